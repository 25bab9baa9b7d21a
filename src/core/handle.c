/* Handles: the layout of one dispatch, owned by the caller, tied to the buffer that made it. */
#include <stdio.h>
#include <stdlib.h>

#include "buffer.h"

static void handle_free(ep_handle *h) {
  if (h->info.free_priv) h->info.free_priv(h->info.priv);
  h->magic = 0;
  free(h);
}

ep_status_t ep_handle_new(ep_buffer *b, ep_handle_info_t *info, ep_handle_t *out) {
  ep_handle *h = calloc(1, sizeof *h);
  if (!h) {
    if (info->free_priv) info->free_priv(info->priv);
    return ep_err(EP_ERR_NO_MEMORY, "out of memory for a handle");
  }
  h->magic = EP_HANDLE_MAGIC;
  h->buffer_id = b->id;
  h->info = *info;
  ep_status_t st = ep_reg_add(EP_OBJ_HANDLE, h, b->group->rank, &h->id);
  if (st) {
    handle_free(h);
    return st;
  }
  *out = ep_id_to_ptr(h->id);
  return EP_OK;
}

ep_status_t ep_handle_get(ep_buffer *b, ep_handle_t handle, const char *op, const char *arg,
                          enum ep_handle_kind kind, ep_handle **out) {
  ep_handle *h;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(handle), EP_OBJ_HANDLE, true, (void **)&h);
  if (st) {
    char msg[EP_ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s: %s: %s", op, arg, ep_last_error());
    ep_err_set_msg(msg);
    return st;
  }
  if (h->buffer_id != b->id || h->info.kind != kind) {
    ep_reg_release(h->id);
    return ep_err(EP_ERR_INVALID_ARG, "%s: %s comes from %s", op, arg,
                  h->buffer_id != b->id ? "another (or a destroyed) buffer"
                  : kind == EP_HANDLE_NORMAL ? "a low-latency dispatch, not a normal one"
                                             : "a normal dispatch, not a low-latency one");
  }
  *out = h;
  return EP_OK;
}

void ep_handle_put(ep_handle *h) { ep_reg_release(h->id); }

ep_status_t ep_handle_num_recv_tokens(ep_handle_t handle, int *n) {
  if (!n) return ep_err(EP_ERR_NULL_ARG, "ep_handle_num_recv_tokens: num_recv_tokens is NULL");
  ep_handle *h;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(handle), EP_OBJ_HANDLE, false, (void **)&h);
  if (st) return st;
  *n = h->info.num_recv_tokens;
  ep_reg_release(h->id);
  return EP_OK;
}

/* A low-latency handle holds one of its buffer's two result slots: it goes back under the
 * buffer's exclusive pin, so that it never races with a call on the buffer (EP_ERR_BUSY then, and
 * the handle survives for a retry). If the buffer is gone, the slot went with it. */
static ep_status_t pin_ll_buffer(ep_handle_t handle, ep_buffer **out) {
  *out = NULL;
  ep_handle *h;
  if (ep_reg_acquire(ep_ptr_to_id(handle), EP_OBJ_HANDLE, false, (void **)&h) != EP_OK)
    return EP_OK; /* ep_reg_remove reports it */
  ep_id_t bid = h->info.kind == EP_HANDLE_LL ? h->buffer_id : 0;
  ep_reg_release(h->id);
  if (!bid) return EP_OK;
  ep_status_t st = ep_reg_acquire(bid, EP_OBJ_BUFFER, true, (void **)out);
  if (st == EP_ERR_BUSY)
    return ep_err(EP_ERR_BUSY, "ep_handle_destroy: a call on the handle's buffer is in flight; "
                  "destroy the low-latency handle once it has returned");
  if (st) *out = NULL;
  return EP_OK;
}

ep_status_t ep_handle_destroy(ep_handle_t handle) {
  if (!handle) return EP_OK;
  ep_buffer *b;
  ep_status_t st = pin_ll_buffer(handle, &b);
  if (st) return st;
  void *obj;
  st = ep_reg_remove(ep_ptr_to_id(handle), EP_OBJ_HANDLE, &obj);
  if (st) {
    char msg[EP_ERRMSG_MAX];
    snprintf(msg, sizeof msg, "ep_handle_destroy: %s", ep_last_error());
    ep_err_set_msg(msg);
    if (b) ep_buffer_put(b);
    return st;
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
