/* GPU benchmark of low-latency mode (`epcomm bench --mode ll --backend cuda`), run under
 * `epcomm launch -n R` with the ranks on one GPU (under MPS) or on several:
 *   cuda_bench_ll [--tokens 128] [--hidden 7168] [--topk 8] [--experts 288] [--sms S]
 *                 [--iters 200] [--warmup 20] [--compute-us 200]
 * DeepEP's low-latency sizes by default (E rounded down to a multiple of R). Every call is timed
 * on its stream with CUDA events, the calls of all iterations queued back to back with no host
 * synchronisation in between (EP_CUDA_LL_ASYNC=1: the calls never wait on the host, as in a
 * graph); each rank's median and p90 over the iterations, and the slowest rank's figures are
 * reported. Measured:
 *   - one phase: dispatch (bf16, fp8) and combine (y in caller memory; y = the bf16 view, pushed
 *     back; zero copy: y in ep_ll_get_combine_buffer's area, read in place by the sources);
 *   - two phases: send and receive of dispatch (bf16, fp8) and combine, apart;
 *   - CUDA graph: dispatch + combine captured once, replayed, against the same calls' sum;
 *   - overlap: send -> a compute kernel of the caller over every SM (an FMA loop sized to about
 *     --compute-us) -> receive; efficiency = (communication alone + compute alone) / overlapped.
 * The last combine of every form is checked: with weights 1/8 and y = the dispatched rows,
 * out[t] = bf16(x[t] * selections / 8) exactly. Self-contained on purpose (public header and
 * CUDA runtime only), beside bench/cuda_bench.cu. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "epcomm.h"

#define CU(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) die("%s: %s", #call, cudaGetErrorString(e_));                \
  } while (0)
#define EP(call)                                                                        \
  do {                                                                                  \
    ep_status_t s_ = (call);                                                            \
    if (s_ != EP_OK) die("%s: %s: %s", #call, ep_status_name(s_), ep_last_error());     \
  } while (0)

static int g_rank = -1;
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "cuda_bench_ll rank %d: ", g_rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

typedef struct {
  int T, H, topk, E, sms, iters, warmup;
  double compute_us;
} opts_t;

static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* ------------------------------------------------------------------ the caller's compute */

/* An FMA loop over every SM: what a caller runs between the two phases (an expert GEMM, the
 * attention of the other micro-batch). */
__global__ void burn(float *sink, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f, d = blockIdx.x * 1e-3f;
  for (int i = 0; i < iters; i++) {
    a = fmaf(a, b, c);
    d = fmaf(d, c, b);
    b = fmaf(b, 0.99999f, 1e-6f);
    c = fmaf(c, 1.00001f, -1e-6f);
  }
  if (a + d == 12345.0f) sink[threadIdx.x] = a + d; /* never true: keeps the loop */
}

/* ------------------------------------------------------------------ state */

typedef struct {
  ep_group_t g;
  ep_buffer_t buf;
  int R, me, dev, L, sms;
  opts_t o;
  cudaStream_t st;
  void *x, *y, *out;       /* device: x [T][H], y [L][R*T][H] (caller memory), out [T][H] */
  int64_t *idx;            /* device [T][topk] */
  float *w, *sink;         /* device [T][topk] weights 1/8; burn's sink */
  uint16_t *hx;            /* host copies for the check */
  int64_t *hidx;
  int burn_blocks, burn_iters;
  std::vector<cudaEvent_t> ev;
} bench_t;

static double slowest(bench_t *b, double mine) {
  std::vector<double> all((size_t)b->R);
  EP(ep_group_allgather(b->g, &mine, all.data(), sizeof mine));
  return *std::max_element(all.begin(), all.end());
}

/* A rank's median and p90 of per-iteration times; both the slowest rank's. */
typedef struct {
  double med, p90;
} fig_t;

static fig_t figure(bench_t *b, std::vector<double> v) {
  std::sort(v.begin(), v.end());
  fig_t f = {v[v.size() / 2], v[(size_t)(0.9 * (double)(v.size() - 1))]};
  f.med = slowest(b, f.med), f.p90 = slowest(b, f.p90);
  return f;
}

static void make_inputs(bench_t *b) {
  const opts_t *o = &b->o;
  uint64_t s = 0x11ee + (uint64_t)b->me * 7919;
  size_t n = (size_t)o->T * o->H;
  b->hx = (uint16_t *)malloc(n * 2);
  b->hidx = (int64_t *)malloc((size_t)o->T * o->topk * 8);
  std::vector<float> hw((size_t)o->T * o->topk, 0.125f);
  for (size_t i = 0; i < n; i++) b->hx[i] = (uint16_t)(0x3c00 + mix(&s) % 0x0800); /* [2^-7, 2) */
  for (int t = 0; t < o->T; t++)
    for (int k = 0; k < o->topk; k++) {
      int64_t e;
      bool dup;
      do { /* distinct experts per token, uniform over all of them */
        e = (int64_t)(mix(&s) % (uint64_t)o->E);
        dup = false;
        for (int j = 0; j < k; j++) dup |= b->hidx[(size_t)t * o->topk + j] == e;
      } while (dup);
      b->hidx[(size_t)t * o->topk + k] = e;
    }
  size_t ybytes = (size_t)b->L * b->R * o->T * o->H * 2;
  CU(cudaMalloc(&b->x, n * 2));
  CU(cudaMalloc(&b->y, ybytes));
  CU(cudaMalloc(&b->out, n * 2));
  CU(cudaMalloc(&b->idx, (size_t)o->T * o->topk * 8));
  CU(cudaMalloc(&b->w, (size_t)o->T * o->topk * 4));
  CU(cudaMalloc(&b->sink, 4096));
  CU(cudaMemcpy(b->x, b->hx, n * 2, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(b->idx, b->hidx, (size_t)o->T * o->topk * 8, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(b->w, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
  CU(cudaMemset(b->y, 0, ybytes));
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* With weights 1/8 and y = the rows as dispatched: out[t] = bf16(x[t] * k / 8), exact in fp32. */
static int check_out(bench_t *b, const char *what) {
  const opts_t *o = &b->o;
  std::vector<uint16_t> out((size_t)o->T * o->H);
  CU(cudaStreamSynchronize(b->st));
  CU(cudaMemcpy(out.data(), b->out, out.size() * 2, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int t = 0; t < o->T; t++)
    for (int h = 0; h < o->H; h += 37) {
      uint32_t u = (uint32_t)b->hx[(size_t)t * o->H + h] << 16;
      float f;
      memcpy(&f, &u, 4);
      bad += out[(size_t)t * o->H + h] != to_bf16(f * (float)o->topk * 0.125f);
    }
  int all = (int)slowest(b, (double)bad);
  if (b->me == 0 && all) printf("check %s: FAILED (%d mismatches on one rank)\n", what, all);
  return all;
}

/* ------------------------------------------------------------------ calls */

static ep_ll_handle_t dispatch(bench_t *b, int fp8, int two_phase) {
  ep_ll_dispatch_args_t a = EP_LL_DISPATCH_ARGS_INIT;
  a.x = b->x, a.num_tokens = b->o.T, a.topk_idx = b->idx, a.topk = b->o.topk;
  a.use_fp8 = fp8, a.two_phase = two_phase, a.stream = b->st;
  ep_ll_handle_t h;
  EP(ep_ll_dispatch(b->buf, &a, &h));
  return h;
}

/* y: 0 caller memory, 1 the view's recv_x (bf16), 2 the combine buffer (zero copy). */
static const void *combine_y(bench_t *b, ep_ll_handle_t h, int ymode) {
  if (ymode == 0) return b->y;
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  EP(ep_ll_get_recv_view(h, &v));
  if (ymode == 1) return v.recv_x;
  void *zy;
  EP(ep_ll_get_combine_buffer(b->buf, h, &zy));
  return zy;
}

static void combine(bench_t *b, ep_ll_handle_t h, const void *y, int two_phase) {
  ep_ll_combine_args_t c = EP_LL_COMBINE_ARGS_INIT;
  c.handle = h, c.y = y, c.topk_idx = b->idx, c.topk_weights = b->w, c.out = b->out;
  c.two_phase = two_phase, c.stream = b->st;
  EP(ep_ll_combine(b->buf, &c));
}

/* y in caller memory: the bf16 rows as dispatched. The routing never changes, so a copy of one
 * bf16 view serves every later call. */
static void keep_rows(bench_t *b, ep_ll_handle_t h) {
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  EP(ep_ll_get_recv_view(h, &v));
  CU(cudaMemcpyAsync(b->y, v.recv_x, (size_t)b->L * v.max_rows * b->o.H * 2,
                     cudaMemcpyDeviceToDevice, b->st));
}

/* The experts' outputs for the zero-copy form: the rows as dispatched, written into the combine
 * buffer. The slots alternate and the routing never changes, so the first two (warm-up)
 * iterations fill both slots' areas for good. */
static void fill_zero_copy(bench_t *b, ep_ll_handle_t h) {
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  EP(ep_ll_get_recv_view(h, &v));
  void *zy;
  EP(ep_ll_get_combine_buffer(b->buf, h, &zy));
  CU(cudaMemcpyAsync(zy, v.recv_x, (size_t)b->L * v.max_rows * b->o.H * 2,
                     cudaMemcpyDeviceToDevice, b->st));
}

static cudaEvent_t *events(bench_t *b, int per_iter) {
  size_t need = (size_t)per_iter * (size_t)b->o.iters;
  while (b->ev.size() < need) {
    cudaEvent_t e;
    CU(cudaEventCreate(&e));
    b->ev.push_back(e);
  }
  return b->ev.data();
}

static double ms(cudaEvent_t a, cudaEvent_t z) {
  float v = 0;
  CU(cudaEventElapsedTime(&v, a, z));
  return 1e3 * v; /* microseconds */
}

static void start(bench_t *b) {
  CU(cudaStreamSynchronize(b->st));
  EP(ep_group_barrier(b->g));
}

/* One phase: dispatch, then combine with y as ymode says; per-iteration times of both. */
static void one_phase(bench_t *b, int fp8, int ymode, fig_t *d, fig_t *c, int *bad) {
  const int n = b->o.iters;
  cudaEvent_t *e = events(b, 3);
  start(b);
  for (int it = -b->o.warmup; it < n; it++) {
    cudaEvent_t *m = it >= 0 ? e + 3 * it : NULL;
    if (m) CU(cudaEventRecord(m[0], b->st));
    ep_ll_handle_t h = dispatch(b, fp8, 0);
    if (ymode == 1 && it == -b->o.warmup) keep_rows(b, h);
    if (ymode == 2 && it < -b->o.warmup + 2) fill_zero_copy(b, h);
    if (m) CU(cudaEventRecord(m[1], b->st));
    combine(b, h, combine_y(b, h, ymode), 0);
    if (m) CU(cudaEventRecord(m[2], b->st));
    EP(ep_ll_handle_destroy(h));
  }
  CU(cudaStreamSynchronize(b->st));
  std::vector<double> td, tc;
  for (int it = 0; it < n; it++) td.push_back(ms(e[3 * it], e[3 * it + 1])), tc.push_back(ms(e[3 * it + 1], e[3 * it + 2]));
  *d = figure(b, td), *c = figure(b, tc);
  *bad += check_out(b, ymode == 2 ? "zero-copy combine" : ymode ? "combine (view)" : "combine");
}

/* Two phases, each phase timed apart: dispatch send, receive, combine send, receive. */
static void two_phase(bench_t *b, int fp8, fig_t *f, int *bad) {
  const int n = b->o.iters;
  cudaEvent_t *e = events(b, 5);
  start(b);
  for (int it = -b->o.warmup; it < n; it++) {
    cudaEvent_t *m = it >= 0 ? e + 5 * it : NULL;
    if (m) CU(cudaEventRecord(m[0], b->st));
    ep_ll_handle_t h = dispatch(b, fp8, 1);
    if (m) CU(cudaEventRecord(m[1], b->st));
    EP(ep_ll_recv(b->buf, h));
    if (m) CU(cudaEventRecord(m[2], b->st));
    combine(b, h, combine_y(b, h, fp8 ? 0 : 1), 1);
    if (m) CU(cudaEventRecord(m[3], b->st));
    EP(ep_ll_recv(b->buf, h));
    if (m) CU(cudaEventRecord(m[4], b->st));
    EP(ep_ll_handle_destroy(h));
  }
  CU(cudaStreamSynchronize(b->st));
  for (int k = 0; k < 4; k++) {
    std::vector<double> t;
    for (int it = 0; it < n; it++) t.push_back(ms(e[5 * it + k], e[5 * it + k + 1]));
    f[k] = figure(b, t);
  }
  *bad += check_out(b, "two-phase combine");
}

/* Dispatch + combine captured once (one phase, y = the view), replayed. */
static fig_t graph(bench_t *b, int *bad) {
  cudaGraph_t gr;
  cudaGraphExec_t ge;
  ep_ll_handle_t h;
  CU(cudaStreamSynchronize(b->st));
  CU(cudaStreamBeginCapture(b->st, cudaStreamCaptureModeGlobal));
  h = dispatch(b, 0, 0);
  combine(b, h, combine_y(b, h, 1), 0);
  CU(cudaStreamEndCapture(b->st, &gr));
  CU(cudaGraphInstantiate(&ge, gr, 0));
  const int n = b->o.iters;
  cudaEvent_t *e = events(b, 2);
  start(b);
  for (int it = -b->o.warmup; it < n; it++) {
    if (it >= 0) CU(cudaEventRecord(e[2 * it], b->st));
    CU(cudaGraphLaunch(ge, b->st));
    if (it >= 0) CU(cudaEventRecord(e[2 * it + 1], b->st));
  }
  CU(cudaStreamSynchronize(b->st));
  std::vector<double> t;
  for (int it = 0; it < n; it++) t.push_back(ms(e[2 * it], e[2 * it + 1]));
  *bad += check_out(b, "graph replay");
  CU(cudaGraphExecDestroy(ge));
  CU(cudaGraphDestroy(gr));
  EP(ep_ll_handle_destroy(h));
  return figure(b, t);
}

/* Calibrates the compute kernel to about --compute-us on this rank (all ranks run it at once,
 * as they will between the phases). */
static void calibrate(bench_t *b) {
  int sms = 0;
  CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, b->dev));
  b->burn_blocks = 2 * sms, b->burn_iters = 4096;
  cudaEvent_t *e = events(b, 2);
  for (int round = 0; round < 3; round++) {
    start(b);
    CU(cudaEventRecord(e[0], b->st));
    burn<<<b->burn_blocks, 256, 0, b->st>>>(b->sink, b->burn_iters);
    CU(cudaEventRecord(e[1], b->st));
    CU(cudaStreamSynchronize(b->st));
    double us = slowest(b, ms(e[0], e[1]));
    b->burn_iters = std::max(64, (int)(b->burn_iters * b->o.compute_us / std::max(us, 1.0)));
  }
}

/* Overlap: send -> compute -> receive, for the dispatch and for the combine (two phases each);
 * against communication alone and compute alone. Times per iteration of the whole sequence. */
typedef struct {
  fig_t comm, compute, overlapped;
} overlap_t;

static void overlap_round(bench_t *b, int with_compute, int comm, cudaEvent_t *m) {
  CU(cudaEventRecord(m[0], b->st));
  ep_ll_handle_t h = comm ? dispatch(b, 0, 1) : NULL;
  if (with_compute) burn<<<b->burn_blocks, 256, 0, b->st>>>(b->sink, b->burn_iters);
  if (comm) EP(ep_ll_recv(b->buf, h));
  if (comm) combine(b, h, combine_y(b, h, 1), 1);
  if (with_compute) burn<<<b->burn_blocks, 256, 0, b->st>>>(b->sink, b->burn_iters);
  if (comm) EP(ep_ll_recv(b->buf, h));
  CU(cudaEventRecord(m[1], b->st));
  if (comm) EP(ep_ll_handle_destroy(h));
}

static overlap_t overlap(bench_t *b, int *bad) {
  overlap_t r;
  fig_t *f[3] = {&r.comm, &r.compute, &r.overlapped};
  const int modes[3][2] = {{0, 1}, {1, 0}, {1, 1}}; /* (compute, comm) */
  const int n = b->o.iters;
  cudaEvent_t *e = events(b, 2);
  for (int k = 0; k < 3; k++) {
    start(b);
    for (int it = -b->o.warmup; it < n; it++)
      overlap_round(b, modes[k][0], modes[k][1], it >= 0 ? e + 2 * it : e);
    CU(cudaStreamSynchronize(b->st));
    std::vector<double> t;
    for (int it = 0; it < n; it++) t.push_back(ms(e[2 * it], e[2 * it + 1]));
    *f[k] = figure(b, t);
  }
  *bad += check_out(b, "overlapped combine");
  return r;
}

/* ------------------------------------------------------------------ main */

static void parse(int argc, char **argv, opts_t *o) {
  *o = (opts_t){128, 7168, 8, 288, 0, 200, 20, 200.0};
  for (int i = 1; i + 1 < argc; i += 2) {
    int v = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--tokens")) o->T = v;
    else if (!strcmp(argv[i], "--hidden")) o->H = v;
    else if (!strcmp(argv[i], "--topk")) o->topk = v;
    else if (!strcmp(argv[i], "--experts")) o->E = v;
    else if (!strcmp(argv[i], "--sms")) o->sms = v;
    else if (!strcmp(argv[i], "--iters")) o->iters = v;
    else if (!strcmp(argv[i], "--warmup")) o->warmup = v;
    else if (!strcmp(argv[i], "--compute-us")) o->compute_us = atof(argv[i + 1]);
    else die("unknown option %s", argv[i]);
  }
  if (o->iters < 1 || o->T < 1 || o->H % 128 || o->topk < 1) die("bad sizes");
  o->warmup = std::max(o->warmup, 2); /* the zero-copy form fills its areas in warm-up */
}

static void row(const char *name, fig_t f) {
  printf("%-46s %9.1f %9.1f\n", name, f.med, f.p90);
}

int main(int argc, char **argv) {
  bench_t b{};
  parse(argc, argv, &b.o);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("skipped: no GPU\n");
    return 77;
  }
  setenv("EP_CUDA_LL_ASYNC", "1", 1); /* no host wait on the path: the GPU time of the calls */
  EP(ep_group_create_from_env(NULL, &b.g));
  EP(ep_group_rank(b.g, &b.me));
  EP(ep_group_nranks(b.g, &b.R));
  g_rank = b.me;
  const char *lr = getenv("EP_LOCAL_RANK");
  b.dev = (lr ? atoi(lr) : b.me) % ndev;
  CU(cudaSetDevice(b.dev));
  CU(cudaStreamCreateWithFlags(&b.st, cudaStreamNonBlocking));
  opts_t *o = &b.o;
  o->E -= o->E % b.R;
  if (o->E < b.R || o->topk > o->E) die("--experts %d too small for %d ranks", o->E, b.R);
  b.L = o->E / b.R;
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.backend = EP_BACKEND_CUDA;
  cfg.num_sms = o->sms;
  cfg.ll_max_tokens = o->T, cfg.ll_hidden = o->H, cfg.ll_num_experts = o->E;
  cfg.ll_max_topk = o->topk;
  EP(ep_buffer_create(b.g, &cfg, &b.buf));
  make_inputs(&b);

  int bad = 0;
  fig_t d16, c_view, d8, c_caller, dz, c_zc, tp16[4], tp8[4];
  one_phase(&b, 0, 1, &d16, &c_view, &bad);
  one_phase(&b, 1, 0, &d8, &c_caller, &bad);
  one_phase(&b, 0, 2, &dz, &c_zc, &bad);
  two_phase(&b, 0, tp16, &bad);
  two_phase(&b, 1, tp8, &bad);
  fig_t g = graph(&b, &bad);
  calibrate(&b);
  overlap_t ov = overlap(&b, &bad);

  if (b.me == 0) {
    printf("\nepcomm cuda low-latency bench: R=%d ranks, %s blocks per rank, %d tokens per rank, "
           "H=%d, topk %d, E=%d; %d calls after %d of warm-up; GPU time by CUDA events, "
           "calls queued back to back; slowest rank's median and p90\n", b.R,
           o->sms ? "--sms" : "the rank's share of the GPU's", o->T, o->H, o->topk, o->E,
           o->iters, o->warmup);
    printf("%-46s %9s %9s\n", "operation (us)", "median", "p90");
    row("dispatch bf16 (one phase)", d16);
    row("dispatch fp8 (one phase)", d8);
    row("combine, y = bf16 view (one phase)", c_view);
    row("combine, y = caller memory (one phase)", c_caller);
    row("combine, zero copy (one phase)", c_zc);
    row("dispatch bf16: send (two phases)", tp16[0]);
    row("dispatch bf16: receive", tp16[1]);
    row("dispatch fp8: send (two phases)", tp8[0]);
    row("dispatch fp8: receive", tp8[1]);
    row("combine: send (two phases)", tp16[2]);
    row("combine: receive", tp16[3]);
    row("graph replay: dispatch bf16 + combine", g);
    printf("graph replay / (dispatch + combine) medians: %.2f\n", g.med / (d16.med + c_view.med));
    row("overlap: communication alone (2 x send+recv)", ov.comm);
    row("overlap: compute alone (2 x FMA kernel)", ov.compute);
    row("overlap: send -> compute -> receive, twice", ov.overlapped);
    printf("overlap efficiency (comm alone + compute alone) / overlapped: %.2f\n",
           (ov.comm.med + ov.compute.med) / ov.overlapped.med);
    printf("check: %s\n", bad ? "FAILED" : "every combine exact");
  }
  for (cudaEvent_t e : b.ev) cudaEventDestroy(e);
  EP(ep_buffer_destroy(b.buf));
  EP(ep_group_destroy(b.g));
  cudaFree(b.x), cudaFree(b.y), cudaFree(b.out), cudaFree(b.idx), cudaFree(b.w), cudaFree(b.sink);
  free(b.hx), free(b.hidx);
  return bad ? 1 : 0;
}
