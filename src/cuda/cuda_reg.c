/* Registrations of caller memory (ep_register_memory) on the CUDA backend. Each rank finds the
 * allocation that holds its range, exports it with cudaIpcGetMemHandle and tells the others the
 * handle and the range's offset in it; every rank maps the peers' allocations (each at most
 * once per buffer: registrations inside one allocation share its mapping, and one inside a
 * peer's pool uses the pool's) and writes the peers' ranges into the device table the combine
 * kernel reads (epk_buf_t.regs). Every step that can fail on one rank is agreed on, so that all
 * ranks succeed or all fail with nothing left behind. */
#include <cuda.h> /* types of the driver's cuMemGetAddressRange, found at run time */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"

static const char OP_REG[] = "ep_register_memory", OP_DEREG[] = "ep_deregister_memory";

_Static_assert(EPK_MAX_REGS == EP_MAX_MEM_REGS, "the kernels' table has a row per registration");

struct cuda_map {
  cudaIpcMemHandle_t handle;
  int rank, refs; /* refs 0: closed, free for reuse */
  uint8_t *base;
};

struct cuda_reg {
  bool live;
  uint8_t *ptr;
  size_t bytes;
  int *map; /* [R] index in s->maps of the peer's mapping; -1: own memory, or a peer's pool */
};

/* What every rank tells the others. */
typedef struct {
  cudaIpcMemHandle_t handle; /* of the allocation that holds the range */
  uint64_t offset;           /* of the range in the allocation */
  uint64_t bytes;            /* of the range */
  int32_t ok, pad;
} reg_info_t;

typedef CUresult (*range_fn_t)(CUdeviceptr *base, size_t *size, CUdeviceptr p);

/* The driver's cuMemGetAddressRange through the runtime (the driver library is not linked). */
static range_fn_t range_fn(void) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) !=
          cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return (void)cudaGetLastError(), NULL;
  return (range_fn_t)fn;
}

/* The kind of memory at ptr: device memory of the buffer's device, or why not. */
static ep_status_t check_kind(cuda_state_t *s, const void *ptr) {
  struct cudaPointerAttributes at;
  cudaError_t e = cudaPointerGetAttributes(&at, ptr);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: the next launch must not report it */
    return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, OP_REG, "export",
                       "ptr %p: not memory CUDA knows (%s)", ptr, cudaGetErrorString(e));
  }
  if (at.type == cudaMemoryTypeUnregistered)
    return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, OP_REG, "export",
                       "ptr %p is host memory, not device memory", ptr);
  if (at.type != cudaMemoryTypeDevice)
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP_REG, "export",
                       "ptr %p is %s memory, which CUDA IPC cannot export (combine from it keeps "
                       "the staging path)",
                       ptr, at.type == cudaMemoryTypeManaged ? "managed" : "page-locked host");
  if (at.device != s->device)
    return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, OP_REG, "export",
                       "ptr %p is memory of device %d, the buffer's device is %d", ptr, at.device,
                       s->device);
  return EP_OK;
}

/* This rank's part: the allocation that holds [ptr, ptr + bytes), exported. */
static ep_status_t export_range(cuda_state_t *s, void *ptr, size_t bytes, reg_info_t *me) {
  ep_status_t st = check_kind(s, ptr);
  if (st) return st;
  range_fn_t range = range_fn();
  CUdeviceptr base = 0;
  size_t size = 0;
  if (!range || range(&base, &size, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP_REG, "export",
                       "ptr %p: the driver does not say which allocation holds it%s", ptr,
                       range ? "" : " (no cuMemGetAddressRange)");
  const uint64_t off = (uint64_t)((uintptr_t)ptr - (uintptr_t)base);
  if (bytes > size - off)
    return ep_ctx_fail(s->ctx, EP_ERR_OUT_OF_RANGE, -1, OP_REG, "export",
                       "[ptr, ptr + %zu) runs %llu bytes past the end of the allocation that "
                       "holds ptr (%zu bytes at %p)",
                       bytes, (unsigned long long)(bytes - (size - off)), size,
                       (void *)(uintptr_t)base);
  cudaError_t e = cudaIpcGetMemHandle(&me->handle, (void *)(uintptr_t)base);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP_REG, "export",
                       "the allocation that holds ptr %p cannot be exported with CUDA IPC (%s): "
                       "memory of cudaMallocAsync pools or of the virtual memory API (PyTorch's "
                       "expandable segments) cannot be registered; combine from it keeps the "
                       "staging path",
                       ptr, cudaGetErrorName(e));
  }
  me->offset = off;
  me->bytes = bytes;
  return EP_OK;
}

/* Every rank learns whether every rank's step succeeded; the first rank that failed is named. */
static ep_status_t agree(cuda_state_t *s, ep_status_t mine, const char *phase) {
  int32_t ok = mine == EP_OK, *all = calloc((size_t)s->nranks, sizeof *all);
  if (!all) return mine ? mine : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP_REG, phase, "oom");
  ep_status_t st = ep_ctx_allgather(s->ctx, &ok, all, sizeof ok);
  for (int r = 0; r < s->nranks && !st && !mine; r++)
    if (!all[r])
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, OP_REG, phase,
                       "rank %d could not register its memory (see its error)", r);
  free(all);
  return mine ? mine : st;
}

static void unref(cuda_state_t *s, int m) {
  if (m < 0 || --s->maps[m].refs > 0) return;
  cudaIpcCloseMemHandle(s->maps[m].base);
  s->maps[m].base = NULL;
}

/* A mapping of rank r's allocation `h`: shared with an earlier registration, or opened now. */
static ep_status_t map_peer(cuda_state_t *s, int r, const cudaIpcMemHandle_t *h, int *out) {
  int spare = -1;
  for (int m = 0; m < s->nmaps; m++) {
    if (s->maps[m].refs > 0 && s->maps[m].rank == r && !memcmp(&s->maps[m].handle, h, sizeof *h)) {
      s->maps[m].refs++;
      return *out = m, EP_OK;
    }
    if (s->maps[m].refs == 0 && spare < 0) spare = m;
  }
  if (spare < 0 && s->nmaps == s->capmaps) {
    int cap = s->capmaps ? 2 * s->capmaps : 16;
    cuda_map_t *n = realloc(s->maps, (size_t)cap * sizeof *n);
    if (!n) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, r, OP_REG, "map", "out of memory");
    s->maps = n, s->capmaps = cap;
  }
  void *p = NULL;
  cudaError_t e = cudaIpcOpenMemHandle(&p, *h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ep_ctx_fail(s->ctx, EP_ERR_CUDA, r, OP_REG, "map",
                       "cannot map rank %d's registered memory: %s (%s)", r, cudaGetErrorString(e),
                       cudaGetErrorName(e));
  }
  int m = spare >= 0 ? spare : s->nmaps++;
  s->maps[m] = (cuda_map_t){*h, r, 1, p};
  return *out = m, EP_OK;
}

/* Bytes mapped here from `base` on (the allocation that holds it), or 0. */
static uint64_t mapped_bytes(const uint8_t *base) {
  range_fn_t range = range_fn();
  CUdeviceptr lo = 0;
  size_t size = 0;
  if (!range || range(&lo, &size, (CUdeviceptr)(uintptr_t)base) != CUDA_SUCCESS) return 0;
  const uintptr_t b = (uintptr_t)base, l = (uintptr_t)lo;
  return b >= l && b - l <= size ? (uint64_t)(size - (b - l)) : 0;
}

/* Every peer's range as mapped here, into row[R] (sizes[R]); reg->map records what to close.
 * A peer's offset and size are checked against what is mapped here, whatever the peer says. */
static ep_status_t map_all(cuda_state_t *s, cuda_reg_t *reg, const reg_info_t *all, uint8_t **row,
                           uint64_t *sizes) {
  ep_status_t st = EP_OK;
  for (int r = 0; r < s->nranks && !st; r++) {
    uint8_t *base;
    uint64_t have;
    if (r == s->rank) {
      row[r] = reg->ptr, sizes[r] = reg->bytes;
      continue;
    } else if (!memcmp(&all[r].handle, &s->pool_handles[r], sizeof all[r].handle)) {
      base = s->peer_ptrs[r], have = s->kb.pool_bytes; /* inside the peer's pool: mapped already */
    } else if (!(st = map_peer(s, r, &all[r].handle, &reg->map[r]))) {
      base = s->maps[reg->map[r]].base, have = mapped_bytes(base);
    } else {
      break;
    }
    if (all[r].bytes == 0 || all[r].offset > have || all[r].bytes > have - all[r].offset)
      st = ep_ctx_fail(s->ctx, EP_ERR_CUDA, r, OP_REG, "map",
                       "rank %d's range (%llu bytes at offset %llu) does not lie in its "
                       "allocation as mapped here (%llu bytes)",
                       r, (unsigned long long)all[r].bytes, (unsigned long long)all[r].offset,
                       (unsigned long long)have);
    else
      row[r] = base + all[r].offset, sizes[r] = all[r].bytes;
  }
  return st;
}

/* Row `slot` of the kernels' tables (NULL: cleared), complete on the device when this returns:
 * the next combine on any stream may read it. */
static ep_status_t table_write(cuda_state_t *s, int slot, uint8_t *const *row,
                               const uint64_t *sizes, const char *op) {
  const size_t n = (size_t)s->nranks, at = (size_t)slot * n;
  void *zero = NULL;
  if (!row && !(zero = calloc(n, sizeof(uint64_t)))) return EP_OK; /* clearing: best effort */
  cudaError_t e = cudaMemcpyAsync(s->reg_bytes + at, row ? (const void *)sizes : zero,
                                  n * sizeof(uint64_t), cudaMemcpyHostToDevice, s->side);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(s->reg_table + at, row ? (const void *)row : zero, n * sizeof(void *),
                        cudaMemcpyHostToDevice, s->side);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s->side);
  free(zero);
  if (!row) { /* clearing: silent, the call's own status stands */
    if (e != cudaSuccess) (void)cudaGetLastError();
    return EP_OK;
  }
  return cuda_check(s, e, op, "map");
}

static void reg_undo(cuda_state_t *s, cuda_reg_t *reg) {
  for (int r = 0; reg->map && r < s->nranks; r++) unref(s, reg->map[r]);
  free(reg->map);
  memset(reg, 0, sizeof *reg);
}

static ep_status_t reg_alloc(cuda_state_t *s, int slot, cuda_reg_t **out) {
  if (!s->regs && !(s->regs = calloc(EP_MAX_MEM_REGS, sizeof *s->regs)))
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP_REG, "init", "out of memory");
  cuda_reg_t *reg = &s->regs[slot];
  if (reg->live)
    return ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, -1, OP_REG, "init", "slot %d is taken", slot);
  if (!(reg->map = malloc((size_t)s->nranks * sizeof *reg->map)))
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP_REG, "init", "out of memory");
  for (int r = 0; r < s->nranks; r++) reg->map[r] = -1;
  *out = reg;
  return EP_OK;
}

/* Maps and publishes: this rank's part of a registration whose handles every rank has. */
static ep_status_t reg_install(cuda_state_t *s, int slot, cuda_reg_t *reg, const reg_info_t *all) {
  uint8_t **row = calloc((size_t)s->nranks, sizeof *row);
  uint64_t *sizes = calloc((size_t)s->nranks, sizeof *sizes);
  ep_status_t st = row && sizes
                       ? EP_OK
                       : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP_REG, "map", "out of memory");
  if (!st) st = map_all(s, reg, all, row, sizes);
  if (!st) st = table_write(s, slot, row, sizes, OP_REG);
  free(row), free(sizes);
  return st;
}

ep_status_t cuda_mem_register(void *state, int slot, void *ptr, size_t bytes) {
  cuda_state_t *s = state;
  if (s->net) /* every rank of the group alike: it spans hosts */
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP_REG, "arguments",
                       "registered memory is not used across hosts on the cuda backend yet (the "
                       "rows cross the network through NCCL's own buffers)");
  int prev;
  if (cuda_set_device(s->device, &prev)) (void)cudaGetLastError();
  reg_info_t me, *all = calloc((size_t)s->nranks, sizeof *all);
  if (!all) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP_REG, "init", "out of memory");
  memset(&me, 0, sizeof me);
  cuda_reg_t *reg = NULL;
  ep_status_t mine = reg_alloc(s, slot, &reg);
  if (!mine) mine = export_range(s, ptr, bytes, &me);
  me.ok = mine == EP_OK;
  ep_status_t st = ep_ctx_allgather(s->ctx, &me, all, sizeof me);
  for (int r = 0; r < s->nranks && !st && !mine; r++)
    if (!all[r].ok)
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, OP_REG, "export",
                       "rank %d could not register its memory (see its error)", r);
  if (!st && !mine) {
    reg->ptr = ptr, reg->bytes = bytes;
    mine = agree(s, reg_install(s, slot, reg, all), "map");
  }
  if (!mine && !st) {
    reg->live = true;
  } else if (reg) {
    if (reg->ptr) (void)table_write(s, slot, NULL, NULL, OP_REG); /* a peer failed after ours */
    reg_undo(s, reg);
  }
  free(all);
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
  return mine ? mine : st;
}

ep_status_t cuda_mem_deregister(void *state, int slot) {
  cuda_state_t *s = state;
  int prev;
  if (cuda_set_device(s->device, &prev)) (void)cudaGetLastError();
  cuda_reg_t *reg = s->regs ? &s->regs[slot] : NULL;
  ep_status_t st = EP_OK;
  /* Our combines may still read the peers' ranges (and peers ours, until ours finish). */
  if (!cuda_quiesce(s, ep_ctx_timeout(s->ctx)))
    st = ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, -1, OP_DEREG, "quiesce",
                     "kernels of this buffer did not finish; they were told to stop (the "
                     "mappings stay until the buffer's destroy)");
  if (!st && reg && reg->live) {
    (void)table_write(s, slot, NULL, NULL, OP_DEREG); /* the table forgets the ranges */
    reg_undo(s, reg);
  }
  /* Nobody returns (and frees its memory) while a peer may still have it mapped. */
  if (!st) st = ep_ctx_barrier(s->ctx);
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
  return st;
}

void cuda_reg_teardown(cuda_state_t *s) {
  for (int i = EP_MAX_MEM_REGS - 1; s->regs && i >= 0; i--)
    if (s->regs[i].live) reg_undo(s, &s->regs[i]);
  for (int m = s->nmaps - 1; m >= 0; m--) /* none left open; a failed deregister's stay here */
    if (s->maps[m].refs > 0) cudaIpcCloseMemHandle(s->maps[m].base);
  free(s->regs);
  free(s->maps);
  s->regs = NULL, s->maps = NULL, s->nmaps = s->capmaps = 0;
}

bool cuda_reg_any(const cuda_state_t *s) {
  for (int i = 0; s->regs && i < EP_MAX_MEM_REGS; i++)
    if (s->regs[i].live) return true;
  return false;
}

int cuda_reg_find(const cuda_state_t *s, const void *p, uint64_t bytes, int64_t *off) {
  const uint8_t *x = p;
  for (int i = 0; s->regs && x && i < EP_MAX_MEM_REGS; i++) {
    const cuda_reg_t *r = &s->regs[i];
    if (!r->live || x < r->ptr || x >= r->ptr + r->bytes) continue;
    if ((uint64_t)(r->ptr + r->bytes - x) < bytes) continue;
    *off = (int64_t)(x - r->ptr);
    return i;
  }
  return -1;
}
