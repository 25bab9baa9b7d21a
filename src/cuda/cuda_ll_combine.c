/* Low-latency combine on the GPU (SEMANTICS.md §6.5): the send kernel (check, push or nothing
 * for a zero-copy y, flags) and the receive, a launch of the same kernel (flags, fmaf reduction,
 * readers' marks), on the caller's stream (the send of a two-phase call on the hook stream, its
 * receive on the caller's stream of the send). Protocol: cuda/kernels/ll_kernels.h; host waits:
 * cuda_ll.h. */
#include <stdint.h>
#include <string.h>

#include "cuda/cuda_ll.h"
#include "cuda/cuda_net.h"

static const char OP[] = "ep_ll_combine";

static bool aligned(const void *p, uintptr_t a) {
  return ((uintptr_t)p & (a - 1)) == 0;
}

ep_status_t cuda_ll_combine_check(cuda_state_t *s, const ep_ll_combine_args_t *a,
                                  const cuda_ll_slot_t *sl) {
  if (sl->state != EP_LLS_RECEIVED)
    return ep_err(EP_ERR_INVALID_ARG, "%s: the handle cannot be combined: %s", OP,
                  ep_ll_state_why(sl->state));
  const void *p[] = {a->y, a->out, a->topk_idx, a->topk_weights};
  static const char *names[] = {"args->y", "args->out", "args->topk_idx", "args->topk_weights"};
  static const uintptr_t need[] = {16, 16, 8, 4};
  for (int i = 0; i < 4; i++)
    if ((i == 0 || sl->n) && !aligned(p[i], need[i]))
      return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                         "%s must be %d-byte "
                         "aligned on the CUDA backend",
                         names[i], (int)need[i]);
  return EP_OK;
}

/* Whether y lies in the data of a result slot (a dispatch view, a combine buffer). */
static bool in_buffer(const cuda_ll_t *ll, const void *y) {
  const uint8_t *p = y;
  for (int i = 0; i < EPK_LL_SLOTS; i++)
    if (p >= ll->slot[i].data && p < ll->slot[i].data + ll->k.lay.data_bytes) return true;
  return false;
}

static epk_ll_combine_t kernel_args(const cuda_ll_slot_t *sl, const ep_ll_combine_args_t *a,
                                    uint32_t ticket) {
  epk_ll_combine_t k;
  memset(&k, 0, sizeof k);
  k.y = a ? a->y : NULL;
  k.topk_idx = a ? a->topk_idx : NULL;
  k.topk_weights = a ? a->topk_weights : NULL;
  k.out = sl->out;
  k.n = sl->n, k.topk = sl->topk, k.slot = sl->index;
  k.zero_copy = a && a->y == sl->data + sl->ll->k.lay.d_cin; /* recognised by its address */
  k.ybuf = a ? in_buffer(sl->ll, a->y) : sl->ybuf;
  k.ticket = ticket;
  return k;
}

/* The receive: the kernel waits for the peers' flags, then reduces; a host that waits (ticket
 * != 0) learns the flags' verdict only. */
static ep_status_t receive(cuda_state_t *s, cuda_ll_slot_t *sl, cudaStream_t st, uint32_t ticket,
                           const char *op) {
  epk_ll_combine_t k = kernel_args(sl, NULL, ticket);
  return cuda_check(s, epk_ll_launch_combine_recv(&s->kb, &s->ll->k, &k, st), op, "launch");
}

ep_status_t cuda_ll_combine(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h) {
  cuda_state_t *s = state;
  if (s->net) return cuda_net_ll_combine(s, a, h); /* across hosts */
  cuda_ll_slot_t *sl = h->priv;
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  if ((rc = cuda_ll_combine_check(s, a, sl))) {
    cuda_leave(s, st, false);
    cuda_ll_reject(s, true);
    return rc;
  }
  uint32_t ticket, rticket = 0;
  const bool eager = cuda_ll_eager(s, st, &ticket);
  if (eager && !a->two_phase) cuda_ll_eager(s, st, &rticket);
  sl->out = a->out;
  epk_ll_combine_t k = kernel_args(sl, a, ticket);
  sl->ybuf = k.ybuf; /* for the receive of a two-phase call */
  const bool fused = !a->two_phase && (s->ll->k.opt & EPK_LL_OPT_FUSE);
  k.recv_too = fused, k.rticket = rticket;
  s->err_key.f[EP_CF_TOPK] = sl->topk;
  s->err_key.f[EP_CF_EXPERTS] = s->ll->k.lay.E;
  /* Both kernels (or the one that does both) are queued before the host waits: first for this
   * rank's check (its own error comes first), then for the peers' flags. */
  cudaStream_t run;
  rc = cuda_ll_send_stream(s, st, a->two_phase, OP, &run);
  if (!rc) rc = cuda_check(s, epk_ll_launch_combine(&s->kb, &s->ll->k, &k, run), OP, "launch");
  if (!rc && !a->two_phase && !fused) rc = receive(s, sl, st, rticket, OP);
  if (!rc && eager) rc = cuda_ll_wait(s, &s->host->ll_send, ticket, OP, true, "check");
  if (!rc && rticket) rc = cuda_ll_wait(s, &s->host->ll_recv, rticket, OP, true, "recv");
  cuda_leave(s, run, true);
  sl->stream = st;
  if (rc == EP_ERR_MISMATCH) return rc; /* this rank's own topk_idx: the handle stays received */
  if (rc) {
    sl->state = EP_LLS_FAILED;
    return rc;
  }
  sl->state = a->two_phase ? EP_LLS_COMB_SENT : EP_LLS_COMBINED;
  return EP_OK;
}

ep_status_t cuda_ll_recv_combine(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op) {
  if (s->net) return cuda_net_ll_recv_combine(s, sl, op);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, sl->stream, op, &st);
  if (!rc) {
    uint32_t ticket;
    const bool eager = cuda_ll_eager(s, st, &ticket);
    rc = receive(s, sl, st, ticket, op);
    if (!rc && eager) rc = cuda_ll_wait(s, &s->host->ll_recv, ticket, op, true, "recv");
    cuda_leave(s, st, true);
  }
  sl->state = rc ? EP_LLS_FAILED : EP_LLS_COMBINED;
  return rc;
}
