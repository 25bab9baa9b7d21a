/* Public entry points of low-latency mode (SEMANTICS.md §6). The core checks everything that
 * can be checked without reading tensor contents, enforces the two-live-handles rule, and hands
 * over to the backend. A collective call rejected here is announced to the peers (ops->ll_reject),
 * so that their matching call fails at once instead of waiting for this rank until the deadline. */
#include <stdio.h>
#include <string.h>

#include "buffer.h"

#define NEED(cond, st, ...)                        \
  do {                                             \
    if (!(cond)) return ep_err((st), __VA_ARGS__); \
  } while (0)

/* Results are double-buffered: one slot per live handle. */
#define LL_SLOTS 2
/* Row positions and (token, slot) indices are int32 everywhere; this keeps R*T*topk far from
 * overflow for any R the group allows. */
#define LL_MAX_TOKENS 65536

ep_status_t ep_ll_check_config(const ep_buffer_config_t *c, int R) {
  int T = c->ll_max_tokens, H = c->ll_hidden, E = c->ll_num_experts, K = c->ll_max_topk;
  if (!T && !H && !E) return EP_OK;
  NEED(T >= 1 && H >= 1 && E >= 1, EP_ERR_OUT_OF_RANGE,
       "cfg: ll_max_tokens, ll_hidden, ll_num_experts are %d, %d, %d: give all three "
       "low-latency sizes (each >= 1) or none",
       T, H, E);
  NEED(T <= LL_MAX_TOKENS, EP_ERR_TOO_LARGE, "cfg->ll_max_tokens: %d, at most %d", T,
       LL_MAX_TOKENS);
  NEED(H % 8 == 0, EP_ERR_SHAPE,
       "cfg->ll_hidden: %d is not a multiple of 8 (bf16 rows must be "
       "a multiple of 16 bytes)",
       H);
  NEED(E % R == 0, EP_ERR_SHAPE, "cfg->ll_num_experts: %d is not divisible by the %d ranks", E, R);
  NEED(E / R <= EP_MAX_LOCAL_EXPERTS, EP_ERR_TOO_LARGE,
       "cfg->ll_num_experts: %d gives %d experts per rank, more than %d", E, E / R,
       EP_MAX_LOCAL_EXPERTS);
  NEED(K >= 1 && K <= EP_MAX_TOPK, EP_ERR_OUT_OF_RANGE, "cfg->ll_max_topk: %d, must be in [1, %d]",
       K, EP_MAX_TOPK);
  double bytes = 2.0 * ((double)E * T * (4.0 * H + 8) + 2.0 * T * K * H);
  NEED(bytes <= 0x1p44, EP_ERR_TOO_LARGE,
       "cfg: the low-latency sizes (T=%d, H=%d, E=%d, K=%d) "
       "need %.3g bytes of buffer per rank",
       T, H, E, K, bytes);
  return EP_OK;
}

const char *ep_ll_state_why(int st) {
  switch (st) {
    case EP_LLS_SENT:
      return "its dispatch receive is pending (call ep_ll_recv)";
    case EP_LLS_RECEIVED:
      return "its dispatch is complete";
    case EP_LLS_COMB_SENT:
      return "its combine receive is pending (call ep_ll_recv)";
    case EP_LLS_COMBINED:
      return "it was already combined (one combine per dispatch)";
    case EP_LLS_FAILED:
      return "a call on it failed (destroy it and dispatch again)";
    default:
      return "it holds no result";
  }
}

static ep_status_t ll_enabled(const ep_buffer *b, const char *op) {
  NEED(b->ops->ll_dispatch && b->ops->ll_reject, EP_ERR_UNSUPPORTED,
       "%s: the %s backend has no low-latency mode", op, b->ops->name);
  NEED(b->cfg.ll_max_tokens > 0, EP_ERR_INVALID_ARG,
       "%s: low-latency mode is disabled on this "
       "buffer; create it with ll_max_tokens, ll_hidden and ll_num_experts",
       op);
  return EP_OK;
}

/* ------------------------------------------------------------------ dispatch */

static ep_status_t check_dispatch(const ep_buffer *b, ep_ll_dispatch_args_t *a, const char *op) {
  const ep_buffer_config_t *c = &b->cfg;
  NEED(a->num_tokens >= 0, EP_ERR_OUT_OF_RANGE, "%s: num_tokens is %d, must be >= 0", op,
       a->num_tokens);
  NEED(a->num_tokens <= c->ll_max_tokens, EP_ERR_TOO_LARGE,
       "%s: num_tokens %d exceeds the buffer's ll_max_tokens %d", op, a->num_tokens,
       c->ll_max_tokens);
  NEED(a->topk >= 1, EP_ERR_OUT_OF_RANGE, "%s: topk is %d, must be >= 1", op, a->topk);
  NEED(a->topk <= c->ll_max_topk, EP_ERR_TOO_LARGE,
       "%s: topk %d exceeds the buffer's "
       "ll_max_topk %d",
       op, a->topk, c->ll_max_topk);
  NEED(a->num_tokens == 0 || a->x, EP_ERR_NULL_ARG, "%s: x is NULL", op);
  NEED(a->num_tokens == 0 || a->topk_idx, EP_ERR_NULL_ARG, "%s: topk_idx is NULL", op);
  a->use_fp8 = !!a->use_fp8, a->round_scale = !!a->round_scale, a->use_ue8m0 = !!a->use_ue8m0;
  a->two_phase = !!a->two_phase;
  NEED(!a->round_scale || a->use_fp8, EP_ERR_INVALID_ARG, "%s: round_scale requires use_fp8", op);
  NEED(!a->use_ue8m0 || a->round_scale, EP_ERR_INVALID_ARG,
       "%s: use_ue8m0 requires round_scale "
       "(an exponent byte only holds a power-of-two scale)",
       op);
  NEED(!a->use_fp8 || c->ll_hidden % 128 == 0, EP_ERR_SHAPE,
       "%s: use_fp8 needs ll_hidden to be "
       "a multiple of 128 (one scale per 128 channels); it is %d",
       op, c->ll_hidden);
  NEED(a->scale_layout == EP_SCALES_ROW_MAJOR || a->scale_layout == EP_SCALES_COL_MAJOR,
       EP_ERR_INVALID_ARG,
       "%s: scale_layout is %d, must be EP_SCALES_ROW_MAJOR (0) or "
       "EP_SCALES_COL_MAJOR (1)",
       op, a->scale_layout);
  NEED(!a->use_ue8m0 || a->scale_layout != EP_SCALES_COL_MAJOR || c->ll_hidden % 512 == 0,
       EP_ERR_SHAPE,
       "%s: scale_layout EP_SCALES_COL_MAJOR with use_ue8m0 packs four exponent "
       "bytes per int32 and needs ll_hidden to be a multiple of 512; it is %d",
       op, c->ll_hidden);
  NEED(b->ll_live < LL_SLOTS, EP_ERR_BUSY,
       "%s: %d low-latency handles are alive and the buffer "
       "holds %d results; destroy one (ep_ll_handle_destroy) before the next ep_ll_dispatch",
       op, b->ll_live, LL_SLOTS);
  return EP_OK;
}

static ep_status_t run_dispatch(ep_buffer *b, const ep_ll_dispatch_args_t *a,
                                ep_ll_handle_t *handle, const char *op) {
  ep_handle_info_t info;
  memset(&info, 0, sizeof info);
  ep_status_t st = ep_buffer_after(b, b->ops->ll_dispatch(b->state, a, &info), op);
  if (st) return st; /* the backend gave its slot back */
  ep_ll_handle_t out = NULL;
  if ((st = ep_handle_new(b, &info, &out))) {
    b->ops->ll_release(b->state, &info);
    return st;
  }
  b->ll_live++;
  *handle = out;
  if (ep_log_enabled(EP_LOG_DEBUG))
    ep_log_at(EP_LOG_DEBUG, b->group->rank, "run",
              "%s: %d tokens sent, %d rows received%s "
              "(%s, topk %d, %d results alive)",
              op, a->num_tokens, info.num_recv_tokens, a->two_phase ? " or on their way" : "",
              a->use_fp8 ? "fp8" : "bf16", a->topk, b->ll_live);
  return EP_OK;
}

ep_status_t ep_ll_dispatch(ep_buffer_t buffer, const ep_ll_dispatch_args_t *args,
                           ep_ll_handle_t *handle) {
  static const char op[] = "ep_ll_dispatch";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_ll_dispatch_args_t a;
  memset(&a, 0, sizeof a);
  if (!(st = ll_enabled(b, op))) { /* disabled: the same on every rank, nobody waits */
    if (!handle)
      st = ep_err(EP_ERR_NULL_ARG, "%s: handle is NULL (the result lives in a handle)", op);
    else if (!(st = ep_args_load(&a, sizeof a, args, op, "args")))
      st = check_dispatch(b, &a, op);
    if (st) {
      b->ops->ll_reject(b->state, false);
      ep_errbox_put(&b->err, ep_last_error());
    } else {
      st = run_dispatch(b, &a, handle, op);
    }
  }
  ep_buffer_put(b);
  return st;
}

/* ------------------------------------------------------------------ receive, view */

ep_status_t ep_ll_recv(ep_buffer_t buffer, ep_ll_handle_t handle) {
  static const char op[] = "ep_ll_recv";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_handle *h = NULL;
  if (!(st = ll_enabled(b, op)) && !(st = ep_handle_get(b, handle, op, "handle", EP_HANDLE_LL, &h)))
    st = ep_buffer_after(b, b->ops->ll_recv(b->state, &h->info), op);
  else
    ep_errbox_put(&b->err, ep_last_error());
  if (h) ep_handle_put(h);
  ep_buffer_put(b);
  return st;
}

static ep_status_t view_from(ep_handle *h, ep_ll_recv_view_t *view, const char *op) {
  ep_buffer *b;
  ep_status_t st = ep_reg_acquire(h->buffer_id, EP_OBJ_BUFFER, false, (void **)&b);
  if (st == EP_ERR_BUSY) return ep_err(st, "%s: a call on the handle's buffer is in flight", op);
  if (st)
    return ep_err(EP_ERR_DESTROYED,
                  "%s: the handle's buffer was destroyed (the received "
                  "rows lived in it)",
                  op);
  ep_ll_recv_view_t v;
  memset(&v, 0, sizeof v);
  v.size = view->size;
  st = b->ops->ll_view ? b->ops->ll_view(&h->info, &v)
                       : ep_err(EP_ERR_UNSUPPORTED, "%s: backend without low-latency mode", op);
  if (!st) memcpy(view, &v, view->size < sizeof v ? view->size : sizeof v);
  ep_reg_release(b->id);
  return st;
}

ep_status_t ep_ll_get_recv_view(ep_ll_handle_t handle, ep_ll_recv_view_t *view) {
  static const char op[] = "ep_ll_get_recv_view";
  NEED(view, EP_ERR_NULL_ARG, "%s: view is NULL", op);
  /* The rules of ep_struct_load, for an output struct: an older caller's smaller view gets the
   * fields it has; a size that is not a multiple of 8 would cut a pointer in half. */
  NEED(view->size >= sizeof(size_t) && view->size <= sizeof(ep_ll_recv_view_t) &&
           view->size % sizeof(void *) == 0,
       EP_ERR_CONFIG,
       "%s: view->size is %zu, this library "
       "accepts %zu..%zu (set it to sizeof(ep_ll_recv_view_t))",
       op, view->size, sizeof(size_t), sizeof(ep_ll_recv_view_t));
  ep_handle *h;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(handle), EP_OBJ_LL_HANDLE, false, (void **)&h);
  if (st) {
    return ep_err_named(st, op, "handle");
  }
  st = view_from(h, view, op);
  ep_reg_release(h->id);
  return st;
}

ep_status_t ep_ll_get_combine_buffer(ep_buffer_t buffer, ep_ll_handle_t handle, void **y) {
  static const char op[] = "ep_ll_get_combine_buffer";
  NEED(y, EP_ERR_NULL_ARG, "%s: y is NULL", op);
  NEED(buffer, EP_ERR_NULL_ARG, "%s: buf is NULL", op);
  /* A local query, like the view: it pins the buffer without excluding other queries. */
  ep_buffer *b;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, false, (void **)&b);
  if (st) {
    return ep_err_named(st, op, "buf");
  }
  ep_handle *h = NULL;
  void *p = NULL;
  if (!(st = ll_enabled(b, op)) && !(st = ep_handle_get(b, handle, op, "handle", EP_HANDLE_LL, &h)))
    st = b->ops->ll_combine_buffer ? b->ops->ll_combine_buffer(&h->info, &p)
                                   : ep_err(EP_ERR_UNSUPPORTED,
                                            "%s: the %s backend has no "
                                            "zero-copy combine buffer",
                                            op, b->ops->name);
  if (!st) *y = p;
  if (h) ep_handle_put(h);
  ep_reg_release(b->id);
  return st;
}

/* ------------------------------------------------------------------ combine */

static ep_status_t check_combine(const ep_ll_combine_args_t *a, const ep_handle_info_t *i,
                                 const char *op) {
  NEED(a->y, EP_ERR_NULL_ARG, "%s: y is NULL", op);
  if (i->num_tokens == 0) return EP_OK;
  NEED(a->topk_idx, EP_ERR_NULL_ARG, "%s: topk_idx is NULL", op);
  NEED(a->topk_weights, EP_ERR_NULL_ARG, "%s: topk_weights is NULL", op);
  NEED(a->out, EP_ERR_NULL_ARG, "%s: out is NULL", op);
  return EP_OK;
}

ep_status_t ep_ll_combine(ep_buffer_t buffer, const ep_ll_combine_args_t *args) {
  static const char op[] = "ep_ll_combine";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  ep_ll_combine_args_t a;
  memset(&a, 0, sizeof a);
  ep_handle *h = NULL;
  if (!(st = ll_enabled(b, op))) {
    if (!(st = ep_args_load(&a, sizeof a, args, op, "args")) &&
        !(st = ep_handle_get(b, a.handle, op, "args->handle", EP_HANDLE_LL, &h)))
      st = check_combine(&a, &h->info, op);
    a.two_phase = !!a.two_phase;
    if (st) {
      b->ops->ll_reject(b->state, true);
      ep_errbox_put(&b->err, ep_last_error());
    } else {
      st = ep_buffer_after(b, b->ops->ll_combine(b->state, &a, &h->info), op);
    }
  }
  if (h) ep_handle_put(h);
  ep_buffer_put(b);
  return st;
}
