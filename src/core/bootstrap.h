/* Local bootstrap channel of a group: a star of Unix-domain stream sockets around rank 0, named in
 * the abstract namespace (nothing is ever created on a filesystem, so nothing can be left behind).
 * It carries the few setup exchanges (allgather of bytes, of file descriptors, barriers); the data
 * path never touches it. Every wait is bounded by a deadline, sees a peer's exit as EOF, and
 * watches the group's liveness (launcher notices, pidfds) every few milliseconds.
 *
 * Authentication (docs/LIFECYCLE.md): rank 0 accepts a connection only from a process of its own
 * effective uid (SO_PEERCRED) whose hello carries an HMAC of the job key; a stray, silent or
 * malformed connection is dropped after a short read timeout, never read into the group, and
 * rank 0 keeps waiting for the real ranks. A peer sends its hello only to a listener of its own
 * uid and checks rank 0's answer, which proves the same key.
 *
 * Pairing: every exchange is part of one collective call of the group (ep_boot_begin) and every
 * frame names that call (operation, number, exchange within it), so ranks in different calls
 * fail with EP_ERR_MISMATCH naming both instead of pairing with the wrong call. */
#ifndef EP_CORE_BOOTSTRAP_H
#define EP_CORE_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "epcomm.h"
#include "liveness.h"
#include "secret.h"

#define EP_RENDEZVOUS_MAX 80
#define EP_BOOT_HELLO_BYTES 48

/* The collective calls that use the channel. */
enum ep_boot_op {
  EP_OP_NONE = 0,
  EP_OP_GROUP_CREATE,
  EP_OP_GROUP_BARRIER,
  EP_OP_GROUP_ALLGATHER,
  EP_OP_GROUP_DESTROY,
  EP_OP_BUFFER_CREATE,
  EP_OP_BUFFER_DESTROY,
  EP_OP_MEM_REGISTER,
  EP_OP_MEM_DEREGISTER,
  EP_OP_COUNT
};
const char *ep_boot_op_name(int op); /* "ep_group_barrier" */

typedef struct {
  int rank, nranks;
  int *socks; /* rank 0: socks[r] for every r > 0; others: socks[0] is the link to rank 0 */
  int listen_fd;
  uint8_t key[EP_KEY_BYTES];
  char name[EP_RENDEZVOUS_MAX];
  ep_live_t *live; /* watched during every wait (not owned) */
  int op;          /* the call in progress, stamped on every frame: operation, */
  uint32_t seq;    /* its number among the group's calls, */
  uint32_t step;   /* and the exchange within it */
  uint32_t next_seq;
} ep_boot_t;

/* Collective. `deadline` is absolute (ep_now() seconds). `live` is watched while waiting. */
ep_status_t ep_boot_open(ep_boot_t *b, const char *name, const uint8_t key[EP_KEY_BYTES], int rank,
                         int nranks, ep_live_t *live, double deadline);
/* Starts the next collective call of the group (its exchanges follow). */
void ep_boot_begin(ep_boot_t *b, int op);
/* Exchanges of the current call. `mine` is this rank's status for the call: non-zero when it
 * rejected its arguments; it still takes part, and then every other rank fails with
 * EP_ERR_PEER_INVALID naming it while this rank returns `mine` with its own message. */
ep_status_t ep_boot_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                              ep_status_t mine, double deadline);
/* fds[r] receives a duplicate of rank r's fd (own fd dup'ed too). Caller closes them. */
ep_status_t ep_boot_allgather_fd(ep_boot_t *b, int fd, int *fds, double deadline);
ep_status_t ep_boot_barrier(ep_boot_t *b, ep_status_t mine, double deadline);
/* Tell the others that this rank is giving up on the current call (best effort, never blocks). */
void ep_boot_abort(ep_boot_t *b, ep_status_t why);
void ep_boot_close(ep_boot_t *b);
/* The rank named by the last failed exchange on this thread (-1: none). */
int ep_boot_failed_peer(void);
/* The hello a peer of rank `rank` sends (EP_BOOT_HELLO_BYTES); exposed for the tests' impostors. */
size_t ep_boot_hello(void *out, const uint8_t key[EP_KEY_BYTES], const char *name, int rank,
                     int nranks);

#endif
