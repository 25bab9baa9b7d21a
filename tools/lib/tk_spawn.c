/* See tk_spawn.h. Between fork and exec the child calls only async-signal-safe functions (and
 * strerror, safe here because every caller is single-threaded at that point). */
#include "tk_spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tk_clock.h"

int tk_pipe(int fds[2]) {
  return pipe2(fds, O_CLOEXEC) ? errno : 0;
}

static void put(int fd, const char *s) {
  size_t n = strlen(s);
  while (n > 0) {
    ssize_t k = write(fd, s, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return;
    s += k, n -= (size_t)k;
  }
}

static int set_stream(int want, int target) {
  if (want == TK_FD_INHERIT) return 0;
  int fd = want == TK_FD_NULL ? open("/dev/null", target ? O_WRONLY : O_RDONLY) : want;
  if (fd < 0 || dup2(fd, target) < 0) return errno;
  if (want == TK_FD_NULL && fd != target) close(fd);
  return 0;
}

static _Noreturn void child_fail(const tk_spawn_t *s, int status_fd, int err) {
  if (s->fail_prefix) {
    put(2, s->fail_prefix), put(2, "cannot run '"), put(2, s->argv[0]), put(2, "': ");
    put(2, strerror(err)), put(2, "\n");
  } else {
    while (write(status_fd, &err, sizeof err) < 0 && errno == EINTR) {
    }
  }
  _exit(127);
}

static _Noreturn void child(const tk_spawn_t *s, int status_fd) {
  int err = 0;
  if (s->new_group) setpgid(0, 0);
  if (s->child_setup) err = s->child_setup(s->ctx);
  if (!err) err = set_stream(s->fd_in, 0);
  if (!err) err = set_stream(s->fd_out, 1);
  if (!err) err = set_stream(s->fd_err, 2);
  if (!err && s->keep_fd >= 0 && fcntl(s->keep_fd, F_SETFD, 0) < 0) err = errno;
  if (err) child_fail(s, status_fd, err);
  if (s->envp)
    s->search_path ? execvpe(s->argv[0], s->argv, s->envp) : execve(s->argv[0], s->argv, s->envp);
  else
    s->search_path ? execvp(s->argv[0], s->argv) : execv(s->argv[0], s->argv);
  child_fail(s, status_fd, errno);
}

/* The exec's verdict: the pipe closes on a successful exec (FD_CLOEXEC), or carries an errno. */
static int exec_verdict(int fd, pid_t pid) {
  int e = 0;
  ssize_t k;
  while ((k = read(fd, &e, sizeof e)) < 0 && errno == EINTR) {
  }
  close(fd);
  if (k != (ssize_t)sizeof e) return 0;
  while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
  }
  return e ? e : ECHILD;
}

int tk_spawn(const tk_spawn_t *s, pid_t *pid) {
  int st[2] = {-1, -1}, err = s->fail_prefix ? 0 : tk_pipe(st);
  if (err) return err;
  pid_t p = fork();
  if (p == 0) child(s, st[1]);
  err = p < 0 ? errno : 0;
  if (st[1] >= 0) close(st[1]);
  if (p > 0 && s->new_group) setpgid(p, p); /* here too: a signal right after fork must reach it */
  if (!err && st[0] >= 0)
    err = exec_verdict(st[0], p);
  else if (st[0] >= 0)
    close(st[0]);
  if (!err) *pid = p;
  return err;
}

int tk_wait_until(pid_t pid, double deadline, int group, int *status) {
  for (;;) {
    pid_t w = waitpid(pid, status, WNOHANG);
    if (w == pid) return 0;
    if (w < 0 && errno != EINTR) return errno;
    if (tk_now_s() > deadline) {
      kill(group ? -pid : pid, SIGTERM);
      sleep(2);
      kill(group ? -pid : pid, SIGKILL);
      while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
      }
      return ETIMEDOUT;
    }
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

int tk_self_dir(char *out, size_t n) {
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return 0;
  self[len] = '\0';
  char *slash = strrchr(self, '/');
  if (!slash) return 0;
  *slash = '\0';
  return snprintf(out, n, "%s", self) < (int)n;
}

int tk_mpirun_needs_agent(void) {
  char agent[PATH_MAX];
  return !getenv("OMPI_MCA_plm_rsh_agent") && !tk_find_exe("ssh", 0, agent, sizeof agent) &&
         !tk_find_exe("rsh", 0, agent, sizeof agent);
}

int tk_find_exe(const char *name, int beside, char *out, size_t n) {
  char dir[PATH_MAX];
  if (beside && tk_self_dir(dir, sizeof dir)) {
    snprintf(out, n, "%s/%s", dir, name);
    if (access(out, X_OK) == 0) return 1;
  }
  for (const char *path = getenv("PATH"); path && *path;) {
    const char *end = strchr(path, ':');
    size_t len = end ? (size_t)(end - path) : strlen(path);
    snprintf(out, n, "%.*s/%s", (int)len, path, name);
    if (len && access(out, X_OK) == 0) return 1;
    path = end ? end + 1 : NULL;
  }
  return 0;
}
