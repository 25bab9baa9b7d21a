/* Buffers: create (collective), destroy (collective), release (local), what they are. */
#include "binding.h"

/* The config fields the Python layer sets, in this order in the argument tuple. */
static int parse_config(PyObject *args, unsigned long long *group, ep_buffer_config_t *c) {
  int backend;
  Py_ssize_t queue_bytes;
  *c = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
  if (!PyArg_ParseTuple(args, "Kiniiiiidii", group, &backend, &queue_bytes, &c->num_channels,
                        &c->ll_max_tokens, &c->ll_hidden, &c->ll_num_experts, &c->ll_max_topk,
                        &c->timeout_s, &c->cuda_device, &c->num_sms))
    return -1;
  if (queue_bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "queue_bytes must be >= 0");
    return -1;
  }
  c->backend = (ep_backend_t)backend;
  c->queue_bytes = (size_t)queue_bytes;
  return 0;
}

static PyObject *buffer_create(PyObject *self, PyObject *args) {
  unsigned long long g;
  ep_buffer_config_t cfg;
  if (parse_config(args, &g, &cfg)) return NULL;
  ep_buffer_t b = NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_buffer_create(epb_ptr(g), &cfg, &b);
  Py_END_ALLOW_THREADS return st ? epb_raise(st) : epb_from_ptr(b);
}

/* Same arguments as buffer_create, the group's slot holding the number of ranks. */
static PyObject *buffer_size_hint(PyObject *self, PyObject *args) {
  unsigned long long nranks;
  ep_buffer_config_t cfg;
  if (parse_config(args, &nranks, &cfg)) return NULL;
  size_t bytes = 0;
  ep_status_t st = ep_buffer_size_hint(&cfg, (int)nranks, &bytes);
  return st ? epb_raise(st) : PyLong_FromSize_t(bytes);
}

static PyObject *buffer_call(PyObject *args, ep_status_t (*fn)(ep_buffer_t)) {
  unsigned long long b;
  if (!PyArg_ParseTuple(args, "K", &b)) return NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = fn(epb_ptr(b));
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

static PyObject *buffer_destroy(PyObject *self, PyObject *args) {
  return buffer_call(args, ep_buffer_destroy);
}
static PyObject *buffer_release(PyObject *self, PyObject *args) {
  return buffer_call(args, ep_buffer_release);
}

/* ep_buffer_query of the buffer in args ("K") into *i; 0 with the exception set. */
static int query_info(PyObject *args, ep_buffer_info_t *i) {
  unsigned long long b;
  if (!PyArg_ParseTuple(args, "K", &b)) return 0;
  ep_status_t st = ep_buffer_query(epb_ptr(b), i);
  return st ? (epb_raise(st), 0) : 1;
}

/* (backend, caps, rank, nranks, dispatch_view_lifetime, ll_view_lifetime, bytes, queue_bytes,
 *  num_channels, ll_max_tokens, ll_hidden, ll_num_experts, ll_max_topk, timeout_s, cuda_device,
 *  num_sms): the resolved config. Also the cheapest round trip into the library, which is what
 *  the Python layer's overhead is measured against. */
static PyObject *buffer_query(PyObject *self, PyObject *args) {
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  if (!query_info(args, &i)) return NULL;
  const ep_buffer_config_t *c = &i.config;
  return Py_BuildValue("(iIiiiinniiiiidii)", (int)i.backend, i.caps, i.rank, i.nranks,
                       (int)i.dispatch_view_lifetime, (int)i.ll_view_lifetime, (Py_ssize_t)i.bytes,
                       (Py_ssize_t)c->queue_bytes, c->num_channels, c->ll_max_tokens, c->ll_hidden,
                       c->ll_num_experts, c->ll_max_topk, c->timeout_s, c->cuda_device, c->num_sms);
}

/* (combines_in_place, dispatches_in_place) of ep_buffer_info_t. */
static PyObject *buffer_in_place(PyObject *self, PyObject *args) {
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  if (!query_info(args, &i)) return NULL;
  return Py_BuildValue("(KK)", (unsigned long long)i.combines_in_place,
                       (unsigned long long)i.dispatches_in_place);
}

static PyObject *buffer_last_error(PyObject *self, PyObject *args) {
  unsigned long long b;
  if (!PyArg_ParseTuple(args, "K", &b)) return NULL;
  return PyUnicode_FromString(ep_buffer_last_error(epb_ptr(b)));
}

/* (buffer, address, bytes) -> registration id. Collective: waits for the peers without the GIL. */
static PyObject *register_memory(PyObject *self, PyObject *args) {
  unsigned long long b, ptr;
  Py_ssize_t bytes;
  if (!PyArg_ParseTuple(args, "KKn", &b, &ptr, &bytes)) return NULL;
  if (bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "bytes must be >= 0");
    return NULL;
  }
  ep_mem_t mem = NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_register_memory(epb_ptr(b), epb_ptr(ptr), (size_t)bytes, &mem);
  Py_END_ALLOW_THREADS return st ? epb_raise(st) : epb_from_ptr(mem);
}

static PyObject *deregister_memory(PyObject *self, PyObject *args) {
  unsigned long long b, mem;
  if (!PyArg_ParseTuple(args, "KK", &b, &mem)) return NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_deregister_memory(epb_ptr(b), epb_ptr(mem));
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef epb_buffer_methods[] = {
    {"buffer_create", buffer_create, METH_VARARGS,
     "buffer_create(group, backend, queue_bytes, num_channels, ll_max_tokens, ll_hidden, "
     "ll_num_experts, ll_max_topk, timeout_s, cuda_device, num_sms) -> buffer id (collective)"},
    {"buffer_size_hint", buffer_size_hint, METH_VARARGS,
     "buffer_size_hint(nranks, <buffer_create's config>) -> bytes"},
    {"buffer_destroy", buffer_destroy, METH_VARARGS, "collective, bounded by the deadline"},
    {"buffer_release", buffer_release, METH_VARARGS, "local: frees without talking to peers"},
    {"buffer_query", buffer_query, METH_VARARGS, "what the buffer is (a tuple, see buffer.c)"},
    {"buffer_in_place", buffer_in_place, METH_VARARGS, "(combines, dispatches) moved in place"},
    {"buffer_last_error", buffer_last_error, METH_VARARGS, "last error recorded on the buffer"},
    {"register_memory", register_memory, METH_VARARGS,
     "register_memory(buffer, address, bytes) -> registration id (collective)"},
    {"deregister_memory", deregister_memory, METH_VARARGS,
     "deregister_memory(buffer, registration) (collective)"},
    {NULL, NULL, 0, NULL},
};
