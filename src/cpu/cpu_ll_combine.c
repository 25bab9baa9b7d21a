/* Low-latency combine (SEMANTICS.md §6.5): every expert rank copies the rows it holds back to their
 * source, into the combine area of the slot the source used for the dispatch, at (token, k);
 * the source reduces them in k order with one fused multiply-add per step. The send never waits
 * (protocol: cpu_ll.h). */
#include <string.h>

#include "cpu_ll.h"
#include "cpu_net.h"

static const char OP[] = "ep_ll_combine";

/* A combine may leave a slot out (-1) but not select anything the dispatch did not send. Keeps
 * the weights and the slots to reduce, so that two_phase callers need only keep `out`. */
static ep_status_t take_routing(cpu_ll_slot_t *sl, const ep_ll_combine_args_t *a) {
  size_t n = (size_t)sl->N * (size_t)sl->topk;
  for (size_t i = 0; i < n; i++) {
    int64_t id = a->topk_idx[i];
    if (id != -1 && id != sl->idx[i])
      return ep_err(EP_ERR_MISMATCH,
                    "%s: topk_idx[%zu][%zu] is %lld but the dispatch had %lld "
                    "(a combine may only set slots to -1)",
                    OP, i / (size_t)sl->topk, i % (size_t)sl->topk, (long long)id,
                    (long long)sl->idx[i]);
  }
  for (size_t i = 0; i < n; i++) {
    sl->use[i] = a->topk_idx[i] != -1;
    sl->w[i] = a->topk_weights[i];
  }
  return EP_OK;
}

typedef struct {
  int parts; /* send: split by received rows; reduce: by tokens (cpu_ll_run) */
  const cpu_ll_slot_t *sl;
  const void *y;
} job_t;

/* Received rows f0..f1 (in view order: expert, then row) go back to their sources' areas, at
 * (token, k), in the slot each source used for the dispatch. */
static ep_status_t back_part(cpu_state_t *s, void *arg, int p) {
  const job_t *j = arg;
  const cpu_ll_t *ll = s->ll;
  const cpu_ll_slot_t *sl = j->sl;
  const int32_t *count = (const int32_t *)(sl->base + ll->lay.count);
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  const int32_t *tok = (const int32_t *)(sl->base + ll->lay.src);
  const int32_t *kk = (const int32_t *)(sl->base + ll->lay.route);
  size_t row = 2 * (size_t)ll->H;
  int total = 0, f0, f1;
  for (int l = 0; l < ll->L; l++) total += count[l];
  cpu_ll_part(total, j->parts, p, &f0, &f1);
  for (int l = 0, f = 0; l < ll->L && f < f1; f += count[l], l++) {
    for (int src = 0; src < ll->R; src++) {
      if (cpu_ll_seg(s, src) < 0) continue; /* another host: cpu_net_ll_csend */
      int64_t rg = range[(size_t)l * ll->R + src];
      int b = (int)(rg >> 32), n = (int)(rg & 0xffffffff);
      int lo = f + b > f0 ? f + b : f0, hi = f + b + n < f1 ? f + b + n : f1;
      unsigned char *area =
          cpu_ll_slot_base(s, cpu_ll_seg(s, src), sl->src_slot[src]) + ll->lay.area;
      for (size_t r = (size_t)l * (size_t)ll->RT + (size_t)(lo - f); lo < hi; lo++, r++)
        memcpy(area + ((size_t)tok[r] * (size_t)sl->topk + (size_t)kk[r]) * row,
               (const unsigned char *)j->y + r * row, row);
    }
  }
  return EP_OK;
}

/* Across hosts, ep_buffer_info_t.local_bytes_sent: the rows given back to the other ranks of this
 * host (view order: expert l's rows from source src are range[l][src]). */
static void count_local(cpu_state_t *s, const cpu_ll_slot_t *sl) {
  if (!s->net) return;
  const cpu_ll_t *ll = s->ll;
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  uint64_t rows = 0;
  for (int src = 0; src < ll->R; src++)
    if (src != s->grank && cpu_ll_seg(s, src) >= 0)
      for (int l = 0; l < ll->L; l++)
        rows += (uint64_t)(range[(size_t)l * ll->R + src] & 0xffffffff);
  atomic_fetch_add(&s->net->local_bytes, rows * 2 * (uint64_t)ll->H);
}

static ep_status_t send_back(cpu_state_t *s, cpu_ll_slot_t *sl, const void *y, int nrecv,
                             uint64_t ticket) {
  const cpu_ll_t *ll = s->ll;
  job_t j = {1, sl, y};
  count_local(s, sl);
  cpu_ll_run(s, (size_t)nrecv * 2 * (size_t)ll->H, &j.parts, back_part, &j);
  for (int i = 1; i <= s->nranks; i++) { /* every part is done: raise the flags */
    int l = (s->rank + i) % s->nranks, src = cpu_grank(s, l);
    unsigned char *base = cpu_ll_slot_base(s, l, sl->src_slot[src]);
    cpu_ll_post(s, l, cpu_ll_flag(base, ll->lay.comb, s->grank), ticket);
  }
  return s->net ? cpu_net_ll_csend(s, sl, y) : EP_OK;
}

ep_status_t cpu_ll_combine(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h) {
  cpu_state_t *s = state;
  cpu_ll_t *ll = s->ll;
  cpu_ll_slot_t *sl = h->priv;
  cpu_call_begin(s);
  ep_status_t st = sl->state == LL_RECEIVED
                       ? take_routing(sl, a)
                       : ep_err(EP_ERR_INVALID_ARG, "%s: the handle cannot be combined: %s", OP,
                                ep_ll_state_why(sl->state));
  if (st) {
    cpu_ll_reject(s, true);
    return st;
  }
  uint64_t ticket = ++ll->c;
  sl->ticket = ticket;
  st = send_back(s, sl, a->y, h->num_recv_tokens, ticket);
  if (st) {
    sl->state = LL_FAILED;
    return st;
  }
  sl->out = a->out;
  sl->state = LL_COMB_SENT;
  return a->two_phase ? EP_OK : cpu_ll_recv_combine(s, sl, OP);
}

static ep_status_t reduce_part(cpu_state_t *s, void *arg, int p) {
  const job_t *j = arg;
  const cpu_ll_t *ll = s->ll;
  const cpu_ll_slot_t *sl = j->sl;
  const unsigned char *area = sl->base + ll->lay.area;
  const uint16_t **rows = ll->rows + (size_t)p * (size_t)ll->K;
  size_t row = 2 * (size_t)ll->H;
  float w[EP_MAX_TOPK];
  int t0, t1;
  cpu_ll_part(sl->N, j->parts, p, &t0, &t1);
  for (int t = t0; t < t1; t++) {
    int n = 0;
    for (int k = 0; k < sl->topk; k++) {
      size_t i = (size_t)t * (size_t)sl->topk + (size_t)k;
      if (!sl->use[i]) continue;
      rows[n] = (const uint16_t *)(area + i * row);
      w[n++] = sl->w[i];
    }
    ll->k.reduce(rows, w, n, ll->H, (uint16_t *)sl->out + (size_t)t * ll->H);
  }
  return EP_OK;
}

ep_status_t cpu_ll_recv_combine(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op) {
  ep_status_t st = s->net ? cpu_net_ll_crecv(s, sl, op) : EP_OK;
  if (!st)
    st = cpu_ll_wait_flags(s, sl->index, s->ll->lay.comb, sl->ticket, true, op,
                           "its rows of this low-latency combine");
  if (st) {
    sl->state = LL_FAILED;
    return st;
  }
  job_t j = {1, sl, NULL};
  cpu_ll_run(s, (size_t)sl->N * (size_t)sl->topk * 2 * (size_t)s->ll->H, &j.parts, reduce_part, &j);
  sl->state = LL_COMBINED;
  return EP_OK;
}
