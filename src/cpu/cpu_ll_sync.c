/* Signals of low-latency mode: entry records, the gate, sequence-numbered flags, rejections.
 * Every wait sleeps on the rank's bell 0 through cpu_wait, so it has the call's deadline, checks
 * peer liveness and abort words, and never burns a core for long (protocol: cpu_ll.h). */
#include <stdio.h>
#include <string.h>

#include "cpu_ll.h"

/* 1: rank r is ready, 0: not yet, -1: it gave up on the call, -2: it made another call than
 * this one (both reported by the caller). */
typedef int (*ready_fn)(cpu_state_t *s, int r, const void *arg);

/* *gave_up: the first rank that answered < 0 (-1: none), *how: its answer. */
static ep_status_t wait_each(cpu_state_t *s, ready_fn ready, const void *arg, const char *op,
                             const char *phase, const char *what, int *gave_up, int *how) {
  cpu_waiter_t w;
  bool armed = false;
  *gave_up = -1, *how = 0;
  for (int r = 0; r < s->nranks; r++) {
    for (;;) {
      uint32_t seen = cpu_bell_read(s, 0); /* before the check: no wake-up is lost */
      int ok = ready(s, r, arg);
      if (ok < 0) *gave_up = r, *how = ok;
      if (ok) break;
      if (!armed) cpu_waiter_init(&w, s, 0, op, phase), armed = true;
      ep_status_t st = cpu_wait(&w, seen, cpu_grank(s, r), what);
      if (st) {
        if (st != EP_ERR_INTERNAL) cpu_abort_peers(s, st);
        return st;
      }
    }
    if (*gave_up >= 0) return EP_OK;
  }
  return EP_OK;
}

static int entered(cpu_state_t *s, int r, const void *arg) {
  uint64_t q = *(const uint64_t *)arg;
  return atomic_load_explicit(&cpu_ll_arrive(s, r, q)->seq, memory_order_acquire) == q + 1;
}

static void ring_peers(cpu_state_t *s) {
  for (int r = 0; r < s->nranks; r++)
    if (r != s->rank) cpu_ring_bell(s, r, 0);
}

ep_status_t cpu_ll_enter(cpu_state_t *s, const cpu_ll_arrive_t *mine, const int32_t *sel,
                         const char *op) {
  cpu_ll_t *ll = s->ll;
  int gave_up, how;
  /* The record of call q-2 (same parity) may still be read by a rank that has not entered q-1. */
  if (ll->q > 0) {
    uint64_t prev = ll->q - 1;
    ep_status_t st = wait_each(s, entered, &prev, op, "enter",
                               "its entry into the previous low-latency dispatch", &gave_up, &how);
    if (st) return st;
  }
  cpu_ll_arrive_t *a = cpu_ll_arrive(s, s->rank, ll->q);
  a->status = mine->status, a->slot = mine->slot, a->topk = mine->topk, a->fmt = mine->fmt;
  a->num_tokens = mine->num_tokens;
  if (sel) memcpy(cpu_ll_sel(a), sel, sizeof(int32_t) * (size_t)ll->E);
  atomic_store_explicit(&a->seq, ll->q + 1, memory_order_release);
  ring_peers(s);
  return EP_OK;
}

const cpu_ll_arrive_t *cpu_ll_record(cpu_state_t *s, int r) {
  return s->net ? cpu_net_ll_record(s, r) : cpu_ll_arrive(s, r, s->ll->q);
}

/* Every rank reads the same records, so every rank reaches the same verdict. */
ep_status_t cpu_ll_verdict(cpu_state_t *s, const char *op) {
  int R = s->ll->R;
  for (int r = 0; r < R; r++)
    if (cpu_ll_record(s, r)->status == LL_REJECTED)
      return ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, op, "gate",
                         "rank %d rejected its arguments for this call (see its error)", r);
  const cpu_ll_arrive_t *a0 = cpu_ll_record(s, 0);
  for (int r = 1; r < R; r++) {
    const cpu_ll_arrive_t *a = cpu_ll_record(s, r);
    if (a->topk != a0->topk)
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "gate",
                         "topk is %d on rank 0 and %d on rank %d (must agree on all ranks)",
                         a0->topk, a->topk, r);
    if (a->fmt != a0->fmt)
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, op, "gate",
                         "use_fp8/round_scale/use_ue8m0/scale_layout are %d/%d/%d/%d on rank 0 "
                         "and %d/%d/%d/%d on rank %d (must agree on all ranks)",
                         a0->fmt & 1, (a0->fmt >> 1) & 1, (a0->fmt >> 2) & 1, (a0->fmt >> 3) & 1,
                         a->fmt & 1, (a->fmt >> 1) & 1, (a->fmt >> 2) & 1, (a->fmt >> 3) & 1, r);
  }
  return EP_OK;
}

ep_status_t cpu_ll_gate(cpu_state_t *s, const char *op) {
  int gave_up, how;
  uint64_t q = s->ll->q;
  ep_status_t st = wait_each(s, entered, &q, op, "gate", "its entry into this low-latency dispatch",
                             &gave_up, &how);
  return st ? st : cpu_ll_verdict(s, op);
}

typedef struct {
  int slot;
  size_t off;
  uint64_t want;
  bool combine;
} flag_arg_t;

/* r: a rank of this host (local index); flags are indexed by the writer's rank in the group. */
static int flag_ready(cpu_state_t *s, int r, const void *arg) {
  const flag_arg_t *f = arg;
  _Atomic uint64_t *flag =
      cpu_ll_flag(cpu_ll_slot_base(s, s->rank, f->slot), f->off, cpu_grank(s, r));
  if (atomic_load_explicit(flag, memory_order_acquire) == f->want) return 1;
  if (!f->combine) return 0; /* past its gate a dispatch sender always delivers */
  /* Its flag of this combine in another slot of ours: it combines the handle of another
   * dispatch (combine tickets are the same on every rank, and only this combine has this one). */
  for (int o = 0; o < CPU_LL_SLOTS; o++)
    if (o != f->slot &&
        atomic_load_explicit(cpu_ll_flag(cpu_ll_slot_base(s, s->rank, o), f->off, cpu_grank(s, r)),
                             memory_order_acquire) == f->want)
      return -2;
  /* A rejection of this combine or a later one; in the later case its flag for this one was
   * stored before that rejection, so the reload below sees it. */
  if (atomic_load_explicit(cpu_ll_creject(s, r), memory_order_acquire) < f->want) return 0;
  return atomic_load_explicit(flag, memory_order_acquire) == f->want ? 1 : -1;
}

ep_status_t cpu_ll_wait_flags(cpu_state_t *s, int slot, size_t off, uint64_t want, bool combine,
                              const char *op, const char *what) {
  flag_arg_t f = {slot, off, want, combine};
  int gave_up, how;
  ep_status_t st = wait_each(s, flag_ready, &f, op, "recv", what, &gave_up, &how);
  if (!st && gave_up >= 0 && how == -2)
    st = ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, cpu_grank(s, gave_up), op, "recv",
                     "rank %d combines the handle of another low-latency dispatch than this "
                     "rank: every rank must combine the same dispatch",
                     cpu_grank(s, gave_up));
  else if (!st && gave_up >= 0)
    st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, cpu_grank(s, gave_up), op, "recv",
                     "rank %d rejected its arguments for this combine (see its error)",
                     cpu_grank(s, gave_up));
  return st;
}

void cpu_ll_post(cpu_state_t *s, int dest, _Atomic uint64_t *flag, uint64_t v) {
  atomic_store_explicit(flag, v, memory_order_release);
  if (dest != s->rank) cpu_ring_bell(s, dest, 0);
}

/* The rejection itself is the call of this rank: it takes the call's number, like an accepted
 * one, so that the ranks keep counting alike. */
void cpu_ll_reject(void *state, bool combine) {
  cpu_state_t *s = state;
  cpu_ll_t *ll = s->ll;
  if (!ll) return;
  char why[512]; /* the caller's message is the one to keep */
  snprintf(why, sizeof why, "%s", ep_ctx_last_error());
  if (combine) {
    atomic_store_explicit(cpu_ll_creject(s, s->rank), ++ll->c, memory_order_release);
    ring_peers(s);
    if (s->net) cpu_net_ll_creject(s);
    ep_ctx_restore_error(why);
    return;
  }
  cpu_call_begin(s);
  cpu_ll_arrive_t mine;
  memset(&mine, 0, sizeof mine);
  mine.status = LL_REJECTED;
  mine.slot = -1;
  ep_status_t st = s->net ? cpu_net_ll_gate(s, &mine, NULL, "ep_ll_dispatch")
                          : cpu_ll_enter(s, &mine, NULL, "ep_ll_dispatch");
  if (st && st != EP_ERR_PEER_INVALID && st != EP_ERR_MISMATCH) ep_ctx_mark_broken(s->ctx);
  ll->q++;
  ep_ctx_restore_error(why);
}
