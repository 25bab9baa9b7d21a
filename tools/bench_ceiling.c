/* The ceiling: plain memcpy with the same number of threads per rank as the run, every rank
 * copying at once (a barrier starts each iteration), between buffers far larger than the caches.
 * Counted as bytes copied (= bytes written), the convention of DeepEP's received-bytes figure:
 * one byte delivered once counts once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* Bytes per rank: 128 MiB (4 ranks x 2 buffers = 1 GiB, far past any L3), or 16 MiB for runs
 * that move less than that (smoke tests: still past L2 and, with 2+ ranks, past a 32 MiB L3). */
#define CEILING_BYTES ((size_t)128 << 20)
#define CEILING_SMALL ((size_t)16 << 20)

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

int bench_ceiling(const bench_opts_t *o, ep_group_t g, bench_rank_t *f) {
  size_t n = f->d_bytes < (double)CEILING_SMALL ? CEILING_SMALL : CEILING_BYTES;
  int T = o->threads;
  unsigned char *src = malloc(n), *dst = malloc(n);
  if (!src || !dst) {
    fprintf(stderr, "epcomm bench: out of memory for the memcpy ceiling\n");
    free(src), free(dst);
    return 1;
  }
  memset(src, 1, n);
  memset(dst, 2, n);
  double *t = bench_rank_times(f) + 2 * (size_t)o->iters;
  for (int it = -o->warmup; it < o->iters; it++) {
    if (ep_group_barrier(g)) {
      fprintf(stderr, "epcomm bench: barrier: %s\n", ep_last_error());
      free(src), free(dst);
      return 1;
    }
    double t0 = bench_now();
    copy_all(dst, src, n, T);
    double t1 = bench_now();
    if (it >= 0) t[it] = t1 - t0;
  }
  f->m_bytes = (double)n;
  free(src), free(dst);
  return 0;
}
