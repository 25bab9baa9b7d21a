/* CUDA backend only (SEMANTICS.md §3-4, §7, §8 on the GPU); skipped with a visible reason without
 * a GPU.
 *   test_cuda graph N     worst-case dispatch + combine captured in a CUDA graph, replayed N times
 *                         with fresh inputs and routing, each replay checked against the reference
 *   test_cuda timeout     a peer that never calls: the synchronous dispatch returns
 *                         EP_ERR_TIMEOUT naming it; an asynchronous one reports it on the next
 *                         call; the context stays usable (a fresh buffer then works)
 *   test_cuda cycles N    N x (group, buffer, dispatch + combine, destroy): device memory flat
 *   test_cuda overflow    outputs too small on one rank: EP_ERR_TOO_LARGE there, the rows are
 *                         drained, the other ranks complete, the buffer stays usable; then a
 *                         worst-case (asynchronous) dispatch too small on rank 0, followed at
 *                         once by a synchronous allocator-path dispatch: EP_OK on every rank,
 *                         the earlier failure logged on rank 0 (EP_LOG_FILE), not returned;
 *                         and the same before a synchronous dispatch that fails on its own
 *                         (num_experts differs): rank 0 returns its own EP_ERR_MISMATCH
 *   test_cuda cbuf N      N rounds of dispatch (bf16 or fp8 alternately, views) + combine whose x
 *                         is ep_get_combine_buffer's memory, written by the "experts" (with and
 *                         without weights, with a bias), each checked against the reference;
 *                         a buffer too small for the rows refuses with EP_ERR_TOO_LARGE
 *   test_cuda onwait      a full dispatch on a stream held by a 50 ms host function: on_wait
 *                         runs every step it asks for while the host waits for the count, the
 *                         receive count is still right; a worst-case and a cached dispatch never
 *                         call it */
#include <unistd.h>

#include "common.h"
#include "ref.h"

#ifndef EP_HAVE_CUDA
int main(void) {
  printf("skipped: no GPU (the CUDA backend is not built)\n");
  return T_SKIP;
}
#else
#include <cuda_runtime_api.h>

#define CU T_CUDA

enum { H = 256, TOPK = 4, NMAX = 40 };

typedef struct {
  int R, me, E, wct;
  uint16_t *x[64];
  int64_t *idx[64];
  float *w[64];
  int n[64];
} inputs_t;

static ep_buffer_config_t cuda_cfg(double timeout_s) {
  ep_buffer_config_t c = EP_BUFFER_CONFIG_INIT;
  c.backend = EP_BACKEND_CUDA;
  c.timeout_s = timeout_s;
  return c;
}

/* Every rank's tokens for round `round` (same on all ranks): up to NMAX tokens, random experts. */
static void make_inputs(inputs_t *in, int round) {
  for (int s = 0; s < in->R; s++) {
    t_rng r = t_seed(0x6a7b + (uint64_t)round, (uint64_t)s);
    int n = in->n[s] = t_below(&r, NMAX + 1);
    free(in->x[s]), free(in->idx[s]), free(in->w[s]);
    in->x[s] = t_xmalloc((size_t)NMAX * H * 2);
    in->idx[s] = t_xmalloc((size_t)NMAX * TOPK * 8);
    in->w[s] = t_xmalloc((size_t)NMAX * TOPK * 4);
    for (int i = 0; i < n * H; i++) in->x[s][i] = t_rand_bf16(&r);
    for (int i = 0; i < n * TOPK; i++) {
      in->idx[s][i] = t_below(&r, 10) < 2 ? -1 : t_below(&r, in->E);
      in->w[s][i] = t_unit(&r);
    }
  }
}

static void free_inputs(inputs_t *in) {
  for (int s = 0; s < in->R; s++) free(in->x[s]), free(in->idx[s]), free(in->w[s]);
}

/* ------------------------------------------------------------------ graph capture + replay */

typedef struct {
  void *x, *idx, *w, *rx, *ridx, *rw, *rsrc, *prefix, *y, *out, *outw;
  int n; /* tokens captured: the graph always sends NMAX rows' worth of this rank's buffers */
} gbufs_t;

static void check_replay(inputs_t *in, gbufs_t *d, const uint16_t *const *y, int round) {
  int R = in->R, me = in->me;
  ref_rank_input_t ri[64];
  for (int s = 0; s < R; s++)
    ri[s] = (ref_rank_input_t){in->n[s], in->x[s], NULL, in->idx[s], in->w[s]};
  ref_recv_t rr[64];
  memset(rr, 0, sizeof rr);
  T_CHECK(ref_dispatch(R, in->E, TOPK, H * 2, 0, 1, ri, rr) == 0, "reference dispatch");
  int nr = rr[me].nr;
  uint16_t *rx = t_to_host(d->rx, (size_t)in->wct * H * 2);
  int64_t *ridx = t_to_host(d->ridx, (size_t)in->wct * TOPK * 8);
  int32_t *pre = t_to_host(d->prefix, (size_t)R * R * 4);
  T_CHECK(!memcmp(pre, rr[me].rank_prefix, (size_t)R * R * 4), "replay %d: rank_prefix", round);
  T_CHECK(!memcmp(rx, rr[me].x, (size_t)nr * H * 2), "replay %d: recv_x differs", round);
  T_CHECK(!memcmp(ridx, rr[me].topk_idx, (size_t)nr * TOPK * 8), "replay %d: recv_topk_idx", round);
  for (int r = nr; r < in->wct; r++)
    T_CHECK(ridx[(size_t)r * TOPK] == -1, "replay %d: tail", round);
  uint16_t *out[64];
  float *ow[64];
  for (int s = 0; s < R; s++)
    out[s] = t_xmalloc((size_t)NMAX * H * 2), ow[s] = t_xmalloc(NMAX * TOPK * 4);
  const float *wv[64];
  for (int s = 0; s < R; s++) wv[s] = rr[s].topk_weights;
  T_CHECK(ref_combine(R, H, TOPK, ri, rr, y, wv, NULL, NULL, out, ow) == 0, "reference combine");
  uint16_t *got = t_to_host(d->out, (size_t)NMAX * H * 2);
  T_CHECK(!memcmp(got, out[me], (size_t)in->n[me] * H * 2), "replay %d: combine out", round);
  for (int s = 0; s < R; s++) free(out[s]), free(ow[s]), ref_free_recv(&rr[s]);
  free(rx), free(ridx), free(pre), free(got);
}

static void upload(inputs_t *in, gbufs_t *d, uint16_t **y) {
  int me = in->me;
  t_copy_to_dev(d->x, in->x[me], (size_t)NMAX * H * 2);
  t_copy_to_dev(d->idx, in->idx[me], (size_t)NMAX * TOPK * 8);
  t_copy_to_dev(d->w, in->w[me], (size_t)NMAX * TOPK * 4);
  t_copy_to_dev(d->y, y[me], (size_t)in->wct * H * 2);
}

/* The expert output of every rank for a round: rank s's rows, random (rebuilt by everyone). */
static void make_y(inputs_t *in, int round, uint16_t **y) {
  for (int s = 0; s < in->R; s++) {
    t_rng r = t_seed(0xe7e7 + (uint64_t)round, (uint64_t)s);
    free(y[s]);
    y[s] = t_xmalloc((size_t)in->wct * H * 2);
    for (size_t i = 0; i < (size_t)in->wct * H; i++) y[s][i] = t_rand_bf16(&r);
  }
}

static int graph(int replays) {
  ep_group_t g;
  inputs_t in = {0};
  t_init(&g, &in.me, &in.R);
  in.E = 4 * in.R, in.wct = NMAX * in.R;
  ep_buffer_config_t cfg = cuda_cfg(0);
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, &cfg, &b));
  ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(b, &info));
  unsigned want = EP_CAP_DISPATCH_VIEWS | EP_CAP_DEVICE_MEMORY | EP_CAP_GRAPH_CAPTURE;
  T_CHECK(info.backend == EP_BACKEND_CUDA && (info.caps & want) == want &&
              info.dispatch_view_lifetime == EP_LIFETIME_NEXT_DISPATCH,
          "ep_buffer_query: backend %d, caps %#x, view lifetime %d", (int)info.backend, info.caps,
          (int)info.dispatch_view_lifetime);
  gbufs_t d;
  d.x = t_dalloc(NMAX * H * 2), d.idx = t_dalloc(NMAX * TOPK * 8), d.w = t_dalloc(NMAX * TOPK * 4);
  d.rx = t_dalloc((size_t)in.wct * H * 2), d.ridx = t_dalloc((size_t)in.wct * TOPK * 8);
  d.rw = t_dalloc((size_t)in.wct * TOPK * 4), d.rsrc = t_dalloc((size_t)in.wct * 4);
  d.prefix = t_dalloc((size_t)in.R * in.R * 4), d.y = t_dalloc((size_t)in.wct * H * 2);
  d.out = t_dalloc(NMAX * H * 2), d.outw = t_dalloc(NMAX * TOPK * 4);
  uint16_t *y[64] = {0};
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  /* The graph always sends NMAX tokens; routing rows past a rank's count are all -1. */
  make_inputs(&in, 0);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = d.x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = NMAX,
                          .hidden = H,
                          .topk_idx = d.idx,
                          .topk_weights = d.w,
                          .topk = TOPK,
                          .num_experts = in.E,
                          .stream = st};
  /* Worst case: the outputs hold in.wct rows, no host wait (capturable). */
  ep_dispatch_out_t o = {.size = sizeof o,
                         .mode = EP_OUTPUT_CALLER,
                         .worst_case = 1,
                         .capacity = in.wct,
                         .recv_x = d.rx,
                         .recv_topk_idx = d.ridx,
                         .recv_topk_weights = d.rw,
                         .recv_src_idx = d.rsrc,
                         .rank_prefix = d.prefix};
  ep_combine_args_t c = {.size = sizeof c, .x = d.y, .stream = st, .out = d.out};
  cudaGraph_t gr;
  cudaGraphExec_t ge;
  CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  T_OK(ep_dispatch(b, &a, &o));
  T_CHECK(o.num_recv_tokens == -1,
          "worst-case dispatch: num_recv_tokens %d, expected -1 (not "
          "known on the host)",
          o.num_recv_tokens);
  ep_handle_t h = o.handle;
  c.handle = h;
  T_OK(ep_combine(b, &c));
  CU(cudaStreamEndCapture(st, &gr));
  CU(cudaGraphInstantiate(&ge, gr, 0));
  for (int round = 0; round < replays; round++) {
    make_inputs(&in, round + 1);
    for (int s = 0; s < in.R; s++) /* pad every rank to NMAX tokens with unrouted ones */
      for (int i = in.n[s] * TOPK; i < NMAX * TOPK; i++) in.idx[s][i] = -1;
    for (int s = 0; s < in.R; s++) in.n[s] = NMAX;
    make_y(&in, round + 1, y);
    upload(&in, &d, y);
    CU(cudaGraphLaunch(ge, st));
    CU(cudaStreamSynchronize(st));
    check_replay(&in, &d, (const uint16_t *const *)y, round);
  }
  CU(cudaGraphExecDestroy(ge));
  CU(cudaGraphDestroy(gr));
  T_OK(ep_handle_destroy(h));
  T_OK(ep_buffer_destroy(b));
  void *all[] = {d.x, d.idx, d.w, d.rx, d.ridx, d.rw, d.rsrc, d.prefix, d.y, d.out, d.outw};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) t_dfree(all[i]);
  for (int s = 0; s < in.R; s++) free(y[s]);
  CU(cudaStreamDestroy(st));
  free_inputs(&in);
  t_fini(g);
  if (in.me == 0) printf("test_cuda graph: R=%d, %d replays checked\n", in.R, replays);
  return T_PASS;
}

/* ------------------------------------------------------------------ one small round trip */

/* Whether token t of rank s selects an expert of rank r (E = 2R: rank r owns experts 2r, 2r+1). */
static bool goes_to(const inputs_t *in, int s, int t, int r) {
  bool hit = false;
  for (int k = 0; k < TOPK; k++)
    hit |= in->idx[s][t * TOPK + k] >= 0 && in->idx[s][t * TOPK + k] / 2 == r;
  return hit;
}

/* The bf16 dispatch of this rank's tokens of `in` (x and idx: their device copies). */
static ep_dispatch_args_t my_dispatch(const inputs_t *in, void *x, void *idx, void *stream) {
  return (ep_dispatch_args_t){.size = sizeof(ep_dispatch_args_t),
                              .x = x,
                              .dtype = EP_DTYPE_BF16,
                              .num_tokens = in->n[in->me],
                              .hidden = H,
                              .topk_idx = idx,
                              .topk = TOPK,
                              .num_experts = in->E,
                              .stream = stream};
}

/* A dispatch (views) and a combine of the view written in place; checks the combine result. */
static void round_trip(ep_buffer_t b, int R, int me) {
  inputs_t in = {.R = R, .me = me, .E = 2 * R};
  make_inputs(&in, 7);
  void *x = t_to_dev(in.x[me], NMAX * H * 2), *idx = t_to_dev(in.idx[me], NMAX * TOPK * 8);
  void *out = t_dalloc(NMAX * H * 2);
  ep_dispatch_args_t a = my_dispatch(&in, x, idx, NULL);
  ep_dispatch_out_t o = {.size = sizeof o, .mode = EP_OUTPUT_VIEWS};
  T_OK(ep_dispatch(b, &a, &o));
  ep_handle_t h = o.handle;
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = o.recv_x, .out = out};
  T_OK(ep_combine(b, &c)); /* x = the rows as received: out = row * (ranks the token went to) */
  uint16_t *got = t_to_host(out, (size_t)in.n[me] * H * 2);
  for (int t = 0; t < in.n[me]; t++) {
    int ranks = 0;
    for (int r = 0; r < R; r++) ranks += goes_to(&in, me, t, r);
    float want = ref_bf16_to_f32(in.x[me][(size_t)t * H]) * (float)ranks;
    T_CHECK(got[(size_t)t * H] == ref_f32_to_bf16(want), "round trip: token %d", t);
  }
  T_OK(ep_handle_destroy(h));
  t_dfree(x), t_dfree(idx), t_dfree(out), free(got);
  free_inputs(&in);
}

/* ------------------------------------------------------------------ on_wait */

static void CUDART_CB hold_50ms(void *unused) {
  (void)unused;
  usleep(50 * 1000); /* the stream, and the count exchange queued after this, waits */
}

static int dispatch_steps(ep_buffer_t b, const ep_dispatch_args_t *a, int worst, int *nr,
                          ep_handle_t *h) {
  t_steps_t w = {.want = 4};
  ep_dispatch_out_t o = {.size = sizeof o,
                         .mode = EP_OUTPUT_VIEWS,
                         .on_wait = t_wait_step,
                         .on_wait_ctx = &w,
                         .worst_case = worst,
                         .capacity = worst ? 64 * NMAX : 0};
  CU(cudaLaunchHostFunc(a->stream, hold_50ms, NULL));
  T_OK(ep_dispatch(b, a, &o));
  T_CHECK(!w.out_of_order, "on_wait: %d of %d steps out of order", w.out_of_order, w.steps);
  *nr = o.num_recv_tokens;
  if (h)
    *h = o.handle;
  else if (o.handle)
    T_OK(ep_handle_destroy(o.handle));
  return w.steps;
}

static int onwait(void) {
  ep_group_t g;
  ep_buffer_t b;
  int R, me;
  t_init(&g, &me, &R);
  ep_buffer_config_t cfg = cuda_cfg(30);
  T_OK(ep_buffer_create(g, &cfg, &b));
  inputs_t in = {.R = R, .me = me, .E = 2 * R};
  make_inputs(&in, 3);
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  void *x = t_to_dev(in.x[me], NMAX * H * 2), *idx = t_to_dev(in.idx[me], NMAX * TOPK * 8);
  ep_dispatch_args_t a = my_dispatch(&in, x, idx, st);
  int want = 0, nr = -2;
  for (int s = 0; s < R; s++)
    for (int t = 0; t < in.n[s]; t++) want += goes_to(&in, s, t, me);
  ep_handle_t h;
  int steps = dispatch_steps(b, &a, 0, &nr, &h);
  T_CHECK(steps == 4, "full dispatch on a held stream: on_wait ran %d of its 4 steps", steps);
  T_CHECK(nr == want, "full dispatch: %d rows received, expected %d", nr, want);
  ep_dispatch_args_t c = {.size = sizeof c,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = in.n[me],
                          .hidden = H,
                          .cached = h,
                          .stream = st};
  steps = dispatch_steps(b, &c, 0, &nr, NULL);
  T_CHECK(steps == 0 && nr == want, "cached dispatch: on_wait ran %d steps (0 expected), %d rows",
          steps, nr);
  steps = dispatch_steps(b, &a, 1, &nr, NULL);
  T_CHECK(steps == 0, "worst-case dispatch: on_wait ran %d steps (0 expected)", steps);
  CU(cudaStreamSynchronize(st));
  printf("rank %d: on_wait ran 4 steps while the host waited; %d rows\n", me, want);
  T_OK(ep_handle_destroy(h));
  t_dfree(x), t_dfree(idx);
  CU(cudaStreamDestroy(st));
  free_inputs(&in);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  return T_PASS;
}

/* ------------------------------------------------------------------ timeouts */

static void expect_timeout(ep_status_t st, const char *what) {
  T_CHECK(st == EP_ERR_TIMEOUT, "%s returned %s (%s), expected EP_ERR_TIMEOUT", what,
          ep_status_name(st), ep_last_error());
  T_CHECK(strstr(ep_last_error(), "peer rank 1"), "%s: the message does not name rank 1: %s", what,
          ep_last_error());
  printf("%s: %s\n", what, ep_last_error());
}

static int timeout(void) {
  ep_group_t g;
  int R, me;
  t_init(&g, &me, &R);
  if (R < 2) {
    printf("skipped: needs 2 ranks\n");
    t_fini(g);
    return T_SKIP;
  }
  ep_buffer_config_t cfg = cuda_cfg(2.0);
  ep_buffer_t b1, b2, b3;
  T_OK(ep_buffer_create(g, &cfg, &b1));
  T_OK(ep_buffer_create(g, &cfg, &b2));
  void *x = t_dalloc(H * 2), *idx = t_to_dev((int64_t[TOPK]){0, -1, -1, -1}, TOPK * 8);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = 1,
                          .hidden = H,
                          .topk_idx = idx,
                          .topk = TOPK,
                          .num_experts = R};
  if (me == 0) {
    /* Rank 1 never comes: the synchronous path fails at the count exchange, naming it. */
    ep_dispatch_out_t o = {.size = sizeof o, .mode = EP_OUTPUT_VIEWS};
    expect_timeout(ep_dispatch(b1, &a, &o), "synchronous dispatch");
    T_CHECK(o.handle == NULL, "a failed dispatch returned a handle");
    /* Asynchronous: the call returns; its kernel gives up; the next call says why. */
    ep_dispatch_out_t w = {.size = sizeof w,
                           .mode = EP_OUTPUT_CALLER,
                           .worst_case = 1,
                           .capacity = 4,
                           .recv_x = t_dalloc(4 * H * 2)};
    T_OK(ep_dispatch(b2, &a, &w));
    ep_handle_t h = w.handle;
    t_dsync();
    w.handle = NULL;
    expect_timeout(ep_dispatch(b2, &a, &w), "call after an asynchronous dispatch");
    T_CHECK(w.handle == NULL, "a failed dispatch returned a handle");
    T_OK(ep_handle_destroy(h));
    t_dfree(w.recv_x);
  }
  /* The timeout broke rank 0's group (only local teardown remains there): every rank lets its
   * objects go locally and all meet again in a fresh group. */
  T_OK(ep_buffer_release(b1));
  T_OK(ep_buffer_release(b2));
  T_OK(ep_group_release(g));
  t_init(&g, &me, &R);
  /* No trap: the context works, a fresh buffer moves data. */
  T_OK(ep_buffer_create(g, NULL, &b3));
  round_trip(b3, R, me);
  T_OK(ep_buffer_destroy(b3));
  t_dfree(x), t_dfree(idx);
  t_fini(g);
  return T_PASS;
}

/* ------------------------------------------------------------------ outputs too small */

/* Rank 0's outputs hold no row: it gets EP_ERR_TOO_LARGE, its rows are drained, every other rank
 * completes, and the buffer stays consistent (a round trip afterwards works). */
static int alloc_x(void *ctx, const ep_dispatch_args_t *a, int nr, ep_dispatch_out_t *o) {
  void **p = ctx;
  (void)a;
  *p = t_dalloc((size_t)(nr > 0 ? nr : 1) * H * 2);
  o->recv_x = *p;
  return *p ? 0 : -1;
}

/* The worst-case dispatch returns before its kernels run; the one too small on rank 0 records
 * its failure on the GPU meanwhile, while the synchronous dispatch after it waits for its count
 * (the peers enter 100 ms late, so rank 0's kernels cannot have ended before it waits). That
 * failure moved no data and belongs to the earlier call: the synchronous one must go through on
 * every rank (rank 0 launching its data kernel, which the peers wait for). */
static void deferred_overflow(ep_buffer_t b, const ep_dispatch_args_t *a, void *rx, int R, int me,
                              ep_output_mode_t mode) {
  ep_dispatch_out_t w = {.size = sizeof w,
                         .mode = EP_OUTPUT_CALLER,
                         .worst_case = 1,
                         .recv_x = rx,
                         .capacity = me == 0 ? 1 : NMAX * R}; /* rank 0 receives R rows or more */
  if (me != 0) usleep(100 * 1000);
  T_OK(ep_dispatch(b, a, &w));
  void *ax = NULL;
  ep_dispatch_out_t s = {.size = sizeof s, .mode = mode, .alloc = alloc_x, .alloc_ctx = &ax};
  ep_status_t st = ep_dispatch(b, a, &s);
  T_CHECK(st == EP_OK, "the synchronous dispatch (mode %d) after an asynchronous overflow: %s (%s)",
          (int)mode, ep_status_name(st), ep_last_error());
  T_OK(cudaDeviceSynchronize() == cudaSuccess ? EP_OK : EP_ERR_CUDA);
  const bool hit = t_logged("moved no data");
  T_CHECK(me != 0 || hit, "rank 0: the earlier call's overflow was not logged (%s)",
          getenv("EP_LOG_FILE"));
  T_OK(ep_handle_destroy(w.handle));
  T_OK(ep_handle_destroy(s.handle));
  t_dfree(ax);
}

/* The same overflow, then a synchronous dispatch that fails on its own: the last rank says
 * num_experts 4R where the others say 2R, a disagreement every rank finds in its count
 * exchange. Rank 0's own failure cannot take the error word, which holds the overflow (no-data
 * failures do not replace each other): it must still return its own EP_ERR_MISMATCH naming
 * num_experts, and log the overflow as the earlier call's. */
static void deferred_own_failure(ep_buffer_t b, const ep_dispatch_args_t *a, void *rx, int R,
                                 int me, ep_output_mode_t mode) {
  ep_dispatch_out_t w = {.size = sizeof w,
                         .mode = EP_OUTPUT_CALLER,
                         .worst_case = 1,
                         .recv_x = rx,
                         .capacity = me == 0 ? 1 : NMAX * R};
  if (me != 0) usleep(100 * 1000);
  T_OK(ep_dispatch(b, a, &w));
  ep_dispatch_args_t odd = *a;
  if (me == R - 1) odd.num_experts = 2 * a->num_experts;
  void *ax = NULL;
  ep_dispatch_out_t s = {.size = sizeof s, .mode = mode, .alloc = alloc_x, .alloc_ctx = &ax};
  ep_status_t st = ep_dispatch(b, &odd, &s);
  T_CHECK(st == EP_ERR_MISMATCH && strstr(ep_last_error(), "num_experts"),
          "the failing synchronous dispatch (mode %d): %s (%s), expected EP_ERR_MISMATCH naming "
          "num_experts",
          (int)mode, ep_status_name(st), ep_last_error());
  T_CHECK(s.handle == NULL, "a failed dispatch returned a handle");
  T_OK(cudaDeviceSynchronize() == cudaSuccess ? EP_OK : EP_ERR_CUDA);
  const bool hit = t_logged("moved no data");
  T_CHECK(me != 0 || hit, "rank 0: the earlier call's overflow was not logged (%s)",
          getenv("EP_LOG_FILE"));
  T_OK(ep_handle_destroy(w.handle));
  t_dfree(ax);
}

static int overflow(void) {
  ep_group_t g;
  ep_buffer_t b;
  int R, me;
  t_init(&g, &me, &R);
  T_OK(ep_buffer_create(g, NULL, &b));
  inputs_t in = {.R = R, .me = me, .E = 2 * R};
  make_inputs(&in, 3);
  for (int s = 0; s < R; s++) { /* every rank sends rank 0 (expert 0) at least one row */
    if (!in.n[s])
      for (int k = 0; k < TOPK; k++) in.idx[s][k] = -1;
    in.n[s] = in.n[s] ? in.n[s] : 1;
    in.idx[s][0] = 0;
  }
  void *x = t_to_dev(in.x[me], NMAX * H * 2), *idx = t_to_dev(in.idx[me], NMAX * TOPK * 8);
  void *rx = t_dalloc((size_t)NMAX * R * H * 2);
  ep_dispatch_args_t a = my_dispatch(&in, x, idx, NULL);
  ep_dispatch_out_t o = {.size = sizeof o,
                         .mode = EP_OUTPUT_CALLER,
                         .recv_x = rx,
                         .capacity = me == 0 ? 0 : NMAX * R,
                         .num_recv_tokens = -5};
  ep_status_t st = ep_dispatch(b, &a, &o);
  if (me == 0) {
    T_CHECK(st == EP_ERR_TOO_LARGE, "rank 0: %s (%s), expected EP_ERR_TOO_LARGE",
            ep_status_name(st), ep_last_error());
    T_CHECK(strstr(ep_last_error(), "out->capacity"), "the message does not name out->capacity: %s",
            ep_last_error());
    T_CHECK(o.num_recv_tokens == -5 && o.handle == NULL, "a failed dispatch wrote its results");
    printf("outputs too small: %s\n", ep_last_error());
  } else {
    T_OK(st);
    T_OK(ep_handle_destroy(o.handle));
  }
  round_trip(b, R, me);
  if (R > 1) deferred_overflow(b, &a, rx, R, me, EP_OUTPUT_ALLOC);
  if (R > 1) deferred_overflow(b, &a, rx, R, me, EP_OUTPUT_VIEWS);
  round_trip(b, R, me);
  if (R > 1) deferred_own_failure(b, &a, rx, R, me, EP_OUTPUT_ALLOC);
  if (R > 1) deferred_own_failure(b, &a, rx, R, me, EP_OUTPUT_VIEWS);
  round_trip(b, R, me);
  T_OK(ep_buffer_destroy(b));
  t_dfree(x), t_dfree(idx), t_dfree(rx);
  free_inputs(&in);
  t_fini(g);
  t_log_remove();
  return T_PASS;
}

/* ------------------------------------------------------------------ combine buffer */

static int cbuf(int rounds) {
  ep_group_t g;
  inputs_t in = {0};
  t_init(&g, &in.me, &in.R);
  const int R = in.R, me = in.me;
  in.E = 4 * R, in.wct = NMAX * R;
  ep_buffer_config_t cfg = cuda_cfg(0);
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, &cfg, &b));
  ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(b, &info));
  T_CHECK(info.caps & EP_CAP_COMBINE_BUFFER, "caps %#x lack EP_CAP_COMBINE_BUFFER", info.caps);
  uint16_t *y[64] = {0}, *bias[64] = {0};
  void *x = t_dalloc(NMAX * H * 2), *idx = t_dalloc(NMAX * TOPK * 8),
       *w = t_dalloc(NMAX * TOPK * 4);
  void *sc = t_dalloc(NMAX * (H / 128) * 4), *b0 = t_dalloc(NMAX * H * 2);
  void *out = t_dalloc(NMAX * H * 2), *outw = t_dalloc(NMAX * TOPK * 4);
  for (int round = 0; round < rounds; round++) {
    make_inputs(&in, 100 + round);
    const int fp8 = round & 1, with_w = (round >> 1) & 1;
    float *scales[64] = {0};
    for (int s = 0; s < R; s++) {
      t_rng r = t_seed(0xb1a5 + (uint64_t)round, (uint64_t)s);
      free(bias[s]);
      bias[s] = t_xmalloc((size_t)NMAX * H * 2);
      for (int i = 0; i < NMAX * H; i++) bias[s][i] = t_rand_bf16(&r);
      scales[s] = t_xmalloc((size_t)NMAX * (H / 128) * 4);
      for (int i = 0; i < NMAX * (H / 128); i++) scales[s][i] = t_unit(&r) + 0.5f;
    }
    /* fp8 rows: the bf16 bytes' low halves as e4m3 codes (any byte is a valid code to move). */
    const size_t row = fp8 ? H : H * 2;
    uint8_t *x8 = t_xmalloc((size_t)NMAX * H);
    for (int i = 0; i < in.n[me] * H; i++) x8[i] = (uint8_t)(in.x[me][i] & 0x7e);
    t_copy_to_dev(x, fp8 ? (void *)x8 : (void *)in.x[me], (size_t)in.n[me] * row);
    t_copy_to_dev(sc, scales[me], (size_t)NMAX * (H / 128) * 4);
    t_copy_to_dev(idx, in.idx[me], (size_t)NMAX * TOPK * 8);
    t_copy_to_dev(w, in.w[me], (size_t)NMAX * TOPK * 4);
    t_copy_to_dev(b0, bias[me], (size_t)NMAX * H * 2);
    ep_dispatch_args_t a = {.size = sizeof a,
                            .x = x,
                            .x_scales = fp8 ? sc : NULL,
                            .dtype = fp8 ? EP_DTYPE_FP8_E4M3 : EP_DTYPE_BF16,
                            .num_scales = fp8 ? H / 128 : 0,
                            .num_tokens = in.n[me],
                            .hidden = H,
                            .topk_idx = idx,
                            .topk_weights = w,
                            .topk = TOPK,
                            .num_experts = in.E};
    ep_dispatch_out_t o = {.size = sizeof o, .mode = EP_OUTPUT_VIEWS};
    T_OK(ep_dispatch(b, &a, &o));
    const int nr = o.num_recv_tokens;
    /* The experts' outputs: random rows of every rank (rebuilt by everyone for the reference),
     * written straight into the combine buffer. */
    for (int s = 0; s < R; s++) {
      t_rng r = t_seed(0xc0b1 + (uint64_t)round, (uint64_t)s);
      free(y[s]);
      y[s] = t_xmalloc((size_t)in.wct * H * 2);
      for (size_t i = 0; i < (size_t)in.wct * H; i++) y[s][i] = t_rand_bf16(&r);
    }
    void *cb = NULL;
    T_OK(ep_get_combine_buffer(b, o.handle, &cb));
    T_CHECK(cb != NULL, "ep_get_combine_buffer gave NULL");
    t_copy_to_dev(cb, y[me], (size_t)nr * H * 2);
    ep_combine_args_t c = {.size = sizeof c,
                           .handle = o.handle,
                           .x = cb,
                           .topk_weights = with_w ? o.recv_topk_weights : NULL,
                           .bias = {b0, NULL},
                           .out = out,
                           .out_topk_weights = with_w ? outw : NULL};
    T_OK(ep_combine(b, &c));
    /* The reference: the same dispatch on the host, then the combine of y. */
    ref_rank_input_t ri[64];
    uint8_t *xs[64];
    for (int s = 0; s < R; s++) {
      xs[s] = t_xmalloc((size_t)NMAX * H);
      for (int i = 0; i < in.n[s] * H; i++) xs[s][i] = (uint8_t)(in.x[s][i] & 0x7e);
      ri[s] = (ref_rank_input_t){in.n[s], fp8 ? (const void *)xs[s] : (const void *)in.x[s],
                                 fp8 ? scales[s] : NULL, in.idx[s], in.w[s]};
    }
    ref_recv_t rr[64];
    memset(rr, 0, sizeof rr);
    T_CHECK(ref_dispatch(R, in.E, TOPK, row, fp8 ? H / 128 : 0, 1, ri, rr) == 0, "reference");
    T_CHECK(rr[me].nr == nr, "round %d: %d rows received, the reference has %d", round, nr,
            rr[me].nr);
    uint16_t *ro[64];
    float *row_w[64];
    const float *wv[64];
    const uint16_t *bv[64];
    for (int s = 0; s < R; s++) {
      ro[s] = t_xmalloc((size_t)NMAX * H * 2), row_w[s] = t_xmalloc(NMAX * TOPK * 4);
      wv[s] = rr[s].topk_weights, bv[s] = bias[s];
    }
    T_CHECK(ref_combine(R, H, TOPK, ri, rr, (const uint16_t *const *)y, with_w ? wv : NULL, bv,
                        NULL, ro, with_w ? row_w : NULL) == 0,
            "reference combine");
    uint16_t *got = t_to_host(out, (size_t)NMAX * H * 2);
    T_CHECK(!memcmp(got, ro[me], (size_t)in.n[me] * H * 2),
            "round %d (%s%s): combine out differs "
            "from the reference",
            round, fp8 ? "fp8" : "bf16", with_w ? ", weights" : "");
    if (with_w) {
      float *gw = t_to_host(outw, (size_t)NMAX * TOPK * 4);
      T_CHECK(!memcmp(gw, row_w[me], (size_t)in.n[me] * TOPK * 4), "round %d: out weights", round);
      free(gw);
    }
    for (int s = 0; s < R; s++)
      free(ro[s]), free(row_w[s]), free(xs[s]), free(scales[s]), ref_free_recv(&rr[s]);
    free(got), free(x8);
    T_OK(ep_handle_destroy(o.handle));
  }
  T_OK(ep_buffer_destroy(b));
  /* A combine area too small for the rows: refused, naming queue_bytes. */
  cfg.queue_bytes = 4096;
  T_OK(ep_buffer_create(g, &cfg, &b));
  make_inputs(&in, 999);
  for (int s = 0; s < R; s++) in.n[s] = NMAX; /* every rank receives well over 4096 * R bytes */
  for (int s = 0; s < R; s++)
    for (int i = 0; i < NMAX * TOPK; i++) in.idx[s][i] = i % TOPK == 0 ? (i / TOPK) % in.E : -1;
  t_copy_to_dev(x, in.x[me], (size_t)NMAX * H * 2);
  t_copy_to_dev(idx, in.idx[me], (size_t)NMAX * TOPK * 8);
  void *rx = t_dalloc((size_t)in.wct * H * 2);
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = NMAX,
                          .hidden = H,
                          .topk_idx = idx,
                          .topk = TOPK,
                          .num_experts = in.E};
  ep_dispatch_out_t o = {
      .size = sizeof o, .mode = EP_OUTPUT_CALLER, .recv_x = rx, .capacity = in.wct};
  T_OK(ep_dispatch(b, &a, &o));
  void *cb = NULL;
  ep_status_t st = ep_get_combine_buffer(b, o.handle, &cb);
  T_CHECK(st == EP_ERR_TOO_LARGE && strstr(ep_last_error(), "queue_bytes") && cb == NULL,
          "a combine buffer too small: %s (%s), expected EP_ERR_TOO_LARGE naming queue_bytes",
          ep_status_name(st), ep_last_error());
  T_OK(ep_handle_destroy(o.handle));
  T_OK(ep_buffer_destroy(b));
  void *all[] = {x, idx, w, sc, b0, out, outw, rx};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) t_dfree(all[i]);
  for (int s = 0; s < R; s++) free(y[s]), free(bias[s]);
  free_inputs(&in);
  t_fini(g);
  if (me == 0) printf("test_cuda cbuf: R=%d, %d rounds checked\n", R, rounds);
  return T_PASS;
}

/* ------------------------------------------------------------------ lifecycle cycles */

static size_t free_mem(void) {
  size_t f = 0, t = 0;
  CU(cudaMemGetInfo(&f, &t));
  return f;
}

static void one_cycle(int *R, int *me) {
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, me, R);
  ep_buffer_config_t cfg = cuda_cfg(0);
  T_OK(ep_buffer_create(g, &cfg, &b));
  round_trip(b, *R, *me);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_barrier(g)); /* every rank has freed: the device-wide figure is comparable */
  T_OK(ep_group_destroy(g));
}

static int cycles(int n) {
  int R, me;
  one_cycle(&R, &me); /* warm up: module load, context */
  size_t f0 = free_mem();
  for (int i = 0; i < n; i++) one_cycle(&R, &me);
  size_t f1 = free_mem();
  printf("rank %d: %d cycles: device free memory %.1f -> %.1f MiB\n", me, n, f0 / 1048576.0,
         f1 / 1048576.0);
  /* Other ranks may sit at another point of their last cycle: allow one buffer's worth. */
  T_CHECK(f1 + (64u << 20) >= f0, "device memory fell by %.1f MiB over %d cycles",
          (f0 - f1) / 1048576.0, n);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "graph";
  if (!strcmp(mode, "overflow")) t_log_to_file(); /* it reads the library's warnings */
  if (!t_cuda()) setenv("EP_BACKEND", "cuda", 1);
  t_require_backend();
  if (!strcmp(mode, "graph")) return graph(argc > 2 ? atoi(argv[2]) : 5);
  if (!strcmp(mode, "timeout")) return timeout();
  if (!strcmp(mode, "cycles")) return cycles(argc > 2 ? atoi(argv[2]) : 100);
  if (!strcmp(mode, "overflow")) return overflow();
  if (!strcmp(mode, "cbuf")) return cbuf(argc > 2 ? atoi(argv[2]) : 8);
  if (!strcmp(mode, "onwait")) return onwait();
  fprintf(stderr, "unknown mode %s\n", mode);
  return T_FAIL;
}
#endif
