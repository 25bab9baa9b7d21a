/* NCCL for the flat GPU baseline across hosts (bench_nccl.c): a communicator over every rank and
 * one grouped ncclSend/ncclRecv per call, NCCL loaded with dlopen. Returns 0 / -1 and NULL on
 * failure, with the reason in `why`. */
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

/* Collective over the group (rank 0's unique id through ep_group_allgather). */
bnccl_t *bnccl_open(ep_group_t g, int R, int me, char *why, size_t n);
/* One grouped send/receive on `stream` (cudaStream_t); returns once it is enqueued. */
int bnccl_exchange(bnccl_t *b, const bnccl_xfer_t *x, int R, void *stream, char *why, size_t n);
void bnccl_close(bnccl_t *b); /* NULL-safe */

#endif
