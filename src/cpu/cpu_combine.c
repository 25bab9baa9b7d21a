/* Normal-mode combine (SEMANTICS.md §4): every rank sends each received row back to its source; the
 * source reduces, per token, bias0 + bias1 + the rows of every rank it went to (ascending rank),
 * in fp32, and rounds once to bf16. Rows arrive in token order per (rank, channel), so the
 * reduction streams: no fp32 staging tensor, one write of the output. */
#include <stdlib.h>
#include <string.h>

#include "cpu_net.h"
#include "cpu_plan.h"
#include "cpu_reduce.h"

static const char OP[] = "ep_combine";
#define BATCH 32

typedef struct {
  const ep_combine_args_t *a;
  const cpu_plan_t *p;
  int H, topk, N;
  bool has_w;
  bool stream;     /* out is far larger than the caches: non-temporal stores */
  size_t row, rec; /* bf16 row, record = row + weights */
} job_t;

typedef struct {
  cpu_q_t q;
  int32_t next, end, base; /* send: rows of (src, channel) in x; recv unused */
} peer_t;

static int push(cpu_state_t *s, const job_t *j, peer_t *pe, int src, int c) {
  int n = 0;
  while (pe->next < pe->end) {
    unsigned char *rec = cpu_q_reserve(&pe->q, j->rec);
    if (!rec) break;
    size_t r = (size_t)(pe->base + pe->next++);
    memcpy(rec, (const unsigned char *)j->a->x + r * j->row, j->row);
    if (j->has_w)
      memcpy(rec + j->row, j->a->topk_weights + r * (size_t)j->topk, (size_t)j->topk * 4);
    cpu_q_commit(&pe->q, j->rec);
    if (++n % BATCH == 0) cpu_q_publish(&pe->q), cpu_ring_bell(s, src, c);
  }
  if (n % BATCH) cpu_q_publish(&pe->q), cpu_ring_bell(s, src, c);
  return n;
}

/* Reduction state of one channel: the next token and where each source's rows come from. */
typedef struct {
  int t, end;
  int32_t self_row; /* next row of x that is this rank's own token */
  float *acc, *wacc;
  const unsigned char **src; /* [R] record (or x row) of the current token per rank */
} reduce_t;

static void reduce_token(const job_t *j, reduce_t *rd, const cpu_state_t *s, int t) {
  const ep_combine_args_t *a = j->a;
  const uint16_t *b0 = a->bias[0] ? (const uint16_t *)a->bias[0] + (size_t)t * j->H : NULL;
  const uint16_t *b1 = a->bias[1] ? (const uint16_t *)a->bias[1] + (size_t)t * j->H : NULL;
  const uint16_t *rows[s->nranks];
  int n = 0;
  for (int k = 0; k < j->topk && j->has_w; k++) rd->wacc[k] = 0.0f;
  for (int r = 0; r < s->nranks; r++) {
    const unsigned char *rec = rd->src[r];
    if (!rec) continue;
    rows[n++] = (const uint16_t *)rec;
    if (!j->has_w) continue;
    const float *w = r == s->rank ? a->topk_weights + (size_t)(rd->self_row - 1) * j->topk
                                  : (const float *)(rec + j->row);
    for (int k = 0; k < j->topk; k++) rd->wacc[k] += w[k];
  }
  cpu_reduce_rows((uint16_t *)a->out + (size_t)t * j->H, rows, n, b0, b1, j->H, j->stream);
  if (j->has_w) memcpy(a->out_topk_weights + (size_t)t * j->topk, rd->wacc, (size_t)j->topk * 4);
}

/* Reduce as many tokens as have all their rows; returns how many. */
static int reduce_ready(cpu_state_t *s, const job_t *j, reduce_t *rd, cpu_q_t *in, int c) {
  const uint8_t *in_rank = j->p->in_rank;
  int n = 0, R = s->nranks;
  bool touched[R];
  memset(touched, 0, sizeof touched);
  for (; rd->t < rd->end; rd->t++) {
    const uint8_t *m = in_rank + (size_t)rd->t * (size_t)R;
    bool ready = true;
    for (int r = 0; r < R && ready; r++) {
      rd->src[r] = NULL;
      if (!m[r]) continue;
      if (r == s->rank)
        rd->src[r] = (const unsigned char *)j->a->x + (size_t)rd->self_row * j->row;
      else
        ready = (rd->src[r] = cpu_q_peek(&in[r], j->rec)) != NULL;
    }
    if (!ready) break;
    if (m[s->rank]) rd->self_row++;
    reduce_token(j, rd, s, rd->t);
    for (int r = 0; r < R; r++)
      if (m[r] && r != s->rank) cpu_q_consume(&in[r], j->rec), touched[r] = true;
    if (++n % BATCH == 0)
      for (int r = 0; r < R; r++)
        if (touched[r]) cpu_q_release(&in[r]), cpu_ring_bell(s, r, c), touched[r] = false;
  }
  for (int r = 0; r < R; r++)
    if (touched[r]) cpu_q_release(&in[r]), cpu_ring_bell(s, r, c);
  return n;
}

static ep_status_t loop(cpu_state_t *s, const job_t *j, int c, peer_t *out, cpu_q_t *in,
                        reduce_t *rd) {
  cpu_waiter_t w;
  cpu_waiter_init(&w, s, c, OP, "data");
  for (;;) {
    uint32_t seen = cpu_bell_read(s, c);
    /* Rows for the peers first: they wait on them, while our own reduction can wait on us. */
    int moved = 0, left = 0, who = -1;
    for (int r = 0; r < s->nranks; r++) {
      if (r == s->rank) continue;
      moved += push(s, j, &out[r], r, c);
      if (out[r].next < out[r].end) left++, who = r;
    }
    moved += reduce_ready(s, j, rd, in, c);
    left += rd->t < rd->end;
    if (!left) return EP_OK;
    if (moved) continue;
    if (rd->t < rd->end) /* waiting for a row of token t: name the first rank that owes one */
      for (int r = 0; r < s->nranks; r++)
        if (r != s->rank && j->p->in_rank[(size_t)rd->t * s->nranks + r] &&
            !cpu_q_peek(&in[r], j->rec)) {
          who = r;
          break;
        }
    ep_status_t st =
        cpu_wait(&w, seen, cpu_grank(s, who), "rows to reduce, or room to send rows back");
    if (st) return st;
  }
}

static ep_status_t combine_channel(cpu_state_t *s, void *job, int c) {
  const job_t *j = job;
  const cpu_plan_t *p = j->p;
  int R = s->nranks;
  peer_t *out = calloc((size_t)R, sizeof *out);
  cpu_q_t *in = calloc((size_t)R, sizeof *in);
  reduce_t rd = {0};
  rd.acc = malloc(((size_t)j->topk + 1) * sizeof(float));
  rd.src = calloc((size_t)R, sizeof *rd.src);
  if (!out || !in || !rd.acc || !rd.src) {
    free(out), free(in), free(rd.acc), free(rd.src);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "data", "out of memory");
  }
  rd.wacc = rd.acc;
  cpu_chan_range(j->N, s->channels, c, &rd.t, &rd.end);
  rd.self_row = p->recv_base[(size_t)s->rank * s->channels + c];
  for (int r = 0; r < R; r++) {
    if (r == s->rank) continue;
    cpu_q_open_send(&out[r].q, cpu_ring(s, r, s->rank, c), s->queue_bytes);
    out[r].base = p->recv_base[(size_t)r * s->channels + c];
    out[r].end = p->recv_cnt[(size_t)r * s->channels + c];
    cpu_q_open_recv(&in[r], cpu_ring(s, s->rank, r, c), s->queue_bytes);
  }
  ep_status_t st = loop(s, j, c, out, in, &rd);
  cpu_reduce_fence(); /* the output's non-temporal stores, before the caller sees completion */
  if (st && st != EP_ERR_INTERNAL) cpu_abort_peers(s, st);
  free(out), free(in), free(rd.acc), free(rd.src);
  return st;
}

ep_status_t cpu_combine(void *state, const ep_combine_args_t *a, const ep_handle_info_t *h) {
  cpu_state_t *s = state;
  if (s->net) return cpu_net_combine(s, a, h);
  job_t j = {a, h->priv, h->hidden, h->topk, h->num_tokens, a->topk_weights != NULL, false, 0, 0};
  j.row = (size_t)j.H * 2;
  j.stream = (double)j.N * (double)j.row > 32.0 * 1024 * 1024; /* past 32 MiB: stream it */
  j.rec = cpu_al16(j.row + (j.has_w ? (size_t)j.topk * 4 : 0));
  cpu_hello_t mine;
  memset(&mine, 0, sizeof mine);
  ep_call_combine_key(a, h, &mine.key);
  ep_status_t st = EP_OK;
  if (j.rec > s->queue_bytes / 2) {
    cpu_reject(s);
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "one row takes %zu bytes; queue_bytes (%zu) must hold two", j.rec,
                       s->queue_bytes);
  }
  cpu_hello_post(s, &mine, NULL, NULL);
  st = cpu_hello_gather(s, &mine, OP);
  if (!st) st = cpu_run_channels(s, combine_channel, &j);
  s->seq++;
  return st;
}
