/* Buffers: collective create/destroy, local release, and the services the core offers backends. */
#include "buffer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ------------------------------------------------------------------ services for backends */

int ep_ctx_rank(const ep_ctx_t *ctx) {
  return ctx->buf->group->rank;
}
int ep_ctx_nranks(const ep_ctx_t *ctx) {
  return ctx->buf->group->nranks;
}
double ep_ctx_timeout(const ep_ctx_t *ctx) {
  return ctx->buf->timeout_s;
}
void ep_ctx_mark_broken(ep_ctx_t *ctx) {
  ctx->buf->broken = true;
}
bool ep_ctx_peer_lost(const ep_ctx_t *ctx) {
  return ctx->buf->group->peer_lost;
}

/* Bootstrap exchanges of a buffer: part of its group's current collective call (buffer create or
 * destroy, buffer_life.c; memory (de)registration, memreg.c), which holds the group's channel; a
 * failure breaks the group too. */
static ep_status_t boot_locked(ep_ctx_t *ctx, int kind, const void *send, void *recv, size_t bytes,
                               int fd, int *fds) {
  ep_group *g = ctx->buf->group;
  if (!ep_group_in_call(g))
    return ep_err(EP_ERR_INTERNAL, "bootstrap exchange outside a collective call of the buffer");
  return ep_group_xchg(g, kind, send, recv, bytes, fd, fds, EP_OK, ctx->buf->timeout_s);
}

ep_status_t ep_ctx_allgather(ep_ctx_t *ctx, const void *send, void *recv, size_t bytes) {
  return boot_locked(ctx, EP_XCHG_BYTES, send, recv, bytes, -1, NULL);
}

ep_status_t ep_ctx_allgather_fd(ep_ctx_t *ctx, int fd, int *fds) {
  return boot_locked(ctx, EP_XCHG_FD, NULL, NULL, 0, fd, fds);
}

ep_status_t ep_ctx_barrier(ep_ctx_t *ctx) {
  return boot_locked(ctx, EP_XCHG_BARRIER, NULL, NULL, 0, -1, NULL);
}

ep_status_t ep_ctx_check_peers(ep_ctx_t *ctx, int *dead, const char **how) {
  return ep_group_check(ctx->buf->group, dead, how);
}

bool ep_ctx_lost_launcher(ep_ctx_t *ctx) {
  return ep_live_lost_launcher(&ctx->buf->group->live);
}

ep_status_t ep_ctx_liveness(void *ctx) {
  return ep_ctx_check_peers(ctx, NULL, NULL);
}

const ep_topo_t *ep_ctx_topo(const ep_ctx_t *ctx) {
  return &ctx->buf->group->topo;
}

static ep_status_t net_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
  return ep_ctx_allgather(ctx, send, recv, bytes);
}

ep_status_t ep_ctx_net_open(ep_ctx_t *ctx, const char *engine, int device,
                            const struct ep_net_engine **e, ep_net_t **n) {
  ep_group *g = ctx->buf->group;
  *n = NULL;
  if (!(*e = ep_net_find(engine))) return EP_ERR_UNSUPPORTED;
  ep_net_open_t how = {g->rank,       g->nranks, device,         ep_now() + ctx->buf->timeout_s,
                       net_allgather, ctx,       ep_ctx_liveness};
  ep_status_t st = (*e)->open(&how, n);
  if (!st)
    ep_log_at(EP_LOG_INFO, g->rank, "init", "network engine %s open: %d ranks on %d hosts", engine,
              g->nranks, g->topo.nhosts);
  return st;
}

ep_status_t ep_ctx_fail(ep_ctx_t *ctx, ep_status_t status, int peer, const char *op,
                        const char *phase, const char *fmt, ...) {
  char detail[EP_ERRMSG_MAX], msg[EP_ERRMSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  if (peer >= 0)
    snprintf(msg, sizeof msg, "%s: %s: %s (peer rank %d, %s)", op, phase, detail, peer,
             ep_status_name(status));
  else
    snprintf(msg, sizeof msg, "%s: %s: %s (%s)", op, phase, detail, ep_status_name(status));
  ep_err_set_msg(msg);
  ep_errbox_put(&ctx->buf->err, msg);
  EP_LOG(ctx, EP_LOG_INFO, "run", "%s", msg);
  return status;
}

/* ------------------------------------------------------------------ lookup */

/* A collective call given an invalid buffer handle cannot take part, and its peers would pair
 * their call with this rank's next one (and return EP_OK with the wrong data). When this process
 * has exactly one live buffer, that is the one the call was meant for as far as anyone can tell:
 * reject the call through it, so that the peers fail at once (EP_ERR_PEER_INVALID) and the
 * buffer's calls stay in step. With several buffers nobody can tell which: see LIFECYCLE.md. */
static void reject_lost_call(const char *op) {
  int kind = !strcmp(op, "ep_dispatch") || !strcmp(op, "ep_combine") ? 0
             : !strcmp(op, "ep_ll_dispatch")                         ? 1
             : !strcmp(op, "ep_ll_combine")                          ? 2
                                                                     : -1;
  ep_id_t id = kind < 0 ? 0 : ep_reg_sole(EP_OBJ_BUFFER);
  ep_buffer *b;
  if (!id || ep_reg_acquire(id, EP_OBJ_BUFFER, true, (void **)&b) != EP_OK) return;
  if (!strcmp(op, "ep_dispatch")) b->dispatches++; /* the numbers stay in step (ops_normal.c) */
  if (!b->broken && kind == 0 && b->ops->reject) b->ops->reject(b->state);
  if (!b->broken && kind > 0 && b->cfg.ll_max_tokens > 0 && b->ops->ll_reject)
    b->ops->ll_reject(b->state, kind == 2);
  ep_reg_release(id);
}

ep_status_t ep_buffer_get(ep_buffer_t buffer, const char *op, ep_buffer **b) {
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, true, (void **)b);
  if (st) {
    char msg[EP_ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", ep_last_error()); /* the rejection below may overwrite it */
    if (st == EP_ERR_NULL_ARG || st == EP_ERR_INVALID_ARG || st == EP_ERR_DESTROYED)
      reject_lost_call(op);
    ep_err_set_msg(msg);
    return ep_err_named(st, op, NULL);
  }
  if ((*b)->broken) {
    ep_reg_release((*b)->id);
    return ep_err(EP_ERR_BROKEN,
                  "%s: buffer is unusable after an earlier failure (%s); destroy "
                  "or release it",
                  op, ep_errbox_get(&(*b)->err));
  }
  return EP_OK;
}

void ep_buffer_put(ep_buffer *b) {
  ep_reg_release(b->id);
}

static bool status_breaks(ep_status_t st) {
  return st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED || st == EP_ERR_SYSTEM ||
         st == EP_ERR_INTERNAL || st == EP_ERR_CUDA || st == EP_ERR_BROKEN;
}

ep_status_t ep_buffer_after(ep_buffer *b, ep_status_t st, const char *op) {
  if (st == EP_OK) return st;
  if (status_breaks(st)) b->broken = true;
  /* A peer that timed out or died leaves every collective of the group in doubt: its destroys
   * must not wait a second deadline for the same peer. */
  if (st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED)
    b->group->broken = b->group->peer_lost = true;
  /* Backends report through ep_ctx_fail; a bare status from them still gets the op name. */
  ep_err_prefix(op);
  ep_errbox_put(&b->err, ep_last_error());
  return st;
}

const char *ep_buffer_last_error(ep_buffer_t buffer) {
  ep_buffer *b;
  if (ep_reg_acquire(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, false, (void **)&b))
    return ep_last_error();
  const char *m = ep_errbox_get(&b->err);
  ep_reg_release(b->id);
  return m;
}

ep_status_t ep_buffer_query(ep_buffer_t buffer, ep_buffer_info_t *info) {
  static const char op[] = "ep_buffer_query";
  if (!info) return ep_err(EP_ERR_NULL_ARG, "%s: info is NULL", op);
  ep_buffer_info_t i;
  memset(&i, 0, sizeof i);
  if (info->size < sizeof(size_t) || info->size > sizeof i || info->size % sizeof(void *))
    return ep_err(EP_ERR_CONFIG,
                  "%s: info->size is %zu, this library accepts %zu..%zu (use "
                  "EP_BUFFER_INFO_INIT)",
                  op, info->size, sizeof(size_t), sizeof i);
  ep_buffer *b;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(buffer), EP_OBJ_BUFFER, false, (void **)&b);
  if (st) {
    return ep_err_named(st, op, "buf");
  }
  i.size = info->size;
  i.backend = b->cfg.backend;
  i.caps = b->ops->caps | (b->ops->ll_dispatch && b->cfg.ll_max_tokens ? EP_CAP_LOW_LATENCY : 0);
  if (b->group->topo.nhosts > 1) i.caps &= ~b->ops->caps_one_host;
  i.rank = b->group->rank;
  i.nranks = b->group->nranks;
  i.dispatch_view_lifetime = b->ops->dispatch_view_lifetime;
  i.ll_view_lifetime = i.caps & EP_CAP_LOW_LATENCY ? b->ops->ll_view_lifetime : EP_LIFETIME_NONE;
  i.bytes = b->bytes;
  i.config = b->cfg;
  const ep_topo_t *t = &b->group->topo;
  i.nhosts = t->nhosts, i.host = t->host, i.local_rank = t->local_rank,
  i.local_size = t->local_size;
  if (b->ops->traffic) b->ops->traffic(b->state, &i.net_bytes_sent, &i.local_bytes_sent);
  if (b->ops->path_counts) b->ops->path_counts(b->state, &i);
  ep_reg_release(b->id);
  memcpy(info, &i, info->size); /* an older caller's smaller struct gets the fields it has */
  return EP_OK;
}

/* ------------------------------------------------------------------ config */

/* The public enum's spelling (EP_BACKEND=cuda); whether a backend is built is the table's say. */
static const char *const backend_names[] = {"auto", "cpu", "cuda"};

const char *ep_backend_name(ep_backend_t id) {
  return id >= 0 && id < (int)(sizeof backend_names / sizeof *backend_names) ? backend_names[id]
                                                                             : NULL;
}

static const char *backend_name(ep_backend_t id) {
  const char *n = ep_backend_name(id);
  return n ? n : "unknown";
}

const struct ep_backend_ops *ep_backend_find(ep_backend_t id) {
  for (int i = 0; ep_backend_table[i]; i++) {
    const struct ep_backend_ops *o = ep_backend_table[i]();
    if (o && o->id == id) return o;
  }
  return NULL;
}

static ep_status_t backend_from_env(ep_backend_t *id) {
  const char *e = ep_env_str("EP_BACKEND");
  *id = EP_BACKEND_CPU;
  if (!e || !*e) return EP_OK;
  for (int i = EP_BACKEND_CPU; i < (int)(sizeof backend_names / sizeof *backend_names); i++)
    if (!strcasecmp(e, backend_names[i])) {
      *id = (ep_backend_t)i;
      return EP_OK;
    }
  return ep_env_check_value("EP_BACKEND", e); /* names the value and the accepted form */
}

/* AUTO asks about the backend a buffer with AUTO would get (EP_BACKEND, else cpu). */
int ep_backend_available(ep_backend_t id) {
  if (id == EP_BACKEND_AUTO && backend_from_env(&id)) return 0;
  if (!ep_backend_name(id)) {
    ep_err(EP_ERR_INVALID_ARG, "ep_backend_available: %d is not an ep_backend_t", (int)id);
    return 0;
  }
  const struct ep_backend_ops *o = ep_backend_find(id);
  if (!o) {
    ep_err(EP_ERR_UNSUPPORTED, "the %s backend is not built into this library", backend_name(id));
    return 0;
  }
  return o->available() == EP_OK;
}

static ep_status_t resolve_backend(ep_buffer_config_t *c, const struct ep_backend_ops **ops) {
  if (c->backend == EP_BACKEND_AUTO) {
    ep_status_t st = backend_from_env(&c->backend);
    if (st) return st;
  }
  if (c->backend != EP_BACKEND_CPU && c->backend != EP_BACKEND_CUDA)
    return ep_err(EP_ERR_INVALID_ARG, "cfg->backend: %d is not an ep_backend_t", c->backend);
  if (!(*ops = ep_backend_find(c->backend)))
    return ep_err(EP_ERR_UNSUPPORTED,
                  "cfg->backend: the %s backend is not built into this "
                  "library",
                  backend_name(c->backend));
  return EP_OK;
}

ep_status_t ep_buffer_resolve_config(const ep_buffer_config_t *cfg, double group_timeout,
                                     ep_buffer_config_t *c, const struct ep_backend_ops **ops) {
  *c = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
  ep_status_t st = cfg ? ep_struct_load(c, sizeof *c, cfg, "cfg", true) : EP_OK;
  if (!st) st = ep_env_check(); /* an invalid EP_* value fails here, named, never defaulted */
  if (st) return st;
  if (!c->queue_bytes) c->queue_bytes = (size_t)ep_env_int("EP_QUEUE_BYTES");
  if (!c->num_channels) c->num_channels = (int)ep_env_int("EP_CHANNELS");
  if (c->timeout_s <= 0) c->timeout_s = group_timeout;
  if (c->num_channels < 1 || c->num_channels > 64)
    return ep_err(EP_ERR_OUT_OF_RANGE, "cfg->num_channels: %d, must be in [1, 64]",
                  c->num_channels);
  if (c->queue_bytes < 4096 || c->queue_bytes > (1ull << 34))
    return ep_err(EP_ERR_OUT_OF_RANGE, "cfg->queue_bytes: %zu, must be in [4096, 16 GiB]",
                  c->queue_bytes);
  if (c->ll_max_tokens < 0 || c->ll_hidden < 0 || c->ll_num_experts < 0 || c->ll_max_topk < 0)
    return ep_err(EP_ERR_OUT_OF_RANGE, "cfg: low-latency sizes must not be negative");
  if (c->ll_max_tokens && !c->ll_max_topk) c->ll_max_topk = 16;
  return resolve_backend(c, ops);
}

ep_status_t ep_buffer_size_hint(const ep_buffer_config_t *cfg, int nranks, size_t *bytes) {
  if (!bytes) return ep_err(EP_ERR_NULL_ARG, "ep_buffer_size_hint: bytes is NULL");
  if (nranks < 1) return ep_err(EP_ERR_OUT_OF_RANGE, "ep_buffer_size_hint: nranks %d", nranks);
  ep_buffer_config_t c;
  const struct ep_backend_ops *ops;
  ep_status_t st = ep_buffer_resolve_config(cfg, 100.0, &c, &ops);
  if (!st) st = ep_ll_check_config(&c, nranks);
  return st ? st : ops->size_hint(&c, nranks, bytes);
}

/* Every rank must create its buffer with the same sizes: compare them all, name the first
 * field and rank that differ. */
typedef struct {
  int32_t backend, channels, ll_T, ll_H, ll_E, ll_topk;
  uint64_t queue_bytes;
} cfg_key_t;

ep_status_t ep_buffer_agree_config(ep_buffer *b) {
  const ep_buffer_config_t *c = &b->cfg;
  cfg_key_t me = {c->backend,        c->num_channels, c->ll_max_tokens, c->ll_hidden,
                  c->ll_num_experts, c->ll_max_topk,  c->queue_bytes};
  int n = b->group->nranks;
  cfg_key_t *all = calloc((size_t)n, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_status_t st = ep_ctx_allgather(&b->ctx, &me, all, sizeof me);
  static const char *names[] = {"backend",        "num_channels", "ll_max_tokens", "ll_hidden",
                                "ll_num_experts", "ll_max_topk",  "queue_bytes"};
  for (int r = 0; r < n && !st; r++) {
    const int32_t *x = &all[r].backend, *y = &me.backend;
    for (int f = 0; f < 6 && !st; f++)
      if (x[f] != y[f])
        st = ep_err(EP_ERR_MISMATCH,
                    "cfg->%s: this rank has %d, rank %d has %d (buffer configs "
                    "must agree)",
                    names[f], y[f], r, x[f]);
    if (!st && all[r].queue_bytes != me.queue_bytes)
      st = ep_err(EP_ERR_MISMATCH, "cfg->queue_bytes: this rank has %llu, rank %d has %llu",
                  (unsigned long long)me.queue_bytes, r, (unsigned long long)all[r].queue_bytes);
  }
  free(all);
  return st;
}
