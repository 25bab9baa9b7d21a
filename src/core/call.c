/* The backend-neutral part of a normal-mode call: what ranks compare, how a mismatch is named,
 * where the received rows go (the output-mode policy and its errors) and what a handle keeps.
 * Backends call these so that every backend says and decides the same. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const char *const field_names[EP_CF_COUNT] = {
    "the operation",
    "hidden",
    "dtype",
    "topk",
    "num_experts",
    "num_scales",
    "topk_weights given",
    "the dispatch whose handle the call uses (its number on the buffer)"};

static const char *kind_name(int32_t k) {
  return k == EP_CALL_DISPATCH  ? "dispatch"
         : k == EP_CALL_CACHED  ? "cached dispatch"
         : k == EP_CALL_COMBINE ? "combine"
                                : "an unknown call";
}

int ep_call_key_diff(const ep_call_key_t *mine, const ep_call_key_t *theirs) {
  if (theirs->rejected) return EP_CF_REJECTED;
  for (int f = 0; f < EP_CF_COUNT; f++)
    if (mine->f[f] != theirs->f[f]) return f;
  return -1;
}

ep_status_t ep_call_keys_check(ep_ctx_t *ctx, const char *op, const ep_call_key_t *mine,
                               const int32_t *words, size_t stride, int nranks, int rank) {
  for (int r = 0; r < nranks; r++) {
    const ep_call_key_t *theirs = (const ep_call_key_t *)(words + (size_t)r * stride);
    int f = r == rank ? -1 : ep_call_key_diff(mine, theirs);
    if (f >= 0) return ep_call_key_fail(ctx, op, "counts", f, mine, theirs, r);
  }
  return EP_OK;
}

ep_status_t ep_call_key_fail(ep_ctx_t *ctx, const char *op, const char *phase, int f,
                             const ep_call_key_t *mine, const ep_call_key_t *theirs, int peer) {
  if (f == EP_CF_REJECTED)
    return ep_ctx_fail(ctx, EP_ERR_PEER_INVALID, peer, op, phase,
                       "rank %d rejected its arguments for this call (see its error)", peer);
  if (f < 0 || f >= EP_CF_COUNT)
    return ep_ctx_fail(ctx, EP_ERR_MISMATCH, peer, op, phase,
                       "the call differs between this rank and rank %d", peer);
  if (f == EP_CF_KIND && theirs)
    return ep_ctx_fail(ctx, EP_ERR_MISMATCH, peer, op, phase,
                       "this rank calls %s, rank %d calls %s", kind_name(mine->f[f]), peer,
                       kind_name(theirs->f[f]));
  if (theirs)
    return ep_ctx_fail(ctx, EP_ERR_MISMATCH, peer, op, phase,
                       "%s is %d on this rank and %d on rank %d (must agree on all ranks)",
                       field_names[f], mine->f[f], theirs->f[f], peer);
  return ep_ctx_fail(ctx, EP_ERR_MISMATCH, peer, op, phase,
                     "%s differs between this rank and rank %d (must agree on all ranks)",
                     field_names[f], peer);
}

void ep_call_combine_key(const ep_combine_args_t *a, const ep_handle_info_t *h,
                         ep_call_key_t *key) {
  memset(key, 0, sizeof *key);
  key->f[EP_CF_KIND] = EP_CALL_COMBINE;
  key->f[EP_CF_HIDDEN] = h->hidden;
  key->f[EP_CF_TOPK] = a->topk_weights ? h->topk : 0;
  key->f[EP_CF_WEIGHTS] = a->topk_weights != NULL;
  key->f[EP_CF_LAYOUT] = h->number;
}

ep_status_t ep_call_bad_expert(ep_ctx_t *ctx, const char *op, int64_t token, int k, int64_t value,
                               int num_experts) {
  if (!ctx)
    return ep_err(EP_ERR_OUT_OF_RANGE, "%s: topk_idx[%lld][%d] is %lld, must be -1 or in [0, %d)",
                  op, (long long)token, k, (long long)value, num_experts);
  return ep_ctx_fail(ctx, EP_ERR_OUT_OF_RANGE, -1, op, "layout",
                     "topk_idx[%lld][%d] is %lld, must be -1 or in [0, %d)", (long long)token, k,
                     (long long)value, num_experts);
}

/* ------------------------------------------------------------------ outputs */

int64_t ep_call_out_rows(const ep_dispatch_call_t *c, int64_t view_rows) {
  if (c->out.worst_case || c->out.mode == EP_OUTPUT_CALLER) return c->out.capacity;
  return c->views ? view_rows : -1;
}

static const char OP[] = "ep_dispatch";

ep_status_t ep_call_outputs_ready(ep_ctx_t *ctx, ep_dispatch_call_t *c, int nr, int64_t view_rows) {
  ep_dispatch_out_t *o = &c->out;
  if (o->mode == EP_OUTPUT_ALLOC) {
    if (o->alloc(o->alloc_ctx, &c->in, nr, o) != 0)
      return ep_ctx_fail(ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                         "the alloc callback failed for %d rows", nr);
    if (nr == 0 || o->recv_x) return EP_OK;
    return ep_ctx_fail(ctx, EP_ERR_NULL_ARG, -1, OP, "outputs",
                       "the alloc callback returned 0 "
                       "but left out->recv_x NULL for %d rows",
                       nr);
  }
  int64_t rows = ep_call_out_rows(c, view_rows);
  if (nr <= rows) return EP_OK;
  if (o->worst_case)
    return ep_ctx_fail(ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                       "%d rows arrive but out->capacity (worst case) is %d", nr, o->capacity);
  if (c->views)
    return ep_ctx_fail(ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                       "%d rows arrive but the receive area holds %lld (views need every row at "
                       "once): raise queue_bytes or use EP_OUTPUT_CALLER",
                       nr, (long long)rows);
  return ep_ctx_fail(ctx, EP_ERR_TOO_LARGE, -1, OP, "outputs",
                     "%d rows arrive but out->capacity is %d", nr, o->capacity);
}

ep_handle_info_t ep_call_handle_info(const ep_dispatch_call_t *c, int nr, void *priv,
                                     void (*free_priv)(void *)) {
  const ep_dispatch_args_t *a = &c->in;
  int rows = c->out.worst_case ? c->out.capacity : nr;
  return (ep_handle_info_t){.kind = EP_HANDLE_NORMAL,
                            .num_tokens = a->num_tokens,
                            .num_recv_tokens = nr,
                            .recv_rows = rows,
                            .hidden = a->hidden,
                            .topk = a->topk,
                            .num_experts = a->num_experts,
                            .dtype = a->dtype,
                            .num_scales = a->num_scales,
                            .priv = priv,
                            .free_priv = free_priv}; /* number: the core's, after the call */
}
