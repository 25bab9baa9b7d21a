/*
 * What one rank measured, in a form every program of the benchmark shares (`epcomm bench` on
 * either backend, the MPI baseline alone or merged): a list of rows (one measured phase each:
 * epcomm's dispatch, a variant of it, the copy ceiling, a baseline's combine ...), each with this
 * rank's time per timed iteration and its bytes; plus the outcome of the rank's self-checks. Rank 0
 * gathers every rank's results and reports them: per iteration the slowest rank's time, then
 * median / p10 / p90 over the iterations, as a table and/or JSON (bench_report.c). No dependency
 * on the library: part of ep_benchcore.
 */
#ifndef EP_TOOLS_BENCH_RESULT_H
#define EP_TOOLS_BENCH_RESULT_H

#include <stddef.h>
#include <stdint.h>

#include "bench_common.h"

#define BENCH_MAX_ROWS 32
#define BENCH_MSG 240

/* What a row's bytes are, for GB/s: a dispatch's received bytes, a combine's returned bytes, a
 * copy, or none (a part of a call, a compute kernel: time only). */
enum { BENCH_K_DISPATCH, BENCH_K_COMBINE, BENCH_K_COPY, BENCH_K_TIME };
/* Whose figure it is: epcomm's, the ceiling of epcomm's run, a baseline's, the baseline's ceiling.
 */
enum { BENCH_G_EPCOMM, BENCH_G_CEILING, BENCH_G_BASE, BENCH_G_BASE_CEILING };

typedef struct {
  char key[32];   /* JSON key, e.g. "dispatch_cached" */
  char label[48]; /* table label, e.g. "epcomm dispatch (cached, views)" */
  int32_t kind, group;
  double bytes; /* this rank's bytes per call (DeepEP's definition; copy: bytes copied) */
  double wire;  /* of which cross rank */
  double cpu;   /* CPU seconds (process, all threads) per call, mean; < 0: not measured */
  double csw;   /* context switches per call, mean; < 0: not measured */
  double host;  /* GPU rows: seconds the host spent in the call, median over the timed
                   iterations: enqueueing it, and in a full dispatch its wait for the count.
                   < 0: not measured */
} bench_row_t;

/* A row's calls and of those the ones that took the path it is about; -1: not run. */
typedef struct {
  int32_t calls, took;
} bench_path_t;

typedef struct {
  int32_t nrows, iters;
  int32_t recv_rows, self_rows; /* rows received in total and from itself (main dispatch) */
  int64_t bad;                  /* self-check mismatches, all rows of this rank */
  uint64_t digest_rows;         /* received rows (payload only) of the main dispatch */
  uint64_t digest_x;            /* received rows, then scales (fp8) */
  uint64_t digest_out;          /* the main combine's output */
  char msg[BENCH_MSG];          /* first self-check mismatch, "" if none */
  /* A baseline run inside this rank (the GPU's cudaMemcpy baseline): its self-check, and whether
   * its outputs differ from epcomm's checked ones. */
  int64_t base_bad;
  int32_t base_ran, base_differs;
  char base_msg[BENCH_MSG];
  /* Across hosts (normal mode, nhosts > 1), per timed call of the main rows: bytes this rank sent
   * through the network engine and to ranks of its own host (ep_buffer_info_t's counters); from
   * its routing, the pairs (token, other host it goes to) and the rows a flat all-to-all sends to
   * ranks of other hosts and to other ranks of this host. */
  double net_d, net_c, local_d, local_c;
  double host_pairs, remote_rank_rows, local_rank_rows;
  /* Rows whose calls should take a fast path (CUDA), as the buffer counted them: the allocator
   * row with registered outputs (dispatch_alloc_reg: recv_x written in place, the late hello),
   * the cached dispatch into caller arrays (dispatch_cached_caller: rows pulled, EP_CUDA_PULL),
   * the allocator row with plain outputs (dispatch_alloc: rows pulled) and the combine of a
   * separate tensor (combine: x copied into the combine buffer, EP_CUDA_COMBINE_COPY). */
  bench_path_t alloc_reg, caller_pull, alloc_pull, combine_copy;
  bench_row_t row[BENCH_MAX_ROWS];
  double *t; /* [nrows][iters] seconds; not part of the packed form */
} bench_rank_t;

bench_rank_t *bench_rank_new(int iters); /* NULL: out of memory */
void bench_rank_free(bench_rank_t *r);
/* A new row with zeroed times; returns its index, or -1 when full or out of memory. */
int bench_row_add(bench_rank_t *r, const char *key, const char *label, int kind, int group,
                  double bytes, double wire);
int bench_row_find(const bench_rank_t *r, const char *key); /* -1: absent */
static inline double *bench_row_times(bench_rank_t *r, int row) {
  return r->t + (size_t)row * (size_t)r->iters;
}
/* The first mismatch of the rank is kept; later ones only count. */
void bench_rank_fail(bench_rank_t *r, long bad, const char *msg);

/* A flat copy (for allgather, or a file): the same size on every rank with the same rows. */
size_t bench_rank_packed_size(const bench_rank_t *r);
void bench_rank_pack(const bench_rank_t *r, void *out);
bench_rank_t *bench_rank_unpack(const void *in, size_t n); /* NULL: malformed or no memory */

/* ---- statistics */
typedef struct {
  double median, p10, p90, mean;
} bench_stat_t;
/* Quantiles of v[n] (sorted copy, linear interpolation), and the mean (JSON only: what DeepEP's
 * own tests report, for side-by-side tables). */
bench_stat_t bench_stats(const double *v, int n);

/* ---- the baseline's outcome, for the report */
typedef struct {
  int ran;       /* 1: its rows are in the ranks' results */
  char why[256]; /* why it did not run, or its failure */
  int ok;        /* its own self-check passed on every rank */
  int agree;     /* -1: not compared; 1: its outputs are identical to epcomm's; 0: they differ */
  char name[40]; /* "MPI baseline", "cudaMemcpy baseline" */
} bench_base_t;

/* CPUs this process may run on (its affinity mask; containers and taskset narrow it). */
int bench_usable_cpus(void);

/* ---- the report (rank 0) */
typedef struct {
  const char *tool;    /* "epcomm bench" */
  const char *version; /* of the library */
  const char *what;    /* "cpu backend", "cuda backend", "MPI_Alltoallv baseline alone" */
  int cpus;            /* CPUs this process may use: cpu% is capped at 100 x cpus */
} bench_who_t;
/* Table (stdout) and/or JSON as o->json says. Returns the exit status: 0, 1 on a self-check
 * failure or a disagreement with the baseline, 2 when the JSON file cannot be written. */
int bench_report(const bench_opts_t *o, const bench_who_t *who, int R, bench_rank_t *const *rk,
                 const bench_base_t *b);

#endif
