/* Low-latency mode on the CUDA backend only (SEMANTICS.md §6, §7, §8 on the GPU); skipped with a
 * visible reason without a GPU. tests/test_ll and tests/test_ll_misuse run the common matrix on
 * either backend; this program covers what only the GPU has:
 *   test_cuda_ll graph N      dispatch + combine captured in CUDA graphs, one phase (bf16, fp8
 *                             with column-major scales) and two phases with a zero-copy combine
 *                             (the experts' copy into the combine buffer captured between
 *                             them), each replayed N times with new inputs and routing, every
 *                             replay checked against the reference; then eager calls on the same
 *                             buffer (counters advance on the device alike)
 *   test_cuda_ll hooks        two-phase calls with the device busy between send and receive
 *   test_cuda_ll deferred     a replayed graph's dispatch fails (the last rank's expert out of
 *                             range; nobody waits on the host) while the other ranks' hosts
 *                             already wait for the eager dispatch behind it: that failure moved
 *                             no data and is logged naming the replay's call, the eager dispatch
 *                             and combine go through on every rank
 *   test_cuda_ll deferred-combine  the same with a replayed combine that fails (the late rank's
 *                             topk_idx differs from its dispatch's), found by the eager dispatch
 *   test_cuda_ll deferred-timeout  the same replay, then the late rank skips the eager dispatch:
 *                             the others return EP_ERR_TIMEOUT naming it within the deadline
 *   test_cuda_ll timeout      a peer that never calls: the dispatch returns EP_ERR_TIMEOUT naming
 *                             it; the context stays usable (a fresh buffer then works)
 *   test_cuda_ll cycles N     N x (group, buffer, dispatch + combine, destroy): device memory flat
 */
#include <unistd.h>

#include "ll_world.h"
#include "tk_clock.h"

#ifndef EP_HAVE_CUDA
int main(void) {
  printf("skipped: no GPU (the CUDA backend is not built)\n");
  return T_SKIP;
}
#else
#include <cuda_runtime_api.h>

#define CU T_CUDA

static const llw_cfg_t gcfg = {16, 512, 0, 8}; /* E: 4 experts per rank */

/* ------------------------------------------------------------------ graphs */

typedef struct {
  int fmt, two_phase, zero_copy, cols;
  const char *name;
} gcase_t;

/* The fixed device tensors a graph reads and writes; every replay refills the inputs. */
typedef struct {
  void *x, *w, *y, *out;
  int64_t *idx;
  size_t ybytes;
} gbufs_t;

/* Every rank's expert outputs for round `seed`, rebuilt alike by every rank. */
static uint16_t **make_y(const llw_round_t *rd, uint64_t seed) {
  size_t n = (size_t)(rd->c.E / rd->R) * rd->R * rd->c.T * rd->c.H;
  uint16_t **y = t_xmalloc(sizeof *y * (size_t)rd->R);
  for (int s = 0; s < rd->R; s++) {
    t_rng r = t_seed(seed ^ 0x7e7eull, (uint64_t)s);
    y[s] = t_xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) y[s][i] = t_rand_bf16(&r);
  }
  return y;
}

static void check_combine(const llw_round_t *rd, uint16_t **y, const void *dout, const char *what) {
  uint16_t **want = t_xmalloc(sizeof *want * (size_t)rd->R);
  for (int s = 0; s < rd->R; s++) want[s] = t_xmalloc((size_t)rd->in[s].n * rd->c.H * 2 + 2);
  T_CHECK(ref_ll_combine(rd->R, rd->c.T, rd->c.E, rd->c.H, rd->k.topk, rd->in,
                         (const uint16_t *const *)y, 1, want) == 0,
          "reference ll combine");
  int n = rd->in[rd->me].n;
  uint16_t *got = t_to_host(dout, (size_t)n * rd->c.H * 2);
  llw_cmp(got, want[rd->me], (size_t)n * rd->c.H * 2, what);
  for (int s = 0; s < rd->R; s++) free(want[s]);
  free(want), free(got);
}

/* Nothing runs during a capture: only the shapes and the tensors' addresses are taken. */
static void capture(ep_buffer_t buf, const gcase_t *gc, int T, int topk, gbufs_t *d,
                    cudaStream_t st, ep_ll_handle_t *h, cudaGraphExec_t *ge) {
  ep_ll_dispatch_args_t a = EP_LL_DISPATCH_ARGS_INIT;
  a.x = d->x, a.num_tokens = T, a.topk_idx = d->idx, a.topk = topk;
  a.use_fp8 = gc->fmt != F_BF16, a.round_scale = gc->fmt >= F_FP8_ROUND;
  a.use_ue8m0 = gc->fmt == F_FP8_UE8M0, a.two_phase = gc->two_phase, a.stream = st;
  a.scale_layout = gc->cols ? EP_SCALES_COL_MAJOR : EP_SCALES_ROW_MAJOR;
  ep_ll_combine_args_t c = EP_LL_COMBINE_ARGS_INIT;
  c.y = d->y, c.topk_idx = d->idx, c.topk_weights = d->w, c.out = d->out;
  c.two_phase = gc->two_phase, c.stream = st;
  cudaGraph_t g;
  CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  T_OK(ep_ll_dispatch(buf, &a, h));
  int nr = 0;
  T_OK(ep_ll_handle_num_recv_tokens(*h, &nr));
  T_CHECK(nr == -1, "captured dispatch: num_recv_tokens %d, expected -1 (not known on the host)",
          nr);
  if (gc->two_phase) T_OK(ep_ll_recv(buf, *h));
  if (gc->zero_copy) { /* the experts' output lands in the combine buffer: a copy stands for them */
    void *zy = NULL;
    T_OK(ep_ll_get_combine_buffer(buf, *h, &zy));
    CU(cudaMemcpyAsync(zy, d->y, d->ybytes, cudaMemcpyDeviceToDevice, st));
    c.y = zy;
  }
  c.handle = *h;
  T_OK(ep_ll_combine(buf, &c));
  if (gc->two_phase) T_OK(ep_ll_recv(buf, *h));
  CU(cudaStreamEndCapture(st, &g));
  CU(cudaGraphInstantiate(ge, g, 0));
  CU(cudaGraphDestroy(g));
}

static void replay(ep_buffer_t buf, const gcase_t *gc, int R, int me, gbufs_t *d, cudaStream_t st,
                   ep_ll_handle_t h, cudaGraphExec_t ge, int round) {
  llw_cfg_t c = gcfg;
  c.E = 4 * R;
  llw_case_t k = {.topk = 6,
                  .routing = round % 2 ? RT_MASKED : RT_SKEW,
                  .nmode = NM_FULL,
                  .fmt = gc->fmt,
                  .cols = gc->cols};
  llw_round_t rd;
  llw_gen(&rd, R, me, &c, &k, 0x9a000ull + (uint64_t)round * 31 + (uint64_t)gc->fmt);
  uint16_t **y = make_y(&rd, (uint64_t)round);
  t_copy_to_dev(d->x, rd.x[me], (size_t)c.T * c.H * 2);
  t_copy_to_dev(d->idx, rd.idx[me], (size_t)c.T * k.topk * 8);
  t_copy_to_dev(d->w, rd.w[me], (size_t)c.T * k.topk * 4);
  t_copy_to_dev(d->y, y[me], d->ybytes);
  CU(cudaGraphLaunch(ge, st));
  CU(cudaStreamSynchronize(st));
  rd.h = h; /* the captured handle's view holds this replay's rows */
  llw_check_view(&rd);
  rd.h = NULL;
  static char what[96];
  snprintf(what, sizeof what, "%s replay %d: combine out", gc->name, round);
  check_combine(&rd, y, d->out, what);
  for (int s = 0; s < R; s++) free(y[s]);
  free(y);
  llw_free(&rd);
  (void)buf;
}

static int graph(int replays) {
  static const gcase_t cases[] = {
      {F_BF16, 0, 0, 0, "one phase bf16"},
      {F_FP8, 0, 0, 1, "one phase fp8, column-major scales"},
      {F_FP8_UE8M0, 1, 1, 0, "two phases fp8-ue8m0, zero copy"},
      {F_BF16, 1, 1, 0, "two phases bf16, zero copy"},
  };
  ep_group_t g;
  int R, me;
  t_init(&g, &me, &R);
  llw_cfg_t c = gcfg;
  c.E = 4 * R;
  ep_buffer_t buf;
  llw_buffer(g, &c, &buf);
  gbufs_t d;
  d.ybytes = (size_t)c.E / R * R * c.T * c.H * 2;
  d.x = t_dalloc((size_t)c.T * c.H * 2), d.idx = t_dalloc((size_t)c.T * c.K * 8);
  d.w = t_dalloc((size_t)c.T * c.K * 4), d.y = t_dalloc(d.ybytes);
  d.out = t_dalloc((size_t)c.T * c.H * 2);
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    t_case = cases[i].name;
    ep_ll_handle_t h = NULL;
    cudaGraphExec_t ge;
    capture(buf, &cases[i], c.T, 6, &d, st, &h, &ge);
    for (int r = 0; r < replays; r++) replay(buf, &cases[i], R, me, &d, st, h, ge, r);
    /* Eager calls between replays keep the ranks' device counters alike. */
    llw_round_t rd;
    llw_case_t k = {.topk = 5,
                    .routing = RT_MASKED,
                    .nmode = NM_RANDOM,
                    .fmt = F_FP8,
                    .two_phase = 1,
                    .zero_copy = 1};
    llw_gen(&rd, R, me, &c, &k, 0xe9e9ull + i);
    llw_dispatch(&rd, buf, NULL, NULL);
    llw_combine(&rd, buf, 0xe9e9ull + i, NULL, NULL);
    llw_free(&rd);
    replay(buf, &cases[i], R, me, &d, st, h, ge, replays);
    CU(cudaGraphExecDestroy(ge));
    T_OK(ep_ll_handle_destroy(h));
  }
  t_case = NULL;
  CU(cudaStreamDestroy(st));
  t_dfree(d.x), t_dfree(d.idx), t_dfree(d.w), t_dfree(d.y), t_dfree(d.out);
  T_OK(ep_buffer_destroy(buf));
  t_fini(g);
  if (me == 0)
    printf("test_cuda_ll graph: R=%d, %zu graphs x %d replays checked\n", R,
           sizeof cases / sizeof cases[0], replays + 1);
  return T_PASS;
}

/* ------------------------------------------------------------------ hooks */

typedef struct {
  void *scratch;
  size_t bytes;
} busy_t;

/* The caller's own work between send and receive: the device is busy (memsets on the default
 * stream, which the calls' stream follows), the peers' rows land meanwhile. */
static void busy(void *arg) {
  busy_t *b = arg;
  for (int i = 0; i < 8; i++) CU(cudaMemsetAsync(b->scratch, i, b->bytes, 0));
}

/* x rewritten on the calls' stream just before the send, behind a long queue: the send (on the
 * buffer's hook stream) must start after it, or it reads the 0xff pattern and the view differs
 * from the reference. */
static void *late_input(llw_round_t *rd, busy_t *b) {
  size_t bytes = (size_t)rd->in[rd->me].n * (size_t)rd->c.H * 2;
  if (!bytes) return NULL;
  void *good = t_dalloc(bytes); /* freed by the caller after the round (cudaFree synchronises) */
  CU(cudaMemcpy(good, rd->dx, bytes, cudaMemcpyDeviceToDevice));
  CU(cudaMemsetAsync(rd->dx, 0xff, bytes, 0));
  busy(b);
  CU(cudaMemcpyAsync(rd->dx, good, bytes, cudaMemcpyDeviceToDevice, 0));
  return good; /* no synchronisation: the dispatch is queued right behind the copy */
}

static int hooks(void) {
  ep_group_t g;
  int R, me;
  t_init(&g, &me, &R);
  llw_cfg_t c = {32, 7168, 8 * R, 8};
  ep_buffer_t buf;
  llw_buffer(g, &c, &buf);
  busy_t b = {t_dalloc(256u << 20), 256u << 20};
  for (int i = 0; i < 6; i++) {
    llw_case_t k = {.topk = 8,
                    .routing = i % 3,
                    .nmode = NM_FULL,
                    .fmt = i % 4,
                    .two_phase = 1,
                    .zero_copy = i % 2};
    static char desc[64];
    snprintf(desc, sizeof desc, "hooks round %d", i);
    t_case = desc;
    llw_round_t rd;
    llw_gen(&rd, R, me, &c, &k, 0x400 + (uint64_t)i);
    void *good = i % 2 ? late_input(&rd, &b) : NULL;
    llw_dispatch(&rd, buf, busy, &b);
    llw_combine(&rd, buf, 0x500 + (uint64_t)i, busy, &b);
    llw_free(&rd);
    if (good) t_dfree(good);
  }
  t_case = NULL;
  t_dfree(b.scratch);
  T_OK(ep_buffer_destroy(buf));
  t_fini(g);
  if (me == 0) printf("test_cuda_ll hooks: R=%d passed\n", R);
  return T_PASS;
}

/* ------------------------------------------------------------------ deferred failures */

/* The late rank's (the last's) failing entry is [1][1] of a call with topk 4, captured in a
 * graph before any eager call (the buffer's last call key is then the eager calls' topk 6, which
 * would decode the entry as [0][5]). */
static int failing_entry(const llw_round_t *rd) {
  return 1 * rd->k.topk + 1;
}

/* The combine form's topk_idx: the dispatch's, but on the late rank entry [1][1] names another
 * expert, one the token does not already name. */
static void *failing_combine_idx(const llw_round_t *rd, int R, int me) {
  const size_t nk = (size_t)rd->in[me].n * (size_t)rd->k.topk;
  int64_t *h = t_xmalloc(nk * 8);
  memcpy(h, rd->idx[me], nk * 8);
  const int k = rd->k.topk, at = failing_entry(rd);
  for (int64_t e = (h[at] + 1) % rd->c.E; me == R - 1; e = (e + 1) % rd->c.E) {
    bool used = false;
    for (int j = 0; j < k; j++) used |= h[1 * k + j] == e;
    if (!used) {
      h[at] = e;
      break;
    }
  }
  void *d = t_to_dev(h, nk * 8);
  free(h);
  return d;
}

/* The dispatch form (cidx NULL): the late rank names expert E + 3 in its dispatch. The combine
 * form: a good dispatch and its combine (y = the view) whose topk_idx differs on the late rank:
 * its combine check fails (recorded for a later call), its peers' receives find it rejected
 * (the same); *cidx, *out: the combine's tensors, freed by the caller. */
static cudaGraphExec_t capture_failing(ep_buffer_t buf, int R, int me, llw_round_t *rd,
                                       cudaStream_t st, void **cidx, void **out) {
  if (!cidx && me == R - 1) rd->idx[me][failing_entry(rd)] = rd->c.E + 3;
  llw_upload(rd);
  if (cidx) *cidx = failing_combine_idx(rd, R, me);
  if (cidx) *out = t_dalloc((size_t)rd->in[me].n * (size_t)rd->c.H * 2);
  ep_ll_dispatch_args_t a;
  llw_args(rd, &a);
  a.stream = st;
  cudaGraph_t gr;
  cudaGraphExec_t ge;
  CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  T_OK(ep_ll_dispatch(buf, &a, &rd->h));
  if (cidx) {
    ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
    T_OK(ep_ll_get_recv_view(rd->h, &v));
    ep_ll_combine_args_t c = EP_LL_COMBINE_ARGS_INIT;
    c.handle = rd->h, c.y = v.recv_x, c.topk_idx = *cidx, c.topk_weights = rd->dw;
    c.out = *out, c.stream = st;
    T_OK(ep_ll_combine(buf, &c));
  }
  CU(cudaStreamEndCapture(st, &gr));
  CU(cudaGraphInstantiate(&ge, gr, 0));
  CU(cudaGraphDestroy(gr));
  return ge;
}

/* The replay, with the late rank 100 ms late: the other ranks' gates wait for its entry, find it
 * rejected and record the failure for a later call (nobody waits for a replay), while their
 * hosts already wait for the eager dispatch queued behind it. Nothing that synchronises with the
 * device may run between this and the eager dispatch. */
static void replay_late(int R, int me, cudaGraphExec_t ge, cudaStream_t st, cudaEvent_t ev) {
  t_dsync(); /* the previous calls are behind us: the replay follows them */
  if (me == R - 1) usleep(100 * 1000);
  CU(cudaGraphLaunch(ge, st));
  CU(cudaEventRecord(ev, st)); /* the eager calls (legacy stream) follow the replay */
  CU(cudaStreamWaitEvent(0, ev, 0));
}

typedef struct {
  ep_group_t g;
  int R, me;
  llw_cfg_t c;
  ep_buffer_t buf;
  cudaStream_t st;
  cudaEvent_t ev;
  llw_round_t bad;
  cudaGraphExec_t ge;
  void *cidx, *out; /* the combine form's */
} deferred_t;

static bool deferred_init(deferred_t *d, double timeout_s, bool comb) {
  t_init(&d->g, &d->me, &d->R);
  if (d->R < 2) {
    printf("skipped: needs 2 ranks\n");
    t_fini(d->g);
    return false;
  }
  d->c = gcfg;
  d->c.E = 4 * d->R;
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = d->c.T, cfg.ll_hidden = d->c.H, cfg.ll_num_experts = d->c.E;
  cfg.ll_max_topk = d->c.K, cfg.timeout_s = timeout_s;
  T_OK(ep_buffer_create(d->g, &cfg, &d->buf));
  CU(cudaStreamCreateWithFlags(&d->st, cudaStreamNonBlocking));
  CU(cudaEventCreateWithFlags(&d->ev, cudaEventDisableTiming));
  llw_case_t kb = {.topk = 4, .routing = RT_SKEW, .nmode = NM_FULL};
  llw_gen(&d->bad, d->R, d->me, &d->c, &kb, 0xdef0ull);
  d->cidx = d->out = NULL;
  d->ge = capture_failing(d->buf, d->R, d->me, &d->bad, d->st, comb ? &d->cidx : NULL, &d->out);
  return true;
}

static void deferred_fini(deferred_t *d) {
  CU(cudaGraphExecDestroy(d->ge));
  llw_free(&d->bad); /* the captured handle too */
  t_dfree(d->cidx), t_dfree(d->out);
  CU(cudaEventDestroy(d->ev));
  CU(cudaStreamDestroy(d->st));
}

/* comb: the replayed failure is a combine's, found by the eager dispatch after it (the warning
 * must name the combine, not the call that finds it). */
static int deferred(bool comb) {
  deferred_t d;
  if (!deferred_init(&d, 0, comb)) return T_SKIP;
  const int R = d.R, me = d.me;
  /* The failure names the replay's call, its entry decoded with its own topk. */
  char want[96];
  if (comb && me == R - 1)
    snprintf(want, sizeof want, "moved no data: ep_ll_combine: check: topk_idx[1][1] is ");
  else if (comb)
    snprintf(want, sizeof want, "moved no data: ep_ll_combine: recv: rank %d rejected", R - 1);
  else if (me == R - 1)
    snprintf(want, sizeof want, "moved no data: ep_ll_dispatch: topk_idx[1][1] is %d", d.c.E + 3);
  else
    snprintf(want, sizeof want, "moved no data: ep_ll_dispatch: gate: rank %d rejected", R - 1);
  for (int i = 0; i < 3; i++) {
    llw_case_t k = {.topk = 6, .routing = RT_MASKED, .nmode = NM_RANDOM, .fmt = i % 2};
    llw_round_t rd;
    llw_gen(&rd, R, me, &d.c, &k, 0xdef1ull + (uint64_t)i);
    replay_late(R, me, d.ge, d.st, d.ev);
    llw_dispatch(&rd, d.buf, NULL, NULL); /* fails the test unless EP_OK with the reference rows */
    llw_combine(&rd, d.buf, 0xdef9ull + (uint64_t)i, NULL, NULL);
    llw_free(&rd);
    T_CHECK(t_logged(want), "round %d: no warning \"%s...\" in %s (the replay's failure)", i, want,
            getenv("EP_LOG_FILE"));
  }
  deferred_fini(&d);
  T_OK(ep_buffer_destroy(d.buf));
  t_fini(d.g);
  t_log_remove();
  if (me == 0)
    printf("test_cuda_ll deferred%s: R=%d, 3 rounds passed\n", comb ? "-combine" : "", R);
  return T_PASS;
}

/* The same replay, then the late rank never makes the eager dispatch: the others' gates give up
 * on it after the deadline (2 s) and that timeout replaces the replay's no-data failure in the
 * error word, so their hosts, waiting past that word, return it at once, naming the late rank,
 * instead of their own deadline (10 s later: "the kernel did not report"). */
static int deferred_timeout(void) {
  deferred_t d;
  if (!deferred_init(&d, 2.0, false)) return T_SKIP;
  const int R = d.R, me = d.me;
  llw_case_t k = {.topk = 6, .routing = RT_MASKED, .nmode = NM_FULL};
  llw_round_t rd;
  llw_gen(&rd, R, me, &d.c, &k, 0xdefaull);
  replay_late(R, me, d.ge, d.st, d.ev);
  if (me != R - 1) {
    ep_ll_dispatch_args_t a;
    llw_args(&rd, &a);
    const double t0 = tk_now_s();
    ep_status_t st = ep_ll_dispatch(d.buf, &a, &rd.h);
    const double dt = tk_now_s() - t0;
    char name[32];
    snprintf(name, sizeof name, "rank %d", R - 1);
    T_CHECK(st == EP_ERR_TIMEOUT, "dispatch returned %s (%s), expected EP_ERR_TIMEOUT",
            ep_status_name(st), ep_last_error());
    T_CHECK(strstr(ep_last_error(), name) && !strstr(ep_last_error(), "did not report"),
            "the timeout does not come from the gate naming %s: %s", name, ep_last_error());
    T_CHECK(dt < 6.0, "the dispatch returned after %.1f s (deadline 2 s)", dt);
    printf("rank %d: %s after %.2f s: %s\n", me, ep_status_name(st), dt, ep_last_error());
  }
  /* All meet in a fresh group first, so that the late rank lives, its pool mapped, until the
   * others have returned (an exited rank is a dead peer, which would end their wait before the
   * deadline). The handles' release kernels write into the peers' pools: every rank finishes
   * them before any rank lets its broken buffer go (locally: release, not destroy). */
  ep_group_t g2;
  int me2, R2;
  t_init(&g2, &me2, &R2);
  t_dsync();
  llw_free(&rd);
  deferred_fini(&d);
  t_dsync();
  T_OK(ep_group_barrier(g2));
  T_OK(ep_buffer_release(d.buf));
  T_OK(ep_group_release(d.g));
  t_fini(g2);
  if (me != R - 1) t_logged("moved no data"); /* a replay's failure taken at the call's entry */
  t_log_remove();
  return T_PASS;
}

/* ------------------------------------------------------------------ timeouts */

static int timeout(void) {
  ep_group_t g;
  int R, me;
  t_init(&g, &me, &R);
  if (R < 2) {
    printf("skipped: needs 2 ranks\n");
    t_fini(g);
    return T_SKIP;
  }
  llw_cfg_t c = {8, 256, 4 * R, 4};
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = c.T, cfg.ll_hidden = c.H, cfg.ll_num_experts = c.E, cfg.ll_max_topk = c.K;
  cfg.timeout_s = 2.0;
  ep_buffer_t b1, b2;
  T_OK(ep_buffer_create(g, &cfg, &b1));
  llw_case_t k = {.topk = 4, .nmode = NM_FULL};
  llw_round_t rd;
  llw_gen(&rd, R, me, &c, &k, 77);
  if (me == 0) { /* rank 1 never comes: the gate gives up, naming it */
    ep_ll_dispatch_args_t a;
    llw_args(&rd, &a);
    ep_ll_handle_t h = NULL;
    ep_status_t st = ep_ll_dispatch(b1, &a, &h);
    T_CHECK(st == EP_ERR_TIMEOUT, "dispatch returned %s (%s), expected EP_ERR_TIMEOUT",
            ep_status_name(st), ep_last_error());
    T_CHECK(strstr(ep_last_error(), "peer rank 1") || strstr(ep_last_error(), "rank 1 "),
            "the message does not name rank 1: %s", ep_last_error());
    T_CHECK(h == NULL, "a failed dispatch returned a handle");
    printf("low-latency dispatch alone: %s\n", ep_last_error());
    T_STATUS(EP_ERR_BROKEN, ep_ll_dispatch(b1, &a, &h));
  }
  llw_free(&rd);
  /* The timeout broke rank 0's group (only local teardown remains there): every rank lets its
   * objects go locally and all meet again in a fresh group. */
  T_OK(ep_buffer_release(b1));
  T_OK(ep_group_release(g));
  t_init(&g, &me, &R);
  /* No trap: the context works, a fresh buffer moves data. */
  llw_buffer(g, &c, &b2);
  llw_gen(&rd, R, me, &c, &k, 78);
  llw_dispatch(&rd, b2, NULL, NULL);
  llw_combine(&rd, b2, 79, NULL, NULL);
  llw_free(&rd);
  T_OK(ep_buffer_destroy(b2));
  t_fini(g);
  return T_PASS;
}

/* ------------------------------------------------------------------ lifecycle cycles */

static size_t free_mem(void) {
  size_t f = 0, t = 0;
  CU(cudaMemGetInfo(&f, &t));
  return f;
}

static void one_cycle(int *R, int *me, int i) {
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, me, R);
  llw_cfg_t c = {8, 1024, 4 * *R, 4};
  llw_buffer(g, &c, &b);
  llw_case_t k = {.topk = 4, .nmode = NM_RANDOM, .fmt = i % 4, .zero_copy = i % 2};
  llw_round_t rd;
  llw_gen(&rd, *R, *me, &c, &k, 0xcc00 + (uint64_t)i);
  llw_dispatch(&rd, b, NULL, NULL);
  llw_combine(&rd, b, 0xcd00 + (uint64_t)i, NULL, NULL);
  llw_free(&rd);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_barrier(g)); /* every rank has freed: the device-wide figure is comparable */
  T_OK(ep_group_destroy(g));
}

static int cycles(int n) {
  int R, me;
  one_cycle(&R, &me, 0); /* warm up: module load, context */
  size_t f0 = free_mem();
  for (int i = 0; i < n; i++) one_cycle(&R, &me, i + 1);
  size_t f1 = free_mem();
  printf("rank %d: %d low-latency cycles: device free memory %.1f -> %.1f MiB\n", me, n,
         f0 / 1048576.0, f1 / 1048576.0);
  T_CHECK(f1 + (64u << 20) >= f0, "device memory fell by %.1f MiB over %d cycles",
          (f0 - f1) / 1048576.0, n);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "graph";
  if (!strncmp(mode, "deferred", 8)) t_log_to_file(); /* it reads the library's warnings */
  if (!t_cuda()) setenv("EP_BACKEND", "cuda", 1);
  t_require_backend();
  if (!strcmp(mode, "graph")) return graph(argc > 2 ? atoi(argv[2]) : 4);
  if (!strcmp(mode, "deferred")) return deferred(false);
  if (!strcmp(mode, "deferred-combine")) return deferred(true);
  if (!strcmp(mode, "deferred-timeout")) return deferred_timeout();
  if (!strcmp(mode, "hooks")) return hooks();
  if (!strcmp(mode, "timeout")) return timeout();
  if (!strcmp(mode, "cycles")) return cycles(argc > 2 ? atoi(argv[2]) : 50);
  fprintf(stderr, "unknown mode %s\n", mode);
  return T_FAIL;
}
#endif
