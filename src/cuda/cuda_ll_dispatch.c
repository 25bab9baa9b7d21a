/* Low-latency dispatch on the GPU (SEMANTICS.md §6.2-6.4): the send kernel, whose block 0 is the
 * count exchange (the gate), and the receive (a launch of the same kernel), both on the caller's
 * stream (the send of a two-phase call on the hook stream, its receive on the caller's stream of
 * the send). Protocol: cuda/kernels/ll_kernels.h; host waits: cuda_ll.h. */
#include <stdint.h>
#include <string.h>

#include "cuda/cuda_ll.h"
#include "cuda/cuda_net.h"

static const char OP[] = "ep_ll_dispatch";

static bool aligned(const void *p, uintptr_t a) {
  return ((uintptr_t)p & (a - 1)) == 0;
}

/* The free slot given back longest ago (the core allows a dispatch only while one is free). */
cuda_ll_slot_t *cuda_ll_take_slot(cuda_ll_t *ll) {
  cuda_ll_slot_t *best = NULL;
  for (int i = 0; i < EPK_LL_SLOTS; i++)
    if (ll->slot[i].state == EP_LLS_FREE && (!best || ll->slot[i].stamp < best->stamp))
      best = &ll->slot[i];
  return best;
}

static int format_of(const ep_ll_dispatch_args_t *a) {
  return (a->use_fp8 ? EPK_LL_FP8 : 0) | (a->round_scale ? EPK_LL_ROUND : 0) |
         (a->use_ue8m0 ? EPK_LL_UE8M0 : 0) |
         (a->use_fp8 && a->scale_layout == EP_SCALES_COL_MAJOR ? EPK_LL_COLS : 0);
}

ep_status_t cuda_ll_dispatch_aligned(cuda_state_t *s, const ep_ll_dispatch_args_t *a) {
  if (a->num_tokens && !aligned(a->x, 16))
    return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                       "args->x must be 16-byte aligned on the CUDA backend");
  if (a->num_tokens && !aligned(a->topk_idx, 8))
    return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                       "args->topk_idx must be 8-byte aligned");
  return EP_OK;
}

/* Host-side checks; a failure here is followed by a rejection (the peers fail at once too). The
 * ids themselves are device memory: the gate checks them, before anything is written. */
static ep_status_t check(cuda_state_t *s, const ep_ll_dispatch_args_t *a, cuda_ll_slot_t *sl) {
  if (!sl) return ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, -1, OP, "arguments", "no free result slot");
  return cuda_ll_dispatch_aligned(s, a);
}

void cuda_ll_fill_info(const cuda_ll_t *ll, const ep_ll_dispatch_args_t *a, cuda_ll_slot_t *sl,
                       int nrecv, ep_handle_info_t *out) {
  memset(out, 0, sizeof *out);
  out->kind = EP_HANDLE_LL;
  out->num_tokens = a->num_tokens;
  out->num_recv_tokens = nrecv;
  out->recv_rows = ll->k.lay.L * ll->k.lay.RT;
  out->hidden = ll->k.lay.H;
  out->topk = a->topk;
  out->num_experts = ll->k.lay.E;
  out->dtype = a->use_fp8 ? EP_DTYPE_FP8_E4M3 : EP_DTYPE_BF16;
  out->num_scales = a->use_fp8 ? ll->k.lay.NS : 0;
  out->priv = sl; /* the slot lives in the buffer's state: nothing to free with the handle */
}

ep_status_t cuda_ll_dispatch(void *state, const ep_ll_dispatch_args_t *a, ep_handle_info_t *out) {
  cuda_state_t *s = state;
  if (s->net) return cuda_net_ll_dispatch(s, a, out); /* across hosts */
  cuda_ll_t *ll = s->ll;
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  cuda_ll_slot_t *sl = cuda_ll_take_slot(ll);
  if ((rc = check(s, a, sl))) {
    cuda_leave(s, st, false);
    cuda_ll_reject(s, false);
    return rc;
  }
  uint32_t ticket;
  const bool eager = cuda_ll_eager(s, st, &ticket);
  epk_ll_dispatch_t k = {.x = a->x,
                         .topk_idx = a->topk_idx,
                         .n = a->num_tokens,
                         .topk = a->topk,
                         .fmt = format_of(a),
                         .slot = sl->index,
                         .recv_too = !a->two_phase,
                         .ticket = ticket};
  s->err_key.f[EP_CF_TOPK] = a->topk; /* names a bad entry, here or in a deferred report */
  s->err_key.f[EP_CF_EXPERTS] = ll->k.lay.E;
  cudaStream_t run;
  rc = cuda_ll_send_stream(s, st, a->two_phase, OP, &run);
  if (!rc) rc = cuda_check(s, epk_ll_launch_dispatch(&s->kb, &ll->k, &k, run), OP, "launch");
  if (!rc && eager) rc = cuda_ll_wait(s, &s->host->ll_send, ticket, OP, false, "gate");
  cuda_leave(s, run, true);
  if (rc) return rc; /* the slot stays free; every rank failed alike at the gate */
  sl->state = a->two_phase ? EP_LLS_SENT : EP_LLS_RECEIVED;
  sl->stream = st;
  sl->n = a->num_tokens, sl->topk = a->topk, sl->fmt = k.fmt;
  cuda_ll_fill_info(ll, a, sl,
                    eager ? __atomic_load_n(&s->host->ll_send.nrecv, __ATOMIC_ACQUIRE) : -1, out);
  return EP_OK;
}

/* Nothing to wait for on the host: the kernel waits for the rows (and, when the slot's last
 * combine was zero copy, for its readers); a failure there is returned by the next call. */
ep_status_t cuda_ll_recv_dispatch(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op) {
  if (s->net) return cuda_net_ll_recv_dispatch(s, sl, op);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, sl->stream, op, &st);
  if (!rc) {
    rc = cuda_check(s, epk_ll_launch_dispatch_recv(&s->kb, &s->ll->k, sl->index, st), op, "launch");
    cuda_leave(s, st, true);
  }
  sl->state = rc ? EP_LLS_FAILED : EP_LLS_RECEIVED;
  return rc;
}
