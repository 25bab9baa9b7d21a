/* GPU benchmark of normal mode (`epcomm bench --backend cuda`), run under `epcomm launch -n R`:
 *   cuda_bench [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--sms S] [--iters 30]
 * DeepEP's sizes and method: random routing (topk distinct experts per token), time = mean of
 * `iters` calls after warm-up, each bracketed by CUDA events, the slowest rank's mean reported.
 * Measured: dispatch (bf16, fp8; full = count exchange + host sync + data, and cached), combine
 * (x = the bf16 dispatch view written in place, and x in a separate tensor); from the same run,
 * the GPU's device-to-device copy ceiling and a cudaMemcpy baseline (count exchange through the
 * host, a pack kernel, one cudaMemcpyAsync per peer into its IPC-mapped receive buffer).
 * Self-contained so that `epcomm bench --backend cuda` can wrap it later. */
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
  fprintf(stderr, "cuda_bench rank %d: ", g_rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

typedef struct {
  int N, H, topk, E, sms, iters, warmup;
} opts_t;

static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ kernels of the bench */

__global__ void copy_kernel(const int4 *src, int4 *dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

/* Baseline layout: one block per destination d scans the tokens in order (rows to d, by token). */
__global__ void bl_positions(const int64_t *idx, int N, int topk, int L, int R, int *pos,
                             int *cnt) {
  __shared__ int warp_tot[32];
  __shared__ int base;
  const int d = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int t0 = 0; t0 < N; t0 += blockDim.x) {
    int t = t0 + threadIdx.x, in = 0;
    for (int k = 0; t < N && k < topk; k++) in |= idx[(size_t)t * topk + k] >= 0 && idx[(size_t)t * topk + k] / L == d;
    unsigned m = __ballot_sync(0xffffffffu, in);
    if (lane == 0) warp_tot[warp] = __popc(m);
    __syncthreads();
    int before = base;
    for (int w = 0; w < warp; w++) before += warp_tot[w];
    if (t < N) pos[(size_t)t * R + d] = in ? before + __popc(m & ((1u << lane) - 1)) : -1;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < (int)(blockDim.x / 32); w++) base += warp_tot[w];
    __syncthreads();
  }
  if (threadIdx.x == 0) cnt[d] = base;
}

/* Baseline pack: rows grouped by destination, in token order (one warp per token). */
__global__ void bl_pack(const int4 *x, int N, int R, size_t row16, const int *pos, const int *off,
                        int4 *send) {
  const int lane = threadIdx.x & 31;
  for (int t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < N; t += gridDim.x * blockDim.x / 32)
    for (int d = 0; d < R; d++) {
      int p = pos[(size_t)t * R + d];
      if (p < 0) continue;
      int4 *dst = send + (size_t)(off[d] + p) * row16;
      for (size_t i = lane; i < row16; i += 32) dst[i] = x[(size_t)t * row16 + i];
    }
}

/* ------------------------------------------------------------------ setup */

typedef struct {
  ep_group_t g;
  int R, me, dev;
  opts_t o;
  cudaStream_t st;
  int64_t *idx;          /* device [N][topk] */
  void *x16, *x8;        /* device bf16 / fp8 rows */
  float *sc;             /* device fp8 scales */
  int64_t *hidx;         /* host routing */
  uint16_t *hx16;
} bench_t;

static void make_inputs(bench_t *b) {
  const opts_t *o = &b->o;
  uint64_t s = 0x5eed + (uint64_t)b->me * 7919;
  size_t n = (size_t)o->N * o->H;
  b->hidx = (int64_t *)malloc((size_t)o->N * o->topk * 8);
  b->hx16 = (uint16_t *)malloc(n * 2);
  uint8_t *h8 = (uint8_t *)malloc(n);
  float *hs = (float *)malloc((size_t)o->N * (o->H / 128) * 4);
  for (size_t i = 0; i < n; i++) {
    b->hx16[i] = (uint16_t)(0x3c00 + mix(&s) % 0x0800); /* finite, in [2^-7, 2) */
    h8[i] = (uint8_t)(mix(&s) % 0x7e);
  }
  for (int i = 0; i < o->N * (o->H / 128); i++) hs[i] = 1.0f + (float)(mix(&s) % 100) / 100.0f;
  for (int t = 0; t < o->N; t++)
    for (int k = 0; k < o->topk; k++) {
      int64_t e;
      int dup;
      do {
        e = (int64_t)(mix(&s) % (uint64_t)o->E);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= b->hidx[(size_t)t * o->topk + j] == e;
      } while (dup);
      b->hidx[(size_t)t * o->topk + k] = e;
    }
  CU(cudaMalloc(&b->idx, (size_t)o->N * o->topk * 8));
  CU(cudaMalloc(&b->x16, n * 2));
  CU(cudaMalloc(&b->x8, n));
  CU(cudaMalloc(&b->sc, (size_t)o->N * (o->H / 128) * 4));
  CU(cudaMemcpy(b->idx, b->hidx, (size_t)o->N * o->topk * 8, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(b->x16, b->hx16, n * 2, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(b->x8, h8, n, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(b->sc, hs, (size_t)o->N * (o->H / 128) * 4, cudaMemcpyHostToDevice));
  free(h8), free(hs);
}

/* Mean of `iters` calls (after warm-up), each bracketed by events on the stream and issued back
 * to back (no host synchronisation between calls, as DeepEP's bench does); slowest rank. */
typedef void (*op_fn)(bench_t *b, void *ctx);

static double slowest(bench_t *b, double mine) {
  double all[256], worst = 0;
  EP(ep_group_allgather(b->g, &mine, all, sizeof mine));
  for (int r = 0; r < b->R; r++) worst = all[r] > worst ? all[r] : worst;
  return worst;
}

static double time_op(bench_t *b, op_fn fn, void *ctx) {
  enum { MAXIT = 256 };
  cudaEvent_t e0[MAXIT], e1[MAXIT];
  int n = b->o.iters < MAXIT ? b->o.iters : MAXIT;
  for (int i = 0; i < n; i++) {
    CU(cudaEventCreate(&e0[i]));
    CU(cudaEventCreate(&e1[i]));
  }
  for (int i = 0; i < b->o.warmup; i++) fn(b, ctx);
  CU(cudaStreamSynchronize(b->st));
  EP(ep_group_barrier(b->g));
  for (int i = 0; i < n; i++) {
    CU(cudaEventRecord(e0[i], b->st));
    fn(b, ctx);
    CU(cudaEventRecord(e1[i], b->st));
  }
  CU(cudaStreamSynchronize(b->st));
  double sum = 0;
  for (int i = 0; i < n; i++) {
    float ms = 0;
    CU(cudaEventElapsedTime(&ms, e0[i], e1[i]));
    sum += ms * 1e-3;
    cudaEventDestroy(e0[i]), cudaEventDestroy(e1[i]);
  }
  return slowest(b, sum / n);
}

/* ------------------------------------------------------------------ epcomm operations */

typedef struct {
  ep_buffer_t buf;
  ep_dtype_t dtype;
  ep_handle_t cached; /* cached dispatch along this handle */
  void *recv_x;       /* caller's outputs (NULL: views) */
  float *recv_sc;
  int cap;
  ep_handle_t *keep;  /* receives the handle of the call (else it is destroyed at once) */
  ep_dispatch_out_t last;
} dctx_t;

static void op_dispatch(bench_t *b, void *p) {
  dctx_t *c = (dctx_t *)p;
  const opts_t *o = &b->o;
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.dtype = c->dtype;
  a.x = c->dtype == EP_DTYPE_BF16 ? b->x16 : b->x8;
  a.x_scales = c->dtype == EP_DTYPE_BF16 ? NULL : b->sc;
  a.num_tokens = o->N, a.hidden = o->H;
  a.topk_idx = b->idx, a.topk = o->topk, a.num_experts = o->E;
  a.cached = c->cached;
  a.stream = b->st;
  ep_dispatch_out_t out = EP_DISPATCH_OUT_INIT;
  if (c->recv_x) {
    out.mode = EP_OUTPUT_CALLER, out.capacity = c->cap;
    out.recv_x = c->recv_x, out.recv_x_scales = c->recv_sc;
  } else {
    out.mode = EP_OUTPUT_VIEWS;
  }
  EP(ep_dispatch(c->buf, &a, &out));
  if (c->keep && !c->cached) *c->keep = out.handle;
  else EP(ep_handle_destroy(out.handle)); /* NULL after a cached dispatch: a no-op */
  c->last = out;
}

typedef struct {
  ep_buffer_t buf;
  ep_handle_t h;
  const void *x;
  void *out;
} cctx_t;

static void op_combine(bench_t *b, void *p) {
  cctx_t *c = (cctx_t *)p;
  ep_combine_args_t a;
  memset(&a, 0, sizeof a);
  a.size = sizeof a;
  a.handle = c->h, a.x = c->x, a.out = c->out, a.stream = b->st;
  EP(ep_combine(c->buf, &a));
}

/* The experts' write (a device copy of their output rows into x), then the combine of x. */
typedef struct {
  cctx_t c;
  const void *y;
  size_t bytes;
} wctx_t;

static void op_write_combine(bench_t *b, void *p) {
  wctx_t *w = (wctx_t *)p;
  CU(cudaMemcpyAsync((void *)w->c.x, w->y, w->bytes, cudaMemcpyDeviceToDevice, b->st));
  op_combine(b, &w->c);
}

/* ------------------------------------------------------------------ baseline */

typedef struct {
  int *pos, *cnt, *off_d;
  int hcnt[256], allcnt[256 * 256], off[256];
  void *send, *recv, *peer[256];
  size_t row;
  const void *x;
} base_t;

static void base_setup(bench_t *b, base_t *s) {
  int R = b->R, N = b->o.N;
  size_t rows = (size_t)N * R;
  CU(cudaMalloc(&s->pos, (size_t)N * R * 4));
  CU(cudaMalloc(&s->cnt, (size_t)R * 4));
  CU(cudaMalloc(&s->off_d, (size_t)R * 4));
  CU(cudaMalloc(&s->send, rows * b->o.H * 2));
  CU(cudaMalloc(&s->recv, rows * b->o.H * 2));
  cudaIpcMemHandle_t mine, all[256];
  CU(cudaIpcGetMemHandle(&mine, s->recv));
  EP(ep_group_allgather(b->g, &mine, all, sizeof mine));
  for (int r = 0; r < R; r++)
    if (r == b->me) s->peer[r] = s->recv;
    else CU(cudaIpcOpenMemHandle(&s->peer[r], all[r], cudaIpcMemLazyEnablePeerAccess));
}

static void base_teardown(bench_t *b, base_t *s) {
  for (int r = 0; r < b->R; r++)
    if (r != b->me) CU(cudaIpcCloseMemHandle(s->peer[r]));
  EP(ep_group_barrier(b->g));
  cudaFree(s->pos), cudaFree(s->cnt), cudaFree(s->off_d), cudaFree(s->send), cudaFree(s->recv);
}

/* Count exchange through the host, pack, one copy per peer; done when every rank is. */
static void base_dispatch(bench_t *b, base_t *s) {
  const int R = b->R, N = b->o.N;
  bl_positions<<<R, 1024, 0, b->st>>>(b->idx, N, b->o.topk, b->o.E / R, R, s->pos, s->cnt);
  CU(cudaMemcpyAsync(s->hcnt, s->cnt, (size_t)R * 4, cudaMemcpyDeviceToHost, b->st));
  CU(cudaStreamSynchronize(b->st));
  EP(ep_group_allgather(b->g, s->hcnt, s->allcnt, (size_t)R * 4));
  for (int d = 0, run = 0; d < R; d++) s->off[d] = run, run += s->hcnt[d];
  CU(cudaMemcpyAsync(s->off_d, s->off, (size_t)R * 4, cudaMemcpyHostToDevice, b->st));
  bl_pack<<<132, 512, 0, b->st>>>((const int4 *)s->x, N, R, s->row / 16, s->pos, s->off_d,
                                  (int4 *)s->send);
  for (int d = 0; d < R; d++) {
    size_t base = 0;
    for (int q = 0; q < b->me; q++) base += (size_t)s->allcnt[q * R + d];
    CU(cudaMemcpyAsync((char *)s->peer[d] + base * s->row, (char *)s->send + s->off[d] * s->row,
                       (size_t)s->hcnt[d] * s->row, cudaMemcpyDeviceToDevice, b->st));
  }
  CU(cudaStreamSynchronize(b->st));
  EP(ep_group_barrier(b->g));
}

static double time_base(bench_t *b, base_t *s) {
  for (int i = 0; i < b->o.warmup; i++) base_dispatch(b, s);
  double sum = 0;
  for (int i = 0; i < b->o.iters; i++) {
    double t0 = now_s();
    base_dispatch(b, s);
    sum += now_s() - t0;
  }
  return slowest(b, sum / b->o.iters);
}

/* ------------------------------------------------------------------ copy ceiling */

/* Rank 0 alone copies 2 GiB with a grid-stride kernel over the whole GPU. Bytes copied per
 * second (the figure delivered bytes compare to); reads + writes are twice that. */
static double copy_ceiling(bench_t *b) {
  double bw = 0;
  if (b->me == 0) {
    size_t n = (size_t)2 << 30;
    void *src, *dst;
    CU(cudaMalloc(&src, n));
    CU(cudaMalloc(&dst, n));
    CU(cudaMemset(src, 1, n));
    int sms;
    CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, b->dev));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    copy_kernel<<<sms * 4, 512, 0, b->st>>>((const int4 *)src, (int4 *)dst, n / 16);
    CU(cudaEventRecord(e0, b->st));
    for (int i = 0; i < 10; i++)
      copy_kernel<<<sms * 4, 512, 0, b->st>>>((const int4 *)src, (int4 *)dst, n / 16);
    CU(cudaEventRecord(e1, b->st));
    CU(cudaEventSynchronize(e1));
    float ms;
    CU(cudaEventElapsedTime(&ms, e0, e1));
    bw = 10.0 * (double)n / (ms * 1e-3);
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaFree(src), cudaFree(dst);
  }
  EP(ep_group_barrier(b->g));
  double all[256];
  EP(ep_group_allgather(b->g, &bw, all, sizeof bw));
  return all[0];
}

/* ------------------------------------------------------------------ checks and report */

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Combine of the dispatched rows themselves: out[t] = x[t] * (ranks t went to), exactly. */
static int check_combine(bench_t *b, const void *out_d) {
  const opts_t *o = &b->o;
  uint16_t *out = (uint16_t *)malloc((size_t)o->N * o->H * 2);
  CU(cudaMemcpy(out, out_d, (size_t)o->N * o->H * 2, cudaMemcpyDeviceToHost));
  int bad = 0, L = o->E / b->R;
  for (int t = 0; t < o->N; t += 7) {
    int ranks = 0;
    for (int r = 0; r < b->R; r++) {
      int hit = 0;
      for (int k = 0; k < o->topk; k++) hit |= b->hidx[(size_t)t * o->topk + k] / L == r;
      ranks += hit;
    }
    for (int h = 0; h < o->H; h += 61) {
      uint32_t u = (uint32_t)b->hx16[(size_t)t * o->H + h] << 16;
      float f;
      memcpy(&f, &u, 4);
      bad += out[(size_t)t * o->H + h] != to_bf16(f * (float)ranks);
    }
  }
  free(out);
  return bad;
}

typedef struct {
  const char *name;
  double t, bytes_rank, bytes_all, deepep_us;
} row_t;

static void report(bench_t *b, const row_t *rows, int n, double ceiling, double base16,
                   double base8) {
  if (b->me) return;
  printf("\nepcomm cuda bench: R=%d ranks on one GPU (MPS if enabled), %d SMs per rank, "
         "%d tokens, H=%d, topk %d, E=%d, mean of %d calls, slowest rank\n", b->R, b->o.sms,
         b->o.N, b->o.H, b->o.topk, b->o.E, b->o.iters);
  printf("copy ceiling (device-to-device copy kernel, rank 0 alone): %.0f GB/s copied "
         "(%.0f GB/s read + write)\n", ceiling / 1e9, 2 * ceiling / 1e9);
  printf("%-30s %10s %12s %14s %9s %10s %9s\n", "operation", "time us", "GB/s rank",
         "GB/s all ranks", "x ceiling", "DeepEP us", "x DeepEP");
  for (int i = 0; i < n; i++) {
    const row_t *r = &rows[i];
    char dp[32] = "-", sp[32] = "-";
    if (r->deepep_us > 0) {
      snprintf(dp, sizeof dp, "%.0f", r->deepep_us);
      snprintf(sp, sizeof sp, "%.2f", r->deepep_us / (r->t * 1e6));
    }
    printf("%-30s %10.1f %12.1f %14.1f %9.2f %10s %9s\n", r->name, r->t * 1e6,
           r->bytes_rank / r->t / 1e9, r->bytes_all / r->t / 1e9, r->bytes_all / r->t / ceiling,
           dp, sp);
  }
  printf("baseline (host count exchange + pack + cudaMemcpyAsync per peer): bf16 %.1f us, "
         "fp8 %.1f us\n", base16 * 1e6, base8 * 1e6);
  printf("epcomm full dispatch vs baseline: bf16 %.2fx, fp8 %.2fx\n", base16 / rows[0].t,
         base8 / rows[2].t);
}

/* DeepEP V1 intranode, measured on this machine (docs/PERFORMANCE.md): R -> fp8 dispatch, bf16
 * dispatch, combine. */
static void deepep(int R, int sms, double *v) {
  v[0] = v[1] = v[2] = 0;
  if (R == 2 && sms == 24) v[0] = 298, v[1] = 411, v[2] = 480;
  if (R == 4 && sms == 24) v[0] = 504, v[1] = 1056, v[2] = 858;
  if (R == 8 && sms == 16) v[0] = 1390, v[1] = 2537, v[2] = 2290;
}

static void parse(int argc, char **argv, opts_t *o) {
  *o = (opts_t){4096, 7168, 8, 256, 0, 30, 10};
  for (int i = 1; i + 1 < argc; i += 2) {
    int v = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--tokens")) o->N = v;
    else if (!strcmp(argv[i], "--hidden")) o->H = v;
    else if (!strcmp(argv[i], "--topk")) o->topk = v;
    else if (!strcmp(argv[i], "--experts")) o->E = v;
    else if (!strcmp(argv[i], "--sms")) o->sms = v;
    else if (!strcmp(argv[i], "--iters")) o->iters = v;
    else die("unknown option %s", argv[i]);
  }
}

int main(int argc, char **argv) {
  bench_t b;
  memset(&b, 0, sizeof b);
  parse(argc, argv, &b.o);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("skipped: no GPU\n");
    return 77;
  }
  EP(ep_group_create_from_env(NULL, &b.g));
  EP(ep_group_rank(b.g, &b.me));
  EP(ep_group_nranks(b.g, &b.R));
  g_rank = b.me;
  const char *lr = getenv("EP_LOCAL_RANK");
  b.dev = (lr ? atoi(lr) : b.me) % ndev;
  CU(cudaSetDevice(b.dev));
  CU(cudaStreamCreateWithFlags(&b.st, cudaStreamNonBlocking));
  if (!b.o.sms) b.o.sms = b.R >= 8 ? 16 : 24;
  opts_t *o = &b.o;
  make_inputs(&b);
  double ceiling = copy_ceiling(&b);

  /* Buffer: the receive area holds the worst case (every token to every rank). */
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.backend = EP_BACKEND_CUDA;
  cfg.num_sms = o->sms;
  size_t per_row = (size_t)o->H * 2 + (size_t)o->topk * 12 + 4 + (size_t)(o->H / 128) * 4;
  cfg.queue_bytes = ((size_t)o->N * b.R * per_row) / (size_t)b.R + (1 << 20);
  ep_buffer_t buf;
  EP(ep_buffer_create(b.g, &cfg, &buf));

  ep_handle_t h16 = NULL, h8 = NULL;
  dctx_t d16 = {buf, EP_DTYPE_BF16, NULL, NULL, NULL, 0, NULL, {0}};
  dctx_t d8 = {buf, EP_DTYPE_FP8_E4M3, NULL, NULL, NULL, 0, NULL, {0}};
  row_t rows[12];
  double dv[3];
  deepep(b.R, o->sms, dv);
  d8.keep = &h8;
  op_dispatch(&b, &d8); /* handles for the cached runs and for the byte counts */
  d8.keep = NULL;
  d16.keep = &h16;
  op_dispatch(&b, &d16);
  d16.keep = NULL;
  int nr16, nr8, all16[256], all8[256];
  EP(ep_handle_num_recv_tokens(h16, &nr16));
  EP(ep_handle_num_recv_tokens(h8, &nr8));
  EP(ep_group_allgather(b.g, &nr16, all16, sizeof nr16));
  EP(ep_group_allgather(b.g, &nr8, all8, sizeof nr8));
  double sum16 = 0, sum8 = 0;
  for (int r = 0; r < b.R; r++) sum16 += all16[r], sum8 += all8[r];
  const double row16 = o->H * 2.0, row8 = o->H + (o->H / 128) * 4.0;

  rows[0] = (row_t){"dispatch bf16 (full, views)", time_op(&b, op_dispatch, &d16), nr16 * row16,
                    sum16 * row16, dv[1]};
  rows[2] = (row_t){"dispatch fp8 (full, views)", time_op(&b, op_dispatch, &d8), nr8 * row8,
                    sum8 * row8, dv[0]};
  d16.cached = h16, d8.cached = h8;
  rows[1] = (row_t){"dispatch bf16 (cached, views)", time_op(&b, op_dispatch, &d16), nr16 * row16,
                    sum16 * row16, dv[1]};
  rows[3] = (row_t){"dispatch fp8 (cached, views)", time_op(&b, op_dispatch, &d8), nr8 * row8,
                    sum8 * row8, dv[0]};
  dctx_t dc = {buf, EP_DTYPE_BF16, h16, NULL, NULL, o->N * b.R, NULL, {0}};
  CU(cudaMalloc(&dc.recv_x, (size_t)o->N * b.R * row16));
  rows[4] = (row_t){"dispatch bf16 (cached, copy)", time_op(&b, op_dispatch, &dc), nr16 * row16,
                    sum16 * row16, dv[1]};

  /* Combine: the bf16 rows as dispatched (a fresh view), then the same rows in a tensor. */
  d16.cached = h16;
  op_dispatch(&b, &d16);
  void *out, *y;
  CU(cudaMalloc(&out, (size_t)o->N * row16));
  CU(cudaMalloc(&y, (size_t)nr16 * row16 + 16));
  CU(cudaMemcpyAsync(y, d16.last.recv_x, (size_t)nr16 * row16, cudaMemcpyDeviceToDevice, b.st));
  cctx_t cz = {buf, h16, d16.last.recv_x, out}, cs = {buf, h16, y, out};
  rows[5] = (row_t){"combine bf16 (x = view)", time_op(&b, op_combine, &cz), nr16 * row16,
                    sum16 * row16, dv[2]};
  CU(cudaStreamSynchronize(b.st));
  int bad = check_combine(&b, out);
  rows[6] = (row_t){"combine bf16 (x = tensor)", time_op(&b, op_combine, &cs), nr16 * row16,
                    sum16 * row16, dv[2]};
  CU(cudaStreamSynchronize(b.st));
  bad += check_combine(&b, out);
  /* x = ep_get_combine_buffer's memory (the experts write their outputs there; peers read it in
   * place): the combine alone, then with the experts' write (a copy of the rows) in each call,
   * beside the same write into a separate tensor. */
  int nrows = 7;
  void *cb = NULL;
  if (ep_get_combine_buffer(buf, h16, &cb) == EP_OK) {
    CU(cudaMemcpyAsync(cb, y, (size_t)nr16 * row16, cudaMemcpyDeviceToDevice, b.st));
    cctx_t cc = {buf, h16, cb, out};
    rows[nrows++] = (row_t){"combine bf16 (x = comb. buf)", time_op(&b, op_combine, &cc),
                            nr16 * row16, sum16 * row16, dv[2]};
    CU(cudaStreamSynchronize(b.st));
    bad += check_combine(&b, out);
    wctx_t wb = {cc, y, (size_t)nr16 * (size_t)row16};
    void *y2;
    CU(cudaMalloc(&y2, (size_t)nr16 * row16 + 16));
    wctx_t wt = {{buf, h16, y2, out}, y, (size_t)nr16 * (size_t)row16};
    rows[nrows++] = (row_t){"write + combine (comb. buf)", time_op(&b, op_write_combine, &wb),
                            nr16 * row16, sum16 * row16, dv[2]};
    rows[nrows++] = (row_t){"write + combine (x = tensor)", time_op(&b, op_write_combine, &wt),
                            nr16 * row16, sum16 * row16, dv[2]};
    CU(cudaStreamSynchronize(b.st));
    bad += check_combine(&b, out);
    cudaFree(y2);
  } else if (b.me == 0) {
    printf("ep_get_combine_buffer: %s (rows not timed)\n", ep_last_error());
  }
  int allbad[256], totbad = 0;
  EP(ep_group_allgather(b.g, &bad, allbad, sizeof bad));
  for (int r = 0; r < b.R; r++) totbad += allbad[r];

  base_t bs;
  memset(&bs, 0, sizeof bs);
  base_setup(&b, &bs);
  bs.row = (size_t)row16, bs.x = b.x16;
  double base16 = time_base(&b, &bs);
  bs.row = (size_t)o->H, bs.x = b.x8;
  double base8 = time_base(&b, &bs);
  base_teardown(&b, &bs);

  report(&b, rows, nrows, ceiling, base16, base8);
  if (b.me == 0) printf("combine check: %s (%d mismatches)\n", totbad ? "FAILED" : "exact", totbad);
  EP(ep_handle_destroy(h16));
  EP(ep_handle_destroy(h8));
  EP(ep_buffer_destroy(buf));
  EP(ep_group_destroy(b.g));
  cudaFree(out), cudaFree(y), cudaFree(dc.recv_x);
  return totbad ? 1 : 0;
}
