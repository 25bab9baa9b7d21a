/* Normal-mode combine across hosts on the CUDA backend (cuda_net.h, combine steps 1-3;
 * SEMANTICS.md §4.6): rows into the own area C, partials of each host at the forwarders, the
 * partials back over NCCL, the reduction at the source. */
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_net.h"
#include "cuda/cuda_net_plan.h"

static const char OP[] = "ep_combine";

/* Area C: x rows of the handle, then (256-aligned) its weight rows. */
typedef struct {
  uint64_t xrow, wrow, off_w;
  int64_t rows;
} carea_t;

static carea_t carea(const cuda_state_t *s, const ep_handle_info_t *h) {
  carea_t c;
  c.xrow = 2ull * (uint64_t)h->hidden;
  c.wrow = 4ull * (uint64_t)h->topk; /* room for weights whether or not a call has them */
  c.rows = epk_stage_rows(s->kb.area_bytes, c.xrow, c.wrow);
  c.off_w = epk_al((uint64_t)c.rows * c.xrow, 256);
  return c;
}

ep_status_t cuda_net_combine_buffer(cuda_state_t *s, const ep_handle_info_t *h, void **x) {
  carea_t c = carea(s, h);
  if (h->recv_rows > c.rows)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, "ep_get_combine_buffer", "arguments",
                       "the handle has %d rows; the combine area holds %lld: raise queue_bytes",
                       h->recv_rows, (long long)c.rows);
  *x = s->pool + s->kb.off_area_c;
  return EP_OK;
}

typedef struct {
  const ep_combine_args_t *a;
  const ep_handle_info_t *h;
  cuda_nplan_t *p;
  carea_t ca;
  bool has_w;
  uint8_t *part, *pin;
  const uint8_t **blk; /* device [H] */
} job_t;

static ep_status_t check_rows(cuda_state_t *s, const job_t *j) {
  for (int d = 0; d < s->nranks; d++) {
    int32_t nr = cuda_nplan_rows_of(j->p, d);
    if (nr > j->ca.rows)
      return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, d, OP, "counts",
                         "rank %d combines %d rows; the combine area holds %lld: raise "
                         "queue_bytes (the area is R x num_channels x queue_bytes)",
                         d, nr, (long long)j->ca.rows);
  }
  return EP_OK;
}

static ep_status_t stage(cuda_state_t *s, job_t *j) {
  cuda_nplan_t *p = j->p;
  int H = p->H, me = s->net->host;
  size_t in = 0, out = 0;
  for (int g = 0; g < H; g++)
    if (g != me) in += (size_t)cuda_nplan_pbytes(p, s->rank, g);
  for (int b = 0; b < H; b++) out += (size_t)cuda_nplan_pbytes(p, p->col[b], me);
  j->part = cuda_dstage(s, &s->net->part, out + 16, OP);
  j->pin = cuda_dstage(s, &s->net->pin, in + 16, OP);
  j->blk = cuda_dstage(s, &s->net->desc, (size_t)H * sizeof(void *), OP);
  return j->part && j->pin && j->blk ? EP_OK : EP_ERR_NO_MEMORY;
}

/* Partials of the column at this forwarder, over NCCL to their sources, and the reduction. */
static ep_status_t reduce(cuda_state_t *s, job_t *j, cudaStream_t st) {
  cuda_net_t *n = s->net;
  cuda_nplan_t *p = j->p;
  const ep_combine_args_t *a = j->a;
  int H = p->H, L = p->L, me = n->host, blocks = s->kb.blocks > 0 ? s->kb.blocks : 1;
  epk_net_partial_t pk = {p->entries, L,         j->h->hidden, j->h->topk,  j->has_w,
                          p->d_fan,   p->d_poff, n->area_c,    j->ca.off_w, j->part};
  ep_status_t rc = cuda_check(s, epk_net_launch_partial(&pk, blocks, st), OP, "launch");
  ep_net_xfer_t x[2 * H];
  const uint8_t *blk[H];
  int nx = 0;
  size_t base = 0, own = 0;
  for (int b = 0; b < H; b++) {
    size_t bytes = (size_t)cuda_nplan_pbytes(p, p->col[b], me);
    if (b == p->own) own = base;
    if (b != p->own && bytes > 0)
      x[nx++] = (ep_net_xfer_t){p->col[b], 1, 0, j->part + base, bytes, 0, 0, 0};
    base += bytes;
  }
  size_t off = 0;
  for (int g = 0; g < H; g++) {
    size_t bytes = (size_t)cuda_nplan_pbytes(p, s->rank, g);
    if (g == me) {
      blk[g] = j->part + own;
      continue;
    }
    blk[g] = j->pin + off;
    if (bytes > 0)
      x[nx++] = (ep_net_xfer_t){n->rank_at[g * L + n->lrank], 0, 0, j->pin + off, bytes, 0, 0, 0};
    off += bytes;
  }
  if (!rc)
    rc = cuda_check(s, cudaMemcpyAsync(j->blk, blk, sizeof blk, cudaMemcpyHostToDevice, st), OP,
                    "network");
  ep_status_t posted = rc ? EP_ERR_INTERNAL : (rc = cuda_net_post(s, x, nx, st, OP, "network"));
  epk_net_reduce_t rk = {p->N,   H,          j->h->hidden, j->h->topk, j->has_w,           p->d_tok,
                         j->blk, a->bias[0], a->bias[1],   a->out,     a->out_topk_weights};
  if (!rc) rc = cuda_check(s, epk_net_launch_reduce(&rk, blocks, st), OP, "launch");
  if (!rc)
    rc = cuda_net_complete(s, x, nx, OP, "network");
  else if (!posted)
    cuda_net_abandon(s, x, nx);                    /* the transfers are in flight: let them go */
  if (!rc) cuda_net_count_local(s, p, j->ca.xrow); /* read from its host's ranks */
  return rc;
}

static ep_status_t run(cuda_state_t *s, job_t *j, cudaStream_t st, const int32_t *words) {
  ep_status_t rc = cuda_net_counts(s, words, OP);
  if (rc) return rc;
  if ((rc = check_rows(s, j))) return rc;
  if ((rc = cuda_net_agree(s, stage(s, j), OP, "staging"))) return rc;
  uint8_t *area = s->pool + s->kb.off_area_c;
  epk_net_stage_t sk = {j->a->x,    j->a->topk_weights, area,      j->ca.off_w,
                        j->ca.xrow, j->p->nr,           j->h->topk};
  int blocks = s->kb.blocks > 0 ? s->kb.blocks : 1;
  rc = cuda_check(s, epk_net_launch_stage(&sk, blocks, st), OP, "launch");
  rc = cuda_net_fence(s, st, rc, OP, "stage"); /* every rank, even after a local failure */
  if (!rc) rc = reduce(s, j, st);
  /* The peers of this host read our area C until their partials are done: nobody may write it
   * (the next combine, or the experts through ep_get_combine_buffer) before. */
  rc = cuda_net_fence(s, st, rc, OP, "release");
  return rc;
}

/* The kernels move rows 16 bytes at a time (as on one host: cuda_combine.c). */
static ep_status_t check_aligned(cuda_state_t *s, const ep_combine_args_t *a) {
  const void *ptrs[] = {a->x, a->out, a->bias[0], a->bias[1]};
  static const char *names[] = {"x", "out", "bias[0]", "bias[1]"};
  for (int i = 0; i < 4; i++)
    if ((uintptr_t)ptrs[i] & 15)
      return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                         "%s must be 16-byte aligned on the CUDA backend", names[i]);
  return EP_OK;
}

ep_status_t cuda_net_combine(cuda_state_t *s, const ep_combine_args_t *a,
                             const ep_handle_info_t *h) {
  job_t j = {a, h, h->priv, carea(s, h), a->topk_weights != NULL, NULL, NULL, NULL};
  int32_t *words = calloc((size_t)s->net->cw, sizeof *words);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) {
    free(words);
    return rc;
  }
  ep_call_key_t key;
  ep_call_combine_key(a, h, &key);
  if (!words)
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "arguments", "out of memory");
  else if (cuda_capturing(st))
    rc = ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP, "arguments",
                     "a combine across hosts waits on the host (network) and cannot be captured "
                     "in a CUDA graph");
  else
    rc = check_aligned(s, a);
  if (!rc && !(rc = cuda_net_sync(s, st, OP, "enter"))) {
    memcpy(words, &key, sizeof key);
  }
  if (rc) {
    cuda_leave(s, st, false);
    cuda_net_reject(s, OP);
  } else {
    rc = run(s, &j, st, words);
    cuda_leave(s, st, true);
  }
  free(words);
  return rc;
}
