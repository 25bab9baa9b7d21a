/* See ll_world.h. */
#include "ll_world.h"

#include <math.h>

const char *llw_rt_names[] = {"uniform", "skewed", "masked", "empty-rank", "all-masked-on-odd"};
const char *llw_nm_names[] = {"N<=T", "N=T", "N=0-on-odd"};
const char *llw_fmt_names[] = {"bf16", "fp8", "fp8-round", "fp8-ue8m0"};

void llw_cmp(const void *got, const void *want, size_t n, const char *what) {
  if (!n || !memcmp(got, want, n)) return;
  const uint8_t *g = got, *w = want;
  size_t i = 0;
  while (g[i] == w[i]) i++;
  T_FAILF("%s differs from the reference at byte %zu of %zu (got 0x%02x, want 0x%02x)", what, i, n,
          g[i], w[i]);
}

void llw_buffer(ep_group_t g, const llw_cfg_t *c, ep_buffer_t *buf) {
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = c->T, cfg.ll_hidden = c->H, cfg.ll_num_experts = c->E;
  cfg.ll_max_topk = c->K;
  cfg.queue_bytes = 64 << 10; /* normal-mode calls in between stay small */
  T_OK(ep_buffer_create(g, &cfg, buf));
}

/* ------------------------------------------------------------------ inputs */

static int tokens_of(const llw_round_t *rd, int s, t_rng *r) {
  switch (rd->k.nmode) {
    case NM_FULL:
      return rd->c.T;
    case NM_ZERO_SOME:
      return s % 2 ? 0 : 1 + t_below(r, rd->c.T);
    default:
      return t_below(r, rd->c.T + 1);
  }
}

static int64_t pick(const llw_round_t *rd, int s, t_rng *r) {
  int E = rd->c.E, per = E / rd->R;
  switch (rd->k.routing) {
    case RT_SKEW: { /* geometric: most selections on the first experts (rank 0) */
      int e = 0;
      while (e < E - 1 && t_below(r, 100) < 55) e++;
      return e;
    }
    case RT_MASKED:
      return t_below(r, 10) < 3 ? -1 : t_below(r, E);
    case RT_EMPTY_RANK:
      return rd->R > 1 ? t_below(r, E - per) : t_below(r, E);
    case RT_ALLMASK:
      return s % 2 ? -1 : t_below(r, E);
    default:
      return t_below(r, E);
  }
}

/* Distinct experts per token (a low-latency dispatch refuses duplicates); -1 when a skewed
 * routing cannot find a new one. */
static void gen_routing(const llw_round_t *rd, int s, int n, int64_t *idx, t_rng *r) {
  int topk = rd->k.topk;
  for (int t = 0; t < n; t++)
    for (int k = 0; k < topk; k++) {
      int64_t e = -1;
      for (int tries = 0; tries < 50; tries++) {
        e = pick(rd, s, r);
        bool dup = false;
        for (int j = 0; j < k; j++) dup |= e >= 0 && idx[(size_t)t * topk + j] == e;
        if (!dup) break;
        e = -1;
      }
      idx[(size_t)t * topk + k] = e;
    }
}

/* Values spread over many binades per block of 128 (fp8 scales differ), some all-zero blocks
 * (amax floors at 1e-4) and tiny values (e4m3 subnormals). */
static void gen_row(uint16_t *x, int H, t_rng *r) {
  for (int b = 0; b < H; b += 128) {
    int kind = t_below(r, 16), sh = t_below(r, 25) - 12;
    for (int i = b; i < H && i < b + 128; i++) {
      float f = (t_unit(r) - 0.5f) * 8.0f;
      if (kind == 0)
        f = 0.0f;
      else if (kind == 1)
        f = ldexpf(f, -20);
      else
        f = ldexpf(f, sh);
      x[i] = ref_f32_to_bf16(f);
    }
  }
}

void llw_gen(llw_round_t *rd, int R, int me, const llw_cfg_t *c, const llw_case_t *k,
             uint64_t seed) {
  memset(rd, 0, sizeof *rd);
  rd->R = R, rd->me = me, rd->c = *c, rd->k = *k;
  rd->in = t_xmalloc(sizeof *rd->in * (size_t)R);
  rd->x = t_xmalloc(sizeof *rd->x * (size_t)R);
  rd->idx = t_xmalloc(sizeof *rd->idx * (size_t)R);
  rd->w = t_xmalloc(sizeof *rd->w * (size_t)R);
  for (int s = 0; s < R; s++) {
    t_rng r = t_seed(seed, (uint64_t)s);
    int n = tokens_of(rd, s, &r);
    size_t nk = (size_t)n * (size_t)k->topk;
    rd->x[s] = t_xmalloc((size_t)n * (size_t)c->H * 2);
    rd->idx[s] = t_xmalloc(nk * sizeof(int64_t));
    rd->w[s] = t_xmalloc(nk * sizeof(float));
    gen_routing(rd, s, n, rd->idx[s], &r);
    for (int t = 0; t < n; t++) gen_row(rd->x[s] + (size_t)t * c->H, c->H, &r);
    for (size_t i = 0; i < nk; i++) rd->w[s][i] = (t_unit(&r) - 0.25f) * 2.0f;
    rd->in[s] = (ref_rank_input_t){n, rd->x[s], NULL, rd->idx[s], rd->w[s]};
  }
  rd->ref = t_xmalloc(sizeof *rd->ref * (size_t)R);
  int fp8 = k->fmt != F_BF16;
  T_CHECK(ref_ll_dispatch(R, c->T, c->E, c->H, k->topk, rd->in, fp8, k->fmt >= F_FP8_ROUND,
                          k->fmt == F_FP8_UE8M0, rd->ref) == 0,
          "reference ll dispatch");
  llw_upload(rd);
}

void llw_upload(llw_round_t *rd) {
  size_t n = (size_t)rd->in[rd->me].n, nk = n * (size_t)rd->k.topk;
  t_dfree(rd->dx), t_dfree(rd->didx), t_dfree(rd->dw);
  rd->dx = t_to_dev(rd->x[rd->me], n * (size_t)rd->c.H * 2);
  rd->didx = t_to_dev(rd->idx[rd->me], nk * sizeof(int64_t));
  rd->dw = t_to_dev(rd->w[rd->me], nk * sizeof(float));
}

void llw_free(llw_round_t *rd) {
  if (rd->h) T_OK(ep_ll_handle_destroy(rd->h));
  t_dfree(rd->dx), t_dfree(rd->didx), t_dfree(rd->dw);
  for (int s = 0; s < rd->R; s++) {
    free(rd->x[s]), free(rd->idx[s]), free(rd->w[s]);
    ref_ll_free(&rd->ref[s]);
  }
  free(rd->in), free(rd->x), free(rd->idx), free(rd->w), free(rd->ref);
  memset(rd, 0, sizeof *rd);
}

/* ------------------------------------------------------------------ dispatch */

void llw_args(llw_round_t *rd, ep_ll_dispatch_args_t *a) {
  *a = (ep_ll_dispatch_args_t)EP_LL_DISPATCH_ARGS_INIT;
  a->x = rd->dx;
  a->num_tokens = rd->in[rd->me].n;
  a->topk_idx = rd->didx;
  a->topk = rd->k.topk;
  a->use_fp8 = rd->k.fmt != F_BF16;
  a->round_scale = rd->k.fmt >= F_FP8_ROUND;
  a->use_ue8m0 = rd->k.fmt == F_FP8_UE8M0;
  a->two_phase = rd->k.two_phase;
  a->scale_layout = rd->k.cols ? EP_SCALES_COL_MAJOR : EP_SCALES_ROW_MAJOR;
}

void llw_dispatch(llw_round_t *rd, ep_buffer_t buf, llw_between_fn between, void *arg) {
  ep_ll_dispatch_args_t a;
  llw_args(rd, &a);
  T_OK(ep_ll_dispatch(buf, &a, &rd->h));
  if (rd->k.two_phase) {
    /* Before the receive the view already says where the rows will be (not what they are). */
    ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT, after = EP_LL_RECV_VIEW_INIT;
    T_OK(ep_ll_get_recv_view(rd->h, &v));
    if (between) between(arg);
    T_OK(ep_ll_recv(buf, rd->h));
    T_OK(ep_ll_get_recv_view(rd->h, &after));
    T_CHECK(v.recv_x == after.recv_x && v.recv_x_scales == after.recv_x_scales &&
                v.recv_count == after.recv_count && v.recv_src_info == after.recv_src_info &&
                v.recv_layout_range == after.recv_layout_range,
            "the view before the receive names other arrays than after it");
  }
  llw_check_view(rd);
}

/* The view as the host sees it (device memory copied on cuda). */
typedef struct {
  int32_t *count, *src;
  int64_t *range;
  void *x, *sc;
} host_view_t;

static host_view_t host_view(const llw_round_t *rd, const ep_ll_recv_view_t *v) {
  size_t L = (size_t)v->num_local_experts, RT = (size_t)v->max_rows, H = (size_t)rd->c.H;
  size_t NS = H / 128, fp8 = rd->k.fmt != F_BF16, ue8m0 = rd->k.fmt == F_FP8_UE8M0;
  host_view_t h;
  h.count = t_to_host(v->recv_count, L * 4);
  h.range = t_to_host(v->recv_layout_range, L * (size_t)rd->R * 8);
  h.src = t_to_host(v->recv_src_info, L * RT * 4);
  h.x = t_to_host(v->recv_x, L * RT * H * (fp8 ? 1 : 2));
  h.sc = fp8 ? t_to_host(v->recv_x_scales, L * RT * NS * (ue8m0 ? 1 : 4)) : NULL;
  return h;
}

static void free_view(host_view_t *h) {
  free(h->count), free(h->range), free(h->src), free(h->x), free(h->sc);
}

/* Column-major scales (SEMANTICS.md §6.4) against the reference's rows: float [L][NS][RT], or the
 * exponent bytes packed four to an int32 [L][NS/4][RT], block 4j + i in byte i. */
static void check_cols(const llw_round_t *rd, const host_view_t *v, int l, int n) {
  const ref_ll_recv_t *w = &rd->ref[rd->me];
  size_t RT = (size_t)w->RT, NS = (size_t)rd->c.H / 128;
  for (size_t row = 0; row < (size_t)n; row++)
    for (size_t b = 0; b < NS; b++) {
      size_t want_at = ((size_t)l * RT + row) * NS + b;
      if (rd->k.fmt == F_FP8_UE8M0) {
        uint8_t got =
            ((const uint8_t *)v->sc)[(((size_t)l * (NS / 4) + b / 4) * RT + row) * 4 + b % 4];
        T_CHECK(got == w->ue8m0_exp[want_at],
                "column-major ue8m0 byte of expert %d row %zu block "
                "%zu: 0x%02x, reference 0x%02x",
                l, row, b, got, w->ue8m0_exp[want_at]);
      } else {
        float got = ((const float *)v->sc)[((size_t)l * NS + b) * RT + row];
        T_CHECK(!memcmp(&got, &w->scales[want_at], 4),
                "column-major scale of expert %d row %zu "
                "block %zu: %a, reference %a",
                l, row, b, got, w->scales[want_at]);
      }
    }
}

static void check_rows(const llw_round_t *rd, const ep_ll_recv_view_t *v, const host_view_t *h,
                       int l, int n) {
  const ref_ll_recv_t *w = &rd->ref[rd->me];
  size_t RT = (size_t)v->max_rows, H = (size_t)rd->c.H, NS = H / 128, r0 = (size_t)l * RT;
  llw_cmp(h->src + r0, w->src_info + r0, (size_t)n * 4, "recv_src_info");
  if (rd->k.fmt == F_BF16) {
    llw_cmp((const uint16_t *)h->x + r0 * H, w->x + r0 * H, (size_t)n * H * 2, "recv_x bf16");
    return;
  }
  llw_cmp((const uint8_t *)h->x + r0 * H, w->q + r0 * H, (size_t)n * H, "recv_x e4m3");
  if (v->scale_layout == EP_SCALES_COL_MAJOR)
    check_cols(rd, h, l, n);
  else if (rd->k.fmt == F_FP8_UE8M0)
    llw_cmp((const uint8_t *)h->sc + r0 * NS, w->ue8m0_exp + r0 * NS, (size_t)n * NS,
            "recv_x_scales ue8m0 bytes");
  else
    llw_cmp((const float *)h->sc + r0 * NS, w->scales + r0 * NS, (size_t)n * NS * 4,
            "recv_x_scales");
}

void llw_check_view(const llw_round_t *rd) {
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  T_OK(ep_ll_get_recv_view(rd->h, &v));
  const ref_ll_recv_t *w = &rd->ref[rd->me];
  int L = rd->c.E / rd->R, fp8 = rd->k.fmt != F_BF16;
  T_CHECK(v.num_local_experts == L && v.max_rows == rd->R * rd->c.T && v.hidden == rd->c.H,
          "view shape %d x %d x %d", v.num_local_experts, v.max_rows, v.hidden);
  T_CHECK(v.use_fp8 == fp8 && v.use_ue8m0 == (rd->k.fmt == F_FP8_UE8M0) &&
              v.num_scales == (fp8 ? rd->c.H / 128 : 0) && (v.recv_x_scales != NULL) == fp8,
          "view format fields");
  T_CHECK(v.scale_layout == (fp8 && rd->k.cols ? EP_SCALES_COL_MAJOR : EP_SCALES_ROW_MAJOR),
          "view scale_layout %d", v.scale_layout);
  host_view_t h = host_view(rd, &v);
  llw_cmp(h.count, w->count, (size_t)L * 4, "recv_count");
  llw_cmp(h.range, w->layout_range, (size_t)L * rd->R * 8, "recv_layout_range");
  int total = 0, nr = -1;
  for (int l = 0; l < L; l++) check_rows(rd, &v, &h, l, w->count[l]), total += w->count[l];
  T_OK(ep_ll_handle_num_recv_tokens(rd->h, &nr));
  /* -1: not known on the host (CUDA, EP_CUDA_LL_ASYNC=1); recv_count on the device has it */
  T_CHECK(nr == total || (nr == -1 && t_cuda()), "num_recv_tokens %d, reference %d", nr, total);
  free_view(&h);
}

/* ------------------------------------------------------------------ combine */

typedef struct {
  uint16_t **y, **out;
  float **w;    /* weights of the reference: 0 where this combine leaves a slot out */
  int64_t *idx; /* this rank's combine topk_idx */
  ref_rank_input_t *in;
} comb_t;

static void comb_inputs(llw_round_t *rd, comb_t *cb, uint64_t seed) {
  int R = rd->R, H = rd->c.H, RT = R * rd->c.T, L = rd->c.E / R, topk = rd->k.topk;
  cb->y = t_xmalloc(sizeof *cb->y * (size_t)R), cb->out = t_xmalloc(sizeof *cb->out * (size_t)R);
  cb->w = t_xmalloc(sizeof *cb->w * (size_t)R), cb->in = t_xmalloc(sizeof *cb->in * (size_t)R);
  for (int s = 0; s < R; s++) {
    t_rng r = t_seed(seed ^ 0xc0b1ull, (uint64_t)s);
    int n = rd->in[s].n;
    size_t nk = (size_t)n * (size_t)topk;
    cb->y[s] = rd->k.in_place ? NULL : t_xmalloc((size_t)L * RT * H * 2 + 2);
    for (int l = 0; cb->y[s] && l < L; l++)
      for (size_t i = 0; i < (size_t)rd->ref[s].count[l] * H; i++)
        cb->y[s][(size_t)l * RT * H + i] = t_rand_bf16(&r);
    cb->out[s] = t_xmalloc((size_t)n * H * 2 + 2);
    cb->w[s] = t_xmalloc(nk * 4 + 4);
    int64_t *ci = s == rd->me ? (cb->idx = t_xmalloc(nk * 8 + 8)) : NULL;
    for (size_t i = 0; i < nk; i++) { /* leaving a slot out = weight 0 for finite rows */
      bool out = rd->k.cmask && rd->idx[s][i] >= 0 && t_below(&r, 4) == 0;
      cb->w[s][i] = out ? 0.0f : rd->w[s][i];
      if (ci) ci[i] = out ? -1 : rd->idx[s][i];
    }
    cb->in[s] = rd->in[s];
    cb->in[s].topk_weights = cb->w[s];
  }
}

static void comb_free(const llw_round_t *rd, comb_t *cb) {
  for (int s = 0; s < rd->R; s++) free(cb->y[s]), free(cb->out[s]), free(cb->w[s]);
  free(cb->y), free(cb->out), free(cb->w), free(cb->in), free(cb->idx);
}

void llw_combine(llw_round_t *rd, ep_buffer_t buf, uint64_t seed, llw_between_fn between,
                 void *arg) {
  comb_t cb = {0};
  comb_inputs(rd, &cb, seed);
  const uint16_t **y = t_xmalloc(sizeof *y * (size_t)rd->R);
  for (int s = 0; s < rd->R; s++) y[s] = rd->k.in_place ? rd->ref[s].x : cb.y[s];
  T_CHECK(ref_ll_combine(rd->R, rd->c.T, rd->c.E, rd->c.H, rd->k.topk, cb.in, y, 1, cb.out) == 0,
          "reference ll combine");
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  T_OK(ep_ll_get_recv_view(rd->h, &v));
  int n = rd->in[rd->me].n;
  size_t ybytes = (size_t)v.num_local_experts * v.max_rows * rd->c.H * 2;
  size_t nk = (size_t)n * (size_t)rd->k.topk;
  void *got = t_dalloc((size_t)n * rd->c.H * 2 + 2);
  void *dy = rd->k.in_place ? NULL : t_to_dev(cb.y[rd->me], ybytes);
  int64_t *didx = t_to_dev(cb.idx, nk * 8 + 8);
  ep_ll_combine_args_t a = EP_LL_COMBINE_ARGS_INIT;
  a.handle = rd->h, a.y = rd->k.in_place ? v.recv_x : dy;
  if (rd->k.zero_copy) { /* the experts write their outputs straight into the buffer */
    void *zy = NULL;
    T_OK(ep_ll_get_combine_buffer(buf, rd->h, &zy));
    T_CHECK(zy != NULL, "ep_ll_get_combine_buffer gave NULL");
    t_copy_to_dev(zy, cb.y[rd->me], ybytes);
    a.y = zy;
  }
  a.topk_idx = didx, a.topk_weights = rd->dw;
  a.two_phase = rd->k.two_phase, a.out = got;
  T_OK(ep_ll_combine(buf, &a));
  if (rd->k.two_phase) {
    if (between) between(arg);
    T_OK(ep_ll_recv(buf, rd->h));
  }
  uint16_t *host = t_to_host(got, (size_t)n * rd->c.H * 2);
  llw_cmp(host, cb.out[rd->me], (size_t)n * rd->c.H * 2, "combine out");
  free(host), free(y);
  t_dfree(got), t_dfree(dy), t_dfree(didx);
  comb_free(rd, &cb);
}

/* ------------------------------------------------------------------ normal mode in between */

void llw_normal_round(ep_buffer_t buf, int R, int me, uint64_t seed) {
  int H = 128, topk = 2, E = 2 * R;
  llw_round_t rd; /* only its inputs: routing and rows of every rank */
  llw_cfg_t c = {8, H, E, topk};
  llw_case_t k = {.topk = topk, .routing = RT_UNIFORM, .nmode = NM_RANDOM, .fmt = F_BF16};
  llw_gen(&rd, R, me, &c, &k, seed);
  ref_recv_t *rr = t_xmalloc(sizeof *rr * (size_t)R);
  T_CHECK(ref_dispatch(R, E, topk, (size_t)H * 2, 0, 1, rd.in, rr) == 0, "reference dispatch");
  int n = rd.in[me].n, cap = rr[me].nr;
  void *rx = t_dalloc((size_t)cap * H * 2 + 2);
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = rd.dx, a.dtype = EP_DTYPE_BF16, a.num_tokens = n, a.hidden = H;
  a.topk_idx = rd.didx, a.topk = topk, a.num_experts = E;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = rx, o.capacity = cap;
  T_OK(ep_dispatch(buf, &a, &o));
  int nr = o.num_recv_tokens;
  ep_handle_t h = o.handle;
  T_CHECK(nr == cap, "normal dispatch in between: %d rows, reference %d", nr, cap);
  void *hrx = t_to_host(rx, (size_t)nr * H * 2);
  llw_cmp(hrx, rr[me].x, (size_t)nr * H * 2, "normal-mode recv_x in between");
  free(hrx);
  uint16_t **want = t_xmalloc(sizeof *want * (size_t)R), *got = t_dalloc((size_t)n * H * 2 + 2);
  const uint16_t **y = t_xmalloc(sizeof *y * (size_t)R);
  for (int s = 0; s < R; s++)
    want[s] = t_xmalloc((size_t)rd.in[s].n * H * 2 + 2), y[s] = (const uint16_t *)rr[s].x;
  T_CHECK(ref_combine(R, H, topk, rd.in, rr, y, NULL, NULL, NULL, want, NULL) == 0, "ref combine");
  ep_combine_args_t ca = EP_COMBINE_ARGS_INIT;
  ca.handle = h, ca.x = rx, ca.out = got;
  T_OK(ep_combine(buf, &ca));
  uint16_t *hgot = t_to_host(got, (size_t)n * H * 2);
  llw_cmp(hgot, want[me], (size_t)n * H * 2, "normal-mode combine in between");
  free(hgot);
  T_OK(ep_handle_destroy(h));
  for (int s = 0; s < R; s++) free(want[s]), ref_free_recv(&rr[s]);
  free(want), free(y), free(rr);
  t_dfree(got), t_dfree(rx);
  llw_free(&rd);
}
