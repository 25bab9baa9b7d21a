/* The hello phase that opens every normal-mode call: each rank posts what its call is (the core's
 * call key) and, for a dispatch, its counts into every peer's segment, then waits for all peers'
 * posts. Ranks that disagree about the call, or a rank that rejected its arguments, make *every*
 * rank fail the call the same way, before any payload moves; the queues stay consistent and usable.
 */
#include <stdio.h>
#include <string.h>

#include "cpu.h"
#include "cpu_net.h"

static int parity(const cpu_state_t *s) {
  return (int)(s->seq & 1);
}

cpu_hello_t *cpu_hello_from(cpu_state_t *s, int src) {
  return cpu_hello(s, s->rank, parity(s), src);
}

void cpu_hello_post(cpu_state_t *s, const cpu_hello_t *mine,
                    void (*fill)(cpu_state_t *s, cpu_hello_t *slot, int dest, void *arg),
                    void *arg) {
  EP_LOG(s->ctx, EP_LOG_TRACE, "run", "call %llu: hello (kind %d, rejected %d)",
         (unsigned long long)s->seq, mine->key.f[EP_CF_KIND], mine->key.rejected);
  for (int d = 0; d < s->nranks; d++) {
    cpu_hello_t *h = cpu_hello(s, d, parity(s), s->rank);
    h->key = mine->key;
    if (fill) fill(s, h, d, arg);
    atomic_store_explicit(&h->seq, s->seq + 1, memory_order_release);
    if (d != s->rank) cpu_ring_bell(s, d, 0);
  }
}

/* Ranks whose hello for this call has not arrived, as "2, 5" (for the timeout message). */
static int missing(cpu_state_t *s, char *list, size_t n) {
  int first = -1, k = 0;
  size_t used = 0;
  list[0] = '\0';
  for (int r = 0; r < s->nranks; r++) {
    cpu_hello_t *h = cpu_hello_from(s, r);
    if (atomic_load_explicit(&h->seq, memory_order_acquire) == s->seq + 1) continue;
    if (first < 0) first = r;
    if (used + 16 < n)
      used += (size_t)snprintf(list + used, n - used, "%s%d", k ? ", " : "", cpu_grank(s, r));
    k++;
  }
  return first;
}

ep_status_t cpu_hello_gather(cpu_state_t *s, const cpu_hello_t *mine, const char *op) {
  cpu_call_begin(s);
  cpu_waiter_t w;
  cpu_waiter_init(&w, s, 0, op, "hello");
  char list[200], what[240];
  for (;;) {
    uint32_t seen = cpu_bell_read(s, 0);
    int first = missing(s, list, sizeof list);
    if (first < 0) break;
    snprintf(what, sizeof what, "no hello yet from rank(s) %s: they have not entered this call",
             list);
    ep_status_t st = cpu_wait(&w, seen, cpu_grank(s, first), what);
    if (st) {
      cpu_abort_peers(s, st);
      return st;
    }
  }
  /* Compare only once all have arrived, so that every rank fails the call the same way. */
  for (int r = 0; r < s->nranks; r++) {
    const ep_call_key_t *theirs = &cpu_hello_from(s, r)->key;
    int f = r == s->rank ? -1 : ep_call_key_diff(&mine->key, theirs);
    if (f >= 0) return ep_call_key_fail(s->ctx, op, "hello", f, &mine->key, theirs, r);
  }
  return EP_OK;
}

/* A rejected call still takes part in the hello phase: it posts "rejected" and waits for the
 * peers' hellos of the same call. Returning at once would let this rank run ahead into later
 * calls and overwrite a hello slot that a slow peer has not read yet. The caller's error
 * message (naming the bad argument) is kept whatever the wait says. */
void cpu_reject(void *state) {
  cpu_state_t *s = state;
  if (s->net) return cpu_net_reject(s);
  cpu_hello_t mine;
  memset(&mine, 0, sizeof mine);
  mine.key.rejected = 1;
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  cpu_hello_post(s, &mine, NULL, NULL);
  (void)cpu_hello_gather(s, &mine, "rejected call");
  s->seq++;
  ep_ctx_restore_error(saved);
}
