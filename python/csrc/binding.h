/*
 * epcomm._C: the CPython extension under the Python package, on the stable ABI (Py_LIMITED_API,
 * set by python/CMakeLists.txt): one binary serves every CPython from 3.9 on.
 *
 * It is a thin layer over include/epcomm.h and knows nothing of torch: objects (groups, buffers,
 * handles) travel as Python ints holding their opaque ids, tensors as their addresses, CUDA
 * streams as their cudaStream_t value. The Python layer (epcomm/_buffer.py and friends) checks
 * dtypes, shapes and devices, allocates with torch and keeps tensors alive.
 *
 * GIL: every call that may wait for peers runs with the GIL released, so other Python threads
 * (and the peers' progress, when ranks are threads) go on; the callbacks that call back into
 * Python (bootstrap allgather and barrier, the dispatch allocator) take it again.
 *
 * Errors: a failing epcomm call raises the Python class registered for its status
 * (set_error_classes, epcomm/_errors.py) with ep_last_error()'s message.
 */
#ifndef EPCOMM_PY_BINDING_H
#define EPCOMM_PY_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <epcomm.h>
#include <stdint.h>
#include <string.h>

/* Raises the exception of status st with the calling thread's last epcomm error. Returns NULL. */
PyObject *epb_raise(ep_status_t st);
/* The same with a message of the binding's own (no epcomm call failed). */
PyObject *epb_raise_msg(ep_status_t st, const char *msg);
/* Opaque id or address -> Python int, and back (0 is NULL). */
PyObject *epb_from_ptr(const void *p);
static inline void *epb_ptr(unsigned long long v) {
  return (void *)(uintptr_t)v;
}

/* A Python exception caught inside a callback that C called: kept until the epcomm call has
 * returned, then raised in place of the status it caused. */
typedef struct {
  PyObject *type, *value, *tb;
} epb_stash_t;
void epb_stash_take(epb_stash_t *s); /* with the GIL: moves the current exception in */
PyObject *epb_stash_raise(epb_stash_t *s, ep_status_t st); /* raise it, chained to st's error */

/* Method tables of the parts of the module (module.c adds them all). */
extern PyMethodDef epb_group_methods[];
extern PyMethodDef epb_buffer_methods[];
extern PyMethodDef epb_normal_methods[];
extern PyMethodDef epb_ll_methods[];
extern PyMethodDef epb_dlpack_methods[];
extern PyMethodDef epb_arena_methods[];

#endif
