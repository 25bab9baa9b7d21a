/* See world.h. Exchanges are point to point (every rank sends to every rank): a rank that does
 * not arrive is then named by the receive still pending at the deadline, which a collective
 * could not say. */
#include "world.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bootstrap.h"

enum { TAG_HEADER = 1, TAG_DATA = 2, TAG_NOTICE = 3 };

typedef struct {
  int32_t op, status;
  uint32_t seq, step;
  uint64_t bytes;
} header_t;

/* ------------------------------------------------------------------ open, close */

static ep_status_t post_notices(ep_world_t *w) {
  int R = w->nranks, k = 0;
  w->rx = calloc((size_t)R, sizeof *w->rx);
  w->tx = calloc((size_t)R, sizeof *w->tx);
  w->rx_buf = calloc((size_t)R, sizeof *w->rx_buf);
  if (!w->rx || !w->tx || !w->rx_buf) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  for (int r = 0; r < R; r++)
    if (r != w->rank)
      w->rx[k++] = (ep_net_xfer_t){r, 0, TAG_NOTICE, &w->rx_buf[r], sizeof w->rx_buf[r], 0, 0, 0};
  return w->e->post(w->n, w->rx, k, NULL);
}

ep_status_t ep_world_open(ep_world_t **out, int rank, int nranks, double deadline) {
  ep_world_t *w = calloc(1, sizeof *w);
  if (!w) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  w->e = ep_net_world_engine();
  w->rank = rank, w->nranks = nranks, w->heard = -1;
  pthread_mutex_init(&w->lock, NULL);
  ep_net_open_t how = {rank, nranks, -1, deadline, NULL, NULL, NULL};
  ep_status_t st = w->e->open(&how, &w->n);
  if (!st) st = post_notices(w);
  if (st) {
    ep_world_close(w, false);
    return st;
  }
  *out = w;
  return EP_OK;
}

void ep_world_close(ep_world_t *w, bool clean) {
  if (!w) return;
  ep_heartbeat_stop(w->hb); /* before the endpoint goes */
  if (w->n) {
    if (w->rx) w->e->cancel(w->n, w->rx, w->nranks - 1);
    if (w->told) w->e->cancel(w->n, w->tx, w->nranks - 1);
    w->e->close(w->n, clean);
  }
  pthread_mutex_destroy(&w->lock);
  free(w->rx), free(w->tx), free(w->rx_buf);
  free(w);
}

/* ------------------------------------------------------------------ exchanges */

typedef struct {
  ep_world_t *w;
  double deadline, timeout_s;
  ep_net_check_fn check;
  void *ctx;
} wait_t;

/* Every rank's `bytes` into all[r * bytes], own included. On failure the buffers may still be
 * in the engine's hands (a late peer could write them): they are left allocated on purpose,
 * once, for a group that is broken from then on. */
static ep_status_t all_to_all(const wait_t *wt, int tag, const void *mine, void *all, size_t bytes,
                              const char *what, int *peer) {
  ep_world_t *w = wt->w;
  int R = w->nranks, k = 0;
  ep_net_xfer_t *x = calloc(2 * (size_t)R, sizeof *x);
  unsigned char *tmp = malloc(bytes * ((size_t)R + 1) + 1);
  if (!x || !tmp) {
    free(x), free(tmp);
    return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  }
  memcpy(tmp + bytes * (size_t)R, mine, bytes);
  for (int r = 0; r < R; r++) {
    if (r == w->rank) continue;
    x[k++] = (ep_net_xfer_t){r, 1, tag, tmp + bytes * (size_t)R, bytes, 0, 0, 0};
    x[k++] = (ep_net_xfer_t){r, 0, tag, tmp + bytes * (size_t)r, bytes, 0, 0, 0};
  }
  ep_status_t st = w->e->post(w->n, x, k, NULL);
  if (!st)
    st = ep_net_wait(w->e, w->n, x, k, wt->deadline, wt->timeout_s, wt->check, wt->ctx, what);
  for (int i = 0; st && i < k; i++)
    if (!x[i].done) {
      *peer = x[i].peer;
      break;
    }
  if (st) {
    w->e->cancel(w->n, x, k);
    free(x); /* tmp stays: see above */
    return st;
  }
  memcpy(tmp + bytes * (size_t)w->rank, mine, bytes);
  memcpy(all, tmp, bytes * (size_t)R);
  free(x), free(tmp);
  return EP_OK;
}

/* As the local channel says it: the exchange only when the calls are the same. */
static void call_text(char *out, size_t n, const header_t *h, bool with_step) {
  if (with_step)
    snprintf(out, n, "%s (#%u, exchange %u)", ep_boot_op_name(h->op), h->seq, h->step);
  else
    snprintf(out, n, "%s (#%u)", ep_boot_op_name(h->op), h->seq);
}

/* The same verdict on every rank, from the same headers. */
static ep_status_t judge(const header_t *all, int R, int me, ep_status_t mine, int *peer) {
  const header_t *m = &all[me];
  for (int r = 0; r < R; r++) {
    const header_t *h = &all[r];
    if (h->op == m->op && h->seq == m->seq && h->step == m->step) continue;
    char a[96], b[96];
    bool steps = h->op == m->op && h->seq == m->seq;
    call_text(a, sizeof a, m, steps), call_text(b, sizeof b, h, steps);
    *peer = r;
    return ep_err(EP_ERR_MISMATCH, "this rank calls %s, rank %d calls %s", a, r, b);
  }
  for (int r = 0; r < R; r++)
    if (all[r].status && r != me && !mine) {
      *peer = r;
      return ep_err(EP_ERR_PEER_INVALID,
                    "rank %d rejected its arguments for %s (#%u) (%s; its "
                    "own error says which)",
                    r, ep_boot_op_name(m->op), m->seq, ep_status_name((ep_status_t)all[r].status));
    }
  if (mine) return mine;
  for (int r = 0; r < R; r++)
    if (all[r].bytes != m->bytes && !all[r].status) {
      *peer = r;
      return ep_err(EP_ERR_MISMATCH,
                    "%s (#%u): this rank exchanges %llu bytes, rank %d %llu "
                    "(must agree on all ranks)",
                    ep_boot_op_name(m->op), m->seq, (unsigned long long)m->bytes, r,
                    (unsigned long long)all[r].bytes);
    }
  return EP_OK;
}

ep_status_t ep_world_allgather(ep_world_t *w, int op, uint32_t seq, const void *send, void *recv,
                               size_t bytes, ep_status_t mine, double deadline, double timeout_s,
                               ep_net_check_fn check, void *ctx, int *peer) {
  *peer = -1;
  char saved[EP_ERRMSG_MAX];
  if (mine) snprintf(saved, sizeof saved, "%s", ep_last_error());
  header_t me = {op, (int32_t)mine, seq, w->step++, mine ? 0 : bytes};
  header_t *all = calloc((size_t)w->nranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  wait_t wt = {w, deadline, timeout_s, check, ctx};
  char what[96];
  snprintf(what, sizeof what, "%s (#%u): bootstrap", ep_boot_op_name(op), seq);
  ep_status_t st = all_to_all(&wt, TAG_HEADER, &me, all, sizeof me, what, peer);
  if (!st) st = judge(all, w->nranks, w->rank, mine, peer);
  if (!st && bytes) st = all_to_all(&wt, TAG_DATA, send, recv, bytes, what, peer);
  free(all);
  if (mine) ep_err_set_msg(saved); /* the rejecting rank keeps its own, precise message */
  return st;
}

/* ------------------------------------------------------------------ notices */

void ep_world_notify(ep_world_t *w, int dead, const char *how) {
  pthread_mutex_lock(&w->lock);
  if (!w->told) {
    w->tx_buf.dead = dead, w->tx_buf.reporter = w->rank;
    snprintf(w->tx_buf.how, sizeof w->tx_buf.how, "%s", how);
    int k = 0;
    for (int r = 0; r < w->nranks; r++)
      if (r != w->rank)
        w->tx[k++] = (ep_net_xfer_t){r, 1, TAG_NOTICE, &w->tx_buf, sizeof w->tx_buf, 0, 0, 0};
    w->told = w->e->post(w->n, w->tx, k, NULL) == EP_OK;
  }
  pthread_mutex_unlock(&w->lock);
}

bool ep_world_heard(ep_world_t *w, int *dead, int *reporter, char *how, size_t n) {
  if (w->heard < 0) {
    if (pthread_mutex_trylock(&w->lock)) return false; /* another thread is looking */
    int ndone = 0;
    char saved[EP_ERRMSG_MAX];
    snprintf(saved, sizeof saved, "%s", ep_last_error());
    if (w->e->test(w->n, w->rx, w->nranks - 1, &ndone) == EP_OK)
      for (int i = 0; i < w->nranks - 1 && w->heard < 0; i++)
        if (w->rx[i].done && w->rx[i].got == sizeof(ep_notice_t)) w->heard = w->rx[i].peer;
    ep_err_set_msg(saved); /* looking is not failing */
    pthread_mutex_unlock(&w->lock);
    if (w->heard < 0) return false;
  }
  const ep_notice_t *m = &w->rx_buf[w->heard];
  *dead = m->dead, *reporter = m->reporter;
  snprintf(how, n, "%.*s", (int)sizeof m->how, m->how);
  return true;
}
