/* libFuzzer target over the argument space of the public API (SEMANTICS.md §8.3): the fuzzer's
 * bytes choose shapes, values (expert ids included), NULL pointers, struct sizes, output modes,
 * handles of the wrong kind and which call to make; buffers are always as large as the shapes
 * they are declared with, so any crash or sanitizer report is epcomm's fault. A few contracts of
 * the API are checked too (abort, so the fuzzer reports them): a failing ep_dispatch leaves its
 * results untouched, a successful one returns a handle unless it was cached, and a handle of one
 * kind is refused where the other kind is expected. One rank (a group from callbacks), no
 * launcher needed. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"

#define CONTRACT(cond)                                                                             \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "fuzz_args: contract broken: %s (%s:%d; last error: %s)\n", #cond, __FILE__, \
              __LINE__, ep_last_error());                                                          \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

typedef struct {
  const uint8_t *p;
  size_t n;
} bytes_t;

static uint8_t take(bytes_t *b) {
  if (!b->n) return 0;
  b->n--;
  return *b->p++;
}
static int pick(bytes_t *b, const int *v, int count) {
  return v[take(b) % count];
}

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
  size_t rows =
      c > (size_t)(s->worst > 0 ? s->worst : 0) ? c : (size_t)(s->worst > 0 ? s->worst : 0);
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

/* EP_OUTPUT_ALLOC: arrays of exactly the rows asked for (the sanitizer sees any row past them),
 * or a failure, or no recv_x. Each call frees the previous call's arrays. */
typedef struct {
  int fail, no_x;
  void *x;
  float *scales, *w;
  int64_t *idx;
  int32_t *src;
} alloc_t;

static void alloc_free(alloc_t *c) {
  free(c->x), free(c->scales), free(c->w), free(c->idx), free(c->src);
  c->x = NULL, c->scales = NULL, c->w = NULL, c->idx = NULL, c->src = NULL;
}

static int fuzz_alloc(void *ctx, const ep_dispatch_args_t *a, int n, ep_dispatch_out_t *o) {
  alloc_t *c = ctx;
  if (!c) return 1; /* an out->size that ends before alloc_ctx: the call sees alloc_ctx NULL */
  alloc_free(c);
  CONTRACT(n >= 0 && a && o && a->hidden > 0 && a->topk > 0);
  if (c->fail) return 1;
  size_t rows = (size_t)n, h = (size_t)a->hidden, k = (size_t)a->topk;
  size_t ns = a->dtype == EP_DTYPE_FP8_E4M3 ? (size_t)a->num_scales : 0;
  c->x = malloc(rows * h * (a->dtype == EP_DTYPE_BF16 ? 2 : 1) + 1);
  c->scales = ns ? malloc(rows * ns * 4 + 1) : NULL;
  c->idx = malloc(rows * k * 8 + 1), c->w = malloc(rows * k * 4 + 1);
  c->src = malloc(rows * 4 + 1);
  o->recv_x = c->no_x ? NULL : c->x, o->recv_x_scales = c->scales;
  o->recv_topk_idx = c->idx, o->recv_topk_weights = c->w, o->recv_src_idx = c->src;
  return 0;
}

static const ep_output_mode_t modes[] = {EP_OUTPUT_CALLER,    EP_OUTPUT_CALLER,   EP_OUTPUT_CALLER,
                                         EP_OUTPUT_ALLOC,     EP_OUTPUT_ALLOC,    EP_OUTPUT_VIEWS,
                                         (ep_output_mode_t)0, (ep_output_mode_t)9};

static void make_out(bytes_t *b, const shapes_t *s, const ep_dispatch_args_t *a, alloc_t *ac,
                     ep_dispatch_out_t *o) {
  *o = (ep_dispatch_out_t)EP_DISPATCH_OUT_INIT;
  if (take(b) % 16 == 0) o->size = take(b);
  o->mode = modes[take(b) % 8];
  o->worst_case = s->worst != 0, o->capacity = s->worst ? s->worst : s->cap;
  o->alloc = take(b) % 16 ? fuzz_alloc : NULL, o->alloc_ctx = ac;
  ac->fail = take(b) % 8 == 0, ac->no_x = take(b) % 8 == 0;
  if (o->mode != EP_OUTPUT_ALLOC || take(b) % 8 == 0) { /* caller arrays, also where ignored */
    o->recv_x = s->rx, o->recv_x_scales = a->dtype == EP_DTYPE_FP8_E4M3 ? s->rs : NULL;
    o->recv_topk_idx = s->ri, o->recv_topk_weights = a->topk_weights ? s->rw : NULL;
    o->recv_src_idx = s->src;
  }
  o->rank_prefix = s->prefix, o->recv_tokens_per_expert = s->per_expert;
  o->num_recv_tokens = -777, o->handle = (ep_handle_t)(uintptr_t)0x5a5a;
}

/* ep_dispatch with the results' contract: untouched on failure; on success a handle exactly
 * when the dispatch was not cached (an args->size that ends before `cached` is an older
 * caller's struct without it: not cached). */
static ep_status_t dispatch(const ep_dispatch_args_t *a, ep_dispatch_out_t *o) {
  ep_status_t st = ep_dispatch(buffer, a, o);
  if (!o) return st;
  if (st != EP_OK) {
    CONTRACT(o->num_recv_tokens == -777 && o->handle == (ep_handle_t)(uintptr_t)0x5a5a);
    return st;
  }
  bool cached = a->cached && a->size >= offsetof(ep_dispatch_args_t, cached) + sizeof a->cached;
  CONTRACT(cached ? o->handle == NULL : o->handle != NULL);
  return st;
}

static void call_dispatch(bytes_t *b, shapes_t *s) {
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  if (take(b) % 16 == 0) a.size = take(b);
  a.x = s->x, a.dtype = s->dtype, a.num_tokens = s->n, a.hidden = s->h;
  a.x_scales = s->dtype == EP_DTYPE_FP8_E4M3 ? s->scales : NULL, a.num_scales = s->ns;
  a.topk_idx = s->idx, a.topk_weights = take(b) % 2 ? s->w : NULL, a.topk = s->topk;
  a.num_experts = s->e, a.expert_alignment = take(b) % 5 - 1;
  alloc_t ac = {0};
  ep_dispatch_out_t o;
  make_out(b, s, &a, &ac, &o);
  const ep_dispatch_args_t *ap = take(b) % 32 ? &a : NULL;
  ep_dispatch_out_t *op = take(b) % 32 ? &o : NULL;
  if (dispatch(ap, op) != EP_OK) {
    alloc_free(&ac);
    return;
  }
  ep_handle_t h = o.handle;
  int nr = -1;
  CONTRACT(ep_handle_num_recv_tokens(h, &nr) == EP_OK);
  uint16_t *out = calloc((size_t)(s->n > 0 ? s->n : 1) * (size_t)s->h, 2);
  float *ow = calloc((size_t)(s->n > 0 ? s->n : 1) * (size_t)s->topk, 4);
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  if (take(b) % 16 == 0) c.size = take(b);
  c.handle = h, c.x = o.recv_x, c.out = out;
  c.topk_weights = take(b) % 2 ? (o.mode == EP_OUTPUT_ALLOC ? ac.w : s->rw) : NULL;
  c.out_topk_weights = take(b) % 2 ? ow : NULL;
  if (s->dtype == EP_DTYPE_BF16) ep_combine(buffer, take(b) % 32 ? &c : NULL);
  if (take(b) % 8 == 0) /* a normal handle is not a low-latency one */
    CONTRACT(ep_ll_handle_destroy((ep_ll_handle_t)h) == EP_ERR_INVALID_ARG);
  if (take(b) % 2) { /* cached dispatch along the handle */
    a.cached = h;
    make_out(b, s, &a, &ac, &o);
    dispatch(&a, &o);
  }
  ep_handle_destroy(h);
  if (take(b) % 8 == 0) ep_handle_destroy(h); /* double destroy: reported, harmless */
  alloc_free(&ac);
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
      idx[t * kk + j] =
          take(b) % 10 ? (int64_t)((t + j * 3 + (take(b) % 2)) % LL_E) : (int64_t)take(b) - 120;
  for (size_t i = 0; x && i < nn * LL_H; i++) x[i] = (uint16_t)(take(b) << 8 | take(b));
  uint16_t *y = calloc((size_t)LL_E * LL_T * LL_H, 2);
  ep_ll_handle_t h[3] = {NULL, NULL, NULL};
  int live = take(b) % 3 + 1;
  for (int i = 0; i < live; i++) {
    ep_ll_dispatch_args_t a = EP_LL_DISPATCH_ARGS_INIT;
    if (take(b) % 16 == 0) a.size = take(b);
    a.x = x, a.num_tokens = n, a.topk_idx = idx, a.topk = k, a.use_fp8 = take(b) % 2;
    a.round_scale = take(b) % 2, a.use_ue8m0 = take(b) % 2, a.two_phase = take(b) % 2;
    ep_ll_handle_t got = (ep_ll_handle_t)(uintptr_t)0x5a5a;
    ep_status_t st = ep_ll_dispatch(buffer, take(b) % 32 ? &a : NULL, take(b) % 16 ? &got : NULL);
    if (st != EP_OK) {
      CONTRACT(got == (ep_ll_handle_t)(uintptr_t)0x5a5a);
      continue;
    }
    h[i] = got;
    CONTRACT(h[i] != NULL);
    if (take(b) % 8 == 0) /* a low-latency handle is not a normal one */
      CONTRACT(ep_handle_destroy((ep_handle_t)h[i]) == EP_ERR_INVALID_ARG);
    if (a.two_phase) ep_ll_recv(buffer, h[i]);
    ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
    if (take(b) % 16 == 0) v.size = take(b);
    ep_ll_get_recv_view(h[i], &v);
    int nr;
    ep_ll_handle_num_recv_tokens(h[i], &nr);
    ep_ll_combine_args_t c = EP_LL_COMBINE_ARGS_INIT;
    c.handle = h[i], c.y = y, c.topk_idx = idx, c.topk_weights = w, c.two_phase = take(b) % 2;
    c.out = out;
    if (take(b) % 2 && ep_ll_combine(buffer, &c) == EP_OK && c.two_phase) ep_ll_recv(buffer, h[i]);
  }
  for (int i = 0; i < 3; i++) ep_ll_handle_destroy(h[i]);
  free(x), free(out), free(idx), free(w), free(y);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  bytes_t b = {data, size};
  shapes_t s;
  make(&b, &s);
  int32_t pr[1], pe[8];
  uint8_t ir[64];
  switch (take(&b) % 5) {
    case 3:
      call_ll(&b);
      break;
    case 4: { /* a size the library accepts fills that many bytes of a full-size info */
      ep_buffer_info_t info;
      memset(&info, 0, sizeof info);
      info.size = take(&b) % 4 ? sizeof info : take(&b);
      ep_buffer_query(buffer, take(&b) % 16 ? &info : NULL);
      break;
    }
    case 0: {
      ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
      if (take(&b) % 16 == 0) l.size = take(&b);
      l.topk_idx = s.idx, l.num_tokens = s.n, l.topk = s.topk, l.num_experts = s.e;
      l.tokens_per_rank = pr, l.tokens_per_expert = s.e > 0 && s.e <= 8 ? pe : NULL;
      l.is_token_in_rank = s.n > 0 && s.n <= 64 ? ir : NULL;
      ep_get_dispatch_layout(buffer, take(&b) % 32 ? &l : NULL);
      break;
    }
    default:
      call_dispatch(&b, &s);
      break;
  }
  release(&s);
  return 0;
}
