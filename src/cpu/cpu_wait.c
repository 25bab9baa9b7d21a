/* Waiting without burning the cores other ranks need: spin briefly, then sleep on a futex in the
 * shared segment. Every wait is bounded by the call's deadline and checks, every few
 * milliseconds, whether a peer died (pidfd / launcher notice) or aborted the call. */
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cpu.h"

#define CHECK_PERIOD_S 0.002 /* liveness checks while waiting */
#define SLEEP_MAX_S 0.010    /* futex sleeps are cut short this often to re-check liveness */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, double secs) {
  struct timespec ts = {(time_t)secs, (long)((secs - (double)(time_t)secs) * 1e9)};
  /* Shared (not PRIVATE) futex: the word lives in memory mapped by several processes. */
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

void cpu_ring_bell(cpu_state_t *s, int rank, int ch) {
  cpu_bell_t *b = cpu_bell(s, rank, ch);
  atomic_fetch_add(&b->bell, 1);
  if (atomic_load(&b->sleepers) > 0) futex_wake(&b->bell);
}

void cpu_call_begin(cpu_state_t *s) {
  atomic_store(&s->local_abort, 0);
  atomic_store(&s->culprit, -1);
}

static void note_culprit(cpu_state_t *s, int rank) {
  int none = -1;
  atomic_compare_exchange_strong(&s->culprit, &none, rank);
}

void cpu_abort_peers(cpu_state_t *s, ep_status_t why) {
  int culprit = atomic_load(&s->culprit);
  uint64_t word = cpu_abort_pack(culprit, s->grank, why);
  /* Only when the launcher is this call's explanation: a channel that timed out on a peer first
   * named that peer, and the peers should hear of it. */
  if (atomic_load(&s->lost_launcher) && culprit == s->grank) word |= CPU_ABORT_LAUNCHER;
  for (int r = 0; r < s->nranks; r++) {
    if (r == s->rank) continue;
    uint64_t zero = 0;
    atomic_compare_exchange_strong(cpu_abort_word(s, r), &zero, word);
    for (int c = 0; c < s->channels; c++) cpu_ring_bell(s, r, c);
  }
}

void cpu_waiter_init(cpu_waiter_t *w, cpu_state_t *s, int channel, const char *op,
                     const char *phase) {
  w->s = s;
  w->channel = channel;
  w->deadline = ep_now() + ep_ctx_timeout(s->ctx);
  w->next_check = 0;
  w->sleep_cap = SLEEP_MAX_S;
  w->op = op;
  w->phase = phase;
}

/* A peer gave up on this call: fail the same way, naming the rank at fault (not just the one
 * that noticed first), so every rank's message points at the same culprit. */
static ep_status_t peer_aborted(cpu_waiter_t *w, uint64_t ab) {
  cpu_state_t *s = w->s;
  int culprit = cpu_abort_culprit(ab), reporter = cpu_abort_reporter(ab);
  ep_status_t why = cpu_abort_why(ab);
  ep_status_t st = why == EP_ERR_TIMEOUT ? EP_ERR_TIMEOUT : EP_ERR_PEER_FAILED;
  note_culprit(s, culprit >= 0 ? culprit : reporter);
  if (ab & CPU_ABORT_LAUNCHER)
    return ep_ctx_fail(s->ctx, st, reporter, w->op, w->phase,
                       "rank %d lost its launcher (epcomm launch died) and gave up on "
                       "this call",
                       reporter);
  if (culprit == s->grank)
    return ep_ctx_fail(s->ctx, st, reporter, w->op, w->phase,
                       "this rank came too late: rank %d "
                       "gave up on the call (%s) before it arrived",
                       reporter, ep_status_name(why));
  if (culprit >= 0 && culprit != reporter && why == EP_ERR_TIMEOUT)
    return ep_ctx_fail(s->ctx, st, culprit, w->op, w->phase,
                       "rank %d did not answer within the "
                       "deadline (reported by rank %d)",
                       culprit, reporter);
  if (culprit >= 0 && culprit != reporter)
    return ep_ctx_fail(s->ctx, st, culprit, w->op, w->phase,
                       "rank %d failed this call (%s, "
                       "reported by rank %d)",
                       culprit, ep_status_name(why), reporter);
  return ep_ctx_fail(s->ctx, st, reporter, w->op, w->phase, "rank %d gave up on this call (%s)",
                     reporter, ep_status_name(why));
}

/* Peer death, a peer's abort, or a sibling channel's failure: the reasons to stop early. A dead
 * peer is checked first: it is the better explanation when both are true. */
static ep_status_t check_world(cpu_waiter_t *w) {
  cpu_state_t *s = w->s;
  if (atomic_load(&s->local_abort)) return EP_ERR_INTERNAL; /* reported by the failing channel */
  /* Except when the peers' verdict is that this rank came too late (it was stopped, say): they
   * may have left since, and their exit is the consequence, not the cause. */
  uint64_t ab = atomic_load(cpu_abort_word(s, s->rank));
  if (ab && cpu_abort_culprit(ab) == s->grank) return peer_aborted(w, ab);
  int dead;
  const char *how;
  if (ep_ctx_check_peers(s->ctx, &dead, &how) != EP_OK) {
    /* A peer that gave up on this call may leave before this rank looks: its exit follows its
     * verdict, which names the rank really at fault (the verdict is written before it exits).
     * After a lost launcher every rank gives up and leaves: any exit is that verdict's sequel. */
    ab = atomic_load(cpu_abort_word(s, s->rank));
    if (ab && (cpu_abort_reporter(ab) == dead ||
               ((ab & CPU_ABORT_LAUNCHER) && !ep_ctx_lost_launcher(s->ctx))))
      return peer_aborted(w, ab);
    note_culprit(s, dead);
    if (dead == s->grank && ep_ctx_lost_launcher(s->ctx)) atomic_store(&s->lost_launcher, 1);
    return ep_ctx_fail(s->ctx, EP_ERR_PEER_FAILED, dead, w->op, w->phase, "rank %d %s", dead, how);
  }
  ab = atomic_load(cpu_abort_word(s, s->rank));
  return ab ? peer_aborted(w, ab) : EP_OK;
}

ep_status_t cpu_wait(cpu_waiter_t *w, uint32_t seen, int waiting_for, const char *what) {
  cpu_state_t *s = w->s;
  cpu_bell_t *b = cpu_bell(s, s->rank, w->channel);
  double now = ep_now();
  if (now >= w->next_check) {
    w->next_check = now + CHECK_PERIOD_S;
    ep_status_t st = check_world(w);
    if (st) return st;
    if (now >= w->deadline) {
      note_culprit(s, waiting_for);
      return ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, waiting_for, w->op, w->phase,
                         "deadline of %.1f s passed waiting for rank %d (%s)",
                         ep_ctx_timeout(s->ctx), waiting_for, what);
    }
  }
  /* Spin: the common case on idle cores is that the peer answers within microseconds. */
  double spin_end = now + s->spin_s;
  for (int i = 0;; i++) {
    if (atomic_load_explicit(&b->bell, memory_order_acquire) != seen) return EP_OK;
    if ((i & 63) == 63) {
      if (ep_now() >= spin_end) break;
      sched_yield(); /* let a rank that shares our core run */
    }
    cpu_relax();
  }
  atomic_fetch_add(&b->sleepers, 1);
  if (atomic_load(&b->bell) == seen) {
    double left = w->deadline - ep_now();
    futex_wait(&b->bell, seen, left < w->sleep_cap ? (left > 0 ? left : 0) : w->sleep_cap);
  }
  atomic_fetch_sub(&b->sleepers, 1);
  return EP_OK;
}
