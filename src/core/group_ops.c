/* Groups in use: liveness, the collective calls on the bootstrap channel (numbered, so that a
 * rank in another call is named instead of paired with), and teardown. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group.h"

/* ------------------------------------------------------------------ liveness */

/* h's text, formatted by the first caller only: the text a caller gets stays put while another
 * thread's check finds the same death. */
static const char *explain_once(ep_group *g, ep_how_t *h, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static const char *explain_once(ep_group *g, ep_how_t *h, const char *fmt, ...) {
  if (!atomic_load_explicit(&h->set, memory_order_acquire)) {
    pthread_mutex_lock(&g->how_lock);
    if (!atomic_load_explicit(&h->set, memory_order_relaxed)) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(h->text, sizeof h->text, fmt, ap);
      va_end(ap);
      atomic_store_explicit(&h->set, true, memory_order_release);
    }
    pthread_mutex_unlock(&g->how_lock);
  }
  return h->text;
}

/* A rank of this host died (local index l): tell the other hosts, once, and say so. */
static ep_status_t local_death(ep_group *g, int l, int *dead, const char **how) {
  int r = ep_group_local_to_rank(g, l);
  if (dead) *dead = r;
  if (how) *how = g->live.how;
  g->broken = true;
  g->peer_lost = true;
  if (l == g->topo.local_rank) /* the launcher is gone: nobody will report deaths now */
    return ep_err(EP_ERR_PEER_FAILED, "rank %d %s; giving up", r, g->live.how);
  if (!g->world)
    return ep_err(EP_ERR_PEER_FAILED, "rank %d (pid %d) %s", r, (int)g->live.pids[l], g->live.how);
  const char *said = explain_once(g, &g->local_how, "(host %d, pid %d) %s", g->topo.host,
                                  (int)g->live.pids[l], g->live.how);
  if (how) *how = said;
  ep_world_notify(g->world, r, said);
  return ep_err(EP_ERR_PEER_FAILED, "rank %d %s", r, said);
}

/* A notice from another host first: it reports the first death, where a rank of this host may
 * just have exited after hearing the same notice. */
/* A rank of another host that sent no heartbeat for too long: its host is down or cut off (a
 * whole host that dies has nobody left to say so). Told to every rank, like a death seen here. */
static ep_status_t silent_host(ep_group *g, int r, double quiet, int *dead, const char **how) {
  if (dead) *dead = r;
  g->broken = true;
  g->peer_lost = true;
  const char *said = explain_once(
      g, &g->silent_how,
      "(host %d) sent no heartbeat for %.1f s: its host is down or cut off (EP_HEARTBEAT_S)",
      g->topo.host_of[r], quiet);
  if (how) *how = said;
  ep_world_notify(g->world, r, said);
  return ep_err(EP_ERR_PEER_FAILED, "rank %d %s", r, said);
}

ep_status_t ep_group_check(ep_group *g, int *dead, const char **how) {
  int r, reporter;
  char said[96];
  if (!g->world || !ep_world_heard(g->world, &r, &reporter, said, sizeof said)) {
    int l = ep_live_check(&g->live);
    if (l >= 0) return local_death(g, l, dead, how);
    double quiet;
    if (g->world && ep_heartbeat_silent(g->world->hb, &r, &quiet))
      return silent_host(g, r, quiet, dead, how);
    return EP_OK;
  }
  const char *text = explain_once(g, &g->remote_how, "%s (reported by rank %d)", said, reporter);
  if (dead) *dead = r;
  if (how) *how = text;
  g->broken = true;
  g->peer_lost = true;
  return ep_err(EP_ERR_PEER_FAILED, "rank %d %s", r, text);
}

ep_status_t ep_group_explain(ep_group *g, ep_status_t st, int peer) {
  if (st != EP_ERR_PEER_FAILED && st != EP_ERR_TIMEOUT) return st;
  /* A closed socket can be seen a moment before the process is reaped and the launcher says how
   * it died: give the better explanation 200 ms to show up. */
  char saved[EP_ERRMSG_MAX];
  snprintf(saved, sizeof saved, "%s", ep_last_error());
  for (int i = 0; i < 40; i++) {
    int dead;
    /* After a timeout, a bystander that has exited since (the rank that gave up first and
     * told us, say) explains nothing: only the rank the call waited for does. */
    if (ep_group_check(g, &dead, NULL) == EP_ERR_PEER_FAILED &&
        (st != EP_ERR_TIMEOUT || peer < 0 || dead == peer))
      return EP_ERR_PEER_FAILED;
    if (st == EP_ERR_TIMEOUT) break;
    nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
  }
  ep_err_set_msg(saved);
  return st;
}

bool ep_group_same_host(const ep_group *g) {
  return g->topo.nhosts == 1;
}

ep_status_t ep_group_add_buffer(ep_group *g, ep_id_t buf) {
  pthread_mutex_lock(&g->lock);
  if (g->nbuffers == g->capbuffers) {
    int cap = g->capbuffers ? 2 * g->capbuffers : 4;
    ep_id_t *b = realloc(g->buffers, (size_t)cap * sizeof *b);
    if (!b) {
      pthread_mutex_unlock(&g->lock);
      return ep_err(EP_ERR_NO_MEMORY, "out of memory");
    }
    g->buffers = b;
    g->capbuffers = cap;
  }
  g->buffers[g->nbuffers++] = buf;
  pthread_mutex_unlock(&g->lock);
  return EP_OK;
}

void ep_group_remove_buffer(ep_group *g, ep_id_t buf) {
  pthread_mutex_lock(&g->lock);
  for (int i = 0; i < g->nbuffers; i++)
    if (g->buffers[i] == buf) g->buffers[i] = g->buffers[--g->nbuffers];
  pthread_mutex_unlock(&g->lock);
}

/* ------------------------------------------------------------------ collective calls */

ep_status_t ep_group_call_begin(ep_group *g, int op) {
  pthread_mutex_lock(&g->boot_lock);
  g->call_thread = pthread_self();
  g->in_call = true;
  ep_boot_begin(&g->boot, op);
  if (g->world) g->world->step = 0;
  return g->broken ? ep_err(EP_ERR_BROKEN, "group is broken by an earlier failure") : EP_OK;
}

void ep_group_call_end(ep_group *g) {
  g->in_call = false;
  pthread_mutex_unlock(&g->boot_lock);
}

bool ep_group_in_call(const ep_group *g) {
  return g->in_call && pthread_equal(g->call_thread, pthread_self());
}

static ep_status_t liveness(void *ctx) {
  return ep_group_check(ctx, NULL, NULL);
}

/* Across hosts: the world engine, named with the host of the rank a failure is about. */
static ep_status_t world_xchg(ep_group *g, int kind, const void *send, void *recv, size_t bytes,
                              ep_status_t mine, double timeout_s, int *peer) {
  double deadline = ep_now() + timeout_s;
  ep_status_t st = ep_world_allgather(g->world, g->boot.op, g->boot.seq, send, recv,
                                      kind == EP_XCHG_BARRIER ? 0 : bytes, mine, deadline,
                                      timeout_s, liveness, g, peer);
  if (st && st != mine && *peer >= 0 && *peer != g->rank) {
    char msg[EP_ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s (rank %d is on host %d)", ep_last_error(), *peer,
             g->topo.host_of[*peer]);
    ep_err_set_msg(msg);
  }
  return st;
}

ep_status_t ep_group_xchg(ep_group *g, int kind, const void *send, void *recv, size_t bytes, int fd,
                          int *fds, ep_status_t mine, double timeout_s) {
  if (g->broken)
    return mine ? mine : ep_err(EP_ERR_BROKEN, "group is broken by an earlier failure");
  double deadline = ep_now() + timeout_s;
  int peer = -1;
  ep_status_t st;
  if (g->world && kind != EP_XCHG_FD)
    st = world_xchg(g, kind, send, recv, bytes, mine, timeout_s, &peer);
  else
    st = kind == EP_XCHG_BYTES ? ep_boot_allgather(&g->boot, send, recv, bytes, mine, deadline)
         : kind == EP_XCHG_FD  ? ep_boot_allgather_fd(&g->boot, fd, fds, deadline)
                               : ep_boot_barrier(&g->boot, mine, deadline);
  if (st == mine || st == EP_ERR_PEER_INVALID) return st; /* the channel is in step */
  /* A verdict that this rank came too late stands, though the peers may have left since. */
  if (!g->world) peer = ep_boot_failed_peer();
  if (peer != g->rank) st = ep_group_explain(g, st, peer);
  g->broken = true; /* a peer may be gone, or in another call: no collective call is safe now */
  if (st != EP_ERR_MISMATCH) g->peer_lost = true;
  return st;
}

/* ------------------------------------------------------------------ use */

static ep_status_t group_get(ep_group_t group, bool exclusive, ep_group **g, const char *op) {
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(group), EP_OBJ_GROUP, exclusive, (void **)g);
  if (st && op) ep_err_prefix(op);
  return st;
}

ep_status_t ep_group_rank(ep_group_t group, int *rank) {
  ep_group *g;
  if (!rank) return ep_err(EP_ERR_NULL_ARG, "ep_group_rank: rank is NULL");
  ep_status_t st = group_get(group, false, &g, "ep_group_rank");
  if (st) return st;
  *rank = g->rank;
  ep_reg_release(g->id);
  return EP_OK;
}

ep_status_t ep_group_nranks(ep_group_t group, int *nranks) {
  ep_group *g;
  if (!nranks) return ep_err(EP_ERR_NULL_ARG, "ep_group_nranks: nranks is NULL");
  ep_status_t st = group_get(group, false, &g, "ep_group_nranks");
  if (st) return st;
  *nranks = g->nranks;
  ep_reg_release(g->id);
  return EP_OK;
}

ep_status_t ep_group_query(ep_group_t group, ep_group_info_t *info) {
  static const char op[] = "ep_group_query";
  if (!info) return ep_err(EP_ERR_NULL_ARG, "%s: info is NULL", op);
  if (info->size < sizeof(size_t) || info->size > sizeof(ep_group_info_t) ||
      info->size % sizeof(int) != 0)
    return ep_err(EP_ERR_CONFIG,
                  "%s: info->size is %zu, this library accepts %zu..%zu (use "
                  "EP_GROUP_INFO_INIT)",
                  op, info->size, sizeof(size_t), sizeof(ep_group_info_t));
  ep_group *g;
  ep_status_t st = group_get(group, false, &g, op);
  if (st) return st;
  ep_group_info_t i = {info->size,        g->rank,      g->nranks,
                       g->topo.nhosts,    g->topo.host, g->topo.local_rank,
                       g->topo.local_size};
  ep_reg_release(g->id);
  memcpy(info, &i, info->size);
  return EP_OK;
}

const char *ep_group_last_error(ep_group_t group) {
  ep_group *g;
  if (group_get(group, false, &g, NULL)) return ep_last_error();
  const char *m = ep_errbox_get(&g->err);
  ep_reg_release(g->id);
  return m;
}

/* Barrier and allgather share one path. A rank that rejects its arguments (mine != EP_OK) still
 * takes part, so that its peers fail at once with EP_ERR_PEER_INVALID instead of pairing with
 * its next call. */
static ep_status_t group_exchange(ep_group_t group, int op, const void *send, void *recv,
                                  size_t bytes, ep_status_t mine) {
  ep_group *g;
  const char *name = ep_boot_op_name(op);
  ep_status_t st = group_get(group, false, &g, name);
  if (st) return st;
  st = ep_group_call_begin(g, op);
  if (!st)
    st = ep_group_xchg(g, op == EP_OP_GROUP_BARRIER ? EP_XCHG_BARRIER : EP_XCHG_BYTES, send, recv,
                       bytes, -1, NULL, mine, g->timeout_s);
  ep_group_call_end(g);
  if (st && st != mine) st = ep_group_fail(g, st, name);
  ep_reg_release(g->id);
  return st;
}

ep_status_t ep_group_barrier(ep_group_t group) {
  return group_exchange(group, EP_OP_GROUP_BARRIER, NULL, NULL, 0, EP_OK);
}

ep_status_t ep_group_allgather(ep_group_t group, const void *send, void *recv, size_t bytes) {
  ep_status_t mine = EP_OK;
  if (!send || !recv)
    mine = ep_err(EP_ERR_NULL_ARG, "ep_group_allgather: %s is NULL", send ? "recv" : "send");
  else if (bytes == 0 || bytes > (64u << 20))
    mine = ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_allgather: bytes is %zu, must be in [1, 64 MiB]",
                  bytes);
  return group_exchange(group, EP_OP_GROUP_ALLGATHER, send, recv, bytes, mine);
}

static ep_status_t busy_with_buffers(ep_group *g, const char *op) {
  pthread_mutex_lock(&g->lock);
  int n = g->nbuffers;
  unsigned long long first = n ? (unsigned long long)g->buffers[0] : 0;
  pthread_mutex_unlock(&g->lock);
  if (n == 0) return EP_OK;
  return ep_err(EP_ERR_BUSY,
                "%s: %d buffer(s) of this group are still alive (first: %#llx); "
                "destroy buffers before their group",
                op, n, first);
}

/* The collective part of a destroy: a barrier, so that nobody leaves while a peer still talks to
 * it. A rank with live buffers refuses (EP_ERR_BUSY) but takes part, so that its peers learn it
 * at once (EP_ERR_PEER_INVALID). A broken group skips the barrier: its peers are gone, failing
 * too, or in another call. */
static ep_status_t destroy_barrier(ep_group *g, ep_status_t busy) {
  ep_status_t st = ep_group_call_begin(g, EP_OP_GROUP_DESTROY);
  if (st == EP_ERR_BROKEN)
    st = busy;
  else
    st = ep_group_xchg(g, EP_XCHG_BARRIER, NULL, NULL, 0, -1, NULL, busy, g->timeout_s);
  ep_group_call_end(g);
  return st;
}

ep_status_t ep_group_destroy(ep_group_t group) {
  if (!group) return EP_OK;
  ep_group *g;
  ep_status_t st = group_get(group, true, &g, "ep_group_destroy");
  if (st) return st;
  ep_status_t busy = busy_with_buffers(g, "ep_group_destroy");
  ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group %#llx: destroy%s", (unsigned long long)g->id,
            busy        ? " refused (live buffers)"
            : g->broken ? " (broken: local only)"
                        : "");
  ep_status_t q = destroy_barrier(g, busy);
  if (q && q != busy) ep_group_fail(g, q, "ep_group_destroy");
  ep_reg_release(g->id);
  if (busy) return busy; /* nothing destroyed */
  char msg[EP_ERRMSG_MAX];
  snprintf(msg, sizeof msg, "%s", ep_last_error());
  void *obj;
  if ((st = ep_reg_remove(g->id, EP_OBJ_GROUP, &obj))) return st;
  if (q) ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group destroy: peers not quiesced: %s", msg);
  ep_group_free(g);
  ep_err_set_msg(msg);
  return q;
}

ep_status_t ep_group_release(ep_group_t group) {
  if (!group) return EP_OK;
  ep_group *g;
  ep_status_t st = group_get(group, true, &g, "ep_group_release");
  if (st) return st;
  /* Crash path: buffers go first (local release), then the group. */
  for (;;) {
    pthread_mutex_lock(&g->lock);
    ep_id_t b = g->nbuffers ? g->buffers[g->nbuffers - 1] : 0;
    pthread_mutex_unlock(&g->lock);
    if (!b) break;
    if ((st = ep_buffer_release(ep_id_to_ptr(b)))) {
      ep_reg_release(g->id);
      return st;
    }
  }
  ep_reg_release(g->id);
  void *obj;
  if ((st = ep_reg_remove(g->id, EP_OBJ_GROUP, &obj))) return st;
  ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group released (local)");
  ep_group_free(g);
  return EP_OK;
}
