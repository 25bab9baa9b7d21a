/* Layout on the GPU: one small kernel on the caller's stream. Out-of-range ids are found before
 * anything is written; the call waits for the kernel so that it can return EP_ERR_OUT_OF_RANGE
 * naming the slot, except with no_wait or during a graph capture (outputs left untouched, the
 * dispatch reports the id). Such a kernel does not touch the host words: it may run after a
 * later waiting call has reset them. */
#include "cuda/cuda.h"
#include "cuda/cuda_net.h"

static const char OP[] = "ep_get_dispatch_layout";

ep_status_t cuda_layout(void *state, const ep_layout_args_t *a) {
  cuda_state_t *s = state;
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  /* Across hosts the kernel reads every rank's host from the network state's table. */
  epk_layout_t k = {
      a->topk_idx,          a->num_tokens,          a->topk,
      a->num_experts,       s->net ? s->net->H : 1, a->tokens_per_rank,
      a->tokens_per_expert, a->is_token_in_rank,    s->net ? s->net->host_of_dev : NULL,
      a->tokens_per_host,   a->is_token_in_host,    !a->no_wait && !cuda_capturing(st)};
  __atomic_store_n(&s->host->layout_bad, 0, __ATOMIC_RELEASE);
  rc = cuda_check(s, epk_launch_layout(&s->kb, &k, st), OP, "launch");
  if (!rc && k.report) rc = cuda_check(s, cudaStreamSynchronize(st), OP, "layout");
  int32_t bad = k.report ? __atomic_load_n(&s->host->layout_bad, __ATOMIC_ACQUIRE) : 0;
  if (!rc && bad) {
    long long slot = bad - 1;
    rc = ep_call_bad_expert(s->ctx, OP, slot / a->topk, (int)(slot % a->topk), s->host->bad_value,
                            a->num_experts);
  }
  cuda_leave(s, st, true);
  return rc;
}
