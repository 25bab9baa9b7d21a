/* Inside the report (bench_report.c: aggregates and table; bench_json.c: JSON). */
#ifndef EP_TOOLS_BENCH_REPORT_H
#define EP_TOOLS_BENCH_REPORT_H

#include "bench_result.h"

/* One row over all ranks. */
typedef struct {
  bench_row_t meta;  /* rank 0's row (key, label, kind, group) */
  double *t;         /* [R][iters] seconds */
  double *bytes;     /* [R] per call */
  double *wire;      /* [R] */
  double *cpu, *csw; /* [R] per call; < 0: not measured */
  double *host;      /* [R] GPU rows: the host's seconds in the call, median; < 0: not measured */
  bench_stat_t time; /* of the slowest rank per iteration, seconds */
  bench_stat_t bw;   /* of the mean bytes over ranks / that time, bytes/s; 0: no bytes */
  double *rank_t;    /* [R] median of each rank's own times */
  double *rank_mean; /* [R] mean of each rank's own times: what CPU means are compared with */
} phase_t;

typedef struct {
  int R, iters, n;
  phase_t p[BENCH_MAX_ROWS + 2]; /* the rows, plus dispatch+combine sums */
} phases_t;

typedef struct {
  double d_ceiling, c_ceiling;   /* GB/s over the ceiling's GB/s; 0: no ceiling */
  double d_base, c_base, t_base; /* baseline time over epcomm time; 0: not measured */
  double t_base_norm;            /* t_base with each run's time over its own ceiling's time */
  double graph;                  /* ll: graph replay over dispatch + combine, medians */
  double overlap;                /* ll: (communication alone + compute alone) / overlapped */
} ratios_t;

typedef struct {
  int ok;        /* every rank's self-check passed (epcomm's, or the baseline's when alone) */
  int base_ok;   /* -1: no baseline; else its self-check */
  int agree;     /* -1: not compared */
  int alone;     /* the baseline alone (no epcomm rows) */
  char msg[512]; /* the first mismatch */
} verdict_t;

/* Across hosts (normal mode): mean bytes per rank per call, measured (epcomm) and from the
 * routing (the flat all-to-all: a row + its metadata per (token, rank), bf16 back). */
typedef struct {
  double net_d, net_c, local_d, local_c, pairs;
  double flat_net_d, flat_net_c, flat_local_d, flat_local_c;
} bench_traffic_t;
bench_traffic_t bench_traffic(const bench_opts_t *o, int R, bench_rank_t *const *rk);

int bench_build_phases(phases_t *ph, int R, bench_rank_t *const *rk); /* -1: out of memory */
void bench_free_phases(phases_t *ph);
ratios_t bench_ratios(const phases_t *ph);
verdict_t bench_verdict(int R, bench_rank_t *const *rk, const bench_base_t *b);
const phase_t *bench_phase(const phases_t *ph, const char *key); /* NULL: absent */
int bench_passed(const verdict_t *v);
void bench_json(FILE *f, const bench_opts_t *o, const bench_who_t *who, const phases_t *ph,
                bench_rank_t *const *rk, const bench_base_t *b, const ratios_t *q,
                const verdict_t *v);

#endif
