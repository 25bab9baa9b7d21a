/* One rank's results (bench_result.h): rows, their times, the packed form and the statistics. */
#include "bench_result.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

bench_rank_t *bench_rank_new(int iters) {
  bench_rank_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->iters = iters;
  r->alloc_reg = r->caller_pull = r->alloc_pull = r->combine_copy = (bench_path_t){-1, -1};
  r->t = calloc((size_t)BENCH_MAX_ROWS * (size_t)iters, sizeof *r->t);
  if (!r->t) return free(r), NULL;
  return r;
}

void bench_rank_free(bench_rank_t *r) {
  if (!r) return;
  free(r->t);
  free(r);
}

int bench_row_add(bench_rank_t *r, const char *key, const char *label, int kind, int group,
                  double bytes, double wire) {
  if (r->nrows >= BENCH_MAX_ROWS) return -1;
  bench_row_t *w = &r->row[r->nrows];
  memset(w, 0, sizeof *w);
  snprintf(w->key, sizeof w->key, "%s", key);
  snprintf(w->label, sizeof w->label, "%s", label);
  w->kind = kind, w->group = group, w->bytes = bytes, w->wire = wire;
  w->cpu = w->csw = w->host = -1;
  return r->nrows++;
}

int bench_row_find(const bench_rank_t *r, const char *key) {
  for (int i = 0; i < r->nrows; i++)
    if (!strcmp(r->row[i].key, key)) return i;
  return -1;
}

void bench_rank_fail(bench_rank_t *r, long bad, const char *msg) {
  if (bad <= 0) return;
  if (!r->bad) snprintf(r->msg, sizeof r->msg, "%s", msg);
  r->bad += bad;
}

/* Packed: the struct up to its time pointer, then nrows x iters doubles. */
#define HEAD offsetof(bench_rank_t, t)

size_t bench_rank_packed_size(const bench_rank_t *r) {
  return HEAD + (size_t)r->nrows * (size_t)r->iters * sizeof(double);
}

void bench_rank_pack(const bench_rank_t *r, void *out) {
  memcpy(out, r, HEAD);
  memcpy((char *)out + HEAD, r->t, bench_rank_packed_size(r) - HEAD);
}

bench_rank_t *bench_rank_unpack(const void *in, size_t n) {
  bench_rank_t head;
  if (n < HEAD) return NULL;
  memcpy(&head, in, HEAD);
  if (head.nrows < 0 || head.nrows > BENCH_MAX_ROWS || head.iters < 1) return NULL;
  head.t = NULL;
  if (bench_rank_packed_size(&head) != n) return NULL;
  bench_rank_t *r = bench_rank_new(head.iters);
  if (!r) return NULL;
  double *t = r->t;
  memcpy(r, &head, HEAD);
  r->t = t;
  memcpy(r->t, (const char *)in + HEAD, n - HEAD);
  return r;
}

/* ------------------------------------------------------------------ statistics */

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double quantile(const double *s, int n, double q) {
  double pos = q * (n - 1);
  int i = (int)floor(pos);
  if (i >= n - 1) return s[n - 1];
  return s[i] + (pos - i) * (s[i + 1] - s[i]);
}

bench_stat_t bench_stats(const double *v, int n) {
  bench_stat_t st = {0, 0, 0, 0};
  double *s = n > 0 ? malloc((size_t)n * sizeof *s) : NULL;
  if (!s) return st;
  memcpy(s, v, (size_t)n * sizeof *s);
  qsort(s, (size_t)n, sizeof *s, cmp_d);
  st.median = quantile(s, n, 0.5);
  st.p10 = quantile(s, n, 0.1);
  st.p90 = quantile(s, n, 0.9);
  for (int i = 0; i < n; i++) st.mean += s[i] / n;
  free(s);
  return st;
}

int bench_usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}
