/* Normal-mode dispatch across hosts (cpu_net.h, steps 1-4). Records, in network blocks and in
 * the queues alike: a 16-byte header (source token, output row, entry in its block, source
 * rank), the payload, fp8 scales, global expert ids, weights (each 16-byte aligned; a cached
 * dispatch sends no ids nor weights). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_net.h"
#include "cpu_net_plan.h"

static const char OP[] = "ep_dispatch";
#define BATCH 32
#define NET_SLEEP_S 0.0002 /* futex naps while the network needs polling */

enum { H_TOKEN, H_ROW, H_ENTRY, H_SRC };

typedef struct {
  const ep_dispatch_args_t *a;
  const ep_dispatch_out_t *o;
  cpu_nplan_t *p;
  bool cached, has_w, drain;
  int topk, num_local, first_expert, own; /* own: this rank's block among its column's */
  size_t row, scales, rec, off_x, off_s, off_i, off_w;
  ep_net_xfer_t *x; /* receives (chunks, block by block), then sends */
  int nx;
  int32_t crows; /* records per chunk */
  unsigned char *sbuf, *rbuf;
  size_t *blk_off;        /* [H] where block b's records are in rbuf */
  int *blk_x;             /* [H + 1] block b's receive chunks: x[blk_x[b] .. blk_x[b+1]] */
  int32_t *arrived;       /* [H] records of block b received (channel 0) */
  _Atomic int32_t *ready; /* [H] entries of block b with record and fan-out list */
  int32_t *next;          /* [H][L] fan-out counters (channel 0 lists the blocks) */
  int32_t *tpe;           /* [C][num_local] selections received per local expert */
  _Atomic int net_left;   /* transfers not done */
} job_t;

/* ------------------------------------------------------------------ records */

static void layout(job_t *j, const ep_dispatch_args_t *a, int topk) {
  j->topk = topk;
  j->row = (size_t)a->hidden * ep_dtype_size(a->dtype);
  j->scales = a->dtype == EP_DTYPE_FP8_E4M3 ? (size_t)a->num_scales * sizeof(float) : 0;
  j->off_x = 16;
  j->off_s = j->off_x + j->row;
  j->off_i = j->off_s + cpu_al16(j->scales);
  j->off_w = j->off_i + (j->cached ? 0 : cpu_al16((size_t)topk * sizeof(int64_t)));
  j->rec = j->off_w + (j->cached || !j->has_w ? 0 : cpu_al16((size_t)topk * sizeof(float)));
}

/* Token t of this rank as a record (header: t, row, entry, this rank). */
static void pack(const job_t *j, int grank, int32_t t, int32_t row, int32_t e, unsigned char *rec) {
  const ep_dispatch_args_t *a = j->a;
  int32_t h[4] = {t, row, e, grank};
  memcpy(rec, h, sizeof h);
  memcpy(rec + j->off_x, (const unsigned char *)a->x + (size_t)t * j->row, j->row);
  for (int i = 0; j->scales && i < a->num_scales; i++)
    ((float *)(rec + j->off_s))[i] =
        a->x_scales[t * a->scale_token_stride + i * a->scale_hidden_stride];
  if (j->cached) return;
  memcpy(rec + j->off_i, a->topk_idx + (size_t)t * j->topk, (size_t)j->topk * sizeof(int64_t));
  if (j->has_w)
    memcpy(rec + j->off_w, a->topk_weights + (size_t)t * j->topk, (size_t)j->topk * sizeof(float));
}

/* Local ids and weights of output row r from a token's global ids; counts selections. */
static void deliver_ids(const job_t *j, int c, int32_t r, const int64_t *ids, const float *w) {
  const ep_dispatch_out_t *o = j->o;
  for (int k = 0; k < j->topk; k++) {
    int64_t e = ids[k] - j->first_expert;
    bool local = ids[k] >= 0 && e >= 0 && e < j->num_local;
    if (local) j->tpe[(size_t)c * j->num_local + (size_t)e]++;
    if (o->recv_topk_idx) o->recv_topk_idx[(size_t)r * j->topk + k] = local ? e : -1;
    if (o->recv_topk_weights)
      o->recv_topk_weights[(size_t)r * j->topk + k] = local && w ? w[k] : 0.0f;
  }
}

/* A record (from a queue or a network block) into the outputs at row r. */
static void deliver(const job_t *j, int c, const unsigned char *rec, int32_t r, int32_t e,
                    int src) {
  if (j->drain) return;
  const ep_dispatch_out_t *o = j->o;
  memcpy((unsigned char *)o->recv_x + (size_t)r * j->row, rec + j->off_x, j->row);
  if (j->scales) memcpy(o->recv_x_scales + (size_t)r * j->a->num_scales, rec + j->off_s, j->scales);
  if (o->recv_src_idx) memcpy(&o->recv_src_idx[r], rec + 4 * H_TOKEN, sizeof(int32_t));
  if (j->cached) return;
  j->p->row_src[r] = src, j->p->row_j[r] = e;
  deliver_ids(j, c, r, (const int64_t *)(rec + j->off_i),
              j->has_w ? (const float *)(rec + j->off_w) : NULL);
}

/* This rank's own token t into its own output row r: one copy, straight from x. */
static void deliver_own(const job_t *j, int c, int grank, int32_t t, int32_t r, int32_t e) {
  if (j->drain) return;
  const ep_dispatch_args_t *a = j->a;
  const ep_dispatch_out_t *o = j->o;
  memcpy((unsigned char *)o->recv_x + (size_t)r * j->row,
         (const unsigned char *)a->x + (size_t)t * j->row, j->row);
  for (int q = 0; j->scales && q < a->num_scales; q++)
    o->recv_x_scales[(size_t)r * a->num_scales + q] =
        a->x_scales[t * a->scale_token_stride + q * a->scale_hidden_stride];
  if (o->recv_src_idx) o->recv_src_idx[r] = t;
  if (j->cached) return;
  j->p->row_src[r] = grank, j->p->row_j[r] = e;
  deliver_ids(j, c, r, a->topk_idx + (size_t)t * j->topk,
              j->has_w ? a->topk_weights + (size_t)t * j->topk : NULL);
}

/* ------------------------------------------------------------------ network */

static size_t block_bytes(const job_t *j, int32_t n) {
  return (size_t)n * j->rec;
}

/* Chunks of a block of n records; the sender and the receiver cut it alike. */
static int chunks_of(const job_t *j, int32_t n) {
  return (int)((n + j->crows - 1) / j->crows);
}

static void add_chunks(job_t *j, int peer, int send, unsigned char *base, int32_t n) {
  for (int32_t k = 0; k < n; k += j->crows) {
    int32_t m = n - k < j->crows ? n - k : j->crows;
    j->x[j->nx++] = (ep_net_xfer_t){
        peer, send, NET_TAG_DISPATCH, base + block_bytes(j, k), block_bytes(j, m), 0, 0, 0};
  }
}

/* Receives of the column's remote blocks, and this rank's blocks for the other hosts. */
static ep_status_t start_network(cpu_state_t *s, job_t *j) {
  cpu_nplan_t *p = j->p;
  int H = p->H, me = s->topo->host;
  size_t rbytes = 0, sbytes = 0;
  int nchunks = 0;
  for (int b = 0; b < H; b++) {
    int32_t n = p->blk_base[b + 1] - p->blk_base[b];
    j->blk_off[b] = rbytes;
    if (b != j->own) rbytes += block_bytes(j, n), nchunks += chunks_of(j, n);
  }
  for (int g = 0; g < H; g++) {
    int32_t n = p->hsend_off[g + 1] - p->hsend_off[g];
    if (g != me) sbytes += block_bytes(j, n), nchunks += chunks_of(j, n);
  }
  j->x = calloc((size_t)nchunks + 1, sizeof *j->x);
  j->rbuf = cpu_stage(s, &s->net->recv, rbytes + 1);
  j->sbuf = cpu_stage(s, &s->net->send, sbytes + 1);
  if (!j->x || !j->rbuf || !j->sbuf)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "network", "out of memory");
  for (int b = 0; b < H; b++) {
    j->blk_x[b] = j->nx;
    if (b != j->own)
      add_chunks(j, p->col[b], 0, j->rbuf + j->blk_off[b], p->blk_base[b + 1] - p->blk_base[b]);
  }
  j->blk_x[H] = j->nx;
  unsigned char *at = j->sbuf;
  for (int g = 0; g < H; g++) {
    if (g == me) continue;
    int32_t n = p->hsend_off[g + 1] - p->hsend_off[g];
    for (int32_t e = 0; e < n; e++)
      pack(j, s->grank, p->hsend_idx[p->hsend_off[g] + e], 0, e, at + block_bytes(j, e));
    add_chunks(j, s->topo->rank_at[g * p->L + s->topo->local_rank], 1, at, n);
    at += block_bytes(j, n);
  }
  atomic_fetch_add(&s->net->net_bytes, sbytes);
  atomic_store(&j->net_left, j->nx);
  ep_status_t st = s->net->e->post(s->net->normal, j->x, j->nx, NULL);
  return st ? ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_last_error()) : EP_OK;
}

/* Channel 0: transfers that completed; records of a block become ready in order, each with its
 * fan-out list (listed here, in entry order, from the expert ids the record carries). Chunks of
 * a block complete in order: only the next one is tested (every test runs MPI's progress
 * engine); the sends are tested once every receive is done. */
static int net_progress(cpu_state_t *s, job_t *j, ep_status_t *st) {
  cpu_nplan_t *p = j->p;
  int done, left = 0;
  bool news = false;
  *st = EP_OK;
  for (int b = 0; b < p->H; b++) {
    if (b == j->own) continue;
    int32_t n = p->blk_base[b + 1] - p->blk_base[b], have = j->arrived[b];
    for (int i = j->blk_x[b] + have / j->crows; i < j->blk_x[b + 1]; i++) {
      if (!j->x[i].done && (*st = s->net->e->test(s->net->normal, &j->x[i], 1, &done))) return 0;
      if (!j->x[i].done) break;
      have = (i - j->blk_x[b] + 1) * j->crows < n ? (i - j->blk_x[b] + 1) * j->crows : n;
    }
    for (int32_t e = j->arrived[b]; !j->cached && e < have; e++)
      cpu_nplan_fan(s, p, b, e,
                    (const int64_t *)(j->rbuf + j->blk_off[b] + block_bytes(j, e) + j->off_i),
                    j->topk, j->num_local, j->next + (size_t)b * p->L);
    if (have != j->arrived[b]) news = true;
    j->arrived[b] = have;
    left += have < n;
    atomic_store_explicit(&j->ready[b], have, memory_order_release);
  }
  for (int c = 1; news && c < s->channels; c++) cpu_ring_bell(s, s->rank, c);
  int sends = j->nx - j->blk_x[p->H];
  if (!left && (*st = s->net->e->test(s->net->normal, j->x + j->blk_x[p->H], sends, &done)))
    return 0;
  int was = atomic_load(&j->net_left);
  atomic_store(&j->net_left, left ? left + 1 : sends - done);
  return news || was != atomic_load(&j->net_left);
}

/* ------------------------------------------------------------------ one channel */

typedef struct {
  int32_t e, f; /* next entry of the block, and next receiver of that entry */
  int32_t end;
} cursor_t;

typedef struct {
  cpu_q_t *out, *in; /* [L] queues to and from the ranks of this host */
  cursor_t *cur;     /* [H] */
  bool *ended;       /* [L] the rank's END record arrived */
  bool *end_sent;    /* [L] our END record is in its queue */
  int *pushed;       /* [L] records pushed since the last publication */
  bool blocks_done, ends_sent;
  uint64_t bytes; /* pushed into queues */
} chan_t;

/* Entry e of block b, for local receiver l (its fan index f), pushed or delivered; false when
 * the queue is full. */
static bool forward(cpu_state_t *s, const job_t *j, chan_t *ch, int c, int b, int32_t e,
                    int32_t f) {
  const cpu_nplan_t *p = j->p;
  int l = p->fan_l[f];
  int32_t row = p->fan_row[f];
  const unsigned char *from = b == j->own ? NULL : j->rbuf + j->blk_off[b] + block_bytes(j, e);
  int32_t t = from ? -1 : p->hsend_idx[p->hsend_off[s->topo->host] + e];
  if (l == s->rank) {
    if (from)
      deliver(j, c, from, row, e, p->col[b]);
    else
      deliver_own(j, c, s->grank, t, row, e);
    return true;
  }
  unsigned char *rec = cpu_q_reserve(&ch->out[l], j->rec);
  if (!rec) return false;
  if (!from)
    pack(j, s->grank, t, row, e, rec);
  else
    memcpy(rec, from, j->rec);
  int32_t h[4];
  memcpy(h, rec, sizeof h);
  h[H_ROW] = row, h[H_ENTRY] = e, h[H_SRC] = p->col[b];
  memcpy(rec, h, sizeof h);
  cpu_q_commit(&ch->out[l], j->rec);
  ch->bytes += j->rec;
  if (++ch->pushed[l] % BATCH == 0) cpu_q_publish(&ch->out[l]), cpu_ring_bell(s, l, c);
  return true;
}

static int push_blocks(cpu_state_t *s, const job_t *j, chan_t *ch, int c) {
  const cpu_nplan_t *p = j->p;
  int moved = 0;
  bool all = true;
  for (int b = 0; b < p->H; b++) {
    cursor_t *k = &ch->cur[b];
    int32_t ready = atomic_load_explicit(&j->ready[b], memory_order_acquire);
    int32_t base = p->blk_base[b];
    while (k->e < k->end && k->e < ready) {
      int32_t f1 = p->fan_off[base + k->e + 1];
      if (k->f < p->fan_off[base + k->e]) k->f = p->fan_off[base + k->e];
      while (k->f < f1 && forward(s, j, ch, c, b, k->e, k->f)) k->f++, moved++;
      if (k->f < f1) break; /* a queue is full: later */
      k->e++;
    }
    all &= k->e >= k->end;
  }
  for (int l = 0; l < s->nranks; l++)
    if (l != s->rank && ch->pushed[l])
      cpu_q_publish(&ch->out[l]), cpu_ring_bell(s, l, c), ch->pushed[l] = 0;
  ch->blocks_done = all;
  return moved;
}

/* After its last record, each channel sends every rank of the host an END record. */
static int push_ends(cpu_state_t *s, const job_t *j, chan_t *ch, int c) {
  int moved = 0, left = 0;
  for (int l = 0; l < s->nranks; l++) {
    if (l == s->rank || ch->end_sent[l]) continue;
    unsigned char *rec = cpu_q_reserve(&ch->out[l], j->rec);
    if (!rec) {
      left++;
      continue;
    }
    int32_t h[4] = {-1, -1, -1, -1};
    memcpy(rec, h, sizeof h);
    cpu_q_commit(&ch->out[l], j->rec);
    cpu_q_publish(&ch->out[l]), cpu_ring_bell(s, l, c);
    ch->end_sent[l] = true, moved++;
  }
  ch->ends_sent = left == 0;
  return moved;
}

static int pull(cpu_state_t *s, const job_t *j, chan_t *ch, int c, bool *all_ended) {
  int moved = 0;
  *all_ended = true;
  for (int l = 0; l < s->nranks; l++) {
    if (l == s->rank || ch->ended[l]) continue;
    int n = 0;
    const unsigned char *rec;
    while (!ch->ended[l] && (rec = cpu_q_peek(&ch->in[l], j->rec))) {
      int32_t h[4];
      memcpy(h, rec, sizeof h);
      if (h[H_ROW] < 0)
        ch->ended[l] = true;
      else
        deliver(j, c, rec, h[H_ROW], h[H_ENTRY], h[H_SRC]);
      cpu_q_consume(&ch->in[l], j->rec);
      if (++n % BATCH == 0) cpu_q_release(&ch->in[l]), cpu_ring_bell(s, l, c);
    }
    if (n) cpu_q_release(&ch->in[l]), cpu_ring_bell(s, l, c);
    moved += n;
    *all_ended &= ch->ended[l];
  }
  return moved;
}

static int laggard(const cpu_state_t *s, const chan_t *ch, char *what, size_t n) {
  for (int l = 0; l < s->nranks; l++)
    if (l != s->rank && !ch->ended[l]) {
      snprintf(what, n, "rows forwarded by rank %d of this host", cpu_grank(s, l));
      return cpu_grank(s, l);
    }
  snprintf(what, n, "room in a queue, or a network block");
  return -1;
}

/* MPI's progress costs microseconds a call: channel 0 runs it between rounds of local work no
 * more often than this, and whenever there is nothing else to do. */
#define NET_PERIOD_S 0.0001

static ep_status_t loop(cpu_state_t *s, job_t *j, chan_t *ch, int c) {
  cpu_waiter_t w;
  cpu_waiter_init(&w, s, c, OP, "data");
  double next_net = 0;
  int moved = 0;
  for (;;) {
    uint32_t seen = cpu_bell_read(s, c);
    ep_status_t st = EP_OK;
    bool ended;
    if (c == 0 && atomic_load(&j->net_left) && (!moved || ep_now() >= next_net)) {
      moved = net_progress(s, j, &st);
      next_net = ep_now() + NET_PERIOD_S;
    } else {
      moved = 0;
    }
    if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_last_error());
    if (!ch->blocks_done) moved += push_blocks(s, j, ch, c);
    if (ch->blocks_done && !ch->ends_sent) moved += push_ends(s, j, ch, c);
    moved += pull(s, j, ch, c, &ended);
    bool net_wait = c == 0 && atomic_load(&j->net_left) > 0;
    if (ch->ends_sent && ended && !net_wait) return EP_OK;
    if (moved) continue;
    w.sleep_cap = net_wait ? NET_SLEEP_S : 0.010;
    char what[96];
    int who = laggard(s, ch, what, sizeof what);
    if ((st = cpu_wait(&w, seen, who, what))) return st;
  }
}

static ep_status_t channel(cpu_state_t *s, void *arg, int c) {
  job_t *j = arg;
  int L = s->nranks, H = j->p->H;
  chan_t ch = {0};
  ch.out = calloc((size_t)L * 2, sizeof *ch.out);
  ch.cur = calloc((size_t)H, sizeof *ch.cur);
  ch.ended = calloc((size_t)L * 2, sizeof *ch.ended);
  ch.pushed = calloc((size_t)L, sizeof *ch.pushed);
  if (!ch.out || !ch.cur || !ch.ended || !ch.pushed) {
    free(ch.out), free(ch.cur), free(ch.ended), free(ch.pushed);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "data", "out of memory");
  }
  ch.in = ch.out + L;
  ch.end_sent = ch.ended + L;
  for (int l = 0; l < L; l++) {
    if (l == s->rank) continue;
    cpu_q_open_send(&ch.out[l], cpu_ring(s, l, s->rank, c), s->queue_bytes);
    cpu_q_open_recv(&ch.in[l], cpu_ring(s, s->rank, l, c), s->queue_bytes);
  }
  for (int b = 0; b < H; b++) {
    int lo, hi;
    cpu_chan_range(j->p->blk_base[b + 1] - j->p->blk_base[b], s->channels, c, &lo, &hi);
    ch.cur[b] = (cursor_t){lo, 0, hi};
  }
  ep_status_t st = loop(s, j, &ch, c);
  if (st && st != EP_ERR_INTERNAL) cpu_abort_peers(s, st);
  atomic_fetch_add(&s->net->local_bytes, ch.bytes);
  free(ch.out), free(ch.cur), free(ch.ended), free(ch.pushed);
  return st;
}

/* ------------------------------------------------------------------ the call */

static void results(cpu_state_t *s, ep_dispatch_call_t *c, job_t *j) {
  cpu_nplan_t *p = j->p;
  ep_dispatch_out_t *o = &c->out;
  int R = s->gnranks, Nr = p->flat->Nr;
  for (int r = Nr; o->worst_case && r < o->capacity; r++) {
    for (int k = 0; k < j->topk; k++) {
      if (o->recv_topk_idx) o->recv_topk_idx[(size_t)r * j->topk + k] = -1;
      if (o->recv_topk_weights) o->recv_topk_weights[(size_t)r * j->topk + k] = 0.0f;
    }
    if (o->recv_src_idx) o->recv_src_idx[r] = -1;
  }
  if (o->rank_prefix) memcpy(o->rank_prefix, p->flat->rank_prefix, sizeof(int32_t) * (size_t)R * R);
  int A = c->in.expert_alignment;
  for (int l = 0; !j->cached && o->recv_tokens_per_expert && l < j->num_local; l++) {
    int64_t n = 0;
    for (int ch = 0; ch < s->channels; ch++) n += j->tpe[(size_t)ch * j->num_local + l];
    o->recv_tokens_per_expert[l] = (int32_t)(A > 1 ? (n + A - 1) / A * A : n);
  }
  o->num_recv_tokens = Nr;
}

/* This rank's own block: its tokens for its own host, fan-out listed from topk_idx now. */
static void list_own(cpu_state_t *s, job_t *j) {
  cpu_nplan_t *p = j->p;
  int h = s->topo->host;
  int32_t n = p->hsend_off[h + 1] - p->hsend_off[h];
  for (int32_t e = 0; !j->cached && e < n; e++)
    cpu_nplan_fan(s, p, j->own, e,
                  j->a->topk_idx + (size_t)p->hsend_idx[p->hsend_off[h] + e] * j->topk, j->topk,
                  j->num_local, j->next + (size_t)j->own * p->L);
  atomic_store(&j->ready[j->own], n);
  j->arrived[j->own] = n;
}

static ep_status_t run(cpu_state_t *s, ep_dispatch_call_t *c, job_t *j) {
  cpu_nplan_t *p = j->p;
  int H = p->H;
  j->blk_off = calloc((size_t)H, sizeof *j->blk_off);
  j->blk_x = calloc((size_t)H + 1, sizeof *j->blk_x);
  j->arrived = calloc((size_t)H, sizeof *j->arrived);
  j->ready = calloc((size_t)H, sizeof *j->ready);
  j->next = calloc((size_t)H * p->L, sizeof *j->next);
  j->tpe = calloc((size_t)s->channels * j->num_local + 1, sizeof *j->tpe);
  if (!j->blk_off || !j->blk_x || !j->arrived || !j->ready || !j->next || !j->tpe)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "data", "out of memory");
  for (int b = 0; b < H; b++)
    if (p->col[b] == s->grank) j->own = b;
  /* Outputs for Nr rows (the allocator is called here); if they cannot take them, the rows are
   * still received and dropped, and every rank's forwarding goes on as planned. */
  ep_status_t out_st = ep_call_outputs_ready(s->ctx, c, p->flat->Nr, 0);
  j->drain = out_st != EP_OK;
  ep_status_t st = start_network(s, j);
  if (st) return st;
  list_own(s, j);
  st = cpu_run_channels(s, channel, j);
  if (st) {
    s->net->e->cancel(s->net->normal, j->x, j->nx);
    return st;
  }
  if (out_st) return out_st;
  results(s, c, j);
  return EP_OK;
}

static void job_free(job_t *j) {
  free(j->x), free(j->blk_off), free(j->blk_x), free(j->arrived), free((void *)j->ready);
  free(j->next), free(j->tpe);
}

/* This rank's count words: key, then its tokens per rank and per host. */
static int32_t *count_words(cpu_state_t *s, const ep_dispatch_call_t *c, cpu_nplan_t *p,
                            bool cached) {
  int R = s->gnranks, H = p->H, key = (int)(sizeof(ep_call_key_t) / 4);
  int32_t *w = calloc((size_t)s->net->cw, sizeof *w);
  if (!w) return NULL;
  memcpy(w, &c->key, sizeof c->key);
  if (cached) {
    memcpy(w + key, p->cnt + (size_t)s->grank * R, (size_t)R * sizeof *w);
    memcpy(w + key + R, p->hcnt + (size_t)s->grank * H, (size_t)H * sizeof *w);
  } else {
    cpu_nplan_send_side(s, p, w + key, w + key + R);
  }
  return w;
}

static ep_status_t route(cpu_state_t *s, const ep_dispatch_args_t *a, cpu_nplan_t **out) {
  cpu_nplan_t *p = cpu_nplan_new(s, a->num_tokens);
  if (!p)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout",
                       "out of memory for the "
                       "layout of num_tokens %d x %d ranks",
                       a->num_tokens, s->gnranks);
  ep_status_t st = cpu_route(s, a->topk_idx, a->num_tokens, a->topk, a->num_experts, NULL, NULL,
                             p->flat->in_rank, NULL, NULL, OP);
  if (st)
    cpu_nplan_free(p);
  else
    *out = p;
  return st;
}

ep_status_t cpu_net_dispatch(cpu_state_t *s, ep_dispatch_call_t *c, ep_handle_info_t *out) {
  job_t j;
  memset(&j, 0, sizeof j);
  j.a = &c->in, j.o = &c->out, j.cached = c->cached != NULL, j.has_w = c->has_w;
  j.num_local = c->num_local, j.first_expert = s->grank * c->num_local;
  layout(&j, &c->in, c->topk);
  j.crows = (int32_t)(s->net->chunk / j.rec > 0 ? s->net->chunk / j.rec : 1);
  ep_status_t st = EP_OK;
  if (j.rec > s->queue_bytes / 2)
    st = ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                     "one token takes %zu bytes; "
                     "queue_bytes (%zu) must hold two: raise queue_bytes",
                     j.rec, s->queue_bytes);
  cpu_nplan_t *p = j.cached ? c->cached->priv : NULL;
  if (!st && !j.cached) st = route(s, &c->in, &p);
  if (st) {
    cpu_net_reject(s);
    return st;
  }
  j.p = p;
  int32_t *words = count_words(s, c, p, j.cached);
  st = words ? cpu_net_counts(s, words, OP)
             : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "counts", "out of memory");
  free(words);
  if (!st && !j.cached && !cpu_nplan_recv_side(s, p, s->net->counts, s->net->cw))
    st = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout", "out of memory");
  if (!st) st = run(s, c, &j);
  s->seq++;
  job_free(&j);
  if (j.cached) return st;
  if (st) {
    cpu_nplan_free(p);
    return st;
  }
  *out = ep_call_handle_info(c, p->flat->Nr, p, cpu_nplan_free);
  return EP_OK;
}
