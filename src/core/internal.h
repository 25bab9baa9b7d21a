/* Core-private declarations. Backends must not include this file (they use backend.h). */
#ifndef EP_CORE_INTERNAL_H
#define EP_CORE_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "epcomm.h"

#define EP_ERRMSG_MAX 512

/* ---- errors (status.c) */
/* Set the calling thread's last error and return `s`. */
ep_status_t ep_err(ep_status_t s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Set the thread's last error from a preformatted message. */
void ep_err_set_msg(const char *msg);
/* Prefix the thread's last error with "op: arg: " (arg NULL: "op: ") and return `st`: the
 * registry and struct loaders say what is wrong, the entry point says where. */
ep_status_t ep_err_named(ep_status_t st, const char *op, const char *arg);
/* Prefix the thread's last error with "op: " unless it already starts so. */
void ep_err_prefix(const char *op);

/* A per-object last error, written by the thread that failed and read by anyone. */
typedef struct {
  pthread_mutex_t lock;
  char msg[EP_ERRMSG_MAX];
} ep_errbox_t;
void ep_errbox_init(ep_errbox_t *b);
void ep_errbox_fini(ep_errbox_t *b);
void ep_errbox_put(ep_errbox_t *b, const char *msg);
/* Copies into a thread-local buffer so the caller's pointer outlives a concurrent update. */
const char *ep_errbox_get(ep_errbox_t *b);

/* ---- logging (log.c) */
void ep_log_raw(int level, int rank, const char *phase, const char *fmt, va_list ap);

/* ---- environment registry (env.c) */
const char *ep_env_str(const char *name); /* NULL if unset; name must be registered */
/* A number from the registry: its set value, else its row's default_value (the one place a
 * default is written); ep_env_long's `unset` only for rows whose default is derived
 * (default_value ""). */
long ep_env_int(const char *name);
double ep_env_real(const char *name);
long ep_env_long(const char *name, long unset);
void ep_env_check_unknown(void); /* warn once about unknown EP_* (typos) */

/* ---- object registry (registry.c): opaque ids with generations, so that a stale or doubled
 * handle is detected instead of dereferenced. */
enum ep_obj_kind {
  EP_OBJ_GROUP = 1,
  EP_OBJ_BUFFER = 2,
  EP_OBJ_HANDLE = 3,
  EP_OBJ_LL_HANDLE = 4,
  EP_OBJ_MEM = 5 /* a registration of caller memory (memreg.c) */
};
typedef uint64_t ep_id_t;
ep_status_t ep_reg_add(enum ep_obj_kind kind, void *obj, int rank, ep_id_t *id);
/* Look up and pin (in-flight count + 1). EP_ERR_DESTROYED / EP_ERR_INVALID_ARG / EP_ERR_BUSY
 * (when `exclusive` and another call is in flight). */
ep_status_t ep_reg_acquire(ep_id_t id, enum ep_obj_kind kind, bool exclusive, void **obj);
void ep_reg_release(ep_id_t id);
/* Remove if nothing is in flight: EP_ERR_BUSY otherwise, EP_ERR_DESTROYED if already gone. */
ep_status_t ep_reg_remove(ep_id_t id, enum ep_obj_kind kind, void **obj);
/* Number of live objects of a kind (for leak reports). */
int ep_reg_count(enum ep_obj_kind kind);
/* The id of this process's only live object of a kind; 0 when there are none or several. */
ep_id_t ep_reg_sole(enum ep_obj_kind kind);
/* Per-process counter of groups created from the environment (rendezvous name suffix). */
unsigned ep_reg_next_env_group(void);

static inline void *ep_id_to_ptr(ep_id_t id) {
  return (void *)(uintptr_t)id;
}
static inline ep_id_t ep_ptr_to_id(const void *p) {
  return (ep_id_t)(uintptr_t)p;
}

/* ---- versioned structs: `dst` holds defaults of the full current size; an older caller's
 * smaller struct overwrites only the fields it has. */
ep_status_t ep_struct_load(void *dst, size_t full, const void *src, const char *argname,
                           bool has_magic);
/* The args (or out) struct of a call: NULL, or a bad size, fails naming the call and the
 * argument ("ep_dispatch: out"). */
ep_status_t ep_args_load(void *dst, size_t full, const void *args, const char *op,
                         const char *argname);
/* The same for a struct that grew since API 0.2: `oldest` is its 0.2 size (offsetof the first
 * field added since), also accepted; the newer fields then stay zero. */
ep_status_t ep_args_load_since(void *dst, size_t full, size_t oldest, const void *args,
                               const char *op, const char *argname);

#endif
