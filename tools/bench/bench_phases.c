/* Rank 0's aggregates (bench_report.h): every row over all ranks, per iteration the slowest
 * rank's time, then median / p10 / p90 over the iterations; the ratios; the verdict. The same
 * code for every program and backend. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_report.h"

static int alloc_phase(phase_t *p, int R, int I) {
  p->t = calloc((size_t)R * I, sizeof *p->t);
  p->bytes = calloc((size_t)R, sizeof *p->bytes), p->wire = calloc((size_t)R, sizeof *p->wire);
  p->cpu = calloc((size_t)R, sizeof *p->cpu), p->csw = calloc((size_t)R, sizeof *p->csw);
  p->host = calloc((size_t)R, sizeof *p->host);
  p->rank_t = calloc((size_t)R, sizeof *p->rank_t);
  p->rank_mean = calloc((size_t)R, sizeof *p->rank_mean);
  return p->t && p->bytes && p->wire && p->cpu && p->csw && p->host && p->rank_t && p->rank_mean
             ? 0
             : -1;
}

static void aggregate(phase_t *p, int R, int iters) {
  double *tmax = calloc((size_t)iters, sizeof *tmax), *bw = calloc((size_t)iters, sizeof *bw);
  double mean = 0;
  if (!tmax || !bw) goto out;
  for (int r = 0; r < R; r++) mean += p->bytes[r] / R;
  for (int i = 0; i < iters; i++) {
    for (int r = 0; r < R; r++)
      if (p->t[(size_t)r * iters + i] > tmax[i]) tmax[i] = p->t[(size_t)r * iters + i];
    bw[i] = tmax[i] > 0 ? mean / tmax[i] : 0;
  }
  p->time = bench_stats(tmax, iters);
  p->bw = bench_stats(bw, iters);
  for (int r = 0; r < R; r++) {
    p->rank_t[r] = bench_stats(p->t + (size_t)r * iters, iters).median;
    for (int i = 0; i < iters; i++) p->rank_mean[r] += p->t[(size_t)r * iters + i] / iters;
  }
out:
  free(tmax), free(bw);
}

/* Row `key` of every rank into a new phase (rank 0's meta). */
static phase_t *add_row(phases_t *ph, bench_rank_t *const *rk, int i) {
  phase_t *p = &ph->p[ph->n];
  int I = ph->iters;
  if (alloc_phase(p, ph->R, I)) return NULL;
  p->meta = rk[0]->row[i];
  for (int r = 0; r < ph->R; r++) {
    int j = bench_row_find(rk[r], p->meta.key);
    if (j < 0) continue; /* a rank without the row: zeros, which the check reports anyway */
    memcpy(p->t + (size_t)r * I, bench_row_times(rk[r], j), (size_t)I * sizeof *p->t);
    p->bytes[r] = rk[r]->row[j].bytes, p->wire[r] = rk[r]->row[j].wire;
    p->cpu[r] = rk[r]->row[j].cpu, p->csw[r] = rk[r]->row[j].csw;
    p->host[r] = rk[r]->row[j].host;
  }
  ph->n++;
  return p;
}

/* "<prefix>dispatch" + "<prefix>combine" as one more phase, per rank and iteration. */
static void add_sum(phases_t *ph, const char *prefix) {
  char kd[48], kc[48], key[48];
  snprintf(kd, sizeof kd, "%sdispatch", prefix), snprintf(kc, sizeof kc, "%scombine", prefix);
  snprintf(key, sizeof key, "%sdispatch_combine", prefix);
  const phase_t *d = bench_phase(ph, kd), *c = bench_phase(ph, kc);
  phase_t *p = &ph->p[ph->n];
  if (!d || !c || alloc_phase(p, ph->R, ph->iters)) return;
  p->meta = d->meta;
  snprintf(p->meta.key, sizeof p->meta.key, "%s", key);
  snprintf(p->meta.label, sizeof p->meta.label, "%s+combine", d->meta.label);
  for (size_t k = 0; k < (size_t)ph->R * ph->iters; k++) p->t[k] = d->t[k] + c->t[k];
  for (int r = 0; r < ph->R; r++) {
    p->bytes[r] = d->bytes[r] + c->bytes[r], p->wire[r] = d->wire[r] + c->wire[r];
    p->cpu[r] = p->csw[r] = p->host[r] = -1;
  }
  ph->n++;
  aggregate(p, ph->R, ph->iters);
}

int bench_build_phases(phases_t *ph, int R, bench_rank_t *const *rk) {
  memset(ph, 0, sizeof *ph);
  ph->R = R, ph->iters = rk[0]->iters;
  for (int i = 0; i < rk[0]->nrows; i++) {
    phase_t *p = add_row(ph, rk, i);
    if (!p) return -1;
    aggregate(p, R, ph->iters);
    if (!strcmp(p->meta.key, "combine"))
      add_sum(ph, "");
    else if (!strcmp(p->meta.key, "baseline_combine"))
      add_sum(ph, "baseline_");
  }
  return 0;
}

void bench_free_phases(phases_t *ph) {
  for (int k = 0; k < ph->n; k++) {
    phase_t *p = &ph->p[k];
    free(p->t), free(p->bytes), free(p->wire), free(p->cpu), free(p->csw), free(p->host);
    free(p->rank_t), free(p->rank_mean);
  }
}

const phase_t *bench_phase(const phases_t *ph, const char *key) {
  for (int k = 0; k < ph->n; k++)
    if (!strcmp(ph->p[k].meta.key, key)) return &ph->p[k];
  return NULL;
}

static double med(const phases_t *ph, const char *key) {
  const phase_t *p = bench_phase(ph, key);
  return p ? p->time.median : 0;
}

static double over(double a, double b) {
  return a > 0 && b > 0 ? a / b : 0;
}

ratios_t bench_ratios(const phases_t *ph) {
  ratios_t q;
  memset(&q, 0, sizeof q);
  const phase_t *m = bench_phase(ph, "memcpy"), *d = bench_phase(ph, "dispatch"),
                *c = bench_phase(ph, "combine");
  if (m && d) q.d_ceiling = over(d->bw.median, m->bw.median);
  if (m && c) q.c_ceiling = over(c->bw.median, m->bw.median);
  q.d_base = over(med(ph, "baseline_dispatch"), med(ph, "dispatch"));
  q.c_base = over(med(ph, "baseline_combine"), med(ph, "combine"));
  q.t_base = over(med(ph, "baseline_dispatch_combine"), med(ph, "dispatch_combine"));
  /* The baseline runs after epcomm; on a shared machine the two may see different speeds. Each
   * time over its own run's ceiling time (the same copy) cancels that drift. */
  const phase_t *mb = bench_phase(ph, "baseline_memcpy");
  if (q.t_base > 0 && m && mb && m->bytes[0] == mb->bytes[0])
    q.t_base_norm = over(med(ph, "baseline_dispatch_combine") / mb->time.median,
                         med(ph, "dispatch_combine") / m->time.median);
  q.graph = over(med(ph, "graph"), med(ph, "dispatch") + med(ph, "combine"));
  q.overlap = over(med(ph, "overlap_comm") + med(ph, "overlap_compute"), med(ph, "overlap"));
  return q;
}

verdict_t bench_verdict(int R, bench_rank_t *const *rk, const bench_base_t *b) {
  verdict_t v = {1, -1, -1, bench_row_find(rk[0], "dispatch") < 0, ""};
  for (int r = 0; r < R; r++)
    if (rk[r]->bad) {
      if (v.ok)
        snprintf(v.msg, sizeof v.msg, "%s: %s", v.alone ? "baseline" : "epcomm", rk[r]->msg);
      v.ok = 0;
    }
  if (!b || !b->ran) return v;
  v.base_ok = b->ok, v.agree = b->agree;
  if ((!b->ok || !b->agree) && !v.msg[0]) snprintf(v.msg, sizeof v.msg, "baseline: %s", b->why);
  return v;
}

int bench_passed(const verdict_t *v) {
  return v->ok && v->base_ok != 0 && v->agree != 0;
}
