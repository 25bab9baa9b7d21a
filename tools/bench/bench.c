/* `epcomm bench` (run under `epcomm launch -n R` or mpirun): epcomm's dispatch and combine on
 * either backend, the copy ceiling and a baseline (MPI_Alltoallv on the CPU, cudaMemcpy on the
 * GPU), all from one run, with ratios to both and a self-check of every output. One program,
 * one set of options, one report: see docs/PERFORMANCE.md. */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Everyone's results to rank 0 (allgather: small, once); every rank has the same rows. */
static bench_rank_t **gather(ep_group_t g, int R, const bench_rank_t *mine) {
  size_t sz = bench_rank_packed_size(mine);
  char *blob = malloc(sz * (size_t)(R + 1));
  bench_rank_t **all = calloc((size_t)R, sizeof *all);
  int ok = blob && all;
  if (ok) bench_rank_pack(mine, blob + sz * (size_t)R);
  ok = ok && !ep_group_allgather(g, blob + sz * (size_t)R, blob, sz);
  for (int r = 0; ok && r < R; r++)
    ok = (all[r] = bench_rank_unpack(blob + sz * (size_t)r, sz)) != NULL;
  free(blob);
  if (ok) return all;
  for (int r = 0; all && r < R; r++) bench_rank_free(all[r]);
  free(all);
  return NULL;
}

/* The GPU's baseline ran inside every rank: its outcome from their results. */
static void cubase_outcome(const bench_opts_t *o, int R, bench_rank_t *const *rk, bench_base_t *b) {
  snprintf(b->name, sizeof b->name, "%s", o->nhosts > 1 ? "NCCL baseline" : "cudaMemcpy baseline");
  b->ran = b->ok = b->agree = 1;
  for (int r = 0; r < R; r++) {
    b->ran &= rk[r]->base_ran;
    if (rk[r]->base_bad && b->ok) snprintf(b->why, sizeof b->why, "%s", rk[r]->base_msg), b->ok = 0;
    if (rk[r]->base_differs && b->agree && b->ok)
      snprintf(b->why, sizeof b->why, "rank %d: its received rows differ from epcomm's", r);
    if (rk[r]->base_differs) b->agree = 0;
  }
  if (!b->ran) snprintf(b->why, sizeof b->why, "not run");
}

/* Rank 0: the baseline's outcome (running the MPI one), then the report; the others wait. */
static int conclude(const bench_opts_t *o, ep_group_t g, int R, bench_rank_t **rk) {
  bench_base_t b;
  memset(&b, 0, sizeof b);
  b.agree = -1;
  int cuda = o->backend == BENCH_CUDA, rc = 0;
  if (o->mode == BENCH_LL)
    snprintf(b.why, sizeof b.why, "--mode ll has no baseline");
  else if (o->baseline == BENCH_BASELINE_OFF)
    snprintf(b.why, sizeof b.why, "--baseline off");
  else if (cuda)
    cubase_outcome(o, R, rk, &b);
  else {
    bench_progress_stage(o->progress, "the MPI baseline (mpirun, same options)", 0);
    bench_mpi_run(o, R, rk, &b);
  }
  if (o->baseline == BENCH_BASELINE_ON && !b.ran) {
    fprintf(stderr, "epcomm bench: the %s did not run: %s\n",
            cuda ? (b.name[0] ? b.name : "GPU baseline") : "MPI baseline", b.why);
    rc = 1;
  }
  bench_who_t who = {"epcomm bench", ep_version_string(), cuda ? "cuda backend" : "cpu backend",
                     bench_usable_cpus()};
  int r2 = bench_report(o, &who, R, rk, &b);
  return rc ? rc : r2;
}

static int run(const bench_opts_t *o, ep_group_t g, int R, int me) {
  bench_ctx_t c = {.o = o, .g = g, .R = R, .me = me, .res = bench_rank_new(o->iters)};
  if (!c.res) return fprintf(stderr, "epcomm bench: out of memory\n"), 1;
  int rc = o->mode == BENCH_LL ? bench_ll(&c) : bench_normal(&c);
  bench_rank_t **all = rc ? NULL : gather(g, R, c.res);
  if (!rc && !all) rc = fail_group("gathering the figures", NULL);
  if (!rc && me == 0) rc = conclude(o, g, R, all);
  /* The others sleep here while rank 0 runs the MPI baseline (bounded by the group deadline). */
  if (all && ep_group_barrier(g) && !rc) rc = fail_group("barrier after the report", NULL);
  for (int r = 0; all && r < R; r++) bench_rank_free(all[r]);
  free(all);
  bench_rank_free(c.res);
  return rc;
}

/* --backend cuda where there is no GPU (or no CUDA build): a skip, as the test suite counts it. */
static int gpu_missing(void) {
  if (ep_backend_available(EP_BACKEND_CUDA)) return 0;
  if (bench_env_rank() == 0) printf("skipped: no GPU (%s)\n", ep_last_error());
  fflush(stdout);
  return 77;
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

/* The hosts of the group (from EP_HOSTS, EP_HOST_ID or the machines), for the combine's check
 * and the traffic figures; *host_of is the caller's to free. */
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

static int setup(bench_opts_t *o, ep_group_t g, int R, int me) {
  char why[320];
  int changed = bench_fix_experts(o, R, why, sizeof why);
  if (changed < 0) { /* every rank knows R now: all stop, rank 0 says why */
    if (me == 0) fprintf(stderr, "epcomm bench: %s\n", why);
    return 2;
  }
  if (me == 0 && changed && o->set_experts && !o->json)
    printf("epcomm bench: --experts rounded to %d (a multiple of %d ranks)\n", o->experts, R);
  /* DeepEP's SMs per rank in its normal-mode tests: 24, 16 from 8 ranks on one GPU. */
  if (o->backend == BENCH_CUDA && o->mode == BENCH_NORMAL && !o->threads)
    o->threads = R >= 8 ? 16 : 24;
  return 0;
}

/* The tool's own variables (tools/tool_env.c), read once and taken out of the environment before
 * the library's first call: the library warns about every EP_* name it does not read, and these
 * are not its (the doctor takes EP_DOCTOR_RULES out likewise). */
static void take_env(bench_opts_t *o) {
  const char *r = getenv("EP_BENCH_REFUSE"), *f = getenv("EP_BENCH_LL_FILL");
  snprintf(o->refuse, sizeof o->refuse, "%s", r ? r : "");
  o->ll_fill_copies = f && !strcmp(f, "copies");
  unsetenv("EP_BENCH_REFUSE");
  unsetenv("EP_BENCH_LL_FILL");
}

int ep_cmd_bench(int argc, char **argv) {
  bench_opts_t o;
  int rc = bench_parse(argc, argv, "epcomm bench", BENCH_TOOL_EPCOMM, &o);
  if (rc) return rc == 1 << 8 ? 0 : rc;
  take_env(&o);
  if (o.backend == BENCH_CUDA && (rc = gpu_missing())) return rc;
  ep_group_config_t gc = EP_GROUP_CONFIG_INIT;
  gc.timeout_s = o.timeout_s;
  ep_group_t g = NULL;
  int R, me, *host_of = NULL;
  if ((rc = pretend_hosts(&o))) return rc;
  if (ep_group_create_from_env(&gc, &g)) return fail_group("ep_group_create_from_env", NULL);
  ep_group_rank(g, &me);
  ep_group_nranks(g, &R);
  if (hosts_of(g, &o, R, &host_of)) return free(host_of), fail_group("ep_group_query", g);
  rc = setup(&o, g, R, me);
  bench_progress_t progress;
  bench_progress_init(&progress, &o, me);
  o.progress = &progress;
  if (!rc) rc = run(&o, g, R, me);
  free(host_of);
  if (ep_group_destroy(g)) return fail_group("ep_group_destroy", g);
  return rc;
}
