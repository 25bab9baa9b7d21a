/* Low-latency mode across hosts on the CUDA backend (SEMANTICS.md §6; cuda_net.h, cuda_ll.h).
 *
 * Every row goes straight to the rank of its expert through NCCL (grouped ncclSend/ncclRecv of
 * device memory on the caller's stream; between ranks of one host NCCL takes its own intranode
 * path), one record per (token, selected expert). The results land in the same result slots as
 * on one host, so views, combine buffers and handle states are the one-host ones.
 *   dispatch send  the ids come to the host (a wait for this rank's stream only) and are checked;
 *                  the gate: every rank's record (status, topk, format, tokens, selections per
 *                  expert) reaches every rank over the MPI endpoint, which is where a rejection
 *                  or a disagreement fails every rank alike; then this rank knows where each of
 *                  its rows lands on its destination, packs the records (with the fp8 cast) and
 *                  posts the transfers on the stream, and returns: the rows move while the
 *                  caller works;
 *   dispatch recv  waits (deadline, liveness) for the transfers, scatters the records into the
 *                  slot's receive layout;
 *   combine send   topk_idx comes to the host and is checked against the dispatch's; every rank
 *                  agrees (a rejection, handles of different dispatches), then each expert rank
 *                  gathers the rows every source gets back, in view order, and posts them;
 *   combine recv   waits for them, then one kernel reduces per token in k order with fmaf.
 * Sizes of every transfer follow from the gate's records, so both ends post matching sizes
 * without another exchange. Calls wait on the host, so none can be captured in a CUDA graph.
 * Unlike one host, a combine's send waits for every rank to enter the combine (the agreement
 * that replaces the one-host rejection flags: NCCL cannot take back a posted transfer). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_ll.h"
#include "cuda/cuda_net.h"

enum { GATE_HDR = 4 }; /* status, topk, fmt, num_tokens; then sel[E] */

/* The network side of one result slot. */
typedef struct {
  cuda_dstage_t items, send, recv, rows, map, w, csend, crecv; /* device */
  int32_t *pin;                                                /* page-locked uploads */
  size_t pin_cap;
  int64_t *ids; /* the dispatch's ids (host), for the combine's check and order */
  size_t ids_cap;
  int64_t *range;     /* [L][R] this rank's receive layout (host) */
  int32_t *to, *from; /* [R] rows to / from each rank of the last call on the slot */
  int32_t seq;        /* number of the slot's dispatch (every rank's combine must match) */
  int nrec;           /* records (dispatch) or rows (combine) received */
  uint64_t rec;
  ep_net_xfer_t *x; /* [2R] */
  int nx;
  bool pending; /* posted, not yet waited for */
} nll_slot_t;

struct cuda_net_ll {
  nll_slot_t slot[EPK_LL_SLOTS];
  int32_t *recs; /* [R][GATE_HDR + E]: every rank's gate record of the current dispatch */
  int32_t *mine;
  int64_t *cidx;  /* page-locked [T][K]: a combine's topk_idx */
  int32_t *agree; /* [R][2]: every rank's combine agreement (status, dispatch number) */
  int32_t seq;    /* dispatches past the gate (the same on every rank) */
};

static nll_slot_t *nslot(cuda_state_t *s, const cuda_ll_slot_t *sl) {
  return &s->net->ll->slot[sl->index];
}

/* Waits for the slot's transfers in flight (deadline, liveness); a failure breaks the buffer. */
static ep_status_t settle(cuda_state_t *s, nll_slot_t *ns, const char *op, const char *phase) {
  ep_status_t rc = ns->pending ? cuda_net_complete(s, ns->x, ns->nx, op, phase) : EP_OK;
  ns->pending = false;
  return rc;
}

ep_status_t cuda_net_ll_create(cuda_state_t *s) {
  const epk_ll_layout_t *l = &s->ll->k.lay;
  int R = s->nranks;
  struct cuda_net_ll *n = calloc(1, sizeof *n);
  if (!n) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  s->net->ll = n;
  size_t gw = GATE_HDR + (size_t)l->E;
  n->recs = calloc(((size_t)R + 1) * gw, sizeof *n->recs);
  bool ok = n->recs != NULL;
  if (ok) n->mine = n->recs + (size_t)R * gw;
  ok = ok && (n->agree = calloc(2 * (size_t)R, sizeof *n->agree));
  for (int i = 0; i < EPK_LL_SLOTS; i++) {
    nll_slot_t *ns = &n->slot[i];
    ns->range = calloc((size_t)l->L * (size_t)R, sizeof *ns->range);
    ns->to = calloc(2 * (size_t)R, sizeof *ns->to);
    ns->x = calloc(2 * (size_t)R, sizeof *ns->x);
    ok = ok && ns->range && ns->to && ns->x;
    if (ns->to) ns->from = ns->to + R;
  }
  ok =
      ok && cudaHostAlloc((void **)&n->cidx, 8 * (size_t)l->T * (size_t)l->K + 8, 0) == cudaSuccess;
  return ok ? EP_OK : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
}

static void dfree(cuda_dstage_t *d) {
  if (d->p) cudaFree(d->p);
  d->p = NULL, d->cap = 0;
}

bool cuda_net_ll_settle_all(cuda_state_t *s, bool calm) {
  struct cuda_net_ll *n = s->net ? s->net->ll : NULL;
  for (int i = 0; n && i < EPK_LL_SLOTS; i++) {
    nll_slot_t *ns = &n->slot[i];
    if (calm)
      calm = !settle(s, ns, "ep_buffer_destroy", "settle");
    else if (ns->pending)
      s->net->e->cancel(s->net->ep, ns->x, ns->nx);
    ns->pending = false;
  }
  return calm;
}

void cuda_net_ll_destroy(cuda_state_t *s) {
  struct cuda_net_ll *n = s->net ? s->net->ll : NULL;
  if (!n) return;
  for (int i = 0; i < EPK_LL_SLOTS; i++) {
    nll_slot_t *ns = &n->slot[i];
    cuda_dstage_t *d[] = {&ns->items, &ns->send, &ns->recv,  &ns->rows,
                          &ns->map,   &ns->w,    &ns->csend, &ns->crecv};
    for (size_t k = 0; k < sizeof d / sizeof d[0]; k++) dfree(d[k]);
    if (ns->pin) cudaFreeHost(ns->pin);
    free(ns->ids), free(ns->range), free(ns->to), free(ns->x);
  }
  if (n->cidx) cudaFreeHost(n->cidx);
  free(n->recs), free(n->agree);
  free(n);
  s->net->ll = NULL;
}

/* Page-locked upload space of a slot (its earlier uploads are done: every call waits for its
 * stream before it plans). */
static int32_t *pinned(cuda_state_t *s, nll_slot_t *ns, size_t bytes, const char *op) {
  if (bytes <= ns->pin_cap) return ns->pin;
  if (ns->pin) cudaFreeHost(ns->pin);
  ns->pin = NULL, ns->pin_cap = 0;
  if (cuda_check(s, cudaHostAlloc((void **)&ns->pin, bytes + bytes / 4 + 4096, 0), op, "plan"))
    return NULL;
  ns->pin_cap = bytes + bytes / 4 + 4096;
  return ns->pin;
}

static const char CAPTURE[] =
    "a low-latency call across hosts waits on the host (gate, network) and cannot be captured in "
    "a CUDA graph";

/* A receive while the stream is captured: refused, the handle as it was (receive it later). */
static ep_status_t refuse_capture(cuda_state_t *s, cudaStream_t st, const char *op) {
  cuda_leave(s, st, false);
  return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, op, "arguments", "%s", CAPTURE);
}

/* A call's topk_idx (device memory) into the page-locked cidx ([T][K] holds any call's), with a
 * wait for this rank's stream only. */
static ep_status_t ids_to_host(cuda_state_t *s, const int64_t *ids, size_t cnt, cudaStream_t st,
                               const char *op) {
  ep_status_t rc =
      cnt ? cuda_check(s, cudaMemcpyAsync(s->net->ll->cidx, ids, cnt * 8, cudaMemcpyDefault, st),
                       op, "ids")
          : EP_OK;
  return rc ? rc : cuda_net_sync(s, st, op, "ids");
}

/* Host checks and the ids, before the gate: a failure here rejects the call. */
static ep_status_t dispatch_prepare(cuda_state_t *s, const ep_ll_dispatch_args_t *a, nll_slot_t *ns,
                                    cudaStream_t st, const char *op) {
  const int E = s->ll->k.lay.E;
  if (cuda_capturing(st))
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, op, "arguments", "%s", CAPTURE);
  ep_status_t rc = cuda_ll_dispatch_aligned(s, a);
  if (rc) return rc;
  size_t cnt = (size_t)a->num_tokens * (size_t)a->topk;
  if (cnt > ns->ids_cap) {
    free(ns->ids);
    ns->ids_cap = 0;
    if (!(ns->ids = malloc(cnt * 8)))
      return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, op, "ids", "out of memory");
    ns->ids_cap = cnt;
  }
  if ((rc = ids_to_host(s, a->topk_idx, cnt, st, op))) return rc;
  memcpy(ns->ids, s->net->ll->cidx, cnt * 8);
  for (int t = 0; t < a->num_tokens; t++)
    for (int k = 0; k < a->topk; k++) {
      const int64_t e = ns->ids[(size_t)t * a->topk + k];
      if (e < -1 || e >= E) return ep_call_bad_expert(s->ctx, op, t, k, e, E);
      for (int j = 0; e >= 0 && j < k; j++)
        if (ns->ids[(size_t)t * a->topk + j] == e)
          return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, op, "arguments",
                             "topk_idx[%d] selects expert %lld twice (slots %d and %d); each "
                             "expert at most once per token",
                             t, (long long)e, j, k);
    }
  return EP_OK;
}

static const int32_t *record(const cuda_state_t *s, int r) {
  return s->net->ll->recs + (size_t)r * (GATE_HDR + (size_t)s->ll->k.lay.E);
}

/* Every row position and size below derives from the records: one that no valid call makes
 * (a peer out of step, a corrupt message) is refused before any is used, on every rank alike. */
static bool record_sane(const cuda_state_t *s, const int32_t *q) {
  const epk_ll_layout_t *l = &s->ll->k.lay;
  if (q[3] < 0 || q[3] > l->T || q[1] < 1 || q[1] > l->K) return false;
  int64_t sum = 0;
  for (int e = 0; e < l->E; e++) {
    if (q[GATE_HDR + e] < 0 || q[GATE_HDR + e] > q[3]) return false;
    sum += q[GATE_HDR + e];
  }
  return sum <= (int64_t)q[3] * q[1];
}

/* The gate: every rank's record; the verdict every rank reaches alike. `mine` failed: this
 * rank's own error stays the call's. */
static ep_status_t gate(cuda_state_t *s, ep_status_t mine, const char *op) {
  struct cuda_net_ll *n = s->net->ll;
  const size_t gw = GATE_HDR + (size_t)s->ll->k.lay.E;
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  if (mine) n->mine[0] = 1;
  ep_status_t st =
      cuda_net_allgather(s, CUDA_NET_TAG_LL_GATE, n->mine, n->recs, gw * 4, op, "gate");
  if (st || mine) {
    if (mine) ep_ctx_restore_error(saved);
    return mine ? mine : st;
  }
  const int32_t *r0 = record(s, 0);
  for (int r = 0; r < s->nranks; r++) {
    const int32_t *q = record(s, r);
    if (q[0])
      return ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, op, "gate",
                         "rank %d rejected its arguments for this call (see its error)", r);
  }
  for (int r = 0; r < s->nranks; r++)
    if (!record_sane(s, record(s, r)))
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "gate",
                         "rank %d's gate record is impossible (tokens, topk or selections out of "
                         "range): the ranks are out of step",
                         r);
  for (int r = 1; r < s->nranks; r++) {
    const int32_t *q = record(s, r);
    if (q[1] != r0[1])
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "gate",
                         "topk is %d on rank 0 and %d on rank %d (must agree on all ranks)", r0[1],
                         q[1], r);
    if (q[2] != r0[2])
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "gate",
                         "use_fp8/round_scale/use_ue8m0/scale_layout are %d/%d/%d/%d on rank 0 "
                         "and %d/%d/%d/%d on rank %d (must agree on all ranks)",
                         r0[2] & 1, (r0[2] >> 1) & 1, (r0[2] >> 2) & 1, (r0[2] >> 3) & 1, q[2] & 1,
                         (q[2] >> 1) & 1, (q[2] >> 2) & 1, (q[2] >> 3) & 1, r);
  }
  return EP_OK;
}

/* This rank's gate record: status 0, shape, selections per expert. */
static void fill_record(cuda_state_t *s, const ep_ll_dispatch_args_t *a, const nll_slot_t *ns,
                        int fmt) {
  int32_t *m = s->net->ll->mine;
  const int E = s->ll->k.lay.E;
  memset(m, 0, (GATE_HDR + (size_t)E) * 4);
  m[1] = a->topk, m[2] = fmt, m[3] = a->num_tokens;
  for (size_t i = 0; i < (size_t)a->num_tokens * (size_t)a->topk; i++)
    if (ns->ids[i] >= 0) m[GATE_HDR + ns->ids[i]]++;
}

/* Where every row goes (items, in destination order) and this rank's receive layout, from the
 * gate's records; uploads them. SEMANTICS.md §6.3: expert l's rows by source ascending, then by
 * the source's token order. */
static ep_status_t dispatch_plan(cuda_state_t *s, const ep_ll_dispatch_args_t *a, nll_slot_t *ns,
                                 cuda_ll_slot_t *sl, cudaStream_t st, const char *op, int *nsend) {
  const epk_ll_layout_t *l = &s->ll->k.lay;
  const int R = s->nranks, L = l->L, E = l->E, me = s->rank;
  const size_t nitems = (size_t)a->num_tokens * (size_t)a->topk;
  const size_t b_items = epk_al(16 * nitems, 16), b_cnt = epk_al(4 * (size_t)L, 16);
  int32_t *pin = pinned(s, ns, b_items + b_cnt + 8 * (size_t)L * R + 16, op);
  int64_t *base = calloc((size_t)E + (size_t)R + 1, 8); /* [E] my first row at e's rank; off */
  if (!pin || !base) {
    free(base);
    return pin ? ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, op, "plan", "out of memory")
               : EP_ERR_NO_MEMORY;
  }
  for (int e = 0; e < E; e++)
    for (int r = 0; r < me; r++) base[e] += record(s, r)[GATE_HDR + e];
  int64_t *off = base + E;
  int n = 0;
  for (int d = 0; d < R; d++) {
    ns->to[d] = 0;
    for (int e = d * L; e < (d + 1) * L; e++) ns->to[d] += record(s, me)[GATE_HDR + e];
    off[d] = n, n += ns->to[d];
  }
  int4 *items = (int4 *)pin;
  for (int t = 0; t < a->num_tokens; t++)
    for (int k = 0; k < a->topk; k++) {
      const int64_t e = ns->ids[(size_t)t * a->topk + k];
      if (e < 0) continue;
      const int d = (int)(e / L), le = (int)(e % L);
      items[off[d]++] = (int4){t, le * l->RT + (int)base[e]++, k, 0};
    }
  free(base);
  int32_t *count = (int32_t *)((uint8_t *)pin + b_items);
  int64_t *range = (int64_t *)((uint8_t *)count + b_cnt);
  ns->nrec = 0;
  for (int r = 0; r < R; r++) ns->from[r] = 0;
  for (int le = 0; le < L; le++) {
    int64_t begin = 0;
    for (int r = 0; r < R; r++) {
      const int32_t c = record(s, r)[GATE_HDR + me * L + le];
      range[(size_t)le * R + r] = ns->range[(size_t)le * R + r] = (begin << 32) | (uint32_t)c;
      begin += c, ns->from[r] += c;
    }
    count[le] = (int32_t)begin, ns->nrec += (int)begin;
  }
  *nsend = n;
  void *d_items = cuda_dstage(s, &ns->items, b_items + 16, op);
  if (!d_items) return EP_ERR_NO_MEMORY;
  ep_status_t rc =
      cuda_check(s, cudaMemcpyAsync(d_items, pin, b_items, cudaMemcpyHostToDevice, st), op, "plan");
  if (!rc)
    rc = cuda_check(
        s, cudaMemcpyAsync(sl->ctrl + l->c_count, count, 4 * (size_t)L, cudaMemcpyHostToDevice, st),
        op, "plan");
  if (!rc)
    rc = cuda_check(s,
                    cudaMemcpyAsync(sl->ctrl + l->c_range, range, 8 * (size_t)L * R,
                                    cudaMemcpyHostToDevice, st),
                    op, "plan");
  return rc;
}

/* The transfers of one call: receives of from[r] units and sends of to[r] units of `unit`
 * bytes, in rank order (both ends derive the same sizes from the gate). */
static ep_status_t post(cuda_state_t *s, nll_slot_t *ns, uint8_t *sbuf, uint8_t *rbuf,
                        uint64_t unit, cudaStream_t st, const char *op) {
  ns->nx = 0;
  for (int r = 0; r < s->nranks; r++) {
    if (ns->from[r])
      ns->x[ns->nx++] = (ep_net_xfer_t){r, 0, 0, rbuf, unit * (uint64_t)ns->from[r], 0, 0, 0};
    rbuf += unit * (uint64_t)ns->from[r];
  }
  for (int r = 0; r < s->nranks; r++) {
    if (ns->to[r])
      ns->x[ns->nx++] = (ep_net_xfer_t){r, 1, 0, sbuf, unit * (uint64_t)ns->to[r], 0, 0, 0};
    sbuf += unit * (uint64_t)ns->to[r];
  }
  ep_status_t rc = cuda_net_post(s, ns->x, ns->nx, st, op, "send");
  ns->pending = !rc && ns->nx > 0;
  return rc;
}

static int format_of(const ep_ll_dispatch_args_t *a) {
  return (a->use_fp8 ? EPK_LL_FP8 : 0) | (a->round_scale ? EPK_LL_ROUND : 0) |
         (a->use_ue8m0 ? EPK_LL_UE8M0 : 0) |
         (a->use_fp8 && a->scale_layout == EP_SCALES_COL_MAJOR ? EPK_LL_COLS : 0);
}

/* After the gate: plan, pack, post. */
static ep_status_t dispatch_send(cuda_state_t *s, const ep_ll_dispatch_args_t *a,
                                 cuda_ll_slot_t *sl, int fmt, cudaStream_t st, const char *op) {
  nll_slot_t *ns = nslot(s, sl);
  const epk_ll_layout_t *l = &s->ll->k.lay;
  int nsend = 0;
  ep_status_t rc = dispatch_plan(s, a, ns, sl, st, op, &nsend);
  if (rc) return rc;
  ns->rec = epk_nll_rec(l->H, l->NS, fmt & EPK_LL_FP8);
  uint8_t *sbuf = cuda_dstage(s, &ns->send, ns->rec * (uint64_t)nsend + 16, op);
  uint8_t *rbuf = sbuf ? cuda_dstage(s, &ns->recv, ns->rec * (uint64_t)ns->nrec + 16, op) : NULL;
  if (!rbuf) return EP_ERR_NO_MEMORY;
  epk_nll_pack_t k = {a->x, (const int4 *)ns->items.p, sbuf, nsend, l->H, l->NS, fmt};
  rc = cuda_check(s, epk_nll_launch_pack(&k, s->ll->k.blocks, st), op, "launch");
  return rc ? rc : post(s, ns, sbuf, rbuf, ns->rec, st, op);
}

ep_status_t cuda_net_ll_dispatch(cuda_state_t *s, const ep_ll_dispatch_args_t *a,
                                 ep_handle_info_t *out) {
  static const char OP[] = "ep_ll_dispatch";
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  cuda_ll_slot_t *sl = cuda_ll_take_slot(s->ll);
  const int fmt = format_of(a);
  if (!rc && !sl) rc = ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, -1, OP, "arguments", "no free slot");
  if (!rc) rc = dispatch_prepare(s, a, nslot(s, sl), st, OP);
  if (!rc) fill_record(s, a, nslot(s, sl), fmt);
  rc = gate(s, rc, OP);
  if (!rc) {
    s->net->ll->seq++;
    nslot(s, sl)->seq = s->net->ll->seq;
    rc = dispatch_send(s, a, sl, fmt, st, OP);
    if (rc) ep_ctx_mark_broken(s->ctx); /* past the gate the peers count on these transfers */
  }
  cuda_leave(s, st, !rc);
  if (rc) return rc;
  sl->state = EP_LLS_SENT;
  sl->stream = st;
  sl->n = a->num_tokens, sl->topk = a->topk, sl->fmt = fmt;
  const int nrecv = nslot(s, sl)->nrec;
  if (!a->two_phase && (rc = cuda_net_ll_recv_dispatch(s, sl, OP))) {
    sl->state = EP_LLS_FREE; /* no handle holds it */
    return rc;
  }
  cuda_ll_fill_info(s->ll, a, sl, nrecv, out);
  return EP_OK;
}

/* The start of a receive, on the stream of the send: refused while it is captured (*entered
 * false: the handle as it was), else the wait for the transfers. */
static ep_status_t recv_begin(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op, cudaStream_t *st,
                              bool *entered) {
  ep_status_t rc = cuda_enter(s, sl->stream, op, st);
  if (!rc && cuda_capturing(*st)) rc = refuse_capture(s, *st, op);
  *entered = !rc;
  return rc ? rc : settle(s, nslot(s, sl), op, "recv");
}

ep_status_t cuda_net_ll_recv_dispatch(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op) {
  nll_slot_t *ns = nslot(s, sl);
  const epk_ll_layout_t *l = &s->ll->k.lay;
  cudaStream_t st;
  bool entered;
  ep_status_t rc = recv_begin(s, sl, op, &st, &entered);
  if (!entered) return rc;
  epk_nll_unpack_t k = {ns->recv.p,
                        ns->nrec,
                        l->H,
                        l->NS,
                        sl->fmt,
                        l->L,
                        l->RT,
                        sl->data + l->d_slab,
                        (int32_t *)(sl->ctrl + l->c_src),
                        s->net->bad};
  if (!rc) rc = cuda_check(s, cudaMemsetAsync(s->net->bad, 0, 4, st), op, "recv");
  if (!rc) rc = cuda_check(s, epk_nll_launch_unpack(&k, s->ll->k.blocks, st), op, "launch");
  int32_t *bad = (int32_t *)ns->pin; /* page-locked, free again once the plan's uploads ran */
  if (!rc)
    rc = cuda_check(s, cudaMemcpyAsync(bad, s->net->bad, 4, cudaMemcpyDefault, st), op, "recv");
  if (!rc) rc = cuda_net_sync(s, st, op, "recv");
  if (!rc && *bad)
    rc = ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, -1, op, "recv",
                     "a record from another rank named a row outside this rank's receive layout "
                     "(ranks disagree about the layout); it was dropped");
  cuda_leave(s, st, true);
  sl->state = rc ? EP_LLS_FAILED : EP_LLS_RECEIVED;
  return rc;
}

/* ------------------------------------------------------------------ combine */

/* Local checks of a combine (a failure rejects it on every rank). */
static ep_status_t combine_prepare(cuda_state_t *s, const ep_ll_combine_args_t *a,
                                   const cuda_ll_slot_t *sl, cudaStream_t st, const char *op) {
  const nll_slot_t *ns = nslot(s, sl);
  ep_status_t rc = cuda_ll_combine_check(s, a, sl); /* the handle's state, then alignment */
  if (rc) return rc;
  if (cuda_capturing(st))
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, op, "arguments", "%s", CAPTURE);
  const size_t cnt = (size_t)sl->n * (size_t)sl->topk;
  const int64_t *c = s->net->ll->cidx;
  rc = ids_to_host(s, a->topk_idx, cnt, st, op);
  for (size_t i = 0; !rc && i < cnt; i++)
    if (c[i] != -1 && c[i] != ns->ids[i])
      rc = ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, -1, op, "check",
                       "topk_idx[%d][%d] is %lld but the dispatch had %lld (a combine may only "
                       "set slots to -1)",
                       (int)(i / (size_t)sl->topk), (int)(i % (size_t)sl->topk), (long long)c[i],
                       (long long)ns->ids[i]);
  return rc;
}

/* Every rank enters the combine of the same dispatch, or every rank fails it. */
static ep_status_t combine_agree(cuda_state_t *s, ep_status_t mine, int32_t seq, const char *op) {
  int32_t w[2] = {mine != EP_OK, seq}, *all = s->net->ll->agree;
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  ep_status_t st = cuda_net_allgather(s, CUDA_NET_TAG_LL_COMBINE, w, all, sizeof w, op, "check");
  if (st || mine) {
    if (mine) ep_ctx_restore_error(saved);
    return mine ? mine : st;
  }
  for (int r = 0; r < s->nranks && !st; r++)
    if (all[2 * r])
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, op, "check",
                       "rank %d rejected its arguments for this combine (see its error)", r);
  for (int r = 0; r < s->nranks && !st; r++)
    if (all[2 * r + 1] != seq)
      st = ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "check",
                       "rank %d combines the handle of low-latency dispatch #%d, this rank #%d: "
                       "every rank must combine the same dispatch",
                       r, all[2 * r + 1], seq);
  return st;
}

/* Rows each source gets back (view order: local experts ascending, the source's rows in order)
 * and, for this rank's (token, k), the row of the rows sent back to it (peers ascending, each
 * peer's experts ascending, tokens ascending), -1 where the combine leaves the slot out. */
static ep_status_t combine_plan(cuda_state_t *s, const cuda_ll_slot_t *sl, nll_slot_t *ns,
                                cudaStream_t st, const char *op, int *nsend) {
  const epk_ll_layout_t *l = &s->ll->k.lay;
  const int R = s->nranks, L = l->L;
  const size_t cnt = (size_t)sl->n * (size_t)sl->topk;
  int total = 0;
  for (int r = 0; r < R; r++) {
    ns->to[r] = 0;
    for (int le = 0; le < L; le++)
      ns->to[r] += (int32_t)(ns->range[(size_t)le * R + r] & 0xffffffff);
    total += ns->to[r];
  }
  const size_t b_rows = epk_al(4 * (size_t)total, 16);
  int32_t *pin = pinned(s, ns, b_rows + 4 * cnt + 16, op);
  if (!pin) return EP_ERR_NO_MEMORY;
  int32_t *rows = pin, *map = (int32_t *)((uint8_t *)pin + b_rows);
  int n = 0;
  for (int r = 0; r < R; r++)
    for (int le = 0; le < L; le++) {
      const int64_t v = ns->range[(size_t)le * R + r];
      for (int64_t i = 0; i < (v & 0xffffffff); i++) rows[n++] = le * l->RT + (int)((v >> 32) + i);
    }
  const int64_t *c = s->net->ll->cidx;
  int m = 0;
  for (int r = 0; r < R; r++) {
    ns->from[r] = 0;
    for (int64_t e = (int64_t)r * L; e < (int64_t)(r + 1) * L; e++)
      for (size_t t = 0; t < (size_t)sl->n; t++)
        for (size_t k = 0; k < (size_t)sl->topk; k++) {
          const size_t i = t * (size_t)sl->topk + k;
          if (ns->ids[i] != e) continue;
          map[i] = c[i] < 0 ? -1 : m;
          m++, ns->from[r]++;
        }
  }
  for (size_t i = 0; i < cnt; i++)
    if (ns->ids[i] < 0) map[i] = -1;
  ns->nrec = m;
  *nsend = total;
  void *d_rows = cuda_dstage(s, &ns->rows, b_rows + 16, op);
  void *d_map = d_rows ? cuda_dstage(s, &ns->map, 4 * cnt + 16, op) : NULL;
  if (!d_map) return EP_ERR_NO_MEMORY;
  ep_status_t rc = cuda_check(
      s, cudaMemcpyAsync(d_rows, rows, 4 * (size_t)total, cudaMemcpyHostToDevice, st), op, "plan");
  if (!rc && cnt)
    rc =
        cuda_check(s, cudaMemcpyAsync(d_map, map, 4 * cnt, cudaMemcpyHostToDevice, st), op, "plan");
  return rc;
}

static ep_status_t combine_send(cuda_state_t *s, const ep_ll_combine_args_t *a, cuda_ll_slot_t *sl,
                                cudaStream_t st, const char *op) {
  nll_slot_t *ns = nslot(s, sl);
  const epk_ll_layout_t *l = &s->ll->k.lay;
  const size_t cnt = (size_t)sl->n * (size_t)sl->topk;
  int nsend = 0;
  ep_status_t rc = combine_plan(s, sl, ns, st, op, &nsend);
  if (rc) return rc;
  const uint64_t row = 2 * (uint64_t)l->H;
  uint8_t *sbuf = cuda_dstage(s, &ns->csend, row * (uint64_t)nsend + 16, op);
  uint8_t *rbuf = sbuf ? cuda_dstage(s, &ns->crecv, row * (uint64_t)ns->nrec + 16, op) : NULL;
  void *w = rbuf ? cuda_dstage(s, &ns->w, 4 * cnt + 16, op) : NULL;
  if (!w) return EP_ERR_NO_MEMORY;
  /* The weights are copied at the call (a two-phase caller need only keep `out`). */
  if (cnt)
    rc = cuda_check(s, cudaMemcpyAsync(w, a->topk_weights, 4 * cnt, cudaMemcpyDefault, st), op,
                    "weights");
  epk_nll_gather_t k = {a->y, (const int32_t *)ns->rows.p, sbuf, nsend, l->H};
  if (!rc) rc = cuda_check(s, epk_nll_launch_gather(&k, s->ll->k.blocks, st), op, "launch");
  return rc ? rc : post(s, ns, sbuf, rbuf, row, st, op);
}

ep_status_t cuda_net_ll_combine(cuda_state_t *s, const ep_ll_combine_args_t *a,
                                ep_handle_info_t *h) {
  static const char OP[] = "ep_ll_combine";
  cuda_ll_slot_t *sl = h->priv;
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (!rc) rc = combine_prepare(s, a, sl, st, OP);
  const ep_status_t own = rc;
  rc = combine_agree(s, rc, nslot(s, sl)->seq, OP);
  if (!rc) {
    sl->out = a->out;
    rc = combine_send(s, a, sl, st, OP);
    if (rc) ep_ctx_mark_broken(s->ctx);
  }
  cuda_leave(s, st, !rc);
  if (own) return rc; /* this rank's own arguments: the handle is as it was */
  sl->stream = st;
  if (rc) {
    sl->state = EP_LLS_FAILED;
    return rc;
  }
  sl->state = EP_LLS_COMB_SENT;
  return a->two_phase ? EP_OK : cuda_net_ll_recv_combine(s, sl, OP);
}

ep_status_t cuda_net_ll_recv_combine(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op) {
  nll_slot_t *ns = nslot(s, sl);
  const epk_ll_layout_t *l = &s->ll->k.lay;
  cudaStream_t st;
  bool entered;
  ep_status_t rc = recv_begin(s, sl, op, &st, &entered);
  if (!entered) return rc;
  epk_nll_reduce_t k = {
      ns->crecv.p, (const int32_t *)ns->map.p, (const float *)ns->w.p, sl->out, sl->n, sl->topk,
      l->H};
  if (!rc) rc = cuda_check(s, epk_nll_launch_reduce(&k, s->ll->k.blocks, st), op, "launch");
  if (!rc) rc = cuda_net_sync(s, st, op, "recv");
  cuda_leave(s, st, true);
  sl->state = rc ? EP_LLS_FAILED : EP_LLS_COMBINED;
  return rc;
}

/* ------------------------------------------------------------------ slots, rejections */

void cuda_net_ll_settle(cuda_state_t *s, cuda_ll_slot_t *sl) {
  nll_slot_t *ns = nslot(s, sl);
  if (!ns->pending) return;
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  settle(s, ns, "ep_ll_handle_destroy", "settle"); /* a failure breaks the buffer */
  ep_ctx_restore_error(saved);
}

void cuda_net_ll_reject(cuda_state_t *s, bool combine) {
  static const char OP[] = "rejected call";
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  /* A failed exchange breaks the buffer itself (cuda_net_allgather). */
  if (combine)
    combine_agree(s, EP_ERR_INVALID_ARG, -1, OP);
  else
    gate(s, EP_ERR_INVALID_ARG, OP);
  ep_ctx_restore_error(saved);
}
