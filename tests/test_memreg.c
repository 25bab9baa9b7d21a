/* Registered caller memory (ep_register_memory, docs/SEMANTICS.md §4.7) on the backend EP_BACKEND
 * names: cpu (the range is recorded; combine reads any x where it is, as always) or cuda (the
 * peers read an x inside a registration in place; skipped with a reason without a GPU).
 *   test_memreg combine N  N rounds of random routing: dispatch, then a combine whose x lies in a
 *                          registered tensor (two registrations in one allocation, x at an
 *                          interior offset of the second), with and without weights and a bias;
 *                          then x in a separate unregistered tensor, and x in the range after its
 *                          deregistration (the staging path): every output checked against the
 *                          reference, bit for bit
 *   test_memreg dispatch N N rounds of random routing (bf16 and fp8, with and without weights,
 *                          ranks without tokens, ranks nobody sends to, no tokens anywhere):
 *                          an EP_OUTPUT_CALLER dispatch whose recv_x is, on some ranks, inside a
 *                          registration (cuda: the senders write x rows there) and on the others
 *                          a plain tensor, then a cached dispatch with new rows and the choices
 *                          swapped; on some ranks in some rounds the same arrays come from an
 *                          EP_OUTPUT_ALLOC callback (cuda: the late hello says where recv_x is);
 *                          every output against the reference, bit for bit. Then rank 0
 *                          with too small a capacity (EP_ERR_TOO_LARGE, its registered recv_x
 *                          untouched) and a round after it; then all again with a receive area
 *                          small enough that dispatches go in windows
 *   test_memreg misuse     NULL and size-0 arguments, a rank rejecting alone, too many
 *                          registrations, stale and foreign handles, ranks deregistering in
 *                          different orders (EP_ERR_MISMATCH on every rank, buffer usable after);
 *                          cuda: host memory, a range past its allocation, cudaMallocAsync memory
 *   test_memreg cycles N   N x (register, combine, deregister); cuda: device memory flat */
#include "common.h"
#include "ref.h"

enum { H = 256, TOPK = 4, NMAX = 40, PAD = 24 /* rows before x in the registered tensor */ };

typedef struct {
  int R, me, E;
  ep_group_t g;
  ep_buffer_t b;
} ctx_t;

typedef struct {
  int n[64];
  uint16_t *x[64], *y[64], *bias[64];
  int64_t *idx[64];
  float *w[64];
} data_t;

static void make_data(const ctx_t *c, int round, data_t *d) {
  for (int s = 0; s < c->R; s++) {
    t_rng r = t_seed(0x3e6 + (uint64_t)round, (uint64_t)s);
    int n = d->n[s] = t_below(&r, NMAX + 1);
    d->x[s] = t_xmalloc((size_t)NMAX * H * 2);
    d->y[s] = t_xmalloc((size_t)c->R * NMAX * H * 2);
    d->bias[s] = t_xmalloc((size_t)NMAX * H * 2);
    d->idx[s] = t_xmalloc((size_t)NMAX * TOPK * 8);
    d->w[s] = t_xmalloc((size_t)NMAX * TOPK * 4);
    for (int i = 0; i < n * H; i++) d->x[s][i] = t_rand_bf16(&r), d->bias[s][i] = t_rand_bf16(&r);
    for (int i = 0; i < c->R * NMAX * H; i++) d->y[s][i] = t_rand_bf16(&r);
    for (int t = 0; t < n; t++)
      for (int k = 0; k < TOPK; k++) { /* distinct experts per token, some slots unused */
        int64_t e = t_below(&r, 10) < 2 ? -1 : t_below(&r, c->E);
        for (int j = 0; j < k && e >= 0; j++)
          if (d->idx[s][t * TOPK + j] == e) e = -1;
        d->idx[s][t * TOPK + k] = e;
        d->w[s][t * TOPK + k] = t_unit(&r);
      }
  }
}

static void free_data(const ctx_t *c, data_t *d) {
  for (int s = 0; s < c->R; s++)
    free(d->x[s]), free(d->y[s]), free(d->bias[s]), free(d->idx[s]), free(d->w[s]);
}

/* The buffer's counts of normal-mode calls that skipped the staging pass (ep_buffer_info_t). */
static void in_place(const ctx_t *c, uint64_t *combines, uint64_t *dispatches) {
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(c->b, &i));
  *combines = i.combines_in_place, *dispatches = i.dispatches_in_place;
}

/* One dispatch of round `round`'s data, then a combine whose x is `x_at` (this rank's expert
 * outputs written there first), checked against the reference. want_direct: whether the CUDA
 * backend must read x where it lies (1), stage it (0), or either (-1); the results are the same
 * bits either way, so only the buffer's count can tell a silent fallback. */
static void round_at(const ctx_t *c, int round, void *x_at, int want_direct, const char *what) {
  const int R = c->R, me = c->me, with_w = round & 1, with_bias = (round >> 1) & 1;
  data_t d;
  make_data(c, round, &d);
  void *x = t_to_dev(d.x[me], (size_t)NMAX * H * 2), *idx = t_to_dev(d.idx[me], NMAX * TOPK * 8);
  void *w = t_to_dev(d.w[me], NMAX * TOPK * 4), *b0 = t_to_dev(d.bias[me], NMAX * H * 2);
  void *rx = t_dalloc((size_t)R * NMAX * H * 2), *rw = t_dalloc((size_t)R * NMAX * TOPK * 4);
  void *out = t_dalloc(NMAX * H * 2), *outw = t_dalloc(NMAX * TOPK * 4);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = d.n[me],
                          .hidden = H,
                          .topk_idx = idx,
                          .topk_weights = w,
                          .topk = TOPK,
                          .num_experts = c->E};
  ep_dispatch_out_t o = {.size = sizeof o,
                         .mode = EP_OUTPUT_CALLER,
                         .capacity = R * NMAX,
                         .recv_x = rx,
                         .recv_topk_weights = rw};
  T_OK(ep_dispatch(c->b, &a, &o));
  const int nr = o.num_recv_tokens;
  if (nr) t_copy_to_dev(x_at, d.y[me], (size_t)nr * H * 2);
  ep_combine_args_t cb = {.size = sizeof cb,
                          .handle = o.handle,
                          .x = x_at,
                          .topk_weights = with_w ? rw : NULL,
                          .bias = {with_bias ? b0 : NULL, NULL},
                          .out = out,
                          .out_topk_weights = with_w ? outw : NULL};
  uint64_t c0, c1, dd;
  in_place(c, &c0, &dd);
  T_OK(ep_combine(c->b, &cb));
  in_place(c, &c1, &dd);
  T_CHECK(t_cuda() ? want_direct < 0 || c1 - c0 == (uint64_t)want_direct : c1 == c0,
          "%s, round %d: combines read in place went from %llu to %llu (want %s)", what, round,
          (unsigned long long)c0, (unsigned long long)c1,
          !t_cuda()     ? "no change on this backend"
          : want_direct ? "one more"
                        : "no change");
  ref_rank_input_t ri[64];
  for (int s = 0; s < R; s++) ri[s] = (ref_rank_input_t){d.n[s], d.x[s], NULL, d.idx[s], d.w[s]};
  ref_recv_t rr[64];
  memset(rr, 0, sizeof rr);
  T_CHECK(ref_dispatch(R, c->E, TOPK, H * 2, 0, 1, ri, rr) == 0, "reference dispatch");
  T_CHECK(rr[me].nr == nr, "%s, round %d: %d rows, the reference has %d", what, round, nr,
          rr[me].nr);
  uint16_t *ro[64];
  float *row[64];
  const float *wv[64];
  const uint16_t *bv[64];
  for (int s = 0; s < R; s++) {
    ro[s] = t_xmalloc((size_t)NMAX * H * 2), row[s] = t_xmalloc(NMAX * TOPK * 4);
    wv[s] = rr[s].topk_weights, bv[s] = d.bias[s];
  }
  T_CHECK(ref_combine(R, H, TOPK, ri, rr, (const uint16_t *const *)d.y, with_w ? wv : NULL,
                      with_bias ? bv : NULL, NULL, ro, with_w ? row : NULL) == 0,
          "reference combine");
  uint16_t *got = t_to_host(out, (size_t)NMAX * H * 2);
  T_CHECK(!memcmp(got, ro[me], (size_t)d.n[me] * H * 2),
          "%s, round %d%s%s: combine out differs from the reference", what, round,
          with_w ? ", weights" : "", with_bias ? ", bias" : "");
  if (with_w) {
    float *gw = t_to_host(outw, (size_t)NMAX * TOPK * 4);
    T_CHECK(!memcmp(gw, row[me], (size_t)d.n[me] * TOPK * 4), "%s, round %d: out weights", what,
            round);
    free(gw);
  }
  for (int s = 0; s < R; s++) free(ro[s]), free(row[s]), ref_free_recv(&rr[s]);
  free(got);
  T_OK(ep_handle_destroy(o.handle));
  void *all[] = {x, idx, w, b0, rx, rw, out, outw};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) t_dfree(all[i]);
  free_data(c, &d);
}

static void ctx_init_q(ctx_t *c, size_t queue_bytes, int channels) {
  t_init(&c->g, &c->me, &c->R);
  c->E = 2 * c->R;
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.queue_bytes = queue_bytes;
  cfg.num_channels = channels;
  T_OK(ep_buffer_create(c->g, &cfg, &c->b));
}

static void ctx_init(ctx_t *c) {
  ctx_init_q(c, 0, 0);
}

static void ctx_fini(ctx_t *c) {
  T_OK(ep_buffer_destroy(c->b));
  t_fini(c->g);
}

static size_t tensor_bytes(const ctx_t *c) {
  return (size_t)(PAD + c->R * NMAX) * H * 2;
}

static int combine(int rounds) {
  ctx_t c;
  ctx_init(&c);
  /* One allocation, two registrations: [0, half) and [PAD / 2 rows, end); x at PAD rows lies in
   * the second, and in the first too when its rows end before half (on cuda the peers map the
   * allocation once, for both). */
  const size_t bytes = tensor_bytes(&c), rowb = (size_t)H * 2;
  uint8_t *y = t_dalloc(bytes);
  void *sep = t_dalloc((size_t)c.R * NMAX * rowb);
  ep_mem_t first, second;
  T_OK(ep_register_memory(c.b, y, bytes / 2, &first));
  T_OK(ep_register_memory(c.b, y + PAD / 2 * rowb, bytes - PAD / 2 * rowb, &second));
  for (int round = 0; round < rounds; round++) {
    round_at(&c, round, y + PAD * rowb, 1, "x registered");
    round_at(&c, 1000 + round, sep, 0, "x separate");
  }
  T_OK(ep_deregister_memory(c.b, second));
  /* x may still lie inside the first registration (its rows up to half the tensor): either */
  round_at(&c, 2000, y + PAD * rowb, -1, "x in a deregistered range");
  round_at(&c, 2001, y, -1, "x at the start of the first registration");
  T_OK(ep_deregister_memory(c.b, first));
  /* Registrations left at destroy go with the buffer; their handles are then stale. */
  T_OK(ep_register_memory(c.b, y, bytes, &first));
  round_at(&c, 2002, y + PAD * rowb, 1, "x registered again");
  ctx_fini(&c);
  T_STATUS(EP_ERR_DESTROYED, ep_deregister_memory(c.b, first));
  t_dfree(y), t_dfree(sep);
  if (c.me == 0) printf("test_memreg combine: R=%d, %d rounds checked\n", c.R, rounds);
  return T_PASS;
}

/* ------------------------------------------------------------------ dispatch */

enum { NS = H / 128 /* fp8 scales per row */ };

/* What one rank's dispatch writes, on the host. */
typedef struct {
  uint8_t *x;
  float *s, *w;
  int64_t *idx;
  int32_t *src;
} got_t;

/* Where one rank's outputs go: recv_x in the registered tensor or in a plain one; the other
 * arrays always plain. Every array is poisoned before each call. */
typedef struct {
  uint8_t *reg_x, *plain_x;
  float *s, *w;
  int64_t *idx;
  int32_t *src;
  int live; /* reg_x is registered (0 for the round after ep_deregister_memory) */
} outs_t;

static void poison(void *dev, size_t n) {
  void *h = t_xmalloc(n);
  t_copy_to_dev(dev, h, n);
  free(h);
}

static void poison_outs(const ctx_t *c, const outs_t *o) {
  const size_t rows = (size_t)c->R * NMAX;
  poison(o->reg_x, rows * H * 2), poison(o->plain_x, rows * H * 2);
  poison(o->s, rows * NS * 4), poison(o->w, rows * TOPK * 4);
  poison(o->idx, rows * TOPK * 8), poison(o->src, rows * 4);
}

static void get(void *dst, const void *dev, size_t n) {
  void *h = t_to_host(dev, n);
  memcpy(dst, h, n);
  free(h);
}

/* memcmp that accepts empty ranges (a rank may receive nothing: its arrays are then NULL). */
static int same(const void *a, const void *b, size_t n) {
  return n == 0 || !memcmp(a, b, n);
}

/* This rank's received rows against the reference's (x, scales; ids and weights unless cached;
 * source indices). */
static void check_recv(const ctx_t *c, const ref_recv_t *rr, const void *recv_x, const outs_t *o,
                       int row, int fp8, int cached, int with_w, const char *what, int round) {
  const int nr = rr->nr;
  got_t g = {t_xmalloc((size_t)nr * row + 1), t_xmalloc((size_t)nr * NS * 4 + 4),
             t_xmalloc((size_t)nr * TOPK * 4 + 4), t_xmalloc((size_t)nr * TOPK * 8 + 8),
             t_xmalloc((size_t)nr * 4 + 4)};
  get(g.x, recv_x, (size_t)nr * row), get(g.src, o->src, (size_t)nr * 4);
  T_CHECK(same(g.x, rr->x, (size_t)nr * row), "%s, round %d: recv_x differs (%d rows)", what, round,
          nr);
  T_CHECK(same(g.src, rr->src_idx, (size_t)nr * 4), "%s, round %d: recv_src_idx differs", what,
          round);
  if (fp8) {
    get(g.s, o->s, (size_t)nr * NS * 4);
    T_CHECK(same(g.s, rr->scales, (size_t)nr * NS * 4), "%s, round %d: scales differ", what, round);
  }
  if (!cached) {
    get(g.idx, o->idx, (size_t)nr * TOPK * 8);
    T_CHECK(same(g.idx, rr->topk_idx, (size_t)nr * TOPK * 8), "%s, round %d: topk ids differ", what,
            round);
  }
  if (!cached && with_w) {
    get(g.w, o->w, (size_t)nr * TOPK * 4);
    T_CHECK(same(g.w, rr->topk_weights, (size_t)nr * TOPK * 4), "%s, round %d: topk weights differ",
            what, round);
  }
  free(g.x), free(g.s), free(g.w), free(g.idx), free(g.src);
}

/* The allocator path's callback: the arrays the caller mode would have passed. */
typedef struct {
  void *x;
  const outs_t *o;
  int fp8, with_w, calls;
} alloc_ctx_t;

static int give_outs(void *ctx, const ep_dispatch_args_t *args, int nr, ep_dispatch_out_t *out) {
  alloc_ctx_t *a = ctx;
  (void)nr;
  a->calls++;
  out->recv_x = a->x;
  out->recv_x_scales = a->fp8 ? a->o->s : NULL;
  out->recv_topk_idx = args->cached ? NULL : a->o->idx;
  out->recv_topk_weights = a->with_w && !args->cached ? a->o->w : NULL;
  out->recv_src_idx = a->o->src;
  return 0;
}

/* The caller's arrays (EP_OUTPUT_CALLER), or the same ones from the callback (EP_OUTPUT_ALLOC). */
static void set_outs(ep_dispatch_out_t *out, int alloc, alloc_ctx_t *ac, int cap) {
  if (!alloc) {
    out->mode = EP_OUTPUT_CALLER, out->capacity = cap;
    return;
  }
  out->recv_x = NULL, out->recv_x_scales = NULL, out->recv_topk_idx = NULL; /* the callback's */
  out->recv_topk_weights = NULL, out->recv_src_idx = NULL;
  out->mode = EP_OUTPUT_ALLOC, out->alloc = give_outs, out->alloc_ctx = ac;
}

/* Whether the allocator's recv_x of nr rows was written in place: cuda with the late hello
 * (unless EP_CUDA_LATE_HELLO=0), reg (recv_x lies in memory registered now), rows to write. Checked
 * by the in-place counter. */
static void check_alloc_in_place(const ctx_t *c, uint64_t before, int alloc, int reg, int nr,
                                 const char *what, int round) {
  uint64_t cc, after;
  in_place(c, &cc, &after);
  const int want = t_late_hello() && reg && nr > 0;
  T_CHECK(!alloc || after - before == (uint64_t)want,
          "%s, round %d: allocator path, %d rows, %sregistered: %llu dispatches in place, want %d",
          what, round, nr, reg ? "" : "not ", (unsigned long long)(after - before), want);
}

/* Round `round`: the shape of the routing, the format, who has recv_x registered and who takes
 * the allocator path follow from it. */
static void dispatch_round(const ctx_t *c, int round, const outs_t *o) {
  const int R = c->R, me = c->me, fp8 = round & 1, with_w = (round >> 1) & 1;
  const int row = fp8 ? H : H * 2, shape = round % 5;
  data_t d;
  make_data(c, 5000 + round, &d);
  float *sc[64];
  for (int s = 0; s < R; s++) { /* scales; the ranks without tokens, or without receivers */
    t_rng r = t_seed(0x5ca1 + (uint64_t)round, (uint64_t)s);
    sc[s] = t_xmalloc((size_t)NMAX * NS * 4);
    for (int i = 0; i < NMAX * NS; i++) sc[s][i] = t_unit(&r);
    if ((shape == 1 && s == round % R) || shape == 3) d.n[s] = 0;
    for (int i = 0; shape == 2 && i < NMAX * TOPK; i++) /* nobody sends to rank round % R */
      if (d.idx[s][i] / 2 == round % R) d.idx[s][i] = -1;
  }
  const int mine = (round + me) % 3 != 0;    /* registered here; R > 1: some peers differ */
  const int alloc = ((round >> 2) + me) & 1; /* likewise, the allocator path */
  void *x = t_to_dev(d.x[me], (size_t)NMAX * H * 2), *x2 = t_to_dev(d.bias[me], NMAX * H * 2);
  void *idx = t_to_dev(d.idx[me], NMAX * TOPK * 8), *w = t_to_dev(d.w[me], NMAX * TOPK * 4);
  void *s = t_to_dev(sc[me], NMAX * NS * 4);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = fp8 ? EP_DTYPE_FP8_E4M3 : EP_DTYPE_BF16,
                          .num_tokens = d.n[me],
                          .hidden = H,
                          .x_scales = fp8 ? s : NULL,
                          .num_scales = fp8 ? NS : 0,
                          .topk_idx = idx,
                          .topk_weights = with_w ? w : NULL,
                          .topk = TOPK,
                          .num_experts = c->E};
  poison_outs(c, o);
  void *rx = mine ? o->reg_x : o->plain_x;
  ep_dispatch_out_t out = {.size = sizeof out,
                           .mode = EP_OUTPUT_CALLER,
                           .capacity = R * NMAX,
                           .recv_x = rx,
                           .recv_x_scales = fp8 ? o->s : NULL,
                           .recv_topk_idx = o->idx,
                           .recv_topk_weights = with_w ? o->w : NULL,
                           .recv_src_idx = o->src};
  alloc_ctx_t ac = {rx, o, fp8, with_w, 0};
  set_outs(&out, alloc, &ac, R * NMAX);
  uint64_t cc, d0;
  in_place(c, &cc, &d0);
  T_OK(ep_dispatch(c->b, &a, &out));
  T_CHECK(ac.calls == alloc, "round %d: the callback was called %d times", round, ac.calls);
  check_alloc_in_place(c, d0, alloc, mine && o->live, out.num_recv_tokens, "full", round);
  ref_rank_input_t ri[64];
  ref_recv_t rr[64];
  for (int q = 0; q < R; q++)
    ri[q] =
        (ref_rank_input_t){d.n[q], d.x[q], fp8 ? sc[q] : NULL, d.idx[q], with_w ? d.w[q] : NULL};
  memset(rr, 0, sizeof rr);
  T_CHECK(ref_dispatch(R, c->E, TOPK, (size_t)row, fp8 ? NS : 0, 1, ri, rr) == 0,
          "reference dispatch");
  T_CHECK(out.num_recv_tokens == rr[me].nr, "round %d: %d rows, the reference has %d", round,
          out.num_recv_tokens, rr[me].nr);
  check_recv(c, &rr[me], rx, o, row, fp8, 0, with_w, mine ? "registered" : "plain", round);
  /* Cached: new rows, the choices swapped. */
  poison_outs(c, o);
  rx = mine ? o->plain_x : o->reg_x;
  a.x = x2, a.cached = out.handle, a.topk_idx = NULL, a.topk_weights = NULL;
  ep_dispatch_out_t oc = {.size = sizeof oc,
                          .mode = EP_OUTPUT_CALLER,
                          .capacity = R * NMAX,
                          .recv_x = rx,
                          .recv_x_scales = fp8 ? o->s : NULL,
                          .recv_src_idx = o->src};
  ac.x = rx;
  set_outs(&oc, alloc, &ac, R * NMAX);
  in_place(c, &cc, &d0);
  T_OK(ep_dispatch(c->b, &a, &oc));
  T_CHECK(ac.calls == 2 * alloc, "cached, round %d: the callback was called %d times in all", round,
          ac.calls);
  check_alloc_in_place(c, d0, alloc, !mine && o->live, oc.num_recv_tokens, "cached", round);
  for (int q = 0; q < R; q++) ref_free_recv(&rr[q]), ri[q].x = d.bias[q];
  T_CHECK(ref_dispatch(R, c->E, TOPK, (size_t)row, fp8 ? NS : 0, 1, ri, rr) == 0,
          "reference dispatch");
  T_CHECK(oc.num_recv_tokens == rr[me].nr, "cached, round %d: %d rows, the reference has %d", round,
          oc.num_recv_tokens, rr[me].nr);
  check_recv(c, &rr[me], rx, o, row, fp8, 1, 0, mine ? "cached, plain" : "cached, registered",
             round);
  T_OK(ep_handle_destroy(out.handle));
  for (int q = 0; q < R; q++) ref_free_recv(&rr[q]), free(sc[q]);
  void *all[] = {x, x2, idx, w, s};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) t_dfree(all[i]);
  free_data(c, &d);
}

/* Rank 0's registered recv_x holds one row fewer than arrive: EP_ERR_TOO_LARGE there, its
 * tensor untouched (the senders drained its rows instead of writing them in place); the others
 * complete. */
static void dispatch_overflow(const ctx_t *c, const outs_t *o) {
  const int R = c->R, me = c->me;
  data_t d;
  make_data(c, 6000, &d);
  for (int s = 0; s < R; s++) { /* every rank sends rank 0 (expert 0) at least one row */
    if (!d.n[s])
      for (int k = 0; k < TOPK; k++) d.idx[s][k] = -1;
    d.n[s] = d.n[s] ? d.n[s] : 1;
    d.idx[s][0] = 0;
  }
  ref_rank_input_t ri[64];
  ref_recv_t rr[64];
  for (int q = 0; q < R; q++) ri[q] = (ref_rank_input_t){d.n[q], d.x[q], NULL, d.idx[q], NULL};
  memset(rr, 0, sizeof rr);
  T_CHECK(ref_dispatch(R, c->E, TOPK, H * 2, 0, 1, ri, rr) == 0, "reference dispatch");
  const int nr0 = rr[0].nr;
  void *x = t_to_dev(d.x[me], (size_t)NMAX * H * 2), *idx = t_to_dev(d.idx[me], NMAX * TOPK * 8);
  poison_outs(c, o);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = d.n[me],
                          .hidden = H,
                          .topk_idx = idx,
                          .topk = TOPK,
                          .num_experts = c->E};
  ep_dispatch_out_t out = {.size = sizeof out,
                           .mode = EP_OUTPUT_CALLER,
                           .capacity = me == 0 ? nr0 - 1 : R * NMAX,
                           .recv_x = o->reg_x,
                           .recv_src_idx = o->src};
  ep_status_t st = ep_dispatch(c->b, &a, &out);
  if (me == 0) {
    T_CHECK(st == EP_ERR_TOO_LARGE, "rank 0: %s (%s), expected EP_ERR_TOO_LARGE",
            ep_status_name(st), ep_last_error());
    const size_t n = (size_t)R * NMAX * H * 2;
    uint8_t *got = t_to_host(o->reg_x, n), *want = t_xmalloc(n);
    T_CHECK(!memcmp(got, want, n), "rank 0: a dispatch over capacity wrote its recv_x");
    free(got), free(want);
  } else {
    T_OK(st);
    check_recv(c, &rr[me], o->reg_x, o, H * 2, 0, 1, 0, "overflow on rank 0", 6000);
    T_OK(ep_handle_destroy(out.handle));
  }
  for (int q = 0; q < R; q++) ref_free_recv(&rr[q]);
  t_dfree(x), t_dfree(idx);
  free_data(c, &d);
}

static void dispatch_rounds(size_t queue_bytes, int rounds, const char *what) {
  ctx_t c;
  ctx_init_q(&c, queue_bytes, queue_bytes ? 1 : 0);
  const size_t rows = (size_t)c.R * NMAX, rowb = (size_t)H * 2, bytes = tensor_bytes(&c);
  uint8_t *y = t_dalloc(bytes);
  outs_t o = {y + PAD * rowb,
              t_dalloc(rows * rowb),
              t_dalloc(rows * NS * 4),
              t_dalloc(rows * TOPK * 4),
              t_dalloc(rows * TOPK * 8),
              t_dalloc(rows * 4),
              1};
  ep_mem_t m;
  uint64_t cc, d0, d1, d2;
  T_OK(ep_register_memory(c.b, y, bytes, &m));
  in_place(&c, &cc, &d0);
  for (int round = 0; round < rounds; round++) dispatch_round(&c, round, &o);
  in_place(&c, &cc, &d1);
  /* The registered recv_x was written by the senders (a fallback would give the same bits). */
  T_CHECK(t_cuda() ? rounds < 1 || d1 > d0 : d1 == d0,
          "%s: dispatches written in place went from %llu to %llu over %d rounds", what,
          (unsigned long long)d0, (unsigned long long)d1, rounds);
  dispatch_overflow(&c, &o);
  dispatch_round(&c, rounds, &o);
  T_OK(ep_deregister_memory(c.b, m));
  o.live = 0;
  in_place(&c, &cc, &d1);
  dispatch_round(&c, rounds + 1, &o); /* registered nowhere now */
  in_place(&c, &cc, &d2);
  T_CHECK(d2 == d1, "%s: a dispatch into deregistered memory counts as written in place", what);
  ctx_fini(&c);
  void *all[] = {y, o.plain_x, o.s, o.w, o.idx, o.src};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) t_dfree(all[i]);
  if (c.me == 0)
    printf("test_memreg dispatch (%s): R=%d, %d rounds checked\n", what, c.R, rounds + 2);
}

static int dispatch(int rounds) {
  dispatch_rounds(0, rounds, "default receive area");
  dispatch_rounds(4096, rounds, "receive area of R x 4096 bytes: windows");
  return T_PASS;
}

/* ------------------------------------------------------------------ misuse */

static void expect(ep_status_t got, ep_status_t want, const char *needle, const char *what) {
  T_CHECK(got == want && (!needle || strstr(ep_last_error(), needle)),
          "%s: %s (%s), expected %s naming \"%s\"", what, ep_status_name(got), ep_last_error(),
          ep_status_name(want), needle ? needle : "");
}

#ifdef EP_HAVE_CUDA
/* Memory the CUDA backend refuses, alike on every rank. */
static void cuda_misuse(ctx_t *c, uint8_t *y, size_t bytes) {
  ep_mem_t m = NULL;
  char host[4096];
  expect(ep_register_memory(c->b, host, sizeof host, &m), EP_ERR_INVALID_ARG, "host memory",
         "host memory");
  uint8_t *big = NULL; /* 4 MiB: whatever granularity the driver rounds sizes to */
  T_CUDA(cudaMalloc((void **)&big, 4 << 20));
  expect(ep_register_memory(c->b, big + (2 << 20), 4 << 20, &m), EP_ERR_OUT_OF_RANGE,
         "past the end", "a range past its allocation");
  T_CUDA(cudaFree(big));
  (void)y, (void)bytes;
  void *pool = NULL;
  T_CUDA(cudaMallocAsync(&pool, 1 << 20, 0));
  T_CUDA(cudaStreamSynchronize(0));
  expect(ep_register_memory(c->b, pool, 1 << 20, &m), EP_ERR_UNSUPPORTED, "CUDA IPC",
         "cudaMallocAsync memory");
  T_CUDA(cudaFreeAsync(pool, 0));
  T_CUDA(cudaStreamSynchronize(0));
  T_CHECK(m == NULL, "a refused registration set *mem");
}
#endif

static int misuse(void) {
  ctx_t c;
  ctx_init(&c);
  const size_t bytes = tensor_bytes(&c), rowb = (size_t)H * 2;
  uint8_t *y = t_dalloc(bytes);
  ep_mem_t m = NULL, a, b;
  expect(ep_register_memory(c.b, y, bytes, NULL), EP_ERR_NULL_ARG, "mem", "mem NULL");
  expect(ep_register_memory(c.b, NULL, bytes, &m), EP_ERR_NULL_ARG, "ptr", "ptr NULL");
  expect(ep_register_memory(c.b, y, 0, &m), EP_ERR_OUT_OF_RANGE, "bytes is 0", "bytes 0");
  expect(ep_register_memory(c.b, (void *)~(uintptr_t)0xfff, 1 << 20, &m), EP_ERR_OUT_OF_RANGE,
         "wraps", "a range that wraps");
  expect(ep_deregister_memory(c.b, NULL), EP_ERR_NULL_ARG, "mem", "deregister NULL");
  T_CHECK(m == NULL, "a refused registration set *mem");
  if (c.R > 1) { /* one rank alone rejects: the others learn it at once */
    ep_status_t st = ep_register_memory(c.b, c.me == 0 ? NULL : y, bytes, &m);
    expect(st, c.me == 0 ? EP_ERR_NULL_ARG : EP_ERR_PEER_INVALID, NULL, "rank 0 alone rejects");
  }
#ifdef EP_HAVE_CUDA
  if (t_cuda()) cuda_misuse(&c, y, bytes);
#endif
  /* Ranks that deregister in different orders: every rank fails, nothing changes. */
  T_OK(ep_register_memory(c.b, y, bytes / 2, &a));
  T_OK(ep_register_memory(c.b, y + bytes / 2, bytes / 2, &b));
  if (c.R > 1) {
    ep_status_t st = ep_deregister_memory(c.b, c.me == 0 ? a : b);
    expect(st, EP_ERR_MISMATCH, "same order", "deregistrations in different orders");
    round_at(&c, 7, y + PAD * rowb, -1, "after a mismatch");
  }
  T_OK(ep_deregister_memory(c.b, a));
  expect(ep_deregister_memory(c.b, a), EP_ERR_DESTROYED, "mem", "deregistered twice");
  /* A handle of another buffer. */
  ep_buffer_t other;
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  T_OK(ep_buffer_create(c.g, &cfg, &other));
  expect(ep_deregister_memory(other, b), EP_ERR_INVALID_ARG, "another buffer", "foreign handle");
  T_OK(ep_buffer_destroy(other));
  T_OK(ep_deregister_memory(c.b, b));
  /* At most EP's limit alive at once; the next is refused, and the buffer still works. */
  ep_mem_t many[65];
  int n = 0;
  for (; n < 65; n++) {
    ep_status_t st = ep_register_memory(c.b, y + (size_t)n * 16, 16, &many[n]);
    if (st) {
      expect(st, EP_ERR_TOO_LARGE, "64 registrations", "the 65th registration");
      break;
    }
  }
  T_CHECK(n == 64, "%d registrations accepted, expected 64", n);
  for (int i = n - 1; i >= 0; i--) T_OK(ep_deregister_memory(c.b, many[i]));
  round_at(&c, 8, y + PAD * rowb, 0, "after the misuse");
  ctx_fini(&c);
  t_dfree(y);
  if (c.me == 0) printf("test_memreg misuse: R=%d\n", c.R);
  return T_PASS;
}

/* ------------------------------------------------------------------ cycles */

static size_t free_mem(void) {
  size_t f = 0;
#ifdef EP_HAVE_CUDA
  size_t t = 0;
  if (t_cuda()) T_CUDA(cudaMemGetInfo(&f, &t));
#endif
  return f;
}

static int cycles(int n) {
  ctx_t c;
  ctx_init(&c);
  const size_t bytes = tensor_bytes(&c), rowb = (size_t)H * 2;
  uint8_t *y = t_dalloc(bytes);
  size_t f0 = 0;
  for (int i = 0; i <= n; i++) {
    ep_mem_t m;
    T_OK(ep_register_memory(c.b, y, bytes, &m));
    if (i % 10 == 0) round_at(&c, 3000 + i, y + PAD * rowb, 1, "cycles");
    T_OK(ep_deregister_memory(c.b, m));
    if (i == 0) f0 = free_mem(); /* after the first: module load, context, first mappings */
  }
  T_OK(ep_group_barrier(c.g));
  size_t f1 = free_mem();
  printf("rank %d: %d cycles: device free memory %.1f -> %.1f MiB\n", c.me, n, f0 / 1048576.0,
         f1 / 1048576.0);
  /* Other ranks may be at another point of their last cycle: allow a little. */
  T_CHECK(f1 + (16u << 20) >= f0, "device memory fell by %.1f MiB over %d cycles",
          (f0 - f1) / 1048576.0, n);
  ctx_fini(&c);
  t_dfree(y);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "combine";
  t_require_backend();
  if (!strcmp(mode, "combine")) return combine(argc > 2 ? atoi(argv[2]) : 6);
  if (!strcmp(mode, "dispatch")) return dispatch(argc > 2 ? atoi(argv[2]) : 10);
  if (!strcmp(mode, "misuse")) return misuse();
  if (!strcmp(mode, "cycles")) return cycles(argc > 2 ? atoi(argv[2]) : 50);
  fprintf(stderr, "unknown mode %s\n", mode);
  return T_FAIL;
}
