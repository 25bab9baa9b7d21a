/* The data phase of dispatch for one channel: push this rank's rows into every peer's queue,
 * pull every peer's rows into the outputs, each at its final row, in one pass. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dispatch.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define EP_NT 1
#endif

#define BATCH 32 /* records between two publications of a queue position */

typedef struct {
  cpu_q_t q;
  int32_t next, end; /* send: index into the plan's list; recv: rows taken / expected */
  int32_t base;      /* recv: output row of the first record */
} peer_t;

/* Token t's record: source index, payload, scales, global expert ids, weights. */
static void pack(const cpu_dispatch_job_t *j, int32_t t, unsigned char *rec) {
  const ep_dispatch_args_t *a = j->a;
  memcpy(rec, &t, sizeof t);
  memcpy(rec + j->off_x, (const unsigned char *)a->x + (size_t)t * j->row, j->row);
  if (j->scales) {
    float *sc = (float *)(rec + j->off_s);
    for (int i = 0; i < a->num_scales; i++)
      sc[i] = a->x_scales[t * a->scale_token_stride + i * a->scale_hidden_stride];
  }
  if (j->cached) return;
  memcpy(rec + j->off_i, a->topk_idx + (size_t)t * j->topk, (size_t)j->topk * sizeof(int64_t));
  if (j->has_w)
    memcpy(rec + j->off_w, a->topk_weights + (size_t)t * j->topk, (size_t)j->topk * sizeof(float));
}

/* A payload row into the caller's output. Outputs far larger than the caches are written with
 * non-temporal stores: no read-for-ownership of lines that are overwritten whole, and the queue
 * lines stay in cache (an sfence at the end of the channel orders them). */
static inline void put_row(const cpu_dispatch_job_t *j, void *dst, const void *src) {
#ifdef EP_NT
  if (j->stream && ((uintptr_t)dst & 15) == 0 && (j->row & 63) == 0) {
    __m128i *d = dst;
    const __m128i *s = src;
    for (size_t i = 0; i < j->row / 16; i += 4) {
      __m128i a = _mm_loadu_si128(s + i), b = _mm_loadu_si128(s + i + 1);
      __m128i c = _mm_loadu_si128(s + i + 2), e = _mm_loadu_si128(s + i + 3);
      _mm_stream_si128(d + i, a), _mm_stream_si128(d + i + 1, b);
      _mm_stream_si128(d + i + 2, c), _mm_stream_si128(d + i + 3, e);
    }
    return;
  }
#endif
  memcpy(dst, src, j->row);
}

/* Local expert ids and weights of output row r from a token's global ids (w: NULL = none). */
static void deliver_ids(const cpu_dispatch_job_t *j, int32_t r, const int64_t *ids,
                        const float *w) {
  for (int k = 0; k < j->topk; k++) {
    int64_t e = ids[k] - j->first_expert;
    bool local = ids[k] >= 0 && e >= 0 && e < j->num_local;
    if (j->o->recv_topk_idx) j->o->recv_topk_idx[(size_t)r * j->topk + k] = local ? e : -1;
    if (j->o->recv_topk_weights)
      j->o->recv_topk_weights[(size_t)r * j->topk + k] = local && w ? w[k] : 0.0f;
  }
}

/* Output row `r` from a packed record. */
static void unpack(const cpu_dispatch_job_t *j, const unsigned char *rec, int32_t r) {
  const ep_dispatch_args_t *a = j->a;
  if (j->drain) return;
  put_row(j, (unsigned char *)j->o->recv_x + (size_t)r * j->row, rec + j->off_x);
  if (j->scales) memcpy(j->o->recv_x_scales + (size_t)r * a->num_scales, rec + j->off_s, j->scales);
  if (j->o->recv_src_idx) memcpy(&j->o->recv_src_idx[r], rec, sizeof(int32_t));
  if (j->cached) return;
  deliver_ids(j, r, (const int64_t *)(rec + j->off_i),
              j->has_w ? (const float *)(rec + j->off_w) : NULL);
}

/* This rank's own tokens skip the queue: one copy, straight from x to their output rows. */
static void copy_self(cpu_state_t *s, const cpu_dispatch_job_t *j, int c) {
  const cpu_plan_t *p = j->p;
  const ep_dispatch_args_t *a = j->a;
  int me = s->rank;
  const int32_t *chan = p->send_chan + (size_t)me * (size_t)(s->channels + 1);
  int32_t row = p->recv_base[(size_t)me * s->channels + c];
  if (j->drain) return;
  for (int32_t i = chan[c]; i < chan[c + 1]; i++, row++) {
    int32_t t = p->send_idx[p->send_off[me] + i];
    put_row(j, (unsigned char *)j->o->recv_x + (size_t)row * j->row,
            (const unsigned char *)a->x + (size_t)t * j->row);
    for (int q = 0; j->scales && q < a->num_scales; q++)
      j->o->recv_x_scales[(size_t)row * a->num_scales + q] =
          a->x_scales[t * a->scale_token_stride + q * a->scale_hidden_stride];
    if (j->o->recv_src_idx) j->o->recv_src_idx[row] = t;
    if (!j->cached)
      deliver_ids(j, row, a->topk_idx + (size_t)t * j->topk,
                  j->has_w ? a->topk_weights + (size_t)t * j->topk : NULL);
  }
}

static int push(cpu_state_t *s, const cpu_dispatch_job_t *j, peer_t *pe, int d, int c) {
  int n = 0;
  const int32_t *list = j->p->send_idx + j->p->send_off[d];
  while (pe->next < pe->end) {
    unsigned char *rec = cpu_q_reserve(&pe->q, j->rec);
    if (!rec) break;
    pack(j, list[pe->next++], rec);
    cpu_q_commit(&pe->q, j->rec);
    if (++n % BATCH == 0) cpu_q_publish(&pe->q), cpu_ring_bell(s, d, c);
  }
  if (n % BATCH) cpu_q_publish(&pe->q), cpu_ring_bell(s, d, c);
  return n;
}

static int pull(cpu_state_t *s, const cpu_dispatch_job_t *j, peer_t *pe, int src, int c) {
  int n = 0;
  while (pe->next < pe->end) {
    const unsigned char *rec = cpu_q_peek(&pe->q, j->rec);
    if (!rec) break;
    unpack(j, rec, pe->base + pe->next++);
    cpu_q_consume(&pe->q, j->rec);
    if (++n % BATCH == 0) cpu_q_release(&pe->q), cpu_ring_bell(s, src, c);
  }
  if (n % BATCH) cpu_q_release(&pe->q), cpu_ring_bell(s, src, c);
  return n;
}

static void open_peers(cpu_state_t *s, const cpu_dispatch_job_t *j, int c, peer_t *out,
                       peer_t *in) {
  const cpu_plan_t *p = j->p;
  for (int r = 0; r < s->nranks; r++) {
    if (r == s->rank) continue;
    const int32_t *chan = p->send_chan + (size_t)r * (size_t)(s->channels + 1);
    cpu_q_open_send(&out[r].q, cpu_ring(s, r, s->rank, c), s->queue_bytes);
    out[r].next = chan[c];
    out[r].end = chan[c + 1];
    cpu_q_open_recv(&in[r].q, cpu_ring(s, s->rank, r, c), s->queue_bytes);
    in[r].next = 0;
    in[r].end = p->recv_cnt[(size_t)r * s->channels + c];
    in[r].base = p->recv_base[(size_t)r * s->channels + c];
  }
}

/* Whom we are waiting for, for the timeout message. */
static int laggard(cpu_state_t *s, const peer_t *out, const peer_t *in, char *what, size_t n) {
  for (int r = 0; r < s->nranks; r++) {
    if (r == s->rank) continue;
    if (in[r].next < in[r].end) {
      snprintf(what, n, "received %d of %d rows", in[r].next, in[r].end);
      return r;
    }
    if (out[r].next < out[r].end) {
      snprintf(what, n, "its queue is full; %d rows left to send", out[r].end - out[r].next);
      return r;
    }
  }
  snprintf(what, n, "nothing");
  return -1;
}

static ep_status_t loop(cpu_state_t *s, const cpu_dispatch_job_t *j, int c, peer_t *out,
                        peer_t *in) {
  cpu_waiter_t w;
  cpu_waiter_init(&w, s, c, "ep_dispatch", "data");
  for (;;) {
    uint32_t seen = cpu_bell_read(s, c);
    int moved = 0, left = 0;
    for (int r = 0; r < s->nranks; r++) {
      if (r == s->rank) continue;
      moved += push(s, j, &out[r], r, c) + pull(s, j, &in[r], r, c);
      left += (out[r].next < out[r].end) + (in[r].next < in[r].end);
    }
    if (!left) return EP_OK;
    if (moved) continue;
    char what[96];
    int who = laggard(s, out, in, what, sizeof what);
    ep_status_t st = cpu_wait(&w, seen, cpu_grank(s, who), what);
    if (st) return st;
  }
}

ep_status_t cpu_dispatch_channel(cpu_state_t *s, void *job, int c) {
  const cpu_dispatch_job_t *j = job;
  peer_t *out = calloc((size_t)s->nranks * 2, sizeof *out);
  if (!out) {
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_dispatch", "data", "out of memory");
  }
  peer_t *in = out + s->nranks;
  open_peers(s, j, c, out, in);
  copy_self(s, j, c);
  ep_status_t st = loop(s, j, c, out, in);
#ifdef EP_NT
  _mm_sfence(); /* the non-temporal row stores, before the caller sees the call complete */
#endif
  if (st && st != EP_ERR_INTERNAL) cpu_abort_peers(s, st);
  free(out);
  return st;
}
