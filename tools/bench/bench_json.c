/* The report as JSON (`--json`): a "summary" block with one scalar per line (bench/plot reads it
 * with awk), the configuration, every phase with its aggregate and per-rank figures, the
 * baseline's status and the checks. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "bench_report.h"
#include "tk_json.h"

static void stat(FILE *f, const char *k, bench_stat_t s, double scale) {
  fprintf(f, "\"%s\": {\"median\": ", k);
  tk_json_num(f, s.median * scale), fputs(", \"p10\": ", f);
  tk_json_num(f, s.p10 * scale), fputs(", \"p90\": ", f);
  tk_json_num(f, s.p90 * scale), fputs(", \"mean\": ", f);
  tk_json_num(f, s.mean * scale), fputs("}", f);
}

static void summary_gbps(FILE *f, const phases_t *ph, const char *key, const char *name) {
  const phase_t *p = bench_phase(ph, key);
  if (p && p->bw.median > 0) fprintf(f, "  \"%s\": %.4f,\n", name, p->bw.median / 1e9);
}

/* Across hosts: the bytes of print_hosts (bench_report.c), per rank per call. */
static void summary_hosts(FILE *f, const bench_opts_t *o, const phases_t *ph,
                          bench_rank_t *const *rk) {
  if (o->nhosts < 2 || o->mode != BENCH_NORMAL) return;
  bench_traffic_t m = bench_traffic(o, ph->R, rk);
  fprintf(f,
          "  \"hosts\": %d,\n  \"net_bytes_dispatch\": %.0f,\n  \"net_bytes_combine\": %.0f,\n"
          "  \"host_bytes_dispatch\": %.0f,\n  \"host_bytes_combine\": %.0f,\n"
          "  \"flat_net_bytes_dispatch\": %.0f,\n  \"flat_net_bytes_combine\": %.0f,\n"
          "  \"token_host_pairs\": %.0f,\n",
          o->nhosts, m.net_d, m.net_c, m.local_d, m.local_c, m.flat_net_d, m.flat_net_c, m.pairs);
}

/* A fast-path row (bench_path_t): the fewest of its calls that took the path on any rank that
 * receives rows (a rank that receives none writes nothing in place), of how many calls;
 * `path` is the offset of the row's counts in a rank's results (offsetof(bench_rank_t, ...)). */
static void summary_path(FILE *f, int R, bench_rank_t *const *rk, size_t path,
                         const char *calls_key, const char *took_key) {
  int32_t least = -1, calls = -1;
  for (int r = 0; r < R; r++) {
    const bench_path_t p = *(const bench_path_t *)((const char *)rk[r] + path);
    if (p.calls < 0 || rk[r]->recv_rows <= 0) continue;
    calls = p.calls;
    if (least < 0 || p.took < least) least = p.took;
  }
  if (calls >= 0) fprintf(f, "  \"%s\": %d,\n  \"%s\": %d,\n", calls_key, calls, took_key, least);
}

static void summary(FILE *f, const bench_opts_t *o, const phases_t *ph, const ratios_t *q,
                    const verdict_t *v, bench_rank_t *const *rk) {
  fprintf(f, "\"summary\": {\n");
  fprintf(f, "  \"ranks\": %d,\n  \"threads\": %d,\n  \"tokens\": %d,\n  \"hidden\": %d,\n", ph->R,
          o->threads, o->tokens, o->hidden);
  summary_gbps(f, ph, "dispatch", "dispatch_gbps");
  summary_gbps(f, ph, "combine", "combine_gbps");
  summary_gbps(f, ph, "memcpy", "memcpy_gbps");
  summary_gbps(f, ph, "baseline_dispatch", "baseline_dispatch_gbps");
  summary_gbps(f, ph, "baseline_combine", "baseline_combine_gbps");
  const struct {
    const char *name;
    double v;
  } r[] = {
      {"ratio_dispatch_ceiling", q->d_ceiling}, {"ratio_combine_ceiling", q->c_ceiling},
      {"ratio_dispatch_baseline", q->d_base},   {"ratio_combine_baseline", q->c_base},
      {"ratio_total_baseline", q->t_base},      {"ratio_total_baseline_normalised", q->t_base_norm},
      {"ratio_graph_calls", q->graph},          {"overlap_efficiency", q->overlap}};
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++)
    if (r[i].v > 0) fprintf(f, "  \"%s\": %.4f,\n", r[i].name, r[i].v);
  summary_hosts(f, o, ph, rk);
  summary_path(f, ph->R, rk, offsetof(bench_rank_t, alloc_reg), "alloc_reg_calls",
               "alloc_reg_in_place_min");
  summary_path(f, ph->R, rk, offsetof(bench_rank_t, caller_pull), "caller_calls",
               "caller_pulled_min");
  summary_path(f, ph->R, rk, offsetof(bench_rank_t, alloc_pull), "alloc_calls", "alloc_pulled_min");
  summary_path(f, ph->R, rk, offsetof(bench_rank_t, combine_copy), "combine_calls",
               "combine_copied_min");
  fprintf(f, "  \"check\": \"%s\"\n},\n", bench_passed(v) ? "pass" : "fail");
}

static void config(FILE *f, const bench_opts_t *o, int R) {
  fprintf(f,
          "\"config\": {\"mode\": \"%s\", \"backend\": \"%s\", \"ranks\": %d, "
          "\"threads\": %d, \"tokens\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, "
          "\"dtype\": \"%s\", \"routing\": \"%s\", \"warmup\": %d, \"iters\": %d, "
          "\"variants\": \"%s\", \"seed\": %llu},\n",
          o->mode == BENCH_LL ? "ll" : "normal", o->backend == BENCH_CUDA ? "cuda" : "cpu", R,
          o->threads, o->tokens, o->hidden, o->topk, o->experts, bench_dtype_name(o->dtype),
          bench_routing_name(o->routing), o->warmup, o->iters,
          o->variants == BENCH_VARIANTS_MAIN ? "main" : "all", (unsigned long long)o->seed);
}

static void phase_ranks(FILE *f, const phase_t *p, int R) {
  for (int r = 0; r < R; r++) {
    double t = p->rank_t[r];
    fprintf(f, "%s{\"rank\": %d, \"time_ms\": %.6g, \"mean_ms\": %.6g, \"gbps\": ",
            r ? ",\n      " : "", r, t * 1e3, p->rank_mean[r] * 1e3);
    tk_json_num(f, p->bytes[r] > 0 && t > 0 ? p->bytes[r] / t / 1e9 : NAN);
    fprintf(f, ", \"logical_bytes\": %.0f, \"cross_rank_bytes\": %.0f", p->bytes[r], p->wire[r]);
    if (p->cpu[r] >= 0)
      fprintf(f, ", \"cpu_ms\": %.6g, \"context_switches\": %.1f", 1e3 * p->cpu[r], p->csw[r]);
    if (p->host[r] >= 0) fprintf(f, ", \"host_ms\": %.6g", 1e3 * p->host[r]);
    fprintf(f, "}");
  }
}

/* DeepEP's harness's statistic: each rank's mean over the iterations, the largest of them. The
 * mean of each iteration's slowest rank (time_ms's mean) is never below it, and above it by the
 * ranks' jitter (at R = 8 and 128 tokens on one H100 by 17-19%): comparisons with DeepEP use this
 * one. */
static double slowest_mean(const phase_t *p, int R) {
  double m = 0;
  for (int r = 0; r < R; r++)
    if (p->rank_mean[r] > m) m = p->rank_mean[r];
  return m;
}

static void phases(FILE *f, const phases_t *ph) {
  fprintf(f, "\"phases\": {\n");
  for (int k = 0; k < ph->n; k++) {
    const phase_t *p = &ph->p[k];
    fprintf(f, "%s  \"%s\": {\"label\": ", k ? ",\n" : "", p->meta.key);
    tk_json_str(f, p->meta.label);
    fputs(", ", f);
    stat(f, "time_ms", p->time, 1e3);
    fprintf(f, ", \"slowest_rank_mean_ms\": %.6g, ", slowest_mean(p, ph->R) * 1e3);
    stat(f, "gbps", p->bw, p->bw.median > 0 ? 1e-9 : NAN);
    fprintf(f, ",\n    \"per_rank\": [");
    phase_ranks(f, p, ph->R);
    fprintf(f, "]}");
  }
  fprintf(f, "\n},\n");
}

void bench_json(FILE *f, const bench_opts_t *o, const bench_who_t *who, const phases_t *ph,
                bench_rank_t *const *rk, const bench_base_t *b, const ratios_t *q,
                const verdict_t *v) {
  fprintf(f, "{\n\"tool\": ");
  tk_json_str(f, who->tool);
  fprintf(f, ",\n\"version\": ");
  tk_json_str(f, who->version);
  fprintf(f, ",\n");
  summary(f, o, ph, q, v, rk);
  config(f, o, ph->R);
  fprintf(f,
          "\"units\": {\"time\": \"ms, slowest rank per iteration\", "
          "\"slowest_rank_mean_ms\": \"each rank's mean over the iterations (per_rank mean_ms), "
          "the largest (DeepEP's harness's statistic)\", \"gbps\": \"1e9 bytes/s per rank: mean "
          "bytes over ranks / that time\", \"bytes\": \"logical = DeepEP's received rows x row "
          "bytes (fp8 with scales); cross_rank = payload + metadata of rows from other ranks\", "
          "\"memcpy\": \"bytes copied\", \"host_ms\": \"GPU rows: the rank's host time in the "
          "call, median: enqueueing it, and in a full dispatch the wait for the count; in a call "
          "without a host wait, above time_ms the GPU waited for the host\"},\n");
  phases(f, ph);
  fprintf(f, "\"ranks\": [");
  for (int r = 0; r < ph->R; r++)
    fprintf(f, "%s{\"rank\": %d, \"recv_rows\": %d, \"self_rows\": %d}", r ? ", " : "", r,
            rk[r]->recv_rows, rk[r]->self_rows);
  fprintf(f, "],\n\"baseline\": {\"ran\": %s, \"name\": ", b && b->ran ? "true" : "false");
  tk_json_str(f, b && b->name[0] ? b->name : "none");
  fprintf(f, ", \"note\": ");
  tk_json_str(f, b ? b->why : "--baseline off");
  fprintf(f, "},\n\"check\": {\"%s\": %s, \"baseline\": %s, \"agree\": %s, \"first_mismatch\": ",
          v->alone ? "baseline_alone" : "epcomm", v->ok ? "true" : "false",
          v->base_ok < 0 ? "null"
          : v->base_ok   ? "true"
                         : "false",
          v->agree < 0 ? "null"
          : v->agree   ? "true"
                       : "false");
  tk_json_str(f, v->msg);
  fprintf(f, "}\n}\n");
}
