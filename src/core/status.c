/* Status table, version, and last-error messages (per thread and per object). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The version string comes from the header's numbers, the only place the version is written. */
#define EP_STR_(x) #x
#define EP_XSTR_(x) EP_STR_(x)

int ep_version(void) {
  return EP_VERSION_CODE;
}
const char *ep_version_string(void) {
  return EP_XSTR_(EP_VERSION_MAJOR) "." EP_XSTR_(EP_VERSION_MINOR) "." EP_XSTR_(EP_VERSION_PATCH);
}

static const struct {
  const char *name, *msg;
} status_table[] = {
#define EP_STATUS_ROW_(code, value, msg) [value] = {#code, msg},
    EP_STATUS_MAP(EP_STATUS_ROW_)
#undef EP_STATUS_ROW_
};

static bool status_known(ep_status_t s) {
  return (int)s >= 0 && (int)s < EP_STATUS_COUNT_ && status_table[s].name;
}

const char *ep_status_name(ep_status_t s) {
  return status_known(s) ? status_table[s].name : "EP_ERR_UNKNOWN";
}

const char *ep_status_string(ep_status_t s) {
  return status_known(s) ? status_table[s].msg : "unknown status code";
}

/* The per-thread message: owned by the thread, so no locking. */
static _Thread_local char tls_error[EP_ERRMSG_MAX];

const char *ep_last_error(void) {
  return tls_error;
}

void ep_err_set_msg(const char *msg) {
  snprintf(tls_error, sizeof tls_error, "%s", msg);
}
const char *ep_ctx_last_error(void) {
  return tls_error;
}

ep_status_t ep_err_named(ep_status_t st, const char *op, const char *arg) {
  char msg[EP_ERRMSG_MAX];
  if (arg)
    snprintf(msg, sizeof msg, "%s: %s: %s", op, arg, tls_error);
  else
    snprintf(msg, sizeof msg, "%s: %s", op, tls_error);
  ep_err_set_msg(msg);
  return st;
}

void ep_err_prefix(const char *op) {
  size_t n = strlen(op);
  /* Said once: a message that already starts with the call ("op: ...") keeps its one prefix. */
  if (!strncmp(tls_error, op, n) && tls_error[n] == ':') return;
  char msg[EP_ERRMSG_MAX];
  snprintf(msg, sizeof msg, "%s: %s", op, tls_error);
  ep_err_set_msg(msg);
}
void ep_ctx_restore_error(const char *msg) {
  ep_err_set_msg(msg);
}

ep_status_t ep_err(ep_status_t s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tls_error, sizeof tls_error, fmt, ap);
  va_end(ap);
  return s;
}

void ep_errbox_init(ep_errbox_t *b) {
  pthread_mutex_init(&b->lock, NULL);
  b->msg[0] = '\0';
}

void ep_errbox_fini(ep_errbox_t *b) {
  pthread_mutex_destroy(&b->lock);
}

void ep_errbox_put(ep_errbox_t *b, const char *msg) {
  pthread_mutex_lock(&b->lock);
  snprintf(b->msg, sizeof b->msg, "%s", msg);
  pthread_mutex_unlock(&b->lock);
}

static _Thread_local char tls_copy[EP_ERRMSG_MAX];

const char *ep_errbox_get(ep_errbox_t *b) {
  pthread_mutex_lock(&b->lock);
  memcpy(tls_copy, b->msg, sizeof tls_copy);
  pthread_mutex_unlock(&b->lock);
  return tls_copy;
}

ep_status_t ep_struct_load(void *dst, size_t full, const void *src, const char *argname,
                           bool has_magic) {
  const struct {
    size_t size;
    uint32_t magic;
  } *head = src;
  size_t min = has_magic ? sizeof *head : sizeof(size_t);
  /* A size that is not a multiple of 8 would cut a pointer in half: never a real struct size. */
  if (head->size < min || head->size > full || head->size % sizeof(void *) != 0)
    return ep_err(EP_ERR_CONFIG,
                  "%s: size field is %zu, this library accepts %zu..%zu (set it to "
                  "sizeof the struct, or use the _INIT macro)",
                  argname, head->size, min, full);
  if (has_magic && head->magic != EP_CONFIG_MAGIC)
    return ep_err(EP_ERR_CONFIG,
                  "%s: magic is 0x%x, expected 0x%x (initialise it with the _INIT "
                  "macro)",
                  argname, head->magic, EP_CONFIG_MAGIC);
  /* An older, smaller struct: fields it does not have keep the defaults already in dst. */
  memcpy(dst, src, head->size);
  ((struct { size_t size; } *)dst)->size = full;
  return EP_OK;
}

ep_status_t ep_args_load_since(void *dst, size_t full, size_t oldest, const void *args,
                               const char *op, const char *argname) {
  if (!args) return ep_err(EP_ERR_NULL_ARG, "%s: %s is NULL", op, argname);
  /* An args or out struct is read and written whole: a size this library never had would
   * leave fields the call relies on (out->handle, args->cached) outside the caller's memory.
   * A struct that grew is accepted at each size it has had (`oldest` .. `full`, as released);
   * fields past an older caller's size keep the defaults already in dst. */
  size_t size = *(const size_t *)args;
  if (size != full && size != oldest) {
    if (oldest == full)
      return ep_err(EP_ERR_CONFIG,
                    "%s: %s: size field is %zu, this library needs %zu (set it "
                    "with the struct's _INIT macro)",
                    op, argname, size, full);
    return ep_err(EP_ERR_CONFIG,
                  "%s: %s: size field is %zu, this library accepts %zu (API 0.2) "
                  "or %zu (set it with the struct's _INIT macro)",
                  op, argname, size, oldest, full);
  }
  ep_status_t st = ep_struct_load(dst, full, args, argname, false);
  return st ? ep_err_named(st, op, NULL) : EP_OK;
}

ep_status_t ep_args_load(void *dst, size_t full, const void *args, const char *op,
                         const char *argname) {
  return ep_args_load_since(dst, full, full, args, op, argname);
}
