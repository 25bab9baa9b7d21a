/*
 * The network layer: the one contract between epcomm and the engines that move bytes between
 * hosts. epcomm has no transport of its own across hosts; it drives what users already run:
 * MPI for host memory (src/net/net_mpi.c) and NCCL for GPU memory (src/net/net_nccl.c).
 *
 * Layer rule (docs/ARCHITECTURE.md): include/epcomm.h <- core <- backends and net. An engine
 * includes only this header (and core/backend.h for the core's services); the core and the
 * backends reach engines only through `struct ep_net_engine`, found by name in a table the build
 * writes (src/net/engines.c.in), never by naming one.
 *
 * An engine's library is loaded with dlopen when the first endpoint of a group that spans hosts
 * is opened, and unloaded when the last one closes: a job on one host never maps libmpi or
 * libnccl, so their threads cannot start, and cannot complain at exit.
 *
 * An endpoint (ep_net_t) is this rank's part of one communicator over all R ranks of a group.
 * Transfers are non-blocking: `post` starts a batch of sends and receives of byte ranges, `test`
 * reports which are done; nothing in the contract blocks. Every wait is the caller's loop
 * (ep_net_wait) with its deadline and its liveness checks.
 */
#ifndef EP_NET_NET_H
#define EP_NET_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "epcomm.h"

typedef struct ep_net ep_net_t;

/* One transfer of a batch. Between one pair of ranks, sends and receives with the same tag are
 * matched in the order they are posted (both engines guarantee it). */
typedef struct {
  int peer; /* global rank */
  int send; /* 1: send `bytes` of buf to peer; 0: receive at most `bytes` from peer into buf */
  int tag;  /* 0 .. EP_NET_MAX_TAG */
  void *buf;
  size_t bytes;
  size_t got; /* receive: bytes that arrived (set once done) */
  int done;   /* set by test */
  void *req;  /* the engine's */
} ep_net_xfer_t;

#define EP_NET_MAX_TAG 4095

/* How an endpoint is opened: collective over the R ranks of the group. */
typedef struct {
  int rank, nranks;
  int device;      /* device engines: the CUDA device of this rank; -1 otherwise */
  double deadline; /* absolute (ep_now()) */
  /* The group's own exchange across hosts, for what an engine must share at open (NCCL's
   * unique id): every rank's `bytes` into recv[r * bytes]. NULL for an engine that opens on its
   * own (MPI: a duplicate of MPI_COMM_WORLD). */
  ep_status_t (*allgather)(void *ctx, const void *send, void *recv, size_t bytes);
  void *ctx;
  /* The caller's liveness check (may be NULL), for the waits an engine makes itself (NCCL:
   * communicator creation, a batch being enqueued): a dead peer fails them at once. */
  ep_status_t (*check)(void *ctx);
} ep_net_open_t;

struct ep_net_engine {
  const char *name;   /* "mpi", "nccl" (EP_MPI_LIB, EP_NCCL_LIB name their libraries) */
  bool device_memory; /* transfers are of device memory, ordered on a stream */
  /* Local: can the library be loaded here? EP_OK, or the reason (ep_last_error names the
   * library and what to set). Does not keep it loaded. */
  ep_status_t (*probe)(void);
  /* Collective. Loads the library (first endpoint of the process) and builds the endpoint. */
  ep_status_t (*open)(const ep_net_open_t *how, ep_net_t **out);
  /* clean: every rank closes together after a successful run (communicators freed, MPI
   * finalized when epcomm initialized it and this was its last endpoint). !clean: after a
   * failure: abandon what is in flight, never wait for a peer. Always frees. */
  void (*close)(ep_net_t *n, bool clean);
  /* Starts the transfers; `stream`: device engines enqueue them on it (cudaStream_t), and return
   * only once they are on it, so that later work on the stream follows them. On error nothing
   * of the batch is in flight. */
  ep_status_t (*post)(ep_net_t *n, ep_net_xfer_t *x, int count, void *stream);
  /* Never blocks: sets x[i].done (and .got) for the transfers that completed, *ndone to how
   * many of the `count` are done. An engine may complete a batch only as a whole. A failed
   * transfer returns EP_ERR_PEER_FAILED (or EP_ERR_SYSTEM) with a message naming its peer. */
  ep_status_t (*test)(ep_net_t *n, ep_net_xfer_t *x, int count, int *ndone);
  /* After a failure or a deadline: let go of the posted transfers that are not done (receives
   * are cancelled, sends abandoned); their buffers may be freed afterwards. */
  void (*cancel)(ep_net_t *n, ep_net_xfer_t *x, int count);
  /* Optional: may a thread of epcomm's own post and test while the program's threads use the
   * engine too (MPI: only at MPI_THREAD_MULTIPLE)? NULL: no. */
  bool (*own_threads_ok)(void);
};

/* The engine of that name (NULL: not built into this library; ep_last_error says so). */
const struct ep_net_engine *ep_net_find(const char *name);
/* The engines (one getter per engine module). */
const struct ep_net_engine *ep_net_mpi(void);
const struct ep_net_engine *ep_net_nccl(void); /* built with the CUDA backend only */

/* The engine that carries a group's own exchanges across hosts (its bootstrap): MPI, which
 * every launcher that spans hosts (mpirun, srun --mpi=pmix) sets up. */
const struct ep_net_engine *ep_net_world_engine(void);

/* One wait over posted transfers: until all are done, the deadline passes, or `check` (the
 * caller's liveness check, may be NULL) fails. Sleeps in growing steps (never spins for long:
 * the ranks of an oversubscribed host need the cores). Names the first peer still pending on a
 * timeout: "<what>: deadline of 2.0 s passed waiting for rank 3 (host 1)". */
typedef ep_status_t (*ep_net_check_fn)(void *ctx);
ep_status_t ep_net_wait(const struct ep_net_engine *e, ep_net_t *n, ep_net_xfer_t *x, int count,
                        double deadline, double timeout_s, ep_net_check_fn check, void *ctx,
                        const char *what);

/* dlopen a library: the first of `names` that loads (the variable env_name wins when set). NULL and
 * ep_last_error() naming what was tried. RTLD_LOCAL: nothing of it leaks into the process. */
void *ep_net_dlopen(const char *env_name, const char *const *names, char *loaded, size_t n);

#endif
