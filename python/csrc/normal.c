/* Normal mode: layout (local), dispatch and combine (collective), handles. Tensors arrive as
 * addresses the Python layer has checked (dtype, shape, device, contiguity). */
#include "binding.h"

static PyObject *layout(PyObject *self, PyObject *args) {
  unsigned long long b, idx, stream, tpr, tpe, itr;
  ep_layout_args_t a = EP_LAYOUT_ARGS_INIT;
  if (!PyArg_ParseTuple(args, "KKiiiKKKKi", &b, &idx, &a.num_tokens, &a.topk, &a.num_experts,
                        &stream, &tpr, &tpe, &itr, &a.no_wait))
    return NULL;
  a.topk_idx = epb_ptr(idx), a.stream = epb_ptr(stream);
  a.tokens_per_rank = epb_ptr(tpr), a.tokens_per_expert = epb_ptr(tpe);
  a.is_token_in_rank = epb_ptr(itr);
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_get_dispatch_layout(epb_ptr(b), &a);
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

/* EP_OUTPUT_ALLOC: the Python allocator is called with the receive count once it is known and
 * returns the addresses of (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
 * recv_src_idx), 0 for an output not wanted. It runs on this thread, GIL taken again. */
typedef struct {
  PyObject *fn;
  epb_stash_t stash;
} alloc_ctx_t;

static int take_rows(PyObject *r, ep_dispatch_out_t *o) {
  unsigned long long p[5];
  if (!PyArg_ParseTuple(r, "KKKKK;the allocator must return 5 addresses", &p[0], &p[1], &p[2],
                        &p[3], &p[4]))
    return -1;
  o->recv_x = epb_ptr(p[0]), o->recv_x_scales = epb_ptr(p[1]);
  o->recv_topk_idx = epb_ptr(p[2]), o->recv_topk_weights = epb_ptr(p[3]);
  o->recv_src_idx = epb_ptr(p[4]);
  return 0;
}

static int alloc_rows(void *vctx, const ep_dispatch_args_t *args, int n, ep_dispatch_out_t *o) {
  alloc_ctx_t *c = vctx;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallFunction(c->fn, "i", n);
  int rc = r ? take_rows(r, o) : -1;
  if (rc) epb_stash_take(&c->stash);
  Py_XDECREF(r);
  PyGILState_Release(g);
  return rc;
}

/* ep_dispatch_out_t.on_wait: the Python callable gets the step number while the host waits for
 * the count; a true result asks for the next step. An exception is the callable's bug, not the
 * call's: it is printed as unraisable and the steps end; a Ctrl-C is raised again once the call
 * is back in Python (the collective call itself must still complete on this rank). */
static int wait_step(void *fn, int step) {
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallFunction((PyObject *)fn, "i", step);
  int more = r ? PyObject_IsTrue(r) : -1;
  if (more < 0) {
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
      PyErr_Clear();
      PyErr_SetInterrupt();
    } else {
      PyErr_WriteUnraisable((PyObject *)fn);
    }
    more = 0;
  }
  Py_XDECREF(r);
  PyGILState_Release(g);
  return more;
}

/* The inputs, in the order of the argument tuple (see dispatch's doc string). */
static int parse_inputs(PyObject *args, unsigned long long *b, ep_dispatch_args_t *a,
                        ep_dispatch_out_t *o, PyObject **alloc, PyObject **on_wait) {
  unsigned long long x, sc, idx, w, cached, stream, rx, rs, ri, rw, rsrc, rp, rtpe;
  long long st_tok, st_hid;
  int dtype, mode;
  if (!PyArg_ParseTuple(args, "KKiiiKiLLKKiiiKKiiiOKKKKKKK|O", b, &x, &dtype, &a->num_tokens,
                        &a->hidden, &sc, &a->num_scales, &st_tok, &st_hid, &idx, &w, &a->topk,
                        &a->num_experts, &a->expert_alignment, &cached, &stream, &mode,
                        &o->worst_case, &o->capacity, alloc, &rx, &rs, &ri, &rw, &rsrc, &rp, &rtpe,
                        on_wait))
    return -1;
  a->x = epb_ptr(x), a->dtype = (ep_dtype_t)dtype, a->x_scales = epb_ptr(sc);
  a->scale_token_stride = st_tok, a->scale_hidden_stride = st_hid;
  o->mode = (ep_output_mode_t)mode;
  a->topk_idx = epb_ptr(idx), a->topk_weights = epb_ptr(w);
  a->cached = epb_ptr(cached), a->stream = epb_ptr(stream);
  o->recv_x = epb_ptr(rx), o->recv_x_scales = epb_ptr(rs), o->recv_topk_idx = epb_ptr(ri);
  o->recv_topk_weights = epb_ptr(rw), o->recv_src_idx = epb_ptr(rsrc);
  o->rank_prefix = epb_ptr(rp), o->recv_tokens_per_expert = epb_ptr(rtpe);
  return 0;
}

static PyObject *dispatch(PyObject *self, PyObject *args) {
  unsigned long long b;
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  alloc_ctx_t ctx = {0};
  PyObject *on_wait = Py_None;
  if (parse_inputs(args, &b, &a, &o, &ctx.fn, &on_wait)) return NULL;
  if (o.mode == EP_OUTPUT_ALLOC) {
    if (!PyCallable_Check(ctx.fn))
      return PyErr_Format(PyExc_TypeError, "dispatch: the allocator must be callable");
    o.alloc = alloc_rows, o.alloc_ctx = &ctx;
  }
  if (on_wait != Py_None) {
    if (!PyCallable_Check(on_wait))
      return PyErr_Format(PyExc_TypeError, "dispatch: on_wait must be callable or None");
    o.on_wait = wait_step, o.on_wait_ctx = on_wait; /* borrowed: args holds it for the call */
  }
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_dispatch(epb_ptr(b), &a, &o);
  Py_END_ALLOW_THREADS if (st) return ctx.stash.type ? epb_stash_raise(&ctx.stash, st)
                                                     : epb_raise(st);
  return Py_BuildValue("(iN)", o.num_recv_tokens, epb_from_ptr(o.handle));
}

static PyObject *combine(PyObject *self, PyObject *args) {
  unsigned long long b, h, x, w, b0, b1, stream, out, out_w;
  if (!PyArg_ParseTuple(args, "KKKKKKKKK", &b, &h, &x, &w, &b0, &b1, &stream, &out, &out_w))
    return NULL;
  ep_combine_args_t a = EP_COMBINE_ARGS_INIT;
  a.handle = epb_ptr(h), a.x = epb_ptr(x), a.topk_weights = epb_ptr(w);
  a.bias[0] = epb_ptr(b0), a.bias[1] = epb_ptr(b1), a.stream = epb_ptr(stream);
  a.out = epb_ptr(out), a.out_topk_weights = epb_ptr(out_w);
  ep_status_t st;
  Py_BEGIN_ALLOW_THREADS st = ep_combine(epb_ptr(b), &a);
  Py_END_ALLOW_THREADS if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

/* The combine input inside the buffer for a handle (ep_get_combine_buffer): its address. */
static PyObject *get_combine_buffer(PyObject *self, PyObject *args) {
  unsigned long long b, h;
  if (!PyArg_ParseTuple(args, "KK", &b, &h)) return NULL;
  void *x = NULL;
  ep_status_t st = ep_get_combine_buffer(epb_ptr(b), epb_ptr(h), &x);
  return st ? epb_raise(st) : epb_from_ptr(x);
}

static PyObject *handle_destroy(PyObject *self, PyObject *args) {
  unsigned long long h;
  if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
  ep_status_t st = ep_handle_destroy(epb_ptr(h));
  if (st) return epb_raise(st);
  Py_RETURN_NONE;
}

static PyObject *handle_num_recv_tokens(PyObject *self, PyObject *args) {
  unsigned long long h;
  int n;
  if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
  ep_status_t st = ep_handle_num_recv_tokens(epb_ptr(h), &n);
  return st ? epb_raise(st) : PyLong_FromLong(n);
}

PyMethodDef epb_normal_methods[] = {
    {"layout", layout, METH_VARARGS,
     "layout(buf, topk_idx, num_tokens, topk, num_experts, stream, tokens_per_rank, "
     "tokens_per_expert, is_token_in_rank, no_wait) (local)"},
    {"dispatch", dispatch, METH_VARARGS,
     "dispatch(buf, x, dtype, num_tokens, hidden, x_scales, num_scales, scale_token_stride, "
     "scale_hidden_stride, topk_idx, topk_weights, topk, num_experts, expert_alignment, cached, "
     "stream, mode, worst_case, capacity, alloc, recv_x, recv_x_scales, recv_topk_idx, "
     "recv_topk_weights, recv_src_idx, rank_prefix, recv_tokens_per_expert[, on_wait]) -> "
     "(num_recv_tokens, handle) (collective; on_wait(step) -> bool runs while the host waits "
     "for the count)"},
    {"combine", combine, METH_VARARGS,
     "combine(buf, handle, x, topk_weights, bias0, bias1, stream, out, out_topk_weights) "
     "(collective)"},
    {"get_combine_buffer", get_combine_buffer, METH_VARARGS,
     "get_combine_buffer(buf, handle) -> address of the combine input inside the buffer (local)"},
    {"handle_destroy", handle_destroy, METH_VARARGS, "local"},
    {"handle_num_recv_tokens", handle_num_recv_tokens, METH_VARARGS, "local"},
    {NULL, NULL, 0, NULL},
};
