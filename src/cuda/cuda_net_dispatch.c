/* Normal-mode dispatch across hosts on the CUDA backend (cuda_net.h, dispatch steps 1-4). */
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_net.h"
#include "cuda/cuda_net_plan.h"

static const char OP[] = "ep_dispatch";

typedef struct {
  ep_dispatch_call_t *c;
  cuda_nplan_t *p;
  bool cached;
  epk_net_rec_t r;
  epk_net_area_t lay;
  uint8_t *in_rank; /* host [N][R] (non-cached) */
  int64_t *tok;     /* host [N][H] (non-cached; epk_net_reduce_t.tok) */
  uint8_t *sbuf, *rbuf;
  epk_net_blk_t *blk; /* device [H] */
} job_t;

static bool aligned16(const void *p) {
  return ((uintptr_t)p & 15) == 0;
}

/* The ids on the host (page-locked, kept), checked as the layout checks them. */
static ep_status_t ids_to_host(cuda_state_t *s, const ep_dispatch_call_t *c, cudaStream_t st,
                               const int64_t **out) {
  cuda_net_t *n = s->net;
  size_t cnt = (size_t)c->in.num_tokens * (size_t)c->topk, bytes = cnt * 8 + 8;
  if (bytes > n->ids_cap) {
    if (n->ids_host) cudaFreeHost(n->ids_host);
    n->ids_host = NULL, n->ids_cap = 0;
    ep_status_t rc = cuda_check(s, cudaHostAlloc((void **)&n->ids_host, bytes, 0), OP, "ids");
    if (rc) return rc;
    n->ids_cap = bytes;
  }
  ep_status_t rc =
      cnt ? cuda_check(s,
                       cudaMemcpyAsync(n->ids_host, c->in.topk_idx, cnt * 8, cudaMemcpyDefault, st),
                       OP, "ids")
          : EP_OK;
  if (!rc) rc = cuda_net_sync(s, st, OP, "ids");
  for (size_t i = 0; !rc && i < cnt; i++)
    if (n->ids_host[i] < -1 || n->ids_host[i] >= c->num_experts)
      rc = ep_call_bad_expert(s->ctx, OP, (int64_t)(i / (size_t)c->topk),
                              (int)(i % (size_t)c->topk), n->ids_host[i], c->num_experts);
  *out = n->ids_host;
  return rc;
}

/* Everything this rank can find wrong before the count exchange (then it rejects the call). */
static ep_status_t prepare(cuda_state_t *s, job_t *j, cudaStream_t st, int32_t *words) {
  ep_dispatch_call_t *c = j->c;
  int R = s->nranks, H = s->net->H, key = (int)(sizeof(ep_call_key_t) / 4);
  if (cuda_capturing(st))
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP, "arguments",
                       "a dispatch across hosts waits on the host (counts, network) and cannot be "
                       "captured in a CUDA graph");
  if (!aligned16(c->in.x) || (c->out.mode == EP_OUTPUT_CALLER && !aligned16(c->out.recv_x)))
    return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                       "%s must be 16-byte aligned on the CUDA backend",
                       !aligned16(c->in.x) ? "args->x" : "out->recv_x");
  if (c->views && c->out.worst_case && c->out.capacity > j->lay.a.rows)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "out->capacity %d exceeds the %lld rows the receive area holds (views "
                       "need every row at once): raise queue_bytes",
                       c->out.capacity, (long long)j->lay.a.rows);
  ep_status_t rc = cuda_net_sync(s, st, OP, "enter");
  if (rc) return rc;
  memcpy(words, &c->key, sizeof c->key);
  if (j->cached) {
    memcpy(words + key, j->p->cnt + (size_t)s->rank * R, (size_t)R * 4);
    memcpy(words + key + R, j->p->hcnt + (size_t)s->rank * H, (size_t)H * 4);
    memcpy(words + key + R + H, j->p->ocnt + (size_t)s->rank * H, (size_t)H * 4);
    return EP_OK;
  }
  const int64_t *ids;
  if ((rc = ids_to_host(s, c, st, &ids))) return rc;
  int N = c->in.num_tokens;
  j->p = cuda_nplan_new(s, N);
  j->in_rank = malloc((size_t)N * (size_t)R + 1);
  j->tok = malloc(((size_t)N * (size_t)H + 1) * 8);
  if (!j->p || !j->in_rank || !j->tok)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout",
                       "out of memory for the layout of num_tokens %d x %d ranks", N, R);
  j->p->hidden = c->in.hidden, j->p->topk = c->topk; /* the number comes with the counts */
  cuda_nplan_send_side(s, j->p, ids, c->topk, c->num_local, j->in_rank, words + key,
                       words + key + R, words + key + R + H);
  return EP_OK;
}

/* Every rank computes the same verdict for every rank, so a full area fails the call alike. */
static ep_status_t check_rows(cuda_state_t *s, const job_t *j) {
  for (int d = 0; d < s->nranks; d++) {
    int32_t nr = cuda_nplan_rows_of(j->p, d);
    if (nr > j->lay.a.rows)
      return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, d, OP, "counts",
                         "rank %d receives %d rows; the receive area holds %lld of %zu bytes: "
                         "raise queue_bytes (the area is R x num_channels x queue_bytes)",
                         d, nr, (long long)j->lay.a.rows, j->c->row_bytes);
  }
  return EP_OK;
}

/* After the counts: the plan's receive side, headers, device arrays and staging. Local; the
 * caller agrees on the result with every rank. */
static ep_status_t plan(cuda_state_t *s, job_t *j, cudaStream_t st) {
  cuda_nplan_t *p = j->p;
  int H = p->H, own = p->own;
  if (!j->cached) {
    if (!cuda_nplan_headers(s, p, j->in_rank, j->tok))
      return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout", "out of memory");
    if (!cuda_nplan_device(p, true))
      return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout",
                         "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
    ep_status_t rc =
        cuda_check(s, cudaMemcpyAsync(p->d_hdr, p->hdr, p->b_hdr - 4, cudaMemcpyHostToDevice, st),
                   OP, "layout");
    if (!rc)
      rc =
          cuda_check(s, cudaMemcpyAsync(p->d_tok, j->tok, p->b_tok - 8, cudaMemcpyHostToDevice, st),
                     OP, "layout");
    if (rc) return rc;
  }
  size_t rbytes = 0;
  for (int b = 0; b < H; b++)
    if (b != own) rbytes += (size_t)(p->blk_base[b + 1] - p->blk_base[b]) * j->r.rec;
  j->sbuf = cuda_dstage(s, &s->net->send, (size_t)p->hsend_off[H] * j->r.rec + 16, OP);
  j->rbuf = cuda_dstage(s, &s->net->recv, rbytes + 16, OP);
  j->blk = cuda_dstage(s, &s->net->desc, (size_t)H * sizeof(epk_net_blk_t), OP);
  return j->sbuf && j->rbuf && j->blk ? EP_OK : EP_ERR_NO_MEMORY;
}

/* The transfers of this rank's blocks (sends to each other host, receives of its column's) and
 * the descriptors of the blocks it fans out; returns how many transfers. */
static int plan_blocks(const cuda_state_t *s, const job_t *j, ep_net_xfer_t *x,
                       epk_net_blk_t *blk) {
  const cuda_net_t *n = s->net;
  const cuda_nplan_t *p = j->p;
  int H = p->H, L = p->L, me = n->host, nx = 0;
  for (int g = 0; g < H; g++) {
    int32_t m = p->hsend_off[g + 1] - p->hsend_off[g];
    if (g != me && m > 0)
      x[nx++] = (ep_net_xfer_t){
          n->rank_at[g * L + n->lrank], 1, 0, j->sbuf + (size_t)p->hsend_off[g] * j->r.rec,
          (size_t)m * j->r.rec,         0, 0, 0};
  }
  size_t roff = 0;
  int64_t pbase = 0; /* where each block's partials will start in this forwarder's buffer */
  for (int b = 0; b < H; b++) {
    int32_t m = p->blk_base[b + 1] - p->blk_base[b];
    uint8_t *at = b == p->own ? j->sbuf + (size_t)p->hsend_off[me] * j->r.rec : j->rbuf + roff;
    int64_t pb = cuda_nplan_pbytes(p, p->col[b], me);
    blk[b] = (epk_net_blk_t){at, pbase, pb, m, p->col[b], p->blk_base[b], 0};
    pbase += pb;
    if (b == p->own || !m) continue;
    x[nx++] = (ep_net_xfer_t){p->col[b], 0, 0, at, (size_t)m * j->r.rec, 0, 0, 0};
    roff += (size_t)m * j->r.rec;
  }
  return nx;
}

/* After the fan-out: this rank's work done, and every rank agrees that every record it forwarded
 * was sound (the barrier before the receivers read their areas). */
static ep_status_t verify(cuda_state_t *s, cudaStream_t st, ep_status_t rc) {
  /* A timeout or a lost peer already broke the buffer: no second wait for the same peer. */
  if (rc == EP_ERR_TIMEOUT || rc == EP_ERR_PEER_FAILED) return rc;
  int32_t bad = 0;
  if (!rc) rc = cuda_net_sync(s, st, OP, "forward");
  if (!rc) /* the stream is idle now: a copy on it, never one that waits for other streams */
    rc = cuda_check(s, cudaMemcpyAsync(&bad, s->net->bad, sizeof bad, cudaMemcpyDeviceToHost, st),
                    OP, "forward");
  if (!rc) rc = cuda_check(s, cudaStreamSynchronize(st), OP, "forward");
  if (!rc && bad)
    rc = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, bad - 1, OP, "forward",
                     "rank %d sent records whose rows or partial offsets lie outside this host's "
                     "buffers (a corrupt or mismatched peer): they were dropped",
                     bad - 1);
  return cuda_net_agree(s, rc, OP, "forward");
}

/* Pack, the network, the fan-out into the ranks of this host, and the agreement after it. */
static ep_status_t forward(cuda_state_t *s, job_t *j, cudaStream_t st) {
  cuda_net_t *n = s->net;
  cuda_nplan_t *p = j->p;
  const ep_dispatch_args_t *a = &j->c->in;
  int H = p->H, blocks = s->kb.blocks > 0 ? s->kb.blocks : 1;
  epk_net_pack_t pk = {j->r,
                       p->hsend_off[H],
                       p->d_hdr,
                       a->x,
                       a->x_scales,
                       a->scale_token_stride,
                       a->scale_hidden_stride,
                       a->topk_idx,
                       a->topk_weights,
                       j->sbuf};
  ep_status_t rc = cuda_check(s, epk_net_launch_pack(&pk, blocks, st), OP, "launch");
  ep_net_xfer_t x[2 * H];
  epk_net_blk_t blk[H];
  int nx = plan_blocks(s, j, x, blk);
  if (!rc)
    rc = cuda_check(s, cudaMemcpyAsync(j->blk, blk, sizeof blk, cudaMemcpyHostToDevice, st), OP,
                    "network");
  if (!rc) rc = cuda_check(s, cudaMemsetAsync(n->bad, 0, sizeof *n->bad, st), OP, "network");
  epk_net_fanout_t f = {j->r,
                        H,
                        j->blk,
                        n->area_d,
                        j->lay,
                        j->cached ? NULL : p->d_fan,
                        j->cached ? NULL : p->d_poff,
                        (int64_t)epk_net_psize(p->hidden, p->topk, 1),
                        (int64_t)epk_net_psize(p->hidden, p->topk, 0),
                        n->bad};
  ep_status_t posted = rc ? EP_ERR_INTERNAL : (rc = cuda_net_post(s, x, nx, st, OP, "network"));
  if (!rc) rc = cuda_check(s, epk_net_launch_fanout(&f, p->entries, blocks, st), OP, "launch");
  if (!rc)
    rc = cuda_net_complete(s, x, nx, OP, "network");
  else if (!posted)
    cuda_net_abandon(s, x, nx); /* the transfers are in flight: let them go */
  if (!rc) cuda_net_count_local(s, p, j->c->row_bytes); /* written into its host's ranks */
  return verify(s, st, rc);
}

/* Area D into the outputs (views: in place), counts, rank_prefix, the worst case's tail. */
static ep_status_t finish(cuda_state_t *s, job_t *j, cudaStream_t st) {
  ep_dispatch_call_t *c = j->c;
  ep_dispatch_out_t *o = &c->out;
  cuda_nplan_t *p = j->p;
  const int nr = p->nr, ns = j->r.ns, topk = c->topk, R = s->nranks;
  uint8_t *area = s->pool + s->kb.off_area_d;
  ep_status_t rc = ep_call_outputs_ready(s->ctx, c, nr, j->lay.a.rows);
  if (!rc && o->mode == EP_OUTPUT_ALLOC && !aligned16(o->recv_x))
    rc = ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "outputs",
                     "the alloc callback gave a recv_x that is not 16-byte aligned");
  if (rc) return rc;
  if (c->views) {
    o->recv_x = area + j->lay.a.off_x;
    o->recv_x_scales = ns ? (float *)(area + j->lay.a.off_s) : NULL;
    o->recv_topk_idx = j->cached ? NULL : (int64_t *)(area + j->lay.a.off_i);
    o->recv_topk_weights = j->cached || !c->has_w ? NULL : (float *)(area + j->lay.a.off_w);
    o->recv_src_idx = (int32_t *)(area + j->lay.a.off_src);
  }
  int32_t *ecount = s->kb.ecount;
  bool experts = !j->cached && o->recv_tokens_per_expert;
  if (experts)
    rc = cuda_check(s, cudaMemsetAsync(ecount, 0, 4 * (size_t)c->num_local, st), OP, "outputs");
  epk_net_finish_t fk = {area,
                         j->lay,
                         nr,
                         topk,
                         ns,
                         j->cached,
                         c->has_w,
                         s->rank * c->num_local,
                         c->num_local,
                         c->row_bytes,
                         o->recv_x,
                         o->recv_x_scales,
                         j->cached ? NULL : o->recv_topk_weights,
                         j->cached ? NULL : o->recv_topk_idx,
                         o->recv_src_idx,
                         j->cached ? NULL : p->d_meta,
                         experts ? ecount : NULL};
  int blocks = s->kb.blocks > 0 ? s->kb.blocks : 1;
  if (!rc) rc = cuda_check(s, epk_net_launch_finish(&fk, blocks, st), OP, "launch");
  if (!rc && experts)
    rc = cuda_check(s,
                    epk_net_launch_experts(ecount, o->recv_tokens_per_expert, c->num_local,
                                           c->in.expert_alignment, st),
                    OP, "launch");
  int32_t *pre = o->rank_prefix ? malloc((size_t)R * R * 4) : NULL;
  if (!rc && o->rank_prefix && !pre)
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs", "out of memory");
  if (!rc && pre) {
    for (size_t i = 0; i < (size_t)R; i++)
      for (size_t d = 0; d < (size_t)R; d++)
        pre[i * R + d] = p->cnt[i * R + d] + (i ? pre[(i - 1) * R + d] : 0);
    rc = cuda_check(s,
                    cudaMemcpyAsync(o->rank_prefix, pre, (size_t)R * R * 4, cudaMemcpyDefault, st),
                    OP, "outputs");
  }
  /* pre is freed below; per-expert counts in host memory are written on return (epcomm.h) */
  if (!rc && (pre || experts)) rc = cuda_net_sync(s, st, OP, "outputs");
  free(pre);
  int64_t tail = o->worst_case ? (int64_t)o->capacity - nr : 0;
  if (!rc && tail > 0) {
    if (o->recv_topk_idx && !j->cached)
      rc = cuda_check(
          s,
          cudaMemsetAsync(o->recv_topk_idx + (size_t)nr * topk, 0xff, (size_t)tail * topk * 8, st),
          OP, "outputs");
    if (!rc && o->recv_topk_weights && !j->cached)
      rc = cuda_check(
          s,
          cudaMemsetAsync(o->recv_topk_weights + (size_t)nr * topk, 0, (size_t)tail * topk * 4, st),
          OP, "outputs");
    if (!rc && o->recv_src_idx)
      rc = cuda_check(s, cudaMemsetAsync(o->recv_src_idx + nr, 0xff, (size_t)tail * 4, st), OP,
                      "outputs");
  }
  if (!rc) o->num_recv_tokens = nr;
  return rc;
}

static ep_status_t run(cuda_state_t *s, job_t *j, cudaStream_t st, const int32_t *words) {
  ep_status_t rc = cuda_net_counts(s, words, OP);
  if (rc) return rc;
  if (!j->cached) cuda_nplan_counts(s, j->p, s->net->counts, s->net->cw);
  rc = check_rows(s, j);
  if (rc) return rc;
  if ((rc = cuda_net_agree(s, plan(s, j, st), OP, "layout"))) return rc;
  if ((rc = forward(s, j, st))) return rc;
  return finish(s, j, st);
}

ep_status_t cuda_net_dispatch(cuda_state_t *s, ep_dispatch_call_t *c, ep_handle_info_t *out) {
  job_t j;
  memset(&j, 0, sizeof j);
  j.c = c, j.cached = c->cached != NULL, j.p = j.cached ? c->cached->priv : NULL;
  const int ns = c->in.dtype == EP_DTYPE_FP8_E4M3 ? c->in.num_scales : 0;
  const int topk_sent = j.cached ? 0 : c->topk;
  j.r = epk_net_rec(s->net->L, c->row_bytes, ns, c->topk, !j.cached, c->has_w);
  j.lay = epk_net_area(s->kb.area_bytes, c->row_bytes, ns, topk_sent, !j.cached && c->has_w);
  int32_t *words = calloc((size_t)s->net->cw, sizeof *words);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, c->in.stream, OP, &st);
  if (rc) {
    free(words);
    return rc;
  }
  rc = words ? prepare(s, &j, st, words)
             : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "arguments", "out of memory");
  if (rc) {
    cuda_leave(s, st, false);
    cuda_net_reject(s, OP);
  } else {
    rc = run(s, &j, st, words);
    cuda_leave(s, st, true);
  }
  free(words), free(j.in_rank), free(j.tok);
  if (j.cached) return rc;
  if (rc) {
    cuda_nplan_free(j.p);
    return rc;
  }
  *out = ep_call_handle_info(c, j.p->nr, j.p, cuda_nplan_free);
  return EP_OK;
}
