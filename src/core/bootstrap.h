/* Local bootstrap channel of a group: a star of Unix-domain stream sockets around rank 0, named in
 * the abstract namespace (nothing is ever created on a filesystem, so nothing can be left behind).
 * It carries the few setup exchanges (allgather of bytes, of file descriptors, barriers); the data
 * path never touches it. Every receive is bounded by a deadline and sees a peer's exit as EOF. */
#ifndef EP_CORE_BOOTSTRAP_H
#define EP_CORE_BOOTSTRAP_H

#include <stddef.h>

#include "epcomm.h"

typedef struct {
  int rank, nranks;
  int *socks; /* rank 0: socks[r] for every r > 0; others: socks[0] is the link to rank 0 */
  int listen_fd;
} ep_boot_t;

/* Collective. `deadline` is absolute (ep_now() seconds). */
ep_status_t ep_boot_open(ep_boot_t *b, const char *name, int rank, int nranks, double deadline);
ep_status_t ep_boot_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                              double deadline);
/* fds[r] receives a duplicate of rank r's fd (own fd dup'ed too). Caller closes them. */
ep_status_t ep_boot_allgather_fd(ep_boot_t *b, int fd, int *fds, double deadline);
ep_status_t ep_boot_barrier(ep_boot_t *b, double deadline);
/* Tell the others that this rank is giving up (best effort, never blocks), then close. */
void ep_boot_abort(ep_boot_t *b, ep_status_t why);
void ep_boot_close(ep_boot_t *b);
/* The rank named by the last failed exchange on this thread (-1: none). */
int ep_boot_failed_peer(void);

#endif
