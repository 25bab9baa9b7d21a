/* Normal-mode dispatch on the GPU (SPEC §3). Two kernels on the caller's stream: notify (count
 * exchange, checks) and dispatch (rows straight to their final place in each destination's
 * receive area). Paths:
 *   - synchronous: the host waits for notify through mapped memory, learns the receive count,
 *     sets up outputs (caller's, allocator's, or views), then launches the data kernel;
 *   - worst case (worst_case_tokens > 0): no host wait, fixed-size outputs; capturable;
 *   - cached: the handle's plan, no count exchange (no host wait when the count is known).
 * Outputs: with recv_x == NULL (and no allocator) the outputs are views of the receive area,
 * valid until the next dispatch on this buffer; otherwise a receiver-side copy fills them. */
#include <stdint.h>
#include <string.h>

#include "cuda/cuda.h"

static const char OP[] = "ep_dispatch";

typedef struct {
  ep_dispatch_args_t *a;
  const ep_handle_info_t *cached;
  cuda_plan_t *plan;
  bool view, sync, has_w;
  int topk, num_experts, mode;
  uint64_t row;
  epk_recv_layout_t lay;
} call_t;

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Host-side checks; every failure here is followed by a reject (peers fail at once too). */
static ep_status_t check(cuda_state_t *s, const call_t *c, cudaStream_t st) {
  const ep_dispatch_args_t *a = c->a;
  if (c->lay.rows < 1)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "one row takes %llu bytes and more; the receive area (%llu bytes) holds "
                       "none: raise queue_bytes", (unsigned long long)c->row,
                       (unsigned long long)s->kb.area_bytes);
  if (!aligned16(a->x) || !aligned16(a->recv_x))
    return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                       "%s must be 16-byte aligned on the CUDA backend",
                       !aligned16(a->x) ? "x" : "recv_x");
  if (c->view && a->worst_case_tokens > c->lay.rows)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "worst_case_tokens %d exceeds the %lld rows the receive area holds (views "
                       "need every row at once): raise queue_bytes", a->worst_case_tokens,
                       (long long)c->lay.rows);
  if (c->sync && (!c->cached || c->plan->nr < 0) && cuda_capturing(st))
    return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, OP, "arguments",
                       "the synchronous path waits on the host and cannot be captured in a "
                       "graph: give worst_case_tokens");
  return EP_OK;
}

/* Outputs of the synchronous path once Nr is known: caller's, allocator's, views, or none. */
static ep_status_t prepare_outputs(cuda_state_t *s, call_t *c, int nr) {
  ep_dispatch_args_t *a = c->a;
  c->mode = c->view ? EPK_MODE_VIEW : EPK_MODE_COPY;
  if (c->view && nr > c->lay.rows) {
    c->mode = EPK_MODE_DRAIN;
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                       "%d rows arrive but the receive area holds %lld (views need every row at "
                       "once): raise queue_bytes or give recv_x", nr, (long long)c->lay.rows);
  }
  if (c->view) return EP_OK;
  if (a->alloc) {
    if (a->alloc(a->alloc_ctx, nr, a) == 0 && (nr == 0 || a->recv_x) && aligned16(a->recv_x))
      return EP_OK;
    c->mode = EPK_MODE_DRAIN;
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                       "the alloc callback failed for %d rows (or gave a misaligned recv_x)", nr);
  }
  if (nr <= a->recv_capacity) return EP_OK;
  c->mode = EPK_MODE_DRAIN;
  return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                     "%d rows arrive but recv_capacity is %d (num_recv_tokens says how many)", nr,
                     a->recv_capacity);
}

static void fill_notify(const cuda_state_t *s, const call_t *c, epk_notify_t *n) {
  const ep_dispatch_args_t *a = c->a;
  memset(n, 0, sizeof *n);
  n->kind = c->cached ? EPK_NOTIFY_CACHED : EPK_NOTIFY_DISPATCH;
  n->hidden = a->hidden;
  n->dtype = a->dtype;
  n->topk = c->cached ? 0 : a->topk;
  n->num_experts = c->cached ? 0 : a->num_experts;
  n->num_scales = a->dtype == EP_DTYPE_FP8_E4M3 ? a->num_scales : 0;
  n->has_w = c->has_w;
  n->num_tokens = a->num_tokens;
  n->topk_idx = a->topk_idx;
  n->plan = c->plan->plan;
  n->rank_prefix = a->rank_prefix;
  n->recv_per_expert = c->cached ? NULL : a->recv_tokens_per_expert;
  n->align = a->expert_alignment;
  (void)s;
}

static void fill_data(cuda_state_t *s, const call_t *c, epk_dispatch_t *k) {
  const ep_dispatch_args_t *a = c->a;
  const bool fp8 = a->dtype == EP_DTYPE_FP8_E4M3;
  memset(k, 0, sizeof *k);
  *k = (epk_dispatch_t){c->cached != NULL, a->num_tokens, fp8 ? a->num_scales : 0, c->topk,
                        c->has_w, c->num_experts / s->nranks, c->mode, a->worst_case_tokens,
                        c->row, a->x, a->x_scales, a->scale_token_stride, a->scale_hidden_stride,
                        a->topk_idx, a->topk_weights, c->plan->plan, c->plan->src,
                        c->plan->src_cap, a->recv_x, a->recv_x_scales, a->recv_topk_weights,
                        a->recv_topk_idx, a->recv_src_idx, c->lay};
  if (c->mode != EPK_MODE_VIEW) return;
  uint8_t *ad = s->pool + s->kb.off_area_d;
  k->recv_x = ad + c->lay.off_x;
  k->recv_scales = fp8 ? (float *)(ad + c->lay.off_s) : NULL;
  k->recv_idx = c->cached ? NULL : (int64_t *)(ad + c->lay.off_i);
  k->recv_w = c->cached || !c->has_w ? NULL : (float *)(ad + c->lay.off_w);
  k->recv_src = (int32_t *)(ad + c->lay.off_src);
}

/* Views go back to the caller through the args (the core copies them to the caller's struct). */
static void publish_views(const epk_dispatch_t *k, ep_dispatch_args_t *a) {
  a->recv_x = k->recv_x;
  a->recv_x_scales = k->recv_scales;
  a->recv_topk_idx = k->recv_idx;
  a->recv_topk_weights = k->recv_w;
  a->recv_src_idx = k->recv_src;
}

/* The count exchange, and for the synchronous path the wait for its result. */
static ep_status_t exchange(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr) {
  epk_notify_t n;
  fill_notify(s, c, &n);
  bool wait = c->sync && (!c->cached || c->plan->nr < 0);
  if (wait) n.ticket = ++s->ticket ? s->ticket : ++s->ticket;
  s->err_topk = c->topk;
  ep_status_t rc = cuda_check(s, epk_launch_notify(&s->kb, &n, st), OP, "launch");
  *nr = c->plan->nr;
  if (rc || !wait) return rc;
  if ((rc = cuda_wait_ticket(s, n.ticket, OP))) return rc;
  if ((rc = cuda_take_error(s, OP))) return rc;
  *nr = c->plan->nr = __atomic_load_n(&s->host->nr, __ATOMIC_ACQUIRE);
  return EP_OK;
}

static ep_status_t run(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr_out) {
  ep_dispatch_args_t *a = c->a;
  int nr = -1;
  ep_status_t rc = exchange(s, c, st, &nr), out_rc = EP_OK;
  if (rc) return rc;
  c->mode = c->view ? EPK_MODE_VIEW : EPK_MODE_COPY;
  if (c->sync) out_rc = prepare_outputs(s, c, nr);
  if (!c->plan->src && !cuda_plan_src(c->plan, c->sync ? nr : a->worst_case_tokens) && !out_rc) {
    c->mode = EPK_MODE_DRAIN;
    out_rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                         "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
  }
  epk_dispatch_t k;
  fill_data(s, c, &k);
  rc = cuda_check(s, epk_launch_dispatch(&s->kb, &k, st), OP, "launch");
  if (rc) return rc;
  if (out_rc) return out_rc; /* rows drained, counters consistent, outputs untouched */
  if (c->view) publish_views(&k, a);
  *nr_out = c->sync ? nr : -1;
  return EP_OK;
}

ep_status_t cuda_dispatch(void *state, ep_dispatch_args_t *a, const ep_handle_info_t *cached,
                          ep_handle_info_t *out) {
  cuda_state_t *s = state;
  call_t c = {a, cached, cached ? cached->priv : NULL, !a->recv_x && !a->alloc,
              !a->worst_case_tokens, !cached && a->topk_weights, 0, 0, 0, 0, {0}};
  c.topk = cached ? cached->topk : a->topk;
  c.num_experts = cached ? cached->num_experts : a->num_experts;
  c.row = (uint64_t)a->hidden * ep_dtype_size(a->dtype);
  c.lay = epk_recv_layout(s->kb.area_bytes, c.row, a->dtype == EP_DTYPE_FP8_E4M3 ? a->num_scales : 0,
                          cached ? 0 : a->topk, c.has_w);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  if (!(rc = check(s, &c, st)) && !cached && !(c.plan = cuda_plan_new(s, a->num_tokens)))
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "arguments",
                     "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
  if (rc) {
    cuda_leave(s, st, false);
    cuda_reject(s);
    return rc;
  }
  int nr = -1;
  rc = run(s, &c, st, &nr);
  cuda_leave(s, st, true);
  if (rc || cached) {
    if (!cached) cuda_plan_free(c.plan);
    if (!rc) *a->num_recv_tokens = nr >= 0 ? nr : c.plan->nr;
    return rc;
  }
  *a->num_recv_tokens = nr;
  *out = (ep_handle_info_t){EP_HANDLE_NORMAL, a->num_tokens, nr,
                            a->worst_case_tokens ? a->worst_case_tokens : nr, a->hidden, a->topk,
                            a->num_experts, a->dtype, a->num_scales, c.plan, cuda_plan_free};
  return EP_OK;
}
