/* NCCL for the flat GPU baseline across hosts (bench_cubase.c): what a user of a cluster writes
 * without epcomm, one communicator over every rank and each rank's rows to each rank in one
 * grouped ncclSend/ncclRecv. NCCL is opened with dlopen (EP_NCCL_LIB, else libnccl.so.2), as the
 * library's engine does, so that `epcomm` links no NCCL; nccl.h gives only the types. Under
 * pretend hosts the library's engine has already given this process its own NCCL host. */
#include "bench_nccl.h"

#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef EP_HAVE_NCCL
#include <nccl.h>

/* What each rank tells the others at connect: whether it can go on, and rank 0's id. */
typedef struct {
  ncclUniqueId id;
  int32_t ok, pad;
} hello_t;

struct bnccl {
  void *dl;
  ncclComm_t comm;
  double timeout_s;
  hello_t *all; /* [R]: the id exchange's room, made before it (bnccl_new) */
  __typeof__(&ncclGetUniqueId) GetUniqueId;
  __typeof__(&ncclCommInitRankConfig) CommInitRankConfig;
  __typeof__(&ncclCommGetAsyncError) CommGetAsyncError;
  __typeof__(&ncclCommFinalize) CommFinalize;
  __typeof__(&ncclCommDestroy) CommDestroy;
  __typeof__(&ncclCommAbort) CommAbort;
  __typeof__(&ncclSend) Send;
  __typeof__(&ncclRecv) Recv;
  __typeof__(&ncclGroupStart) GroupStart;
  __typeof__(&ncclGroupEnd) GroupEnd;
  __typeof__(&ncclGetErrorString) GetErrorString;
};

static int load(bnccl_t *b, char *why, size_t n) {
  const char *lib = getenv("EP_NCCL_LIB");
  b->dl = dlopen(lib && *lib ? lib : "libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!b->dl) {
    snprintf(why, n, "no NCCL library (%s): set EP_NCCL_LIB", dlerror());
    return -1;
  }
#define SYM(f) (*(void **)&b->f = dlsym(b->dl, "nccl" #f)) != NULL
  if (!(SYM(GetUniqueId) && SYM(CommInitRankConfig) && SYM(CommGetAsyncError) &&
        SYM(CommFinalize) && SYM(CommDestroy) && SYM(CommAbort) && SYM(Send) && SYM(Recv) &&
        SYM(GroupStart) && SYM(GroupEnd) && SYM(GetErrorString))) {
    snprintf(why, n, "the NCCL library lacks a function of the baseline (NCCL 2.19 or later)");
    return -1;
  }
#undef SYM
  return 0;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A non-blocking communicator's last call (`what`, which returned r) until it is done, at most
 * timeout_s: 0, or -1 with why (NCCL's error, or the deadline). A short wait (a timed transfer's
 * enqueue) spins, so that the baseline's time is not the nap's; a long one (the communicator's
 * init, its finalize) naps between polls. */
static int settle(bnccl_t *b, ncclResult_t r, const char *what, char *why, size_t n) {
  const double until = now_s() + b->timeout_s;
  const struct timespec nap = {0, 100000};
  for (unsigned polls = 0; r == ncclInProgress; polls++) {
    if (polls >= 1000) nanosleep(&nap, NULL);
    const bool late = now_s() > until; /* before the poll: one that ends in time counts */
    ncclResult_t e = b->CommGetAsyncError(b->comm, &r);
    if (e != ncclSuccess) r = e;
    if (r == ncclInProgress && late) {
      snprintf(why, n, "%s: not done within %.0f s (half of --timeout)", what, b->timeout_s);
      return -1;
    }
  }
  if (r == ncclSuccess) return 0;
  snprintf(why, n, "%s: %s", what, b->GetErrorString(r));
  return -1;
}

bnccl_t *bnccl_new(int R, double timeout_s, char *why, size_t n) {
  bnccl_t *b = calloc(1, sizeof *b);
  if (b) b->all = calloc((size_t)R, sizeof *b->all);
  if (!b || !b->all) {
    snprintf(why, n, "out of memory");
    bnccl_close(b, 0);
    return NULL;
  }
  b->timeout_s = timeout_s;
  if (load(b, why, n) == 0) return b;
  bnccl_close(b, 0);
  return NULL;
}

int bnccl_connect(bnccl_t *b, ep_group_t g, int R, int me, char *why, size_t n) {
  hello_t mine;
  memset(&mine, 0, sizeof mine);
  mine.ok = 1;
  ncclResult_t r = ncclSuccess;
  if (me == 0 && (r = b->GetUniqueId(&mine.id)) != ncclSuccess) {
    snprintf(why, n, "ncclGetUniqueId: %s", b->GetErrorString(r));
    mine.ok = 0;
  }
  /* Every rank takes part in the exchange whatever happened here, so that none is left waiting,
   * and all give up together when rank 0 has no id. */
  if (ep_group_allgather(g, &mine, b->all, sizeof mine) != EP_OK) {
    snprintf(why, n, "exchanging NCCL's id: %s", ep_last_error());
    return -1;
  }
  if (!b->all[0].ok) {
    if (mine.ok) snprintf(why, n, "rank 0 has no NCCL id");
    return -1;
  }
  /* Non-blocking, so that a peer that never joins costs the deadline, not a hang. */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  r = b->CommInitRankConfig(&b->comm, R, b->all[0].id, me, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) b->comm = NULL;
  return settle(b, r, "ncclCommInitRank", why, n);
}

int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n) {
  ncclResult_t r = b->GroupStart();
  for (int q = 0; q < R && (r == ncclSuccess || r == ncclInProgress); q++) {
    if (x->send_bytes[q]) r = b->Send(x->send[q], x->send_bytes[q], ncclUint8, q, b->comm, stream);
    if ((r == ncclSuccess || r == ncclInProgress) && x->recv_bytes[q])
      r = b->Recv(x->recv[q], x->recv_bytes[q], ncclUint8, q, b->comm, stream);
  }
  ncclResult_t e = b->GroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = e;
  /* In progress: not yet on the stream (a first transfer to a peer connects first). */
  return settle(b, r, "grouped ncclSend/ncclRecv", why, n);
}

void bnccl_close(bnccl_t *b, int clean) {
  if (!b) return;
  char why[160];
  /* Finalize flushes what is in flight and waits for the peers' goodbyes, so only when every
   * rank got this far; a failed or unfinished one is said, and the communicator aborted. */
  if (b->comm && clean &&
      settle(b, b->CommFinalize(b->comm), "ncclCommFinalize", why, sizeof why) != 0) {
    fprintf(stderr, "epcomm bench: the NCCL baseline: %s\n", why);
    clean = 0;
  }
  if (b->comm && clean)
    b->CommDestroy(b->comm);
  else if (b->comm)
    b->CommAbort(b->comm);
  if (b->dl) dlclose(b->dl);
  free(b->all);
  free(b);
}

#else /* a build without nccl.h */

bnccl_t *bnccl_new(int R, double timeout_s, char *why, size_t n) {
  (void)R, (void)timeout_s;
  snprintf(why, n, "this build found no nccl.h");
  return NULL;
}
int bnccl_connect(bnccl_t *b, ep_group_t g, int R, int me, char *why, size_t n) {
  (void)b, (void)g, (void)R, (void)me;
  snprintf(why, n, "this build found no nccl.h");
  return -1;
}
int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n) {
  (void)b, (void)x, (void)R, (void)stream;
  snprintf(why, n, "this build found no nccl.h");
  return -1;
}
void bnccl_close(bnccl_t *b, int clean) {
  (void)b, (void)clean;
}
#endif
