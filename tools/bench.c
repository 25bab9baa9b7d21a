/* `epcomm bench` (run under `epcomm launch -n R` or mpirun): epcomm's dispatch and combine, the
 * host's memcpy ceiling and the MPI_Alltoallv baseline, all from one run, with ratios to both and
 * a self-check of every output. See docs/PERFORMANCE.md. */
#include <errno.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"

static int fail_group(const char *what, ep_group_t g) {
  const char *m = ep_last_error(); /* the library's messages already start with their call */
  if (strncmp(m, what, strlen(what)) == 0)
    fprintf(stderr, "epcomm bench: %s\n", m);
  else
    fprintf(stderr, "epcomm bench: %s: %s\n", what, m);
  if (g) ep_group_release(g);
  return 1;
}

/* Everyone's figures to rank 0 (allgather: small, once). */
static bench_rank_t **gather(ep_group_t g, int R, bench_rank_t *mine, size_t sz, char **blob) {
  *blob = malloc(sz * (size_t)R);
  bench_rank_t **all = calloc((size_t)R, sizeof *all);
  if (!*blob || !all || ep_group_allgather(g, mine, *blob, sz)) {
    free(all);
    return NULL;
  }
  for (int r = 0; r < R; r++) all[r] = (bench_rank_t *)(*blob + sz * (size_t)r);
  return all;
}

static int run(const bench_opts_t *o, ep_group_t g, int R, int me) {
  size_t sz = bench_rank_size(o->iters);
  bench_rank_t *mine = calloc(1, sz);
  if (!mine) return fprintf(stderr, "epcomm bench: out of memory\n"), 1;
  mine->iters = o->iters;
  int rc = o->mode == BENCH_LL ? bench_ll(o, g, mine) : bench_normal(o, g, mine);
  if (rc) {
    free(mine);
    return rc;
  }
  /* The baseline after epcomm's run: rank 0 drives mpirun, the others sleep in the barrier. */
  bench_baseline_t b, *bp = NULL;
  memset(&b, 0, sizeof b);
  if (o->mode == BENCH_LL)
    snprintf(b.why, sizeof b.why, "the MPI baseline covers normal mode only"), bp = &b;
  int want = o->baseline != BENCH_BASELINE_OFF && !o->backend_cuda && o->mode == BENCH_NORMAL;
  if (want && me == 0) {
    bench_progress_stage(o->progress, "the MPI baseline (mpirun, same options)", 0);
    bench_baseline_run(o, R, &b);
    bp = &b;
  }
  if (ep_group_barrier(g)) rc = fail_group("barrier after the baseline", NULL);
  char *blob = NULL;
  bench_rank_t **all = rc ? NULL : gather(g, R, mine, sz, &blob);
  if (!rc && !all) rc = fail_group("gathering the figures", NULL);
  if (!rc && me == 0) {
    if (o->mode == BENCH_LL && o->baseline == BENCH_BASELINE_ON) {
      fprintf(stderr, "epcomm bench: the MPI baseline covers normal mode only\n");
      rc = 1;
    }
    if (want && !b.ran && o->baseline == BENCH_BASELINE_ON) {
      fprintf(stderr, "epcomm bench: the MPI baseline did not run: %s\n", b.why);
      rc = 1;
    }
    int r2 = bench_report(o, R, all, bp);
    if (!rc) rc = r2;
  }
  bench_baseline_free(&b);
  free(all), free(blob), free(mine);
  return rc;
}

/* The GPU benchmark keeps its data on the device and its own kernels (ceiling, baseline): it is
 * a separate program, bin/cuda_bench (normal mode) or bin/cuda_bench_ll (low-latency mode),
 * built with the CUDA backend. This rank becomes it, with the same sizes; the launcher's
 * environment (rank, job, notify socket) carries over. */
static int run_cuda_bench(const bench_opts_t *o) {
  const int ll = o->mode == BENCH_LL;
  char self[4096], path[4200], num[7][16];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return perror("epcomm bench: /proc/self/exe"), 2;
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (slash) *slash = '\0';
  snprintf(path, sizeof path, "%s/%s", self, ll ? "cuda_bench_ll" : "cuda_bench");
  if (access(path, X_OK) != 0) {
    fprintf(stderr, "epcomm bench: %s not found: this build has no CUDA backend (configure with "
            "-DEP_CUDA=ON on a machine with nvcc)\n", path);
    return 2;
  }
  /* Low latency: at least 200 calls per figure (median and p90) unless --iters says. */
  snprintf(num[0], 16, "%d", o->tokens), snprintf(num[1], 16, "%d", o->hidden);
  snprintf(num[2], 16, "%d", o->topk), snprintf(num[3], 16, "%d", o->experts);
  snprintf(num[4], 16, "%d", ll && !o->set_iters ? 200 : o->iters);
  snprintf(num[5], 16, "%d", o->threads);
  snprintf(num[6], 16, "%d", ll && !o->set_warmup ? 20 : o->warmup);
  char *args[] = {path, "--tokens", num[0], "--hidden", num[1], "--topk", num[2], "--experts",
                  num[3], "--iters", num[4], "--warmup", num[6], "--sms", num[5], NULL};
  if (!ll) args[11] = "--sms", args[12] = num[5], args[13] = NULL; /* its own warm-up */
  /* --threads N sets the SMs per rank; default: 24 (normal), the rank's share (ll) */
  if (o->threads <= 1) args[ll ? 13 : 11] = NULL;
  fflush(stdout);
  execv(path, args);
  fprintf(stderr, "epcomm bench: cannot run %s: %s\n", path, strerror(errno));
  return 2;
}

/* --hosts H: pretend hosts through EP_HOSTS, which the group reads (the ranks must run under
 * mpirun: `epcomm launch -n R --hosts H` sets both). */
static int pretend_hosts(const bench_opts_t *o) {
  if (o->hosts < 1) return 0;
  const char *set = getenv("EP_HOSTS");
  if (set && *set && atoi(set) != o->hosts) {
    if (bench_env_rank() == 0)
      fprintf(stderr, "epcomm bench: --hosts %d but EP_HOSTS=%s\n", o->hosts, set);
    return 2;
  }
  char v[16];
  snprintf(v, sizeof v, "%d", o->hosts);
  setenv("EP_HOSTS", v, 1);
  return 0;
}

/* The hosts of the group, for the combine's check and the traffic figures. */
static int hosts_of(ep_group_t g, bench_opts_t *o, int R, int **host_of) {
  ep_group_info_t i = EP_GROUP_INFO_INIT;
  if (ep_group_query(g, &i)) return 1;
  o->nhosts = i.nhosts;
  if (i.nhosts < 2) return 0;
  *host_of = malloc((size_t)R * sizeof **host_of);
  if (!*host_of || ep_group_allgather(g, &i.host, *host_of, sizeof i.host)) return 1;
  o->host_of = *host_of;
  return 0;
}

int ep_cmd_bench(int argc, char **argv) {
  bench_opts_t o;
  int rc = bench_parse(argc, argv, "epcomm bench", 0, &o);
  if (rc) return rc == 1 << 8 ? 0 : rc;
  if (o.backend_cuda) return run_cuda_bench(&o);
  ep_group_config_t gc = EP_GROUP_CONFIG_INIT;
  gc.timeout_s = o.timeout_s;
  ep_group_t g = NULL;
  int R, me;
  if ((rc = pretend_hosts(&o))) return rc;
  if (ep_group_create_from_env(&gc, &g)) return fail_group("ep_group_create_from_env", NULL);
  ep_group_rank(g, &me);
  ep_group_nranks(g, &R);
  int *host_of = NULL;
  if (hosts_of(g, &o, R, &host_of)) return fail_group("ep_group_query", g);
  char why[320];
  int changed = bench_fix_experts(&o, R, why, sizeof why);
  if (changed < 0) { /* every rank knows R now: all stop, rank 0 says why */
    if (me == 0) fprintf(stderr, "epcomm bench: %s\n", why);
    return ep_group_destroy(g) ? fail_group("ep_group_destroy", g) : 2;
  }
  if (me == 0 && changed && o.set_experts && !o.json)
    printf("epcomm bench: --experts rounded to %d (a multiple of %d ranks)\n", o.experts, R);
  bench_progress_t progress;
  bench_progress_init(&progress, &o, me);
  o.progress = &progress;
  rc = run(&o, g, R, me);
  free(host_of);
  if (ep_group_destroy(g)) return fail_group("ep_group_destroy", g);
  return rc;
}
