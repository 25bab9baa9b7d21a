/* The NCCL engine: GPU memory across hosts, through grouped ncclSend/ncclRecv.
 *
 * epcomm never links NCCL: libnccl.so.2 (or EP_NCCL_LIB) is opened with dlopen when the first
 * endpoint is opened and its functions resolved with dlsym; nccl.h gives only their types
 * (through __typeof__), so no call binds to the library at link time.
 *
 * An endpoint is one communicator over every rank of the group, created non-blocking so that
 * its creation has the group's deadline: rank 0's unique id travels through the group's own
 * exchange, then ncclCommInitRankConfig returns at once and ncclCommGetAsyncError is polled.
 * A batch of transfers is one ncclGroupStart/ncclGroupEnd on the caller's stream followed by an
 * event; it is done when the event is. NCCL cannot cancel a transfer: after a failure the
 * communicator is aborted (close with clean = false), which also stops its kernels. */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/backend.h"
#include "net/net.h"

typedef struct {
  __typeof__(&ncclGetVersion) GetVersion;
  __typeof__(&ncclGetUniqueId) GetUniqueId;
  __typeof__(&ncclCommInitRankConfig) CommInitRankConfig;
  __typeof__(&ncclCommFinalize) CommFinalize;
  __typeof__(&ncclCommDestroy) CommDestroy;
  __typeof__(&ncclCommAbort) CommAbort;
  __typeof__(&ncclCommGetAsyncError) CommGetAsyncError;
  __typeof__(&ncclSend) Send;
  __typeof__(&ncclRecv) Recv;
  __typeof__(&ncclGroupStart) GroupStart;
  __typeof__(&ncclGroupEnd) GroupEnd;
  __typeof__(&ncclGetErrorString) GetErrorString;
  __typeof__(&ncclGetLastError) GetLastError;
} nccl_fns_t;

#define FN(name) \
  { "nccl" #name, offsetof(nccl_fns_t, name) }
static const struct {
  const char *sym;
  size_t off;
} symbols[] = {FN(GetVersion),  FN(GetUniqueId), FN(CommInitRankConfig), FN(CommFinalize),
               FN(CommDestroy), FN(CommAbort),   FN(CommGetAsyncError),  FN(Send),
               FN(Recv),        FN(GroupStart),  FN(GroupEnd),           FN(GetErrorString),
               FN(GetLastError)};
#undef FN

static const char *const lib_names[] = {"libnccl.so.2", "libnccl.so", NULL};

/* The process's NCCL library: loaded once, kept (RTLD_NODELETE: its proxy threads and exit
 * handlers must never point into unmapped code). Guarded by `lock`. */
static struct {
  pthread_mutex_t lock;
  void *dl;
  char path[256];
  nccl_fns_t f;
} lib = {PTHREAD_MUTEX_INITIALIZER, NULL, "", {0}};

static ep_status_t load(void) {
  pthread_mutex_lock(&lib.lock);
  ep_status_t st = EP_OK;
  if (!lib.dl) {
    void *dl = ep_net_dlopen("EP_NCCL_LIB", lib_names, lib.path, sizeof lib.path);
    if (!dl) st = EP_ERR_UNSUPPORTED;
    for (size_t i = 0; dl && !st && i < sizeof symbols / sizeof symbols[0]; i++) {
      void *p = dlsym(dl, symbols[i].sym);
      if (!p)
        st = ep_err(EP_ERR_UNSUPPORTED, "%s has no %s: NCCL 2.19 or later is needed", lib.path,
                    symbols[i].sym);
      memcpy((char *)&lib.f + symbols[i].off, &p, sizeof p);
    }
    if (dl && st)
      dlclose(dl);
    else if (dl)
      lib.dl = dl, dlopen(lib.path, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  }
  pthread_mutex_unlock(&lib.lock);
  return st;
}

struct ep_net {
  ncclComm_t comm;
  int rank, nranks, device;
  double timeout_s; /* the group's, from open: bounds the wait for a batch to be enqueued */
  ep_status_t (*check)(void *ctx); /* the caller's liveness check (NULL: none) */
  void *check_ctx;
};

/* What a posted batch keeps, in x[0].req. */
typedef struct {
  cudaEvent_t ev;
  cudaStream_t stream;
  int enqueued; /* ncclGroupEnd finished (a non-blocking communicator may need polling first) */
} batch_t;

static ep_status_t nccl_fail(ep_status_t st, const char *what, ncclResult_t r, ep_net_t *n) {
  const char *last = lib.f.GetLastError ? lib.f.GetLastError(n ? n->comm : NULL) : "";
  return ep_err(st, "NCCL %s: %s%s%s", what, lib.f.GetErrorString(r), last && *last ? ": " : "",
                last ? last : "");
}

static ep_status_t nccl_probe(void) {
  char path[256];
  void *dl = ep_net_dlopen("EP_NCCL_LIB", lib_names, path, sizeof path);
  if (!dl) return EP_ERR_UNSUPPORTED;
  bool ok = dlsym(dl, "ncclCommInitRankConfig") && dlsym(dl, "ncclSend");
  dlclose(dl);
  return ok ? EP_OK : ep_err(EP_ERR_UNSUPPORTED, "%s lacks ncclSend/ncclCommInitRankConfig", path);
}

static void nap(void) {
  struct timespec ts = {0, 200 * 1000};
  nanosleep(&ts, NULL);
}

/* A non-blocking communicator is ready when its async state leaves ncclInProgress. */
static ep_status_t wait_ready(ep_net_t *n, double deadline, const char *what) {
  for (unsigned naps = 0;; naps++) {
    ncclResult_t a = ncclInProgress;
    ncclResult_t r = lib.f.CommGetAsyncError(n->comm, &a);
    if (r != ncclSuccess) return nccl_fail(EP_ERR_SYSTEM, what, r, n);
    if (a == ncclSuccess) return EP_OK;
    if (a != ncclInProgress) return nccl_fail(EP_ERR_PEER_FAILED, what, a, n);
    if (ep_now() >= deadline)
      return ep_err(EP_ERR_TIMEOUT,
                    "NCCL %s: not done before the deadline (a rank did not join, "
                    "or no network path: see `epcomm doctor env`)",
                    what);
    /* Every 10 ms or so: a peer that died will never join (the check names it). */
    ep_status_t live = n->check && naps % 50 == 49 ? n->check(n->check_ctx) : EP_OK;
    if (live) return live;
    nap();
  }
}

static ep_status_t exchange_id(const ep_net_open_t *how, ncclUniqueId *id) {
  ncclUniqueId mine;
  memset(&mine, 0, sizeof mine);
  if (how->rank == 0) {
    ncclResult_t r = lib.f.GetUniqueId(&mine);
    if (r != ncclSuccess) return nccl_fail(EP_ERR_SYSTEM, "ncclGetUniqueId", r, NULL);
  }
  ncclUniqueId *all = calloc((size_t)how->nranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_status_t st = how->allgather ? how->allgather(how->ctx, &mine, all, sizeof mine)
                                  : ep_err(EP_ERR_INTERNAL, "NCCL: no exchange for the unique id");
  if (!st) *id = all[0];
  free(all);
  return st;
}

/* Pretend hosts on one machine (EP_HOSTS, `epcomm launch --hosts`): NCCL would see a single host
 * and refuse two ranks on one GPU, so each rank claims a NCCL host of its own and NCCL talks
 * over loopback sockets, as it would over a cluster's network. Values the user set win; real
 * hosts (EP_HOST_ID or the hostname) are left alone. Before NCCL reads its environment. */
static void pretend_hosts(int rank) {
  if (ep_env_int("EP_HOSTS") <= 1) return;
  char id[48];
  snprintf(id, sizeof id, "epcomm-pretend-rank-%d", rank);
  setenv("NCCL_HOSTID", id, 0);
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  setenv("NCCL_IB_DISABLE", "1", 0); /* loopback: no adapter between pretend hosts */
  setenv("NCCL_NVLS_ENABLE", "0", 0);
}

static ep_status_t nccl_open(const ep_net_open_t *how, ep_net_t **out) {
  pretend_hosts(how->rank);
  ep_status_t st = load();
  if (st) return st;
  ep_net_t *n = calloc(1, sizeof *n);
  if (!n) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  n->rank = how->rank, n->nranks = how->nranks, n->device = how->device;
  n->timeout_s = how->deadline - ep_now() > 1.0 ? how->deadline - ep_now() : 1.0;
  n->check = how->check, n->check_ctx = how->ctx;
  ncclUniqueId id;
  if (how->device >= 0 && cudaSetDevice(how->device) != cudaSuccess)
    st = ep_err(EP_ERR_CUDA, "NCCL: cudaSetDevice(%d) failed", how->device);
  if (!st) st = exchange_id(how, &id);
  if (!st) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* so that creation has a deadline */
    ncclResult_t r = lib.f.CommInitRankConfig(&n->comm, how->nranks, id, how->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
      st = nccl_fail(EP_ERR_SYSTEM, "ncclCommInitRank", r, n);
    else
      st = wait_ready(n, how->deadline, "ncclCommInitRank");
  }
  if (st) {
    if (n->comm) lib.f.CommAbort(n->comm);
    free(n);
    return st;
  }
  *out = n;
  return EP_OK;
}

static void nccl_close(ep_net_t *n, bool clean) {
  if (!n) return;
  ncclResult_t r = ncclSuccess;
  /* Finalize flushes what is in flight and says goodbye to the peers; bounded, then abort. */
  if (clean && (r = lib.f.CommFinalize(n->comm)) == ncclSuccess)
    clean = wait_ready(n, ep_now() + 30.0, "ncclCommFinalize") == EP_OK;
  if (clean && r == ncclSuccess)
    lib.f.CommDestroy(n->comm);
  else
    lib.f.CommAbort(n->comm);
  free(n);
}

static ep_status_t nccl_post(ep_net_t *n, ep_net_xfer_t *x, int count, void *stream) {
  if (count == 0) return EP_OK;
  batch_t *b = calloc(1, sizeof *b);
  if (!b) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  b->stream = (cudaStream_t)stream;
  if (cudaEventCreateWithFlags(&b->ev, cudaEventDisableTiming) != cudaSuccess) {
    free(b);
    return ep_err(EP_ERR_CUDA, "NCCL batch: cudaEventCreate failed");
  }
  lib.f.GroupStart();
  ncclResult_t r = ncclSuccess;
  for (int i = 0; i < count && (r == ncclSuccess || r == ncclInProgress); i++) {
    r = x[i].send ? lib.f.Send(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, n->comm, b->stream)
                  : lib.f.Recv(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, n->comm, b->stream);
    x[i].done = 0, x[i].got = 0, x[i].req = i ? NULL : b;
  }
  ncclResult_t e = lib.f.GroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = e;
  if (r != ncclSuccess && r != ncclInProgress) {
    cudaEventDestroy(b->ev);
    free(b);
    x[0].req = NULL;
    return nccl_fail(EP_ERR_SYSTEM, "grouped send/receive", r, n);
  }
  /* A non-blocking communicator may return before the batch is on the stream (its first
   * transfer to a peer connects first): wait, so that work the caller puts on the stream after
   * this call runs after the transfers. */
  ep_status_t w = EP_OK;
  if (r == ncclInProgress &&
      (w = wait_ready(n, ep_now() + n->timeout_s, "grouped send/receive (enqueue)")) != EP_OK) {
    cudaEventDestroy(b->ev);
    free(b);
    x[0].req = NULL;
    return w;
  }
  b->enqueued = 1;
  cudaEventRecord(b->ev, b->stream);
  return EP_OK;
}

static void batch_free(ep_net_xfer_t *x) {
  batch_t *b = x[0].req;
  if (b) cudaEventDestroy(b->ev), free(b);
  x[0].req = NULL;
}

static ep_status_t nccl_test(ep_net_t *n, ep_net_xfer_t *x, int count, int *ndone) {
  *ndone = 0;
  if (count == 0) return EP_OK;
  batch_t *b = x[0].req;
  if (!b) { /* done before */
    *ndone = count;
    return EP_OK;
  }
  ncclResult_t a = ncclSuccess;
  lib.f.CommGetAsyncError(n->comm, &a);
  if (a != ncclSuccess && a != ncclInProgress)
    return nccl_fail(EP_ERR_PEER_FAILED, "transfer", a, n);
  if (!b->enqueued) {
    if (a == ncclInProgress) return EP_OK;
    b->enqueued = 1;
    cudaEventRecord(b->ev, b->stream);
  }
  cudaError_t q = cudaEventQuery(b->ev);
  if (q == cudaErrorNotReady) return EP_OK;
  if (q != cudaSuccess) return ep_err(EP_ERR_CUDA, "NCCL batch: %s", cudaGetErrorString(q));
  for (int i = 0; i < count; i++) x[i].done = 1, x[i].got = x[i].send ? 0 : x[i].bytes;
  batch_free(x);
  *ndone = count;
  return EP_OK;
}

/* NCCL cannot take a transfer back: the batch's bookkeeping goes; the communicator must then be
 * closed with clean = false (abort). */
static void nccl_cancel(ep_net_t *n, ep_net_xfer_t *x, int count) {
  (void)n;
  if (count > 0) batch_free(x);
  for (int i = 0; i < count; i++) x[i].done = 1;
}

static const struct ep_net_engine nccl_engine = {
    .name = "nccl",
    .device_memory = true,
    .probe = nccl_probe,
    .open = nccl_open,
    .close = nccl_close,
    .post = nccl_post,
    .test = nccl_test,
    .cancel = nccl_cancel,
};

const struct ep_net_engine *ep_net_nccl(void) {
  return &nccl_engine;
}
