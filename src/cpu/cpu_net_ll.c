/* Low-latency mode across hosts (cpu_net.h): the ranks of this host are written in shared
 * memory as on one host (cpu_ll_*.c); the ranks of other hosts through the engine (MPI), on the
 * buffer's low-latency endpoint:
 *   - the gate: every rank's entry record (status, slot, shape, selections per expert) reaches
 *     every rank, which is both the entry and the gate of the one-host protocol;
 *   - dispatch: one message per (source, destination) pair of different hosts holding the
 *     source's rows for the destination's experts (token order; each row with its token, slot
 *     and local expert), received into staging and written into the slab at the receive phase;
 *   - combine: every rank sends every rank of another host a header (status, rows, the number of
 *     the dispatch whose handle it combines: handles of different dispatches fail alike), then the
 *     rows it holds for that source in view order; the source knows that order from its own
 *     routing. A rank that rejects its combine sends a "rejected" header instead, and takes in
 *     the rows sent to it, so that every rank's next call pairs with the right messages.
 * A transfer still in flight when its slot is given back completes first (cpu_net_ll_settle). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ll.h"
#include "cpu_net.h"

enum { TAG_GATE = 11, TAG_DROWS = 12, TAG_CHDR = 13, TAG_CROWS = 14 };
enum { ROW_HDR = 16 }; /* token, slot, local expert, pad */

typedef struct {
  int64_t status, rows;
  int64_t q; /* the dispatch call whose handle the combine uses (the same number on every rank) */
  int64_t pad;
} chdr_t;

/* The network side of one result slot. */
typedef struct {
  ep_net_xfer_t *x; /* dispatch: receives from other hosts, then sends */
  int nx, nrecv;
  bool pending; /* posted, not yet waited for */
  size_t row, sbytes, rec;
  cpu_stage_t sbuf, rbuf;
  ep_net_xfer_t *cx; /* combine: header receives, header sends, row sends, row receives */
  int ncx, nhdr;
  bool cpending;
  chdr_t *hin, *hout; /* [R] */
  cpu_stage_t csbuf, crbuf;
} nslot_t;

struct cpu_net_ll {
  unsigned char *recs;            /* [R][arrive_bytes]: the records of the current dispatch */
  nslot_t slot[CPU_LL_SLOTS + 1]; /* + 1: the one a rejected combine uses */
};

static nslot_t *nslot(cpu_state_t *s, int i) {
  return &s->net->llnet->slot[i];
}

static bool remote(const cpu_state_t *s, int r) {
  return cpu_ll_seg(s, r) < 0;
}

ep_status_t cpu_net_ll_create(cpu_state_t *s) {
  int R = s->gnranks;
  struct cpu_net_ll *n = calloc(1, sizeof *n);
  if (!n) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  s->net->llnet = n;
  n->recs = calloc((size_t)R, s->ll->lay.arrive_bytes);
  bool ok = n->recs != NULL;
  for (int i = 0; i <= CPU_LL_SLOTS; i++) {
    nslot_t *ns = &n->slot[i];
    ns->x = calloc(2 * (size_t)R, sizeof *ns->x);
    ns->cx = calloc(4 * (size_t)R, sizeof *ns->cx);
    ns->hin = calloc(2 * (size_t)R, sizeof *ns->hin);
    ok = ok && ns->x && ns->cx && ns->hin;
    if (ns->hin) ns->hout = ns->hin + R;
  }
  return ok ? EP_OK : ep_err(EP_ERR_NO_MEMORY, "out of memory");
}

void cpu_net_ll_destroy(cpu_state_t *s, bool clean) {
  struct cpu_net_ll *n = s->net ? s->net->llnet : NULL;
  if (!n) return;
  for (int i = 0; i <= CPU_LL_SLOTS; i++) {
    nslot_t *ns = &n->slot[i];
    if (clean && i < CPU_LL_SLOTS) cpu_net_ll_settle(s, &s->ll->slot[i]);
    if (ns->pending && ns->x) s->net->e->cancel(s->net->ll, ns->x, ns->nx);
    if (ns->cpending && ns->cx) s->net->e->cancel(s->net->ll, ns->cx, ns->ncx);
    free(ns->x), free(ns->cx), free(ns->hin);
    free(ns->sbuf.p), free(ns->rbuf.p), free(ns->csbuf.p), free(ns->crbuf.p);
  }
  free(n->recs);
  free(n);
  s->net->llnet = NULL;
}

/* ------------------------------------------------------------------ gate */

const cpu_ll_arrive_t *cpu_net_ll_record(cpu_state_t *s, int r) {
  return (const cpu_ll_arrive_t *)(s->net->llnet->recs + (size_t)r * s->ll->lay.arrive_bytes);
}

ep_status_t cpu_net_ll_gate(cpu_state_t *s, const cpu_ll_arrive_t *mine, const int32_t *sel,
                            const char *op) {
  size_t ab = s->ll->lay.arrive_bytes;
  unsigned char *rec = calloc(1, ab);
  if (!rec) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, op, "gate", "out of memory");
  cpu_ll_arrive_t *a = (cpu_ll_arrive_t *)rec;
  a->status = mine->status, a->slot = mine->slot, a->topk = mine->topk, a->fmt = mine->fmt;
  a->num_tokens = mine->num_tokens;
  if (sel) memcpy(cpu_ll_sel(a), sel, sizeof(int32_t) * (size_t)s->ll->E);
  ep_status_t st =
      cpu_net_all_to_all(s, s->net->ll, TAG_GATE, rec, s->net->llnet->recs, ab, op, "gate");
  free(rec);
  return st ? st : cpu_ll_verdict(s, op);
}

/* ------------------------------------------------------------------ dispatch */

/* Selections of `who`'s record of the experts of rank d. */
static int32_t sel_of(cpu_state_t *s, int who, int d) {
  const int32_t *sel = cpu_ll_sel((cpu_ll_arrive_t *)cpu_ll_record(s, who));
  int32_t n = 0;
  for (int e = d * s->ll->L; e < (d + 1) * s->ll->L; e++) n += sel[e];
  return n;
}

/* This rank's rows for rank d, token order, each after its header. */
static unsigned char *pack_rows(cpu_state_t *s, nslot_t *ns, const ep_ll_dispatch_args_t *a, int d,
                                size_t stride, unsigned char *at) {
  const cpu_ll_t *ll = s->ll;
  for (int t = 0; t < a->num_tokens; t++) {
    const int64_t *id = a->topk_idx + (size_t)t * (size_t)a->topk;
    for (int k = 0; k < a->topk; k++) {
      if (id[k] < 0 || id[k] / ll->L != d) continue;
      int32_t h[4] = {t, k, (int32_t)(id[k] - (int64_t)d * ll->L), 0};
      memcpy(at, h, sizeof h);
      const unsigned char *src = a->use_fp8 ? ll->cast + (size_t)t * stride
                                            : (const unsigned char *)a->x + (size_t)t * ns->row;
      memcpy(at + ROW_HDR, src, ns->row);
      if (ns->sbytes) memcpy(at + ROW_HDR + ns->row, src + ns->row, ns->sbytes);
      at += ns->rec;
    }
  }
  return at;
}

ep_status_t cpu_net_ll_send(cpu_state_t *s, cpu_ll_slot_t *sl, const ep_ll_dispatch_args_t *a,
                            size_t row, size_t sbytes, size_t stride) {
  static const char OP[] = "ep_ll_dispatch";
  nslot_t *ns = nslot(s, sl->index);
  int R = s->gnranks;
  ns->row = row, ns->sbytes = sbytes, ns->rec = cpu_al16(ROW_HDR + row + sbytes);
  size_t in = 0, out = 0;
  for (int r = 0; r < R; r++)
    if (remote(s, r)) in += (size_t)sel_of(s, r, s->grank), out += (size_t)sel_of(s, s->grank, r);
  unsigned char *rb = cpu_stage(s, &ns->rbuf, in * ns->rec + 1);
  unsigned char *sb = cpu_stage(s, &ns->sbuf, out * ns->rec + 1);
  if (!rb || !sb) return EP_ERR_NO_MEMORY;
  ns->nx = 0;
  for (int r = 0; r < R; r++) {
    int32_t n = remote(s, r) ? sel_of(s, r, s->grank) : 0;
    if (n) ns->x[ns->nx++] = (ep_net_xfer_t){r, 0, TAG_DROWS, rb, (size_t)n * ns->rec, 0, 0, 0};
    rb += (size_t)n * ns->rec;
  }
  ns->nrecv = ns->nx;
  for (int r = 0; r < R; r++) {
    if (!remote(s, r) || !sel_of(s, s->grank, r)) continue;
    unsigned char *end = pack_rows(s, ns, a, r, stride, sb);
    ns->x[ns->nx++] = (ep_net_xfer_t){r, 1, TAG_DROWS, sb, (size_t)(end - sb), 0, 0, 0};
    sb = end;
  }
  atomic_fetch_add(&s->net->net_bytes, out * ns->rec);
  ep_status_t st = s->net->e->post(s->net->ll, ns->x, ns->nx, NULL);
  if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "send", "%s", ep_last_error());
  ns->pending = true;
  return EP_OK;
}

/* The rows of source `src` (received in `at`) into the slab, by expert, in token order. */
static void unpack_rows(cpu_state_t *s, const cpu_ll_slot_t *sl, const nslot_t *ns, int src,
                        const unsigned char *at, int32_t n) {
  const cpu_ll_t *ll = s->ll;
  unsigned char *slab = sl->base + ll->lay.slab;
  unsigned char *scales = slab + (size_t)ll->L * (size_t)ll->RT * (size_t)ll->H;
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  int32_t *srci = (int32_t *)(sl->base + ll->lay.src),
          *route = (int32_t *)(sl->base + ll->lay.route);
  int32_t cnt[ll->L];
  memset(cnt, 0, sizeof cnt);
  for (int32_t i = 0; i < n; i++, at += ns->rec) {
    int32_t h[4];
    memcpy(h, at, sizeof h);
    int l = h[2];
    size_t pos = (size_t)(range[(size_t)l * ll->R + src] >> 32) + (size_t)cnt[l]++;
    size_t r = (size_t)l * (size_t)ll->RT + pos;
    memcpy(slab + r * ns->row, at + ROW_HDR, ns->row);
    if (ns->sbytes && sl->scale_layout == EP_SCALES_COL_MAJOR)
      cpu_ll_put_cols(ll, scales, (size_t)l, pos, at + ROW_HDR + ns->row, sl->ue8m0);
    else if (ns->sbytes)
      memcpy(scales + r * ns->sbytes, at + ROW_HDR + ns->row, ns->sbytes);
    srci[r] = h[0], route[r] = h[1];
  }
}

ep_status_t cpu_net_ll_recv(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op) {
  nslot_t *ns = nslot(s, sl->index);
  if (!ns->pending) return EP_OK;
  ep_status_t st = cpu_net_wait(s, s->net->ll, ns->x, ns->nx, op, "recv");
  ns->pending = false;
  if (st) return st;
  for (int i = 0; i < ns->nrecv; i++)
    unpack_rows(s, sl, ns, ns->x[i].peer, ns->x[i].buf, (int32_t)(ns->x[i].bytes / ns->rec));
  return EP_OK;
}

/* ------------------------------------------------------------------ combine */

/* Rows source src gets back from this rank, in view order (expert, then the source's rows). */
static int32_t rows_back(const cpu_state_t *s, const cpu_ll_slot_t *sl, int src) {
  const cpu_ll_t *ll = s->ll;
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  int32_t n = 0;
  for (int l = 0; l < ll->L; l++) n += (int32_t)(range[(size_t)l * ll->R + src] & 0xffffffff);
  return n;
}

/* Headers from and to every rank of the other hosts (a rejected combine: rows = 0). */
static ep_status_t post_headers(cpu_state_t *s, nslot_t *ns, int64_t status,
                                const cpu_ll_slot_t *sl) {
  int R = s->gnranks;
  ns->ncx = 0;
  for (int r = 0; r < R; r++)
    if (remote(s, r))
      ns->cx[ns->ncx++] = (ep_net_xfer_t){r, 0, TAG_CHDR, &ns->hin[r], sizeof(chdr_t), 0, 0, 0};
  ns->nhdr = ns->ncx;
  for (int r = 0; r < R; r++) {
    if (!remote(s, r)) continue;
    ns->hout[r] =
        (chdr_t){status, sl && !status ? rows_back(s, sl, r) : 0, sl ? (int64_t)sl->q : -1, 0};
    ns->cx[ns->ncx++] = (ep_net_xfer_t){r, 1, TAG_CHDR, &ns->hout[r], sizeof(chdr_t), 0, 0, 0};
  }
  return EP_OK;
}

ep_status_t cpu_net_ll_csend(cpu_state_t *s, cpu_ll_slot_t *sl, const void *y) {
  static const char OP[] = "ep_ll_combine";
  const cpu_ll_t *ll = s->ll;
  nslot_t *ns = nslot(s, sl->index);
  size_t row = 2 * (size_t)ll->H, total = 0;
  int R = s->gnranks;
  post_headers(s, ns, 0, sl);
  for (int r = 0; r < R; r++) total += remote(s, r) ? (size_t)ns->hout[r].rows * row : 0;
  unsigned char *at = cpu_stage(s, &ns->csbuf, total + 1);
  if (!at) return EP_ERR_NO_MEMORY;
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  for (int r = 0; r < R; r++) {
    if (!remote(s, r) || !ns->hout[r].rows) continue;
    unsigned char *start = at;
    for (int l = 0; l < ll->L; l++) {
      int64_t rg = range[(size_t)l * ll->R + r];
      size_t b = (size_t)(rg >> 32), n = (size_t)(rg & 0xffffffff);
      memcpy(at, (const unsigned char *)y + ((size_t)l * (size_t)ll->RT + b) * row, n * row);
      at += n * row;
    }
    ns->cx[ns->ncx++] = (ep_net_xfer_t){r, 1, TAG_CROWS, start, (size_t)(at - start), 0, 0, 0};
  }
  atomic_fetch_add(&s->net->net_bytes, total);
  ep_status_t st = s->net->e->post(s->net->ll, ns->cx, ns->ncx, NULL);
  if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "send", "%s", ep_last_error());
  ns->cpending = true;
  return EP_OK;
}

/* The network part of a combine's receive: headers, then the rows they announce, then every
 * send done. *rejecter: a rank whose header said it rejected the combine (-1: none); *other: one
 * that combines the handle of another dispatch than `q` (-1: none; q < 0: not checked). */
static ep_status_t crecv_net(cpu_state_t *s, nslot_t *ns, int64_t q, const char *op, int *rejecter,
                             int *other) {
  *rejecter = -1, *other = -1;
  if (!ns->cpending) return EP_OK;
  ep_status_t st = cpu_net_wait(s, s->net->ll, ns->cx, ns->nhdr, op, "recv");
  size_t row = 2 * (size_t)s->ll->H, total = 0;
  for (int i = 0; !st && i < ns->nhdr; i++) {
    const chdr_t *h = &ns->hin[ns->cx[i].peer];
    if (h->status && *rejecter < 0) *rejecter = ns->cx[i].peer;
    if (!h->status && q >= 0 && h->q != q && *other < 0) *other = ns->cx[i].peer;
    total += (size_t)h->rows * row;
  }
  unsigned char *at = st ? NULL : cpu_stage(s, &ns->crbuf, total + 1);
  if (!st && !at) st = EP_ERR_NO_MEMORY;
  int first = ns->ncx;
  for (int i = 0; !st && i < ns->nhdr; i++) {
    int r = ns->cx[i].peer;
    size_t n = (size_t)ns->hin[r].rows * row;
    if (n) ns->cx[ns->ncx++] = (ep_net_xfer_t){r, 0, TAG_CROWS, at, n, 0, 0, 0}, at += n;
  }
  if (!st && ns->ncx > first)
    st = s->net->e->post(s->net->ll, ns->cx + first, ns->ncx - first, NULL);
  if (!st) st = cpu_net_wait(s, s->net->ll, ns->cx, ns->ncx, op, "recv");
  ns->cpending = false;
  return st;
}

/* Rows from rank d into the area, at (token, slot): d's experts ascending, this rank's tokens in
 * order, as d sent them. */
static ep_status_t unpack_back(cpu_state_t *s, cpu_ll_slot_t *sl, int d, const unsigned char *at,
                               int64_t rows, const char *op) {
  const cpu_ll_t *ll = s->ll;
  size_t row = 2 * (size_t)ll->H;
  unsigned char *area = sl->base + ll->lay.area;
  int64_t n = 0;
  for (int64_t e = (int64_t)d * ll->L; e < (int64_t)(d + 1) * ll->L; e++)
    for (int t = 0; t < sl->N; t++)
      for (int k = 0; k < sl->topk; k++) {
        if (sl->idx[(size_t)t * (size_t)sl->topk + (size_t)k] != e) continue;
        if (n++ < rows)
          memcpy(area + ((size_t)t * (size_t)sl->topk + (size_t)k) * row, at, row), at += row;
      }
  if (n == rows) return EP_OK;
  return ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, d, op, "recv",
                     "rank %d sent %lld rows back, this "
                     "rank's dispatch gave it %lld",
                     d, (long long)rows, (long long)n);
}

ep_status_t cpu_net_ll_crecv(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op) {
  nslot_t *ns = nslot(s, sl->index);
  int rejecter, other;
  ep_status_t st = crecv_net(s, ns, (int64_t)sl->q, op, &rejecter, &other);
  if (st) return st;
  if (rejecter >= 0)
    return ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, rejecter, op, "recv",
                       "rank %d rejected its "
                       "arguments for this combine (see its error)",
                       rejecter);
  if (other >= 0)
    return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, other, op, "recv",
                       "rank %d combines the handle of low-latency dispatch #%lld, this rank "
                       "#%lld: every rank must combine the same dispatch",
                       other, (long long)ns->hin[other].q, (long long)sl->q);
  const unsigned char *at = ns->crbuf.p;
  size_t row = 2 * (size_t)s->ll->H;
  for (int i = 0; i < ns->nhdr && !st; i++) {
    int d = ns->cx[i].peer;
    st = unpack_back(s, sl, d, at, ns->hin[d].rows, op);
    at += (size_t)ns->hin[d].rows * row;
  }
  return st;
}

void cpu_net_ll_creject(cpu_state_t *s) {
  nslot_t *ns = nslot(s, CPU_LL_SLOTS);
  int rejecter, other;
  post_headers(s, ns, 1, NULL);
  ep_status_t st = s->net->e->post(s->net->ll, ns->cx, ns->ncx, NULL);
  if (!st) ns->cpending = true, st = crecv_net(s, ns, -1, "rejected call", &rejecter, &other);
  if (st) ep_ctx_mark_broken(s->ctx);
}

void cpu_net_ll_settle(cpu_state_t *s, cpu_ll_slot_t *sl) {
  nslot_t *ns = nslot(s, sl->index);
  int rejecter, other;
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  ep_status_t st = EP_OK;
  if (ns->pending)
    st = cpu_net_wait(s, s->net->ll, ns->x, ns->nx, "ep_ll_handle_destroy", "settle");
  ns->pending = false;
  if (!st) st = crecv_net(s, ns, -1, "ep_ll_handle_destroy", &rejecter, &other);
  if (st) ep_ctx_mark_broken(s->ctx);
  ep_ctx_restore_error(saved);
}
