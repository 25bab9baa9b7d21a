/* The two moves every backend makes over a buffer's network endpoint (core/backend.h): a bounded
 * wait for posted transfers, and an all-gather of a few bytes per rank; a failure names the peer
 * still pending with its host, or the dead rank the liveness check saw. One place for both, so
 * that the CPU and CUDA paths across hosts fail alike. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "net/net.h"

const char *ep_ctx_who(const ep_ctx_t *ctx, int rank, char *buf, size_t n) {
  if (rank < 0 || rank >= ep_ctx_nranks(ctx))
    snprintf(buf, n, "no rank");
  else
    snprintf(buf, n, "rank %d (host %d)", rank, ep_ctx_topo(ctx)->host_of[rank]);
  return buf;
}

static ep_status_t wait_named(ep_ctx_t *ctx, const struct ep_net_engine *e, ep_net_t *n,
                              ep_net_xfer_t *x, int count, const char *op, const char *phase,
                              const char *what) {
  if (!count) return EP_OK;
  double t = ep_ctx_timeout(ctx);
  ep_status_t st = ep_net_wait(e, n, x, count, ep_now() + t, t, ep_ctx_liveness, ctx, what);
  if (!st) return EP_OK;
  int peer = -1, dead;
  for (int i = 0; i < count && peer < 0; i++)
    if (!x[i].done) peer = x[i].peer;
  const char *how;
  char who[48], msg[512];
  snprintf(msg, sizeof msg, "%s", ep_last_error());
  e->cancel(n, x, count);
  /* A death the liveness check saw is already named with its host. */
  if (st == EP_ERR_PEER_FAILED && ep_ctx_check_peers(ctx, &dead, &how) != EP_OK)
    return ep_ctx_fail(ctx, st, dead, op, phase, "%s", msg);
  return ep_ctx_fail(ctx, st, peer, op, phase, "%s (%s)", msg,
                     ep_ctx_who(ctx, peer, who, sizeof who));
}

ep_status_t ep_ctx_net_wait(ep_ctx_t *ctx, const struct ep_net_engine *e, ep_net_t *n,
                            ep_net_xfer_t *x, int count, const char *op, const char *phase) {
  return wait_named(ctx, e, n, x, count, op, phase, "network");
}

ep_status_t ep_ctx_net_allgather(ep_ctx_t *ctx, const struct ep_net_engine *e, ep_net_t *n, int tag,
                                 const void *mine, void *all, size_t bytes, const char *op,
                                 const char *phase) {
  const int R = ep_ctx_nranks(ctx), me = ep_ctx_rank(ctx);
  int k = 0;
  ep_net_xfer_t *x = calloc(2 * (size_t)R, sizeof *x);
  if (!x) return ep_ctx_fail(ctx, EP_ERR_NO_MEMORY, -1, op, phase, "out of memory");
  for (int r = 0; r < R; r++) {
    if (r == me) continue;
    x[k++] = (ep_net_xfer_t){r, 1, tag, (void *)mine, bytes, 0, 0, 0};
    x[k++] = (ep_net_xfer_t){r, 0, tag, (char *)all + bytes * (size_t)r, bytes, 0, 0, 0};
  }
  memcpy((char *)all + bytes * (size_t)me, mine, bytes);
  ep_status_t st = k ? e->post(n, x, k, NULL) : EP_OK;
  if (st)
    st = ep_ctx_fail(ctx, st, -1, op, phase, "%s", ep_last_error());
  else
    st = wait_named(ctx, e, n, x, k, op, phase, phase);
  for (int i = 0; !st && i < k; i++) /* a message of another exchange: the ranks are out of step */
    if (!x[i].send && x[i].got != bytes) {
      ep_ctx_mark_broken(ctx);
      st =
          ep_ctx_fail(ctx, EP_ERR_MISMATCH, x[i].peer, op, phase,
                      "%zu bytes from rank %d where %zu were expected", x[i].got, x[i].peer, bytes);
    }
  free(x);
  return st;
}
