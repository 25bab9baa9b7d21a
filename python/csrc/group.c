/* Groups: created from Python callbacks (a torch.distributed process group, an mpi4py
 * communicator, anything with an allgather) or from the launcher's environment. The callbacks
 * are used only inside ep_group_create; epcomm then talks over its own local sockets. */
#include "binding.h"

typedef struct {
  PyObject *allgather; /* allgather(bytes) -> bytes of nranks times its length, in rank order */
  PyObject *barrier;   /* barrier() or None */
  int nranks;
  epb_stash_t stash;
} boot_ctx_t;

/* Called by ep_group_create on this thread, GIL released: take it for the Python call. */
static int boot_allgather(void *vctx, const void *send, void *recv, size_t bytes) {
  boot_ctx_t *c = vctx;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = -1;
  PyObject *r = PyObject_CallFunction(c->allgather, "y#", (const char *)send, (Py_ssize_t)bytes);
  if (r && PyBytes_Check(r) && PyBytes_Size(r) == (Py_ssize_t)(bytes * (size_t)c->nranks)) {
    memcpy(recv, PyBytes_AsString(r), bytes * (size_t)c->nranks);
    rc = 0;
  } else if (r) {
    PyErr_Format(PyExc_ValueError, "the allgather callback returned %R, not %zd bytes", r,
                 (Py_ssize_t)(bytes * (size_t)c->nranks));
  }
  if (rc) epb_stash_take(&c->stash);
  Py_XDECREF(r);
  PyGILState_Release(g);
  return rc;
}

static int boot_barrier(void *vctx) {
  boot_ctx_t *c = vctx;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallObject(c->barrier, NULL);
  if (!r) epb_stash_take(&c->stash);
  Py_XDECREF(r);
  PyGILState_Release(g);
  return r ? 0 : -1;
}

static PyObject *group_create(PyObject *self, PyObject *args) {
  boot_ctx_t c = {0};
  double timeout_s;
  int rank;
  if (!PyArg_ParseTuple(args, "iiOOd", &rank, &c.nranks, &c.allgather, &c.barrier, &timeout_s))
    return NULL;
  if (!PyCallable_Check(c.allgather) || (c.barrier != Py_None && !PyCallable_Check(c.barrier)))
    return PyErr_Format(PyExc_TypeError, "group_create: allgather and barrier must be callable");
  ep_bootstrap_t boot = {rank, c.nranks, boot_allgather, c.barrier == Py_None ? NULL : boot_barrier,
                         &c};
  ep_group_config_t cfg = EP_GROUP_CONFIG_INIT;
  cfg.timeout_s = timeout_s;
  ep_group_t g = NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_group_create(&boot, &cfg, &g);
  Py_END_ALLOW_THREADS if (st) return c.stash.type ? epb_stash_raise(&c.stash, st) : epb_raise(st);
  return epb_from_ptr(g);
}

static PyObject *group_create_from_env(PyObject *self, PyObject *args) {
  double timeout_s;
  const char *job_id;
  if (!PyArg_ParseTuple(args, "dz", &timeout_s, &job_id)) return NULL;
  ep_group_config_t cfg = EP_GROUP_CONFIG_INIT;
  cfg.timeout_s = timeout_s;
  cfg.job_id = job_id;
  ep_group_t g = NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_group_create_from_env(&cfg, &g);
  Py_END_ALLOW_THREADS return st ? epb_raise(st) : epb_from_ptr(g);
}

/* The calls that take only a group and may wait: destroy, release, barrier. */
static PyObject *group_call(PyObject *args, ep_status_t (*fn)(ep_group_t)) {
  unsigned long long g;
  if (!PyArg_ParseTuple(args, "K", &g)) return NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = fn(epb_ptr(g));
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

static PyObject *group_destroy(PyObject *self, PyObject *args) {
  return group_call(args, ep_group_destroy);
}
static PyObject *group_release(PyObject *self, PyObject *args) {
  return group_call(args, ep_group_release);
}
static PyObject *group_barrier(PyObject *self, PyObject *args) {
  return group_call(args, ep_group_barrier);
}

static PyObject *group_info(PyObject *self, PyObject *args) {
  unsigned long long g;
  int rank, nranks;
  if (!PyArg_ParseTuple(args, "K", &g)) return NULL;
  ep_status_t st = ep_group_rank(epb_ptr(g), &rank);
  if (!st) st = ep_group_nranks(epb_ptr(g), &nranks);
  return st ? epb_raise(st) : Py_BuildValue("(ii)", rank, nranks);
}

static PyObject *group_allgather(PyObject *self, PyObject *args) {
  unsigned long long g;
  const char *send;
  Py_ssize_t n;
  int rank, nranks;
  if (!PyArg_ParseTuple(args, "Ky#", &g, &send, &n)) return NULL;
  ep_status_t st = ep_group_nranks(epb_ptr(g), &nranks);
  if (st || (st = ep_group_rank(epb_ptr(g), &rank))) return epb_raise(st);
  PyObject *out = PyBytes_FromStringAndSize(NULL, n * nranks);
  if (!out) return NULL;
  char *recv = PyBytes_AsString(out);
  Py_BEGIN_ALLOW_THREADS st = ep_group_allgather(epb_ptr(g), send, recv, (size_t)n);
  Py_END_ALLOW_THREADS if (st) {
    Py_DECREF(out);
    return epb_raise(st);
  }
  return out;
}

static PyObject *group_last_error(PyObject *self, PyObject *args) {
  unsigned long long g;
  if (!PyArg_ParseTuple(args, "K", &g)) return NULL;
  return PyUnicode_FromString(ep_group_last_error(epb_ptr(g)));
}

PyMethodDef epb_group_methods[] = {
    {"group_create", group_create, METH_VARARGS,
     "group_create(rank, nranks, allgather, barrier, timeout_s) -> group id (collective)"},
    {"group_create_from_env", group_create_from_env, METH_VARARGS,
     "group_create_from_env(timeout_s, job_id) -> group id (collective)"},
    {"group_destroy", group_destroy, METH_VARARGS, "collective, bounded by the deadline"},
    {"group_release", group_release, METH_VARARGS, "local: frees without talking to peers"},
    {"group_barrier", group_barrier, METH_VARARGS, "collective"},
    {"group_info", group_info, METH_VARARGS, "(rank, nranks)"},
    {"group_allgather", group_allgather, METH_VARARGS, "collective: bytes -> nranks times as many"},
    {"group_last_error", group_last_error, METH_VARARGS, "last error recorded on the group"},
    {NULL, NULL, 0, NULL},
};
