/* The ceiling: plain memcpy with the same number of threads per rank as the run, every rank
 * copying at once (a barrier starts each copy), between buffers far larger than the caches. One
 * copy runs in every iteration right before the dispatch and combine it is compared with, so
 * that a noisy machine (other tenants, hypervisor steal) weighs on both alike.
 * Counted as bytes copied (= bytes written), the convention of DeepEP's received-bytes figure:
 * one byte delivered once counts once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* Bytes per rank, whatever the run's size: 128 MiB (4 ranks x 2 buffers = 1 GiB, far past any
 * L3; a smaller copy would partly stay in cache and make the ceiling depend on the run). */
#define CEILING_BYTES ((size_t)128 << 20)

typedef struct {
  unsigned char *dst;
  const unsigned char *src;
  size_t n;
} slice_t;

static void *copy_slice(void *arg) {
  slice_t *s = arg;
  memcpy(s->dst, s->src, s->n);
  return NULL;
}

/* One concurrent copy of n bytes by T threads (this thread takes the first slice). */
static void copy_all(unsigned char *dst, const unsigned char *src, size_t n, int T) {
  if (T < 1) T = 1;
  slice_t sl[256] = {{0}};
  pthread_t th[256];
  int up[256] = {0};
  size_t chunk = (n / (size_t)T + 4095) & ~(size_t)4095;
  for (int i = 0; i < T; i++) {
    size_t b = (size_t)i * chunk < n ? (size_t)i * chunk : n;
    size_t e = b + chunk < n ? b + chunk : n;
    sl[i] = (slice_t){dst + b, src + b, e - b};
  }
  for (int i = 1; i < T; i++)
    if (!(up[i] = !pthread_create(&th[i], NULL, copy_slice, &sl[i]))) copy_slice(&sl[i]);
  copy_slice(&sl[0]);
  for (int i = 1; i < T; i++)
    if (up[i]) pthread_join(th[i], NULL);
}

struct bench_ceiling_s {
  unsigned char *src, *dst;
  size_t n;
  int threads;
};

bench_ceiling_t *bench_ceiling_new(const bench_opts_t *o) {
  bench_ceiling_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->n = CEILING_BYTES;
  c->threads = o->threads;
  c->src = malloc(c->n), c->dst = malloc(c->n);
  if (!c->src || !c->dst) {
    bench_ceiling_free(c);
    return NULL;
  }
  memset(c->src, 1, c->n); /* touched: no page faults in the timed copies */
  memset(c->dst, 2, c->n);
  return c;
}

double bench_ceiling_copy(bench_ceiling_t *c) {
  double t0 = bench_now();
  copy_all(c->dst, c->src, c->n, c->threads);
  return bench_now() - t0;
}

double bench_ceiling_bytes(const bench_ceiling_t *c) { return (double)c->n; }

void bench_ceiling_free(bench_ceiling_t *c) {
  if (!c) return;
  free(c->src), free(c->dst), free(c);
}
