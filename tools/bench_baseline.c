/* The MPI_Alltoallv baseline, run by rank 0 after epcomm's measurement while the other ranks wait
 * in a group barrier (asleep in poll(), not spinning). epcomm itself never links MPI: the
 * baseline is its own program (bench/mpi_baseline.c, built when CMake finds MPI) that mpirun
 * starts on the same number of ranks with the same options and seed, so it moves the same data.
 * It checks itself with the same code as epcomm bench and writes its per-rank timings and output
 * digests to a file that is merged here. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

extern char **environ;

#define PROGRAM "epcomm-bench-mpi"

/* PROGRAM next to this executable, else on PATH. */
static int find_exe(const char *name, int beside_self, char *out, size_t n) {
  if (beside_self) {
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0) {
      self[len] = '\0';
      char *slash = strrchr(self, '/');
      if (slash) {
        *slash = '\0';
        snprintf(out, n, "%s/%s", self, name);
        if (access(out, X_OK) == 0) return 1;
      }
    }
  }
  const char *path = getenv("PATH");
  while (path && *path) {
    const char *end = strchr(path, ':');
    size_t len = end ? (size_t)(end - path) : strlen(path);
    snprintf(out, n, "%.*s/%s", (int)len, path, name);
    if (len && access(out, X_OK) == 0) return 1;
    path = end ? end + 1 : NULL;
  }
  return 0;
}

/* Under mpirun, this process carries its launcher's identity (OMPI_*, PMIX_*): a nested mpirun
 * must not see it, or it would think it is one of our ranks. */
static int keep_var(const char *kv, int under_mpi) {
  if (!under_mpi) return 1;
  if (!strncmp(kv, "OMPI_ALLOW_RUN_AS_ROOT", 22)) return 1;
  return strncmp(kv, "OMPI_", 5) && strncmp(kv, "PMIX_", 5) && strncmp(kv, "PMI_", 4) &&
         strncmp(kv, "ORTE_", 5) && strncmp(kv, "OPAL_", 5);
}

static char **child_env(void) {
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 3, sizeof *env);
  if (!env) return NULL;
  int under_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (keep_var(environ[i], under_mpi)) env[k++] = environ[i];
  if (geteuid() == 0) { /* OpenMPI refuses root without these; the bench is often run as root */
    if (!getenv("OMPI_ALLOW_RUN_AS_ROOT")) env[k++] = "OMPI_ALLOW_RUN_AS_ROOT=1";
    if (!getenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")) env[k++] = "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1";
  }
  return env;
}

static void add(char **argv, int *n, const char *s) { argv[(*n)++] = (char *)s; }

/* Runs mpirun; returns its wait status, or -1 (b->why says why). */
static int spawn(const bench_opts_t *o, int R, const char *mpirun, const char *prog,
                 const char *raw, const char *log, bench_baseline_t *b) {
  char nr[16], num[10][32];
  char *argv[64];
  int n = 0;
  snprintf(nr, sizeof nr, "%d", R);
  add(argv, &n, mpirun), add(argv, &n, "-n"), add(argv, &n, nr);
  /* Ranks float like epcomm's (never pinned two to one core); shared memory between them. */
  add(argv, &n, "--oversubscribe"), add(argv, &n, "--bind-to"), add(argv, &n, "none");
  if (!getenv("OMPI_MCA_btl")) add(argv, &n, "--mca"), add(argv, &n, "btl"), add(argv, &n, "self,vader");
  add(argv, &n, prog);
  const struct {
    const char *k;
    long v;
  } nums[] = {{"--tokens", o->tokens}, {"--hidden", o->hidden},   {"--topk", o->topk},
              {"--experts", o->experts}, {"--warmup", o->warmup}, {"--iters", o->iters}};
  for (int i = 0; i < 6; i++) {
    snprintf(num[i], sizeof num[i], "%ld", nums[i].v);
    add(argv, &n, nums[i].k), add(argv, &n, num[i]);
  }
  snprintf(num[6], sizeof num[6], "%llu", (unsigned long long)o->seed);
  add(argv, &n, "--seed"), add(argv, &n, num[6]);
  add(argv, &n, "--dtype"), add(argv, &n, o->dtype == BENCH_FP8 ? "fp8" : "bf16");
  add(argv, &n, "--routing"), add(argv, &n, bench_routing_name(o->routing));
  add(argv, &n, "--raw"), add(argv, &n, raw);
  argv[n] = NULL;
  char **env = child_env();
  int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (!env || fd < 0) {
    snprintf(b->why, sizeof b->why, "cannot prepare the baseline run: %s", strerror(errno));
    free(env);
    if (fd >= 0) close(fd);
    return -1;
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, 1), dup2(fd, 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    setpgid(0, 0); /* killable as a group on timeout */
    execve(mpirun, argv, env);
    _exit(127);
  }
  close(fd);
  free(env);
  if (pid < 0) {
    snprintf(b->why, sizeof b->why, "fork: %s", strerror(errno));
    return -1;
  }
  /* Bounded: the other ranks wait for us within the group's deadline. */
  double deadline = bench_now() + o->timeout_s * 0.9;
  int st = 0;
  for (;;) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) return st;
    if (w < 0 && errno != EINTR) {
      snprintf(b->why, sizeof b->why, "waitpid: %s", strerror(errno));
      return -1;
    }
    if (bench_now() > deadline) {
      kill(-pid, SIGTERM);
      sleep(2);
      kill(-pid, SIGKILL);
      waitpid(pid, &st, 0);
      snprintf(b->why, sizeof b->why, "timed out after %.0f s (log: %s)", o->timeout_s * 0.9, log);
      return -1;
    }
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

static int read_raw(const char *path, int R, int iters, bench_baseline_t *b) {
  FILE *f = fopen(path, "re");
  int ver = 0, r0 = 0, i0 = 0, ok = 0, good = 0;
  if (!f) return 0;
  if (fscanf(f, "epcomm-bench-mpi %d %d %d ok %d copy %lf", &ver, &r0, &i0, &ok, &b->copy_bytes) == 5 &&
      ver == 2 && r0 == R && i0 == iters) {
    good = 1;
    for (int r = 0; r < R && good; r++) {
      int rr;
      unsigned long long dx, dout;
      good = fscanf(f, " rank %d %d %llx %llx", &rr, &b->recv_rows[r], &dx, &dout) == 4 && rr == r;
      b->digest_x[r] = dx, b->digest_out[r] = dout;
      for (int i = 0; i < iters && good; i++)
        good = fscanf(f, "%lf %lf %lf", &b->t_dispatch[(size_t)r * iters + i],
                      &b->t_combine[(size_t)r * iters + i], &b->t_memcpy[(size_t)r * iters + i]) == 3;
    }
    if (good && fscanf(f, " msg %255[^\n]", b->why) != 1) b->why[0] = '\0';
  }
  fclose(f);
  b->ok = ok;
  return good;
}

void bench_baseline_run(const bench_opts_t *o, int R, bench_baseline_t *b) {
  memset(b, 0, sizeof *b);
  char prog[PATH_MAX], mpirun[PATH_MAX], dir[] = "/tmp/epcomm-bench.XXXXXX";
  char raw[PATH_MAX], log[PATH_MAX];
  if (!find_exe(PROGRAM, 1, prog, sizeof prog)) {
    snprintf(b->why, sizeof b->why, PROGRAM " was not built (CMake did not find MPI)");
    return;
  }
  if (!find_exe("mpirun", 0, mpirun, sizeof mpirun)) {
    snprintf(b->why, sizeof b->why, "mpirun is not on PATH");
    return;
  }
  if (!mkdtemp(dir)) {
    snprintf(b->why, sizeof b->why, "mkdtemp: %s", strerror(errno));
    return;
  }
  snprintf(raw, sizeof raw, "%s/raw", dir);
  snprintf(log, sizeof log, "%s/mpirun.log", dir);
  b->recv_rows = calloc((size_t)R, sizeof *b->recv_rows);
  b->digest_x = calloc((size_t)R, sizeof *b->digest_x);
  b->digest_out = calloc((size_t)R, sizeof *b->digest_out);
  b->t_dispatch = calloc((size_t)R * o->iters, sizeof *b->t_dispatch);
  b->t_combine = calloc((size_t)R * o->iters, sizeof *b->t_combine);
  b->t_memcpy = calloc((size_t)R * o->iters, sizeof *b->t_memcpy);
  if (!b->recv_rows || !b->digest_x || !b->digest_out || !b->t_dispatch || !b->t_combine ||
      !b->t_memcpy) {
    snprintf(b->why, sizeof b->why, "out of memory");
    return;
  }
  double t0 = bench_now();
  int st = spawn(o, R, mpirun, prog, raw, log, b);
  b->wall_s = bench_now() - t0;
  if (st == -1) return;
  if (!WIFEXITED(st) || (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 1)) {
    snprintf(b->why, sizeof b->why, "mpirun %s %d (log kept: %s)",
             WIFEXITED(st) ? "exited with status" : "killed by signal",
             WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), log);
    return;
  }
  if (!read_raw(raw, R, o->iters, b)) {
    snprintf(b->why, sizeof b->why, "no readable results from " PROGRAM " (log kept: %s)", log);
    return;
  }
  b->ran = 1;
  unlink(raw), unlink(log), rmdir(dir);
}

void bench_baseline_free(bench_baseline_t *b) {
  free(b->recv_rows), free(b->digest_x), free(b->digest_out);
  free(b->t_dispatch), free(b->t_combine), free(b->t_memcpy);
}
