/* Shared segments: one memfd per rank, mapped by every rank of the group. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu.h"
#include "cpu_ll.h"

static size_t align_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

size_t cpu_seg_size(int nranks, int ll_ranks, int channels, size_t queue_bytes,
                    const ep_buffer_config_t *cfg, cpu_seg_hdr_t *l) {
  memset(l, 0, sizeof *l);
  size_t off = align_up(sizeof(cpu_seg_hdr_t), CPU_CL);
  l->off_bells = off;
  off += (size_t)channels * sizeof(cpu_bell_t);
  l->off_abort = off;
  off += CPU_CL;
  l->off_hello = off;
  l->hello_bytes =
      align_up(sizeof(cpu_hello_t) +
                   sizeof(int32_t) * ((size_t)nranks + (size_t)channels + EP_MAX_LOCAL_EXPERTS),
               CPU_CL);
  off += 2 * (size_t)nranks * l->hello_bytes;
  l->off_rings = off = align_up(off, 4096);
  l->ring_bytes = align_up(sizeof(cpu_ring_t) + queue_bytes, 4096);
  off += (size_t)nranks * (size_t)channels * l->ring_bytes;
  l->off_ll = off = align_up(off, 4096);
  off += cpu_ll_region_bytes(cfg, ll_ranks);
  l->magic = CPU_SEG_MAGIC;
  l->nranks = nranks;
  l->channels = channels;
  l->queue_bytes = queue_bytes;
  l->total_bytes = align_up(off, 4096);
  return l->total_bytes;
}

static ep_status_t seg_create(cpu_state_t *s, int *fd_out) {
  size_t total = s->layout.total_bytes;
  int fd = memfd_create("epcomm-seg", MFD_CLOEXEC);
  if (fd < 0)
    return ep_ctx_fail(s->ctx, EP_ERR_SYSTEM, -1, "ep_buffer_create", "init", "memfd_create: %s",
                       strerror(errno));
  /* Pages are allocated on first touch: the low-latency region is large and mostly unused. */
  if (ftruncate(fd, (off_t)total) != 0) {
    int e = errno;
    close(fd);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init",
                       "cannot size %zu bytes of shared memory: %s", total, strerror(e));
  }
  *fd_out = fd;
  return EP_OK;
}

static ep_status_t seg_map(cpu_state_t *s, int r, int fd) {
  void *p = mmap(NULL, s->layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return ep_ctx_fail(s->ctx, EP_ERR_SYSTEM, r, "ep_buffer_create", "init",
                       "mmap of %zu bytes: %s", (size_t)s->layout.total_bytes, strerror(errno));
  s->segs[r].base = p;
  s->segs[r].hdr = p;
  return EP_OK;
}

static ep_status_t seg_check(cpu_state_t *s, int r) {
  const cpu_seg_hdr_t *h = s->segs[r].hdr;
  if (h->magic != CPU_SEG_MAGIC || h->rank != r || h->total_bytes != s->layout.total_bytes)
    return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r, "ep_buffer_create", "init",
                       "segment of rank %d does not match this rank's layout", r);
  return EP_OK;
}

/* Every rank of the group (every host) says whether it has its segment. */
static ep_status_t agree_ok(cpu_state_t *s, ep_status_t mine) {
  int32_t *all = calloc((size_t)s->gnranks, sizeof *all), me = (int32_t)mine;
  if (!all) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  ep_status_t st = ep_ctx_allgather(s->ctx, &me, all, sizeof me);
  if (st && !mine)
    st = ep_ctx_fail(s->ctx, st, -1, "ep_buffer_create", "init", "exchanging segments: %s",
                     ep_last_error());
  for (int r = 0; r < s->gnranks && !st && !mine; r++)
    if (r != s->grank && all[r] != EP_OK)
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, "ep_buffer_create", "init",
                       "rank %d could not create its segment (%s)", r,
                       ep_status_name((ep_status_t)all[r]));
  free(all);
  return mine ? mine : st;
}

ep_status_t cpu_seg_setup(cpu_state_t *s, const ep_buffer_config_t *cfg) {
  cpu_seg_size(s->nranks, s->gnranks, s->channels, s->queue_bytes, cfg, &s->layout);
  s->segs = calloc((size_t)s->nranks, sizeof *s->segs);
  int *fds = malloc((size_t)s->nranks * sizeof(int));
  if (!s->segs || !fds) {
    free(fds);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "out of memory");
  }
  int fd = -1;
  ep_status_t st = seg_create(s, &fd);
  if (!st) st = seg_map(s, s->rank, fd);
  if (!st) {
    cpu_seg_hdr_t *h = s->segs[s->rank].hdr;
    *h = s->layout;
    h->rank = s->rank;
  }
  /* Every rank says whether it got its segment before fds move, so that a local failure makes
   * the peers fail at once instead of waiting for the deadline. */
  ep_status_t x = agree_ok(s, st);
  if (!x)
    x = ep_ctx_allgather_fd(s->ctx, fd, fds);
  else
    for (int r = 0; r < s->nranks; r++) fds[r] = -1;
  if (fd >= 0) close(fd); /* the mapping keeps the memory; peers hold their own duplicates */
  if (!st) st = x;
  for (int r = 0; r < s->nranks; r++) {
    if (!st && r != s->rank) st = seg_map(s, r, fds[r]);
    if (!st) st = seg_check(s, r);
    if (fds[r] >= 0) close(fds[r]);
  }
  free(fds);
  return st;
}

void cpu_seg_teardown(cpu_state_t *s) {
  if (!s->segs) return;
  for (int r = 0; r < s->nranks; r++)
    if (s->segs[r].base) munmap(s->segs[r].base, s->layout.total_bytes);
  free(s->segs);
  s->segs = NULL;
}
