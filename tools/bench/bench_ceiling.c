/* The ceiling: every rank copies one buffer far larger than the caches into another, all ranks
 * at once. On the host: plain memcpy with the run's --threads threads (a barrier starts each
 * copy; on the CPU backend one copy runs in every iteration right before the dispatch and
 * combine it is compared with, so that a noisy machine weighs on both alike). On the GPU: a
 * grid-stride copy kernel over every SM (bench_gpu.cu), timed by events like the calls.
 * Counted as bytes copied (= bytes written), the convention of DeepEP's received-bytes figure:
 * one byte delivered once counts once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_gpu.h"
#include "tk_dev.h"

/* Bytes per rank, whatever the run's size: 128 MiB on the host (4 ranks x 2 buffers = 1 GiB, far
 * past any L3; a smaller copy would partly stay in cache and make the ceiling depend on the run);
 * 256 MiB on the GPU (5x an H200's L2). */
#define CEILING_BYTES ((size_t)128 << 20)
#define CEILING_BYTES_GPU ((size_t)256 << 20)

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

bench_ceiling_t *bench_ceiling_new(bench_ctx_t *c) {
  bench_ceiling_t *m = calloc(1, sizeof *m);
  if (!m) return fprintf(stderr, "epcomm bench: out of memory\n"), NULL;
  m->n = c->dev ? CEILING_BYTES_GPU : CEILING_BYTES;
  m->threads = c->o->threads;
  /* Filled (touched) now: no page faults in the timed copies. */
  m->src = tk_dev_alloc(c->dev, m->n, 1), m->dst = tk_dev_alloc(c->dev, m->n, 2);
  if (m->src && m->dst) return m;
  fprintf(stderr, "epcomm bench: the ceiling's buffers: %s\n", tk_dev_error());
  bench_ceiling_free(c, m);
  return NULL;
}

int bench_ceiling_copy(bench_ctx_t *c, void *state, int it) {
  bench_ceiling_t *m = c->ceiling;
  if (!c->dev) return copy_all(m->dst, m->src, m->n, m->threads), 0;
  if (!bgpu_copy(m->dst, m->src, m->n, c->stream)) return 0;
  return fprintf(stderr, "epcomm bench: the copy ceiling: %s\n", bgpu_error()), 1;
}

double bench_ceiling_bytes(const bench_ceiling_t *m) {
  return (double)m->n;
}

void bench_ceiling_free(bench_ctx_t *c, bench_ceiling_t *m) {
  if (!m) return;
  tk_dev_free(c->dev, m->src), tk_dev_free(c->dev, m->dst), free(m);
}
