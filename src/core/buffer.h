/* The buffer and handle objects (core-private). */
#ifndef EP_CORE_BUFFER_H
#define EP_CORE_BUFFER_H

#include "group.h"

struct ep_ctx {
  struct ep_buffer_s *buf;
};

struct ep_buffer_s {
  uint32_t magic;
  ep_id_t id;
  ep_group *group;
  const struct ep_backend_ops *ops;
  void *state; /* the backend's */
  ep_buffer_config_t cfg;
  double timeout_s;
  bool broken;         /* a collective failed mid-way: only destroy/release remain */
  int ll_live;         /* low-latency handles alive (at most 2) */
  uint32_t dispatches; /* ep_dispatch calls made on the buffer: a new handle's number (wraps:
                          only equality is compared) */
  size_t bytes;        /* the backend's size hint for this buffer */
  struct ep_ctx ctx;
  ep_errbox_t err;
  ep_id_t mems[EP_MAX_MEM_REGS]; /* registrations by slot (memreg.c); 0: free */
};
typedef struct ep_buffer_s ep_buffer;

struct ep_handle_s {
  uint32_t magic;
  ep_id_t id;
  ep_id_t buffer_id; /* the buffer it belongs to; checked on every use */
  ep_handle_info_t info;
};
typedef struct ep_handle_s ep_handle;

#define EP_BUFFER_MAGIC 0x45504246u
#define EP_HANDLE_MAGIC 0x45504844u

/* Pin a buffer for one call (exclusive) and refuse broken ones. Release with buffer_put. */
ep_status_t ep_buffer_get(ep_buffer_t buffer, const char *op, ep_buffer **b);
void ep_buffer_put(ep_buffer *b);
/* After a backend call: record the failure on the buffer, mark it broken when the collective
 * state may be inconsistent, and return `st`. */
ep_status_t ep_buffer_after(ep_buffer *b, ep_status_t st, const char *op);
/* Defaults, environment and range checks of a buffer config (local). */
ep_status_t ep_buffer_resolve_config(const ep_buffer_config_t *cfg, double group_timeout,
                                     ep_buffer_config_t *c, const struct ep_backend_ops **ops);
/* Local: the low-latency sizes of a resolved config are usable with `nranks` ranks (ops_ll.c). */
ep_status_t ep_ll_check_config(const ep_buffer_config_t *c, int nranks);
/* The backend built with this id, or NULL. */
const struct ep_backend_ops *ep_backend_find(ep_backend_t id);
/* Collective: every rank's config must be the same. */
ep_status_t ep_buffer_agree_config(ep_buffer *b);
/* Buffer teardown: the registrations' ids go (the backend undoes its part in its destroy). */
void ep_mem_drop_all(ep_buffer *b);
/* Resolve a handle of this buffer. */
ep_status_t ep_handle_get(ep_buffer *b, const void *h, const char *op, const char *arg,
                          enum ep_handle_kind kind, ep_handle **out);
void ep_handle_put(ep_handle *h);
/* Wrap filled info into a new handle object (frees info.priv on failure); `out` points to an
 * ep_handle_t or an ep_ll_handle_t, as info->kind says. */
ep_status_t ep_handle_new(ep_buffer *b, ep_handle_info_t *info, void *out);

#endif
