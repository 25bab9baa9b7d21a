/* `epcomm bench` internals: the backend-neutral driver (this header, bench_run.c), normal mode
 * (bench_normal*.c), low-latency mode (bench_ll*.c), the ceilings (bench_ceiling.c), the
 * baselines (bench_mpi.c through mpirun, bench_cubase.c on the GPU) and the CUDA-only pieces
 * behind a C interface (bench_gpu.h). Uses only the public header and the tool libraries. */
#ifndef EP_TOOLS_BENCH_H
#define EP_TOOLS_BENCH_H

#include "bench_common.h"
#include "bench_result.h"
#include "epcomm.h"

/* An epcomm call inside a bench step: on failure, say which and jump to the function's `fail`. */
#define TRY(call)                                                                                 \
  do {                                                                                            \
    ep_status_t st_ = (call);                                                                     \
    if (st_) {                                                                                    \
      fprintf(stderr, "epcomm bench: %s: %s: %s\n", #call, ep_status_name(st_), ep_last_error()); \
      goto fail;                                                                                  \
    }                                                                                             \
  } while (0)

/* 0 for EP_OK; else says which call failed and why, and returns 1. */
int bench_said(ep_status_t st, const char *call);

/* Progress lines on a terminal (bench_progress.c): rank 0, stderr, never with --json. */
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

/* One rank's run: the group, the buffer and where its tensors live. */
typedef struct bench_ctx {
  const bench_opts_t *o;
  ep_group_t g;
  ep_buffer_t buf;
  int R, me;
  int dev;       /* tensors in device memory, calls ordered on `stream`, GPU time by events */
  unsigned caps; /* the buffer's EP_CAP_* */
  void *stream;  /* cudaStream_t of every call (dev), else NULL */
  bench_rank_t *res;
  struct bench_ceiling_s *ceiling;
  double sent_net, sent_local; /* across hosts: the buffer's traffic counters when last read */
  int *agree; /* [R]: bench_all_ok's receive buffer, allocated with the context so that no
                 allocation can keep a rank out of that collective */
} bench_ctx_t;

/* The buffer for this mode (cfg filled by the caller: sizes), its device and stream, the
 * ceiling. Returns 0, or 1 after saying why. */
int bench_ctx_open(bench_ctx_t *c, ep_buffer_config_t *cfg);
void bench_ctx_close(bench_ctx_t *c);
/* Across hosts: what the buffer sent since the last reading (through the network, to ranks of
 * this host), added per timed iteration (it >= 0) to *net and *local. Read between the timed
 * steps, so the reading is never timed. */
void bench_traffic_step(bench_ctx_t *c, int it, double *net, double *local);
/* The buffer's counters now (zeros when the query fails). Read after a row: bench_run
 * synchronizes the stream after its timed loop. */
ep_buffer_info_t bench_info(bench_ctx_t *c);
/* A fast-path row's verdict (bench_path_t): its calls, warm-up and timed, and of those the ones
 * that took the path, from the path's counter before and after the row. */
void bench_path_set(bench_ctx_t *c, bench_path_t *p, uint64_t before, uint64_t after);
/* Tensors where the backend wants them (tk_dev.h): zero-filled, NULL on failure (said). */
void *bench_alloc(bench_ctx_t *c, size_t n);
void bench_free(bench_ctx_t *c, void *p);
int bench_upload(bench_ctx_t *c, void *dst, const void *host, size_t n);
int bench_copy(bench_ctx_t *c, void *dst, const void *src, size_t n); /* on the stream */
/* A host copy of n bytes of a tensor after the stream's work (free it); NULL on failure. */
void *bench_fetch(bench_ctx_t *c, const void *src, size_t n);
int bench_sync(bench_ctx_t *c);
const char *bench_dev_error(void);
/* Whether every rank has ok != 0 (an allgather): before a loop of collective calls, so that a
 * rank that could not prepare it (memory, say) keeps its peers from waiting for it. */
int bench_all_ok(bench_ctx_t *c, int ok);
/* bench_all_ok that says it: 0 when every rank is ready, else 1 after the rank that was not
 * (and rank 0, when it was) named WHAT. */
int bench_agree(bench_ctx_t *c, int ok, const char *what);
/* The same for a check of outputs (ok: its host copies could be made), so that every rank stops
 * together before the next collective step; "could not check WHAT". STOPPED: this rank stopped
 * before the check and said why already (it stays quiet; rank 0 says a peer stopped). */
int bench_agree_check(bench_ctx_t *c, int stopped, int ok, const char *what);
/* A new row of this rank's results (bytes filled in later with bench_apply_bytes). */
int bench_row(bench_ctx_t *c, const char *key, const char *label, int kind);
/* The main rows of either mode, in the table's order: dispatch, combine, the ceiling. */
void bench_main_rows(bench_ctx_t *c, int row[3]);
/* Bytes of every dispatch and combine row, epcomm's and the baseline's (which move the same
 * data), once the first dispatch has told them. */
void bench_apply_bytes(bench_ctx_t *c, const bench_bytes_t *b);

/* A step of a measured loop: one call, timed into row `row` (-1: untimed preparation or
 * clean-up). `it` runs from -warmup to iters - 1. Returns 0, or 1 after saying why. */
typedef struct {
  int (*call)(bench_ctx_t *c, void *state, int it);
  int row;
  int host_clock; /* time by the host clock even on the GPU (a call that waits for its work) */
} bench_step_t;
/* Runs the steps in order, warm-up + timed iterations. Timed steps: on the host (cpu backend),
 * each after a group barrier, timed by the clock with CPU time and context switches; on the GPU,
 * issued back to back with no host wait, timed by CUDA events. */
int bench_run(bench_ctx_t *c, void *state, const bench_step_t *steps, int n, const char *what);

/* Modes: fill c->res; 0, or 1 after saying why. */
int bench_normal(bench_ctx_t *c);
int bench_ll(bench_ctx_t *c);

/* The ceiling (bench_ceiling.c): every rank copies one large buffer at once, --threads threads
 * on the host or a copy kernel on the GPU. */
typedef struct bench_ceiling_s bench_ceiling_t;
bench_ceiling_t *bench_ceiling_new(bench_ctx_t *c);          /* NULL: said why */
int bench_ceiling_copy(bench_ctx_t *c, void *state, int it); /* a bench_step_t call */
double bench_ceiling_bytes(const bench_ceiling_t *c);
void bench_ceiling_free(bench_ctx_t *c, bench_ceiling_t *ceiling);

/* The MPI baseline (bench_mpi.c), rank 0 only: runs it through mpirun with the same options and
 * merges its rows into every rank's results; b says whether it ran and agreed. */
void bench_mpi_run(const bench_opts_t *o, int R, bench_rank_t **rk, bench_base_t *b);

#endif
