/* Low-latency mode: dispatch, receive, view, combine, handles (include/epcomm.h). */
#include "binding.h"

static PyObject *ll_dispatch(PyObject *self, PyObject *args) {
  unsigned long long b, x, idx, stream;
  int scale_layout = 0;
  ep_ll_dispatch_args_t a = EP_LL_DISPATCH_ARGS_INIT;
  if (!PyArg_ParseTuple(args, "KKiKiiiiiK|i", &b, &x, &a.num_tokens, &idx, &a.topk, &a.use_fp8,
                        &a.round_scale, &a.use_ue8m0, &a.two_phase, &stream, &scale_layout))
    return NULL;
  a.x = epb_ptr(x), a.topk_idx = epb_ptr(idx), a.stream = epb_ptr(stream);
  a.scale_layout = scale_layout;
  ep_ll_handle_t h = NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_ll_dispatch(epb_ptr(b), &a, &h);
  Py_END_ALLOW_THREADS return st ? epb_raise(st) : epb_from_ptr(h);
}

static PyObject *ll_recv(PyObject *self, PyObject *args) {
  unsigned long long b, h;
  if (!PyArg_ParseTuple(args, "KK", &b, &h)) return NULL;
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_ll_recv(epb_ptr(b), epb_ptr(h));
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

/* (L, max_rows, hidden, num_scales, use_fp8, round_scale, use_ue8m0, recv_x, recv_x_scales,
 *  recv_count, recv_src_info, recv_layout_range, scale_layout): shapes and addresses of the
 *  receive side. */
static PyObject *ll_view(PyObject *self, PyObject *args) {
  unsigned long long h;
  if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  ep_status_t st = ep_ll_get_recv_view(epb_ptr(h), &v);
  if (st) return epb_raise(st);
  int layout = v.scale_layout;
  return Py_BuildValue("(iiiiiiiNNNNNi)", v.num_local_experts, v.max_rows, v.hidden, v.num_scales,
                       v.use_fp8, v.round_scale, v.use_ue8m0, epb_from_ptr(v.recv_x),
                       epb_from_ptr(v.recv_x_scales), epb_from_ptr(v.recv_count),
                       epb_from_ptr(v.recv_src_info), epb_from_ptr(v.recv_layout_range), layout);
}

static PyObject *ll_combine(PyObject *self, PyObject *args) {
  unsigned long long b, h, y, idx, w, stream, out;
  ep_ll_combine_args_t a = EP_LL_COMBINE_ARGS_INIT;
  if (!PyArg_ParseTuple(args, "KKKKKiKK", &b, &h, &y, &idx, &w, &a.two_phase, &stream, &out))
    return NULL;
  a.handle = epb_ptr(h), a.y = epb_ptr(y), a.topk_idx = epb_ptr(idx);
  a.topk_weights = epb_ptr(w), a.stream = epb_ptr(stream), a.out = epb_ptr(out);
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_ll_combine(epb_ptr(b), &a);
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

static PyObject *ll_handle_destroy(PyObject *self, PyObject *args) {
  unsigned long long h;
  if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
  ep_status_t st = ep_ll_handle_destroy(epb_ptr(h));
  if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

static PyObject *ll_handle_num_recv_tokens(PyObject *self, PyObject *args) {
  unsigned long long h;
  int n;
  if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
  ep_status_t st = ep_ll_handle_num_recv_tokens(epb_ptr(h), &n);
  return st ? epb_raise(st) : PyLong_FromLong(n);
}

/* The zero-copy combine input of a received handle (ep_ll_get_combine_buffer): its address. */
static PyObject *ll_get_combine_buffer(PyObject *self, PyObject *args) {
  unsigned long long b, h;
  if (!PyArg_ParseTuple(args, "KK", &b, &h)) return NULL;
  void *y = NULL;
  ep_status_t st = ep_ll_get_combine_buffer(epb_ptr(b), epb_ptr(h), &y);
  return st ? epb_raise(st) : epb_from_ptr(y);
}

PyMethodDef epb_ll_methods[] = {
    {"ll_dispatch", ll_dispatch, METH_VARARGS,
     "ll_dispatch(buf, x, num_tokens, topk_idx, topk, use_fp8, round_scale, use_ue8m0, "
     "two_phase, stream) -> ll handle (collective)"},
    {"ll_recv", ll_recv, METH_VARARGS, "ll_recv(buf, handle): completes a two-phase call"},
    {"ll_view", ll_view, METH_VARARGS, "the receive side of a dispatch (a tuple, see ll.c)"},
    {"ll_combine", ll_combine, METH_VARARGS,
     "ll_combine(buf, handle, y, topk_idx, topk_weights, two_phase, stream, out) (collective)"},
    {"ll_handle_destroy", ll_handle_destroy, METH_VARARGS, "local; gives the result slot back"},
    {"ll_handle_num_recv_tokens", ll_handle_num_recv_tokens, METH_VARARGS, "local"},
    {"ll_get_combine_buffer", ll_get_combine_buffer, METH_VARARGS,
     "ll_get_combine_buffer(buf, handle) -> address of the zero-copy combine input (local)"},
    {NULL, NULL, 0, NULL},
};
