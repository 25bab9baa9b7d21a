/* Normal-mode dispatch on the GPU (SEMANTICS.md §3). Two kernels on the caller's stream: notify
 * (count exchange, checks) and dispatch (rows straight to their final place in each destination's
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

/* Rows the outputs hold, known before the count: worst case, caller's capacity, or (views) the
 * receive area. The allocator path has no such bound: it learns Nr first. */
static int64_t capacity(const call_t *c) {
  const ep_dispatch_args_t *a = c->a;
  if (a->worst_case_tokens) return a->worst_case_tokens;
  return c->view ? c->lay.rows : a->recv_capacity;
}

static ep_status_t too_large(cuda_state_t *s, const call_t *c, int nr) {
  if (c->view)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                       "%d rows arrive but the receive area holds %lld (views need every row at "
                       "once): raise queue_bytes or give recv_x", nr, (long long)c->lay.rows);
  return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                     "%d rows arrive but recv_capacity is %d (num_recv_tokens says how many)", nr,
                     c->a->recv_capacity);
}

/* Allocator path, once Nr is known. */
static ep_status_t allocate(cuda_state_t *s, call_t *c, int nr) {
  ep_dispatch_args_t *a = c->a;
  if (a->alloc(a->alloc_ctx, nr, a) == 0 && (nr == 0 || a->recv_x) && aligned16(a->recv_x))
    return EP_OK;
  c->mode = EPK_MODE_DRAIN;
  return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                     "the alloc callback failed for %d rows (or gave a misaligned recv_x)", nr);
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

static void fill_data(cuda_state_t *s, const call_t *c, int64_t cap, epk_dispatch_t *k) {
  const ep_dispatch_args_t *a = c->a;
  const bool fp8 = a->dtype == EP_DTYPE_FP8_E4M3;
  *k = (epk_dispatch_t){c->cached != NULL, a->num_tokens, fp8 ? a->num_scales : 0, c->topk,
                        c->has_w, c->num_experts / s->nranks, c->mode,
                        a->worst_case_tokens > 0, c->sync, 0, cap, c->row, a->x, a->x_scales,
                        a->scale_token_stride, a->scale_hidden_stride, a->topk_idx,
                        a->topk_weights, c->plan->plan, c->plan->src, c->plan->src_cap,
                        a->recv_x, a->recv_x_scales, a->recv_topk_weights, a->recv_topk_idx,
                        a->recv_src_idx, c->lay};
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

static ep_status_t launch_notify(cuda_state_t *s, const call_t *c, cudaStream_t st, bool ticket,
                                 uint32_t *t) {
  epk_notify_t n;
  fill_notify(s, c, &n);
  if (ticket) n.ticket = *t = ++s->ticket ? s->ticket : ++s->ticket;
  s->err_topk = c->topk;
  return cuda_check(s, epk_launch_notify(&s->kb, &n, st), OP, "launch");
}

/* The receive count of a synchronous call, once notify has published it. */
static ep_status_t wait_count(cuda_state_t *s, call_t *c, uint32_t ticket, int *nr) {
  ep_status_t rc = cuda_wait_ticket(s, ticket, OP);
  if (!rc) rc = cuda_take_error(s, OP);
  if (!rc) *nr = c->plan->nr = __atomic_load_n(&s->host->nr, __ATOMIC_ACQUIRE);
  return rc;
}

static ep_status_t launch_data(cuda_state_t *s, call_t *c, cudaStream_t st, int64_t cap) {
  if (!c->plan->src && !cuda_plan_src(c->plan, cap)) {
    c->mode = EPK_MODE_DRAIN; /* peers still get our part of the exchange */
    cap = 0;
  }
  epk_dispatch_t k;
  fill_data(s, c, cap, &k);
  ep_status_t rc = cuda_check(s, epk_launch_dispatch(&s->kb, &k, st), OP, "launch");
  if (!rc && c->view && c->mode == EPK_MODE_VIEW) publish_views(&k, c->a);
  if (!rc && c->mode == EPK_MODE_DRAIN && !c->plan->src)
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                     "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
  return rc;
}

/* Allocator path: the host needs Nr before any output exists, so it waits in between. */
static ep_status_t run_alloc(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr) {
  uint32_t t = 0;
  bool wait = c->plan->nr < 0;
  ep_status_t rc = launch_notify(s, c, st, wait, &t);
  *nr = c->plan->nr;
  if (!rc && wait) rc = wait_count(s, c, t, nr);
  if (rc) return rc;
  ep_status_t out_rc = allocate(s, c, *nr);
  rc = launch_data(s, c, st, *nr);
  return rc ? rc : out_rc;
}

/* Every other path launches both kernels back to back (the GPU never waits for the host); a
 * synchronous call then waits for the count, which it returns. Rows beyond the outputs' capacity
 * are drained by the kernel and reported here. */
static ep_status_t run(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr) {
  if (c->sync && c->a->alloc) return run_alloc(s, c, st, nr);
  const int64_t cap = capacity(c);
  uint32_t t = 0;
  bool wait = c->sync && c->plan->nr < 0;
  c->mode = c->view ? EPK_MODE_VIEW : EPK_MODE_COPY;
  if (c->sync && c->plan->nr > cap) c->mode = EPK_MODE_DRAIN; /* cached, count known */
  ep_status_t rc = launch_notify(s, c, st, wait, &t);
  if (!rc) rc = launch_data(s, c, st, cap);
  *nr = c->sync ? c->plan->nr : -1;
  if (!rc && wait) rc = wait_count(s, c, t, nr);
  if (!rc && c->sync && *nr > cap) rc = too_large(s, c, *nr);
  return rc;
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
