/* Peer liveness for ranks on this host: a pidfd per peer (readable once the peer has exited, even
 * before anyone reaps it) plus the launcher's notify socket, which says *how* a rank died and
 * whose EOF says that the launcher itself is gone. Checking is a zero-timeout poll: cheap enough
 * for wait loops every few milliseconds. It starts before the group is complete: a notice about
 * a rank whose pid is not known yet counts too (the rank died before it could connect). */
#ifndef EP_CORE_LIVENESS_H
#define EP_CORE_LIVENESS_H

#include <pthread.h>
#include <stdbool.h>
#include <sys/types.h>

typedef struct {
  int nranks, rank;
  int *pidfds;   /* -1 where unavailable (own rank, other host, not known yet) */
  pid_t *pids;   /* 0 while unknown */
  int notify_fd; /* EP_NOTIFY_FD or -1; not owned (the launcher's, shared by all groups) */
  int dead;      /* first dead rank seen (this rank: its launcher died), or -1 */
  char how[96];  /* stays put once `dead` is set: later checks return at once */
  /* One check at a time: every channel's thread and the bootstrap check, and a check that sees
   * a rank exit waits up to 100 ms for the launcher to say how, rewriting `how` meanwhile. */
  pthread_mutex_t lock;
  bool ready; /* ep_live_init ran (the lock exists) */
} ep_live_t;

int ep_live_init(ep_live_t *l, int rank, int nranks, int notify_fd);
/* Rank r's pid, once known (from SO_PEERCRED, then from the group's exchange). */
void ep_live_set_pid(ep_live_t *l, int r, pid_t pid, int same_host);
/* Returns a dead rank or -1. Sticky: once a rank is dead it stays reported. */
int ep_live_check(ep_live_t *l);
/* Whether a check saw this rank's own launcher die (the dead rank it named was this rank). */
bool ep_live_lost_launcher(ep_live_t *l);
void ep_live_fini(ep_live_t *l);

#endif
