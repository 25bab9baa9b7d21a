/* Rank 0's report: aggregates (per iteration the slowest rank's time, then median / p10 / p90
 * over iterations), per-rank figures, the self-checks, the two ratios; a table and/or JSON. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

/* One measured phase: t[r * stride + i] seconds, bytes[r] per iteration. */
typedef struct {
  const char *key, *label;
  int present;
  double *t;         /* [R][iters], owned */
  double *bytes;     /* [R] DeepEP's bytes (logical) */
  double *wire;      /* [R] cross-rank bytes */
  bench_stat_t time; /* of max-over-ranks per iteration, seconds */
  bench_stat_t bw;   /* of mean bytes / that time, bytes/s */
  double *rank_t;    /* [R] median of each rank's own times */
  double *rank_mean; /* [R] mean of each rank's own times: what CPU means are compared with */
} phase_t;

enum { P_DISPATCH, P_COMBINE, P_TOTAL, P_MEMCPY, P_BDISPATCH, P_BCOMBINE, P_BTOTAL, P_BMEMCPY,
       P_COUNT };

static void aggregate(phase_t *p, int R, int iters) {
  double *tmax = calloc((size_t)iters, sizeof *tmax), *bw = calloc((size_t)iters, sizeof *bw);
  double mean = 0;
  for (int r = 0; r < R; r++) mean += p->bytes[r] / R;
  for (int i = 0; i < iters; i++) {
    for (int r = 0; r < R; r++)
      if (p->t[(size_t)r * iters + i] > tmax[i]) tmax[i] = p->t[(size_t)r * iters + i];
    bw[i] = tmax[i] > 0 ? mean / tmax[i] : 0;
  }
  p->time = bench_stats(tmax, iters);
  p->bw = bench_stats(bw, iters);
  p->rank_t = calloc((size_t)R, sizeof *p->rank_t);
  p->rank_mean = calloc((size_t)R, sizeof *p->rank_mean);
  for (int r = 0; r < R; r++) {
    p->rank_t[r] = bench_stats(p->t + (size_t)r * iters, iters).median;
    for (int i = 0; i < iters; i++) p->rank_mean[r] += p->t[(size_t)r * iters + i] / iters;
  }
  free(tmax), free(bw);
}

static void build(const bench_opts_t *o, int R, bench_rank_t *const *rk, const bench_baseline_t *b,
                  phase_t *ph) {
  static const char *const keys[P_COUNT] = {"dispatch", "combine", "dispatch_combine", "memcpy",
                                            "baseline_dispatch", "baseline_combine",
                                            "baseline_dispatch_combine", "baseline_memcpy"};
  static const char *const labels[P_COUNT] = {
      "epcomm dispatch", "epcomm combine", "epcomm dispatch+combine", "memcpy ceiling",
      "MPI baseline dispatch", "MPI baseline combine", "MPI baseline dispatch+combine",
      "memcpy ceiling, MPI run"};
  int I = o->iters;
  for (int k = 0; k < P_COUNT; k++) {
    phase_t *p = &ph[k];
    p->key = keys[k], p->label = labels[k];
    p->present = k < P_BDISPATCH || (b && b->ran);
    p->t = calloc((size_t)R * I, sizeof *p->t);
    p->bytes = calloc((size_t)R, sizeof *p->bytes);
    p->wire = calloc((size_t)R, sizeof *p->wire);
    for (int r = 0; r < R && p->present; r++) {
      const bench_rank_t *f = rk[r];
      const double *t = bench_rank_times((bench_rank_t *)f);
      const double *bd = b && b->ran ? b->t_dispatch + (size_t)r * I : NULL;
      const double *bc = b && b->ran ? b->t_combine + (size_t)r * I : NULL;
      const double *bm = b && b->ran ? b->t_memcpy + (size_t)r * I : NULL;
      double db = f->d_bytes, cb = f->c_bytes;
      p->bytes[r] = k == P_DISPATCH || k == P_BDISPATCH ? db
                    : k == P_COMBINE || k == P_BCOMBINE ? cb
                    : k == P_MEMCPY                     ? f->m_bytes
                    : k == P_BMEMCPY                    ? b->copy_bytes
                                                        : db + cb;
      p->wire[r] = k == P_DISPATCH || k == P_BDISPATCH ? f->d_wire
                   : k == P_COMBINE || k == P_BCOMBINE ? f->c_wire
                   : k == P_MEMCPY || k == P_BMEMCPY   ? 0
                                                       : f->d_wire + f->c_wire;
      for (int i = 0; i < I; i++) {
        double v = k == P_DISPATCH ? t[i] : k == P_COMBINE ? t[I + i] : k == P_TOTAL ? t[i] + t[I + i]
                 : k == P_MEMCPY ? t[2 * I + i] : k == P_BDISPATCH ? bd[i] : k == P_BCOMBINE ? bc[i]
                 : k == P_BMEMCPY ? bm[i] : bd[i] + bc[i];
        p->t[(size_t)r * I + i] = v;
      }
    }
    if (p->present) aggregate(p, R, I);
  }
}

typedef struct {
  double d_ceiling, c_ceiling, d_base, c_base, t_base;
  double t_base_norm; /* t_base with each run's time scaled by its own memcpy ceiling */
  int have_base;
} ratios_t;

static ratios_t ratios(const phase_t *ph) {
  ratios_t q = {0, 0, 0, 0, 0, 0, ph[P_BDISPATCH].present};
  double m = ph[P_MEMCPY].bw.median;
  q.d_ceiling = m > 0 ? ph[P_DISPATCH].bw.median / m : 0;
  q.c_ceiling = m > 0 ? ph[P_COMBINE].bw.median / m : 0;
  if (q.have_base) {
    q.d_base = ph[P_BDISPATCH].time.median / ph[P_DISPATCH].time.median;
    q.c_base = ph[P_BCOMBINE].time.median / ph[P_COMBINE].time.median;
    q.t_base = ph[P_BTOTAL].time.median / ph[P_TOTAL].time.median;
    /* The baseline runs after epcomm; on a shared machine the two may see different speeds.
     * Each time over its own run's memcpy time cancels that drift. */
    double me = ph[P_MEMCPY].time.median, mb = ph[P_BMEMCPY].time.median;
    if (me > 0 && mb > 0 && ph[P_BMEMCPY].bytes[0] == ph[P_MEMCPY].bytes[0])
      q.t_base_norm = (ph[P_BTOTAL].time.median / mb) / (ph[P_TOTAL].time.median / me);
  }
  return q;
}

/* ------------------------------------------------------------------ checks */
typedef struct {
  int epcomm_ok, base_ok, agree;
  char msg[512];
} verdict_t;

static verdict_t verdict(const bench_opts_t *o, int R, bench_rank_t *const *rk,
                         const bench_baseline_t *b) {
  verdict_t v = {1, -1, -1, ""};
  for (int r = 0; r < R; r++)
    if (rk[r]->dispatch_bad || rk[r]->combine_bad) {
      if (v.epcomm_ok) snprintf(v.msg, sizeof v.msg, "epcomm: %s", rk[r]->msg);
      v.epcomm_ok = 0;
    }
  if (!b || !b->ran) return v;
  v.base_ok = b->ok;
  if (!b->ok && !v.msg[0]) snprintf(v.msg, sizeof v.msg, "baseline: %s", b->why);
  v.agree = 1;
  /* Across hosts the combine adds each host's partial first (SEMANTICS.md §4.6), the flat
   * baseline rank by rank: the dispatches must be identical, the combines each their own rule. */
  int same_combine = o->nhosts < 2;
  for (int r = 0; r < R; r++)
    if (b->recv_rows[r] != rk[r]->recv_rows || b->digest_x[r] != rk[r]->digest_x ||
        (same_combine && b->digest_out[r] != rk[r]->digest_out)) {
      if (v.agree && !v.msg[0])
        snprintf(v.msg, sizeof v.msg, "rank %d: the baseline's outputs differ from epcomm's "
                 "(rows %d vs %d, digests %s)", r, b->recv_rows[r], rk[r]->recv_rows,
                 b->digest_x[r] != rk[r]->digest_x ? "of recv_x differ" : "of the combine differ");
      v.agree = 0;
    }
  return v;
}

/* ------------------------------------------------------------------ table */

static void print_config(FILE *f, const bench_opts_t *o, int R) {
  char hosts[32] = "";
  if (o->nhosts > 1) snprintf(hosts, sizeof hosts, " on %d hosts", o->nhosts);
  fprintf(f, "epcomm bench: %s mode, %s backend, %d ranks%s x %d thread%s; per rank %d tokens, "
          "hidden %d %s, topk %d, %d experts, %s routing; %d warm-up + %d timed iterations\n",
          o->mode == BENCH_LL ? "low-latency" : "normal", o->backend_cuda ? "cuda" : "cpu", R, hosts, o->threads, o->threads > 1 ? "s" : "", o->tokens,
          o->hidden, o->dtype == BENCH_FP8 ? "fp8 (+ fp32 scales)" : "bf16", o->topk, o->experts,
          bench_routing_name(o->routing), o->warmup, o->iters);
}

/* Low-latency two-phase form: the slowest rank's median of each phase. */
static void print_two_phase(const bench_opts_t *o, int R, bench_rank_t *const *rk) {
  double m[5] = {0, 0, 0, 0, 0};
  for (int r = 0; r < R; r++) {
    for (int k = 0; k < 4; k++)
      if (rk[r]->ll_phases[k] > m[k]) m[k] = rk[r]->ll_phases[k];
    if (rk[r]->ll_zero_copy > m[4]) m[4] = rk[r]->ll_zero_copy;
  }
  printf("two-phase form (ep_ll_* with two_phase = 1, then ep_ll_recv; slowest rank's median of "
         "%d):\n  dispatch: send %.1f us, receive %.1f us;  combine: send %.1f us, receive %.1f "
         "us\n", o->iters, m[0] * 1e6, m[1] * 1e6, m[2] * 1e6, m[3] * 1e6);
  printf("zero-copy combine (y in ep_ll_get_combine_buffer's area, one phase; slowest rank's "
         "median):\n  %.1f us\n\n", m[4] * 1e6);
}

/* CPUs this process may run on (its affinity mask; containers and taskset narrow it). */
static int usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* CPU time over wall time of one rank's calls, in percent: both means over the same timed
 * iterations (a mean of CPU over a median of time overstates it whenever one iteration is
 * slow). A process cannot use more than every CPU it may run on: beyond that is accounting
 * jitter, and the figure is capped there. */
static double cpu_percent(double cpu_mean, double time_mean, int cpus) {
  double v = time_mean > 0 ? 100.0 * cpu_mean / time_mean : 0;
  return v > 100.0 * cpus ? 100.0 * cpus : v;
}

/* Prints `text` as lines of at most 100 columns, broken at spaces. */
static void print_wrapped(const char *text) {
  const int width = 100;
  while (*text) {
    int n = (int)strlen(text), cut = n;
    if (n > width) {
      cut = width;
      while (cut > 0 && text[cut] != ' ') cut--;
      if (cut == 0) cut = width;
    }
    printf("%.*s\n", cut, text);
    text += cut;
    while (*text == ' ') text++;
  }
}

/* What the columns mean; the low-latency mode counts bytes its own way. */
static void print_legend(const bench_opts_t *o, int R) {
  char text[1400];
  int cpus = usable_cpus(), n;
  if (o->mode == BENCH_LL)
    n = snprintf(text, sizeof text,
                 "GB/s as DeepEP's low-latency test counts it: selections of the rank's tokens x "
                 "row bytes (fp8: H + H/128 x 4 bytes of scales; combine: bf16 rows) per second, "
                 "per rank; one-phase calls. recv_rows: rows the rank's experts received. x-rank: "
                 "bytes of the selections sent to other ranks (payload + 8 bytes of metadata a "
                 "row).");
  else
    n = snprintf(text, sizeof text,
                 "GB/s as DeepEP counts it: rows received x row bytes (fp8: + scales) per second, "
                 "per rank; combine: the same rows sent back as bf16. x-rank: bytes of the rows "
                 "from other ranks (payload + index/topk metadata).");
  snprintf(text + n, sizeof text - (size_t)n,
           " Time: the slowest rank per iteration. memcpy: bytes copied per second per rank, all "
           "ranks copying at once with %d thread%s each. logical: DeepEP's bytes per rank. cpu%%: "
           "CPU time of the rank's process (all its threads) over its time, both averaged over "
           "the timed iterations; %d rank%s on %d CPU%s share %d%%. csw: context switches per "
           "call.",
           o->threads, o->threads > 1 ? "s" : "", R, R > 1 ? "s" : "", cpus, cpus > 1 ? "s" : "",
           100 * cpus);
  print_wrapped(text);
  printf("\n");
}

/* Column widths of the phase table: each figure is "%W.2f [%w.2f %w.2f]". */
#define FIG_W 9
#define FIG_PW 8
#define FIG_COL (FIG_W + 2 * FIG_PW + 4) /* "%W.2f [%w.2f %w.2f]" */

static void print_phase_table(const bench_opts_t *o, int R, phase_t *ph) {
  int ll = o->mode == BENCH_LL;
  double sc = ll ? 1e6 : 1e3; /* low-latency calls in microseconds */
  char time_hdr[40];
  snprintf(time_hdr, sizeof time_hdr, "time %s: median [p10 p90]", ll ? "us" : "ms");
  printf("\n%-30s %*s %*s %9s %9s\n", "", FIG_COL, time_hdr, FIG_COL,
         "GB/s/rank: median [p10 p90]", "logical", "x-rank");
  for (int k = 0; k < P_COUNT; k++) {
    phase_t *p = &ph[k];
    if (!p->present) continue;
    double mb = 0, wb = 0;
    for (int r = 0; r < R; r++) mb += p->bytes[r] / R / 1e6, wb += p->wire[r] / R / 1e6;
    printf("%-30s %*.2f [%*.2f %*.2f] %*.2f [%*.2f %*.2f] %7.1fMB %7.1fMB\n", p->label, FIG_W,
           p->time.median * sc, FIG_PW, p->time.p10 * sc, FIG_PW, p->time.p90 * sc, FIG_W,
           p->bw.median / 1e9, FIG_PW, p->bw.p10 / 1e9, FIG_PW, p->bw.p90 / 1e9, mb, wb);
  }
}

static void print_rank_table(const bench_opts_t *o, int R, phase_t *ph, bench_rank_t *const *rk,
                             ratios_t q) {
  int ll = o->mode == BENCH_LL, cpus = usable_cpus();
  double sc = ll ? 1e6 : 1e3;
  const char *u = ll ? "us" : "ms";
  char dh[16], ch[16];
  snprintf(dh, sizeof dh, "dispatch_%s", u), snprintf(ch, sizeof ch, "combine_%s", u);
  printf("\nper rank (median of its own iterations):\n");
  printf("%4s  %9s  %9s  %11s %6s %5s %5s  %11s %6s %5s %5s  %11s%s\n", "rank", "recv_rows",
         "self_rows", dh, "GB/s", "cpu%", "csw", ch, "GB/s", "cpu%", "csw", "memcpy_GB/s",
         q.have_base ? "  mpi_dispatch_ms  mpi_combine_ms" : "");
  for (int r = 0; r < R; r++) {
    const bench_rank_t *f = rk[r];
    double dt = ph[P_DISPATCH].rank_t[r], ct = ph[P_COMBINE].rank_t[r];
    printf("%4d  %9d  %9d  %11.2f %6.2f %5.0f %5.0f  %11.2f %6.2f %5.0f %5.0f  %11.2f", r,
           f->recv_rows, f->self_rows, dt * sc, ph[P_DISPATCH].bytes[r] / dt / 1e9,
           cpu_percent(f->d_cpu, ph[P_DISPATCH].rank_mean[r], cpus), f->d_csw, ct * sc,
           ph[P_COMBINE].bytes[r] / ct / 1e9,
           cpu_percent(f->c_cpu, ph[P_COMBINE].rank_mean[r], cpus), f->c_csw,
           ph[P_MEMCPY].bytes[r] / ph[P_MEMCPY].rank_t[r] / 1e9);
    if (q.have_base)
      printf("  %15.2f  %14.2f", ph[P_BDISPATCH].rank_t[r] * 1e3, ph[P_BCOMBINE].rank_t[r] * 1e3);
    printf("\n");
  }
  printf("\n");
}

/* Across hosts: what crossed the network and what stayed inside hosts, next to what the flat
 * baseline (one row per (token, rank) through MPI_Alltoallv) moves between and inside hosts. */
typedef struct {
  double net_d, net_c, local_d, local_c, pairs, flat_net_d, flat_net_c, flat_local_d, flat_local_c;
} traffic_t;

static traffic_t traffic_means(const bench_opts_t *o, int R, bench_rank_t *const *rk) {
  traffic_t m = {0};
  double row = (double)bench_row_bytes(o) + bench_num_scales(o) * 4.0, meta = 4.0 + o->topk * 12.0;
  for (int r = 0; r < R; r++) {
    const bench_rank_t *f = rk[r];
    m.net_d += f->net_d / R, m.net_c += f->net_c / R, m.pairs += f->host_pairs / R;
    m.local_d += f->local_d / R, m.local_c += f->local_c / R;
    m.flat_net_d += f->remote_rank_rows * (row + meta) / R;
    m.flat_local_d += f->local_rank_rows * (row + meta) / R;
    m.flat_net_c += f->remote_rank_rows * o->hidden * 2.0 / R;
    m.flat_local_c += f->local_rank_rows * o->hidden * 2.0 / R;
  }
  return m;
}

static void print_hosts(const bench_opts_t *o, int R, bench_rank_t *const *rk) {
  if (o->nhosts < 2 || o->mode != BENCH_NORMAL) return;
  traffic_t m = traffic_means(o, R, rk);
  double row = (double)bench_row_bytes(o) + bench_num_scales(o) * 4.0;
  printf("across %d hosts of %d ranks, MB sent per rank per call (mean over ranks):\n", o->nhosts,
         R / o->nhosts);
  printf("  %-34s %12s %12s\n", "", "network", "inside host");
  printf("  %-34s %12.2f %12.2f\n", "epcomm dispatch (measured)", m.net_d / 1e6, m.local_d / 1e6);
  printf("  %-34s %12.2f %12.2f\n", "epcomm combine (measured)", m.net_c / 1e6, m.local_c / 1e6);
  printf("  %-34s %12.2f %12.2f\n", "flat all-to-all dispatch (routing)", m.flat_net_d / 1e6,
         m.flat_local_d / 1e6);
  printf("  %-34s %12.2f %12.2f\n", "flat all-to-all combine (routing)", m.flat_net_c / 1e6,
         m.flat_local_c / 1e6);
  printf("  dispatch: %.0f bytes per (token, other host) pair (%.0f pairs per rank); a row is "
         "%.0f bytes, the rest its index, expert ids and weights\n\n",
         m.pairs > 0 ? m.net_d / m.pairs : 0, m.pairs, row);
}

static void print_table(const bench_opts_t *o, int R, phase_t *ph, bench_rank_t *const *rk,
                        const bench_baseline_t *b, ratios_t q, verdict_t v) {
  print_config(stdout, o, R);
  print_phase_table(o, R, ph);
  print_rank_table(o, R, ph, rk, q);
  print_hosts(o, R, rk);
  print_legend(o, R);
  if (o->mode == BENCH_LL) print_two_phase(o, R, rk);
  printf("ratio epcomm/ceiling:  dispatch %.2f, combine %.2f (GB/s over memcpy GB/s)\n",
         q.d_ceiling, q.c_ceiling);
  if (q.have_base)
    printf("ratio epcomm/baseline: dispatch %.2fx, combine %.2fx, dispatch+combine %.2fx "
           "(baseline time over epcomm time);\n                       dispatch+combine %.2fx "
           "with each time over its own run's memcpy time\n", q.d_base, q.c_base, q.t_base,
           q.t_base_norm);
  else
    printf("ratio epcomm/baseline: n/a (baseline not run: %s)\n",
           b && b->why[0] ? b->why : "--baseline off");
  printf("check: epcomm %s", v.epcomm_ok ? "matches the reference on every rank" : "MISMATCH");
  if (v.base_ok >= 0)
    printf("; baseline %s; outputs %s", v.base_ok ? "matches the reference" : "MISMATCH",
           v.agree ? "identical to epcomm's" : "DIFFER from epcomm's");
  printf("\n");
  if (v.msg[0]) printf("first mismatch: %s\n", v.msg);
}

/* ------------------------------------------------------------------ JSON */

static void json_stat(FILE *f, const char *k, bench_stat_t s, double scale, const char *end) {
  fprintf(f, "\"%s\": {\"median\": %.6g, \"p10\": %.6g, \"p90\": %.6g}%s", k, s.median * scale,
          s.p10 * scale, s.p90 * scale, end);
}

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fputc('\\', f);
    if ((unsigned char)*s >= 0x20) fputc(*s, f);
  }
  fputc('"', f);
}

static void print_json(FILE *f, const bench_opts_t *o, int R, phase_t *ph, bench_rank_t *const *rk,
                       const bench_baseline_t *b, ratios_t q, verdict_t v) {
  fprintf(f, "{\n\"tool\": \"epcomm bench\",\n\"version\": \"%s\",\n", ep_version_string());
  /* One scalar per line: bench/plot reads this block with awk. */
  fprintf(f, "\"summary\": {\n");
  fprintf(f, "  \"ranks\": %d,\n  \"threads\": %d,\n  \"tokens\": %d,\n  \"hidden\": %d,\n", R,
          o->threads, o->tokens, o->hidden);
  fprintf(f, "  \"dispatch_gbps\": %.4f,\n  \"combine_gbps\": %.4f,\n  \"memcpy_gbps\": %.4f,\n",
          ph[P_DISPATCH].bw.median / 1e9, ph[P_COMBINE].bw.median / 1e9,
          ph[P_MEMCPY].bw.median / 1e9);
  if (q.have_base)
    fprintf(f, "  \"baseline_dispatch_gbps\": %.4f,\n  \"baseline_combine_gbps\": %.4f,\n",
            ph[P_BDISPATCH].bw.median / 1e9, ph[P_BCOMBINE].bw.median / 1e9);
  fprintf(f, "  \"ratio_dispatch_ceiling\": %.4f,\n  \"ratio_combine_ceiling\": %.4f,\n",
          q.d_ceiling, q.c_ceiling);
  if (q.have_base)
    fprintf(f, "  \"ratio_dispatch_baseline\": %.4f,\n  \"ratio_combine_baseline\": %.4f,\n"
            "  \"ratio_total_baseline\": %.4f,\n  \"ratio_total_baseline_normalised\": %.4f,\n",
            q.d_base, q.c_base, q.t_base, q.t_base_norm);
  if (o->nhosts > 1 && o->mode == BENCH_NORMAL) {
    traffic_t m = traffic_means(o, R, rk);
    fprintf(f, "  \"hosts\": %d,\n  \"net_bytes_dispatch\": %.0f,\n  \"net_bytes_combine\": %.0f,\n"
            "  \"host_bytes_dispatch\": %.0f,\n  \"host_bytes_combine\": %.0f,\n"
            "  \"flat_net_bytes_dispatch\": %.0f,\n  \"flat_net_bytes_combine\": %.0f,\n"
            "  \"token_host_pairs\": %.0f,\n", o->nhosts, m.net_d, m.net_c, m.local_d, m.local_c,
            m.flat_net_d, m.flat_net_c, m.pairs);
  }
  fprintf(f, "  \"check\": \"%s\"\n},\n", v.epcomm_ok && v.base_ok != 0 && v.agree != 0 ? "pass" : "fail");
  fprintf(f, "\"config\": {\"mode\": \"%s\", \"backend\": \"%s\", \"ranks\": %d, "
          "\"threads\": %d, \"tokens\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, "
          "\"dtype\": \"%s\", \"routing\": \"%s\", \"warmup\": %d, \"iters\": %d, \"seed\": %llu},\n",
          o->mode == BENCH_LL ? "ll" : "normal", o->backend_cuda ? "cuda" : "cpu", R, o->threads,
          o->tokens, o->hidden, o->topk,
          o->experts, o->dtype == BENCH_FP8 ? "fp8" : "bf16", bench_routing_name(o->routing),
          o->warmup, o->iters, (unsigned long long)o->seed);
  fprintf(f, "\"units\": {\"time\": \"ms, slowest rank per iteration\", \"gbps\": \"1e9 bytes/s "
          "per rank: mean bytes over ranks / that time\", \"bytes\": \"logical = DeepEP's "
          "received rows x row bytes (fp8 with scales); cross_rank = payload + metadata of rows "
          "from other ranks\", \"memcpy\": \"bytes copied\"},\n");
  fprintf(f, "\"phases\": {\n");
  int first = 1;
  for (int k = 0; k < P_COUNT; k++) {
    phase_t *p = &ph[k];
    if (!p->present) continue;
    fprintf(f, "%s  \"%s\": {", first ? "" : ",\n", p->key);
    first = 0;
    json_stat(f, "time_ms", p->time, 1e3, ", ");
    json_stat(f, "gbps", p->bw, 1e-9, ",\n    \"per_rank\": [");
    for (int r = 0; r < R; r++) {
      fprintf(f, "%s{\"rank\": %d, \"time_ms\": %.6g, \"gbps\": %.6g, \"logical_bytes\": %.0f, "
              "\"cross_rank_bytes\": %.0f", r ? ",\n      " : "", r, p->rank_t[r] * 1e3,
              p->bytes[r] / p->rank_t[r] / 1e9, p->bytes[r], p->wire[r]);
      if (k == P_DISPATCH || k == P_COMBINE)
        fprintf(f, ", \"cpu_ms\": %.6g, \"context_switches\": %.1f",
                1e3 * (k == P_DISPATCH ? rk[r]->d_cpu : rk[r]->c_cpu),
                k == P_DISPATCH ? rk[r]->d_csw : rk[r]->c_csw);
      fprintf(f, "}");
    }
    fprintf(f, "]}");
  }
  fprintf(f, "\n},\n\"ranks\": [");
  for (int r = 0; r < R; r++) {
    fprintf(f, "%s{\"rank\": %d, \"recv_rows\": %d, \"self_rows\": %d", r ? ", " : "", r,
            rk[r]->recv_rows, rk[r]->self_rows);
    if (o->mode == BENCH_LL) /* two-phase form: medians of this rank, microseconds */
      fprintf(f, ", \"two_phase_us\": {\"dispatch_send\": %.2f, \"dispatch_recv\": %.2f, "
              "\"combine_send\": %.2f, \"combine_recv\": %.2f}", rk[r]->ll_phases[0] * 1e6,
              rk[r]->ll_phases[1] * 1e6, rk[r]->ll_phases[2] * 1e6, rk[r]->ll_phases[3] * 1e6);
    if (o->mode == BENCH_LL)
      fprintf(f, ", \"zero_copy_combine_us\": %.2f", rk[r]->ll_zero_copy * 1e6);
    fprintf(f, "}");
  }
  fprintf(f, "],\n\"baseline\": {\"ran\": %s, \"note\": ", b && b->ran ? "true" : "false");
  json_str(f, b ? b->why : "--baseline off");
  fprintf(f, "},\n\"check\": {\"epcomm\": %s, \"baseline\": %s, \"agree\": %s, \"first_mismatch\": ",
          v.epcomm_ok ? "true" : "false", v.base_ok < 0 ? "null" : v.base_ok ? "true" : "false",
          v.agree < 0 ? "null" : v.agree ? "true" : "false");
  json_str(f, v.msg);
  fprintf(f, "}\n}\n");
}

int bench_report(const bench_opts_t *o, int R, bench_rank_t *const *ranks,
                 const bench_baseline_t *b) {
  phase_t ph[P_COUNT];
  memset(ph, 0, sizeof ph);
  build(o, R, ranks, b, ph);
  ratios_t q = ratios(ph);
  verdict_t v = verdict(o, R, ranks, b);
  int rc = 0;
  if (!o->json || strcmp(o->json, "-")) print_table(o, R, ph, ranks, b, q, v);
  if (o->json) {
    FILE *f = strcmp(o->json, "-") ? fopen(o->json, "we") : stdout;
    if (!f) {
      fprintf(stderr, "epcomm bench: cannot write %s\n", o->json);
      rc = 2;
    } else {
      print_json(f, o, R, ph, ranks, b, q, v);
      if (f != stdout) fclose(f);
    }
  }
  fflush(stdout);
  for (int k = 0; k < P_COUNT; k++)
    free(ph[k].t), free(ph[k].bytes), free(ph[k].wire), free(ph[k].rank_t), free(ph[k].rank_mean);
  if (!v.epcomm_ok || v.base_ok == 0 || v.agree == 0) rc = 1;
  return rc;
}
