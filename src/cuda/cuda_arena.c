/* Device memory for handles: one cudaMalloc at buffer create, carved up on the host. A dispatch
 * thus never calls cudaMalloc (which would synchronise, and is not allowed in a graph capture).
 * Memory freed here may be handed out again at once: every kernel of a buffer runs after the
 * previous call's kernels (stream order, or the buffer's event), so a later user of the same
 * bytes always runs after an earlier one. The arena lives until the buffer and every handle it
 * served are gone (reference count). Callers give back the size they asked for. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"

#define ARENA_ALIGN 256

typedef struct {
  size_t off, len;
} blk_t;

struct cuda_arena {
  pthread_mutex_t lock;
  uint8_t *base;
  size_t size;
  int refs, device;
  blk_t *free; /* free blocks, sorted by offset, never adjacent */
  int nfree, cap;
};

ep_status_t cuda_arena_new(size_t bytes, cuda_arena_t **out) {
  cuda_arena_t *a = calloc(1, sizeof *a);
  if (!a) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  a->cap = 64;
  a->free = malloc((size_t)a->cap * sizeof *a->free);
  cudaError_t e = a->free ? cudaMalloc((void **)&a->base, bytes) : cudaErrorMemoryAllocation;
  if (e != cudaSuccess) {
    free(a->free);
    free(a);
    return ep_err(EP_ERR_CUDA, "handle arena of %zu bytes: %s", bytes, cudaGetErrorString(e));
  }
  cudaGetDevice(&a->device);
  pthread_mutex_init(&a->lock, NULL);
  a->size = bytes;
  a->refs = 1;
  a->free[0] = (blk_t){0, bytes};
  a->nfree = 1;
  *out = a;
  return EP_OK;
}

static size_t rounded(size_t bytes) {
  return epk_al(bytes ? bytes : 1, ARENA_ALIGN);
}

void *cuda_arena_alloc(cuda_arena_t *a, size_t bytes) {
  size_t need = rounded(bytes);
  void *p = NULL;
  pthread_mutex_lock(&a->lock);
  for (int i = 0; i < a->nfree && !p; i++) {
    if (a->free[i].len < need) continue;
    p = a->base + a->free[i].off;
    a->free[i].off += need;
    a->free[i].len -= need;
    if (!a->free[i].len) {
      a->nfree--;
      memmove(&a->free[i], &a->free[i + 1], (size_t)(a->nfree - i) * sizeof(blk_t));
    }
  }
  pthread_mutex_unlock(&a->lock);
  return p;
}

/* Inserts [off, off+len) into the sorted free list, merging with its neighbours. */
static void insert_free(cuda_arena_t *a, size_t off, size_t len) {
  int i = 0;
  while (i < a->nfree && a->free[i].off < off) i++;
  bool left = i > 0 && a->free[i - 1].off + a->free[i - 1].len == off;
  bool right = i < a->nfree && off + len == a->free[i].off;
  if (left && right) {
    a->free[i - 1].len += len + a->free[i].len;
    a->nfree--;
    memmove(&a->free[i], &a->free[i + 1], (size_t)(a->nfree - i) * sizeof(blk_t));
  } else if (left) {
    a->free[i - 1].len += len;
  } else if (right) {
    a->free[i].off = off;
    a->free[i].len += len;
  } else {
    if (a->nfree == a->cap) {
      blk_t *n = realloc(a->free, (size_t)a->cap * 2 * sizeof *n);
      if (!n) return; /* the bytes stay lost until the arena goes; never corrupt the list */
      a->free = n;
      a->cap *= 2;
    }
    memmove(&a->free[i + 1], &a->free[i], (size_t)(a->nfree - i) * sizeof(blk_t));
    a->free[i] = (blk_t){off, len};
    a->nfree++;
  }
}

void cuda_arena_free(cuda_arena_t *a, void *p, size_t bytes) {
  if (!p) return;
  pthread_mutex_lock(&a->lock);
  insert_free(a, (size_t)((uint8_t *)p - a->base), rounded(bytes));
  pthread_mutex_unlock(&a->lock);
}

void cuda_arena_ref(cuda_arena_t *a) {
  pthread_mutex_lock(&a->lock);
  a->refs++;
  pthread_mutex_unlock(&a->lock);
}

void cuda_arena_unref(cuda_arena_t *a) {
  pthread_mutex_lock(&a->lock);
  int left = --a->refs;
  pthread_mutex_unlock(&a->lock);
  if (left) return;
  int prev = -1;
  cuda_set_device(a->device, &prev);
  cudaFree(a->base);
  if (prev >= 0 && prev != a->device) cudaSetDevice(prev);
  pthread_mutex_destroy(&a->lock);
  free(a->free);
  free(a);
}

/* ------------------------------------------------------------------ handle plans */

cuda_plan_t *cuda_plan_new(cuda_state_t *s, int N) {
  cuda_plan_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->arena = s->arena;
  p->N = N;
  p->R = s->nranks;
  p->nr = -1;
  p->plan_bytes = epk_plan_bytes(s->nranks, N);
  p->plan = cuda_arena_alloc(s->arena, p->plan_bytes);
  if (!p->plan) {
    free(p);
    return NULL;
  }
  cuda_arena_ref(s->arena);
  return p;
}

bool cuda_plan_src(cuda_plan_t *p, int64_t rows) {
  p->src_cap = rows;
  p->src = cuda_arena_alloc(p->arena, (size_t)rows * 4);
  if (!p->src) p->src_cap = 0;
  return p->src != NULL;
}

void cuda_plan_free(void *plan) {
  cuda_plan_t *p = plan;
  if (!p) return;
  cuda_arena_free(p->arena, p->plan, p->plan_bytes);
  cuda_arena_free(p->arena, p->src, (size_t)p->src_cap * 4);
  cuda_arena_unref(p->arena);
  free(p);
}
