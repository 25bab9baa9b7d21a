/* `epcomm bench` internals: one file per part (normal mode, memcpy ceiling, MPI baseline,
 * report). Uses only the public header, tools/bench_common.h and the test reference. */
#ifndef EP_TOOLS_BENCH_H
#define EP_TOOLS_BENCH_H

#include "bench_common.h"
#include "epcomm.h"

/* An epcomm call inside a bench phase: on failure, say which and jump to the phase's cleanup. */
#define TRY(call)                                                                    \
  do {                                                                               \
    ep_status_t st_ = (call);                                                        \
    if (st_) {                                                                       \
      fprintf(stderr, "epcomm bench: %s: %s: %s\n", #call, ep_status_name(st_),      \
              ep_last_error());                                                      \
      goto fail;                                                                     \
    }                                                                                \
  } while (0)

#define BENCH_MSG 240

/* What one rank measured, gathered on rank 0. The header is followed by 3 x iters doubles:
 * dispatch, combine, memcpy seconds per iteration. */
typedef struct {
  int32_t recv_rows, self_rows; /* rows received in total and from itself */
  int32_t iters, has_data;
  int64_t dispatch_bad, combine_bad; /* self-check mismatches */
  uint64_t digest_x, digest_out;     /* of recv_x (+ scales) and of the combined output */
  double d_bytes, d_wire;            /* dispatch: DeepEP's received bytes, cross-rank bytes */
  double c_bytes, c_wire;            /* combine: DeepEP's bytes (bf16 rows sent back), cross-rank */
  double m_bytes;                    /* bytes one memcpy iteration copies */
  double d_cpu, c_cpu;               /* CPU seconds (user + system, all threads) per iteration */
  double d_csw, c_csw;               /* context switches (voluntary + not) per iteration */
  double ll_phases[4];               /* low-latency two-phase form, median seconds of this rank:
                                        dispatch send, dispatch receive, combine send, receive */
  double ll_zero_copy;               /* one-phase combine with y in ep_ll_get_combine_buffer's
                                        area, median seconds of this rank */
  /* Across hosts (nhosts > 1), per timed iteration: bytes this rank sent through the network
   * engine and to ranks of its host (ep_buffer_query's counters); from its routing, the pairs
   * (token, other host it goes to) and (token, rank of another / of this host it goes to). */
  double net_d, net_c, local_d, local_c;
  double host_pairs, remote_rank_rows, local_rank_rows;
  char msg[BENCH_MSG];               /* first self-check mismatch, "" if none */
} bench_rank_t;

static inline double *bench_rank_times(bench_rank_t *r) { return (double *)(r + 1); }
static inline size_t bench_rank_size(int iters) {
  return sizeof(bench_rank_t) + 3 * (size_t)iters * sizeof(double);
}

/* The MPI baseline's results, read by rank 0 from the program's --raw file. */
typedef struct {
  int ran;            /* 1: results below are valid */
  char why[256];      /* why it did not run, or its failure */
  int ok;             /* its own self-check passed on every rank */
  int32_t *recv_rows; /* [R] */
  uint64_t *digest_x, *digest_out; /* [R] */
  double *t_dispatch, *t_combine, *t_memcpy; /* [R][iters] */
  double copy_bytes;  /* bytes of its memcpy-ceiling copy */
  double wall_s;      /* whole mpirun, for the record */
} bench_baseline_t;

/* Progress lines on a terminal (tools/bench_progress.c): rank 0, stderr, never with --json. */
typedef struct bench_progress {
  int on;
  double t0, start, next; /* start of the run and of the stage; when the next line is due */
  int total;              /* iterations of the stage, 0: a stage without a count */
  char what[96];
} bench_progress_t;
void bench_progress_init(bench_progress_t *p, const bench_opts_t *o, int rank);
/* A new stage ("measuring normal mode"); total 0 for one without iterations. p may be NULL. */
void bench_progress_stage(bench_progress_t *p, const char *what, int total);
/* `done` iterations of the stage are done: prints at 1, 2, 4 ... s into the stage. */
void bench_progress_step(bench_progress_t *p, int done);

/* CPU time (user + system, every thread) and context switches of this process so far. */
typedef struct {
  double cpu, csw;
} bench_usage_t;
bench_usage_t bench_rusage(void);

/* Normal mode on the epcomm buffer: fills `me` (times at bench_rank_times(me)). Returns 0, or 1
 * on an epcomm error (printed). */
int bench_normal(const bench_opts_t *o, ep_group_t g, bench_rank_t *me);
/* Low-latency mode, the same way (one-phase calls; bytes per selection). */
int bench_ll(const bench_opts_t *o, ep_group_t g, bench_rank_t *me);
/* The memcpy ceiling: o->threads threads per rank copying one large buffer; every rank copies at
 * once (the caller's barrier starts each copy). */
typedef struct bench_ceiling_s bench_ceiling_t;
bench_ceiling_t *bench_ceiling_new(const bench_opts_t *o); /* NULL: out of memory */
double bench_ceiling_copy(bench_ceiling_t *c);             /* seconds of one copy */
double bench_ceiling_bytes(const bench_ceiling_t *c);
void bench_ceiling_free(bench_ceiling_t *c);
/* Rank 0: run the MPI baseline through mpirun with the same options. */
void bench_baseline_run(const bench_opts_t *o, int R, bench_baseline_t *b);
void bench_baseline_free(bench_baseline_t *b);
/* Rank 0: table (stdout) and/or JSON. Returns the exit status (self-check failures: 1). */
int bench_report(const bench_opts_t *o, int R, bench_rank_t *const *ranks,
                 const bench_baseline_t *b);

#endif
