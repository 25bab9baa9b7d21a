/* Peer liveness for ranks on this host: a pidfd per peer (readable once the peer has exited, even
 * before anyone reaps it) plus the launcher's notify socket, which says *how* a rank died.
 * Checking is a zero-timeout poll: cheap enough for wait loops every few milliseconds. */
#ifndef EP_CORE_LIVENESS_H
#define EP_CORE_LIVENESS_H

#include <sys/types.h>

typedef struct {
  int nranks, rank;
  int *pidfds;    /* -1 where unavailable (own rank, other host, old kernel) */
  pid_t *pids;
  int notify_fd;  /* EP_NOTIFY_FD or -1; not owned (the launcher's, shared by all groups) */
  int dead;       /* first dead rank seen, or -1 */
  char how[96];
} ep_live_t;

int ep_live_init(ep_live_t *l, int rank, int nranks, const pid_t *pids, const int *same_host,
                 int notify_fd);
/* Returns a dead rank or -1. Sticky: once a rank is dead it stays reported. */
int ep_live_check(ep_live_t *l);
void ep_live_fini(ep_live_t *l);

#endif
