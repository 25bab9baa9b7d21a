/* Low-latency dispatch (SEMANTICS.md §6.2-6.4): one row per (token, selected expert), written by
 * the sender straight into the receiver's expert-major slab, in a deterministic order (source
 * rank, then source token). Protocol and layout: cpu_ll.h. */
#include <string.h>

#include "cpu_ll.h"
#include "cpu_net.h"

static const char OP[] = "ep_ll_dispatch";

typedef struct {
  int parts; /* the work is split by token ranges (cpu_ll_run) */
  const ep_ll_dispatch_args_t *a;
  size_t row;    /* slab bytes of a row: 2H (bf16) or H (fp8) */
  size_t sbytes; /* bytes of a row's scales: 0, NS (ue8m0) or 4 NS */
  size_t stride; /* bytes of one token in the cast scratch */
} job_t;

/* Content checks, all before anything is posted; counts this rank's selections per expert. */
static ep_status_t check_ids(const cpu_ll_t *ll, const ep_ll_dispatch_args_t *a, int32_t *sel) {
  memset(sel, 0, sizeof(int32_t) * (size_t)ll->E);
  for (int t = 0; t < a->num_tokens; t++) {
    const int64_t *id = a->topk_idx + (size_t)t * (size_t)a->topk;
    for (int k = 0; k < a->topk; k++) {
      if (id[k] < -1 || id[k] >= ll->E) return ep_call_bad_expert(NULL, OP, t, k, id[k], ll->E);
      if (id[k] < 0) continue;
      /* The combine returns rows by (token, slot) and reduces them by slot: a token selecting an
       * expert twice would get one row for two slots. DeepEP leaves it undefined; we refuse. */
      for (int j = 0; j < k; j++)
        if (id[j] == id[k])
          return ep_err(EP_ERR_INVALID_ARG,
                        "%s: topk_idx[%d] selects expert %lld twice (slots "
                        "%d and %d); each expert at most once per token",
                        OP, t, (long long)id[k], j, k);
      sel[id[k]]++;
    }
  }
  return EP_OK;
}

static cpu_ll_slot_t *take_slot(cpu_ll_t *ll) {
  for (int i = 0; i < CPU_LL_SLOTS; i++)
    if (ll->slot[i].state == LL_FREE) return &ll->slot[i];
  return NULL; /* the core allows a dispatch only while a slot is free */
}

/* fp8: every token is cast once, whatever the number of experts it goes to, while the peers
 * are still entering the call. */
static ep_status_t cast_part(cpu_state_t *s, void *arg, int p) {
  const job_t *j = arg;
  const ep_ll_dispatch_args_t *a = j->a;
  const cpu_ll_t *ll = s->ll;
  int t0, t1;
  cpu_ll_part(a->num_tokens, j->parts, p, &t0, &t1);
  for (int t = t0; t < t1; t++) {
    unsigned char *o = ll->cast + (size_t)t * j->stride;
    ll->k.cast_row((const uint16_t *)a->x + (size_t)t * ll->H, ll->H, a->round_scale, a->use_ue8m0,
                   o, o + ll->H);
  }
  return EP_OK;
}

/* This rank's receive layout (the view) and the slot of every source, from the records. */
static int recv_layout(cpu_state_t *s, cpu_ll_slot_t *sl) {
  cpu_ll_t *ll = s->ll;
  int R = ll->R, L = ll->L, total = 0;
  int32_t *count = (int32_t *)(sl->base + ll->lay.count);
  int64_t *range = (int64_t *)(sl->base + ll->lay.range);
  for (int r = 0; r < R; r++) sl->src_slot[r] = cpu_ll_record(s, r)->slot;
  for (int l = 0; l < L; l++) {
    int e = s->grank * L + l;
    int64_t begin = 0;
    for (int r = 0; r < R; r++) {
      int64_t c = cpu_ll_sel((cpu_ll_arrive_t *)cpu_ll_record(s, r))[e];
      range[(size_t)l * R + r] = (begin << 32) | c;
      begin += c;
    }
    count[l] = (int32_t)begin;
    total += (int)begin;
  }
  return total;
}

/* Row of the first selection of every expert by tokens t0.. of this rank: after the lower
 * ranks' rows and this rank's earlier tokens. */
static void first_rows(cpu_state_t *s, const ep_ll_dispatch_args_t *a, int t0, int32_t *pos) {
  cpu_ll_t *ll = s->ll;
  memset(pos, 0, sizeof(int32_t) * (size_t)ll->E);
  for (int r = 0; r < s->grank; r++) {
    const int32_t *sel = cpu_ll_sel((cpu_ll_arrive_t *)cpu_ll_record(s, r));
    for (int e = 0; e < ll->E; e++) pos[e] += sel[e];
  }
  for (size_t i = 0; i < (size_t)t0 * (size_t)a->topk; i++)
    if (a->topk_idx[i] >= 0) pos[a->topk_idx[i]]++;
}

/* The scales of one row in the column-major layout (SEMANTICS.md §6.4): float [L][NS][RT], or
 * exponent bytes packed four to an int32 [L][NS/4][RT] (block 4j + i in byte i). */
void cpu_ll_put_cols(const cpu_ll_t *ll, unsigned char *scales, size_t le, size_t row,
                     const unsigned char *sc, int ue8m0) {
  size_t NS = (size_t)ll->NS, RT = (size_t)ll->RT;
  for (size_t b = 0; b < NS; b++) {
    if (ue8m0)
      scales[((le * (NS / 4) + b / 4) * RT + row) * 4 + b % 4] = sc[b];
    else
      memcpy(scales + ((le * NS + b) * RT + row) * 4, sc + 4 * b, 4);
  }
}

/* Rows of tokens t0..t1 for destination d (a rank of this host), at their final place in d's
 * slab. */
static void send_rows(cpu_state_t *s, const job_t *j, int d, int t0, int t1, int32_t *pos) {
  cpu_ll_t *ll = s->ll;
  const ep_ll_dispatch_args_t *a = j->a;
  unsigned char *base = cpu_ll_slot_base(s, cpu_ll_seg(s, d), cpu_ll_record(s, d)->slot);
  unsigned char *slab = base + ll->lay.slab;
  unsigned char *scales = slab + (size_t)ll->L * (size_t)ll->RT * (size_t)ll->H;
  int32_t *src = (int32_t *)(base + ll->lay.src), *route = (int32_t *)(base + ll->lay.route);
  int64_t lo = (int64_t)d * ll->L, hi = lo + ll->L;
  for (int t = t0; t < t1; t++) {
    const int64_t *id = a->topk_idx + (size_t)t * (size_t)a->topk;
    for (int k = 0; k < a->topk; k++) {
      if (id[k] < lo || id[k] >= hi) continue;
      size_t r = (size_t)(id[k] - lo) * (size_t)ll->RT + (size_t)pos[id[k]]++;
      if (a->use_fp8) {
        const unsigned char *c = ll->cast + (size_t)t * j->stride;
        memcpy(slab + r * j->row, c, j->row);
        if (a->scale_layout == EP_SCALES_COL_MAJOR)
          cpu_ll_put_cols(ll, scales, (size_t)(id[k] - lo), (size_t)(pos[id[k]] - 1), c + j->row,
                          a->use_ue8m0);
        else
          memcpy(scales + r * j->sbytes, c + j->row, j->sbytes);
      } else {
        memcpy(slab + r * j->row, (const unsigned char *)a->x + (size_t)t * j->row, j->row);
      }
      src[r] = t;
      route[r] = k;
    }
  }
}

/* Step 5, one token range. Peers first (their receive can complete sooner), this rank last. */
static ep_status_t send_part(cpu_state_t *s, void *arg, int p) {
  const job_t *j = arg;
  int t0, t1;
  int32_t *pos = s->ll->pos + (size_t)p * (size_t)s->ll->E;
  cpu_ll_part(j->a->num_tokens, j->parts, p, &t0, &t1);
  first_rows(s, j->a, t0, pos);
  for (int i = 1, R = s->ll->R; i <= R; i++) {
    int d = (s->grank + i) % R;
    if (cpu_ll_seg(s, d) >= 0) send_rows(s, j, d, t0, t1, pos); /* other hosts: cpu_net_ll.c */
  }
  return EP_OK;
}

/* Across hosts, ep_buffer_info_t.local_bytes_sent: the rows written to the other ranks of this
 * host (the rows to other hosts are the engine's, counted where they are sent). */
static void count_local(cpu_state_t *s, const job_t *j) {
  if (!s->net) return;
  const int32_t *sel = cpu_ll_sel((cpu_ll_arrive_t *)cpu_ll_record(s, s->grank));
  uint64_t rows = 0;
  for (int d = 0; d < s->gnranks; d++)
    if (d != s->grank && cpu_ll_seg(s, d) >= 0)
      for (int e = d * s->ll->L; e < (d + 1) * s->ll->L; e++) rows += (uint64_t)sel[e];
  atomic_fetch_add(&s->net->local_bytes, rows * (j->row + j->sbytes));
}

static ep_status_t send_all(cpu_state_t *s, cpu_ll_slot_t *sl, job_t *j, int nsel) {
  cpu_ll_t *ll = s->ll;
  cpu_ll_run(s, (size_t)nsel * (j->row + j->sbytes), &j->parts, send_part, j);
  count_local(s, j);
  for (int i = 1; i <= s->nranks; i++) { /* every part is done: raise the flags */
    int l = (s->rank + i) % s->nranks, d = cpu_grank(s, l);
    unsigned char *base = cpu_ll_slot_base(s, l, cpu_ll_record(s, d)->slot);
    cpu_ll_post(s, l, cpu_ll_flag(base, ll->lay.data, s->grank), ll->q + 1);
  }
  return s->net ? cpu_net_ll_send(s, sl, j->a, j->row, j->sbytes, j->stride) : EP_OK;
}

static void fill_info(const cpu_ll_t *ll, const ep_ll_dispatch_args_t *a, cpu_ll_slot_t *sl,
                      int nrecv, ep_handle_info_t *out) {
  memset(out, 0, sizeof *out);
  out->kind = EP_HANDLE_LL;
  out->num_tokens = a->num_tokens;
  out->num_recv_tokens = nrecv;
  out->recv_rows = ll->L * ll->RT;
  out->hidden = ll->H;
  out->topk = a->topk;
  out->num_experts = ll->E;
  out->dtype = a->use_fp8 ? EP_DTYPE_FP8_E4M3 : EP_DTYPE_BF16;
  out->num_scales = a->use_fp8 ? ll->NS : 0;
  out->priv = sl; /* the slot lives in the buffer's state: nothing to free with the handle */
}

static void keep_call(cpu_ll_slot_t *sl, const ep_ll_dispatch_args_t *a, uint64_t q) {
  sl->q = q;
  sl->N = a->num_tokens, sl->topk = a->topk;
  sl->fp8 = a->use_fp8, sl->round_scale = a->round_scale, sl->ue8m0 = a->use_ue8m0;
  sl->scale_layout = a->use_fp8 ? a->scale_layout : EP_SCALES_ROW_MAJOR;
  if (a->num_tokens) /* topk_idx may be NULL when there are no tokens */
    memcpy(sl->idx, a->topk_idx, sizeof(int64_t) * (size_t)a->num_tokens * (size_t)a->topk);
}

ep_status_t cpu_ll_dispatch(void *state, const ep_ll_dispatch_args_t *a, ep_handle_info_t *out) {
  cpu_state_t *s = state;
  cpu_ll_t *ll = s->ll;
  cpu_call_begin(s);
  cpu_ll_slot_t *sl = take_slot(ll);
  ep_status_t st =
      sl ? check_ids(ll, a, ll->sel) : ep_err(EP_ERR_INTERNAL, "%s: no free result slot", OP);
  if (st) {
    cpu_ll_reject(s, false);
    return st;
  }
  job_t j = {1, a, a->use_fp8 ? (size_t)ll->H : 2 * (size_t)ll->H,
             !a->use_fp8 ? 0 : (size_t)ll->NS * (a->use_ue8m0 ? 1 : 4), 0};
  j.stride = (size_t)ll->H + 4 * (size_t)ll->NS;
  cpu_ll_arrive_t mine = {.status = LL_ENTERED,
                          .slot = sl->index,
                          .topk = a->topk,
                          .fmt = a->use_fp8 | a->round_scale << 1 | a->use_ue8m0 << 2 |
                                 (a->use_fp8 && a->scale_layout == EP_SCALES_COL_MAJOR) << 3,
                          .num_tokens = a->num_tokens};
  int nsel = 0;
  for (int e = 0; e < ll->E; e++) nsel += ll->sel[e];
  /* Across hosts the records travel through the engine: one exchange is entry and gate. */
  st = s->net ? cpu_net_ll_gate(s, &mine, ll->sel, OP) : cpu_ll_enter(s, &mine, ll->sel, OP);
  if (!st && a->use_fp8)
    cpu_ll_run(s, (size_t)a->num_tokens * 3 * (size_t)ll->H, &j.parts, cast_part, &j);
  if (!st && !s->net) st = cpu_ll_gate(s, OP);
  int nrecv = 0;
  if (!st) {
    sl->state = LL_SENT;
    keep_call(sl, a, ll->q);
    nrecv = recv_layout(s, sl);
    st = send_all(s, sl, &j, nsel);
  }
  ll->q++;
  if (!st && !a->two_phase) st = cpu_ll_recv_dispatch(s, sl, OP);
  if (st) {
    sl->state = LL_FREE;
    return st;
  }
  fill_info(ll, a, sl, nrecv, out);
  return EP_OK;
}

ep_status_t cpu_ll_recv_dispatch(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op) {
  ep_status_t st = s->net ? cpu_net_ll_recv(s, sl, op) : EP_OK;
  if (!st)
    st = cpu_ll_wait_flags(s, sl->index, s->ll->lay.data, sl->q + 1, false, op,
                           "its rows of this low-latency dispatch");
  sl->state = st ? LL_FAILED : LL_RECEIVED;
  return st;
}
