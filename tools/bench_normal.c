/* Normal-mode measurement: every iteration is barrier, memcpy ceiling, barrier, dispatch (synchronous path, outputs from
 * an allocator callback, as a framework would allocate them), barrier, combine. The expert
 * outputs handed to combine are generated once from what the first dispatch delivered; the last
 * iteration's outputs are checked against the generator (bench_common.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"

typedef struct {
  const bench_opts_t *o;
  int R, cap;
  void *x;
  float *scales;
  int64_t *idx;
  float *w;
  int32_t *src_idx, *prefix, *tpe;
} outs_t;

bench_usage_t bench_rusage(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (bench_usage_t){(double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
                       (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec,
                   (double)(ru.ru_nvcsw + ru.ru_nivcsw)};
}

/* 64-byte aligned, as a framework's tensors are (torch's CPU allocator aligns to 64). */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 127) & ~(size_t)63); }

/* Outputs are allocated once and touched, so no iteration pays for page faults. */
static int grow(outs_t *u, int n) {
  if (n <= u->cap) return 0;
  const bench_opts_t *o = u->o;
  size_t rows = (size_t)n, K = (size_t)o->topk, ns = (size_t)bench_num_scales(o);
  free(u->x), free(u->scales), free(u->idx), free(u->w), free(u->src_idx);
  u->x = alloc64(rows * bench_row_bytes(o));
  u->scales = alloc64(rows * ns * sizeof(float));
  u->idx = alloc64(rows * K * sizeof(int64_t));
  u->w = alloc64(rows * K * sizeof(float));
  u->src_idx = alloc64(rows * sizeof(int32_t));
  if (!u->x || !u->scales || !u->idx || !u->w || !u->src_idx) return u->cap = 0, -1;
  memset(u->x, 0, rows * bench_row_bytes(o));
  memset(u->scales, 0, rows * ns * sizeof(float));
  memset(u->idx, 0, rows * K * sizeof(int64_t));
  memset(u->w, 0, rows * K * sizeof(float));
  memset(u->src_idx, 0, rows * sizeof(int32_t));
  u->cap = n;
  return 0;
}

static int alloc_cb(void *ctx, const ep_dispatch_args_t *a, int n, ep_dispatch_out_t *out) {
  outs_t *u = ctx;
  (void)a;
  if (grow(u, n)) return -1;
  out->recv_x = u->x;
  out->recv_x_scales = u->o->dtype == BENCH_FP8 ? u->scales : NULL;
  out->recv_topk_idx = u->idx;
  out->recv_topk_weights = u->w;
  out->recv_src_idx = u->src_idx;
  return 0;
}

/* Expert outputs: row j (from source s, token src_idx[j]) gets bench_gen_y_row(me, s, t). */
static void make_y(const bench_opts_t *o, int R, int me, const outs_t *u, int nr, uint16_t *y) {
  int j = 0;
  for (int s = 0; s < R; s++) {
    int end = u->prefix[(size_t)s * R + me];
    for (; j < end && j < nr; j++)
      bench_gen_y_row(o, me, s, u->src_idx[j], y + (size_t)j * o->hidden);
  }
}

static void figures(const bench_opts_t *o, int R, int me, const outs_t *u, int nr,
                    bench_rank_t *f) {
  int self = u->prefix[(size_t)me * R + me] - (me ? u->prefix[(size_t)(me - 1) * R + me] : 0);
  size_t row = bench_row_bytes(o) + (size_t)bench_num_scales(o) * 4;
  /* metadata the API returns per row: source index, topk ids and weights */
  size_t meta = 4 + (size_t)o->topk * 12;
  f->recv_rows = nr;
  f->self_rows = self;
  f->d_bytes = (double)nr * (double)row;
  f->d_wire = (double)(nr - self) * (double)(row + meta);
  f->c_bytes = (double)nr * o->hidden * 2.0;
  f->c_wire = (double)(nr - self) * o->hidden * 2.0;
  f->digest_x = bench_digest(u->x, (size_t)nr * bench_row_bytes(o), 1469598103934665603ull);
  if (o->dtype == BENCH_FP8)
    f->digest_x = bench_digest(u->scales, (size_t)nr * bench_num_scales(o) * 4, f->digest_x);
}

static void check(const bench_opts_t *o, int R, int me, const outs_t *u, int nr,
                  const uint16_t *out, bench_rank_t *f) {
  bench_recv_t rv = {nr, u->x, u->scales, u->idx, u->w, u->src_idx, u->prefix, u->tpe};
  char m1[BENCH_MSG] = "", m2[BENCH_MSG] = "";
  f->dispatch_bad = bench_check_dispatch(o, R, me, &rv, m1, sizeof m1);
  f->combine_bad = bench_check_combine(o, R, me, out, m2, sizeof m2);
  snprintf(f->msg, sizeof f->msg, "%s", f->dispatch_bad ? m1 : m2);
  f->digest_out = bench_digest(out, (size_t)o->tokens * o->hidden * 2, 1469598103934665603ull);
}

int bench_normal(const bench_opts_t *o, ep_group_t g, bench_rank_t *f) {
  int R, me, rc = 1, nr = 0;
  ep_group_nranks(g, &R);
  ep_group_rank(g, &me);
  size_t N = (size_t)o->tokens, K = (size_t)o->topk;
  outs_t u = {.o = o, .R = R};
  void *x = alloc64(N * bench_row_bytes(o));
  float *xs = alloc64(N * (size_t)bench_num_scales(o) * 4);
  int64_t *idx = alloc64(N * K * 8);
  float *w = alloc64(N * K * 4);
  uint16_t *y = NULL, *out = alloc64(N * (size_t)o->hidden * 2);
  u.prefix = calloc((size_t)R * R, sizeof *u.prefix);
  u.tpe = calloc((size_t)(o->experts / R), sizeof *u.tpe);
  ep_buffer_t buf = NULL;
  ep_handle_t h = NULL;
  bench_ceiling_t *ceil = bench_ceiling_new(o);
  if (!x || !xs || !idx || !w || !out || !u.prefix || !u.tpe || !ceil) {
    fprintf(stderr, "epcomm bench: out of memory\n");
    goto fail;
  }
  bench_gen_x(o, me, x, xs);
  bench_gen_route(o, me, idx, w);
  memset(out, 0, N * (size_t)o->hidden * 2);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.backend = o->backend_cuda ? EP_BACKEND_CUDA : EP_BACKEND_CPU;
  cfg.num_channels = o->threads;
  TRY(ep_buffer_create(g, &cfg, &buf));
  double *t = bench_rank_times(f);
  bench_progress_stage(o->progress, "normal mode, warm-up and timed", o->warmup + o->iters);
  for (int it = -o->warmup; it < o->iters; it++) {
    bench_progress_step(o->progress, it + o->warmup);
    ep_dispatch_args_t a = {.size = sizeof a, .x = x, .dtype = (ep_dtype_t)o->dtype,
                            .num_tokens = o->tokens, .hidden = o->hidden,
                            .x_scales = o->dtype == BENCH_FP8 ? xs : NULL, .topk_idx = idx,
                            .topk_weights = w, .topk = o->topk, .num_experts = o->experts};
    ep_dispatch_out_t dout = {.size = sizeof dout, .mode = EP_OUTPUT_ALLOC, .alloc = alloc_cb,
                              .alloc_ctx = &u, .rank_prefix = u.prefix,
                              .recv_tokens_per_expert = u.tpe};
    TRY(ep_group_barrier(g));
    double tm = bench_ceiling_copy(ceil);
    TRY(ep_group_barrier(g));
    bench_usage_t u0 = bench_rusage();
    double t0 = bench_now();
    TRY(ep_dispatch(buf, &a, &dout));
    double t1 = bench_now();
    bench_usage_t u1 = bench_rusage();
    nr = dout.num_recv_tokens, h = dout.handle;
    if (!y) {
      y = alloc64((size_t)(nr ? nr : 1) * o->hidden * 2);
      if (!y) goto fail;
      make_y(o, R, me, &u, nr, y);
    }
    ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = y, .out = out};
    TRY(ep_group_barrier(g));
    bench_usage_t u2 = bench_rusage();
    double t2 = bench_now();
    TRY(ep_combine(buf, &c));
    double t3 = bench_now();
    bench_usage_t u3 = bench_rusage();
    TRY(ep_handle_destroy(h));
    h = NULL;
    if (it < 0) continue;
    t[it] = t1 - t0, t[o->iters + it] = t3 - t2, t[2 * o->iters + it] = tm;
    f->d_cpu += (u1.cpu - u0.cpu) / o->iters, f->d_csw += (u1.csw - u0.csw) / o->iters;
    f->c_cpu += (u3.cpu - u2.cpu) / o->iters, f->c_csw += (u3.csw - u2.csw) / o->iters;
  }
  figures(o, R, me, &u, nr, f);
  f->m_bytes = bench_ceiling_bytes(ceil);
  bench_progress_stage(o->progress, "checking the outputs against the reference", 0);
  check(o, R, me, &u, nr, out, f);
  f->has_data = 1;
  rc = 0;
fail:
  if (h) ep_handle_destroy(h);
  if (buf && ep_buffer_destroy(buf))
    fprintf(stderr, "epcomm bench: ep_buffer_destroy: %s\n", ep_last_error()), rc = 1;
  bench_ceiling_free(ceil);
  free(x), free(xs), free(idx), free(w), free(y), free(out), free(u.prefix), free(u.tpe);
  free(u.x), free(u.scales), free(u.idx), free(u.w), free(u.src_idx);
  return rc;
}
