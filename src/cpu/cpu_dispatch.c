/* Normal-mode dispatch (SEMANTICS.md §3): route, hello (counts + cross-rank checks), outputs,
 * data. */
#include "cpu_dispatch.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_net.h"

static const char OP[] = "ep_dispatch";

/* Variable part of this rank's hello for destination d. */
static void fill_counts(cpu_state_t *s, cpu_hello_t *h, int d, void *arg) {
  const cpu_dispatch_job_t *j = arg;
  const cpu_plan_t *p = j->p;
  int32_t *to = cpu_hello_to_rank(h), *ch = cpu_hello_chan(s, h), *ex = cpu_hello_experts(s, h);
  for (int r = 0; r < s->nranks; r++) to[r] = p->send_off[r + 1] - p->send_off[r];
  const int32_t *sc = p->send_chan + (size_t)d * (size_t)(s->channels + 1);
  for (int c = 0; c < s->channels; c++) ch[c] = sc[c + 1] - sc[c];
  if (j->cached) return;
  memset(ex, 0, (size_t)j->num_local * sizeof *ex);
  const ep_dispatch_args_t *a = j->a;
  int lo = d * j->num_local;
  for (size_t i = 0; i < (size_t)a->num_tokens * (size_t)a->topk; i++) {
    int64_t e = a->topk_idx[i];
    if (e >= lo && e < lo + j->num_local) ex[e - lo]++;
  }
}

static void record_layout(cpu_dispatch_job_t *j, const ep_dispatch_args_t *a, int topk) {
  j->topk = topk;
  j->row = (size_t)a->hidden * ep_dtype_size(a->dtype);
  j->scales = a->dtype == EP_DTYPE_FP8_E4M3 ? (size_t)a->num_scales * sizeof(float) : 0;
  j->off_x = 16; /* int32 source index, padded */
  j->off_s = j->off_x + j->row;
  j->off_i = j->off_s + cpu_al16(j->scales);
  j->off_w = j->off_i + (j->cached ? 0 : cpu_al16((size_t)topk * sizeof(int64_t)));
  j->rec = j->off_w + (j->cached || !j->has_w ? 0 : cpu_al16((size_t)topk * sizeof(float)));
}

/* Receive side of the plan from everyone's hello. */
static void plan_recv_side(cpu_state_t *s, cpu_plan_t *p) {
  int R = s->nranks, C = s->channels;
  int32_t row = 0;
  for (int src = 0; src < R; src++) {
    cpu_hello_t *h = cpu_hello_from(s, src);
    const int32_t *to = cpu_hello_to_rank(h), *ch = cpu_hello_chan(s, h);
    for (int d = 0; d < R; d++)
      p->rank_prefix[(size_t)src * R + d] =
          to[d] + (src ? p->rank_prefix[(size_t)(src - 1) * R + d] : 0);
    for (int c = 0; c < C; c++) {
      p->recv_cnt[(size_t)src * C + c] = ch[c];
      p->recv_base[(size_t)src * C + c] = row;
      row += ch[c];
    }
  }
  p->Nr = row;
}

static void expert_counts(cpu_state_t *s, const cpu_dispatch_job_t *j, int align, int32_t *out) {
  for (int l = 0; l < j->num_local; l++) {
    int64_t n = 0;
    for (int src = 0; src < s->nranks; src++) n += cpu_hello_experts(s, cpu_hello_from(s, src))[l];
    if (align > 1) n = (n + align - 1) / align * align;
    out[l] = (int32_t)n;
  }
}

/* Rows past the receive count in the worst-case form: well defined, never garbage ids. */
static void fill_worst_tail(const ep_dispatch_out_t *o, int Nr, int topk) {
  for (int r = Nr; r < o->capacity; r++) {
    for (int k = 0; k < topk; k++) {
      if (o->recv_topk_idx) o->recv_topk_idx[(size_t)r * topk + k] = -1;
      if (o->recv_topk_weights) o->recv_topk_weights[(size_t)r * topk + k] = 0.0f;
    }
    if (o->recv_src_idx) o->recv_src_idx[r] = -1;
  }
}

static ep_status_t build_plan(cpu_state_t *s, const ep_dispatch_args_t *a, cpu_plan_t **out) {
  cpu_plan_t *p = cpu_plan_new(s->nranks, s->channels, a->num_tokens);
  if (!p)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "layout",
                       "out of memory for the "
                       "layout of num_tokens %d x %d ranks",
                       a->num_tokens, s->nranks);
  ep_status_t st = cpu_route(s, a->topk_idx, a->num_tokens, a->topk, a->num_experts, NULL, NULL,
                             p->in_rank, NULL, NULL, OP);
  if (st) {
    cpu_plan_free(p);
    return st;
  }
  cpu_plan_send_side(p);
  *out = p;
  return EP_OK;
}

static ep_status_t hello(cpu_state_t *s, cpu_dispatch_job_t *j, const ep_dispatch_call_t *c) {
  cpu_hello_t mine;
  memset(&mine, 0, sizeof mine);
  mine.key = c->key;
  cpu_hello_post(s, &mine, fill_counts, j);
  return cpu_hello_gather(s, &mine, OP);
}

static ep_status_t run(cpu_state_t *s, ep_dispatch_call_t *c, cpu_dispatch_job_t *j,
                       cpu_plan_t *p) {
  ep_status_t st = hello(s, j, c);
  if (st) return st;
  if (!j->cached) plan_recv_side(s, p);
  /* Outputs for Nr rows (the allocator is called here); if they cannot take them, the rows are
   * still received and dropped so that every queue stays consistent. */
  ep_status_t out_st = ep_call_outputs_ready(s->ctx, c, p->Nr, 0);
  j->drain = out_st != EP_OK;
  /* Past 32 MiB of rows the output cannot stay in cache anyway: stream it. */
  j->stream = (double)p->Nr * (double)j->row > 32.0 * 1024 * 1024;
  st = cpu_run_channels(s, cpu_dispatch_channel, j);
  if (st) return st;
  if (out_st) return out_st; /* data drained, queues consistent, outputs untouched */
  ep_dispatch_out_t *o = &c->out;
  if (o->worst_case) fill_worst_tail(o, p->Nr, j->topk);
  if (o->rank_prefix)
    memcpy(o->rank_prefix, p->rank_prefix, sizeof(int32_t) * (size_t)s->nranks * s->nranks);
  if (o->recv_tokens_per_expert && !j->cached)
    expert_counts(s, j, c->in.expert_alignment, o->recv_tokens_per_expert);
  o->num_recv_tokens = p->Nr;
  return EP_OK;
}

ep_status_t cpu_dispatch(void *state, ep_dispatch_call_t *c, ep_handle_info_t *out) {
  cpu_state_t *s = state;
  if (s->net) return cpu_net_dispatch(s, c, out);
  const ep_dispatch_args_t *a = &c->in;
  cpu_dispatch_job_t j;
  memset(&j, 0, sizeof j);
  j.a = a;
  j.o = &c->out;
  j.cached = c->cached != NULL;
  j.has_w = c->has_w;
  j.num_local = c->num_local;
  j.first_expert = s->rank * j.num_local;
  record_layout(&j, a, c->topk);
  if (j.rec > s->queue_bytes / 2) {
    cpu_reject(s);
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "one token takes %zu bytes; queue_bytes (%zu) must hold two: raise "
                       "queue_bytes",
                       j.rec, s->queue_bytes);
  }
  cpu_plan_t *p = j.cached ? c->cached->priv : NULL;
  ep_status_t st = j.cached ? EP_OK : build_plan(s, a, &p);
  if (st) {
    cpu_reject(s);
    return st;
  }
  j.p = p;
  st = run(s, c, &j, p);
  s->seq++;
  if (j.cached) return st;
  if (st) {
    cpu_plan_free(p);
    return st;
  }
  *out = ep_call_handle_info(c, p->Nr, p, cpu_plan_free);
  return EP_OK;
}
