/* Memory the library owns (the low-latency results, the zero-copy combine input) handed to torch
 * without a copy: a DLPack capsule of a 1-D uint8 tensor over [address, address + nbytes),
 * which torch.from_dlpack turns into a tensor on the CPU or on a CUDA device. DLPack is the
 * exchange format every array library reads; unlike __cuda_array_interface__ it needs no numpy.
 * The memory stays the library's: the capsule's deleter frees only its own description. */
#include <stdlib.h>

#include "binding.h"

/* The DLPack ABI (dlpack.h, version 0.x: the DLManagedTensor of a "dltensor" capsule). */
typedef struct {
  int32_t device_type; /* 1: CPU, 2: CUDA */
  int32_t device_id;
} dl_device_t;

typedef struct {
  uint8_t code; /* 1: unsigned integer */
  uint8_t bits;
  uint16_t lanes;
} dl_dtype_t;

typedef struct {
  void *data;
  dl_device_t device;
  int32_t ndim;
  dl_dtype_t dtype;
  int64_t *shape;
  int64_t *strides; /* NULL: compact row-major */
  uint64_t byte_offset;
} dl_tensor_t;

typedef struct dl_managed_s {
  dl_tensor_t dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct dl_managed_s *self);
} dl_managed_t;

/* One allocation: the managed tensor and its one-element shape. */
typedef struct {
  dl_managed_t m;
  int64_t shape[1];
} owned_t;

static void free_owned(dl_managed_t *m) {
  free(m);
}

/* Not consumed by a reader (renamed "used_dltensor" when it is): free the description here. */
static void capsule_gone(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) free_owned(PyCapsule_GetPointer(cap, "dltensor"));
}

static PyObject *memory_tensor(PyObject *self, PyObject *args) {
  unsigned long long address;
  long long nbytes;
  int device_type, device_id;
  if (!PyArg_ParseTuple(args, "KLii", &address, &nbytes, &device_type, &device_id)) return NULL;
  if (nbytes < 0 || (device_type != 1 && device_type != 2))
    return PyErr_Format(PyExc_ValueError, "memory_tensor: %lld bytes on device type %d", nbytes,
                        device_type);
  owned_t *o = calloc(1, sizeof *o);
  if (!o) return PyErr_NoMemory();
  o->shape[0] = nbytes;
  o->m.dl_tensor =
      (dl_tensor_t){epb_ptr(address), {device_type, device_id}, 1, {1, 8, 1}, o->shape, NULL, 0};
  o->m.deleter = free_owned;
  PyObject *cap = PyCapsule_New(&o->m, "dltensor", capsule_gone);
  if (!cap) free(o);
  return cap;
}

PyMethodDef epb_dlpack_methods[] = {
    {"memory_tensor", memory_tensor, METH_VARARGS,
     "memory_tensor(address, nbytes, device_type (1 CPU, 2 CUDA), device_id) -> a DLPack capsule "
     "of a uint8 tensor over that memory (no copy; the memory stays the library's)"},
    {NULL, NULL, 0, NULL},
};
