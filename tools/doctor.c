/* `epcomm doctor`: the seed's three steps as a command.
 *   1. env       check the environment (GPUs, links, MPS, /dev/shm, limits, variables, libraries)
 *   2. run       run a command, capture its output, sort every warning by phase and cause
 *   3. verify    run it again after the fix: warnings gone? same status? same time?
 * plus `classify FILE` (step 2 on a log captured earlier) and `rules` (the rulebook in use).
 * This file parses arguments and writes the reports; the work is in doctor_{env,run,rules}.c. */
#include "doctor.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "tk_json.h"

static int usage(FILE *f) {
  fprintf(
      f,
      "usage: epcomm doctor env [--json] [--config-bytes N[K|M|G]]\n"
      "       epcomm doctor run [--json] [--log FILE] -- COMMAND [ARGS...]\n"
      "       epcomm doctor verify [--json] [--baseline RUN.json] [--log FILE] -- COMMAND...\n"
      "       epcomm doctor classify [--json | --lines] LOGFILE   (a log captured earlier; - "
      "is stdin)\n"
      "       epcomm doctor rules                                 (the rulebook in use)\n"
      "run and verify exit with the command's status (verify: 0 when clean, 1 otherwise).\n"
      "The rulebook is $EP_DOCTOR_RULES, else ../share/epcomm/doctor-rules.txt from the epcomm\n"
      "binary. See docs/DOCTOR.md.\n");
  return f == stdout ? 0 : 2;
}

/* ---- groups: one per (cause, phase), unknown lines per (masked text, phase) ------------------ */

typedef struct {
  int rule, phase;
  char *key;    /* masked text for unknown lines, NULL for known causes */
  size_t count; /* lines in the group */
  size_t first; /* index of its first line */
} group_t;

typedef struct {
  group_t *v;
  size_t n;
  size_t *slot; /* open-addressing hash of group indices + 1; logs can have 10^5 lines */
  size_t nslot;
} groups_t;

static size_t group_hash(int rule, int phase, const char *key) {
  size_t h = 1469598103934665603u ^ (size_t)(rule + 7) * 31u ^ (size_t)phase;
  for (; key && *key; key++) h = (h ^ (unsigned char)*key) * 1099511628211u;
  return h;
}

static group_t *group_find(groups_t *g, int rule, int phase, const char *key) {
  size_t i = group_hash(rule, phase, key) % g->nslot;
  for (; g->slot[i]; i = (i + 1) % g->nslot) {
    group_t *x = &g->v[g->slot[i] - 1];
    if (x->rule == rule && x->phase == phase && (!key || !strcmp(x->key, key))) return x;
  }
  g->slot[i] = ++g->n;
  g->v[g->n - 1] = (group_t){rule, phase, key ? strdup(key) : NULL, 0, 0};
  return &g->v[g->n - 1];
}

static int group_order(const void *a, const void *b) {
  static const int rank[DR_NPHASE] = {2, 1, 0}; /* exit, run, init: the seed's question first */
  const group_t *x = a, *y = b;
  if (x->phase != y->phase) return rank[x->phase] - rank[y->phase];
  if ((x->rule < 0) != (y->rule < 0)) return x->rule < 0 ? 1 : -1;
  return x->first < y->first ? -1 : x->first > y->first;
}

static void groups_build(groups_t *g, const dr_log_t *log) {
  g->n = 0;
  g->nslot = 2 * log->n + 1;
  g->v = calloc(log->n + 1, sizeof *g->v);
  g->slot = calloc(g->nslot, sizeof *g->slot);
  if (!g->v || !g->slot) return;
  for (size_t i = 0; i < log->n; i++) {
    const dr_line_t *l = &log->v[i];
    if (!l->warn) continue;
    char mask[512];
    if (l->rule < 0) dr_mask(l->text, mask, sizeof mask);
    group_t *x = group_find(g, l->rule, l->phase, l->rule < 0 ? mask : NULL);
    if (x->count++ == 0) x->first = i;
  }
  qsort(g->v, g->n, sizeof *g->v, group_order);
}

static void groups_free(groups_t *g) {
  for (size_t i = 0; g->v && i < g->n; i++) free(g->v[i].key);
  free(g->v);
  free(g->slot);
}

/* ---- the run/classify report ----------------------------------------------------------------- */

typedef struct {
  char **argv;      /* the command, or NULL for classify */
  const char *file; /* classify's input */
  const dr_rulebook_t *rb;
  const dr_log_t *log;
} report_t;

static void print_head(FILE *f, const report_t *r) {
  const dr_log_t *log = r->log;
  if (r->argv) {
    fputs("\nepcomm doctor run: ", f), dr_print_command(f, r->argv);
    if (log->signal)
      fprintf(f, "\n  killed by signal %d", log->signal);
    else
      fprintf(f, "\n  exited with status %d", log->status);
    fprintf(f, " after %.2f s\n", log->wall_s);
  } else {
    fprintf(f, "\nepcomm doctor classify: %s, %zu lines\n", r->file, log->n);
  }
  if (log->last >= 0) {
    const dr_line_t *e = &log->v[log->last];
    fprintf(f, "  work ended at line %ld", log->last + 1);
    if (e->t >= 0) fprintf(f, " (t=%.2f s)", e->t);
    fprintf(f, ", the %s: %.100s\n", log->end_kind, e->text);
  } else {
    fprintf(f,
            "  no work line found (no test result, epcomm operation or stdout line): every "
            "warning counts as run\n");
  }
  if (log->ranks_phased)
    fprintf(f, "  lines tagged with a rank are phased against that rank's own work (%d ranks)\n",
            log->ranks_phased);
  fprintf(f, "  warnings: %zu init, %zu run, %zu exit", log->count[DR_INIT], log->count[DR_RUN],
          log->count[DR_EXIT]);
  if (log->ignored) fprintf(f, " (%zu known-benign lines not counted)", log->ignored);
  fputs("\n\n", f);
}

static void print_group(FILE *f, const report_t *r, const group_t *g) {
  const dr_line_t *l = &r->log->v[g->first];
  if (g->rule >= 0) {
    const dr_rule_t *rule = &r->rb->rules[g->rule];
    fprintf(f, "  %-4s %5zux  %s [%s]", dr_phase_name(g->phase), g->count, rule->id, rule->tool);
    if (rule->phase_hint != DR_ANY && rule->phase_hint != g->phase)
      fprintf(f, " (usually at %s)", dr_phase_name(rule->phase_hint));
    fprintf(f, "\n             cause: %s\n", rule->cause);
  } else {
    fprintf(f, "  %-4s %5zux  unknown (no rule): %.100s\n", dr_phase_name(g->phase), g->count,
            g->key);
  }
  fprintf(f, "             first: line %zu", g->first + 1);
  if (l->t >= 0) fprintf(f, ", t=%.2f s", l->t);
  fprintf(f, ": %.160s\n", l->text);
  if (g->rule >= 0) fprintf(f, "             fix:   %s\n", r->rb->rules[g->rule].fix);
  fputc('\n', f);
}

static void print_command_or_placeholder(FILE *f, char **argv) {
  if (argv)
    dr_print_command(f, argv);
  else
    fputs("COMMAND", f);
  fputc('\n', f);
}

static void print_verdict(FILE *f, const report_t *r) {
  const size_t *c = r->log->count;
  if (!c[DR_INIT] && !c[DR_RUN] && !c[DR_EXIT]) {
    fprintf(f, "verdict: no warnings.\n");
  } else if (c[DR_RUN]) {
    fprintf(f,
            "verdict: %zu warning(s) while the work ran: they may affect results; start with the "
            "first one above.\n",
            c[DR_RUN]);
  } else if (c[DR_EXIT] && r->log->status != 0) {
    fprintf(f,
            "verdict: the warnings come after the work ended, but the command failed (status %d):"
            "\n         read its own output first; then apply the fixes above and check with: "
            "epcomm doctor verify -- ",
            r->log->status);
    print_command_or_placeholder(f, r->argv);
  } else if (c[DR_EXIT]) {
    fprintf(f,
            "verdict: the warnings come after the work ended: the results stand, the teardown does "
            "not.\n         Apply the fixes above, then check with: epcomm doctor verify -- ");
    print_command_or_placeholder(f, r->argv);
  } else {
    fprintf(f, "verdict: warnings only at start-up: see `epcomm doctor env`.\n");
  }
}

static void report_human(FILE *f, const report_t *r) {
  groups_t g;
  groups_build(&g, r->log);
  print_head(f, r);
  for (size_t i = 0; i < g.n; i++) print_group(f, r, &g.v[i]);
  print_verdict(f, r);
  groups_free(&g);
}

static void json_line_ref(FILE *f, const dr_log_t *log, size_t i) {
  const dr_line_t *l = &log->v[i];
  fprintf(f, "{\"line\": %zu, ", i + 1);
  if (l->rank >= 0) fprintf(f, "\"rank\": %d, ", l->rank);
  fputs("\"t\": ", f);
  if (l->t >= 0)
    fprintf(f, "%.6f", l->t);
  else
    fputs("null", f);
  fprintf(f, ", \"stream\": \"%s\", \"text\": ",
          l->stream == 'o'   ? "out"
          : l->stream == 'e' ? "err"
                             : "?");
  tk_json_str(f, l->text);
  fputc('}', f);
}

static void json_group(FILE *f, const report_t *r, const group_t *g) {
  fprintf(f, "    {\"phase\": \"%s\", \"count\": %zu, ", dr_phase_name(g->phase), g->count);
  if (g->rule >= 0) {
    const dr_rule_t *rule = &r->rb->rules[g->rule];
    fputs("\"cause_id\": ", f), tk_json_str(f, rule->id);
    fputs(", \"tool\": ", f), tk_json_str(f, rule->tool);
    fprintf(f, ", \"phase_hint\": \"%s\", \"cause\": ", dr_phase_name(rule->phase_hint));
    tk_json_str(f, rule->cause);
    fputs(", \"fix\": ", f), tk_json_str(f, rule->fix);
  } else {
    fputs("\"cause_id\": \"unknown\", \"pattern\": ", f), tk_json_str(f, g->key);
  }
  fputs(", \"first\": ", f), json_line_ref(f, r->log, g->first), fputc('}', f);
}

static void json_lines(FILE *f, const report_t *r) {
  const dr_log_t *log = r->log;
  int comma = 0;
  fputs("  \"lines\": [", f);
  for (size_t i = 0; i < log->n; i++) {
    const dr_line_t *l = &log->v[i];
    if (!l->warn) continue;
    fprintf(f, "%s\n    {\"line\": %zu, \"phase\": \"%s\", \"cause_id\": ", comma++ ? "," : "",
            i + 1, dr_phase_name(l->phase));
    tk_json_str(f, l->rule >= 0 ? r->rb->rules[l->rule].id : "unknown");
    fputs(", \"at\": ", f), json_line_ref(f, log, i), fputc('}', f);
  }
  fputs("\n  ]\n", f);
}

/* The five counters come first: verify --baseline reads them back (dr_read_baseline). */
static void report_json(FILE *f, const report_t *r) {
  const dr_log_t *log = r->log;
  fprintf(f, "{\n  \"exit_status\": %d,\n  \"wall_s\": %.6f,\n", log->status, log->wall_s);
  fprintf(f, "  \"warnings_init\": %zu,\n  \"warnings_run\": %zu,\n  \"warnings_exit\": %zu,\n",
          log->count[DR_INIT], log->count[DR_RUN], log->count[DR_EXIT]);
  fprintf(f, "  \"signal\": %d,\n  \"ignored\": %zu,\n  \"command\": ", log->signal, log->ignored);
  if (r->argv) {
    fputc('[', f);
    for (char **a = r->argv; *a; a++) fputs(a == r->argv ? "" : ", ", f), tk_json_str(f, *a);
    fputc(']', f);
  } else {
    fputs("null, \"file\": ", f), tk_json_str(f, r->file);
  }
  fputs(",\n  \"rulebook\": ", f), tk_json_str(f, r->rb->path);
  fputs(",\n  \"end_of_work\": ", f);
  if (log->last >= 0) {
    fprintf(f, "{\"kind\": \"%s\", \"first_work_line\": %ld, \"at\": ", log->end_kind,
            log->first + 1);
    json_line_ref(f, log, (size_t)log->last), fputc('}', f);
  } else {
    fputs("null", f);
  }
  groups_t g;
  groups_build(&g, log);
  fputs(",\n  \"groups\": [", f);
  for (size_t i = 0; i < g.n; i++) fputs(i ? ",\n" : "\n", f), json_group(f, r, &g.v[i]);
  fputs("\n  ],\n", f);
  groups_free(&g);
  json_lines(f, r);
  fputs("}\n", f);
}

/* One line per warning line, for tests and scripts: line, phase, cause id, fix, text. */
static void report_lines(FILE *f, const report_t *r) {
  const dr_log_t *log = r->log;
  fprintf(f, "end\t%ld\t%s\n", log->last + 1, log->end_kind);
  for (size_t i = 0; i < log->n; i++) {
    const dr_line_t *l = &log->v[i];
    if (!l->warn) continue;
    const dr_rule_t *rule = l->rule >= 0 ? &r->rb->rules[l->rule] : NULL;
    fprintf(f, "%zu\t%s\t%s\t%s\t%s\n", i + 1, dr_phase_name(l->phase), rule ? rule->id : "unknown",
            rule ? rule->fix : "-", l->text);
  }
}

/* ---- options --------------------------------------------------------------------------------- */

typedef struct {
  int json, lines;
  const char *log, *baseline;
  unsigned long long config_bytes;
  char **cmd; /* after "--" */
  const char *file;
} opts_t;

/* N[K|M|G]: the form the library takes for its size variables (EP_QUEUE_BYTES): a decimal
 * integer, optionally times 2^10, 2^20 or 2^30, suffix in either case. */
static int parse_bytes(const char *s, unsigned long long *out) {
  char *end;
  if (*s < '0' || *s > '9') return -1;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  const char *units = "KMG", *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
  if (errno || (*end && (!u || end[1]))) return -1;
  int shift = u ? 10 * (int)(u - units + 1) : 0;
  if (v > (~0ull >> shift)) return -1;
  *out = v << shift;
  return 0;
}

static int parse_opts(int argc, char **argv, opts_t *o) {
  memset(o, 0, sizeof *o);
  o->config_bytes = 64ull << 20;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *next = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--")) {
      o->cmd = &argv[i + 1];
      return argv[i + 1] ? 0 : -1;
    } else if (!strcmp(a, "--json")) {
      o->json = 1;
    } else if (!strcmp(a, "--lines")) {
      o->lines = 1;
    } else if ((!strcmp(a, "--log") || !strcmp(a, "--baseline")) && next) {
      *(a[2] == 'l' ? &o->log : &o->baseline) = next, i++;
    } else if (!strcmp(a, "--config-bytes") && next) {
      if (parse_bytes(next, &o->config_bytes))
        return fprintf(stderr,
                       "epcomm doctor: --config-bytes '%s': not N[K|M|G] bytes (a whole "
                       "number, K/M/G = 2^10/2^20/2^30)\n",
                       next),
               -1;
      i++;
    } else if (a[0] != '-' || !strcmp(a, "-")) {
      if (o->file) return -1;
      o->file = a;
    } else {
      return -1;
    }
  }
  return 0;
}

static int load_rules(dr_rulebook_t *rb) {
  char path[8192];
  if (dr_rules_locate(path, sizeof path)) {
    fprintf(stderr, "epcomm doctor: no rulebook found (tried: %s); set EP_DOCTOR_RULES\n", path);
    return -1;
  }
  return dr_rules_load(rb, path, stderr);
}

/* ---- subcommands ----------------------------------------------------------------------------- */

static void env_row(const dr_check_t *k, int w) {
  printf("%-*s %-6s %s\n", w, k->check, dr_status_name(k->status), k->detail);
  if (k->fix[0]) printf("%*sfix: %s\n", w + 8, "", k->fix);
}

static void env_json(const dr_check_t *k, int first) {
  fputs(first ? "\n {\"check\": " : ",\n {\"check\": ", stdout), tk_json_str(stdout, k->check);
  printf(", \"status\": \"%s\", \"detail\": ", dr_status_name(k->status));
  tk_json_str(stdout, k->detail), fputs(", \"fix\": ", stdout), tk_json_str(stdout, k->fix);
  fputc('}', stdout);
}

/* Exit status 1 when a check FAILs: scripts can gate a job on `epcomm doctor env`. */
static int cmd_env(const opts_t *o) {
  dr_checks_t c = {0};
  dr_env_run(&c, o->config_bytes);
  int count[4] = {0}, w = 5;
  for (size_t i = 0; i < c.n; i++) {
    int len = (int)strlen(c.v[i].check);
    w = len > w ? len : w;
    count[c.v[i].status]++;
  }
  if (o->json)
    fputs("[", stdout);
  else
    printf("%-*s %-6s %s\n", w, "CHECK", "STATUS", "DETAIL");
  for (size_t i = 0; i < c.n; i++) o->json ? env_json(&c.v[i], i == 0) : env_row(&c.v[i], w);
  if (o->json)
    fputs("\n]\n", stdout);
  else
    printf("\n%d OK, %d WARN, %d FAIL, %d INFO\n", count[DR_OK], count[DR_WARN], count[DR_FAIL],
           count[DR_INFO]);
  free(c.v);
  return count[DR_FAIL] ? 1 : 0;
}

static int cmd_run(const opts_t *o) {
  dr_rulebook_t rb;
  dr_log_t log;
  if (load_rules(&rb)) return 2;
  if (dr_capture(o->cmd, o->json, o->log, &log)) return dr_rules_free(&rb), 127;
  dr_classify(&log, &rb);
  report_t r = {o->cmd, NULL, &rb, &log};
  if (o->json)
    report_json(stdout, &r);
  else
    report_human(stderr, &r); /* stdout belongs to the command's own output */
  int status = log.status;
  dr_log_free(&log);
  dr_rules_free(&rb);
  return status;
}

static int cmd_classify(const opts_t *o) {
  dr_rulebook_t rb;
  dr_log_t log;
  if (!o->file) return usage(stderr);
  if (load_rules(&rb)) return 2;
  if (dr_read_log(o->file, &log)) return dr_rules_free(&rb), 2;
  dr_classify(&log, &rb);
  report_t r = {NULL, o->file, &rb, &log};
  if (o->json)
    report_json(stdout, &r);
  else if (o->lines)
    report_lines(stdout, &r);
  else
    report_human(stdout, &r);
  dr_log_free(&log);
  dr_rules_free(&rb);
  return 0;
}

static void verify_row(FILE *f, const char *what, const dr_baseline_t *b, long before, long after) {
  if (b->ok)
    fprintf(f, "  %-12s %8ld %8ld\n", what, before, after);
  else
    fprintf(f, "  %-12s %8s %8ld\n", what, "-", after);
}

static void verify_human(FILE *f, const dr_log_t *log, const dr_baseline_t *b, int clean) {
  fprintf(f, "\nepcomm doctor verify:\n  %-12s %8s %8s\n", "", "before", "after");
  static const char *rows[DR_NPHASE] = {"init warns", "run warns", "exit warns"};
  for (int p = 0; p < DR_NPHASE; p++) verify_row(f, rows[p], b, b->count[p], (long)log->count[p]);
  verify_row(f, "exit status", b, b->status, log->status);
  if (b->ok)
    fprintf(f, "  %-12s %7.2fs %7.2fs  %s\n", "wall time", b->wall_s, log->wall_s,
            dr_within_noise(b->wall_s, log->wall_s) ? "within noise"
                                                    : "NOT within noise (max(0.5 s, 20%))");
  else
    fprintf(f, "  %-12s %8s %7.2fs  (no --baseline: nothing to compare)\n", "wall time", "-",
            log->wall_s);
  fprintf(f, "verdict: %s\n",
          clean ? "clean: no run- or exit-phase warnings and status 0"
                : "not clean: see the warnings above");
}

static void verify_json(FILE *f, const dr_log_t *log, const dr_baseline_t *b, int clean) {
  fprintf(f, "{\n  \"clean\": %s,\n  \"exit_status\": %d,\n  \"wall_s\": %.6f,\n",
          clean ? "true" : "false", log->status, log->wall_s);
  fprintf(f, "  \"warnings_init\": %zu,\n  \"warnings_run\": %zu,\n  \"warnings_exit\": %zu,\n",
          log->count[DR_INIT], log->count[DR_RUN], log->count[DR_EXIT]);
  if (b->ok)
    fprintf(f,
            "  \"baseline\": {\"exit_status\": %d, \"wall_s\": %.6f, \"warnings_init\": %ld, "
            "\"warnings_run\": %ld, \"warnings_exit\": %ld},\n  \"within_noise\": %s\n}\n",
            b->status, b->wall_s, b->count[0], b->count[1], b->count[2],
            dr_within_noise(b->wall_s, log->wall_s) ? "true" : "false");
  else
    fprintf(f, "  \"baseline\": null,\n  \"within_noise\": null\n}\n");
}

static int cmd_verify(const opts_t *o) {
  dr_rulebook_t rb;
  dr_log_t log;
  dr_baseline_t b = {0};
  if (o->baseline && dr_read_baseline(o->baseline, &b)) return 2;
  if (load_rules(&rb)) return 2;
  if (dr_capture(o->cmd, o->json, o->log, &log)) return dr_rules_free(&rb), 1;
  dr_classify(&log, &rb);
  int clean = !log.count[DR_RUN] && !log.count[DR_EXIT] && log.status == 0;
  report_t r = {o->cmd, NULL, &rb, &log};
  if (o->json) {
    verify_json(stdout, &log, &b, clean);
  } else {
    if (!clean) report_human(stderr, &r);
    verify_human(stderr, &log, &b, clean);
  }
  dr_log_free(&log);
  dr_rules_free(&rb);
  return clean ? 0 : 1;
}

static int cmd_rules(void) {
  dr_rulebook_t rb;
  if (load_rules(&rb)) return 2;
  printf("rulebook %s: %d rules\n", rb.path, rb.n);
  for (int i = 0; i < rb.n; i++) {
    const dr_rule_t *r = &rb.rules[i];
    printf("  %-34s %-8s %-4s %2d pattern(s)%s\n", r->id, r->tool, dr_phase_name(r->phase_hint),
           r->nre, r->ignore ? "  (ignored: benign)" : "");
  }
  dr_rules_free(&rb);
  return 0;
}

int ep_cmd_doctor(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))
    return usage(argc < 2 ? stderr : stdout);
  const char *sub = argv[1];
  opts_t o;
  if (parse_opts(argc - 1, argv + 1, &o)) return usage(stderr);
  int needs_cmd = !strcmp(sub, "run") || !strcmp(sub, "verify");
  if (needs_cmd != (o.cmd != NULL)) return usage(stderr);
  if (!strcmp(sub, "env")) return cmd_env(&o);
  if (!strcmp(sub, "run")) return cmd_run(&o);
  if (!strcmp(sub, "verify")) return cmd_verify(&o);
  if (!strcmp(sub, "classify")) return cmd_classify(&o);
  if (!strcmp(sub, "rules")) return cmd_rules();
  fprintf(stderr, "epcomm doctor: unknown subcommand '%s'\n", sub);
  return usage(stderr);
}
