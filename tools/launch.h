/* `epcomm launch` internals shared by tools/launch.c (the poll loop, signals, shutdown ladder)
 * and tools/launch_spawn.c (building a rank's environment and starting it). */
#ifndef EP_TOOLS_LAUNCH_H
#define EP_TOOLS_LAUNCH_H

#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/resource.h>
#include <sys/types.h>

#define MAX_RANKS 4096
#define DEFAULT_GRACE_S 10.0
#define TERM_WAIT_S 3.0        /* SIGTERM -> SIGKILL once the grace period is over */
#define KILL_WAIT_S 5.0        /* SIGKILL -> give up: only a process stuck in the kernel stays */
#define DRAIN_WAIT_S 1.0       /* all ranks reaped but descendants still hold their pipes */
#define MAX_SECONDS 1e9        /* keeps deadline arithmetic far from overflow */
#define LINE_MAX_BUF (1 << 20) /* a longer line is relayed in pieces, tagged once */
#define EXIT_TIMEOUT 124
#define EXIT_USAGE 2
#define EXIT_INTERNAL 1

/* The signals the launcher catches (tools/launch.c says why each). */
#define N_HANDLED 6
extern const int launch_handled_sigs[N_HANDLED];

enum phase { PH_RUN, PH_GRACE, PH_TERM, PH_KILL };

struct stream {
  int fd;       /* read end of the rank's pipe; -1 after EOF */
  int out;      /* 0: relayed to stdout, 1: to stderr */
  int rank;     /* for the tag */
  bool midline; /* a piece of an over-long line went out already, with its tag */
  char *buf;    /* incomplete last line */
  size_t len, cap;
};

struct rank {
  pid_t pid;         /* also its process group id */
  bool live;         /* started, not yet reaped: only then can -pid not name someone else's group */
  bool notify_ok;    /* false after a short write: a torn line must not be followed by another */
  bool up;           /* said "up" on its notify socket: its first group is complete */
  bool exited_clean; /* reaped with status 0 */
  bool notify_eof;   /* its end of the notify socket is closed: nothing more to read */
  int notify_fd;     /* launcher's end of the socketpair; open until the rank is reaped */
  struct stream s[2];
};

struct outbuf {
  int fd;
  size_t len;
  char data[1 << 15]; /* one write() per batch keeps tagged lines whole in the output */
};

struct launch {
  int nranks, started, live, open_streams;
  int hosts; /* --hosts H: the ranks form H pretend hosts and run under mpirun (0: not set) */
  double timeout, grace; /* timeout 0: none */
  bool tag;
  char **prog; /* PROGRAM ARGS..., NULL-terminated (points into argv) */
  char job_id[48];
  char secret[72]; /* EP_JOB_SECRET: random per job, proves a rank to the others (hex) */
  pid_t self;      /* the launcher's pid: a rank whose parent is not this is an orphan */
  int joins, ups;  /* "join" lines received (ranks creating a group); ranks that said "up" */
  struct rank *rk;
  struct pollfd *pfd;
  struct stream **pstream; /* pstream[i] is what pfd[i] reads; NULL for the self-pipe and ... */
  int *pnotify;            /* ... notify sockets: pnotify[i] is the rank whose socket pfd[i] is */
  struct outbuf ob[2];
  enum phase phase;
  double timeout_at, phase_at, drain_at;
  int status;     /* first non-zero rank status, in reaping order */
  int got_signal; /* first forwarded signal */
  bool timed_out, gave_up;
  int sigpipe[2];
  struct sigaction old_act[N_HANDLED];
  sigset_t handled, old_mask; /* the signals in handled_sigs; the caller's mask */
  struct rlimit old_nofile;
};

void launch_write_all(int fd, const char *p, size_t n);
void launch_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void launch_close_fd(int *fd);
/* Starts rank r (pipes, notify socketpair, fork, exec); 0 or an errno. */
int launch_start_rank(struct launch *l, int r);

/* --hosts: becomes mpirun (tools/launch_hosts.c); returns only on failure, with the status. */
int launch_exec_mpirun(const struct launch *l);

#endif
