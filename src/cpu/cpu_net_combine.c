/* Normal-mode combine across hosts (cpu_net.h; SEMANTICS.md §4.6). Every rank plays three
 * roles at once, each channel over its share:
 *   - receiver: sends each row of x back to the forwarder that brought it (shared memory), in
 *     the order that forwarder takes them: the rows of its remote blocks first, its own last;
 *   - forwarder: per entry of a remote block, adds the rows of its host in rank order into one
 *     partial (fp32; a single row stays the bf16 row it is: exact) and sends the block's
 *     partials back to their source in chunks, each as soon as it is complete;
 *   - source: per token, bias0 + bias1, then the partials of the hosts it went to, ascending,
 *     one rounding to bf16. The partial of its own host is never stored: the forwarder takes
 *     its own block last, when the other hosts' partials of a token are here, and reduces the
 *     token at once, adding its host's rows (from the queues and x) lane by lane where the
 *     stored partial would have been read (cpu_reduce_final: the same fp32 sums, the same
 *     bits). A token that went to no rank of this host is reduced from the partials alone.
 * A partial entry: the row (bf16 when one rank of the host holds the token, else fp32), then,
 * with weights, topk floats (16-byte aligned). Forwarder and source size entries alike from the
 * number of ranks of the host the token went to.
 *
 * No cycle of waits: a remote block's partials need only rows, which receivers send back
 * independently of every forwarder's progress (one cursor per forwarder); the own block waits
 * for the remote partials and holds back only rows queued after every remote block's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_net.h"

static const char OP[] = "ep_combine";
#define BATCH 32
#define NET_SLEEP_S 0.0002

typedef struct {
  const ep_combine_args_t *a;
  const cpu_nplan_t *p;
  int H, topk, N, Hn, me; /* hidden, topk, tokens; hosts, this rank's host */
  bool has_w;
  size_t row, rec, wb; /* bf16 row; send-back record (row + weights); partial weights */
  int32_t ce;          /* partial entries per network chunk */
  /* forwarder: partials of remote block b, entry e at pbase[b] + poff[blk_base[b] + b + e] */
  unsigned char **pbase;  /* [Hn]: in the send staging (own block: none) */
  size_t *poff;           /* [entries + Hn] */
  _Atomic int32_t *cleft; /* [send chunks] entries not yet reduced */
  int *cx;                /* [Hn + 1] block b's send chunks: sx[cx[b] .. cx[b+1]] */
  int own;
  int *bord; /* [Hn] the order the forwarder takes its blocks: remote ones ascending, own last */
  /* source: partials from host g for entry e at sbase[g] + soff[hsend_off[g] + g + e] */
  unsigned char **sbase;  /* [Hn] (own host: none) */
  size_t *soff;           /* [my entries + Hn] */
  int *rx;                /* [Hn + 1] receive chunks from host g: x[rx[g] .. rx[g+1]] */
  _Atomic int32_t *ready; /* [Hn] entries from host g received (channel 0) */
  /* network: receives first, then sends (posted chunk by chunk as partials complete) */
  ep_net_xfer_t *x;
  int nrx, nx;
  _Atomic uint8_t *cposted; /* [send chunks] */
  int sent_chunks;
} job_t;

static size_t psize(const job_t *j, int32_t nfan) {
  return (nfan == 1 ? j->row : 2 * j->row) + j->wb;
}

/* ------------------------------------------------------------------ layout of the partials */

/* Offsets of a block's entries from their fan sizes; returns the block's bytes. */
static size_t offsets(const job_t *j, size_t *off, int32_t n, const int32_t *nfan, size_t stride) {
  off[0] = 0;
  for (int32_t e = 0; e < n; e++) off[e + 1] = off[e] + psize(j, nfan[(size_t)e * stride]);
  return off[n];
}

static int nchunks(const job_t *j, int32_t n) {
  return (int)((n + j->ce - 1) / j->ce);
}

static ep_status_t plan_partials(cpu_state_t *s, job_t *j) {
  const cpu_nplan_t *p = j->p;
  int Hn = j->Hn;
  int32_t entries = p->blk_base[Hn], mine = p->hsend_off[Hn];
  j->pbase = calloc((size_t)Hn * 2, sizeof *j->pbase);
  j->poff = calloc((size_t)entries + Hn, sizeof *j->poff);
  j->soff = calloc((size_t)mine + Hn, sizeof *j->soff);
  j->cx = calloc((size_t)Hn + 1, sizeof *j->cx);
  j->rx = calloc((size_t)Hn + 1, sizeof *j->rx);
  j->ready = calloc((size_t)Hn, sizeof *j->ready);
  int32_t *nf = malloc(((size_t)entries + mine + 1) * sizeof *nf);
  if (!j->pbase || !j->poff || !j->soff || !j->cx || !j->rx || !j->ready || !nf) {
    free(nf);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "network", "out of memory");
  }
  j->sbase = j->pbase + Hn;
  for (int32_t i = 0; i < entries; i++) nf[i] = p->fan_off[i + 1] - p->fan_off[i];
  size_t send_bytes = 0, recv_bytes = 0, *pb = malloc(sizeof(size_t) * 2 * (size_t)Hn);
  if (!pb) {
    free(nf);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "network", "out of memory");
  }
  for (int b = 0; b < Hn; b++) {
    int32_t n = p->blk_base[b + 1] - p->blk_base[b];
    size_t bytes = offsets(j, j->poff + p->blk_base[b] + b, n, nf + p->blk_base[b], 1);
    pb[b] = send_bytes;
    if (b != j->own) send_bytes += bytes;
  }
  for (int g = 0; g < Hn; g++) {
    int32_t n = p->hsend_off[g + 1] - p->hsend_off[g];
    for (int32_t e = 0; e < n; e++)
      nf[e] = p->tok_nfan[(size_t)p->hsend_idx[p->hsend_off[g] + e] * Hn + g];
    size_t bytes = offsets(j, j->soff + p->hsend_off[g] + g, n, nf, 1);
    pb[Hn + g] = recv_bytes;
    if (g != j->me) recv_bytes += bytes;
  }
  free(nf);
  unsigned char *snd = cpu_stage(s, &s->net->send, send_bytes + 1);
  unsigned char *rcv = cpu_stage(s, &s->net->recv, recv_bytes + 1);
  if (!snd || !rcv) return free(pb), EP_ERR_NO_MEMORY;
  for (int b = 0; b < Hn; b++) j->pbase[b] = b == j->own ? NULL : snd + pb[b];
  for (int g = 0; g < Hn; g++) j->sbase[g] = g == j->me ? NULL : rcv + pb[Hn + g];
  free(pb);
  return EP_OK;
}

/* Receives of the partials of this rank's tokens from the other hosts, posted now; sends of
 * the forwarded blocks' partials are set up, posted chunk by chunk as they complete. */
static ep_status_t plan_network(cpu_state_t *s, job_t *j) {
  const cpu_nplan_t *p = j->p;
  int Hn = j->Hn, n = 0, L = p->L, lr = s->topo->local_rank;
  for (int g = 0; g < Hn; g++)
    if (g != j->me) n += nchunks(j, p->hsend_off[g + 1] - p->hsend_off[g]);
  int sends = 0;
  for (int b = 0; b < Hn; b++)
    if (b != j->own) sends += nchunks(j, p->blk_base[b + 1] - p->blk_base[b]);
  j->x = calloc((size_t)n + sends + 1, sizeof *j->x);
  j->cleft = calloc((size_t)sends + 1, sizeof *j->cleft);
  j->cposted = calloc((size_t)sends + 1, sizeof *j->cposted);
  if (!j->x || !j->cleft || !j->cposted)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "network", "out of memory");
  for (int g = 0; g < Hn; g++) {
    j->rx[g] = j->nx;
    int32_t m = p->hsend_off[g + 1] - p->hsend_off[g];
    const size_t *off = j->soff + p->hsend_off[g] + g;
    for (int32_t e = 0; g != j->me && e < m; e += j->ce) {
      int32_t end = e + j->ce < m ? e + j->ce : m;
      j->x[j->nx++] = (ep_net_xfer_t){s->topo->rank_at[g * L + lr],
                                      0,
                                      NET_TAG_COMBINE,
                                      j->sbase[g] + off[e],
                                      off[end] - off[e],
                                      0,
                                      0,
                                      0};
    }
  }
  j->rx[Hn] = j->nrx = j->nx;
  for (int b = 0, k = 0; b < Hn; b++) {
    j->cx[b] = k;
    int32_t m = p->blk_base[b + 1] - p->blk_base[b];
    const size_t *off = j->poff + p->blk_base[b] + b;
    for (int32_t e = 0; b != j->own && e < m; e += j->ce, k++) {
      int32_t end = e + j->ce < m ? e + j->ce : m;
      j->cleft[k] = end - e;
      j->x[j->nrx + k] = (ep_net_xfer_t){
          p->col[b], 1, NET_TAG_COMBINE, j->pbase[b] + off[e], off[end] - off[e], 0, 0, 0};
    }
    j->cx[b + 1] = k;
  }
  j->nx = j->nrx + sends;
  for (int g = 0; g < Hn; g++)
    if (g == j->me) atomic_store(&j->ready[g], p->hsend_off[g + 1] - p->hsend_off[g]);
  ep_status_t st = s->net->e->post(s->net->normal, j->x, j->nrx, NULL);
  return st ? ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_last_error()) : EP_OK;
}

/* Channel 0: post the chunks of partials that are complete, each block's in order (the source
 * matches them in the order they are sent, and channels may finish them in another), and see
 * which partials arrived. Chunks complete in order on each stream: only the next one of each is
 * tested (every test runs MPI's progress engine). */
static int net_progress(cpu_state_t *s, job_t *j, ep_status_t *st) {
  int moved = 0, done;
  *st = EP_OK;
  for (int b = 0; b < j->Hn; b++)
    for (int k = j->cx[b]; k < j->cx[b + 1]; k++) {
      ep_net_xfer_t *x = &j->x[j->nrx + k];
      if (atomic_load(&j->cposted[k])) continue;
      if (atomic_load(&j->cleft[k])) break;
      if ((*st = s->net->e->post(s->net->normal, x, 1, NULL))) return 0;
      atomic_fetch_add(&s->net->net_bytes, x->bytes);
      atomic_store(&j->cposted[k], 1);
      j->sent_chunks++, moved++;
    }
  const cpu_nplan_t *p = j->p;
  bool news = false;
  for (int g = 0; g < j->Hn; g++) {
    if (g == j->me) continue;
    int32_t m = p->hsend_off[g + 1] - p->hsend_off[g], have = atomic_load(&j->ready[g]);
    for (int i = j->rx[g] + have / j->ce; i < j->rx[g + 1]; i++) {
      if (!j->x[i].done && (*st = s->net->e->test(s->net->normal, &j->x[i], 1, &done))) return 0;
      if (!j->x[i].done) break;
      have = (i - j->rx[g] + 1) * j->ce < m ? (i - j->rx[g] + 1) * j->ce : m;
    }
    if (have != atomic_load(&j->ready[g])) news = true, moved++;
    atomic_store_explicit(&j->ready[g], have, memory_order_release);
  }
  for (int c = 1; news && c < s->channels; c++) cpu_ring_bell(s, s->rank, c);
  return moved;
}

/* Sends are tested once everything else is done (their buffers live until the next call). */
static ep_status_t sends_done(cpu_state_t *s, job_t *j, bool *all) {
  int done = 0;
  *all = j->sent_chunks == j->nx - j->nrx;
  if (!*all) return EP_OK;
  ep_status_t st = s->net->e->test(s->net->normal, j->x + j->nrx, j->nx - j->nrx, &done);
  *all = done == j->nx - j->nrx;
  return st;
}

/* Receives pending, chunks not yet posted, or posted sends not complete. */
static bool net_busy(cpu_state_t *s, job_t *j, ep_status_t *st) {
  for (int i = 0; i < j->nrx; i++)
    if (!j->x[i].done) return true;
  bool all;
  *st = sends_done(s, j, &all);
  return !all;
}

/* ------------------------------------------------------------------ one channel */

typedef struct {
  cpu_q_t *out, *in; /* [L] send-back queues to the forwarders; from the receivers */
  int32_t *next;     /* [L] receiver: next row of x to consider for forwarder l */
  bool *own_phase;   /* [L] receiver: the rows of forwarder l's remote blocks are all sent */
  bool *touched;     /* [L] forwarder: queues consumed from since their last release */
  int bi, e, e_end;  /* forwarder: next entry (block bord[bi], entry), end of this channel's */
  int t, t_end;      /* source: next token to reduce */
  const unsigned char **rows; /* [L] forwarder: row of each receiver for the current entry */
  const void **parts;         /* [Hn + L] source: inputs of cpu_reduce_final */
  int *nrows;                 /* [Hn] */
  uint64_t bytes;
} chan_t;

/* The channel of entry e of a block of n entries (the dispatch's split, so that forwarder and
 * receiver agree). */
static int chan_of(int32_t e, int32_t n, int C) {
  int32_t chunk = (n + C - 1) / C;
  return chunk ? (int)(e / chunk) : 0;
}

/* Is row r sent back by channel c to forwarder l (not this rank: it reads x itself), in the
 * phase of its rows from remote sources (own == false) or from l itself? */
static bool back_to(const cpu_state_t *s, const job_t *j, int32_t r, int l, int c, bool own) {
  const cpu_nplan_t *p = j->p;
  int src = p->row_src[r];
  return s->topo->local_of[src] == l && (s->topo->host_of[src] == j->me) == own &&
         chan_of(p->row_j[r], p->hcnt[(size_t)src * j->Hn + j->me], s->channels) == c;
}

/* Receiver: rows back to their forwarders, one cursor per forwarder, so that a full queue to
 * one never holds back the others (each forwarder reduces its own column's tokens); to each,
 * the rows of its remote blocks first, then those of its own block (the order it takes them). */
static int send_back(cpu_state_t *s, const job_t *j, chan_t *ch, int c) {
  int moved = 0, Nr = j->p->flat->Nr;
  for (int l = 0; l < s->nranks; l++) {
    if (l == s->rank) continue;
    int n = 0;
    for (int32_t *r = &ch->next[l];; ++*r) {
      if (*r >= Nr && ch->own_phase[l]) break;
      if (*r >= Nr) ch->own_phase[l] = true, *r = -1; /* then row 0 */
      if (*r < 0 || !back_to(s, j, *r, l, c, ch->own_phase[l])) continue;
      unsigned char *rec = cpu_q_reserve(&ch->out[l], j->rec);
      if (!rec) break;
      memcpy(rec, (const unsigned char *)j->a->x + (size_t)*r * j->row, j->row);
      if (j->has_w)
        memcpy(rec + j->row, j->a->topk_weights + (size_t)*r * j->topk, (size_t)j->topk * 4);
      cpu_q_commit(&ch->out[l], j->rec);
      ch->bytes += j->rec;
      if (++n % BATCH == 0) cpu_q_publish(&ch->out[l]), cpu_ring_bell(s, l, c);
    }
    if (n % BATCH) cpu_q_publish(&ch->out[l]), cpu_ring_bell(s, l, c);
    moved += n;
  }
  return moved;
}

static bool sent_back(const cpu_state_t *s, const job_t *j, const chan_t *ch) {
  for (int l = 0; l < s->nranks; l++)
    if (l != s->rank && (!ch->own_phase[l] || ch->next[l] < j->p->flat->Nr)) return false;
  return true;
}

/* The partial of one entry, once every row of it is at hand. */
static void make_partial(const job_t *j, chan_t *ch, int nrows, const float *const *w,
                         unsigned char *dst) {
  if (nrows == 1)
    memcpy(dst, ch->rows[0], j->row);
  else
    cpu_reduce_partial((float *)dst, (const uint16_t *const *)ch->rows, nrows, j->H);
  if (!j->has_w) return;
  float *pw = (float *)(dst + (nrows == 1 ? j->row : 2 * j->row));
  for (int k = 0; k < j->topk; k++) {
    float acc = w[0][k];
    for (int i = 1; i < nrows; i++) acc += w[i][k];
    pw[k] = acc;
  }
}

/* Weights of token t: the hosts' partial weights in host order, each added to 0.0f as a stored
 * partial would be; part `mine` is this host's n rows (weights w, added in rank order). */
static void out_weights(const job_t *j, const chan_t *ch, int np, int mine, int n,
                        const float *const *w, int t) {
  for (int k = 0; k < j->topk; k++) {
    float acc = 0.0f;
    for (int i = 0, q = 0; i < np; i++) {
      if (i == mine) {
        float pw = w[0][k];
        for (int f = 1; f < n; f++) pw += w[f][k];
        acc += pw, q += n;
      } else {
        const unsigned char *part = ch->parts[q++];
        acc += ((const float *)(part + (ch->nrows[i] ? 1 : 2) * j->row))[k];
      }
    }
    j->a->out_topk_weights[(size_t)t * j->topk + k] = acc;
  }
}

/* Source and forwarder at once: the token of own entry e, whose n rows of this host are in
 * ch->rows, reduced if the other hosts' partials of it are here (false: not yet). */
static bool finish_token(const job_t *j, chan_t *ch, int32_t e, int n, const float *const *w) {
  const cpu_nplan_t *p = j->p;
  const ep_combine_args_t *a = j->a;
  int Hn = j->Hn, np = 0, q = 0, mine = 0;
  int t = p->hsend_idx[p->hsend_off[j->me] + e];
  for (int g = 0; g < Hn; g++) {
    if (g == j->me) {
      for (int f = 0; f < n; f++) ch->parts[q++] = ch->rows[f];
      mine = np;
      ch->nrows[np++] = n;
      continue;
    }
    int32_t nf = p->tok_nfan[(size_t)t * Hn + g], eg = p->tok_j[(size_t)t * Hn + g];
    if (!nf) continue;
    if (eg >= atomic_load_explicit(&j->ready[g], memory_order_acquire)) return false;
    ch->parts[q++] = j->sbase[g] + j->soff[p->hsend_off[g] + g + eg];
    ch->nrows[np++] = nf > 1 ? 0 : 1;
  }
  const uint16_t *b0 = a->bias[0] ? (const uint16_t *)a->bias[0] + (size_t)t * j->H : NULL;
  const uint16_t *b1 = a->bias[1] ? (const uint16_t *)a->bias[1] + (size_t)t * j->H : NULL;
  cpu_reduce_final((uint16_t *)a->out + (size_t)t * j->H, ch->parts, ch->nrows, np, b0, b1, j->H);
  if (j->has_w) out_weights(j, ch, np, mine, n, w, t);
  return true;
}

/* Forwarder: entries of this channel, block after block in the order bord (the receivers'
 * queues hold their rows in that order). */
static int forward(cpu_state_t *s, job_t *j, chan_t *ch, int c) {
  const cpu_nplan_t *p = j->p;
  int moved = 0, L = s->nranks;
  bool *touched = ch->touched;
  for (int l = 0; l < L; l++) touched[l] = false;
  while (ch->bi < j->Hn) {
    int b = j->bord[ch->bi];
    if (ch->e >= ch->e_end) {
      if (++ch->bi < j->Hn)
        cpu_chan_range(p->blk_base[j->bord[ch->bi] + 1] - p->blk_base[j->bord[ch->bi]], s->channels,
                       c, &ch->e, &ch->e_end);
      continue;
    }
    int32_t i = p->blk_base[b] + ch->e, n = p->fan_off[i + 1] - p->fan_off[i];
    const float *w[n > 0 ? n : 1];
    bool ready = true;
    for (int32_t f = 0; f < n && ready; f++) {
      int l = p->fan_l[p->fan_off[i] + f];
      int32_t row = p->fan_row[p->fan_off[i] + f];
      if (l == s->rank) {
        ch->rows[f] = (const unsigned char *)j->a->x + (size_t)row * j->row;
        w[f] = j->has_w ? j->a->topk_weights + (size_t)row * j->topk : NULL;
      } else {
        ready = (ch->rows[f] = cpu_q_peek(&ch->in[l], j->rec)) != NULL;
        w[f] = ready && j->has_w ? (const float *)(ch->rows[f] + j->row) : NULL;
      }
    }
    if (!ready) break;
    if (b == j->own) {
      if (!finish_token(j, ch, ch->e, n, w)) break;
    } else {
      make_partial(j, ch, n, w, j->pbase[b] + j->poff[i + b]);
    }
    for (int32_t f = 0; f < n; f++) {
      int l = p->fan_l[p->fan_off[i] + f];
      if (l != s->rank) cpu_q_consume(&ch->in[l], j->rec), touched[l] = true;
    }
    if (b != j->own) atomic_fetch_sub(&j->cleft[j->cx[b] + ch->e / j->ce], 1);
    ch->e++, moved++;
    if (moved % BATCH == 0)
      for (int l = 0; l < L; l++)
        if (touched[l]) cpu_q_release(&ch->in[l]), cpu_ring_bell(s, l, c), touched[l] = false;
  }
  for (int l = 0; l < L; l++)
    if (touched[l]) cpu_q_release(&ch->in[l]), cpu_ring_bell(s, l, c);
  /* Channel 0 posts the completed chunks; a channel reducing tokens may wait on own partials. */
  for (int c2 = 0; moved && c2 < s->channels; c2++)
    if (c2 != c) cpu_ring_bell(s, s->rank, c2);
  return moved;
}

/* Source: the tokens that went to no rank of this host (the others: finish_token), once their
 * partials are all here, reduced in host order. */
static int reduce_tokens(const job_t *j, chan_t *ch) {
  const cpu_nplan_t *p = j->p;
  const ep_combine_args_t *a = j->a;
  int moved = 0, Hn = j->Hn;
  for (; ch->t < ch->t_end; ch->t++) {
    int t = ch->t, n = 0;
    if (p->tok_nfan[(size_t)t * Hn + j->me]) continue;
    bool ready = true;
    for (int g = 0; g < Hn && ready; g++) {
      int32_t nf = p->tok_nfan[(size_t)t * Hn + g], e = p->tok_j[(size_t)t * Hn + g];
      if (!nf) continue;
      ready = e < atomic_load_explicit(&j->ready[g], memory_order_acquire);
      ch->parts[n] = j->sbase[g] + j->soff[p->hsend_off[g] + g + e];
      ch->nrows[n++] = nf > 1 ? 0 : 1;
    }
    if (!ready) break;
    const uint16_t *b0 = a->bias[0] ? (const uint16_t *)a->bias[0] + (size_t)t * j->H : NULL;
    const uint16_t *b1 = a->bias[1] ? (const uint16_t *)a->bias[1] + (size_t)t * j->H : NULL;
    cpu_reduce_final((uint16_t *)a->out + (size_t)t * j->H, ch->parts, ch->nrows, n, b0, b1, j->H);
    for (int k = 0; j->has_w && k < j->topk; k++) {
      float acc = 0.0f;
      for (int i = 0; i < n; i++)
        acc += ((const float *)((const unsigned char *)ch->parts[i] +
                                (ch->nrows[i] ? 1 : 2) * j->row))[k];
      a->out_topk_weights[(size_t)t * j->topk + k] = acc;
    }
    moved++;
  }
  return moved;
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
    bool net = false;
    if (c == 0 && (!moved || ep_now() >= next_net)) {
      moved = net_progress(s, j, &st);
      net = !st && net_busy(s, j, &st);
      next_net = ep_now() + NET_PERIOD_S;
    } else {
      moved = 0, net = c == 0;
    }
    if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_last_error());
    moved += send_back(s, j, ch, c) + forward(s, j, ch, c) + reduce_tokens(j, ch);
    bool local_done = sent_back(s, j, ch) && ch->bi >= j->Hn && ch->t >= ch->t_end;
    if (local_done && !net) return EP_OK;
    if (moved) continue;
    w.sleep_cap = net ? NET_SLEEP_S : 0.010;
    if ((st = cpu_wait(&w, seen, -1, "rows or partials of this combine"))) return st;
  }
}

static ep_status_t channel(cpu_state_t *s, void *arg, int c) {
  job_t *j = arg;
  int L = s->nranks;
  chan_t ch = {0};
  ch.out = calloc((size_t)L * 2, sizeof *ch.out);
  ch.rows = calloc((size_t)L + 1, sizeof *ch.rows);
  ch.parts = calloc((size_t)(j->Hn + L), sizeof *ch.parts);
  ch.nrows = calloc((size_t)j->Hn, sizeof *ch.nrows);
  ch.next = calloc((size_t)L, sizeof *ch.next);
  ch.touched = calloc((size_t)L * 2, sizeof *ch.touched);
  if (!ch.out || !ch.rows || !ch.parts || !ch.nrows || !ch.next || !ch.touched) {
    free(ch.out), free(ch.rows), free(ch.parts), free(ch.nrows), free(ch.next), free(ch.touched);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "data", "out of memory");
  }
  ch.in = ch.out + L;
  ch.own_phase = ch.touched + L;
  for (int l = 0; l < L; l++) {
    if (l == s->rank) continue;
    cpu_q_open_send(&ch.out[l], cpu_ring(s, l, s->rank, c), s->queue_bytes);
    cpu_q_open_recv(&ch.in[l], cpu_ring(s, s->rank, l, c), s->queue_bytes);
  }
  int b0 = j->bord[0];
  cpu_chan_range(j->p->blk_base[b0 + 1] - j->p->blk_base[b0], s->channels, c, &ch.e, &ch.e_end);
  cpu_chan_range(j->N, s->channels, c, &ch.t, &ch.t_end);
  ep_status_t st = loop(s, j, &ch, c);
  if (st && st != EP_ERR_INTERNAL) cpu_abort_peers(s, st);
  atomic_fetch_add(&s->net->local_bytes, ch.bytes);
  free(ch.out), free(ch.rows), free(ch.parts), free(ch.nrows), free(ch.next), free(ch.touched);
  return st;
}

/* ------------------------------------------------------------------ the call */

static void job_free(job_t *j) {
  free(j->pbase), free(j->poff), free(j->soff), free(j->cx), free(j->rx), free((void *)j->ready);
  free(j->x), free((void *)j->cleft), free((void *)j->cposted), free(j->bord);
}

static ep_status_t run(cpu_state_t *s, job_t *j) {
  const cpu_nplan_t *p = j->p;
  for (int b = 0; b < j->Hn; b++)
    if (p->col[b] == s->grank) j->own = b;
  j->bord = malloc(sizeof(int) * (size_t)j->Hn);
  if (!j->bord) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "network", "out of memory");
  for (int b = 0, k = 0; b < j->Hn; b++)
    if (b != j->own) j->bord[k++] = b;
  j->bord[j->Hn - 1] = j->own;
  size_t full = 2 * j->row + j->wb;
  j->ce = (int32_t)(s->net->chunk / full > 0 ? s->net->chunk / full : 1);
  ep_status_t st = plan_partials(s, j);
  if (!st) st = plan_network(s, j);
  if (!st) st = cpu_run_channels(s, channel, j);
  if (st && j->x) s->net->e->cancel(s->net->normal, j->x, j->nx);
  return st;
}

ep_status_t cpu_net_combine(cpu_state_t *s, const ep_combine_args_t *a, const ep_handle_info_t *h) {
  job_t j;
  memset(&j, 0, sizeof j);
  j.a = a, j.p = h->priv, j.H = h->hidden, j.topk = h->topk, j.N = h->num_tokens;
  j.Hn = s->topo->nhosts, j.me = s->topo->host, j.has_w = a->topk_weights != NULL;
  j.row = (size_t)j.H * 2;
  j.wb = j.has_w ? cpu_al16((size_t)j.topk * 4) : 0;
  j.rec = cpu_al16(j.row + (j.has_w ? (size_t)j.topk * 4 : 0));
  int32_t *words = calloc((size_t)s->net->cw, sizeof *words);
  if (!words) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "counts", "out of memory");
  ep_call_combine_key(a, h, (ep_call_key_t *)words);
  ep_status_t st = EP_OK;
  if (j.rec > s->queue_bytes / 2) {
    free(words);
    cpu_net_reject(s);
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "one row takes %zu bytes; "
                       "queue_bytes (%zu) must hold two",
                       j.rec, s->queue_bytes);
  }
  st = cpu_net_counts(s, words, OP);
  free(words);
  if (!st) st = run(s, &j);
  s->seq++;
  job_free(&j);
  return st;
}
