/* Module epcomm._C: definition, error classes, versions. The parts: group.c (bootstrap),
 * buffer.c (buffers), normal.c (layout, dispatch, combine), ll.c (low-latency mode), dlpack.c
 * (tensors over the library's memory), arena.c (the memory pools' allocators). */
#include "binding.h"

/* Exception classes by status code (a tuple, set once by epcomm/_errors.py at import). */
static PyObject *error_classes;

PyObject *epb_from_ptr(const void *p) {
  return PyLong_FromUnsignedLongLong((uintptr_t)p);
}

static PyObject *error_class(ep_status_t st) {
  if (error_classes && (Py_ssize_t)st < PyTuple_Size(error_classes)) {
    PyObject *c = PyTuple_GetItem(error_classes, (Py_ssize_t)st); /* borrowed */
    if (c && c != Py_None) return c;
  }
  return PyExc_RuntimeError;
}

/* The class is called as cls(message, code) so that it can fill .status and .code itself. */
static PyObject *make_error(ep_status_t st, const char *msg) {
  return PyObject_CallFunction(error_class(st), "si", msg, (int)st);
}

PyObject *epb_raise_msg(ep_status_t st, const char *msg) {
  PyObject *exc = make_error(st, msg);
  if (exc) {
    PyErr_SetObject(error_class(st), exc);
    Py_DECREF(exc);
  }
  return NULL;
}

PyObject *epb_raise(ep_status_t st) {
  const char *msg = ep_last_error();
  return epb_raise_msg(st, msg && *msg ? msg : ep_status_string(st));
}

void epb_stash_take(epb_stash_t *s) {
  if (!s->type)
    PyErr_Fetch(&s->type, &s->value, &s->tb);
  else
    PyErr_Clear(); /* the first exception is the one that matters */
}

PyObject *epb_stash_raise(epb_stash_t *s, ep_status_t st) {
  PyObject *cause = NULL;
  if (s->type) {
    PyErr_NormalizeException(&s->type, &s->value, &s->tb);
    if (s->tb && s->value) PyException_SetTraceback(s->value, s->tb);
    cause = s->value; /* new reference */
    Py_XDECREF(s->type);
    Py_XDECREF(s->tb);
    s->type = s->value = s->tb = NULL;
  }
  epb_raise(st);
  if (cause) { /* "raise EpcommError(...) from the callback's exception" */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v)
      PyException_SetCause(v, cause); /* steals cause */
    else
      Py_DECREF(cause);
    PyErr_Restore(t, v, tb);
  }
  return NULL;
}

static PyObject *set_error_classes(PyObject *self, PyObject *args) {
  PyObject *t;
  if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &t)) return NULL;
  PyObject *old = error_classes;
  Py_INCREF(t);
  error_classes = t;
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

static PyObject *version(PyObject *self, PyObject *noargs) {
  return Py_BuildValue("(si)", ep_version_string(), ep_version());
}

static PyObject *status_name(PyObject *self, PyObject *args) {
  int st;
  if (!PyArg_ParseTuple(args, "i", &st)) return NULL;
  return Py_BuildValue("(ss)", ep_status_name((ep_status_t)st), ep_status_string((ep_status_t)st));
}

static PyObject *last_error(PyObject *self, PyObject *noargs) {
  return PyUnicode_FromString(ep_last_error());
}

static PyObject *backend_available(PyObject *self, PyObject *args) {
  int backend;
  if (!PyArg_ParseTuple(args, "i", &backend)) return NULL;
  int ok = ep_backend_available((ep_backend_t)backend);
  return Py_BuildValue("(Os)", ok ? Py_True : Py_False, ok ? "" : ep_last_error());
}

static PyMethodDef module_methods[] = {
    {"set_error_classes", set_error_classes, METH_VARARGS, "exception class of every status"},
    {"version", version, METH_NOARGS, "(version string, version code) of the loaded library"},
    {"status_name", status_name, METH_VARARGS, "(name, message) of a status code"},
    {"last_error", last_error, METH_NOARGS, "message of this thread's last failing call"},
    {"backend_available", backend_available, METH_VARARGS, "(available, why not) of a backend"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "epcomm's C API (include/epcomm.h), for the epcomm package.",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

static int add_constants(PyObject *m) {
  static const struct {
    const char *name;
    long value;
  } consts[] = {
      {"VERSION_CODE", EP_VERSION_CODE},
      {"BACKEND_AUTO", EP_BACKEND_AUTO},
      {"BACKEND_CPU", EP_BACKEND_CPU},
      {"BACKEND_CUDA", EP_BACKEND_CUDA},
      {"DTYPE_BF16", EP_DTYPE_BF16},
      {"DTYPE_FP8_E4M3", EP_DTYPE_FP8_E4M3},
      {"OUTPUT_CALLER", EP_OUTPUT_CALLER},
      {"OUTPUT_ALLOC", EP_OUTPUT_ALLOC},
      {"OUTPUT_VIEWS", EP_OUTPUT_VIEWS},
      {"CAP_DISPATCH_VIEWS", EP_CAP_DISPATCH_VIEWS},
      {"CAP_LOW_LATENCY", EP_CAP_LOW_LATENCY},
      {"CAP_DEVICE_MEMORY", EP_CAP_DEVICE_MEMORY},
      {"CAP_GRAPH_CAPTURE", EP_CAP_GRAPH_CAPTURE},
      {"CAP_COMBINE_BUFFER", EP_CAP_COMBINE_BUFFER},
      {"CAP_REGISTER_MEMORY", EP_CAP_REGISTER_MEMORY},
      {"STATUS_COUNT", EP_STATUS_COUNT_},
      {"ERR_BUSY", EP_ERR_BUSY},
      {"SCALES_ROW_MAJOR", EP_SCALES_ROW_MAJOR},
      {"SCALES_COL_MAJOR", EP_SCALES_COL_MAJOR},
  };
  for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
    if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value)) return -1;
  return 0;
}

PyMODINIT_FUNC PyInit__C(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  PyMethodDef *parts[] = {epb_group_methods, epb_buffer_methods, epb_normal_methods,
                          epb_ll_methods,    epb_dlpack_methods, epb_arena_methods};
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
    if (PyModule_AddFunctions(m, parts[i])) goto fail;
  if (add_constants(m)) goto fail;
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
