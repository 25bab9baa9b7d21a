/*
 * What `epcomm bench` (tools/bench*.c) and its MPI_Alltoallv baseline (bench/mpi_baseline.c)
 * share, so that both move the same data and check it the same way: options, the deterministic
 * generator of tokens and routing, the self-checks, statistics. No dependency on the library (the
 * baseline program links only this, tests/ref.c and MPI) and none on MPI.
 */
#ifndef EP_TOOLS_BENCH_COMMON_H
#define EP_TOOLS_BENCH_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { BENCH_NORMAL = 0, BENCH_LL = 1 };
enum { BENCH_UNIFORM = 0, BENCH_ZIPF = 1, BENCH_GROUPED = 2 };
enum { BENCH_BF16 = 1, BENCH_FP8 = 2 }; /* the values of ep_dtype_t */
enum { BENCH_BASELINE_AUTO = 0, BENCH_BASELINE_ON = 1, BENCH_BASELINE_OFF = 2 };

typedef struct {
  int mode, backend_cuda;
  int tokens, hidden, topk, experts, dtype, routing;
  int warmup, iters, threads;
  uint64_t seed;
  /* epcomm bench only */
  const char *json; /* NULL: table only; "-": JSON on stdout instead of the table; else a file */
  int baseline;     /* BENCH_BASELINE_* */
  double timeout_s; /* group deadline (must cover the baseline run) */
  /* baseline program only */
  const char *raw; /* results file for epcomm bench to merge */
  /* set explicitly on the command line (defaults depend on the mode) */
  int set_tokens, set_experts, set_warmup, set_iters;
  struct bench_progress *progress; /* epcomm bench: rank 0's progress lines; NULL: none */
} bench_opts_t;

/* Parses argv[1..] (argv[0] is the subcommand). `tool` names the program in messages; `mpi`
 * selects the baseline's option set. Returns 0, 1 << 8 after --help (exit 0), or 2 for a bad
 * option: the reason with the valid range and the usage are printed by rank 0 only (the rank
 * from the launcher's environment, bench_env_rank). Defaults: DeepEP's sizes for the mode.
 * Experts are checked against the rank count later (bench_fix_experts). */
int bench_parse(int argc, char **argv, const char *tool, int mpi, bench_opts_t *o);
void bench_usage(FILE *f, const char *tool, int mpi);
/* EP_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID; 0 when none is set. */
int bench_env_rank(void);
/* E rounded down to a multiple of R; returns 0 (unchanged), 1 (rounded), or -1 when no multiple
 * of R at or below E is in [max(R, topk) rounded up to R, 65536], with the valid range in `why`. */
int bench_fix_experts(bench_opts_t *o, int nranks, char *why, size_t why_len);
const char *bench_routing_name(int r);

/* ---- data (identical in every process for the same options and seed) */
size_t bench_row_bytes(const bench_opts_t *o);  /* hidden x dtype size */
int bench_num_scales(const bench_opts_t *o);     /* fp8: hidden / 128, else 0 */
/* Rank `src`'s token rows [tokens][row bytes], scales [tokens][num_scales] (fp8, else NULL). */
void bench_gen_x(const bench_opts_t *o, int src, void *x, float *scales);
/* Rank `src`'s routing: topk_idx [tokens][topk], topk_weights [tokens][topk]. */
void bench_gen_route(const bench_opts_t *o, int src, int64_t *idx, float *w);
/* The "expert output" row that rank `dst` hands to combine for token `t` of rank `src`. */
void bench_gen_y_row(const bench_opts_t *o, int dst, int src, int t, uint16_t *row);

/* ---- self-checks. Each returns the number of mismatches (0: pass) and writes the first one into
 * msg (msg_len bytes). */
typedef struct {
  int nr;                        /* received rows */
  const void *x;                 /* [nr][row bytes] */
  const float *scales;           /* [nr][num_scales] (fp8) */
  const int64_t *topk_idx;       /* [nr][topk], local ids or -1 */
  const float *topk_weights;     /* [nr][topk] */
  const int32_t *src_idx;        /* [nr] */
  const int32_t *rank_prefix;    /* [R][R] or NULL */
  const int32_t *tokens_per_expert; /* [E/R] or NULL */
} bench_recv_t;
/* Dispatch outputs of rank `me` of `R` against the generator and SEMANTICS.md §3. */
long bench_check_dispatch(const bench_opts_t *o, int R, int me, const bench_recv_t *rv, char *msg,
                          size_t msg_len);
/* Combine output out [tokens][hidden] bf16 of rank `me`, for expert outputs from
 * bench_gen_y_row: out[t] = bf16(sum over ranks r ascending that t went to of y(r, me, t)). */
long bench_check_combine(const bench_opts_t *o, int R, int me, const uint16_t *out, char *msg,
                         size_t msg_len);
/* 64-bit digest of a byte range (compares epcomm's and the baseline's outputs). */
uint64_t bench_digest(const void *p, size_t n, uint64_t h);

/* Rows rank `me` receives from each source (recv_from[R]) and sends to each rank (send_to[R]). */
void bench_counts(const bench_opts_t *o, int R, int me, int32_t *recv_from, int32_t *send_to);

/* ---- statistics */
typedef struct {
  double median, p10, p90;
} bench_stat_t;
/* Quantiles of v[n] (sorted copy, linear interpolation). */
bench_stat_t bench_stats(const double *v, int n);

double bench_now(void);

#endif
