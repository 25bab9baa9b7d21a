/* The doctor's rulebook: a line-oriented data file (share/doctor-rules.txt) that maps warning lines
 * to a cause and a fix. The format is documented at the top of that file and in docs/DOCTOR.md;
 * this file only parses it. Rules are data so that a new message needs no rebuild. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "doctor.h"
#include "tk_spawn.h"

/* Where the rulebook is, relative to the directory of the epcomm executable: the same in the
 * build tree and in an installed tree (cmake/install.cmake sets it from the install dirs). */
#ifndef EP_RULES_FROM_BIN
#define EP_RULES_FROM_BIN "../share/epcomm/doctor-rules.txt"
#endif

const char *dr_phase_name(int phase) {
  static const char *names[] = {"init", "run", "exit"};
  return phase >= 0 && phase < DR_NPHASE ? names[phase] : "any";
}

static int readable(const char *path) {
  return path[0] && access(path, R_OK) == 0;
}

int dr_rules_locate(char *buf, size_t len) {
  const char *env = getenv("EP_DOCTOR_RULES");
  char cand[2][4096] = {{0}};
  if (env && *env) snprintf(cand[0], sizeof cand[0], "%s", env);
  char dir[4096];
  if (tk_self_dir(dir, sizeof dir))
    snprintf(cand[1], sizeof cand[1], "%s/%s", dir, EP_RULES_FROM_BIN);
  /* An explicit $EP_DOCTOR_RULES that is wrong is an error, not a reason to use another file. */
  int last = env && *env ? 1 : 2;
  for (int i = 0; i < last; i++)
    if (readable(cand[i])) return snprintf(buf, len, "%s", cand[i]), 0;
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < last; i++)
    if (cand[i][0] && used < len)
      used += (size_t)snprintf(buf + used, len - used, "%s%s", used ? ", " : "", cand[i]);
  return -1;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  char *e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
  return s;
}

/* cause/fix may be split over several lines of the same key: they are joined with a space. */
static int append(char **dst, const char *val) {
  size_t old = *dst ? strlen(*dst) : 0, add = strlen(val);
  char *p = realloc(*dst, old + add + 2);
  if (!p) return -1;
  if (old) p[old++] = ' ';
  memcpy(p + old, val, add + 1);
  *dst = p;
  return 0;
}

static int parse_phase(const char *v) {
  for (int p = 0; p < DR_NPHASE; p++)
    if (!strcmp(v, dr_phase_name(p))) return p;
  return !strcmp(v, "any") ? DR_ANY : -2;
}

static int valid_id(const char *id) {
  if (!*id) return 0;
  for (const char *c = id; *c; c++)
    if (!islower((unsigned char)*c) && !isdigit((unsigned char)*c) && *c != '-') return 0;
  return 1;
}

typedef struct {
  dr_rulebook_t *rb;
  const char *path;
  int line;
  FILE *err;
} parser_t;

static int fail(parser_t *ps, const char *msg, const char *arg) {
  fprintf(ps->err, "%s:%d: %s%s%s\n", ps->path, ps->line, msg, arg ? ": " : "", arg ? arg : "");
  return -1;
}

static int add_pattern(parser_t *ps, dr_rule_t *r, const char *val, int icase) {
  regex_t *re = realloc(r->re, (size_t)(r->nre + 1) * sizeof *re);
  if (!re) return fail(ps, "out of memory", NULL);
  r->re = re;
  int rc = regcomp(&re[r->nre], val, REG_EXTENDED | REG_NOSUB | (icase ? REG_ICASE : 0));
  if (rc) {
    char msg[256];
    regerror(rc, &re[r->nre], msg, sizeof msg);
    return fail(ps, "bad regular expression", msg);
  }
  r->nre++;
  return 0;
}

static int start_rule(parser_t *ps, const char *id) {
  dr_rulebook_t *rb = ps->rb;
  if (!valid_id(id)) return fail(ps, "rule id must be lowercase letters, digits and '-'", id);
  for (int i = 0; i < rb->n; i++)
    if (!strcmp(rb->rules[i].id, id)) return fail(ps, "duplicate rule id", id);
  dr_rule_t *v = realloc(rb->rules, (size_t)(rb->n + 1) * sizeof *v);
  if (!v) return fail(ps, "out of memory", NULL);
  rb->rules = v;
  dr_rule_t *r = &v[rb->n++];
  memset(r, 0, sizeof *r);
  r->phase_hint = DR_ANY;
  r->src_line = ps->line;
  r->id = strdup(id);
  return r->id ? 0 : fail(ps, "out of memory", NULL);
}

static int set_key(parser_t *ps, dr_rule_t *r, const char *key, const char *val) {
  if (!strcmp(key, "match") || !strcmp(key, "imatch"))
    return add_pattern(ps, r, val, key[0] == 'i');
  if (!strcmp(key, "cause")) return append(&r->cause, val);
  if (!strcmp(key, "fix")) return append(&r->fix, val);
  if (!strcmp(key, "tool")) {
    free(r->tool);
    return (r->tool = strdup(val)) ? 0 : -1;
  }
  if (!strcmp(key, "phase")) {
    r->phase_hint = parse_phase(val);
    return r->phase_hint == -2 ? fail(ps, "phase must be init, run, exit or any", val) : 0;
  }
  if (!strcmp(key, "ignore")) {
    r->ignore = !strcmp(val, "yes");
    return r->ignore || !strcmp(val, "no") ? 0 : fail(ps, "ignore must be yes or no", val);
  }
  return fail(ps, "unknown key", key);
}

/* A rule is complete when it can explain and fix what it matches. */
static int check_rule(parser_t *ps, const dr_rule_t *r) {
  const char *missing = !r->nre     ? "match"
                        : !r->cause ? "cause"
                        : !r->fix   ? "fix"
                        : !r->tool  ? "tool"
                                    : NULL;
  if (!missing) return 0;
  fprintf(ps->err, "%s:%d: rule %s has no '%s'\n", ps->path, r->src_line, r->id, missing);
  return -1;
}

static int parse_line(parser_t *ps, char *raw) {
  char *s = trim(raw);
  if (!*s || *s == '#') return 0;
  char *val = s;
  while (*val && !isspace((unsigned char)*val)) val++;
  if (*val) *val++ = '\0';
  val = trim(val);
  if (!*val) return fail(ps, "key without a value", s);
  if (!strcmp(s, "rule")) {
    if (ps->rb->n && check_rule(ps, &ps->rb->rules[ps->rb->n - 1])) return -1;
    return start_rule(ps, val);
  }
  if (!ps->rb->n) return fail(ps, "key before the first 'rule'", s);
  return set_key(ps, &ps->rb->rules[ps->rb->n - 1], s, val);
}

int dr_rules_load(dr_rulebook_t *rb, const char *path, FILE *err) {
  memset(rb, 0, sizeof *rb);
  snprintf(rb->path, sizeof rb->path, "%s", path);
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(err, "epcomm doctor: cannot open rulebook %s: %s\n", path, strerror(errno));
    return -1;
  }
  parser_t ps = {rb, path, 0, err};
  char *buf = NULL;
  size_t cap = 0;
  int rc = 0;
  while (rc == 0 && getline(&buf, &cap, f) >= 0) {
    ps.line++;
    rc = parse_line(&ps, buf);
  }
  free(buf);
  fclose(f);
  if (rc == 0 && rb->n) rc = check_rule(&ps, &rb->rules[rb->n - 1]);
  if (rc == 0 && !rb->n) rc = fail(&ps, "no rules", NULL);
  if (rc) dr_rules_free(rb);
  return rc;
}

int dr_rules_match(const dr_rulebook_t *rb, const char *line) {
  for (int i = 0; i < rb->n; i++)
    for (int k = 0; k < rb->rules[i].nre; k++)
      if (regexec(&rb->rules[i].re[k], line, 0, NULL, 0) == 0) return i;
  return -1;
}

void dr_rules_free(dr_rulebook_t *rb) {
  for (int i = 0; i < rb->n; i++) {
    dr_rule_t *r = &rb->rules[i];
    for (int k = 0; k < r->nre; k++) regfree(&r->re[k]);
    free(r->re);
    free(r->id);
    free(r->tool);
    free(r->cause);
    free(r->fix);
  }
  free(rb->rules);
  rb->rules = NULL;
  rb->n = 0;
}
