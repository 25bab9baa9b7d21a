/* Starting a child process with its standard streams on pipes, files or /dev/null: what
 * `epcomm launch` (one child per rank), `epcomm doctor run` (a command under observation) and
 * `epcomm bench` (mpirun for the MPI baseline) have in common. */
#ifndef EP_TK_SPAWN_H
#define EP_TK_SPAWN_H

#include <stddef.h>
#include <sys/types.h>

#define TK_FD_INHERIT (-1) /* the child keeps this process's stream */
#define TK_FD_NULL (-2)    /* the child's stream is /dev/null */

typedef struct {
  char *const *argv; /* argv[0]: a path, or a name searched on PATH when search_path */
  char *const *envp; /* NULL: this process's environment (as the child has it after setup) */
  int search_path;
  int fd_in, fd_out, fd_err; /* the child's 0, 1, 2: an open fd, TK_FD_INHERIT or TK_FD_NULL */
  int keep_fd;               /* an fd (normally FD_CLOEXEC) that the child keeps across exec; -1 */
  int new_group;             /* the child leads a process group of its own (killed as a whole) */
  /* Runs in the child first (after new_group): only async-signal-safe work, or work that is
   * safe because the parent is single-threaded. Non-zero: an errno, the child fails. */
  int (*child_setup)(void *ctx);
  void *ctx;
  /* NULL: a failed exec is reported to the parent (tk_spawn returns its errno, the child is
   * reaped). Else the child writes "<fail_prefix>cannot run '<argv[0]>': <reason>" to its
   * stderr and exits 127, as a shell would: for parents that relay the child's output. */
  const char *fail_prefix;
} tk_spawn_t;
#define TK_SPAWN_INIT \
  { NULL, NULL, 0, TK_FD_INHERIT, TK_FD_INHERIT, TK_FD_INHERIT, -1, 0, NULL, NULL, NULL }

/* Forks and execs. Returns 0 with *pid set, or an errno (nothing left running). Descriptors of
 * this process that are not FD_CLOEXEC leak into the child: open pipes with tk_pipe. */
int tk_spawn(const tk_spawn_t *s, pid_t *pid);

/* pipe2(O_CLOEXEC); 0 or an errno. */
int tk_pipe(int fds[2]);

/* Waits for pid until `deadline` (tk_now_s() seconds): returns 0 with *status set; on timeout
 * SIGTERM, 2 s later SIGKILL, to its process group when group (else to pid), then ETIMEDOUT;
 * other failures: an errno. */
int tk_wait_until(pid_t pid, double deadline, int group, int *status);

/* The directory of this program's executable (/proc/self/exe), for files installed beside it.
 * Returns 1 with it in out[n], else 0. */
int tk_self_dir(char *out, size_t n);

/* Where an executable `name` is: beside this program first when beside_self, then on PATH.
 * Returns 1 with the path in out[n], else 0. */
int tk_find_exe(const char *name, int beside_self, char *out, size_t n);

/* Whether an mpirun whose ranks are all on this host must be given `--mca plm_rsh_agent false`:
 * it starts no remote daemon, yet Open MPI refuses to start when its remote agent (ssh or rsh)
 * is missing, as in many containers. 0 when the user set OMPI_MCA_plm_rsh_agent. */
int tk_mpirun_needs_agent(void);

#endif
