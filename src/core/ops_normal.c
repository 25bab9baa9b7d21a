/* Public entry points of normal mode: layout, dispatch, combine. The core checks everything
 * that can be checked without reading tensor contents, describes the call (src/core/call.c),
 * then hands over to the backend. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"

#define NEED(cond, st, ...)                        \
  do {                                             \
    if (!(cond)) return ep_err((st), __VA_ARGS__); \
  } while (0)

/* ------------------------------------------------------------------ layout */

static ep_status_t check_routing(int R, const int64_t *topk_idx, int n, int topk, int E,
                                 const char *op) {
  NEED(n >= 0, EP_ERR_OUT_OF_RANGE, "%s: num_tokens is %d, must be >= 0", op, n);
  NEED(n <= EP_MAX_TOKENS, EP_ERR_TOO_LARGE, "%s: num_tokens is %d, at most %d per call", op, n,
       EP_MAX_TOKENS);
  NEED(topk >= 1 && topk <= EP_MAX_TOPK, EP_ERR_OUT_OF_RANGE, "%s: topk is %d, must be in [1, %d]",
       op, topk, EP_MAX_TOPK);
  NEED(n == 0 || topk_idx, EP_ERR_NULL_ARG, "%s: topk_idx is NULL", op);
  NEED(E >= 1, EP_ERR_OUT_OF_RANGE, "%s: num_experts is %d, must be >= 1", op, E);
  NEED(E % R == 0, EP_ERR_SHAPE, "%s: num_experts %d is not divisible by the %d ranks", op, E, R);
  NEED(E / R <= EP_MAX_LOCAL_EXPERTS, EP_ERR_TOO_LARGE,
       "%s: num_experts %d gives %d experts per rank, more than %d", op, E, E / R,
       EP_MAX_LOCAL_EXPERTS);
  return EP_OK;
}

ep_status_t ep_get_dispatch_layout(ep_buffer_t buffer, const ep_layout_args_t *args) {
  static const char op[] = "ep_get_dispatch_layout";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_layout_args_t a;
  memset(&a, 0, sizeof a);
  if (!(st = ep_args_load_since(&a, sizeof a, offsetof(ep_layout_args_t, tokens_per_host), args, op,
                                "args")))
    st = check_routing(b->group->nranks, a.topk_idx, a.num_tokens, a.topk, a.num_experts, op);
  if (!st) st = ep_buffer_after(b, b->ops->layout(b->state, &a), op);
  ep_buffer_put(b);
  return st;
}

/* ------------------------------------------------------------------ dispatch */

static ep_status_t check_payload(const ep_dispatch_args_t *a, const char *op) {
  NEED(a->dtype == EP_DTYPE_BF16 || a->dtype == EP_DTYPE_FP8_E4M3, EP_ERR_INVALID_ARG,
       "%s: args->dtype is %d: set EP_DTYPE_BF16 or EP_DTYPE_FP8_E4M3", op, (int)a->dtype);
  NEED(a->num_tokens >= 0, EP_ERR_OUT_OF_RANGE, "%s: num_tokens is %d, must be >= 0", op,
       a->num_tokens);
  NEED(a->num_tokens <= EP_MAX_TOKENS, EP_ERR_TOO_LARGE,
       "%s: num_tokens is %d, at most %d per "
       "call",
       op, a->num_tokens, EP_MAX_TOKENS);
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

/* The output mode and the arrays it needs. */
static ep_status_t check_mode(const ep_buffer *b, const ep_dispatch_out_t *o, const char *op) {
  NEED(o->mode >= EP_OUTPUT_CALLER && o->mode <= EP_OUTPUT_VIEWS, EP_ERR_INVALID_ARG,
       "%s: out->mode is %d: set EP_OUTPUT_CALLER, EP_OUTPUT_ALLOC or EP_OUTPUT_VIEWS", op,
       (int)o->mode);
  NEED(o->mode != EP_OUTPUT_VIEWS || (b->ops->caps & EP_CAP_DISPATCH_VIEWS), EP_ERR_UNSUPPORTED,
       "%s: out->mode is EP_OUTPUT_VIEWS but the %s backend has no dispatch views (see "
       "ep_buffer_query); use EP_OUTPUT_CALLER or EP_OUTPUT_ALLOC",
       op, b->ops->name);
  NEED(o->mode != EP_OUTPUT_ALLOC || o->alloc, EP_ERR_NULL_ARG,
       "%s: out->alloc is NULL (out->mode is EP_OUTPUT_ALLOC)", op);
  NEED(o->mode != EP_OUTPUT_ALLOC || !o->worst_case, EP_ERR_INVALID_ARG,
       "%s: out->worst_case needs outputs of fixed size: EP_OUTPUT_CALLER or EP_OUTPUT_VIEWS, "
       "not EP_OUTPUT_ALLOC",
       op);
  NEED(o->worst_case == 0 || o->worst_case == 1, EP_ERR_INVALID_ARG,
       "%s: out->worst_case is %d, must be 0 or 1", op, o->worst_case);
  NEED(o->capacity >= 0, EP_ERR_OUT_OF_RANGE, "%s: out->capacity is %d, must be >= 0", op,
       o->capacity);
  NEED(!o->worst_case || o->capacity > 0, EP_ERR_OUT_OF_RANGE,
       "%s: out->capacity is 0 with out->worst_case: give the worst-case rows", op);
  return EP_OK;
}

static ep_status_t check_outputs(const ep_buffer *b, const ep_dispatch_args_t *a,
                                 const ep_dispatch_out_t *o, const char *op) {
  ep_status_t st = check_mode(b, o, op);
  if (st) return st;
  NEED(a->expert_alignment >= 0, EP_ERR_OUT_OF_RANGE, "%s: expert_alignment is %d", op,
       a->expert_alignment);
  if (o->mode == EP_OUTPUT_CALLER) {
    NEED(o->recv_x, EP_ERR_NULL_ARG, "%s: out->recv_x is NULL (out->mode is EP_OUTPUT_CALLER)", op);
    NEED(a->dtype != EP_DTYPE_FP8_E4M3 || o->recv_x_scales, EP_ERR_NULL_ARG,
         "%s: out->recv_x_scales is NULL (fp8 x)", op);
    NEED(a->dtype == EP_DTYPE_FP8_E4M3 || !o->recv_x_scales, EP_ERR_INVALID_ARG,
         "%s: out->recv_x_scales given with bf16 x", op);
    NEED(a->topk_weights || a->cached || !o->recv_topk_weights, EP_ERR_INVALID_ARG,
         "%s: out->recv_topk_weights requested but topk_weights is NULL", op);
  }
  return EP_OK;
}

/* Row arrays are the caller's only in EP_OUTPUT_CALLER: whatever a reused out struct still holds
 * must not be written through when the allocator or the backend is to set them. */
static void clear_rows(ep_dispatch_out_t *o) {
  if (o->mode == EP_OUTPUT_CALLER) return;
  o->recv_x = NULL, o->recv_x_scales = NULL, o->recv_topk_idx = NULL;
  o->recv_topk_weights = NULL, o->recv_src_idx = NULL;
}

static void default_scales(ep_dispatch_args_t *a) {
  if (a->dtype != EP_DTYPE_FP8_E4M3) return;
  if (!a->num_scales) a->num_scales = (a->hidden + 127) / 128;
  if (!a->scale_token_stride) a->scale_token_stride = a->num_scales;
  if (!a->scale_hidden_stride) a->scale_hidden_stride = 1;
}

static ep_status_t check_cached(ep_buffer *b, const ep_dispatch_args_t *a, ep_handle **h,
                                const char *op) {
  ep_status_t st = ep_handle_get(b, a->cached, op, "args->cached", EP_HANDLE_NORMAL, h);
  if (st) return st;
  const ep_handle_info_t *i = &(*h)->info;
  if (a->num_tokens != i->num_tokens || a->hidden != i->hidden || a->dtype != i->dtype ||
      (a->dtype == EP_DTYPE_FP8_E4M3 && a->num_scales != i->num_scales)) {
    ep_handle_put(*h);
    *h = NULL;
    return ep_err(EP_ERR_MISMATCH,
                  "%s: num_tokens/hidden/dtype/num_scales (%d/%d/%d/%d) differ "
                  "from the cached handle's (%d/%d/%d/%d)",
                  op, a->num_tokens, a->hidden, (int)a->dtype, a->num_scales, i->num_tokens,
                  i->hidden, (int)i->dtype, i->num_scales);
  }
  return EP_OK;
}

/* The call as the backend sees it: layout facts, what ranks compare, where rows go. */
static void describe(const ep_buffer *b, ep_dispatch_call_t *c, const ep_handle_info_t *h) {
  ep_dispatch_args_t *a = &c->in;
  c->cached = h;
  c->topk = h ? h->topk : a->topk;
  c->num_experts = h ? h->num_experts : a->num_experts;
  c->num_local = c->num_experts / b->group->nranks;
  c->has_w = !h && a->topk_weights != NULL;
  c->sync = !c->out.worst_case;
  c->views = c->out.mode == EP_OUTPUT_VIEWS;
  c->row_bytes = (size_t)a->hidden * ep_dtype_size(a->dtype);
  c->scale_bytes = a->dtype == EP_DTYPE_FP8_E4M3 ? (size_t)a->num_scales * sizeof(float) : 0;
  int32_t *f = c->key.f;
  f[EP_CF_KIND] = h ? EP_CALL_CACHED : EP_CALL_DISPATCH;
  f[EP_CF_HIDDEN] = a->hidden;
  f[EP_CF_DTYPE] = a->dtype;
  f[EP_CF_TOPK] = h ? 0 : a->topk;
  f[EP_CF_EXPERTS] = h ? 0 : a->num_experts;
  f[EP_CF_SCALES] = a->dtype == EP_DTYPE_FP8_E4M3 ? a->num_scales : 0;
  f[EP_CF_WEIGHTS] = c->has_w;
  f[EP_CF_LAYOUT] = h ? h->number : 0;
  if (h) { /* the layout is the handle's: nothing of the caller's routing is read */
    a->topk_idx = NULL, a->topk_weights = NULL, a->topk = h->topk, a->num_experts = h->num_experts;
  }
}

static ep_status_t validate_dispatch(ep_buffer *b, ep_dispatch_call_t *c, ep_handle **cached,
                                     const char *op) {
  ep_dispatch_args_t *a = &c->in;
  default_scales(a);
  ep_status_t st = check_payload(a, op);
  if (!st) st = check_outputs(b, a, &c->out, op);
  if (!st) clear_rows(&c->out);
  if (!st && a->cached)
    st = check_cached(b, a, cached, op);
  else if (!st)
    st = check_routing(b->group->nranks, a->topk_idx, a->num_tokens, a->topk, a->num_experts, op);
  if (!st) describe(b, c, *cached ? &(*cached)->info : NULL);
  return st;
}

/* What the caller gets back: the results and the row arrays (set by alloc or views). */
static void report(const ep_dispatch_out_t *o, ep_dispatch_out_t *user) {
  user->num_recv_tokens = o->num_recv_tokens;
  user->handle = o->handle;
  if (o->mode == EP_OUTPUT_CALLER) return;
  user->recv_x = o->recv_x;
  user->recv_x_scales = o->recv_x_scales;
  user->recv_topk_idx = o->recv_topk_idx;
  user->recv_topk_weights = o->recv_topk_weights;
  user->recv_src_idx = o->recv_src_idx;
}

static ep_status_t run_dispatch(ep_buffer *b, ep_dispatch_call_t *c, ep_handle *cached,
                                int32_t number, ep_dispatch_out_t *user, const char *op) {
  ep_handle_info_t info;
  memset(&info, 0, sizeof info);
  c->out.handle = NULL;
  ep_status_t st = ep_buffer_after(b, b->ops->dispatch(b->state, c, &info), op);
  info.number = number; /* the combines and cached dispatches along it carry it in their key */
  if (!st && !cached)
    st = ep_handle_new(b, &info, &c->out.handle);
  else if (info.free_priv)
    info.free_priv(info.priv);
  if (st) return st;
  report(&c->out, user);
  if (ep_log_enabled(EP_LOG_DEBUG))
    ep_log_at(EP_LOG_DEBUG, b->group->rank, "run",
              "%s: %d tokens sent, %d received (hidden %d, "
              "%s%s)",
              op, c->in.num_tokens, c->out.num_recv_tokens, c->in.hidden,
              c->in.dtype == EP_DTYPE_BF16 ? "bf16" : "fp8", cached ? ", cached" : "");
  return EP_OK;
}

ep_status_t ep_dispatch(ep_buffer_t buffer, const ep_dispatch_args_t *args,
                        ep_dispatch_out_t *out) {
  static const char op[] = "ep_dispatch";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  /* Every call is numbered, whatever its outcome on this rank (one rank's output may be too
   * small while the others' call succeeds): the ranks make the same calls in the same order
   * (SEMANTICS.md §1.4), so a handle carries the same number on every rank. */
  const int32_t number = (int32_t)++b->dispatches;
  ep_dispatch_call_t c;
  memset(&c, 0, sizeof c);
  ep_handle *cached = NULL;
  if (!(st = ep_args_load(&c.in, sizeof c.in, args, op, "args")) &&
      !(st = ep_args_load_since(&c.out, sizeof c.out, offsetof(ep_dispatch_out_t, on_wait), out, op,
                                "out")))
    st = validate_dispatch(b, &c, &cached, op);
  if (st) {
    /* Peers must not wait for a call this rank will not make. */
    b->ops->reject(b->state);
    ep_errbox_put(&b->err, ep_last_error());
  } else {
    st = run_dispatch(b, &c, cached, number, out, op);
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
  if (!(st = ep_args_load(&a, sizeof a, args, op, "args")))
    st = ep_handle_get(b, a.handle, op, "args->handle", EP_HANDLE_NORMAL, &h);
  if (!st) st = validate_combine(&a, &h->info, op);
  if (st) {
    b->ops->reject(b->state);
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

ep_status_t ep_get_combine_buffer(ep_buffer_t buffer, ep_handle_t handle, void **x) {
  static const char op[] = "ep_get_combine_buffer";
  NEED(x, EP_ERR_NULL_ARG, "%s: x is NULL", op);
  NEED(buffer, EP_ERR_NULL_ARG, "%s: buf is NULL", op);
  /* A local query, like ep_ll_get_combine_buffer: it pins the buffer without excluding calls. */
  ep_buffer *b;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, false, (void **)&b);
  if (st) return ep_err_named(st, op, "buf");
  ep_handle *h = NULL;
  void *p = NULL;
  if (!(st = ep_handle_get(b, handle, op, "handle", EP_HANDLE_NORMAL, &h)))
    st = b->ops->combine_buffer ? b->ops->combine_buffer(b->state, &h->info, &p)
                                : ep_err(EP_ERR_UNSUPPORTED,
                                         "%s: the %s backend has no combine "
                                         "buffer (it reads any x where it is)",
                                         op, b->ops->name);
  if (!st) *x = p;
  if (h) ep_handle_put(h);
  ep_reg_release(b->id);
  return st;
}
