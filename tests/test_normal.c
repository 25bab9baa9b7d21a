/* Normal mode against the reference (SEMANTICS.md §2-4): layout, dispatch (sync, alloc and
 * worst-case paths, bf16 and fp8), cached dispatch and combine, on random routings, for whatever
 * number of ranks `epcomm launch -n R` gives. Every rank rebuilds all ranks' inputs from a seed,
 * runs the single-process reference for the whole group, and compares its own outputs bit for bit.
 * The same body runs on either backend (EP_BACKEND=cuda: tensors in device memory, moved with the
 * t_d* helpers); the view paths (recv_x == NULL: outputs are views of the buffer) run where the
 * backend has them (cuda), and so does the zero-copy combine of a bf16 view written in place. */
#include "common.h"
#include "ref.h"

enum { RT_UNIFORM, RT_SKEW, RT_MASKED, RT_EMPTY_RANK, RT_DUP };
enum { NM_SMALL, NM_ZERO_SOME, NM_LARGE, NM_HUGE };
enum { P_SYNC, P_WORST, P_ALLOC, P_VIEW, P_WVIEW };
static const char *rt_names[] = {"uniform", "skewed", "masked", "empty-rank", "duplicates"};
static const char *nm_names[] = {"small", "zero-on-some", "large", "huge"};
static const char *p_names[] = {"sync", "worst-case", "alloc", "view", "worst-case view"};

typedef struct {
  int H;
  ep_dtype_t dtype;
  int topk, E; /* E 0: = R; E < 0: -E experts per rank */
  int routing, nmode, path;
  int weights, nbias, align, cached;
  int wide; /* combine inputs of widely different magnitudes: the order of the sum shows */
} tcase_t;

typedef struct {
  int R, me;
  int nhosts, *host_of;  /* hosts of the group (EP_HOSTS, EP_HOST_ID, machines) */
  ep_buffer_t buf;       /* default queues */
  ep_buffer_t small_buf; /* 64 KiB queues: many trips for large N */
} ctx_t;

typedef struct {
  ref_rank_input_t in;
  void *x;
  float *scales;
  int64_t *idx;
  float *w;
} rank_data_t;

static size_t row_bytes(const tcase_t *c) {
  return (size_t)c->H * (c->dtype == EP_DTYPE_BF16 ? 2 : 1);
}
static int num_scales(const tcase_t *c) {
  return c->dtype == EP_DTYPE_BF16 ? 0 : (c->H + 127) / 128;
}

/* This rank's inputs where the backend reads them (device memory on cuda). */
typedef struct {
  void *x;
  float *scales, *w;
  int64_t *idx;
} dev_in_t;

static bool worst(const tcase_t *c) {
  return c->path == P_WORST || c->path == P_WVIEW;
}
static bool view(const tcase_t *c) {
  return c->path == P_VIEW || c->path == P_WVIEW;
}

static void to_dev(const tcase_t *c, const rank_data_t *d, dev_in_t *o) {
  int n = d->in.n;
  o->x = t_to_dev(d->x, (size_t)n * row_bytes(c));
  o->scales = t_to_dev(d->scales, (size_t)n * num_scales(c) * sizeof(float));
  o->idx = t_to_dev(d->idx, (size_t)n * c->topk * sizeof(int64_t));
  o->w = t_to_dev(d->w, (size_t)n * c->topk * sizeof(float));
}

static void free_dev(dev_in_t *o) {
  t_dfree(o->x), t_dfree(o->scales), t_dfree(o->idx), t_dfree(o->w);
}

static int tokens_of(const tcase_t *c, int s, t_rng *r) {
  switch (c->nmode) {
    case NM_ZERO_SOME:
      return s % 2 ? 0 : 1 + t_below(r, 60);
    case NM_LARGE:
      return 150 + t_below(r, 100);
    case NM_HUGE: /* the CUDA plan's tiles: several per rank, and two passes each past 32768 */
      return s == 0 ? 32769 + t_below(r, 2000) : 257 + t_below(r, 1800);
    default:
      return t_below(r, 48) + (s == 0);
  }
}

/* One expert for slot k of a token; -1 for a masked slot. */
static int64_t pick_expert(const tcase_t *c, int R, int E, t_rng *r) {
  int per = E / R;
  switch (c->routing) {
    case RT_SKEW: { /* geometric-ish: most selections on the first experts, i.e. on rank 0 */
      int e = 0;
      while (e < E - 1 && t_below(r, 100) < 70) e++;
      return e % (per * 2 < E ? per * 2 : E);
    }
    case RT_MASKED:
      return t_below(r, 10) < 3 ? -1 : t_below(r, E);
    case RT_EMPTY_RANK:
      return R > 1 ? t_below(r, E - per) : -1; /* never the last rank */
    default:
      return t_below(r, E);
  }
}

static void gen_routing(const tcase_t *c, int R, int E, int n, int64_t *idx, t_rng *r) {
  for (int t = 0; t < n; t++) {
    int64_t *row = idx + (size_t)t * c->topk;
    for (int k = 0; k < c->topk; k++) {
      int64_t e;
      int tries = 0;
      do { /* distinct experts per token, unless the case asks for duplicates */
        e = pick_expert(c, R, E, r);
        bool dup = false;
        for (int j = 0; j < k && c->routing != RT_DUP; j++) dup |= e >= 0 && row[j] == e;
        if (!dup) break;
      } while (++tries < 20);
      row[k] = tries < 20 ? e : -1;
    }
  }
}

static void gen_payload(const tcase_t *c, rank_data_t *d, int n, t_rng *r) {
  size_t rb = row_bytes(c);
  uint8_t *x = d->x;
  for (size_t i = 0; i < (size_t)n * rb; i += 2) {
    uint16_t v = t_rand_bf16(r);
    memcpy(x + i, &v, 2);
  }
  int ns = num_scales(c);
  for (int i = 0; i < n * ns; i++) d->scales[i] = t_unit(r) * 3.0f + 0.01f;
}

static void gen_rank(const tcase_t *c, int R, int E, int s, uint64_t seed, rank_data_t *d) {
  t_rng r = t_seed(seed, (uint64_t)s);
  int n = tokens_of(c, s, &r);
  d->x = t_xmalloc((size_t)n * row_bytes(c));
  d->scales = num_scales(c) ? t_xmalloc((size_t)n * num_scales(c) * sizeof(float)) : NULL;
  d->idx = t_xmalloc((size_t)n * c->topk * sizeof(int64_t));
  d->w = c->weights ? t_xmalloc((size_t)n * c->topk * sizeof(float)) : NULL;
  gen_routing(c, R, E, n, d->idx, &r);
  gen_payload(c, d, n, &r);
  for (int i = 0; d->w && i < n * c->topk; i++) d->w[i] = t_unit(&r);
  d->in = (ref_rank_input_t){n, d->x, d->scales, d->idx, d->w};
}

static void free_rank(rank_data_t *d) {
  free(d->x), free(d->scales), free(d->idx), free(d->w);
}

/* ------------------------------------------------------------------ checks */

static void cmp_bytes(const void *got, const void *want, size_t n, const char *what) {
  if (!n || !memcmp(got, want, n)) return;
  const uint8_t *g = got, *w = want;
  size_t i = 0;
  while (g[i] == w[i]) i++;
  T_FAILF("%s differs from the reference at byte %zu (got 0x%02x, want 0x%02x)", what, i, g[i],
          w[i]);
}

/* The host outputs of the layout (tokens per host, is-token-in-host). */
static void check_layout_hosts(ctx_t *x, const tcase_t *c, int E, const rank_data_t *d,
                               const dev_in_t *dv) {
  int n = d->in.n, H = x->nhosts;
  int32_t *ph = t_dalloc((size_t)H * 4), *wh = t_xmalloc((size_t)H * 4);
  uint8_t *ih = t_dalloc((size_t)n * H + 1), *wih = t_xmalloc((size_t)n * H + 1);
  T_CHECK(ref_layout_hosts(d->idx, n, c->topk, E, x->R, H, x->host_of, wh, wih) == 0,
          "reference host layout failed");
  ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
  l.topk_idx = dv->idx, l.num_tokens = n, l.topk = c->topk, l.num_experts = E;
  l.tokens_per_host = ph, l.is_token_in_host = ih;
  T_OK(ep_get_dispatch_layout(x->buf, &l));
  void *hh = t_to_host(ph, (size_t)H * 4), *hih = t_to_host(ih, (size_t)n * H);
  cmp_bytes(hh, wh, (size_t)H * 4, "tokens_per_host");
  cmp_bytes(hih, wih, (size_t)n * H, "is_token_in_host");
  t_dfree(ph), t_dfree(ih);
  free(wh), free(wih), free(hh), free(hih);
}

static bool all_poison(const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != T_POISON) return false;
  return true;
}

/* A bad id with no_wait: on a device backend the call returns EP_OK and writes nothing; the CPU
 * still checks. Then the same ids made valid go through a waiting call (a sanity check: that
 * the no_wait kernel leaves the host words alone is not observable here without a race). */
static void check_layout_no_wait_bad(ctx_t *x, const tcase_t *c, int E, int n) {
  if (n == 0) return;
  const size_t ni = (size_t)n * c->topk;
  int64_t *bad = t_xmalloc(ni * 8);
  for (size_t i = 0; i < ni; i++) bad[i] = -1;
  bad[ni - 1] = E; /* the last slot, so that a kernel checking late would have written */
  int64_t *dbad = t_to_dev(bad, ni * 8);
  int32_t *pe = t_dalloc((size_t)E * 4);
  ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
  l.topk_idx = dbad, l.num_tokens = n, l.topk = c->topk, l.num_experts = E;
  l.tokens_per_expert = pe, l.no_wait = 1;
  ep_status_t st = ep_get_dispatch_layout(x->buf, &l);
  T_CHECK(st == (t_cuda() ? EP_OK : EP_ERR_OUT_OF_RANGE), "no_wait layout of a bad id: %s (%s)",
          ep_status_name(st), ep_last_error());
  int32_t *he = t_to_host(pe, (size_t)E * 4);
  T_CHECK(all_poison(he, (size_t)E * 4), "no_wait layout of a bad id wrote tokens_per_expert");
  for (size_t i = 0; i < ni; i++) bad[i] = -1; /* now valid: a waiting call must succeed */
  t_copy_to_dev(dbad, bad, ni * 8);
  l.no_wait = 0;
  T_OK(ep_get_dispatch_layout(x->buf, &l));
  t_dfree(dbad), t_dfree(pe);
  free(bad), free(he);
}

static void check_layout(ctx_t *x, const tcase_t *c, int E, const rank_data_t *d,
                         const dev_in_t *dv) {
  int n = d->in.n, R = x->R;
  int32_t *pr = t_dalloc((size_t)R * 4), *pe = t_dalloc((size_t)E * 4);
  int32_t *wr = t_xmalloc((size_t)R * 4), *we = t_xmalloc((size_t)E * 4);
  uint8_t *ir = t_dalloc((size_t)n * R), *wi = t_xmalloc((size_t)n * R);
  T_CHECK(ref_layout(d->idx, n, c->topk, E, R, wr, we, wi) == 0, "reference layout failed");
  ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
  l.topk_idx = dv->idx, l.num_tokens = n, l.topk = c->topk, l.num_experts = E;
  l.tokens_per_rank = pr, l.tokens_per_expert = pe, l.is_token_in_rank = ir;
  l.no_wait = (c->topk + n) % 2; /* both forms against the reference (the copies below wait) */
  T_OK(ep_get_dispatch_layout(x->buf, &l));
  void *hr = t_to_host(pr, (size_t)R * 4), *he = t_to_host(pe, (size_t)E * 4);
  void *hi = t_to_host(ir, (size_t)n * R);
  cmp_bytes(hr, wr, (size_t)R * 4, "tokens_per_rank");
  cmp_bytes(he, we, (size_t)E * 4, "tokens_per_expert");
  cmp_bytes(hi, wi, (size_t)n * R, "is_token_in_rank");
  t_dfree(pr), t_dfree(pe), t_dfree(ir);
  free(wr), free(we), free(wi), free(hr), free(he), free(hi);
  check_layout_hosts(x, c, E, d, dv);
  check_layout_no_wait_bad(x, c, E, n);
}

typedef struct {
  void *blocks[5];
} alloc_ctx_t;

static int alloc_outputs(void *ctx, const ep_dispatch_args_t *a, int nr, ep_dispatch_out_t *o) {
  alloc_ctx_t *ac = ctx;
  size_t rows = (size_t)nr + 1;
  ac->blocks[0] = o->recv_x =
      t_dalloc(rows * (size_t)a->hidden * (a->dtype == EP_DTYPE_BF16 ? 2 : 1));
  if (a->dtype != EP_DTYPE_BF16)
    ac->blocks[1] = o->recv_x_scales = t_dalloc(rows * (size_t)a->num_scales * 4);
  ac->blocks[2] = o->recv_topk_idx = t_dalloc(rows * (size_t)a->topk * 8);
  if (a->topk_weights) ac->blocks[3] = o->recv_topk_weights = t_dalloc(rows * (size_t)a->topk * 4);
  ac->blocks[4] = o->recv_src_idx = t_dalloc(rows * 4);
  return 0;
}

/* Outputs of one dispatch: host copies for the checks, and where they live for combine. */
typedef struct {
  void *x;
  float *scales, *w;
  int64_t *idx;
  int32_t *src, *prefix, *per_expert;
  int nr;
  ep_handle_t h;
  alloc_ctx_t ac;
  void *dev[7];    /* what this test allocated on the device (freed at the end) */
  int32_t *pinned; /* recv_tokens_per_expert of a synchronous dispatch: page-locked host memory */
  void *dev_x;     /* recv_x as the backend returned it (a view on the view paths) */
  float *dev_w;    /* recv_topk_weights likewise (combine's topk_weights) */
} got_t;

static void fetch_outputs(ctx_t *x, const tcase_t *c, int E, int rows, const ep_dispatch_out_t *a,
                          got_t *g) {
  int R = x->R, ns = num_scales(c);
  t_dsync();
  g->prefix = t_to_host(g->dev[5], (size_t)R * R * 4);
  if (!g->per_expert) g->per_expert = t_to_host(g->dev[6], (size_t)(E / R) * 4);
  g->dev_x = a->recv_x, g->dev_w = a->recv_topk_weights;
  g->x = t_to_host(a->recv_x, (size_t)rows * row_bytes(c));
  g->scales = ns ? t_to_host(a->recv_x_scales, (size_t)rows * ns * 4) : NULL;
  g->idx = t_to_host(a->recv_topk_idx, (size_t)rows * c->topk * 8);
  g->w = c->weights ? t_to_host(a->recv_topk_weights, (size_t)rows * c->topk * 4) : NULL;
  g->src = t_to_host(a->recv_src_idx, (size_t)rows * 4);
}

static void run_dispatch(ctx_t *x, const tcase_t *c, int E, const rank_data_t *d,
                         const dev_in_t *dv, int rows, got_t *g, ep_buffer_t buf) {
  int R = x->R, ns = num_scales(c);
  memset(g, 0, sizeof *g);
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = dv->x, a.dtype = c->dtype, a.num_tokens = d->in.n, a.hidden = c->H;
  a.x_scales = dv->scales, a.num_scales = ns;
  a.topk_idx = dv->idx, a.topk_weights = dv->w, a.topk = c->topk, a.num_experts = E;
  a.expert_alignment = c->align;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.rank_prefix = g->dev[5] = t_dalloc((size_t)R * R * 4);
  /* A synchronous dispatch has written its per-expert counts when it returns, also into host
   * memory the device writes (page-locked): they are read below before any synchronisation. */
  const size_t pe_bytes = (size_t)(E / R) * 4;
  if (worst(c))
    o.recv_tokens_per_expert = g->dev[6] = t_dalloc(pe_bytes);
  else
    o.recv_tokens_per_expert = g->pinned = t_pinned_alloc(pe_bytes);
  o.num_recv_tokens = -2; /* must be overwritten */
  if (c->path == P_ALLOC) {
    o.mode = EP_OUTPUT_ALLOC, o.alloc = alloc_outputs, o.alloc_ctx = &g->ac;
  } else if (view(c)) {
    o.mode = EP_OUTPUT_VIEWS;
  } else {
    o.mode = EP_OUTPUT_CALLER;
    o.recv_x = g->dev[0] = t_dalloc((size_t)rows * row_bytes(c));
    o.recv_x_scales = g->dev[1] = ns ? t_dalloc((size_t)rows * ns * 4) : NULL;
    o.recv_topk_idx = g->dev[2] = t_dalloc((size_t)rows * c->topk * 8);
    o.recv_topk_weights = g->dev[3] = c->weights ? t_dalloc((size_t)rows * c->topk * 4) : NULL;
    o.recv_src_idx = g->dev[4] = t_dalloc((size_t)rows * 4);
    o.capacity = rows;
  }
  if (worst(c)) o.worst_case = 1, o.capacity = rows;
  enum { WAIT_STEPS = 5 }; /* on_wait: every step in order, at most this many */
  t_steps_t wc = {.want = WAIT_STEPS};
  o.on_wait = t_wait_step, o.on_wait_ctx = &wc;
  T_OK(ep_dispatch(buf, &a, &o));
  /* Only where the host waits for a device: never on CPU, never for a worst-case call (a test
   * that it runs at all: test_cuda onwait). */
  T_CHECK(wc.steps <= (t_cuda() && !worst(c) ? WAIT_STEPS : 0) && !wc.out_of_order,
          "on_wait: %d steps (%d out of order)", wc.steps, wc.out_of_order);
  if (g->pinned) g->per_expert = memcpy(t_xmalloc(pe_bytes), g->pinned, pe_bytes);
  T_CHECK(!view(c) || o.recv_x, "view path: recv_x is still NULL after the dispatch");
  T_CHECK(o.handle, "no handle after a dispatch");
  g->nr = o.num_recv_tokens, g->h = o.handle;
  fetch_outputs(x, c, E, rows, &o, g);
}

static void check_dispatch(ctx_t *x, const tcase_t *c, int E, const ref_recv_t *want,
                           const got_t *g, int rows) {
  int R = x->R, nr = want->nr, ns = num_scales(c);
  cmp_bytes(g->prefix, want->rank_prefix, (size_t)R * R * 4, "rank_prefix");
  bool unknown = worst(c) && t_cuda(); /* no host synchronisation: count not known on return */
  T_CHECK(g->nr == nr || (unknown && g->nr == -1), "num_recv_tokens %d, reference %d", g->nr, nr);
  int hn;
  T_OK(ep_handle_num_recv_tokens(g->h, &hn));
  T_CHECK(hn == g->nr, "handle says %d rows, the call said %d", hn, g->nr);
  cmp_bytes(g->x, want->x, (size_t)nr * row_bytes(c), "recv_x");
  if (ns) cmp_bytes(g->scales, want->scales, (size_t)nr * ns * 4, "recv_x_scales");
  cmp_bytes(g->idx, want->topk_idx, (size_t)nr * c->topk * 8, "recv_topk_idx");
  if (c->weights)
    cmp_bytes(g->w, want->topk_weights, (size_t)nr * c->topk * 4, "recv_topk_weights");
  cmp_bytes(g->src, want->src_idx, (size_t)nr * 4, "recv_src_idx");
  cmp_bytes(g->per_expert, want->tokens_per_expert, (size_t)(E / R) * 4, "recv_tokens_per_expert");
  for (int r = nr; worst(c) && r < rows; r++) {
    for (int k = 0; k < c->topk; k++)
      T_CHECK(g->idx[(size_t)r * c->topk + k] == -1, "worst-case row %d (past %d) has topk id %lld",
              r, nr, (long long)g->idx[(size_t)r * c->topk + k]);
    T_CHECK(g->src[r] == -1, "worst-case row %d (past %d) has source %d", r, nr, g->src[r]);
  }
}

static void free_got(got_t *g) {
  free(g->x), free(g->scales), free(g->idx), free(g->w), free(g->src);
  free(g->prefix), free(g->per_expert);
  for (int i = 0; i < 7; i++) t_dfree(g->dev[i]);
  t_pinned_free(g->pinned);
  for (int i = 0; i < 5; i++) t_dfree(g->ac.blocks[i]);
  if (g->h) T_OK(ep_handle_destroy(g->h));
}

/* Cached dispatch of fresh payloads along the handle: same rows as the reference dispatch of the
 * fresh payloads with the original routing. */
static void check_cached(ctx_t *x, const tcase_t *c, int E, rank_data_t *all, uint64_t seed,
                         const got_t *g, int rows, ep_buffer_t buf) {
  int R = x->R, me = x->me, ns = num_scales(c);
  ref_rank_input_t *in = t_xmalloc((size_t)R * sizeof *in);
  for (int s = 0; s < R; s++) {
    t_rng r = t_seed(seed ^ 0xc0ffee, (uint64_t)s);
    gen_payload(c, &all[s], all[s].in.n, &r);
    in[s] = all[s].in;
  }
  ref_recv_t *want = calloc((size_t)R, sizeof *want);
  T_CHECK(ref_dispatch(R, E, c->topk, row_bytes(c), ns, c->align, in, want) == 0, "reference");
  dev_in_t dv;
  to_dev(c, &all[me], &dv);
  void *rx = view(c) ? NULL : t_dalloc((size_t)rows * row_bytes(c));
  float *rs = ns && !view(c) ? t_dalloc((size_t)rows * ns * 4) : NULL;
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = dv.x, a.dtype = c->dtype, a.num_tokens = all[me].in.n, a.hidden = c->H;
  a.x_scales = dv.scales, a.num_scales = ns, a.cached = g->h;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = view(c) ? EP_OUTPUT_VIEWS : EP_OUTPUT_CALLER;
  o.recv_x = rx, o.recv_x_scales = rs, o.capacity = rows, o.worst_case = worst(c);
  o.handle = (ep_handle_t)(uintptr_t)1; /* a cached dispatch leaves no handle: set to NULL */
  T_OK(ep_dispatch(buf, &a, &o));
  T_CHECK(!o.handle, "a cached dispatch returned a handle");
  int nr = o.num_recv_tokens;
  T_CHECK(nr == want[me].nr || (nr == -1 && g->nr == -1), "cached dispatch: %d rows, reference %d",
          nr, want[me].nr);
  nr = want[me].nr;
  void *hx = t_to_host(o.recv_x, (size_t)nr * row_bytes(c));
  float *hs = ns ? t_to_host(o.recv_x_scales, (size_t)nr * ns * 4) : NULL;
  cmp_bytes(hx, want[me].x, (size_t)nr * row_bytes(c), "cached recv_x");
  if (ns) cmp_bytes(hs, want[me].scales, (size_t)nr * ns * 4, "cached recv_x_scales");
  free(hx), free(hs), free_dev(&dv);
  for (int s = 0; s < R; s++) ref_free_recv(&want[s]);
  free(want), free(in), t_dfree(rx), t_dfree(rs);
}

/* A bf16 value of either sign with an exponent anywhere in 2^-24 .. 2^24: sums of such values
 * round differently in different orders, so the order of the reduction is checked too. */
static uint16_t wide_bf16(t_rng *r) {
  uint16_t e = (uint16_t)(127 - 24 + t_below(r, 49)), m = (uint16_t)t_below(r, 128);
  return (uint16_t)((t_below(r, 2) << 15) | (e << 7) | m);
}

/* Combine: every rank's expert output is random; the reference reduces for the whole group. */
static void check_combine(ctx_t *x, const tcase_t *c, rank_data_t *all, ref_recv_t *rr,
                          uint64_t seed, const got_t *g, ep_buffer_t buf) {
  int R = x->R, me = x->me, H = c->H;
  uint16_t **y = t_xmalloc((size_t)R * sizeof *y), **b0 = t_xmalloc((size_t)R * sizeof *b0);
  uint16_t **b1 = t_xmalloc((size_t)R * sizeof *b1), **out = t_xmalloc((size_t)R * sizeof *out);
  float **ow = t_xmalloc((size_t)R * sizeof *ow);
  const float **w = t_xmalloc((size_t)R * sizeof *w);
  ref_rank_input_t *in = t_xmalloc((size_t)R * sizeof *in);
  for (int s = 0; s < R; s++) {
    t_rng r = t_seed(seed ^ 0xb1a5, (uint64_t)s);
    int n = all[s].in.n, rows = rr[s].nr;
    y[s] = t_xmalloc((size_t)rows * H * 2 + 2);
    for (size_t i = 0; i < (size_t)rows * H; i++)
      y[s][i] = c->wide ? wide_bf16(&r) : t_rand_bf16(&r);
    b0[s] = c->nbias > 0 ? t_xmalloc((size_t)n * H * 2 + 2) : NULL;
    b1[s] = c->nbias > 1 ? t_xmalloc((size_t)n * H * 2 + 2) : NULL;
    for (size_t i = 0; b0[s] && i < (size_t)n * H; i++)
      b0[s][i] = c->wide ? wide_bf16(&r) : t_rand_bf16(&r);
    for (size_t i = 0; b1[s] && i < (size_t)n * H; i++)
      b1[s][i] = c->wide ? wide_bf16(&r) : t_rand_bf16(&r);
    out[s] = t_xmalloc((size_t)n * H * 2 + 2);
    ow[s] = t_xmalloc((size_t)n * c->topk * 4 + 4);
    w[s] = rr[s].topk_weights;
    in[s] = all[s].in;
  }
  T_CHECK(ref_combine_hosts(R, x->nhosts, x->host_of, H, c->topk, in, rr,
                            (const uint16_t *const *)y, c->weights ? w : NULL,
                            (const uint16_t *const *)b0, (const uint16_t *const *)b1, out, ow) == 0,
          "reference combine failed");
  int n = all[me].in.n, rows = rr[me].nr;
  uint16_t *dout = t_dalloc((size_t)n * H * 2 + 2);
  float *dw = c->weights ? t_dalloc((size_t)n * c->topk * 4 + 4) : NULL;
  /* On the view paths the expert output overwrites the bf16 view in place (zero-copy combine). */
  void *dy = view(c) ? g->dev_x : t_to_dev(y[me], (size_t)rows * H * 2 + 2);
  if (view(c)) t_copy_to_dev(dy, y[me], (size_t)rows * H * 2);
  void *d0 = t_to_dev(b0[me], (size_t)n * H * 2 + 2), *d1 = t_to_dev(b1[me], (size_t)n * H * 2 + 2);
  ep_combine_args_t a = {.size = sizeof a};
  a.handle = g->h, a.x = dy, a.topk_weights = c->weights ? g->dev_w : NULL;
  a.bias[0] = d0, a.bias[1] = d1, a.out = dout, a.out_topk_weights = dw;
  T_OK(ep_combine(buf, &a));
  uint16_t *got = t_to_host(dout, (size_t)n * H * 2);
  float *gw = dw ? t_to_host(dw, (size_t)n * c->topk * 4) : NULL;
  cmp_bytes(got, out[me], (size_t)n * H * 2, "combine out");
  if (gw) cmp_bytes(gw, ow[me], (size_t)n * c->topk * 4, "combine out_topk_weights");
  if (!view(c)) t_dfree(dy);
  t_dfree(dout), t_dfree(dw), t_dfree(d0), t_dfree(d1);
  for (int s = 0; s < R; s++) free(y[s]), free(b0[s]), free(b1[s]), free(out[s]), free(ow[s]);
  free(y), free(b0), free(b1), free(out), free(ow), free(w), free(in), free(got), free(gw);
}

static bool has_views(ctx_t *x) {
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(x->buf, &i));
  T_CHECK(i.dispatch_view_lifetime ==
              ((i.caps & EP_CAP_DISPATCH_VIEWS) ? EP_LIFETIME_NEXT_DISPATCH : EP_LIFETIME_NONE),
          "view lifetime %d does not match the capability", (int)i.dispatch_view_lifetime);
  return (i.caps & EP_CAP_DISPATCH_VIEWS) != 0;
}

static void run_case(ctx_t *x, const tcase_t *c, int idx) {
  int R = x->R, me = x->me, E = c->E > 0 ? c->E : c->E < 0 ? -c->E * R : R, ns = num_scales(c);
  if (E % R || (view(c) && !has_views(x))) return;
  /* Across hosts the CUDA backend holds every received row at once (no trips, below): more rows
   * than its area here, and its plan is not the one-host notify's that these cases are for. */
  if (c->nmode == NM_HUGE && t_cuda() && x->nhosts > 1) return;
  static char desc[200];
  snprintf(desc, sizeof desc, "case %d: H=%d %s topk=%d E=%d %s N=%s %s%s%s bias=%d align=%d", idx,
           c->H, c->dtype == EP_DTYPE_BF16 ? "bf16" : "fp8", c->topk, E, rt_names[c->routing],
           nm_names[c->nmode], p_names[c->path], c->weights ? " weights" : "",
           c->cached ? " cached" : "", c->nbias, c->align);
  t_case = desc;
  uint64_t seed = 0x5eed0000ull + (uint64_t)idx * 7919 + (uint64_t)R;
  rank_data_t *all = calloc((size_t)R, sizeof *all);
  ref_rank_input_t *in = calloc((size_t)R, sizeof *in);
  int total = 0;
  for (int s = 0; s < R; s++)
    gen_rank(c, R, E, s, seed, &all[s]), in[s] = all[s].in, total += in[s].n;
  ref_recv_t *rr = calloc((size_t)R, sizeof *rr);
  T_CHECK(ref_dispatch(R, E, c->topk, row_bytes(c), ns, c->align, in, rr) == 0,
          "reference dispatch");
  /* Views need every row at once: they use the default buffer. */
  /* Across hosts the CUDA backend holds every received row in its area at once (no trips). */
  bool trips = !(t_cuda() && x->nhosts > 1);
  ep_buffer_t buf = c->nmode == NM_LARGE && !view(c) && trips ? x->small_buf : x->buf;
  dev_in_t dv;
  to_dev(c, &all[me], &dv);
  check_layout(x, c, E, &all[me], &dv);
  int rows = worst(c) ? total + 3 : rr[me].nr;
  got_t g;
  run_dispatch(x, c, E, &all[me], &dv, rows, &g, buf);
  free_dev(&dv);
  check_dispatch(x, c, E, &rr[me], &g, rows);
  if (c->dtype == EP_DTYPE_BF16) check_combine(x, c, all, rr, seed, &g, buf);
  if (c->cached) check_cached(x, c, E, all, seed, &g, rows, buf);
  free_got(&g);
  for (int s = 0; s < R; s++) ref_free_recv(&rr[s]), free_rank(&all[s]);
  free(rr), free(all), free(in);
}

/* H, dtype, topk, E, routing, N, path, weights, biases, alignment, cached */
static const tcase_t cases[] = {
    {8, EP_DTYPE_BF16, 1, 0, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 0, 0, 0, 0},       /* 16-byte rows */
    {16, EP_DTYPE_FP8_E4M3, 2, 64, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 0, 0, 1, 0}, /* 16-byte fp8 */
    {128, EP_DTYPE_BF16, 8, 64, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 1, 4, 1, 0},
    {128, EP_DTYPE_BF16, 9, 288, RT_MASKED, NM_SMALL, P_WORST, 1, 2, 1, 1, 0},
    {256, EP_DTYPE_FP8_E4M3, 8, 256, RT_SKEW, NM_SMALL, P_SYNC, 1, 0, 8, 1, 0},
    {256, EP_DTYPE_BF16, 8, 256, RT_SKEW, NM_ZERO_SOME, P_ALLOC, 1, 2, 0, 0, 0},
    {512, EP_DTYPE_FP8_E4M3, 9, 288, RT_EMPTY_RANK, NM_SMALL, P_WORST, 1, 0, 0, 1, 0},
    {64, EP_DTYPE_BF16, 2, 0, RT_EMPTY_RANK, NM_ZERO_SOME, P_SYNC, 0, 1, 0, 1, 0},
    {64, EP_DTYPE_BF16, 8, 64, RT_DUP, NM_SMALL, P_SYNC, 1, 0, 2, 0, 0},
    {1024, EP_DTYPE_BF16, 8, 256, RT_UNIFORM, NM_LARGE, P_SYNC, 1, 1, 0, 1, 0}, /* many trips */
    {2048, EP_DTYPE_FP8_E4M3, 8, 64, RT_UNIFORM, NM_LARGE, P_WORST, 0, 0, 0, 1, 0},
    {7168, EP_DTYPE_BF16, 8, 256, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 2, 0, 1, 0},
    {7168, EP_DTYPE_FP8_E4M3, 8, 288, RT_MASKED, NM_SMALL, P_SYNC, 1, 0, 0, 1, 0},
    {7168, EP_DTYPE_BF16, 1, 0, RT_SKEW, NM_ZERO_SOME, P_WORST, 1, 0, 0, 0, 0},
    /* 65 fp8 scales a row: past what the CUDA dispatch loads once per token (EPK_DMETA) */
    {8320, EP_DTYPE_FP8_E4M3, 8, 256, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 0, 0, 1, 0},
    {96, EP_DTYPE_BF16, 9, 0, RT_MASKED, NM_SMALL, P_ALLOC, 1, 1, 3, 0, 0},
    {64, EP_DTYPE_BF16, 32, -1024, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 1, 0, 1, 0}, /* no whitelists */
    {8, EP_DTYPE_BF16, 33, -1024, RT_MASKED, NM_SMALL, P_WORST, 1, 2, 0, 1, 0},
    {128, EP_DTYPE_BF16, 8, 64, RT_UNIFORM, NM_SMALL, P_VIEW, 1, 1, 0, 1, 0}, /* views */
    {256, EP_DTYPE_FP8_E4M3, 8, 256, RT_SKEW, NM_SMALL, P_VIEW, 1, 0, 2, 1, 0},
    {7168, EP_DTYPE_BF16, 8, 256, RT_UNIFORM, NM_SMALL, P_VIEW, 1, 2, 0, 0, 0},
    {1024, EP_DTYPE_BF16, 8, 256, RT_UNIFORM, NM_LARGE, P_VIEW, 0, 0, 0, 1, 0},
    {512, EP_DTYPE_FP8_E4M3, 9, 288, RT_EMPTY_RANK, NM_SMALL, P_WVIEW, 1, 0, 0, 1, 0},
    {256, EP_DTYPE_BF16, 8, 256, RT_MASKED, NM_ZERO_SOME, P_WVIEW, 1, 1, 0, 1, 0},
    /* wide magnitudes: the reduction order (§4.2, §4.6) decides the bits */
    {128, EP_DTYPE_BF16, 8, 64, RT_UNIFORM, NM_SMALL, P_SYNC, 1, 2, 0, 0, 1},
    {64, EP_DTYPE_BF16, 9, 0, RT_MASKED, NM_ZERO_SOME, P_ALLOC, 1, 0, 0, 0, 1},
    {512, EP_DTYPE_BF16, 8, 256, RT_SKEW, NM_LARGE, P_SYNC, 1, 1, 0, 0, 1},
    /* many tokens, small rows: the count exchange's plan over many tiles */
    {8, EP_DTYPE_BF16, 4, 64, RT_MASKED, NM_HUGE, P_SYNC, 1, 0, 0, 1, 0},
    {16, EP_DTYPE_FP8_E4M3, 8, 256, RT_SKEW, NM_HUGE, P_ALLOC, 0, 0, 2, 0, 0},
    /* the allocator path with many trips (EP_CUDA_EARLY_DATA: the rows do not fit at once) */
    {1024, EP_DTYPE_BF16, 8, 256, RT_SKEW, NM_LARGE, P_ALLOC, 1, 1, 0, 1, 0},
};

/* A fast path's switch against the calls that took it: some with the switch on (on one host;
 * across hosts the network engine moves the rows), none with it off, so that a silent fall back
 * (or the path taken where it must not be) fails here. */
static void check_path(const ctx_t *x, uint64_t took, bool on, const char *what) {
  const bool want = on && x->nhosts == 1;
  T_CHECK(want ? took > 0 : took == 0, "%llu %s, expected %s", (unsigned long long)took, what,
          want ? "some" : "none");
}

/* EP_CUDA_EARLY_DATA=1: the allocator cases took the two-kernel path, on either buffer.
 * EP_CUDA_PULL: the cases into caller arrays that fit the large buffer at once pulled their rows.
 * EP_CUDA_COMBINE_COPY: the large buffer's combines of a separate tensor copied it into the
 * combine buffer. */
static void check_paths(const ctx_t *x) {
  ep_buffer_info_t big = EP_BUFFER_INFO_INIT, small = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(x->buf, &big));
  T_OK(ep_buffer_query(x->small_buf, &small));
  check_path(x, big.dispatches_early + small.dispatches_early, t_early_data(),
             "dispatches with early data");
  check_path(x, big.dispatches_pulled, t_pull(), "dispatches pulled their rows");
  check_path(x, big.combines_copied, t_combine_copy(),
             "combines copied their x into the combine buffer");
}

int main(int argc, char **argv) {
  ep_group_t g;
  ctx_t x;
  t_require_backend();
  t_init(&g, &x.me, &x.R);
  int repeat = argc > 1 ? atoi(argv[1]) : 1;
  t_hosts(g, &x.nhosts, &x.host_of);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  T_OK(ep_buffer_create(g, &cfg, &x.buf));
  cfg.queue_bytes = 64 << 10;
  T_OK(ep_buffer_create(g, &cfg, &x.small_buf));
  int ran = 0;
  for (int rep = 0; rep < repeat; rep++) /* repeated calls on the same buffers */
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++, ran++)
      run_case(&x, &cases[i], i + rep * 100);
  t_case = NULL;
  check_paths(&x);
  T_OK(ep_buffer_destroy(x.small_buf));
  T_OK(ep_buffer_destroy(x.buf));
  t_fini(g);
  free(x.host_of);
  if (x.me == 0) printf("test_normal: R=%d on %d host(s), %d cases passed\n", x.R, x.nhosts, ran);
  return T_PASS;
}
