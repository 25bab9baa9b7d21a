/* Public entry points of normal mode: layout, dispatch, combine. The core checks everything
 * that can be checked without reading tensor contents, then hands over to the backend. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"

#define NEED(cond, st, ...)                                       \
  do {                                                            \
    if (!(cond)) return ep_err((st), __VA_ARGS__);                \
  } while (0)

/* ------------------------------------------------------------------ layout */

static ep_status_t check_routing(int R, const int64_t *topk_idx, int n, int topk, int E,
                                 const char *op) {
  NEED(n >= 0, EP_ERR_OUT_OF_RANGE, "%s: num_tokens is %d, must be >= 0", op, n);
  NEED(topk >= 1 && topk <= EP_MAX_TOPK, EP_ERR_OUT_OF_RANGE,
       "%s: topk is %d, must be in [1, %d]", op, topk, EP_MAX_TOPK);
  NEED(n == 0 || topk_idx, EP_ERR_NULL_ARG, "%s: topk_idx is NULL", op);
  NEED(E >= 1, EP_ERR_OUT_OF_RANGE, "%s: num_experts is %d, must be >= 1", op, E);
  NEED(E % R == 0, EP_ERR_SHAPE, "%s: num_experts %d is not divisible by the %d ranks", op, E, R);
  NEED(E / R <= EP_MAX_LOCAL_EXPERTS, EP_ERR_TOO_LARGE,
       "%s: num_experts %d gives %d experts per rank, more than %d", op, E, E / R,
       EP_MAX_LOCAL_EXPERTS);
  return EP_OK;
}

ep_status_t ep_get_dispatch_layout(ep_buffer_t buffer, const int64_t *topk_idx, int num_tokens,
                                   int topk, int num_experts, int32_t *tokens_per_rank,
                                   int32_t *tokens_per_expert, uint8_t *is_token_in_rank,
                                   void *stream) {
  static const char op[] = "ep_get_dispatch_layout";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  st = check_routing(b->group->nranks, topk_idx, num_tokens, topk, num_experts, op);
  if (!st) {
    ep_layout_args_t a = {topk_idx, num_tokens, topk, num_experts, tokens_per_rank,
                          tokens_per_expert, is_token_in_rank, stream};
    st = ep_buffer_after(b, b->ops->layout(b->state, &a), op);
  }
  ep_buffer_put(b);
  return st;
}

/* ------------------------------------------------------------------ dispatch */

static ep_status_t check_payload(const ep_dispatch_args_t *a, const char *op) {
  NEED(a->dtype == EP_DTYPE_BF16 || a->dtype == EP_DTYPE_FP8_E4M3, EP_ERR_INVALID_ARG,
       "%s: dtype %d is not bf16 or fp8_e4m3", op, (int)a->dtype);
  NEED(a->num_tokens >= 0, EP_ERR_OUT_OF_RANGE, "%s: num_tokens is %d, must be >= 0", op,
       a->num_tokens);
  NEED(a->hidden >= 1, EP_ERR_OUT_OF_RANGE, "%s: hidden is %d, must be >= 1", op, a->hidden);
  size_t row = (size_t)a->hidden * ep_dtype_size(a->dtype);
  NEED(row % 16 == 0, EP_ERR_SHAPE, "%s: hidden %d gives rows of %zu bytes, not a multiple of 16",
       op, a->hidden, row);
  NEED(a->num_tokens == 0 || a->x, EP_ERR_NULL_ARG, "%s: x is NULL", op);
  if (a->dtype == EP_DTYPE_BF16) {
    NEED(!a->x_scales, EP_ERR_INVALID_ARG, "%s: x_scales given with bf16 x", op);
    return EP_OK;
  }
  NEED(a->num_scales >= 1 && a->num_scales <= EP_MAX_SCALES, EP_ERR_OUT_OF_RANGE,
       "%s: num_scales is %d, must be in [1, %d]", op, a->num_scales, EP_MAX_SCALES);
  NEED(a->num_tokens == 0 || a->x_scales, EP_ERR_NULL_ARG, "%s: x_scales is NULL (fp8 x)", op);
  NEED(a->scale_token_stride >= 0 && a->scale_hidden_stride >= 0, EP_ERR_OUT_OF_RANGE,
       "%s: scale strides must not be negative", op);
  return EP_OK;
}

static ep_status_t check_outputs(const ep_dispatch_args_t *a, bool cached, bool views,
                                 const char *op) {
  NEED(a->worst_case_tokens >= 0, EP_ERR_OUT_OF_RANGE, "%s: worst_case_tokens is %d", op,
       a->worst_case_tokens);
  NEED(a->recv_capacity >= 0, EP_ERR_OUT_OF_RANGE, "%s: recv_capacity is %d", op,
       a->recv_capacity);
  NEED(a->expert_alignment >= 0, EP_ERR_OUT_OF_RANGE, "%s: expert_alignment is %d", op,
       a->expert_alignment);
  NEED(!(a->alloc && a->worst_case_tokens), EP_ERR_INVALID_ARG,
       "%s: alloc is for the synchronous path; the worst-case path takes fixed outputs", op);
  NEED(a->num_recv_tokens, EP_ERR_NULL_ARG, "%s: num_recv_tokens is NULL", op);
  if (!a->alloc && (a->recv_x || !views)) {
    NEED(a->recv_x, EP_ERR_NULL_ARG, "%s: recv_x is NULL (give outputs or alloc)", op);
    NEED(a->dtype != EP_DTYPE_FP8_E4M3 || a->recv_x_scales, EP_ERR_NULL_ARG,
         "%s: recv_x_scales is NULL (fp8 x)", op);
  }
  NEED(a->dtype == EP_DTYPE_FP8_E4M3 || !a->recv_x_scales, EP_ERR_INVALID_ARG,
       "%s: recv_x_scales given with bf16 x", op);
  if (cached) {
    NEED(!a->handle, EP_ERR_INVALID_ARG, "%s: handle must be NULL in a cached dispatch (the "
         "cached handle stays valid)", op);
    return EP_OK;
  }
  NEED(a->topk_weights || !a->recv_topk_weights, EP_ERR_INVALID_ARG,
       "%s: recv_topk_weights requested but topk_weights is NULL", op);
  return EP_OK;
}

static void default_scales(ep_dispatch_args_t *a) {
  if (a->dtype != EP_DTYPE_FP8_E4M3) return;
  if (!a->num_scales) a->num_scales = (a->hidden + 127) / 128;
  if (!a->scale_token_stride) a->scale_token_stride = a->num_scales;
  if (!a->scale_hidden_stride) a->scale_hidden_stride = 1;
}

static ep_status_t check_cached(ep_buffer *b, ep_dispatch_args_t *a, ep_handle **h,
                                const char *op) {
  ep_status_t st = ep_handle_get(b, a->cached, op, "cached", EP_HANDLE_NORMAL, h);
  if (st) return st;
  const ep_handle_info_t *i = &(*h)->info;
  if (a->num_tokens != i->num_tokens || a->hidden != i->hidden || a->dtype != i->dtype ||
      (a->dtype == EP_DTYPE_FP8_E4M3 && a->num_scales != i->num_scales)) {
    ep_handle_put(*h);
    *h = NULL;
    return ep_err(EP_ERR_MISMATCH, "%s: num_tokens/hidden/dtype/num_scales (%d/%d/%d/%d) differ "
                  "from the cached handle's (%d/%d/%d/%d)", op, a->num_tokens, a->hidden,
                  (int)a->dtype, a->num_scales, i->num_tokens, i->hidden, (int)i->dtype,
                  i->num_scales);
  }
  return EP_OK;
}

static ep_status_t validate_dispatch(ep_buffer *b, ep_dispatch_args_t *a, ep_handle **cached,
                                     const char *op) {
  default_scales(a);
  ep_status_t st = check_payload(a, op);
  bool views = (b->ops->caps & EP_CAP_DISPATCH_VIEWS) != 0;
  if (!st) st = check_outputs(a, a->cached != NULL, views, op);
  if (st) return st;
  if (a->cached) return check_cached(b, a, cached, op);
  return check_routing(b->group->nranks, a->topk_idx, a->num_tokens, a->topk, a->num_experts,
                       op);
}

static ep_status_t run_dispatch(ep_buffer *b, ep_dispatch_args_t *a, ep_handle *cached,
                                ep_dispatch_args_t *user, const char *op) {
  ep_handle_info_t info;
  memset(&info, 0, sizeof info);
  ep_status_t st = b->ops->dispatch(b->state, a, cached ? &cached->info : NULL, &info);
  st = ep_buffer_after(b, st, op);
  if (st) {
    if (info.free_priv) info.free_priv(info.priv);
    return st;
  }
  ep_handle_t out = NULL;
  if (!cached && a->handle) st = ep_handle_new(b, &info, &out);
  else if (info.free_priv) info.free_priv(info.priv);
  if (st) return st;
  if (a->handle) *a->handle = out;
  if (ep_log_enabled(EP_LOG_DEBUG))
    ep_log_at(EP_LOG_DEBUG, b->group->rank, "run", "%s: %d tokens sent, %d received (hidden %d, "
              "%s%s)", op, a->num_tokens, *a->num_recv_tokens, a->hidden,
              a->dtype == EP_DTYPE_BF16 ? "bf16" : "fp8", cached ? ", cached" : "");
  /* Outputs an allocator filled in, or views, are reported back through the caller's struct. */
  if (a->alloc || !user->recv_x) {
    user->recv_x = a->recv_x;
    user->recv_x_scales = a->recv_x_scales;
    user->recv_topk_idx = a->recv_topk_idx;
    user->recv_topk_weights = a->recv_topk_weights;
    user->recv_src_idx = a->recv_src_idx;
  }
  return EP_OK;
}

ep_status_t ep_dispatch(ep_buffer_t buffer, ep_dispatch_args_t *args) {
  static const char op[] = "ep_dispatch";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_dispatch_args_t a;
  memset(&a, 0, sizeof a);
  ep_handle *cached = NULL;
  if (!(st = ep_args_load(&a, sizeof a, args, op)))
    st = validate_dispatch(b, &a, &cached, op);
  if (st) {
    /* Peers must not wait for a call this rank will not make. */
    if (b->ops->reject) b->ops->reject(b->state);
    ep_errbox_put(&b->err, ep_last_error());
  } else {
    st = run_dispatch(b, &a, cached, args, op);
  }
  if (cached) ep_handle_put(cached);
  ep_buffer_put(b);
  return st;
}

/* ------------------------------------------------------------------ combine */

static ep_status_t validate_combine(const ep_combine_args_t *a, const ep_handle_info_t *i,
                                    const char *op) {
  NEED(i->recv_rows == 0 || a->x, EP_ERR_NULL_ARG, "%s: x is NULL", op);
  NEED(i->num_tokens == 0 || a->out, EP_ERR_NULL_ARG, "%s: out is NULL", op);
  NEED(!a->topk_weights || i->topk > 0, EP_ERR_INVALID_ARG,
       "%s: topk_weights given but the dispatch had no topk", op);
  NEED(!a->topk_weights || i->num_tokens == 0 || a->out_topk_weights, EP_ERR_NULL_ARG,
       "%s: out_topk_weights is NULL but topk_weights is given", op);
  NEED(a->topk_weights || !a->out_topk_weights, EP_ERR_INVALID_ARG,
       "%s: out_topk_weights requested but topk_weights is NULL", op);
  return EP_OK;
}

ep_status_t ep_combine(ep_buffer_t buffer, const ep_combine_args_t *args) {
  static const char op[] = "ep_combine";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_combine_args_t a;
  memset(&a, 0, sizeof a);
  ep_handle *h = NULL;
  if (!(st = ep_args_load(&a, sizeof a, args, op)))
    st = ep_handle_get(b, a.handle, op, "handle", EP_HANDLE_NORMAL, &h);
  if (!st) st = validate_combine(&a, &h->info, op);
  if (st) {
    if (b->ops->reject) b->ops->reject(b->state);
    ep_errbox_put(&b->err, ep_last_error());
  } else {
    st = ep_buffer_after(b, b->ops->combine(b->state, &a, &h->info), op);
    if (!st && ep_log_enabled(EP_LOG_DEBUG))
      ep_log_at(EP_LOG_DEBUG, b->group->rank, "run", "%s: %d rows back, %d tokens reduced", op,
                h->info.num_recv_tokens, h->info.num_tokens);
  }
  if (h) ep_handle_put(h);
  ep_buffer_put(b);
  return st;
}
