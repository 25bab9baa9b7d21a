/* Starting one rank of `epcomm launch`: its environment, pipes and notify socket, fork, exec. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "launch.h"
#include "tk_spawn.h"

static bool is_own_var(const char *e) {
  static const char *const own[] = {
      "EP_RANK=",   "EP_NRANKS=",    "EP_LOCAL_RANK=", "EP_LOCAL_SIZE=",
      "EP_JOB_ID=", "EP_NOTIFY_FD=", "EP_JOB_SECRET="};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
    if (!strncmp(e, own[i], strlen(own[i]))) return true;
  return false;
}

/* The rank's environment: ours minus stale EP_* rank variables, plus this rank's. Built before
 * fork() so that the child does no allocation (the caller's env strings are shared, not copied). */
static char **build_env(const struct launch *l, int r, int notify_fd) {
  extern char **environ;
  size_t n = 0, k = 0;
  while (environ[n]) n++;
  size_t ptrs = (n + 8) * sizeof(char *), room = 400;
  char **env = malloc(ptrs + room);
  if (!env) return NULL;
  for (size_t i = 0; i < n; i++)
    if (!is_own_var(environ[i])) env[k++] = environ[i];
  char *p = (char *)env + ptrs;
  int len = snprintf(p, room,
                     "EP_RANK=%d%cEP_NRANKS=%d%cEP_LOCAL_RANK=%d%cEP_LOCAL_SIZE=%d%c"
                     "EP_JOB_ID=%s%cEP_NOTIFY_FD=%d%cEP_JOB_SECRET=%s",
                     r, 0, l->nranks, 0, r, 0, l->nranks, 0, l->job_id, 0, notify_fd, 0, l->secret);
  for (int v = 0; v < 7 && len > 0; v++, p += strlen(p) + 1) env[k++] = p;
  env[k] = NULL;
  return env;
}

/* In the child, first (before the streams are set and exec): async-signal-safe calls only. */
static int child_setup(void *ctx) {
  struct launch *l = ctx;
  /* A rank must not outlive the launcher (kill -9 of it would leave orphans computing forever):
   * the kernel kills it when we die. We may have died already, before the call: check. */
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != l->self) _exit(EXIT_INTERNAL);
  for (int i = 0; i < N_HANDLED; i++) sigaction(launch_handled_sigs[i], &l->old_act[i], NULL);
  sigprocmask(SIG_SETMASK, &l->old_mask, NULL);
  setrlimit(RLIMIT_NOFILE, &l->old_nofile);
  return 0;
}

/* Starts rank r: its own process group, stdout and stderr on the launcher's pipes, the notify end
 * kept across exec. Every other launcher fd has FD_CLOEXEC. Signals stay blocked across fork()
 * so that the child never runs our handler (it would write into the launcher's self-pipe) before
 * it restores the original dispositions. A failed exec is a rank that says why on its stderr
 * (relayed with its tag) and exits 127. */
static int fork_rank(struct launch *l, int r, int fds[6], char **env) {
  /* stdin: rank 0 keeps a pipe or file (as mpirun forwards stdin to rank 0); everyone else gets
   * /dev/null: R ranks sharing one stdin would split its input at random, and a rank in its own
   * (background) process group that read the terminal would be stopped by SIGTTIN. */
  bool keep_stdin = r == 0 && !isatty(STDIN_FILENO);
  tk_spawn_t sp = TK_SPAWN_INIT;
  sp.argv = l->prog, sp.envp = env, sp.search_path = 1, sp.new_group = 1;
  sp.fd_in = keep_stdin ? TK_FD_INHERIT : TK_FD_NULL, sp.fd_out = fds[1], sp.fd_err = fds[3];
  sp.keep_fd = fds[5], sp.child_setup = child_setup, sp.ctx = l;
  sp.fail_prefix = "epcomm launch: ";
  sigset_t run_mask;
  pid_t pid;
  sigprocmask(SIG_BLOCK, &l->handled, &run_mask);
  int err = tk_spawn(&sp, &pid);
  sigprocmask(SIG_SETMASK, &run_mask, NULL);
  if (err) return err;
  struct rank *p = &l->rk[r];
  *p = (struct rank){.pid = pid, .live = true, .notify_ok = true, .notify_fd = fds[4]};
  for (int k = 0; k < 2; k++) {
    p->s[k] = (struct stream){.fd = fds[2 * k], .out = k, .rank = r};
    fcntl(fds[2 * k], F_SETFL, O_NONBLOCK); /* a fresh pipe has no other status flags */
  }
  return 0;
}

/* fds: stdout pipe (read, write), stderr pipe (read, write), socketpair (launcher, rank). */
int launch_start_rank(struct launch *l, int r) {
  int fds[6] = {-1, -1, -1, -1, -1, -1}, err = 0;
  char **env = NULL;
  if (tk_pipe(fds) || tk_pipe(fds + 2) ||
      socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds + 4))
    err = errno;
  if (!err && !(env = build_env(l, r, fds[5]))) err = ENOMEM;
  if (!err) err = fork_rank(l, r, fds, env);
  free(env);
  for (int i = err ? 0 : 1; i < 6; i += err ? 1 : 2)
    launch_close_fd(&fds[i]); /* child ends, or all */
  if (err) return err;
  l->started++;
  l->live++;
  l->open_streams += 2;
  return 0;
}
