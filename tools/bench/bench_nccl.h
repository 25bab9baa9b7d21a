/* NCCL for the flat GPU baseline across hosts (bench_nccl.c): a communicator over every rank and
 * one grouped ncclSend/ncclRecv per call, NCCL loaded with dlopen. The communicator is
 * non-blocking, so that its creation, each call's enqueue and its close wait until a deadline
 * (then abort) instead of for ever; the stream's transfers themselves are waited for by the
 * caller. Returns 0 / -1 (NULL on failure), with the reason in `why`. */
#ifndef EP_TOOLS_BENCH_NCCL_H
#define EP_TOOLS_BENCH_NCCL_H

#include <stddef.h>

#include "epcomm.h"

typedef struct bnccl bnccl_t;

/* Per peer q: bytes to send from send[q], bytes to receive into recv[q] (0: none). */
typedef struct {
  const char *const *send;
  char *const *recv;
  const size_t *send_bytes, *recv_bytes;
} bnccl_xfer_t;

/* Local: the library loaded and room for R ranks' ids. `timeout_s` bounds each later wait; keep
 * it well inside the group's own deadline, so that the peers of a rank that gave up reach the
 * agreement that follows before that rank's wait there expires (bench_cubase.c gives half). The
 * caller agrees on the result with its peers before bnccl_connect, so that a rank that failed
 * here leaves none of them waiting in the id exchange. */
bnccl_t *bnccl_new(int R, double timeout_s, char *why, size_t n);
/* Collective over the group: rank 0's unique id through ep_group_allgather (every rank takes
 * part, whatever happened on it), then the communicator, given up at the deadline. A rank can
 * fail here while its peers succeed: the caller agrees on the result before any transfer. */
int bnccl_connect(bnccl_t *b, ep_group_t g, int R, int me, char *why, size_t n);
/* One grouped send/receive on `stream` (cudaStream_t); returns once it is enqueued. */
int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n);
/* NULL-safe. clean: every rank got through its transfers (finalize, then destroy, within the
 * deadline); else, or when finalizing fails, the communicator is aborted (waits for no peer). */
void bnccl_close(bnccl_t *b, int clean);

#endif
