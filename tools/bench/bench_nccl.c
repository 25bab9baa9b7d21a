/* NCCL for the flat GPU baseline across hosts (bench_cubase.c): what a user of a cluster writes
 * without epcomm, one communicator over every rank and each rank's rows to each rank in one
 * grouped ncclSend/ncclRecv. NCCL is opened with dlopen (EP_NCCL_LIB, else libnccl.so.2), as the
 * library's engine does, so that `epcomm` links no NCCL; nccl.h gives only the types. Under
 * pretend hosts the library's engine has already given this process its own NCCL host. */
#include "bench_nccl.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef EP_HAVE_NCCL
#include <nccl.h>

struct bnccl {
  void *dl;
  ncclComm_t comm;
  __typeof__(&ncclGetUniqueId) GetUniqueId;
  __typeof__(&ncclCommInitRank) CommInitRank;
  __typeof__(&ncclCommDestroy) CommDestroy;
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
  if (!(SYM(GetUniqueId) && SYM(CommInitRank) && SYM(CommDestroy) && SYM(Send) && SYM(Recv) &&
        SYM(GroupStart) && SYM(GroupEnd) && SYM(GetErrorString))) {
    snprintf(why, n, "the NCCL library lacks a function of the baseline (NCCL 2.19 or later)");
    return -1;
  }
#undef SYM
  return 0;
}

/* What each rank tells the others at open: whether NCCL loaded here, and rank 0's id. */
typedef struct {
  ncclUniqueId id;
  int32_t ok, pad;
} hello_t;

bnccl_t *bnccl_open(ep_group_t g, int R, int me, char *why, size_t n) {
  bnccl_t *b = calloc(1, sizeof *b);
  hello_t mine, *all = calloc((size_t)R, sizeof *all);
  memset(&mine, 0, sizeof mine);
  if (!b || !all) {
    snprintf(why, n, "out of memory");
    goto fail;
  }
  mine.ok = load(b, why, n) == 0;
  ncclResult_t r = ncclSuccess;
  if (mine.ok && me == 0 && (r = b->GetUniqueId(&mine.id)) != ncclSuccess) {
    snprintf(why, n, "ncclGetUniqueId: %s", b->GetErrorString(r));
    mine.ok = 0;
  }
  /* Every rank takes part in the exchange whatever happened here, so that none is left waiting,
   * and all give up together when one could not load NCCL. */
  if (ep_group_allgather(g, &mine, all, sizeof mine) != EP_OK) {
    snprintf(why, n, "exchanging NCCL's id: %s", ep_last_error());
    goto fail;
  }
  for (int q = 0; q < R; q++)
    if (!all[q].ok) {
      if (mine.ok) snprintf(why, n, "rank %d could not use NCCL", q);
      goto fail;
    }
  if ((r = b->CommInitRank(&b->comm, R, all[0].id, me)) != ncclSuccess) {
    snprintf(why, n, "ncclCommInitRank: %s", b->GetErrorString(r));
    b->comm = NULL;
    goto fail;
  }
  free(all);
  return b;
fail:
  free(all);
  bnccl_close(b);
  return NULL;
}

int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n) {
  ncclResult_t r = b->GroupStart();
  for (int q = 0; q < R && r == ncclSuccess; q++) {
    if (x->send_bytes[q]) r = b->Send(x->send[q], x->send_bytes[q], ncclUint8, q, b->comm, stream);
    if (r == ncclSuccess && x->recv_bytes[q])
      r = b->Recv(x->recv[q], x->recv_bytes[q], ncclUint8, q, b->comm, stream);
  }
  ncclResult_t e = b->GroupEnd();
  if (r == ncclSuccess) r = e;
  if (r == ncclSuccess) return 0;
  snprintf(why, n, "grouped ncclSend/ncclRecv: %s", b->GetErrorString(r));
  return -1;
}

void bnccl_close(bnccl_t *b) {
  if (!b) return;
  if (b->comm) b->CommDestroy(b->comm);
  if (b->dl) dlclose(b->dl);
  free(b);
}

#else /* a build without nccl.h */

bnccl_t *bnccl_open(ep_group_t g, int R, int me, char *why, size_t n) {
  (void)g, (void)R, (void)me;
  snprintf(why, n, "this build found no nccl.h");
  return NULL;
}
int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n) {
  (void)b, (void)x, (void)R, (void)stream;
  snprintf(why, n, "this build found no nccl.h");
  return -1;
}
void bnccl_close(bnccl_t *b) {
  (void)b;
}
#endif
