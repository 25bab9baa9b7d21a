/* The arenas behind Buffer.mem_pool and the out pool (epcomm/_mempool.py), in C so that PyTorch's
 * caching allocator never calls Python.
 *
 * PyTorch calls a pool's allocator while it holds its own allocator lock. A Python callback there
 * needs the GIL, which another thread may hold while it frees a CUDA tensor and so waits for that
 * same lock: a deadlock. These functions take no GIL, only the arena's own mutex.
 *
 * PyTorch's allocator functions carry no context pointer, so each arena is reached through one of
 * EPB_ARENA_SLOTS fixed function pairs, and the slots are the one table of this module: PyTorch
 * keeps a pool's function pointers for the life of the process. A slot serves a new arena only
 * once its last one is closed, every segment is back and its pool is gone (PyTorch can no longer
 * allocate through it); a generation number tells a stale Python handle from the new arena.
 * (A CUDA graph captured into a pool can outlive the pool object and allocate through its slot
 * later: it then gets memory of the slot's new arena, counted there; memory-safe, but that
 * memory belongs to another Buffer's registration.)
 *
 * An arena is [base, base + size) of memory its Python owner keeps (a uint8 tensor), cut first-fit
 * into the segments PyTorch asks for. Its first EPB_ARENA_ALIGN bytes are never handed out:
 * PyTorch files its blocks by address, and a segment starting where the arena's own tensor
 * starts would share its key. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "binding.h"

#define EPB_ARENA_SLOTS 64
#define EPB_ARENA_ALIGN 512 /* PyTorch's blocks are 512-byte aligned inside a segment */

/* X(b, k) for every slot b * 8 + k of the table. */
/* (clang-format does not settle on one layout of these lines) */
/* clang-format off */
#define EPB_SLOTS_8(X, b) X(b, 0) X(b, 1) X(b, 2) X(b, 3) X(b, 4) X(b, 5) X(b, 6) X(b, 7)
#define EPB_SLOTS(X) \
  EPB_SLOTS_8(X, 0) EPB_SLOTS_8(X, 1) EPB_SLOTS_8(X, 2) EPB_SLOTS_8(X, 3) \
  EPB_SLOTS_8(X, 4) EPB_SLOTS_8(X, 5) EPB_SLOTS_8(X, 6) EPB_SLOTS_8(X, 7)
/* clang-format on */

typedef struct {
  uint64_t off, len;
} span_t;

typedef struct {
  span_t *v;
  size_t n, cap;
} spans_t;

typedef struct {
  pthread_mutex_t mu;
  uint64_t gen;   /* the slot's arenas so far: each arena has its own number */
  uintptr_t base; /* 0: the slot holds no arena */
  uint64_t size;
  spans_t free;   /* sorted by offset, coalesced */
  spans_t used;   /* the segments PyTorch holds, in no order */
  bool closed;    /* the buffer is gone: no new segment */
  bool pool_gone; /* the torch.cuda.MemPool is gone: PyTorch allocates no more through it */
} arena_t;

#define EPB_SLOT_INIT(b, k) {.mu = PTHREAD_MUTEX_INITIALIZER},
static arena_t slots[EPB_ARENA_SLOTS] = {EPB_SLOTS(EPB_SLOT_INIT)};

/* Room for n spans. The free list keeps room for one more span than there are segments out (two
 * free spans, being coalesced, have a segment between them: at most segments + 1 of them), so
 * that giving a segment back (inside PyTorch's allocator, maybe on its way to freeing memory)
 * never needs to allocate. */
static bool spans_reserve(spans_t *s, size_t n) {
  if (n <= s->cap) return true;
  size_t cap = s->cap ? s->cap : 16;
  while (cap < n) cap *= 2;
  span_t *v = realloc(s->v, cap * sizeof *v);
  if (!v) return false;
  s->v = v, s->cap = cap;
  return true;
}

static void spans_insert(spans_t *s, size_t at, span_t x) { /* room reserved by the caller */
  memmove(s->v + at + 1, s->v + at, (s->n - at) * sizeof *s->v);
  s->v[at] = x;
  s->n++;
}

static void spans_remove(spans_t *s, size_t at) {
  memmove(s->v + at, s->v + at + 1, (s->n - at - 1) * sizeof *s->v);
  s->n--;
}

/* ------------------------------------------------------------------ what PyTorch calls */

static void *arena_alloc(arena_t *a, size_t size) {
  void *p = NULL;
  pthread_mutex_lock(&a->mu);
  /* (size checked first: rounding a size near SIZE_MAX up would wrap to 0) */
  const uint64_t want = size > a->size ? 0
                        : size ? (size + EPB_ARENA_ALIGN - 1) / EPB_ARENA_ALIGN * EPB_ARENA_ALIGN
                               : EPB_ARENA_ALIGN;
  const bool room = want && !a->closed && a->base && spans_reserve(&a->used, a->used.n + 1) &&
                    spans_reserve(&a->free, a->used.n + 2);
  for (size_t i = 0; room && i < a->free.n; i++) {
    span_t *f = &a->free.v[i];
    if (f->len < want) continue;
    spans_insert(&a->used, a->used.n, (span_t){f->off, want});
    p = (void *)(a->base + f->off);
    f->off += want, f->len -= want;
    if (!f->len) spans_remove(&a->free, i);
    break;
  }
  pthread_mutex_unlock(&a->mu);
  return p; /* NULL: PyTorch turns it into its out-of-memory error */
}

/* Gives a segment back and merges it with its free neighbours. A pointer that starts no segment
 * of this arena is ignored (PyTorch never passes one). */
static void arena_release(arena_t *a, void *ptr) {
  pthread_mutex_lock(&a->mu);
  const uint64_t off = (uint64_t)((uintptr_t)ptr - a->base);
  size_t u = 0;
  while (u < a->used.n && a->used.v[u].off != off) u++;
  if (a->base && u < a->used.n) {
    span_t x = a->used.v[u];
    spans_remove(&a->used, u);
    size_t at = 0;
    while (at < a->free.n && a->free.v[at].off < x.off) at++;
    if (at > 0 && a->free.v[at - 1].off + a->free.v[at - 1].len == x.off) {
      x.off = a->free.v[at - 1].off, x.len += a->free.v[at - 1].len;
      spans_remove(&a->free, --at);
    }
    if (at < a->free.n && x.off + x.len == a->free.v[at].off) {
      x.len += a->free.v[at].len;
      spans_remove(&a->free, at);
    }
    spans_insert(&a->free, at, x);
  }
  pthread_mutex_unlock(&a->mu);
}

/* Slot b * 8 + k: alloc_bk and free_bk. */
#define EPB_SLOT_FNS(b, k)                                                    \
  static void *alloc_##b##k(size_t size, int device, void *stream) {          \
    (void)device, (void)stream;                                               \
    return arena_alloc(&slots[b * 8 + k], size);                              \
  }                                                                           \
  static void free_##b##k(void *ptr, size_t size, int device, void *stream) { \
    (void)size, (void)device, (void)stream;                                   \
    arena_release(&slots[b * 8 + k], ptr);                                    \
  }
EPB_SLOTS(EPB_SLOT_FNS)

#define EPB_SLOT_ENTRY(b, k) {alloc_##b##k, free_##b##k},
static const struct {
  void *(*alloc)(size_t, int, void *);
  void (*release)(void *, size_t, int, void *);
} slot_fns[EPB_ARENA_SLOTS] = {EPB_SLOTS(EPB_SLOT_ENTRY)};

/* ------------------------------------------------------------------ what Python calls */

static bool slot_reusable(const arena_t *a) {
  return !a->base || (a->closed && a->pool_gone && !a->used.n);
}

static void slot_reset(arena_t *a) {
  free(a->free.v), free(a->used.v);
  memset(&a->free, 0, sizeof a->free), memset(&a->used, 0, sizeof a->used);
  a->base = 0, a->size = 0, a->closed = a->pool_gone = false;
}

/* The slot for (slot, gen), locked, or NULL (unlocked) when the arena is not that slot's now. */
static arena_t *slot_lock(PyObject *args, const char *fmt_extra, void *extra) {
  int i;
  unsigned long long gen;
  if (!(fmt_extra ? PyArg_ParseTuple(args, "iKp", &i, &gen, extra)
                  : PyArg_ParseTuple(args, "iK", &i, &gen)))
    return NULL;
  if (i < 0 || i >= EPB_ARENA_SLOTS) {
    PyErr_Format(PyExc_ValueError, "arena slot %d out of range", i);
    return NULL;
  }
  arena_t *a = &slots[i];
  pthread_mutex_lock(&a->mu);
  if (a->gen == gen && a->base) return a;
  pthread_mutex_unlock(&a->mu);
  return NULL;
}

/* arena_open(base, size) -> (slot, gen, alloc fn address, free fn address). */
static PyObject *arena_open(PyObject *self, PyObject *args) {
  unsigned long long base, size;
  if (!PyArg_ParseTuple(args, "KK", &base, &size)) return NULL;
  if (!base || size <= EPB_ARENA_ALIGN || base % EPB_ARENA_ALIGN) {
    char msg[160]; /* (PyErr_Format has no %llx before Python 3.12) */
    snprintf(msg, sizeof msg,
             "arena_open: base %#llx, size %llu: needs a %d-byte aligned base and more than %d "
             "bytes",
             base, size, EPB_ARENA_ALIGN, EPB_ARENA_ALIGN);
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
  }
  for (int i = 0; i < EPB_ARENA_SLOTS; i++) {
    arena_t *a = &slots[i];
    pthread_mutex_lock(&a->mu);
    if (!slot_reusable(a)) {
      pthread_mutex_unlock(&a->mu);
      continue;
    }
    slot_reset(a);
    const bool ok = spans_reserve(&a->free, 2) && spans_reserve(&a->used, 16);
    if (ok) {
      spans_insert(&a->free, 0, (span_t){EPB_ARENA_ALIGN, size - EPB_ARENA_ALIGN});
      a->base = (uintptr_t)base, a->size = size, a->gen++;
    }
    const unsigned long long gen = a->gen;
    pthread_mutex_unlock(&a->mu);
    if (!ok) return PyErr_NoMemory();
    return Py_BuildValue("(iKKK)", i, gen, (unsigned long long)(uintptr_t)slot_fns[i].alloc,
                         (unsigned long long)(uintptr_t)slot_fns[i].release);
  }
  char msg[320];
  snprintf(msg, sizeof msg,
           "Buffer.mem_pool: all %d pool slots are in use (a pool's slot is free again once its "
           "Buffer is gone, its torch.cuda.MemPool dropped and every segment given back to the "
           "arena: every tensor of the pool freed and PyTorch's cache of it emptied)",
           EPB_ARENA_SLOTS);
  return epb_raise_msg(EP_ERR_NO_MEMORY, msg);
}

static PyObject *spans_list(const span_t *v, size_t n) {
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    PyObject *t = Py_BuildValue("(KK)", (unsigned long long)v[i].off, (unsigned long long)v[i].len);
    if (!t || PyList_SetItem(l, (Py_ssize_t)i, t)) {
      Py_DECREF(l);
      return NULL;
    }
  }
  return l;
}

/* arena_state(slot, gen) -> (free spans, segments out, closed) as (offset, bytes) lists; None
 * once the slot serves another arena (this one was closed and drained then). The spans are
 * copied under the lock and become Python objects after it: making objects may run the garbage
 * collector, and with it a pool's finalizer that closes this very arena. */
static PyObject *arena_state(PyObject *self, PyObject *args) {
  arena_t *a = slot_lock(args, NULL, NULL);
  if (!a) {
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
  }
  const size_t nf = a->free.n, nu = a->used.n;
  span_t *v = malloc((nf + nu + 1) * sizeof *v);
  if (v) {
    memcpy(v, a->free.v, nf * sizeof *v);
    memcpy(v + nf, a->used.v, nu * sizeof *v);
  }
  const bool closed = a->closed;
  pthread_mutex_unlock(&a->mu);
  if (!v) return PyErr_NoMemory();
  PyObject *f = spans_list(v, nf), *u = f ? spans_list(v + nf, nu) : NULL;
  free(v);
  if (!u) {
    Py_XDECREF(f);
    return NULL;
  }
  return Py_BuildValue("(NNO)", f, u, closed ? Py_True : Py_False);
}

/* arena_largest(slot, gen) -> the largest free span's bytes (0 once the slot serves another
 * arena): the out pool's room check, on every dispatch. */
static PyObject *arena_largest(PyObject *self, PyObject *args) {
  arena_t *a = slot_lock(args, NULL, NULL);
  if (!a) return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
  uint64_t most = 0;
  for (size_t i = 0; i < a->free.n; i++) most = a->free.v[i].len > most ? a->free.v[i].len : most;
  pthread_mutex_unlock(&a->mu);
  return PyLong_FromUnsignedLongLong((unsigned long long)most);
}

/* arena_close(slot, gen, pool_gone): no new segment (the buffer is gone); pool_gone: nor can
 * PyTorch ask for one (its MemPool was dropped), so the slot may serve another arena once every
 * segment is back. */
static PyObject *arena_close(PyObject *self, PyObject *args) {
  int pool_gone = 0;
  arena_t *a = slot_lock(args, "p", &pool_gone);
  if (!a) {
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
  }
  a->closed = true;
  a->pool_gone |= pool_gone != 0;
  pthread_mutex_unlock(&a->mu);
  Py_RETURN_NONE;
}

PyMethodDef epb_arena_methods[] = {
    {"arena_open", arena_open, METH_VARARGS, "a pool arena's slot and allocator functions"},
    {"arena_state", arena_state, METH_VARARGS, "(free spans, segments out, closed) of an arena"},
    {"arena_largest", arena_largest, METH_VARARGS, "bytes of an arena's largest free span"},
    {"arena_close", arena_close, METH_VARARGS, "close an arena; say whether its pool is gone"},
    {NULL, NULL, 0, NULL},
};
