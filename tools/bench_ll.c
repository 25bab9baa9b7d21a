/* Low-latency measurement (SEMANTICS.md §6, §9): every iteration is barrier, memcpy ceiling,
 * barrier, ep_ll_dispatch (one phase: send and receive), barrier, ep_ll_combine (one phase), then
 * the handle is destroyed. Bytes as DeepEP's low-latency test counts them: selections of this
 * rank's tokens x row bytes (fp8: H + H/128 x 4 scale bytes; combine: bf16 rows). The expert
 * outputs are generated per (token, expert) once from the first dispatch's view; the last
 * iteration's view and output are checked against the generator and tests/ref.c's fp8 cast. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ref.h"

/* The expert output for token t of rank src at expert e (a row per (token, expert)). */
static void y_row(const bench_opts_t *o, int e, int src, int t, uint16_t *row) {
  bench_gen_y_row(o, 1 << 20 | e, src, t, row);
}

static size_t ll_row_bytes(const bench_opts_t *o) {
  return o->dtype == BENCH_FP8 ? (size_t)o->hidden + (size_t)o->hidden / 128 * 4
                               : (size_t)o->hidden * 2;
}

/* Fills y [L][R*T][H] (only the received rows) from the view. */
static void make_y(const bench_opts_t *o, int R, int me, const ep_ll_recv_view_t *v, uint16_t *y) {
  int L = v->num_local_experts;
  for (int l = 0; l < L; l++)
    for (int s = 0; s < R; s++) {
      int64_t rg = v->recv_layout_range[(size_t)l * R + s];
      int begin = (int)(rg >> 32), n = (int)(rg & 0xffffffff);
      for (int i = begin; i < begin + n; i++)
        y_row(o, me * L + l, s, v->recv_src_info[(size_t)l * v->max_rows + i],
              y + ((size_t)l * v->max_rows + i) * o->hidden);
    }
}

#define FAIL(...)                                         \
  do {                                                    \
    if (!bad++) snprintf(msg, msg_len, __VA_ARGS__);      \
  } while (0)

/* The view of rank `me` against every rank's regenerated tokens and routing. */
static long check_view(const bench_opts_t *o, int R, int me, const ep_ll_recv_view_t *v,
                       char *msg, size_t msg_len) {
  int L = v->num_local_experts, K = o->topk, H = o->hidden, fp8 = o->dtype == BENCH_FP8;
  size_t N = (size_t)o->tokens;
  uint16_t *x = malloc(N * H * 2);
  int64_t *idx = malloc(N * K * 8);
  float *w = malloc(N * K * 4), *sc = malloc((size_t)H / 128 * 4 + 4);
  uint8_t *q = malloc((size_t)H);
  int *next = calloc((size_t)L, sizeof *next);
  long bad = 0;
  bench_opts_t ob = *o;
  ob.dtype = BENCH_BF16; /* the low-latency input is bf16; fp8 is the dispatch's cast */
  for (int s = 0; s < R && bad < 100; s++) {
    bench_gen_x(&ob, s, x, NULL);
    bench_gen_route(o, s, idx, w);
    for (int l = 0; l < L; l++) next[l] = 0;
    int *cnt = calloc((size_t)L, sizeof *cnt);
    for (size_t t = 0; t < N; t++)
      for (int k = 0; k < K; k++) {
        int64_t e = idx[t * K + k];
        if (e < (int64_t)me * L || e >= (int64_t)(me + 1) * L) continue;
        int l = (int)(e - (int64_t)me * L);
        int64_t rg = v->recv_layout_range[(size_t)l * R + s];
        int i = (int)(rg >> 32) + cnt[l]++;
        if (cnt[l] > (int)(rg & 0xffffffff)) {
          FAIL("rank %d expert %d: more rows from rank %d than layout_range says", me, l, s);
          continue;
        }
        if (v->recv_src_info[(size_t)l * v->max_rows + i] != (int32_t)t)
          FAIL("rank %d expert %d row %d: src_info %d, expected %d", me, l, i,
               v->recv_src_info[(size_t)l * v->max_rows + i], (int)t);
        size_t at = (size_t)l * v->max_rows + i;
        if (!fp8) {
          if (memcmp((const uint16_t *)v->recv_x + at * H, x + t * H, (size_t)H * 2))
            FAIL("rank %d expert %d row %d: payload differs from token %d of rank %d", me, l, i,
                 (int)t, s);
          continue;
        }
        ref_ll_cast_row(x + t * H, H, 0, 0, q, sc, NULL);
        if (memcmp((const uint8_t *)v->recv_x + at * H, q, (size_t)H) ||
            memcmp((const float *)v->recv_x_scales + at * (H / 128), sc, (size_t)H / 128 * 4))
          FAIL("rank %d expert %d row %d: fp8 row or scales differ from the reference cast", me, l,
               i);
      }
    for (int l = 0; l < L; l++)
      if (cnt[l] != (int)(v->recv_layout_range[(size_t)l * R + s] & 0xffffffff))
        FAIL("rank %d expert %d: %d rows from rank %d, layout_range says %d", me, l, cnt[l], s,
             (int)(v->recv_layout_range[(size_t)l * R + s] & 0xffffffff));
    free(cnt);
  }
  free(x), free(idx), free(w), free(sc), free(q), free(next);
  return bad;
}

/* out[t] = bf16(fmaf chain over k ascending of y(t, k) x w[t][k]), SEMANTICS.md §6.5. */
static long check_out(const bench_opts_t *o, int R, int me, const uint16_t *out, char *msg,
                      size_t msg_len) {
  int K = o->topk, H = o->hidden;
  size_t N = (size_t)o->tokens;
  int64_t *idx = malloc(N * K * 8);
  float *w = malloc(N * K * 4), *acc = malloc((size_t)H * 4);
  uint16_t *y = malloc((size_t)H * 2);
  long bad = 0;
  (void)R;
  bench_gen_route(o, me, idx, w);
  for (size_t t = 0; t < N && bad < 100; t++) {
    for (int h = 0; h < H; h++) acc[h] = 0.0f;
    for (int k = 0; k < K; k++) {
      if (idx[t * K + k] < 0) continue;
      y_row(o, (int)idx[t * K + k], me, (int)t, y);
      for (int h = 0; h < H; h++) acc[h] = fmaf(ref_bf16_to_f32(y[h]), w[t * K + k], acc[h]);
    }
    for (int h = 0; h < H; h++)
      if (out[t * H + h] != ref_f32_to_bf16(acc[h])) {
        FAIL("rank %d: combined token %d channel %d is %#06x, expected %#06x", me, (int)t, h,
             out[t * H + h], ref_f32_to_bf16(acc[h]));
        break;
      }
  }
  free(idx), free(w), free(acc), free(y);
  return bad;
}

static void figures(const bench_opts_t *o, int R, int me, const int64_t *idx,
                    const ep_ll_recv_view_t *v, bench_rank_t *f) {
  int L = o->experts / R;
  long sel = 0, remote = 0;
  for (size_t i = 0; i < (size_t)o->tokens * o->topk; i++)
    if (idx[i] >= 0) sel++, remote += idx[i] / L != me;
  int rows = 0, self = 0;
  for (int l = 0; l < L; l++) {
    rows += v->recv_count[l];
    self += (int)(v->recv_layout_range[(size_t)l * R + me] & 0xffffffff);
  }
  f->recv_rows = rows, f->self_rows = self;
  f->d_bytes = (double)sel * (double)ll_row_bytes(o);
  f->d_wire = (double)remote * (double)(ll_row_bytes(o) + 8); /* + the row's metadata */
  f->c_bytes = (double)sel * o->hidden * 2.0;
  f->c_wire = (double)remote * o->hidden * 2.0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The two-phase form (SEMANTICS.md §6.7): each call only sends; ep_ll_recv completes it. Timed
 * apart, with a barrier between send and receive so that the receive measures the wait for the data
 * of the slowest sender, not the sender's own skew. Medians of this rank into f->ll_phases. */
static int two_phase(const bench_opts_t *o, ep_group_t g, ep_buffer_t buf, const uint16_t *x,
                     const int64_t *idx, const float *w, const uint16_t *y, uint16_t *out,
                     bench_rank_t *f) {
  int n = o->iters;
  double *t = calloc(4 * (size_t)n, sizeof *t);
  ep_ll_handle_t h = NULL;
  if (!t) return 1;
  for (int it = -o->warmup; it < n; it++) {
    bench_progress_step(o->progress, it + o->warmup);
    ep_ll_dispatch_args_t a = {.size = sizeof a, .x = x, .num_tokens = o->tokens, .topk_idx = idx,
                               .topk = o->topk, .use_fp8 = o->dtype == BENCH_FP8,
                               .two_phase = 1};
    ep_ll_combine_args_t c = {.size = sizeof c, .y = y, .topk_idx = idx, .topk_weights = w,
                              .two_phase = 1, .out = out};
    double s[6];
    TRY(ep_group_barrier(g));
    s[0] = bench_now();
    TRY(ep_ll_dispatch(buf, &a, &h));
    s[1] = bench_now();
    TRY(ep_group_barrier(g));
    s[2] = bench_now();
    TRY(ep_ll_recv(buf, h));
    s[3] = bench_now();
    c.handle = h;
    TRY(ep_group_barrier(g));
    s[4] = bench_now();
    TRY(ep_ll_combine(buf, &c));
    double s5 = bench_now();
    TRY(ep_group_barrier(g));
    double s6 = bench_now();
    TRY(ep_ll_recv(buf, h));
    double s7 = bench_now();
    TRY(ep_ll_handle_destroy(h));
    h = NULL;
    if (it < 0) continue;
    t[it] = s[1] - s[0], t[n + it] = s[3] - s[2], t[2 * n + it] = s5 - s[4], t[3 * n + it] = s7 - s6;
  }
  for (int k = 0; k < 4; k++) {
    qsort(t + k * n, (size_t)n, sizeof *t, cmp_double);
    f->ll_phases[k] = t[k * n + n / 2];
  }
  free(t);
  return 0;
fail:
  if (h) ep_ll_handle_destroy(h);
  free(t);
  return 1;
}

/* Zero-copy combine: the expert outputs are written into ep_ll_get_combine_buffer's area (not
 * timed: the experts would write there anyway), then the one-phase combine is timed. Its output
 * is checked like the copy path's. Median of this rank into f->ll_zero_copy. */
static int zero_copy(const bench_opts_t *o, ep_group_t g, ep_buffer_t buf, const uint16_t *x,
                     const int64_t *idx, const float *w, const uint16_t *y, uint16_t *out,
                     bench_rank_t *f) {
  int n = o->iters;
  double *t = calloc((size_t)n, sizeof *t);
  ep_ll_handle_t h = NULL;
  if (!t) return 1;
  for (int it = -o->warmup; it < n; it++) {
    ep_ll_dispatch_args_t a = {.size = sizeof a, .x = x, .num_tokens = o->tokens, .topk_idx = idx,
                               .topk = o->topk, .use_fp8 = o->dtype == BENCH_FP8};
    ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
    void *zy = NULL;
    TRY(ep_ll_dispatch(buf, &a, &h));
    TRY(ep_ll_get_recv_view(h, &v));
    TRY(ep_ll_get_combine_buffer(buf, h, &zy));
    for (int l = 0; l < v.num_local_experts; l++) /* the received rows of each expert block */
      memcpy((uint16_t *)zy + (size_t)l * v.max_rows * o->hidden,
             y + (size_t)l * v.max_rows * o->hidden, (size_t)v.recv_count[l] * o->hidden * 2);
    ep_ll_combine_args_t c = {.size = sizeof c, .handle = h, .y = zy, .topk_idx = idx,
                              .topk_weights = w, .out = out};
    TRY(ep_group_barrier(g));
    double t0 = bench_now();
    TRY(ep_ll_combine(buf, &c));
    double t1 = bench_now();
    TRY(ep_ll_handle_destroy(h));
    h = NULL;
    if (it >= 0) t[it] = t1 - t0;
  }
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  f->ll_zero_copy = t[n / 2];
  free(t);
  return 0;
fail:
  if (h) ep_ll_handle_destroy(h);
  free(t);
  return 1;
}

int bench_ll(const bench_opts_t *o, ep_group_t g, bench_rank_t *f) {
  int R, me, rc = 1;
  ep_group_nranks(g, &R);
  ep_group_rank(g, &me);
  size_t N = (size_t)o->tokens, K = (size_t)o->topk, H = (size_t)o->hidden;
  int L = o->experts / R;
  bench_opts_t ob = *o;
  ob.dtype = BENCH_BF16;
  uint16_t *x = malloc(N * H * 2 + 64), *out = calloc(N * H + 32, 2), *y = NULL;
  int64_t *idx = malloc(N * K * 8 + 64);
  float *w = malloc(N * K * 4 + 64);
  ep_buffer_t buf = NULL;
  ep_ll_handle_t h = NULL;
  bench_ceiling_t *ceil = bench_ceiling_new(o);
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  if (!x || !out || !idx || !w || !ceil) {
    fprintf(stderr, "epcomm bench: out of memory\n");
    goto fail;
  }
  bench_gen_x(&ob, me, x, NULL);
  bench_gen_route(o, me, idx, w);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.backend = o->backend_cuda ? EP_BACKEND_CUDA : EP_BACKEND_CPU;
  cfg.num_channels = o->threads;
  cfg.ll_max_tokens = o->tokens, cfg.ll_hidden = o->hidden, cfg.ll_num_experts = o->experts;
  cfg.ll_max_topk = o->topk;
  TRY(ep_buffer_create(g, &cfg, &buf));
  double *t = bench_rank_times(f);
  bench_progress_stage(o->progress, "low-latency mode, warm-up and timed", o->warmup + o->iters);
  for (int it = -o->warmup; it < o->iters; it++) {
    bench_progress_step(o->progress, it + o->warmup);
    ep_ll_dispatch_args_t a = {.size = sizeof a, .x = x, .num_tokens = o->tokens, .topk_idx = idx,
                               .topk = o->topk, .use_fp8 = o->dtype == BENCH_FP8};
    TRY(ep_group_barrier(g));
    double tm = bench_ceiling_copy(ceil);
    TRY(ep_group_barrier(g));
    bench_usage_t u0 = bench_rusage();
    double t0 = bench_now();
    TRY(ep_ll_dispatch(buf, &a, &h));
    double t1 = bench_now();
    bench_usage_t u1 = bench_rusage();
    TRY(ep_ll_get_recv_view(h, &v));
    if (!y) { /* address space for [L][R*T][H]; only the received rows are ever touched */
      y = malloc((size_t)L * v.max_rows * H * 2 + 64);
      if (!y) goto fail;
      make_y(o, R, me, &v, y);
    }
    ep_ll_combine_args_t c = {.size = sizeof c, .handle = h, .y = y, .topk_idx = idx,
                              .topk_weights = w, .out = out};
    TRY(ep_group_barrier(g));
    bench_usage_t u2 = bench_rusage();
    double t2 = bench_now();
    TRY(ep_ll_combine(buf, &c));
    double t3 = bench_now();
    bench_usage_t u3 = bench_rusage();
    if (it == o->iters - 1) { /* the last iteration's view, while its handle lives */
      char m[BENCH_MSG] = "";
      f->dispatch_bad = check_view(o, R, me, &v, m, sizeof m);
      figures(o, R, me, idx, &v, f);
      if (f->dispatch_bad) snprintf(f->msg, sizeof f->msg, "%s", m);
    }
    TRY(ep_ll_handle_destroy(h));
    h = NULL;
    if (it < 0) continue;
    t[it] = t1 - t0, t[o->iters + it] = t3 - t2, t[2 * o->iters + it] = tm;
    f->d_cpu += (u1.cpu - u0.cpu) / o->iters, f->d_csw += (u1.csw - u0.csw) / o->iters;
    f->c_cpu += (u3.cpu - u2.cpu) / o->iters, f->c_csw += (u3.csw - u2.csw) / o->iters;
  }
  char m2[BENCH_MSG] = "";
  bench_progress_stage(o->progress, "checking the outputs against the reference", 0);
  f->combine_bad = check_out(o, R, me, out, m2, sizeof m2);
  bench_progress_stage(o->progress, "two-phase form", o->warmup + o->iters);
  if (two_phase(o, g, buf, x, idx, w, y, out, f)) goto fail;
  if (zero_copy(o, g, buf, x, idx, w, y, out, f)) goto fail;
  if (!f->combine_bad) f->combine_bad = check_out(o, R, me, out, m2, sizeof m2);
  if (!f->dispatch_bad && f->combine_bad) snprintf(f->msg, sizeof f->msg, "%s", m2);
  f->digest_out = bench_digest(out, N * H * 2, 1469598103934665603ull);
  f->m_bytes = bench_ceiling_bytes(ceil);
  f->has_data = 1;
  rc = 0;
fail:
  if (h) ep_ll_handle_destroy(h);
  if (buf && ep_buffer_destroy(buf))
    fprintf(stderr, "epcomm bench: ep_buffer_destroy: %s\n", ep_last_error()), rc = 1;
  bench_ceiling_free(ceil);
  free(x), free(out), free(y), free(idx), free(w);
  return rc;
}
