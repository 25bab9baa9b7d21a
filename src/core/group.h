/* The group object (core-private). */
#ifndef EP_CORE_GROUP_H
#define EP_CORE_GROUP_H

#include <stdatomic.h>

#include "bootstrap.h"
#include "internal.h"
#include "liveness.h"
#include "topo.h"
#include "world.h"

#define EP_HOSTKEY_MAX 96

typedef struct {
  _Atomic bool set;
  char text[160];
} ep_how_t;

struct ep_group_s {
  uint32_t magic;
  ep_id_t id;
  int rank, nranks;
  double timeout_s;
  ep_topo_t topo;    /* hosts; one host holding every rank unless the group spans
                        hosts (docs/ARCHITECTURE.md, "Across hosts") */
  ep_world_t *world; /* spanning hosts: the exchanges across hosts, else NULL */
  ep_boot_t boot;    /* the ranks of this host (all ranks when on one host) */
  ep_live_t live;    /* indexed like `boot`: local ranks */
  /* Explanations of a death, each written once (the first check that finds it; later checks
   * find the same death) under how_lock, then read without it: channels' threads check at once. */
  ep_how_t remote_how; /* what a notice from another host said */
  ep_how_t local_how;  /* across hosts: a death on this host, with host and pid */
  ep_how_t silent_how; /* across hosts: a host whose heartbeats stopped */
  pthread_mutex_t how_lock;
  char (*hostkeys)[EP_HOSTKEY_MAX]; /* [nranks]: hostname + boot id */
  _Atomic bool broken;              /* a collective failed: destroys skip their exchanges */
  _Atomic bool peer_lost;           /* a rank died or did not answer: the world engine must not
                                       wait for it at the end (MPI_Finalize would) */
  pthread_mutex_t lock;             /* guards the buffer list */
  pthread_mutex_t boot_lock;        /* one collective call at a time on the bootstrap channel */
  pthread_t call_thread;            /* the thread whose call holds boot_lock */
  _Atomic bool in_call;
  ep_id_t *buffers; /* live buffers, for BUSY reports and release */
  int nbuffers, capbuffers;
  ep_errbox_t err;
};
typedef struct ep_group_s ep_group;

#define EP_GROUP_MAGIC 0x45504752u

/* Frees everything the group owns (local; the registry entry must be gone). */
void ep_group_free(ep_group *g);
/* Record a failure on the group and the calling thread; returns `st`. */
ep_status_t ep_group_fail(ep_group *g, ep_status_t st, const char *op);
/* Zero-timeout check; EP_ERR_PEER_FAILED with a message naming the rank and what happened. */
ep_status_t ep_group_check(ep_group *g, int *dead, const char **how);
bool ep_group_same_host(const ep_group *g);
/* After a failed exchange: if a peer is (about to be seen) dead, say so instead; after a
 * timeout only when it is `peer`, the rank the call failed on (-1: unknown, any). */
ep_status_t ep_group_explain(ep_group *g, ep_status_t st, int peer);
ep_status_t ep_group_add_buffer(ep_group *g, ep_id_t buf);
void ep_group_remove_buffer(ep_group *g, ep_id_t buf);

/* Collective calls on the group's bootstrap channel (barrier, allgather, buffer create and
 * destroy, group destroy). ep_group_call_begin holds the channel for the whole call and gives it
 * the group's next number, so that every frame says which call its sender is in; it returns
 * EP_ERR_BROKEN (call opened all the same: end it) when the group is broken. */
ep_status_t ep_group_call_begin(ep_group *g, int op);
void ep_group_call_end(ep_group *g);
bool ep_group_in_call(const ep_group *g); /* by the calling thread */
enum { EP_XCHG_BYTES, EP_XCHG_FD, EP_XCHG_BARRIER };
/* One exchange of the current call, bounded by timeout_s. `mine`: this rank's own status for the
 * call (non-zero: it rejected the call, takes part anyway, and gets `mine` back). A failure
 * other than a peer's rejection breaks the group. */
ep_status_t ep_group_xchg(ep_group *g, int kind, const void *send, void *recv, size_t bytes, int fd,
                          int *fds, ep_status_t mine, double timeout_s);

/* The group's rank of local index `l` of this host. */
static inline int ep_group_local_to_rank(const ep_group *g, int l) {
  return g->topo.rank_at[g->topo.host * g->topo.local_size + l];
}

/* Job id and key from the environment (job.c); cfg_job, when set, is the id. */
ep_status_t ep_job_from_env(const char *cfg_job, char *id, size_t n, uint8_t key[EP_KEY_BYTES]);

#endif
