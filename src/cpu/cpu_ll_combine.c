/* Low-latency combine (SPEC §4): every expert rank copies the rows it holds back to their
 * source, into the combine area of the slot the source used for the dispatch, at (token, k);
 * the source reduces them in k order with one fused multiply-add per step. The send never waits
 * (protocol: cpu_ll.h). */
#include <string.h>

#include "cpu_ll.h"

static const char OP[] = "ep_ll_combine";

/* A combine may leave a slot out (-1) but not select anything the dispatch did not send. Keeps
 * the weights and the slots to reduce, so that two_phase callers need only keep `out`. */
static ep_status_t take_routing(cpu_ll_slot_t *sl, const ep_ll_combine_args_t *a) {
  size_t n = (size_t)sl->N * (size_t)sl->topk;
  for (size_t i = 0; i < n; i++) {
    int64_t id = a->topk_idx[i];
    if (id != -1 && id != sl->idx[i])
      return ep_err(EP_ERR_MISMATCH, "%s: topk_idx[%zu][%zu] is %lld but the dispatch had %lld "
                    "(a combine may only set slots to -1)", OP, i / (size_t)sl->topk,
                    i % (size_t)sl->topk, (long long)id, (long long)sl->idx[i]);
  }
  for (size_t i = 0; i < n; i++) {
    sl->use[i] = a->topk_idx[i] != -1;
    sl->w[i] = a->topk_weights[i];
  }
  return EP_OK;
}

/* Rows of every local expert from source `src` go back to src's area, at (token, k). */
static void send_back(cpu_state_t *s, const cpu_ll_slot_t *sl, const void *y, int src,
                      uint64_t ticket) {
  const cpu_ll_t *ll = s->ll;
  unsigned char *base = cpu_ll_slot_base(s, src, sl->src_slot[src]);
  unsigned char *area = base + ll->lay.area;
  const int64_t *range = (const int64_t *)(sl->base + ll->lay.range);
  const int32_t *tok = (const int32_t *)(sl->base + ll->lay.src);
  const int32_t *kk = (const int32_t *)(sl->base + ll->lay.route);
  size_t row = 2 * (size_t)ll->H;
  for (int l = 0; l < ll->L; l++) {
    int64_t rg = range[(size_t)l * ll->R + src];
    size_t r0 = (size_t)l * (size_t)ll->RT + (size_t)(rg >> 32);
    for (size_t r = r0; r < r0 + (size_t)(rg & 0xffffffff); r++)
      memcpy(area + ((size_t)tok[r] * (size_t)sl->topk + (size_t)kk[r]) * row,
             (const unsigned char *)y + r * row, row);
  }
  cpu_ll_post(s, src, cpu_ll_flag(base, ll->lay.comb, s->rank), ticket);
}

ep_status_t cpu_ll_combine(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h) {
  cpu_state_t *s = state;
  cpu_ll_t *ll = s->ll;
  cpu_ll_slot_t *sl = h->priv;
  cpu_call_begin(s);
  ep_status_t st = sl->state == LL_RECEIVED
                       ? take_routing(sl, a)
                       : ep_err(EP_ERR_INVALID_ARG, "%s: the handle cannot be combined: %s", OP,
                                cpu_ll_state_name(sl->state));
  if (st) {
    cpu_ll_reject(s, true);
    return st;
  }
  uint64_t ticket = ++ll->c;
  for (int i = 1; i <= s->nranks; i++) send_back(s, sl, a->y, (s->rank + i) % s->nranks, ticket);
  sl->ticket = ticket;
  sl->out = a->out;
  sl->state = LL_COMB_SENT;
  return a->two_phase ? EP_OK : cpu_ll_recv_combine(s, sl, OP);
}

static void reduce(const cpu_ll_t *ll, const cpu_ll_slot_t *sl) {
  const unsigned char *area = sl->base + ll->lay.area;
  size_t row = 2 * (size_t)ll->H;
  float w[EP_MAX_TOPK];
  for (int t = 0; t < sl->N; t++) {
    int n = 0;
    for (int k = 0; k < sl->topk; k++) {
      size_t i = (size_t)t * (size_t)sl->topk + (size_t)k;
      if (!sl->use[i]) continue;
      ll->rows[n] = (const uint16_t *)(area + i * row);
      w[n++] = sl->w[i];
    }
    ll->k.reduce(ll->rows, w, n, ll->H, (uint16_t *)sl->out + (size_t)t * ll->H);
  }
}

ep_status_t cpu_ll_recv_combine(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op) {
  ep_status_t st = cpu_ll_wait_flags(s, sl->index, s->ll->lay.comb, sl->ticket, true, op,
                                     "its rows of this low-latency combine");
  if (st) {
    sl->state = LL_FAILED;
    return st;
  }
  reduce(s->ll, sl);
  sl->state = LL_COMBINED;
  return EP_OK;
}
