/* Rank 0's report (bench_result.h): the table on stdout and/or JSON (bench_json.c), from the
 * aggregates of bench_phases.c. One format for every program and backend. */
#include "bench_report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int ll(const bench_opts_t *o) {
  return o->mode == BENCH_LL;
}
static int cuda(const bench_opts_t *o) {
  return o->backend == BENCH_CUDA;
}

static void print_config(const bench_opts_t *o, const bench_who_t *who, int R) {
  char workers[40];
  if (cuda(o) && o->threads > 0)
    snprintf(workers, sizeof workers, "%d SMs", o->threads);
  else if (cuda(o))
    snprintf(workers, sizeof workers, "the library's SMs");
  else
    snprintf(workers, sizeof workers, "%d thread%s", o->threads, o->threads > 1 ? "s" : "");
  char hosts[32] = "";
  if (o->nhosts > 1) snprintf(hosts, sizeof hosts, " on %d hosts", o->nhosts);
  printf(
      "%s: %s mode, %s, %d ranks%s x %s; per rank %d tokens, hidden %d %s, topk %d, %d experts, "
      "%s routing; %d warm-up + %d timed iterations\n",
      who->tool, ll(o) ? "low-latency" : "normal", who->what, R, hosts, workers, o->tokens,
      o->hidden, o->dtype == BENCH_FP8 ? "fp8 (+ fp32 scales)" : "bf16", o->topk, o->experts,
      bench_routing_name(o->routing), o->warmup, o->iters);
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

/* What the bytes mean; the low-latency mode counts them its own way. */
static int legend_bytes(const bench_opts_t *o, char *text, size_t n) {
  if (ll(o))
    return snprintf(text, n,
                    "GB/s as DeepEP's low-latency test counts it: selections of the rank's tokens "
                    "x row bytes (fp8: H + H/128 x 4 bytes of scales; combine: bf16 rows) per "
                    "second, per rank. recv_rows: rows the rank's experts received. x-rank: bytes "
                    "of the selections sent to other ranks (payload + 8 bytes of metadata a row).");
  return snprintf(text, n,
                  "GB/s as DeepEP counts it: rows received x row bytes (fp8: + scales) per second, "
                  "per rank; combine: the same rows sent back as bf16. x-rank: bytes of the rows "
                  "from other ranks (payload + index/topk metadata).");
}

/* How the time was taken, and what the ceiling is. cpu% only where it was measured. */
static int legend_time(const bench_opts_t *o, const bench_who_t *who, const phases_t *ph,
                       char *text, size_t n) {
  const phase_t *d = bench_phase(ph, "dispatch");
  int R = ph->R, len;
  if (cuda(o))
    return snprintf(text, n,
                    " Time: GPU time of each call by CUDA events on its stream, the calls of a row "
                    "issued back to back (no host wait between them); the slowest rank per "
                    "iteration. copy ceiling: bytes copied per second per rank by a device copy "
                    "kernel, all ranks copying at once. logical: DeepEP's bytes per rank.");
  len = snprintf(text, n,
                 " Time: the slowest rank per iteration. memcpy: bytes copied per second per rank, "
                 "all ranks copying at once with %d thread%s each. logical: DeepEP's bytes per "
                 "rank.",
                 o->threads, o->threads > 1 ? "s" : "");
  if (d && d->cpu[0] >= 0 && len > 0 && (size_t)len < n)
    len += snprintf(text + len, n - (size_t)len,
                    " cpu%%: CPU time of the rank's process (all its threads) over its time, both "
                    "averaged over the timed iterations; %d rank%s on %d CPU%s share %d%%. csw: "
                    "context switches per call.",
                    R, R > 1 ? "s" : "", who->cpus, who->cpus > 1 ? "s" : "", 100 * who->cpus);
  return len;
}

/* What each variant row is, for the rows present. */
static void legend_rows(const bench_opts_t *o, const phases_t *ph, char *text, size_t n) {
  const struct {
    const char *key, *text;
  } rows[] = {{"dispatch", NULL},
              {"dispatch_cached",
               " cached: a dispatch along an earlier one's handle (what DeepEP's tuning "
               "loop times)."},
              {"dispatch_pair_full",
               " pair: a full dispatch and a cached one along its handle in each iteration, "
               "timed apart (full - cached; the cached call follows the full one)."},
              {"dispatch_wc",
               " worst case: a full dispatch whose views hold a fixed number of rows (the "
               "count), so the host does not wait for the count exchange."},
              {"dispatch_tri_full",
               " triple: a full dispatch and two cached ones along its handle in each "
               "iteration, timed apart."},
              {"dispatch_sync_full",
               " after barrier: a full dispatch, the stream's end and a barrier (untimed), and "
               "a cached dispatch along its handle in each iteration."},
              {"dispatch_flush_full",
               " after flush: the same with a 64 MB device copy before the barrier."},
              {"dispatch_lpair_full",
               " dispatch + combine pair: the same pair, each dispatch followed by a combine of "
               "its received rows (untimed), a MoE layer's order."},
              {"dispatch_cached_caller", " caller: the rows copied into the caller's tensors."},
              {"dispatch_alloc",
               " allocator: a full dispatch whose outputs come from an allocator callback "
               "(the rows copied out of the buffer)."},
              {"dispatch_alloc_reg",
               " allocator, reg.: the same with the allocator's recv_x registered; "
               "EP_CUDA_LATE_HELLO=1: written in place by the senders."},
              {"dispatch_cached_reg",
               " reg. caller: caller tensors registered with the buffer (ep_register_memory), "
               "recv_x written in place by the senders."},
              {"combine_view",
               " view: the experts' outputs written into the bf16 dispatch view, which "
               "combine reads in place."},
              {"combine_cbuf",
               " comb. buf: the experts' outputs written into ep_get_combine_buffer's "
               "memory, read in place by the peers."},
              {"write_combine_cbuf",
               " write + combine: the experts' write (a device copy of their rows) "
               "and the combine, timed together."},
              {"combine_reg",
               " reg. tensor: a separate tensor registered with the buffer "
               "(ep_register_memory), read in place by the peers."},
              {"combine_zero_copy",
               " zero copy: the experts' outputs written into "
               "ep_ll_get_combine_buffer's area."},
              {"dispatch_send",
               " two-phase: each call only sends, ep_ll_recv completes it; the phases "
               "timed apart."},
              {"graph", " graph replay: dispatch + combine captured once in a CUDA graph."},
              {"overlap",
               " overlap: send, a compute kernel over every SM (--compute-us), receive, for "
               "dispatch and combine."}};
  size_t len = strlen(text);
  for (size_t i = 0; i < sizeof rows / sizeof rows[0] && len < n; i++) {
    if (!bench_phase(ph, rows[i].key)) continue;
    if (rows[i].text)
      len += (size_t)snprintf(text + len, n - len, "%s", rows[i].text);
    else if (o->mode == BENCH_LL)
      len += (size_t)snprintf(text + len, n - len,
                              " epcomm dispatch and combine: one-phase calls, "
                              "the expert outputs in a tensor.");
    else
      len += (size_t)snprintf(text + len, n - len,
                              " epcomm dispatch: a full dispatch (count "
                              "exchange included), outputs %s; combine: the expert outputs in a "
                              "tensor.",
                              cuda(o) ? "as views inside the buffer (no copy)"
                                      : "from an allocator callback, as a framework "
                                        "allocates them");
  }
}

static void print_legend(const bench_opts_t *o, const bench_who_t *who, const phases_t *ph) {
  char text[2400];
  int n = legend_bytes(o, text, sizeof text);
  n += legend_time(o, who, ph, text + n, sizeof text - (size_t)n);
  if (n > 0 && (size_t)n < sizeof text) legend_rows(o, ph, text, sizeof text);
  print_wrapped(text);
  printf("\n");
}

/* Column widths of the phase table: each figure is "%W.2f [%w.2f %w.2f]". */
#define FIG_W 9
#define FIG_PW 8
#define FIG_COL (FIG_W + 2 * FIG_PW + 4)

static int label_width(const phases_t *ph) {
  int w = 30;
  for (int k = 0; k < ph->n; k++) {
    int n = (int)strlen(ph->p[k].meta.label);
    w = n > w ? n : w;
  }
  return w;
}

static void print_phase(const phase_t *p, int R, int lw, double sc) {
  double mb = 0, wb = 0;
  for (int r = 0; r < R; r++) mb += p->bytes[r] / R / 1e6, wb += p->wire[r] / R / 1e6;
  printf("%-*s %*.2f [%*.2f %*.2f] ", lw, p->meta.label, FIG_W, p->time.median * sc, FIG_PW,
         p->time.p10 * sc, FIG_PW, p->time.p90 * sc);
  if (p->bw.median > 0)
    printf("%*.2f [%*.2f %*.2f] %7.1fMB %7.1fMB\n", FIG_W, p->bw.median / 1e9, FIG_PW,
           p->bw.p10 / 1e9, FIG_PW, p->bw.p90 / 1e9, mb, wb);
  else
    printf("%*s %9s %9s\n", FIG_COL, "-", "-", "-");
}

static void print_phase_table(const bench_opts_t *o, const phases_t *ph) {
  double sc = ll(o) ? 1e6 : 1e3; /* low-latency calls in microseconds */
  char time_hdr[40];
  int lw = label_width(ph);
  snprintf(time_hdr, sizeof time_hdr, "time %s: median [p10 p90]", ll(o) ? "us" : "ms");
  printf("\n%-*s %*s %*s %9s %9s\n", lw, "", FIG_COL, time_hdr, FIG_COL,
         "GB/s/rank: median [p10 p90]", "logical", "x-rank");
  for (int k = 0; k < ph->n; k++) print_phase(&ph->p[k], ph->R, lw, sc);
}

/* One rank's time (o's unit), GB/s, cpu% and csw of phase p, or dashes where not measured. */
static void print_rank_cells(const phase_t *p, int r, double sc, int cpus) {
  double t = p->rank_t[r];
  printf("  %11.2f %6.2f", t * sc, t > 0 ? p->bytes[r] / t / 1e9 : 0);
  if (p->cpu[r] >= 0)
    printf(" %5.0f %5.0f", cpu_percent(p->cpu[r], p->rank_mean[r], cpus), p->csw[r]);
  else
    printf(" %5s %5s", "-", "-");
}

static void print_rank_table(const bench_opts_t *o, const bench_who_t *who, const phases_t *ph,
                             bench_rank_t *const *rk) {
  const phase_t *d = bench_phase(ph, "dispatch"), *c = bench_phase(ph, "combine"),
                *m = bench_phase(ph, "memcpy"), *bd = bench_phase(ph, "baseline_dispatch"),
                *bc = bench_phase(ph, "baseline_combine");
  double sc = ll(o) ? 1e6 : 1e3;
  const char *u = ll(o) ? "us" : "ms";
  char dh[16], ch[16];
  snprintf(dh, sizeof dh, "dispatch_%s", u), snprintf(ch, sizeof ch, "combine_%s", u);
  printf("\nper rank (median of its own iterations):\n%4s  %9s  %9s", "rank", "recv_rows",
         "self_rows");
  if (d && c)
    printf("  %11s %6s %5s %5s  %11s %6s %5s %5s", dh, "GB/s", "cpu%", "csw", ch, "GB/s", "cpu%",
           "csw");
  printf("%s%s\n", m ? "  memcpy_GB/s" : "", bd && bc ? "  mpi_dispatch_ms  mpi_combine_ms" : "");
  for (int r = 0; r < ph->R; r++) {
    printf("%4d  %9d  %9d", r, rk[r]->recv_rows, rk[r]->self_rows);
    if (d && c) print_rank_cells(d, r, sc, who->cpus), print_rank_cells(c, r, sc, who->cpus);
    if (m) printf("  %11.2f", m->rank_t[r] > 0 ? m->bytes[r] / m->rank_t[r] / 1e9 : 0);
    if (bd && bc) printf("  %15.2f  %14.2f", bd->rank_t[r] * 1e3, bc->rank_t[r] * 1e3);
    printf("\n");
  }
  printf("\n");
}

static void print_ratios(const bench_opts_t *o, const phases_t *ph, const bench_base_t *b,
                         const ratios_t *q, const verdict_t *v) {
  if (v->alone) return;
  if (q->d_ceiling > 0 || q->c_ceiling > 0)
    printf("ratio epcomm/ceiling:  dispatch %.2f, combine %.2f (GB/s over %s GB/s)\n", q->d_ceiling,
           q->c_ceiling, cuda(o) ? "copy" : "memcpy");
  if (q->t_base > 0)
    printf(
        "ratio epcomm/baseline: dispatch %.2fx, combine %.2fx, dispatch+combine %.2fx "
        "(baseline time over epcomm time);\n                       dispatch+combine %.2fx "
        "with each time over its own run's memcpy time\n",
        q->d_base, q->c_base, q->t_base, q->t_base_norm);
  else if (q->d_base > 0)
    printf("ratio epcomm/baseline: dispatch %.2fx (%s time over epcomm time)\n", q->d_base,
           b->name);
  else
    printf("ratio epcomm/baseline: n/a (baseline not run: %s)\n",
           b && b->why[0] ? b->why : "--baseline off");
  if (q->graph > 0) printf("graph replay / (dispatch + combine), medians: %.2f\n", q->graph);
  if (q->overlap > 0)
    printf("overlap efficiency (communication alone + compute alone) / overlapped: %.2f\n",
           q->overlap);
  (void)ph;
}

static void print_check(const verdict_t *v) {
  printf("check: %s %s", v->alone ? "baseline" : "epcomm",
         v->ok ? "matches the reference on every rank" : "MISMATCH");
  if (v->base_ok >= 0) printf("; baseline %s", v->base_ok ? "matches the reference" : "MISMATCH");
  if (v->agree >= 0)
    printf("; outputs %s", v->agree ? "identical to epcomm's" : "DIFFER from epcomm's");
  printf("\n");
  if (v->msg[0]) printf("first mismatch: %s\n", v->msg);
}

/* Across hosts: what crossed the network and what stayed inside hosts (measured), next to what
 * the flat baseline (one row per (token, rank) through MPI_Alltoallv) moves between and inside
 * hosts for the same routing. */
static void print_hosts(const bench_opts_t *o, int R, bench_rank_t *const *rk) {
  if (o->nhosts < 2) return;
  bench_traffic_t m = bench_traffic(o, R, rk);
  if (ll(o)) { /* one row per (token, expert) straight to its rank: nothing flat to compare */
    printf(
        "across %d hosts of %d ranks, MB sent per rank per call (mean over ranks), "
        "low-latency mode (one row per selected expert, straight to its rank):\n",
        o->nhosts, R / o->nhosts);
    printf("  %-34s %12s %12s\n", "", "network", "inside host");
    printf("  %-34s %12.2f %12.2f\n", "epcomm dispatch (measured)", m.net_d / 1e6, m.local_d / 1e6);
    printf("  %-34s %12.2f %12.2f\n\n", "epcomm combine (measured)", m.net_c / 1e6,
           m.local_c / 1e6);
    return;
  }
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
  printf(
      "  dispatch: %.0f bytes per (token, other host) pair (%.0f pairs per rank); a row is "
      "%.0f bytes, the rest its index, expert ids and weights\n\n",
      m.pairs > 0 ? m.net_d / m.pairs : 0, m.pairs, row);
}

bench_traffic_t bench_traffic(const bench_opts_t *o, int R, bench_rank_t *const *rk) {
  bench_traffic_t m = {0};
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

static void print_table(const bench_opts_t *o, const bench_who_t *who, const phases_t *ph,
                        bench_rank_t *const *rk, const bench_base_t *b, const ratios_t *q,
                        const verdict_t *v) {
  print_config(o, who, ph->R);
  print_phase_table(o, ph);
  print_rank_table(o, who, ph, rk);
  print_hosts(o, ph->R, rk);
  print_legend(o, who, ph);
  print_ratios(o, ph, b, q, v);
  print_check(v);
}

int bench_report(const bench_opts_t *o, const bench_who_t *who, int R, bench_rank_t *const *rk,
                 const bench_base_t *b) {
  phases_t *ph = calloc(1, sizeof *ph);
  if (!ph || bench_build_phases(ph, R, rk)) {
    fprintf(stderr, "%s: out of memory for the report\n", who->tool);
    if (ph) bench_free_phases(ph);
    free(ph);
    return 2;
  }
  ratios_t q = bench_ratios(ph);
  verdict_t v = bench_verdict(R, rk, b);
  int rc = bench_passed(&v) ? 0 : 1;
  if (!o->json || strcmp(o->json, "-")) print_table(o, who, ph, rk, b, &q, &v);
  if (o->json) {
    FILE *f = strcmp(o->json, "-") ? fopen(o->json, "we") : stdout;
    if (!f) {
      fprintf(stderr, "%s: cannot write %s\n", who->tool, o->json);
      rc = 2;
    } else {
      bench_json(f, o, who, ph, rk, b, &q, &v);
      if (f != stdout) fclose(f);
    }
  }
  fflush(stdout);
  bench_free_phases(ph);
  free(ph);
  return rc;
}
