/* Buffer lifecycle: create (collective), destroy (collective, bounded), release (local). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "buffer.h"

static void buffer_free(ep_buffer *b) {
  ep_errbox_fini(&b->err);
  b->magic = 0;
  free(b);
}

static ep_status_t buffer_new(ep_group *g, const ep_buffer_config_t *cfg, ep_buffer **out) {
  ep_buffer *b = calloc(1, sizeof *b);
  if (!b) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  b->magic = EP_BUFFER_MAGIC;
  b->group = g;
  b->ctx.buf = b;
  ep_errbox_init(&b->err);
  ep_status_t st = ep_buffer_resolve_config(cfg, g->timeout_s, &b->cfg, &b->ops);
  if (st) {
    buffer_free(b);
    return st;
  }
  b->timeout_s = b->cfg.timeout_s;
  *out = b;
  return EP_OK;
}

/* Within the group's BUFFER_CREATE call. A rank whose config is rejected here (or whose `out`
 * is NULL) still takes part in the agreement, so that its peers fail at once with
 * EP_ERR_PEER_INVALID instead of pairing this create with their next one. */
static ep_status_t buffer_create(ep_group *g, const ep_buffer_config_t *cfg, ep_buffer_t *out) {
  ep_buffer *b = NULL;
  ep_status_t st =
      out ? buffer_new(g, cfg, &b) : ep_err(EP_ERR_NULL_ARG, "ep_buffer_create: buf is NULL");
  if (st) return ep_group_xchg(g, EP_XCHG_BYTES, NULL, NULL, 0, -1, NULL, st, g->timeout_s);
  st = ep_buffer_agree_config(b);
  /* After the agreement: every rank checks the same config, so all fail alike or none does. */
  if (!st) st = ep_ll_check_config(&b->cfg, g->nranks);
  if (!st && b->ops->check_config) st = b->ops->check_config(&b->cfg, g->nranks);
  if (!st && b->ops->size_hint(&b->cfg, g->nranks, &b->bytes)) b->bytes = 0; /* query only */
  if (!st) st = b->ops->create(&b->ctx, &b->cfg, &b->state);
  if (st) {
    buffer_free(b);
    return st;
  }
  if ((st = ep_reg_add(EP_OBJ_BUFFER, b, g->rank, &b->id)) ||
      (st = ep_group_add_buffer(g, b->id))) {
    if (b->id) {
      void *obj;
      ep_reg_remove(b->id, EP_OBJ_BUFFER, &obj);
    }
    b->ops->destroy(b->state, false);
    buffer_free(b);
    return st;
  }
  ep_log_at(EP_LOG_INFO, g->rank, "init", "buffer %#" PRIx64 " up: backend %s, %d channels", b->id,
            b->ops->name, b->cfg.num_channels);
  *out = ep_id_to_ptr(b->id);
  return EP_OK;
}

ep_status_t ep_buffer_create(ep_group_t group, const ep_buffer_config_t *cfg, ep_buffer_t *buf) {
  ep_group *g;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(group), EP_OBJ_GROUP, false, (void **)&g);
  if (st) { /* no group, no peers to tell: this cannot take part */
    char msg[EP_ERRMSG_MAX];
    snprintf(msg, sizeof msg, "ep_buffer_create: %s", ep_last_error());
    ep_err_set_msg(msg);
    return st;
  }
  st = ep_group_call_begin(g, EP_OP_BUFFER_CREATE);
  if (!st) st = buffer_create(g, cfg, buf);
  ep_group_call_end(g);
  if (st) ep_group_fail(g, st, "ep_buffer_create");
  ep_reg_release(g->id);
  return st;
}

/* Shared by destroy and release: unlink from the registry and the group, then free. */
static ep_status_t buffer_teardown(ep_buffer_t buffer, bool collective, const char *op) {
  if (!buffer) return EP_OK;
  void *obj;
  ep_status_t st = ep_reg_remove(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, &obj);
  if (st) {
    return ep_err_named(st, op, NULL);
  }
  ep_buffer *b = obj;
  ep_group *g = b->group;
  /* A destroy is the group's BUFFER_DESTROY call even when it skips the barrier (broken), so
   * that every rank counts the same calls. */
  if (collective && ep_group_call_begin(g, EP_OP_BUFFER_DESTROY) == EP_ERR_BROKEN) b->broken = true;
  bool quiesce = collective && !b->broken;
  ep_log_at(EP_LOG_INFO, g->rank, "teardown", "buffer %#" PRIx64 ": %s%s", b->id, op,
            collective && !quiesce ? " (broken: local release only)" : "");
  ep_mem_drop_all(b);
  st = b->ops->destroy(b->state, quiesce);
  if (collective) ep_group_call_end(g);
  if (st) ep_err_prefix(op);
  ep_group_remove_buffer(g, b->id);
  buffer_free(b);
  return st;
}

ep_status_t ep_buffer_destroy(ep_buffer_t buf) {
  return buffer_teardown(buf, true, "ep_buffer_destroy");
}

ep_status_t ep_buffer_release(ep_buffer_t buf) {
  return buffer_teardown(buf, false, "ep_buffer_release");
}
