/* Heartbeats across hosts (world.h): how a host whose ranks all die is noticed promptly.
 *
 * A rank's death on its own host is seen at once (pidfds, liveness.c) and told to the other
 * hosts (world.c); but when a whole host goes down nobody is left there to tell, and MPI reports
 * nothing. So every rank is watched by one rank of the previous host (same local index, hosts in
 * a ring): a thread of the group sends the watcher a small message every `period`, whatever the
 * program is doing (computing, in a call, outside any), and every liveness check of the watcher
 * (every wait of every call) takes what arrived; a watched rank silent for longer than
 * EP_HEARTBEAT_S is reported dead, as a death on the host would be (a notice to every rank), so
 * every survivor fails within about EP_HEARTBEAT_S instead of at its deadline.
 *
 * The thread exists only when the group spans hosts, EP_HEARTBEAT_S > 0, and MPI runs at
 * MPI_THREAD_MULTIPLE (at SERIALIZED a thread of ours calling MPI could overlap the program's
 * own calls); it is stopped and joined before the world engine closes. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "world.h"

enum { TAG_BEAT = 4 };

struct ep_heartbeat {
  ep_world_t *w;
  int watch, watcher;   /* the rank this one watches; the one watching this one */
  double limit, period; /* seconds */
  pthread_t thread;
  pthread_mutex_t lock; /* stop, the send (thread) | the receive (checkers, trylock) */
  pthread_cond_t wake;
  bool stop, started;
  ep_net_xfer_t tx, rx;
  uint64_t tx_buf, rx_buf, sent;
  double last; /* when the watched rank was last heard (ep_now) */
};

static void *beat(void *arg) {
  ep_heartbeat_t *h = arg;
  pthread_mutex_lock(&h->lock);
  while (!h->stop && h->w->e->own_threads_ok()) { /* (MPI finalized by the program: stop) */
    int done = 1;
    /* A send still in flight (a watcher that does not progress MPI) is not posted again; one
     * that failed is let go and a new one posted. */
    if (h->sent && h->w->e->test(h->w->n, &h->tx, 1, &done) != EP_OK)
      h->w->e->cancel(h->w->n, &h->tx, 1), done = 1;
    if (done) {
      h->tx_buf = ++h->sent;
      h->tx = (ep_net_xfer_t){h->watcher, 1, TAG_BEAT, &h->tx_buf, sizeof h->tx_buf, 0, 0, 0};
      if (h->w->e->post(h->w->n, &h->tx, 1, NULL) != EP_OK) h->sent = 0;
    }
    struct timespec ts; /* the condition variable waits on the monotonic clock */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long ns = ts.tv_nsec + (long)(h->period * 1e9);
    ts.tv_sec += ns / 1000000000L, ts.tv_nsec = ns % 1000000000L;
    while (!h->stop && pthread_cond_timedwait(&h->wake, &h->lock, &ts) != ETIMEDOUT) {
    }
  }
  pthread_mutex_unlock(&h->lock);
  return NULL;
}

static ep_status_t post_rx(ep_heartbeat_t *h) {
  h->rx = (ep_net_xfer_t){h->watch, 0, TAG_BEAT, &h->rx_buf, sizeof h->rx_buf, 0, 0, 0};
  return h->w->e->post(h->w->n, &h->rx, 1, NULL);
}

int32_t ep_heartbeat_wanted_ms(const ep_world_t *w) {
  double s = ep_env_real("EP_HEARTBEAT_S");
  if (s <= 0 || !w->e->own_threads_ok || !w->e->own_threads_ok()) return 0;
  return s * 1e3 > 1e9 ? 1000000000 : s * 1e3 < 1 ? 1 : (int32_t)(s * 1e3);
}

ep_status_t ep_heartbeat_start(ep_world_t *w, int watch, int watcher, double limit_s,
                               ep_heartbeat_t **out) {
  *out = NULL;
  if (limit_s <= 0 || watch == w->rank) return EP_OK; /* every rank agreed (group.c) */
  ep_heartbeat_t *h = calloc(1, sizeof *h);
  if (!h) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  h->w = w, h->watch = watch, h->watcher = watcher, h->limit = limit_s;
  h->period = limit_s / 8 < 0.05 ? 0.05 : limit_s / 8;
  h->last = ep_now();
  pthread_mutex_init(&h->lock, NULL);
  pthread_condattr_t ca; /* a step of the wall clock must not stop the beats */
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&h->wake, &ca);
  pthread_condattr_destroy(&ca);
  ep_status_t st = post_rx(h);
  if (!st && pthread_create(&h->thread, NULL, beat, h) != 0)
    st = ep_err(EP_ERR_SYSTEM, "cannot start the heartbeat thread");
  h->started = st == EP_OK;
  *out = h;
  return st;
}

bool ep_heartbeat_silent(ep_heartbeat_t *h, int *dead, double *silent_s) {
  if (!h || pthread_mutex_trylock(&h->lock)) return false; /* another thread is looking */
  char saved[EP_ERRMSG_MAX];
  snprintf(saved, sizeof saved, "%s", ep_last_error());
  int done = 0;
  /* Everything that arrived since the last look: a watcher that did not look for a while finds
   * several beats queued. */
  while (h->w->e->test(h->w->n, &h->rx, 1, &done) == EP_OK && done && post_rx(h) == EP_OK)
    h->last = ep_now(), done = 0;
  ep_err_set_msg(saved); /* looking is not failing */
  double quiet = ep_now() - h->last;
  pthread_mutex_unlock(&h->lock);
  if (quiet <= h->limit) return false;
  *dead = h->watch, *silent_s = quiet;
  return true;
}

void ep_heartbeat_stop(ep_heartbeat_t *h) {
  if (!h) return;
  pthread_mutex_lock(&h->lock);
  h->stop = true;
  pthread_cond_signal(&h->wake);
  pthread_mutex_unlock(&h->lock);
  if (h->started) pthread_join(h->thread, NULL);
  h->w->e->cancel(h->w->n, &h->rx, 1);
  if (h->sent) h->w->e->cancel(h->w->n, &h->tx, 1);
  pthread_cond_destroy(&h->wake);
  pthread_mutex_destroy(&h->lock);
  free(h);
}
