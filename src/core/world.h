/* The exchanges of a group that spans hosts (core-private): its collective calls across hosts
 * go through the world engine (MPI), and so do the notices of a rank's death to the other
 * hosts. Ranks on one host still meet on the local bootstrap channel, for what only a host can
 * share (file descriptors of shared memory). */
#ifndef EP_CORE_WORLD_H
#define EP_CORE_WORLD_H

#include "internal.h"
#include "net/net.h"

/* A death one rank saw on its host, told to every rank of the other hosts. */
typedef struct {
  int32_t dead, reporter;
  char how[88];
} ep_notice_t;

typedef struct ep_heartbeat ep_heartbeat_t;

typedef struct {
  const struct ep_net_engine *e;
  ep_net_t *n;
  int rank, nranks;
  uint32_t step;          /* exchange within the current call */
  pthread_mutex_t lock;   /* notices are looked at from every thread that waits */
  ep_net_xfer_t *rx, *tx; /* [R] standing receives of notices; sends of ours */
  ep_notice_t *rx_buf, tx_buf;
  bool told;          /* this rank sent its notice */
  _Atomic int heard;  /* first notice received (index into rx), -1: none; set under lock */
  ep_heartbeat_t *hb; /* heartbeats to and from the neighbouring hosts (heartbeat.c), or NULL */
} ep_world_t;

/* Collective over every rank of the job: opens the world engine (MPI: initialized when nobody
 * did), checks that it spans exactly the group, posts the receives of notices. */
ep_status_t ep_world_open(ep_world_t **out, int rank, int nranks, double deadline);
/* clean: the group ends normally; else abandon (a peer may be gone). */
void ep_world_close(ep_world_t *w, bool clean);

/* One exchange of a group call: every rank's `bytes` into recv[r * bytes]. Before the data, a
 * header (call, number, exchange, size, status) from every rank is compared, so that ranks in
 * different calls fail with EP_ERR_MISMATCH naming both, and a rank that rejected the call
 * (mine != EP_OK) makes the others fail with EP_ERR_PEER_INVALID, naming it. `check` is the
 * group's liveness check. *peer: the rank a failure is about (-1). */
ep_status_t ep_world_allgather(ep_world_t *w, int op, uint32_t seq, const void *send, void *recv,
                               size_t bytes, ep_status_t mine, double deadline, double timeout_s,
                               ep_net_check_fn check, void *ctx, int *peer);

/* Tell every rank that `dead` died (once per world; never waits). */
void ep_world_notify(ep_world_t *w, int dead, const char *how);
/* Non-blocking: a notice from another rank (*dead, *reporter, how), or false. */
bool ep_world_heard(ep_world_t *w, int *dead, int *reporter, char *how, size_t n);

/* heartbeat.c: the limit this rank wants (EP_HEARTBEAT_S, ms), 0 when it is off or the engine
 * does not allow a thread of ours (MPI below THREAD_MULTIPLE). The group agrees on one limit
 * (0 if any rank has 0, else the largest), then each rank watches rank `watch` (another host)
 * and is watched by `watcher`: a thread sends `watcher` a beat every limit_s / 8 (at least
 * 50 ms). Nothing (EP_OK, *out NULL) when limit_s <= 0. */
int32_t ep_heartbeat_wanted_ms(const ep_world_t *w);
ep_status_t ep_heartbeat_start(ep_world_t *w, int watch, int watcher, double limit_s,
                               ep_heartbeat_t **out);
/* Non-blocking (any thread): true when the watched rank has sent nothing for longer than the
 * limit: *dead = it, *silent_s = for how long. */
bool ep_heartbeat_silent(ep_heartbeat_t *h, int *dead, double *silent_s);
/* Stops and joins the thread, lets go of the transfers; NULL-safe. */
void ep_heartbeat_stop(ep_heartbeat_t *h);

#endif
