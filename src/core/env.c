/* The one registry of environment variables the library reads: the rows every module brings
 * (src/core/env_core.c, src/cpu/cpu_env.c, src/cuda/cuda_env.c), listed by the build in
 * ep_env_modules (src/core/env_modules.c.in). `epcomm info` and `epcomm doctor env` read it
 * through the public ep_env_* calls. Group and buffer creation check every set variable against
 * its row, so an invalid value fails the call that would have read it instead of being replaced
 * by the default; a set EP_* name that is in no row is reported once at warn level (a typo). */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

extern char **environ;

/* NULL-terminated; generated from the build's list of modules. */
extern const ep_env_module_t *const ep_env_modules[];

/* ------------------------------------------------------------------ rows */

static const ep_env_row_t *row_at(int i) {
  for (const ep_env_module_t *const *m = ep_env_modules; *m && i >= 0; i -= (*m)->count, m++)
    if (i < (*m)->count) return &(*m)->rows[i];
  return NULL;
}

static const ep_env_row_t *row_find(const char *name, size_t len) {
  for (const ep_env_module_t *const *m = ep_env_modules; *m; m++)
    for (int i = 0; i < (*m)->count; i++) {
      const char *n = (*m)->rows[i].pub.name;
      if (strlen(n) == len && !strncmp(n, name, len)) return &(*m)->rows[i];
    }
  return NULL;
}

int ep_env_var_count(void) {
  int n = 0;
  for (const ep_env_module_t *const *m = ep_env_modules; *m; m++) n += (*m)->count;
  return n;
}

const ep_env_var_t *ep_env_var(int index) {
  const ep_env_row_t *r = index >= 0 ? row_at(index) : NULL;
  return r ? &r->pub : NULL;
}

const ep_env_var_t *ep_env_var_find(const char *name) {
  const ep_env_row_t *r = name ? row_find(name, strlen(name)) : NULL;
  return r ? &r->pub : NULL;
}

/* ------------------------------------------------------------------ values */

/* A decimal integer, the whole string. */
static bool parse_int(const char *s, long long *v) {
  char *end;
  errno = 0;
  *v = strtoll(s, &end, 10);
  return end != s && *end == '\0' && errno == 0 && !isspace((unsigned char)*s);
}

/* N[K|M|G]: a non-negative decimal integer of bytes, times 2^10, 2^20 or 2^30 with a suffix
 * (either case). `epcomm doctor env --config-bytes` takes the same form. */
static bool parse_size(const char *s, long long *v) {
  if (!isdigit((unsigned char)*s)) return false;
  char *end;
  errno = 0;
  unsigned long long n = strtoull(s, &end, 10);
  int shift = 0;
  if (*end) {
    const char *units = "KMG", *u = strchr(units, toupper((unsigned char)*end));
    if (!u || end[1]) return false;
    shift = 10 * (int)(u - units + 1);
  }
  if (errno || n > (unsigned long long)(INT64_MAX >> shift)) return false;
  *v = (long long)(n << shift);
  return true;
}

static bool parse_float(const char *s, double *v) {
  char *end;
  errno = 0;
  *v = strtod(s, &end);
  return end != s && *end == '\0' && errno == 0 && isfinite(*v) && !isspace((unsigned char)*s);
}

static bool choice_of(const char *choices, const char *s) {
  size_t n = strlen(s);
  for (const char *c = choices; *c;) {
    size_t k = strcspn(c, "|");
    if (k == n && !strncasecmp(c, s, n)) return true;
    c += k + (c[k] == '|');
  }
  return false;
}

/* NULL when `s` is a valid value of the row, else why not. */
static const char *judge(const ep_env_row_t *r, const char *s) {
  long long v, lo, hi;
  double d;
  switch (r->kind) {
    case EP_ENV_INT:
      if (!parse_int(s, &v)) return "not an integer";
      parse_int(r->lo, &lo), parse_int(r->hi, &hi);
      return v < lo || v > hi ? "out of range" : NULL;
    case EP_ENV_SIZE:
      if (!parse_size(s, &v)) return "not a size";
      parse_size(r->lo, &lo), parse_size(r->hi, &hi);
      return v < lo || v > hi ? "out of range" : NULL;
    case EP_ENV_FLOAT:
      if (!parse_float(s, &d)) return "not a number";
      return d <= strtod(r->lo, NULL) || d > strtod(r->hi, NULL) ? "out of range" : NULL;
    case EP_ENV_ENUM:
      return choice_of(r->choices, s) ? NULL : "not a known value";
    case EP_ENV_TEXT:
      return NULL;
  }
  return "unknown kind of variable";
}

static ep_status_t check_row(const ep_env_row_t *r, const char *value) {
  const char *why = *value ? judge(r, value) : NULL;
  if (!why) return EP_OK;
  return ep_err(EP_ERR_INVALID_ARG, "environment variable %s=%s: %s; accepted: %s", r->pub.name,
                value, why, r->pub.accepted);
}

ep_status_t ep_env_check_value(const char *name, const char *value) {
  if (!name || !value)
    return ep_err(EP_ERR_NULL_ARG, "ep_env_check_value: %s is NULL", name ? "value" : "name");
  const ep_env_row_t *r = row_find(name, strlen(name));
  if (!r)
    return ep_err(EP_ERR_INVALID_ARG,
                  "ep_env_check_value: %s is not a variable epcomm reads "
                  "(`epcomm info` lists them)",
                  name);
  return check_row(r, value);
}

ep_status_t ep_env_check(void) {
  for (int i = 0, n = ep_env_var_count(); i < n; i++) {
    const ep_env_row_t *r = row_at(i);
    const char *v = getenv(r->pub.name);
    ep_status_t st = v ? check_row(r, v) : EP_OK;
    if (st) return st;
  }
  return EP_OK;
}

/* ------------------------------------------------------------------ the library's own reads */

const char *ep_env_str(const char *name) {
  /* Reading an unregistered name is a programming error inside epcomm: keep the registry whole. */
  if (!row_find(name, strlen(name))) return NULL;
  return getenv(name);
}

const char *ep_env_text(const char *name) {
  const char *s = ep_env_str(name);
  return s && *s ? s : NULL;
}

/* The value of a set, valid variable; NULL otherwise (creation has rejected invalid ones). */
static const char *valid_value(const char *name, const ep_env_row_t **row) {
  *row = row_find(name, strlen(name));
  const char *s = *row ? getenv(name) : NULL;
  return s && *s && !judge(*row, s) ? s : NULL;
}

static bool number_of(const ep_env_row_t *r, const char *s, long long *v) {
  return r->kind == EP_ENV_SIZE ? parse_size(s, v) : parse_int(s, v);
}

/* A set, valid value as a number, else the row's default (its default_value, the one place a
 * default is written), else `unset`: only for rows whose default is derived (default_value "").
 * Creation has rejected invalid values, so "valid" only matters for reads outside it. */
static double env_double(const char *name, double unset) {
  const ep_env_row_t *r;
  const char *s = valid_value(name, &r);
  double d;
  if (s) return strtod(s, NULL);
  return r && *r->pub.default_value && parse_float(r->pub.default_value, &d) ? d : unset;
}

long ep_env_long(const char *name, long unset) {
  const ep_env_row_t *r;
  const char *s = valid_value(name, &r);
  long long v;
  if (s && number_of(r, s, &v)) return (long)v;
  return r && *r->pub.default_value && number_of(r, r->pub.default_value, &v) ? (long)v : unset;
}

long ep_env_int(const char *name) {
  return ep_env_long(name, 0);
}

double ep_env_real(const char *name) {
  return env_double(name, 0.0);
}

/* Called once from the logger's one-time initialisation. */
void ep_env_check_unknown(void) {
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "EP_", 3) != 0) continue;
    const char *eq = strchr(*e, '=');
    size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
    if (!row_find(*e, len))
      ep_log_at(EP_LOG_WARN, -1, "init",
                "unknown variable %.*s is set; `epcomm info` lists the "
                "EP_* variables epcomm reads",
                (int)len, *e);
    else if (ep_log_enabled(EP_LOG_INFO))
      ep_log_at(EP_LOG_INFO, -1, "init", "%.*s set by environment to %s", (int)len, *e,
                !eq                                             ? ""
                : strcmp(row_find(*e, len)->pub.type, "secret") ? eq + 1
                                                                : "(not shown)");
  }
}
