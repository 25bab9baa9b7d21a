/* The MPI_Alltoallv baseline, run by rank 0 after epcomm's measurement while the other ranks wait
 * in a group barrier (asleep in poll(), not spinning). epcomm itself never links MPI: the
 * baseline is its own program (bench/mpi_baseline.c, built when CMake finds MPI) that mpirun
 * starts on the same number of ranks with the same options and seed, so it moves the same data.
 * It checks itself with the same code as epcomm bench and writes every rank's results (the
 * packed form of bench_result.h) to a file that is merged here. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "tk_clock.h"
#include "tk_spawn.h"

extern char **environ;

#define PROGRAM "epcomm-bench-mpi"

/* Under mpirun, this process carries its launcher's identity (OMPI_*, PMIX_*): a nested mpirun
 * must not see it, or it would think it is one of our ranks. */
static int keep_var(const char *kv, int under_mpi) {
  if (!under_mpi) return 1;
  if (!strncmp(kv, "OMPI_ALLOW_RUN_AS_ROOT", 22)) return 1;
  if (!strncmp(kv, "OMPI_MCA_plm_rsh_agent=", 23)) return 1; /* the user's, for mpirun itself */
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

/* mpirun's command line: the same options as this run, results to `raw`. */
static void command(const bench_opts_t *o, int R, const char *mpirun, const char *prog,
                    const char *raw, char num[8][32], char **argv) {
  int n = 0;
  snprintf(num[0], 32, "%d", R);
  argv[n++] = (char *)mpirun, argv[n++] = "-n", argv[n++] = num[0];
  /* Ranks float like epcomm's (never pinned two to one core); shared memory between them. */
  argv[n++] = "--oversubscribe", argv[n++] = "--bind-to", argv[n++] = "none";
  if (!getenv("OMPI_MCA_btl")) argv[n++] = "--mca", argv[n++] = "btl", argv[n++] = "self,vader";
  if (tk_mpirun_needs_agent()) /* every rank of the baseline is local */
    argv[n++] = "--mca", argv[n++] = "plm_rsh_agent", argv[n++] = "false";
  argv[n++] = (char *)prog;
  const struct {
    const char *k;
    long v;
  } nums[] = {{"--tokens", o->tokens},   {"--hidden", o->hidden}, {"--topk", o->topk},
              {"--experts", o->experts}, {"--warmup", o->warmup}, {"--iters", o->iters}};
  for (int i = 0; i < 6; i++) {
    snprintf(num[i + 1], 32, "%ld", nums[i].v);
    argv[n++] = (char *)nums[i].k, argv[n++] = num[i + 1];
  }
  snprintf(num[7], 32, "%llu", (unsigned long long)o->seed);
  argv[n++] = "--seed", argv[n++] = num[7];
  argv[n++] = "--dtype", argv[n++] = (char *)bench_dtype_name(o->dtype);
  argv[n++] = "--routing", argv[n++] = (char *)bench_routing_name(o->routing);
  argv[n++] = "--raw", argv[n++] = (char *)raw;
  argv[n] = NULL;
}

/* Runs mpirun, bounded by 90% of the group's deadline (the other ranks wait for us within it);
 * returns its wait status, or -1 (b->why says why). */
static int spawn(const bench_opts_t *o, int R, const char *mpirun, const char *prog,
                 const char *raw, const char *log, bench_base_t *b) {
  char num[8][32], *argv[40];
  command(o, R, mpirun, prog, raw, num, argv);
  char **env = child_env();
  int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), st = 0, err;
  if (!env || fd < 0) {
    snprintf(b->why, sizeof b->why, "cannot prepare the baseline run: %s", strerror(errno));
    free(env);
    if (fd >= 0) close(fd);
    return -1;
  }
  tk_spawn_t sp = TK_SPAWN_INIT;
  sp.argv = argv, sp.envp = env, sp.fd_in = TK_FD_NULL, sp.fd_out = sp.fd_err = fd;
  sp.new_group = 1; /* killable as a group on timeout */
  pid_t pid;
  fflush(stdout);
  err = tk_spawn(&sp, &pid);
  close(fd);
  free(env);
  if (!err) err = tk_wait_until(pid, tk_now_s() + o->timeout_s * 0.9, 1, &st);
  if (!err) return st;
  if (err == ETIMEDOUT)
    snprintf(b->why, sizeof b->why, "timed out after %.0f s (log: %s)", o->timeout_s * 0.9, log);
  else
    snprintf(b->why, sizeof b->why, "cannot run %s: %s", mpirun, strerror(err));
  return -1;
}

/* The program's results: a header line, then every rank's packed results. */
static bench_rank_t **read_raw(const char *path, int R, int iters) {
  FILE *f = fopen(path, "re");
  int ver = 0, r0 = 0, ok = f != NULL;
  size_t sz = 0;
  ok = ok && fscanf(f, "epcomm-bench-mpi %d %d %zu", &ver, &r0, &sz) == 3 && fgetc(f) == '\n' &&
       ver == 3 && r0 == R && sz > 0 && sz < ((size_t)1 << 34);
  bench_rank_t **rk = ok ? calloc((size_t)R, sizeof *rk) : NULL;
  char *blob = ok ? malloc(sz) : NULL;
  ok = rk && blob;
  for (int r = 0; ok && r < R; r++)
    ok = fread(blob, 1, sz, f) == sz && (rk[r] = bench_rank_unpack(blob, sz)) &&
         rk[r]->iters == iters;
  if (f) fclose(f);
  free(blob);
  if (ok) return rk;
  for (int r = 0; rk && r < R; r++) bench_rank_free(rk[r]);
  free(rk);
  return NULL;
}

/* The baseline's rows into epcomm's results, rank by rank; its check and agreement into b. Across
 * hosts epcomm's combine adds each host's partial first (SEMANTICS.md §4.6), the flat baseline
 * rank by rank: the dispatches must be identical, the combines each pass their own check. */
static void merge(const bench_opts_t *o, int R, bench_rank_t **rk, bench_rank_t **br,
                  bench_base_t *b) {
  int same_combine = o->nhosts < 2;
  b->ran = b->ok = b->agree = 1;
  for (int r = 0; r < R; r++) {
    for (int i = 0; i < br[r]->nrows; i++) {
      const bench_row_t *w = &br[r]->row[i];
      int j = bench_row_add(rk[r], w->key, w->label, w->kind, w->group, w->bytes, w->wire);
      if (j >= 0)
        memcpy(bench_row_times(rk[r], j), bench_row_times(br[r], i), (size_t)rk[r]->iters * 8);
    }
    if (br[r]->bad && b->ok) snprintf(b->why, sizeof b->why, "%s", br[r]->msg), b->ok = 0;
    if (br[r]->recv_rows == rk[r]->recv_rows && br[r]->digest_x == rk[r]->digest_x &&
        (!same_combine || br[r]->digest_out == rk[r]->digest_out))
      continue;
    if (b->agree && b->ok)
      snprintf(b->why, sizeof b->why,
               "rank %d: the baseline's outputs differ from epcomm's (rows "
               "%d vs %d, digests %s)",
               r, br[r]->recv_rows, rk[r]->recv_rows,
               br[r]->digest_x != rk[r]->digest_x ? "of recv_x differ" : "of the combine differ");
    b->agree = 0;
  }
}

void bench_mpi_run(const bench_opts_t *o, int R, bench_rank_t **rk, bench_base_t *b) {
  char prog[PATH_MAX], mpirun[PATH_MAX], dir[] = "/tmp/epcomm-bench.XXXXXX";
  char raw[PATH_MAX], log[PATH_MAX];
  snprintf(b->name, sizeof b->name, "MPI baseline");
  if (!tk_find_exe(PROGRAM, 1, prog, sizeof prog)) {
    snprintf(b->why, sizeof b->why, PROGRAM " was not built (CMake did not find MPI)");
    return;
  }
  if (!tk_find_exe("mpirun", 0, mpirun, sizeof mpirun)) {
    snprintf(b->why, sizeof b->why, "mpirun is not on PATH");
    return;
  }
  if (!mkdtemp(dir)) {
    snprintf(b->why, sizeof b->why, "mkdtemp: %s", strerror(errno));
    return;
  }
  snprintf(raw, sizeof raw, "%s/raw", dir);
  snprintf(log, sizeof log, "%s/mpirun.log", dir);
  int st = spawn(o, R, mpirun, prog, raw, log, b);
  if (st == -1) return;
  if (!WIFEXITED(st) || (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 1)) {
    snprintf(b->why, sizeof b->why, "mpirun %s %d (log kept: %s)",
             WIFEXITED(st) ? "exited with status" : "killed by signal",
             WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), log);
    return;
  }
  bench_rank_t **br = read_raw(raw, R, o->iters);
  if (!br) {
    snprintf(b->why, sizeof b->why, "no readable results from " PROGRAM " (log kept: %s)", log);
    return;
  }
  merge(o, R, rk, br, b);
  for (int r = 0; r < R; r++) bench_rank_free(br[r]);
  free(br);
  unlink(raw), unlink(log), rmdir(dir);
}
