/* Handles: the layout of one dispatch (ep_handle_t) or one low-latency result slot
 * (ep_ll_handle_t), owned by the caller, tied to the buffer that made it. The two kinds are
 * distinct registry objects, so one cannot be passed where the other is expected. */
#include <stdio.h>
#include <stdlib.h>

#include "buffer.h"

static enum ep_obj_kind obj_kind(enum ep_handle_kind k) {
  return k == EP_HANDLE_LL ? EP_OBJ_LL_HANDLE : EP_OBJ_HANDLE;
}

static void handle_free(ep_handle *h) {
  if (h->info.free_priv) h->info.free_priv(h->info.priv);
  h->magic = 0;
  free(h);
}

ep_status_t ep_handle_new(ep_buffer *b, ep_handle_info_t *info, void *out) {
  ep_handle *h = calloc(1, sizeof *h);
  if (!h) {
    if (info->free_priv) info->free_priv(info->priv);
    return ep_err(EP_ERR_NO_MEMORY, "out of memory for a handle");
  }
  h->magic = EP_HANDLE_MAGIC;
  h->buffer_id = b->id;
  h->info = *info;
  ep_status_t st = ep_reg_add(obj_kind(info->kind), h, b->group->rank, &h->id);
  if (st) {
    handle_free(h);
    return st;
  }
  *(void **)out = ep_id_to_ptr(h->id);
  return EP_OK;
}

ep_status_t ep_handle_get(ep_buffer *b, const void *handle, const char *op, const char *arg,
                          enum ep_handle_kind kind, ep_handle **out) {
  ep_handle *h;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(handle), obj_kind(kind), true, (void **)&h);
  if (st) return ep_err_named(st, op, arg);
  if (h->buffer_id != b->id) {
    ep_reg_release(h->id);
    return ep_err(EP_ERR_INVALID_ARG, "%s: %s comes from another (or a destroyed) buffer", op, arg);
  }
  *out = h;
  return EP_OK;
}

void ep_handle_put(ep_handle *h) {
  ep_reg_release(h->id);
}

static ep_status_t num_recv(const void *handle, enum ep_handle_kind kind, int *n, const char *op) {
  if (!n) return ep_err(EP_ERR_NULL_ARG, "%s: num_recv_tokens is NULL", op);
  ep_handle *h;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(handle), obj_kind(kind), false, (void **)&h);
  if (st) return ep_err_named(st, op, "handle");
  *n = h->info.num_recv_tokens;
  ep_reg_release(h->id);
  return EP_OK;
}

ep_status_t ep_handle_num_recv_tokens(ep_handle_t handle, int *n) {
  return num_recv(handle, EP_HANDLE_NORMAL, n, "ep_handle_num_recv_tokens");
}

ep_status_t ep_ll_handle_num_recv_tokens(ep_ll_handle_t handle, int *n) {
  return num_recv(handle, EP_HANDLE_LL, n, "ep_ll_handle_num_recv_tokens");
}

ep_status_t ep_handle_destroy(ep_handle_t handle) {
  if (!handle) return EP_OK;
  void *obj;
  ep_status_t st = ep_reg_remove(ep_ptr_to_id(handle), EP_OBJ_HANDLE, &obj);
  if (st) return ep_err_named(st, "ep_handle_destroy", "handle");
  handle_free(obj);
  return EP_OK;
}

/* A low-latency handle holds one of its buffer's two result slots: it goes back under the
 * buffer's exclusive pin, so that it never races with a call on the buffer (EP_ERR_BUSY then, and
 * the handle survives for a retry). If the buffer is gone, the slot went with it. */
static ep_status_t pin_ll_buffer(ep_ll_handle_t handle, ep_buffer **out) {
  *out = NULL;
  ep_handle *h;
  if (ep_reg_acquire(ep_ptr_to_id(handle), EP_OBJ_LL_HANDLE, false, (void **)&h) != EP_OK)
    return EP_OK; /* ep_reg_remove reports it */
  ep_id_t bid = h->buffer_id;
  ep_reg_release(h->id);
  ep_status_t st = ep_reg_acquire(bid, EP_OBJ_BUFFER, true, (void **)out);
  if (st == EP_ERR_BUSY)
    return ep_err(EP_ERR_BUSY,
                  "ep_ll_handle_destroy: a call on the handle's buffer is in "
                  "flight; destroy the handle once it has returned");
  if (st) *out = NULL;
  return EP_OK;
}

ep_status_t ep_ll_handle_destroy(ep_ll_handle_t handle) {
  if (!handle) return EP_OK;
  ep_buffer *b;
  ep_status_t st = pin_ll_buffer(handle, &b);
  if (st) return st;
  void *obj;
  st = ep_reg_remove(ep_ptr_to_id(handle), EP_OBJ_LL_HANDLE, &obj);
  if (st) {
    if (b) ep_buffer_put(b);
    return ep_err_named(st, "ep_ll_handle_destroy", "handle");
  }
  ep_handle *h = obj;
  if (b) {
    if (b->ops->ll_release) b->ops->ll_release(b->state, &h->info);
    b->ll_live--;
    ep_buffer_put(b);
  }
  handle_free(h);
  return EP_OK;
}
