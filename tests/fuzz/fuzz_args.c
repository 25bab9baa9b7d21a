/* libFuzzer target over the argument space of the public API (SEMANTICS.md §8.3): the fuzzer's
 * bytes choose shapes, values (expert ids included), NULL pointers, struct sizes and which call
 * to make; buffers are always as large as the shapes they are declared with, so any crash or
 * sanitizer report is epcomm's fault. One rank (a group from callbacks), no launcher needed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"

typedef struct {
  const uint8_t *p;
  size_t n;
} bytes_t;

static uint8_t take(bytes_t *b) {
  if (!b->n) return 0;
  b->n--;
  return *b->p++;
}
static int pick(bytes_t *b, const int *v, int count) { return v[take(b) % count]; }

static int allgather1(void *ctx, const void *send, void *recv, size_t bytes) {
  (void)ctx;
  memcpy(recv, send, bytes);
  return 0;
}

/* Low-latency sizes of the fuzzing buffer. */
enum { LL_T = 16, LL_H = 128, LL_E = 8, LL_K = 4 };

static ep_group_t group;
static ep_buffer_t buffer;

static void setup(void) {
  if (buffer) return;
  ep_bootstrap_t boot = {0, 1, allgather1, NULL, NULL};
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.queue_bytes = 64 << 10;
  cfg.ll_max_tokens = LL_T, cfg.ll_hidden = LL_H, cfg.ll_num_experts = LL_E, cfg.ll_max_topk = LL_K;
  if (ep_group_create(&boot, NULL, &group) || ep_buffer_create(group, &cfg, &buffer)) abort();
}

typedef struct {
  int n, h, topk, e, ns, cap, worst;
  ep_dtype_t dtype;
  void *x, *rx;
  float *scales, *w, *rs, *rw;
  int64_t *idx, *ri;
  int32_t *src, *prefix, *per_expert;
} shapes_t;

static void *alloc_or_null(bytes_t *b, size_t bytes) {
  return (take(b) % 16 == 0) ? NULL : calloc(1, bytes ? bytes : 1);
}

static void make(bytes_t *b, shapes_t *s) {
  static const int ns[] = {0, 1, 5, 37, -1, 300}, hs[] = {8, 16, 64, 72, 128, 7, 0, -8},
                   ks[] = {1, 2, 4, 9, 0, -1, 200}, es[] = {1, 2, 4, 64, 0, 3, 5000},
                   caps[] = {0, 1, 16, 512, -1};
  s->n = pick(b, ns, 6), s->h = pick(b, hs, 8), s->topk = pick(b, ks, 7), s->e = pick(b, es, 7);
  s->dtype = (ep_dtype_t)(take(b) % 3 + 1 == 3 ? 7 : take(b) % 2 + 1);
  s->ns = take(b) % 4;
  s->cap = pick(b, caps, 5), s->worst = take(b) % 4 ? 0 : pick(b, caps, 5);
  size_t n = s->n > 0 ? (size_t)s->n : 0, h = s->h > 0 ? (size_t)s->h : 0;
  size_t k = s->topk > 0 ? (size_t)s->topk : 0, c = s->cap > 0 ? (size_t)s->cap : 0;
  size_t rows = c > (size_t)(s->worst > 0 ? s->worst : 0) ? c : (size_t)(s->worst > 0 ? s->worst : 0);
  size_t ns_ = (size_t)(s->ns ? s->ns : (s->h > 0 ? (s->h + 127) / 128 : 1));
  s->x = alloc_or_null(b, n * h * 2);
  s->scales = alloc_or_null(b, n * ns_ * 4);
  s->idx = alloc_or_null(b, n * k * 8);
  s->w = alloc_or_null(b, n * k * 4);
  for (size_t i = 0; s->idx && i < n * k; i++) /* mostly valid ids, some out of range */
    s->idx[i] = take(b) % 8 ? (int64_t)(take(b) % (s->e > 0 ? s->e : 1)) : (int64_t)take(b) - 130;
  s->rx = alloc_or_null(b, rows * h * 2);
  s->rs = alloc_or_null(b, rows * ns_ * 4);
  s->ri = alloc_or_null(b, rows * k * 8);
  s->rw = alloc_or_null(b, rows * k * 4);
  s->src = alloc_or_null(b, rows * 4);
  s->prefix = alloc_or_null(b, 4);
  s->per_expert = alloc_or_null(b, (size_t)(s->e > 0 ? s->e : 1) * 4);
}

static void release(shapes_t *s) {
  free(s->x), free(s->scales), free(s->idx), free(s->w), free(s->rx), free(s->rs), free(s->ri);
  free(s->rw), free(s->src), free(s->prefix), free(s->per_expert);
}

static void call_dispatch(bytes_t *b, shapes_t *s) {
  int nr;
  ep_handle_t h = NULL;
  ep_dispatch_args_t a = {.size = take(b) % 16 ? sizeof a : take(b)};
  a.x = s->x, a.dtype = s->dtype, a.num_tokens = s->n, a.hidden = s->h;
  a.x_scales = s->dtype == EP_DTYPE_FP8_E4M3 ? s->scales : NULL, a.num_scales = s->ns;
  a.topk_idx = s->idx, a.topk_weights = take(b) % 2 ? s->w : NULL, a.topk = s->topk;
  a.num_experts = s->e, a.expert_alignment = take(b) % 5 - 1;
  a.worst_case_tokens = s->worst, a.recv_capacity = s->cap;
  a.recv_x = s->rx, a.recv_x_scales = s->dtype == EP_DTYPE_FP8_E4M3 ? s->rs : NULL;
  a.recv_topk_idx = s->ri, a.recv_topk_weights = a.topk_weights ? s->rw : NULL;
  a.recv_src_idx = s->src, a.rank_prefix = s->prefix, a.recv_tokens_per_expert = s->per_expert;
  a.num_recv_tokens = take(b) % 16 ? &nr : NULL, a.handle = &h;
  if (ep_dispatch(buffer, &a) != EP_OK || !h) return;
  uint16_t *out = calloc((size_t)(s->n > 0 ? s->n : 1) * (size_t)s->h, 2);
  float *ow = calloc((size_t)(s->n > 0 ? s->n : 1) * (size_t)s->topk, 4);
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = s->rx,
                         .topk_weights = take(b) % 2 ? s->rw : NULL, .out = out,
                         .out_topk_weights = take(b) % 2 ? ow : NULL};
  if (s->dtype == EP_DTYPE_BF16) ep_combine(buffer, &c);
  if (take(b) % 2) { /* cached dispatch along the handle */
    a.cached = h, a.handle = NULL;
    ep_dispatch(buffer, &a);
  }
  ep_handle_destroy(h);
  if (take(b) % 8 == 0) ep_handle_destroy(h); /* double destroy: reported, harmless */
  free(out), free(ow);
}

/* Low-latency calls: shapes around the buffer's limits (N > T, topk > K), bad ids and flags,
 * one- and two-phase forms, views, combines, and handles left alive (a third dispatch is BUSY). */
static void call_ll(bytes_t *b) {
  static const int ns[] = {0, 1, 7, LL_T, LL_T + 1, -1}, ks[] = {1, 2, LL_K, LL_K + 1, 0};
  int n = pick(b, ns, 6), k = pick(b, ks, 5);
  size_t nn = n > 0 ? (size_t)n : 0, kk = k > 0 ? (size_t)k : 0;
  uint16_t *x = alloc_or_null(b, nn * LL_H * 2), *out = calloc(nn * LL_H + 1, 2);
  int64_t *idx = alloc_or_null(b, nn * kk * 8);
  float *w = calloc(nn * kk + 1, 4);
  for (size_t t = 0; idx && t < nn; t++)
    for (size_t j = 0; j < kk; j++) /* distinct per token, sometimes not, sometimes bad */
      idx[t * kk + j] = take(b) % 10 ? (int64_t)((t + j * 3 + (take(b) % 2)) % LL_E)
                                     : (int64_t)take(b) - 120;
  for (size_t i = 0; x && i < nn * LL_H; i++) x[i] = (uint16_t)(take(b) << 8 | take(b));
  uint16_t *y = calloc((size_t)LL_E * LL_T * LL_H, 2);
  ep_handle_t h[3] = {NULL, NULL, NULL};
  int live = take(b) % 3 + 1;
  for (int i = 0; i < live; i++) {
    ep_ll_dispatch_args_t a = {.size = sizeof a, .x = x, .num_tokens = n, .topk_idx = idx,
                               .topk = k, .use_fp8 = take(b) % 2, .round_scale = take(b) % 2,
                               .use_ue8m0 = take(b) % 2, .two_phase = take(b) % 2,
                               .handle = take(b) % 16 ? &h[i] : NULL};
    if (ep_ll_dispatch(buffer, &a) != EP_OK || !h[i]) continue;
    if (a.two_phase) ep_ll_recv(buffer, h[i]);
    ep_ll_recv_view_t v = {.size = sizeof v};
    ep_ll_get_recv_view(h[i], &v);
    ep_ll_combine_args_t c = {.size = sizeof c, .handle = h[i], .y = y, .topk_idx = idx,
                              .topk_weights = w, .two_phase = take(b) % 2, .out = out};
    if (take(b) % 2 && ep_ll_combine(buffer, &c) == EP_OK && c.two_phase) ep_ll_recv(buffer, h[i]);
  }
  for (int i = 0; i < 3; i++) ep_handle_destroy(h[i]);
  free(x), free(out), free(idx), free(w), free(y);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  bytes_t b = {data, size};
  shapes_t s;
  make(&b, &s);
  int32_t pr[1], pe[8];
  uint8_t ir[64];
  switch (take(&b) % 4) {
    case 3: call_ll(&b); break;
    case 0:
      ep_get_dispatch_layout(buffer, s.idx, s.n, s.topk, s.e, pr, s.e > 0 && s.e <= 8 ? pe : NULL,
                             s.n > 0 && s.n <= 64 ? ir : NULL, NULL);
      break;
    default: call_dispatch(&b, &s); break;
  }
  release(&s);
  return 0;
}
