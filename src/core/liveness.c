#include "liveness.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define PROBE_PID (-2) /* pidfds[r] value: no pidfd, probe the pid with kill(pid, 0) */

static int pidfd_open_(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  errno = ENOSYS;
  return -1;
#endif
}

int ep_live_init(ep_live_t *l, int rank, int nranks, int notify_fd) {
  memset(l, 0, sizeof *l);
  l->rank = rank;
  l->nranks = nranks;
  l->notify_fd = notify_fd;
  l->dead = -1;
  pthread_mutex_init(&l->lock, NULL);
  l->ready = true;
  l->pidfds = malloc((size_t)nranks * sizeof(int));
  if (l->pidfds) /* before any failure: ep_live_fini closes what is not -1 */
    for (int r = 0; r < nranks; r++) l->pidfds[r] = -1;
  l->pids = calloc((size_t)nranks, sizeof(pid_t));
  return l->pidfds && l->pids ? 0 : -1;
}

static void set_pid(ep_live_t *l, int r, pid_t pid, int same_host) {
  if (r < 0 || r >= l->nranks || pid <= 0 || l->pids[r] == pid) return;
  if (l->pidfds[r] >= 0) close(l->pidfds[r]);
  l->pidfds[r] = -1;
  l->pids[r] = pid;
  if (r == l->rank || !same_host) return;
  int fd = pidfd_open_(pid);
  if (fd >= 0) {
    l->pidfds[r] = fd;
    return;
  }
  /* Older kernels (or valgrind) have no pidfd_open: probe the pid instead. */
  l->pidfds[r] = PROBE_PID;
  if (ep_log_enabled(EP_LOG_DEBUG))
    ep_log_at(EP_LOG_DEBUG, l->rank, "init",
              "no pidfd for rank %d (pid %d): %s; probing the "
              "pid instead",
              r, (int)pid, strerror(errno));
}

/* The launcher holds the other end of the notify socket for as long as it lives: a hang-up means
 * it is gone, and with it whoever would have reported deaths or stopped the job. */
static bool launcher_gone(const ep_live_t *l) {
  struct pollfd p = {l->notify_fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP));
}

/* "dead rank=2 pid=1234 how=killed by signal 9 (Killed)\n" lines from epcomm launch. Peeked,
 * never consumed: every group of this process reads the same socket. want: the rank whose
 * notice is wanted, or -1 for the first notice; `how` is written only for the one returned. */
static int check_notify(ep_live_t *l, int want) {
  if (l->notify_fd < 0) return -1;
  char buf[4096];
  ssize_t n = recv(l->notify_fd, buf, sizeof buf - 1, MSG_PEEK | MSG_DONTWAIT);
  if (n <= 0) return -1;
  buf[n] = '\0';
  for (char *line = buf; line && *line;) {
    char *nl = strchr(line, '\n');
    if (nl) *nl = '\0';
    int r, pid, off = 0;
    if (sscanf(line, "dead rank=%d pid=%d how=%n", &r, &pid, &off) == 2 && off > 0 && r >= 0 &&
        r < l->nranks && r != l->rank && (l->pids[r] == pid || l->pids[r] == 0) &&
        (want < 0 || r == want)) {
      snprintf(l->how, sizeof l->how, "%s", line + off);
      return r;
    }
    line = nl ? nl + 1 : NULL;
  }
  return -1;
}

/* Without a pidfd: gone (ESRCH) or a zombie nobody has reaped yet. Pid reuse within the life of
 * a group is not a concern: the launcher reaps promptly and the notice names the dead rank. */
static bool pid_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f) return true;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')');
  return p && (p[2] == 'Z' || p[2] == 'X');
}

void ep_live_set_pid(ep_live_t *l, int r, pid_t pid, int same_host) {
  if (!l->ready) return;
  pthread_mutex_lock(&l->lock);
  set_pid(l, r, pid, same_host);
  pthread_mutex_unlock(&l->lock);
}

static int check(ep_live_t *l) {
  if (l->dead >= 0) return l->dead;
  int r = check_notify(l, -1);
  if (r >= 0) return l->dead = r;
  if (l->notify_fd >= 0 && launcher_gone(l)) {
    snprintf(l->how, sizeof l->how, "lost its launcher: epcomm launch died (EOF on EP_NOTIFY_FD)");
    return l->dead = l->rank;
  }
  for (r = 0; r < l->nranks; r++) {
    bool gone = false;
    if (l->pidfds[r] == PROBE_PID) {
      gone = pid_gone(l->pids[r]);
    } else if (l->pidfds[r] >= 0) {
      struct pollfd p = {l->pidfds[r], POLLIN, 0};
      gone = poll(&p, 1, 0) > 0;
    }
    if (gone) {
      snprintf(l->how, sizeof l->how, "exited");
      /* The launcher, if any, is about to say how (signal or status): worth a short wait. */
      for (int i = 0; i < 20 && l->notify_fd >= 0 && check_notify(l, r) != r; i++)
        nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
      return l->dead = r;
    }
  }
  return -1;
}

int ep_live_check(ep_live_t *l) {
  if (!l->ready) return -1; /* set before any other thread can see l */
  pthread_mutex_lock(&l->lock);
  int r = check(l);
  pthread_mutex_unlock(&l->lock);
  return r;
}

bool ep_live_lost_launcher(ep_live_t *l) {
  if (!l->ready) return false;
  pthread_mutex_lock(&l->lock);
  bool lost = l->dead >= 0 && l->dead == l->rank;
  pthread_mutex_unlock(&l->lock);
  return lost;
}

void ep_live_fini(ep_live_t *l) {
  if (l->pidfds)
    for (int r = 0; r < l->nranks; r++)
      if (l->pidfds[r] >= 0) close(l->pidfds[r]);
  free(l->pidfds);
  free(l->pids);
  l->pidfds = NULL;
  l->pids = NULL;
  if (l->ready) pthread_mutex_destroy(&l->lock);
  l->ready = false;
}
