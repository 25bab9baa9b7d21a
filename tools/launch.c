/* `epcomm launch`: start R local ranks of one program, like a small mpirun/torchrun.
 *
 * One single-threaded poll() loop owns everything: the ranks' stdout/stderr pipes (relayed line by
 * line with a "[r] " tag), a self-pipe fed by the signal handler (forwarded signals and SIGCHLD)
 * and the deadlines of the shutdown ladder (grace -> SIGTERM -> 3 s -> SIGKILL). Each rank also
 * holds one end of a socketpair (EP_NOTIFY_FD) on which the launcher writes "dead rank=..." lines
 * when a peer dies, so the library fails fast instead of waiting for its own timeout; the library
 * only peeks at them, so each is written once. EOF on that socket tells a rank that the launcher
 * itself is gone (and PR_SET_PDEATHSIG kills the ranks themselves then). The other way, a rank
 * writes "join" there when it starts to create a group and "up" once the group is complete:
 * from the first "join" until every rank is up, the launcher reports any rank's exit, status 0
 * included, to the others (they are waiting for it in their group creation and would otherwise
 * wait for their deadline). A program that never creates a group never hears of a clean exit.
 */
#include "launch.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "tk_clock.h"
#include "tk_rng.h"

static const char usage_text[] =
    "usage: epcomm launch -n R [--hosts H] [--timeout S] [--grace S] [--no-tag] [--] PROGRAM "
    "ARGS...";

/* --help: what each option does, and the two things users ask about: which deadline is which,
 * and where stdin goes. */
static const char help_text[] =
    "Starts R ranks of PROGRAM on this host, each with EP_RANK, EP_NRANKS, EP_LOCAL_RANK,\n"
    "EP_LOCAL_SIZE, EP_JOB_ID and EP_NOTIFY_FD set; relays their output line by line, tagged\n"
    "\"[r] \"; exits with the first failing rank's status (0 when all succeed).\n"
    "  -n R          number of ranks, 1 to 4096\n"
    "  --timeout S   wall-clock limit of the whole job in seconds (default: none); when it\n"
    "                passes, the ranks get SIGTERM, then SIGKILL after the grace period, and\n"
    "                the exit status is 124. Not to be confused with EP_TIMEOUT_S, the\n"
    "                library's deadline for each wait inside one epcomm call (default 100 s):\n"
    "                a rank waiting for a dead or stuck peer fails with EP_ERR_TIMEOUT naming\n"
    "                it, long before a generous --timeout ends the job.\n"
    "  --grace S     seconds the other ranks get to finish after one fails or a signal is\n"
    "                forwarded, and between SIGTERM and SIGKILL after --timeout (default 10)\n"
    "  --no-tag      relay the output without the \"[r] \" tags\n"
    "  --hosts H     split the R ranks into H pretend hosts (EP_HOSTS=H: consecutive ranks,\n"
    "                R/H per host) that talk only through the network engine, as on a\n"
    "                cluster. The engine is MPI, whose ranks mpirun must start: the launcher\n"
    "                then becomes `mpirun -n R --oversubscribe --bind-to none` (shared\n"
    "                memory transport) with the same program, --timeout passed on, output\n"
    "                tagged by mpirun (\"[1,r]<stdout>:\"); deaths and exits are mpirun's\n"
    "                to report. CUDA buffers talk through NCCL between the pretend hosts,\n"
    "                each rank its own NCCL host over loopback (NCCL_HOSTID, set by the\n"
    "                library unless you set it). Real hosts: run mpirun --hostfile or srun\n"
    "                yourself.\n"
    "  --            ends the options: everything after it is PROGRAM and its arguments\n"
    "stdin: rank 0 reads the launcher's stdin when that is a pipe or a file (`cmd | epcomm\n"
    "launch ...`, `< file`), as mpirun forwards it; the other ranks read /dev/null, and so does\n"
    "rank 0 when stdin is a terminal (a rank runs in its own process group, and reading the\n"
    "terminal from there would stop it). Signals (Ctrl-C, SIGTERM) reach every rank.\n";

/* Signals we catch. The first four are forwarded to the ranks; SIGPIPE is ignored so that a closed
 * stdout or a dead rank's notify socket returns EPIPE instead of killing the launcher (and
 * orphaning the ranks). */
const int launch_handled_sigs[N_HANDLED] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE};

/* The only global: a signal handler can reach state only through a static. It holds the write end
 * of the self-pipe, so the handler does nothing but one write(), which is async-signal-safe. */
static volatile sig_atomic_t sig_wr_fd = -1;

/* Blocks until everything is written; a vanished reader (EPIPE) just drops the output. */
void launch_write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) { /* an O_NONBLOCK stdout we inherited: wait, never drop */
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      if (poll(&pf, 1, -1) >= 0 || errno == EINTR) continue;
    }
    if (w <= 0) return;
    p += w;
    n -= (size_t)w;
  }
}

void launch_say(const char *fmt, ...) {
  char b[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  if (n > 0) launch_write_all(2, b, (size_t)n < sizeof b ? (size_t)n : sizeof b - 1);
}

static void ob_flush(struct outbuf *o) {
  launch_write_all(o->fd, o->data, o->len);
  o->len = 0;
}

static void ob_put(struct outbuf *o, const char *p, size_t n) {
  if (o->len + n > sizeof o->data) ob_flush(o);
  if (n > sizeof o->data) {
    launch_write_all(o->fd, p, n);
    return;
  }
  memcpy(o->data + o->len, p, n);
  o->len += n;
}

void launch_close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  char b[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  launch_say("epcomm launch: %s; %s\n", b, usage_text);
  return EXIT_USAGE;
}

/* A number in [lo, hi] (or (0, hi] when lo is 0 and zero is not allowed); integral if asked. */
static bool parse_num(const char *s, double lo, double hi, bool integral, bool zero, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  bool ok = v >= lo && v <= hi && (zero || v != 0) && (!integral || v == (double)(long)v);
  if (errno || end == s || *end || !ok) return false; /* !ok also for NaN */
  *out = v;
  return true;
}

/* Matches "NAME V", "NAME=V" and, for a short option, "-nV".
 * Returns 0: not this option, 1: *val set, -1: value missing. */
static int take_value(const char *name, int argc, char **argv, int *i, const char **val) {
  const char *a = argv[*i];
  size_t n = strlen(name);
  if (strncmp(a, name, n)) return 0;
  if (a[n] == '\0') {
    if (*i + 1 >= argc) return -1;
    *val = argv[++*i];
    return 1;
  }
  if (a[n] == '=')
    *val = a + n + 1;
  else if (name[1] != '-')
    *val = a + n;
  else
    return 0; /* "--timeoutX" is some other, unknown option */
  return 1;
}

/* Parses one option at argv[*i]. Returns -1 to go on, or an exit status. */
static int parse_option(struct launch *l, int argc, char **argv, int *i) {
  const char *a = argv[*i], *v = "";
  double x;
  int m;
  if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
    printf("%s\n%s", usage_text, help_text);
    return 0;
  }
  if (!strcmp(a, "--no-tag")) {
    l->tag = false;
    return -1;
  }
  if ((m = take_value("--hosts", argc, argv, i, &v)) != 0) {
    if (m < 0) return usage_error("option --hosts needs a value");
    if (!parse_num(v, 1, MAX_RANKS, true, false, &x))
      return usage_error("invalid --hosts '%s' (want an integer from 1 to %d)", v, MAX_RANKS);
    l->hosts = (int)x;
  } else if ((m = take_value("-n", argc, argv, i, &v)) != 0) {
    if (m < 0) return usage_error("option -n needs a value");
    if (!parse_num(v, 1, MAX_RANKS, true, false, &x))
      return usage_error("invalid -n '%s' (want an integer from 1 to %d)", v, MAX_RANKS);
    l->nranks = (int)x;
  } else if ((m = take_value("--timeout", argc, argv, i, &v)) != 0) {
    if (m < 0) return usage_error("option --timeout needs a value");
    if (!parse_num(v, 0, MAX_SECONDS, false, false, &l->timeout))
      return usage_error("invalid --timeout '%s' (want seconds > 0)", v);
  } else if ((m = take_value("--grace", argc, argv, i, &v)) != 0) {
    if (m < 0) return usage_error("option --grace needs a value");
    if (!parse_num(v, 0, MAX_SECONDS, false, true, &l->grace))
      return usage_error("invalid --grace '%s' (want seconds >= 0)", v);
  } else {
    return usage_error("unknown option '%s'", a);
  }
  return -1;
}

/* Options end at the first non-option or "--": PROGRAM's own options are never ours. */
static int parse_args(struct launch *l, int argc, char **argv) {
  l->grace = DEFAULT_GRACE_S;
  l->tag = true;
  int i = 1;
  for (; i < argc; i++) {
    if (!strcmp(argv[i], "--")) {
      i++;
      break;
    }
    if (argv[i][0] != '-' || argv[i][1] == '\0') break;
    int rc = parse_option(l, argc, argv, &i);
    if (rc >= 0) return rc;
  }
  if (l->nranks == 0) return usage_error("missing -n R");
  if (i >= argc) return usage_error("missing PROGRAM");
  if (l->hosts && l->nranks % l->hosts)
    return usage_error(
        "--hosts %d does not divide -n %d (every host holds the same number of "
        "ranks)",
        l->hosts, l->nranks);
  l->prog = argv + i;
  return -1;
}

/* Relays the complete lines in s->buf and keeps the incomplete tail. A full buffer, or EOF, sends
 * the tail as it is; EOF then ends it with the newline the rank never wrote. */
static void relay(struct launch *l, struct stream *s, bool eof) {
  struct outbuf *o = &l->ob[s->out];
  char tag[16];
  size_t tl = l->tag ? (size_t)snprintf(tag, sizeof tag, "[%d] ", s->rank) : 0;
  size_t start = 0;
  char *nl;
  while ((nl = memchr(s->buf + start, '\n', s->len - start)) != NULL) {
    size_t end = (size_t)(nl - s->buf) + 1;
    if (!s->midline) ob_put(o, tag, tl);
    ob_put(o, s->buf + start, end - start);
    s->midline = false;
    start = end;
  }
  if (start > 0) memmove(s->buf, s->buf + start, s->len - start);
  s->len -= start;
  if (s->len > 0 && (eof || s->len == s->cap)) {
    if (!s->midline) ob_put(o, tag, tl);
    ob_put(o, s->buf, s->len);
    s->midline = true;
    s->len = 0;
  }
  if (eof && s->midline) ob_put(o, "\n", 1);
  ob_flush(o);
}

static void stream_close(struct launch *l, struct stream *s) {
  if (s->fd < 0) return;
  relay(l, s, true);
  launch_close_fd(&s->fd);
  free(s->buf);
  s->buf = NULL;
  s->len = s->cap = 0;
  l->open_streams--;
}

static bool stream_grow(struct stream *s) {
  if (s->cap - s->len >= 4096 || s->cap >= LINE_MAX_BUF) return true;
  size_t cap = s->cap ? s->cap * 2 : 4096;
  char *b = realloc(s->buf, cap);
  if (!b) return s->cap > s->len; /* keep going with what we have, if anything */
  s->buf = b;
  s->cap = cap;
  return true;
}

/* Reads once. Returns 1: got data, 0: nothing now, -1: closed. */
static int stream_read(struct launch *l, struct stream *s) {
  if (!stream_grow(s)) {
    launch_say("epcomm launch: out of memory relaying rank %d's output\n", s->rank);
    stream_close(l, s);
    return -1;
  }
  ssize_t n = read(s->fd, s->buf + s->len, s->cap - s->len);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
  if (n <= 0) {
    stream_close(l, s);
    return -1;
  }
  s->len += (size_t)n;
  relay(l, s, false);
  return 1;
}

/* Signals each rank's whole process group, so that its descendants get it too. */
static void signal_all(struct launch *l, int sig) {
  for (int r = 0; r < l->started; r++) {
    if (!l->rk[r].live) continue;
    if (kill(-l->rk[r].pid, sig) < 0) kill(l->rk[r].pid, sig);
  }
}

/* Sends sig (0: none) to every live rank's group and arms the next rung of the ladder. */
static void escalate(struct launch *l, int sig, enum phase next, double wait_s) {
  if (sig) signal_all(l, sig);
  l->phase = next;
  l->phase_at = tk_now_s() + wait_s;
}

static void on_timeout(struct launch *l) {
  launch_say("epcomm launch: timeout after %g s; terminating ranks\n", l->timeout);
  l->timed_out = true;
  escalate(l, SIGTERM, PH_TERM, l->grace);
}

static void report_stuck(struct launch *l) {
  for (int r = 0; r < l->started; r++)
    if (l->rk[r].live)
      launch_say("epcomm launch: rank %d (pid %d) still alive after SIGKILL; giving up\n", r,
                 (int)l->rk[r].pid);
  l->gave_up = true;
}

static void advance_phase(struct launch *l) {
  if (l->phase == PH_GRACE)
    escalate(l, SIGTERM, PH_TERM, TERM_WAIT_S);
  else if (l->phase == PH_TERM)
    escalate(l, SIGKILL, PH_KILL, KILL_WAIT_S);
  else if (l->phase == PH_KILL)
    report_stuck(l);
}

static bool timeout_armed(const struct launch *l) {
  return l->timeout > 0 && !l->timed_out && l->phase <= PH_GRACE;
}

static void check_deadlines(struct launch *l) {
  if (l->live == 0) return;
  double t = tk_now_s();
  if (timeout_armed(l) && t >= l->timeout_at)
    on_timeout(l);
  else if (l->phase != PH_RUN && t >= l->phase_at)
    advance_phase(l);
}

/* Milliseconds until the next deadline, rounded up (waking early would only spin); -1: none. */
static int poll_timeout_ms(const struct launch *l) {
  double at = l->live == 0 ? l->drain_at : l->phase != PH_RUN ? l->phase_at : -1;
  if (l->live > 0 && timeout_armed(l) && (at < 0 || l->timeout_at < at)) at = l->timeout_at;
  if (at < 0) return -1;
  double ms = (at - tk_now_s()) * 1e3 + 1.0;
  return ms <= 0 ? 0 : ms >= INT_MAX ? INT_MAX : (int)ms;
}

static void describe(int st, char *how, size_t n) {
  if (WIFSIGNALED(st)) {
    const char *name = strsignal(WTERMSIG(st));
    snprintf(how, n, "killed by signal %d (%s)", WTERMSIG(st), name ? name : "?");
  } else {
    snprintf(how, n, "exited with status %d", WEXITSTATUS(st));
  }
}

/* Writes the news once to every other live rank. MSG_DONTWAIT: the launcher must never block on a
 * rank that does not read; a full socket just misses later news, the first line is what counts. */
static void notify_peers(struct launch *l, int dead, const char *how) {
  char msg[192];
  int n =
      snprintf(msg, sizeof msg, "dead rank=%d pid=%d how=%s\n", dead, (int)l->rk[dead].pid, how);
  if (n <= 0 || (size_t)n >= sizeof msg) return;
  for (int r = 0; r < l->started; r++) {
    struct rank *p = &l->rk[r];
    if (r == dead || !p->live || !p->notify_ok) continue;
    if (send(p->notify_fd, msg, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) != n) p->notify_ok = false;
  }
}

static const char early_exit[] = "exited with status 0 before its group was complete";

/* Someone waits to form a group with a rank that is gone without a word: say so. */
static bool early_exit_matters(const struct launch *l, const struct rank *p) {
  return l->joins > 0 && l->ups < l->nranks && !p->up;
}

/* The first "join": ranks that exited cleanly before it left without notice; give it now. */
static void on_first_join(struct launch *l) {
  for (int r = 0; r < l->started; r++)
    if (l->rk[r].exited_clean && early_exit_matters(l, &l->rk[r])) notify_peers(l, r, early_exit);
}

/* Reads what a rank said on its notify socket: "join ..." and "up ..." lines. */
static void notify_read(struct launch *l, int r) {
  struct rank *p = &l->rk[r];
  char buf[256];
  ssize_t n;
  while (p->notify_fd >= 0 && !p->notify_eof &&
         (n = recv(p->notify_fd, buf, sizeof buf, MSG_DONTWAIT)) != 0) {
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) p->notify_eof = true;
      return;
    }
    if (memmem(buf, (size_t)n, "join ", 5) && l->joins++ == 0) on_first_join(l);
    if (!p->up && memmem(buf, (size_t)n, "up ", 3)) p->up = true, l->ups++;
  }
  if (p->notify_fd >= 0 && !p->notify_eof) p->notify_eof = true; /* n == 0: its end closed */
}

static void rank_exited(struct launch *l, int r, int st) {
  struct rank *p = &l->rk[r];
  /* Its "up" and the others' may still sit in their sockets: read them before judging. */
  for (int k = 0; k < l->started; k++) notify_read(l, k);
  p->live = false;
  launch_close_fd(&p->notify_fd);
  if (--l->live == 0) l->drain_at = tk_now_s() + DRAIN_WAIT_S;
  /* What it wrote is in its pipes already: relay that before announcing its death. Bounded, for
   * a descendant holding the pipe may keep writing. */
  for (int k = 0, i = 0; k < 2; k++, i = 0)
    while (p->s[k].fd >= 0 && i++ < 64 && stream_read(l, &p->s[k]) > 0) continue;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
    /* Not a failure of the job, but the others may be waiting for it to join their group. */
    p->exited_clean = true;
    if (early_exit_matters(l, p)) notify_peers(l, r, early_exit);
    return;
  }
  char how[96];
  describe(st, how, sizeof how);
  launch_say("epcomm launch: rank %d (pid %d) %s\n", r, (int)p->pid, how);
  if (l->status == 0) l->status = WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
  notify_peers(l, r, how);
  if (l->phase == PH_RUN) escalate(l, 0, PH_GRACE, l->grace);
}

/* waitpid(-1) is one call per death; scanning R pids per SIGCHLD made R=4096 quadratic. It cannot
 * steal anyone's child: ep_cmd_launch runs in the epcomm process, whose only children are ranks. */
static void reap_all(struct launch *l) {
  int st;
  pid_t pid;
  while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
    for (int r = 0; r < l->started; r++)
      if (l->rk[r].live && l->rk[r].pid == pid) rank_exited(l, r, st);
  bool lost = pid < 0 && errno == ECHILD; /* ranks gone without a trace: never wait for them */
  for (int r = 0; lost && r < l->started; r++)
    if (l->rk[r].live) rank_exited(l, r, W_EXITCODE(EXIT_INTERNAL, 0));
}

static void forward_signal(struct launch *l, int sig) {
  if (l->got_signal == 0) l->got_signal = sig;
  if (l->phase == PH_RUN)
    escalate(l, sig, PH_GRACE, l->grace);
  else
    signal_all(l, sig);
}

static void handle_self_pipe(struct launch *l) {
  unsigned char b[64];
  ssize_t n;
  bool child = false;
  while ((n = read(l->sigpipe[0], b, sizeof b)) > 0)
    for (ssize_t i = 0; i < n; i++) {
      if (b[i] == SIGCHLD)
        child = true;
      else
        forward_signal(l, b[i]);
    }
  if (child) reap_all(l);
}

static int build_pollfds(struct launch *l) {
  int n = 0;
  l->pfd[n] = (struct pollfd){.fd = l->sigpipe[0], .events = POLLIN};
  l->pnotify[n] = -1;
  l->pstream[n++] = NULL;
  for (int r = 0; r < l->started; r++) {
    for (int k = 0; k < 2; k++) {
      struct stream *s = &l->rk[r].s[k];
      if (s->fd < 0) continue;
      l->pfd[n] = (struct pollfd){.fd = s->fd, .events = POLLIN};
      l->pnotify[n] = -1;
      l->pstream[n++] = s;
    }
    struct rank *p = &l->rk[r];
    if (p->notify_fd < 0 || p->notify_eof || p->up) continue; /* nothing after "up" matters */
    l->pfd[n] = (struct pollfd){.fd = p->notify_fd, .events = POLLIN};
    l->pnotify[n] = r;
    l->pstream[n++] = NULL;
  }
  return n;
}

static void run_loop(struct launch *l) {
  while ((l->live > 0 || l->open_streams > 0) && !l->gave_up) {
    if (l->live == 0 && tk_now_s() >= l->drain_at) break;
    int n = build_pollfds(l);
    int rc = poll(l->pfd, (nfds_t)n, poll_timeout_ms(l));
    if (rc < 0 && errno != EINTR && errno != EAGAIN) {
      launch_say("epcomm launch: poll: %s; killing ranks\n", strerror(errno));
      escalate(l, SIGKILL, PH_KILL, KILL_WAIT_S);
      if (l->status == 0) l->status = EXIT_INTERNAL;
      rc = 0;
    }
    for (int i = 1; i < n && rc > 0; i++) {
      if (!l->pfd[i].revents) continue;
      if (l->pnotify[i] >= 0)
        notify_read(l, l->pnotify[i]);
      else
        stream_read(l, l->pstream[i]);
    }
    if (rc > 0 && l->pfd[0].revents) handle_self_pipe(l);
    check_deadlines(l);
  }
  for (int r = 0; r < l->started; r++)
    for (int k = 0; k < 2; k++) stream_close(l, &l->rk[r].s[k]);
}

static void start_ranks(struct launch *l) {
  for (int r = 0; r < l->nranks; r++) {
    int err = launch_start_rank(l, r);
    if (!err) continue;
    launch_say("epcomm launch: cannot start rank %d: %s; terminating ranks\n", r, strerror(err));
    l->status = EXIT_INTERNAL;
    escalate(l, SIGTERM, PH_TERM, TERM_WAIT_S);
    return;
  }
  if (l->timeout > 0) l->timeout_at = tk_now_s() + l->timeout;
}

static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  ssize_t w = write(sig_wr_fd, &b, 1); /* a full pipe already holds a wake-up: dropping is fine */
  (void)w;
  errno = saved;
}

/* A signal ignored when we started (nohup, `cmd &` in a script) stays ignored and unforwarded.
 * One blocked when we started is unblocked: a blocked SIGCHLD would leave ranks unreaped. */
static void install_signals(struct launch *l) {
  sigemptyset(&l->handled);
  for (int i = 0; i < N_HANDLED; i++) sigaddset(&l->handled, launch_handled_sigs[i]);
  sigprocmask(SIG_UNBLOCK, &l->handled, &l->old_mask);
  for (int i = 0; i < N_HANDLED; i++) {
    int sig = launch_handled_sigs[i];
    struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(sig, NULL, &l->old_act[i]);
    if (sig == SIGPIPE) sa.sa_handler = SIG_IGN;
    if (sig == SIGCHLD) sa.sa_flags |= SA_NOCLDSTOP;
    if (sig != SIGCHLD && l->old_act[i].sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, NULL);
  }
}

static void restore_signals(struct launch *l) {
  for (int i = 0; i < N_HANDLED; i++) sigaction(launch_handled_sigs[i], &l->old_act[i], NULL);
  sigprocmask(SIG_SETMASK, &l->old_mask, NULL);
  sig_wr_fd = -1;
}

/* A closed 0, 1 or 2 would be handed out as a pipe end, then clobbered by dup2() in the child. */
static void ensure_std_fds(void) {
  for (int fd = 0; fd < 3; fd++)
    if (fcntl(fd, F_GETFD) < 0 && errno == EBADF && open("/dev/null", O_RDWR) < 0) return;
}

/* Three fds per rank stay open in the launcher; the ranks get the original limit back. */
static void raise_nofile(struct launch *l) {
  getrlimit(RLIMIT_NOFILE, &l->old_nofile);
  rlim_t want = (rlim_t)l->nranks * 3 + 64;
  struct rlimit lim = l->old_nofile;
  if (lim.rlim_cur >= want) return;
  lim.rlim_cur = lim.rlim_max < want ? lim.rlim_max : want;
  setrlimit(RLIMIT_NOFILE, &lim);
}

/* The job's secret: 256 random bits, as hex. Blocking getrandom (it only blocks before the
 * kernel's pool is first initialised): a guessable secret would be no secret. */
static int make_secret(struct launch *l) {
  unsigned char rnd[32];
  if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) return -1;
  for (size_t i = 0; i < sizeof rnd; i++) snprintf(l->secret + 2 * i, 3, "%02x", rnd[i]);
  return 0;
}

/* pid plus 64 random bits: unique per launch, and only [0-9a-f-], safe in /dev/shm names. */
static void make_job_id(struct launch *l) {
  uint64_t rnd;
  if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    rnd = tk_mix64((uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 30 ^ (uintptr_t)l);
  }
  snprintf(l->job_id, sizeof l->job_id, "%ld-%016llx", (long)getpid(), (unsigned long long)rnd);
}

static int setup(struct launch *l) {
  ensure_std_fds();
  make_job_id(l);
  l->self = getpid();
  l->ob[0].fd = 1;
  l->ob[1].fd = 2;
  size_t slots = (size_t)l->nranks * 3 + 1; /* self-pipe, then per rank 2 pipes + notify */
  l->rk = calloc((size_t)l->nranks, sizeof *l->rk);
  l->pfd = calloc(slots, sizeof *l->pfd);
  l->pstream = calloc(slots, sizeof *l->pstream);
  l->pnotify = calloc(slots, sizeof *l->pnotify);
  if (!l->rk || !l->pfd || !l->pstream || !l->pnotify || make_secret(l) ||
      pipe2(l->sigpipe, O_CLOEXEC | O_NONBLOCK)) {
    launch_say("epcomm launch: cannot set up: %s\n", strerror(errno));
    return -1;
  }
  sig_wr_fd = l->sigpipe[1];
  raise_nofile(l);
  install_signals(l);
  return 0;
}

static void teardown(struct launch *l) {
  if (sig_wr_fd >= 0) {
    restore_signals(l);
    setrlimit(RLIMIT_NOFILE, &l->old_nofile);
    launch_close_fd(&l->sigpipe[0]);
    launch_close_fd(&l->sigpipe[1]);
  }
  for (int r = 0; r < l->started; r++) launch_close_fd(&l->rk[r].notify_fd);
  free(l->rk);
  free(l->pfd);
  free(l->pstream);
  free(l->pnotify);
  explicit_bzero(l->secret, sizeof l->secret);
}

/* The library unlinks its segments as soon as peers have mapped them; this catches what ranks
 * killed in between could not. The names carry the job id, so other jobs are never touched. */
static void clean_shm(const struct launch *l) {
  char prefix[64];
  int n = snprintf(prefix, sizeof prefix, "epcomm-%s", l->job_id);
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (!strncmp(e->d_name, prefix, (size_t)n)) unlinkat(dirfd(d), e->d_name, 0);
  closedir(d);
}

static int exit_status(const struct launch *l) {
  if (l->timed_out) return EXIT_TIMEOUT;
  if (l->status) return l->status;
  return l->got_signal ? 128 + l->got_signal : 0;
}

int ep_cmd_launch(int argc, char **argv) {
  struct launch l = {.sigpipe = {-1, -1}}; /* ~64 KiB, mostly the two output buffers */
  int rc = parse_args(&l, argc, argv);
  if (rc >= 0) return rc;
  if (l.hosts > 1) return launch_exec_mpirun(&l);
  rc = EXIT_INTERNAL;
  if (setup(&l) == 0) {
    start_ranks(&l);
    run_loop(&l);
    rc = exit_status(&l);
    clean_shm(&l);
  }
  teardown(&l);
  return rc;
}
