/* Private interface between the files of `epcomm doctor` (tools/doctor*.c). Not installed.
 *
 *   doctor.c        argument parsing, dispatch, human and JSON reports
 *   doctor_env.c    `doctor env`: environment checks
 *   doctor_run.c    running a command, capturing its lines, phases, `verify`
 *   doctor_rules.c  the rulebook (share/doctor-rules.txt): loading and matching
 */
#ifndef EP_TOOLS_DOCTOR_H
#define EP_TOOLS_DOCTOR_H

#include <regex.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---- rulebook -------------------------------------------------------------------------------- */

enum { DR_INIT = 0, DR_RUN = 1, DR_EXIT = 2, DR_NPHASE = 3, DR_ANY = -1 };

typedef struct dr_rule {
  char *id;       /* "nccl-proxy-shutdown" */
  char *tool;     /* "nccl", "torch", "epcomm", ... */
  char *cause;    /* one sentence: why the line is printed */
  char *fix;      /* one sentence: what to change */
  int phase_hint; /* DR_INIT/DR_RUN/DR_EXIT where the line usually appears, DR_ANY */
  int ignore;     /* 1: a known benign line, counted but not a warning */
  regex_t *re;    /* match patterns; a line matching any of them belongs to the rule */
  int nre;
  int src_line; /* line of the `rule` key in the file, for messages */
} dr_rule_t;

typedef struct {
  dr_rule_t *rules;
  int n;
  char path[4096];
} dr_rulebook_t;

/* Finds the rulebook: $EP_DOCTOR_RULES, else <dir of executable>/../share/epcomm/doctor-rules.txt
 * (build tree and installed tree alike). Returns 0 and the path in buf, or -1 and the list of
 * places tried in buf. */
int dr_rules_locate(char *buf, size_t len);
/* 0 on success; on a syntax error prints "file:line: message" to err and returns -1. */
int dr_rules_load(dr_rulebook_t *rb, const char *path, FILE *err);
/* Index of the first rule (file order) with a pattern matching line, or -1. */
int dr_rules_match(const dr_rulebook_t *rb, const char *line);
void dr_rules_free(dr_rulebook_t *rb);
const char *dr_phase_name(int phase);

/* ---- captured logs --------------------------------------------------------------------------- */

/* What a line is, once classified. */
enum { DR_PLAIN = 0, DR_WORK_START, DR_WORK_RESULT, DR_WORK_OP };

typedef struct dr_line {
  double t;    /* seconds since the command started (monotonic); -1 when unknown */
  char stream; /* 'o' stdout, 'e' stderr, '?' unknown (a log file) */
  char *text;  /* without the newline and without terminal colour escapes */
  int work;    /* DR_PLAIN or the kind of work marker */
  int span;    /* 2: delimits the work (see mark_work), 1: only opens it, 0: neither */
  int warn;    /* 1: a warning or error line (matched a rule or a warning word) */
  int benign;  /* 1: matched an `ignore` rule */
  int lib;     /* 1: a library's or launcher's log line (NCCL INFO, glog, ...), not the work */
  int rule;    /* rulebook index or -1 (unknown) */
  int rank;    /* rank the launcher tagged the line with, or -1 */
  int phase;   /* DR_INIT/DR_RUN/DR_EXIT for warning lines */
} dr_line_t;

typedef struct dr_log {
  dr_line_t *v;
  size_t n, cap;
  long first, last;     /* first and last work line of the whole log, -1 when none was found;
                           lines tagged with a rank use that rank's own work lines */
  const char *end_kind; /* "test result", "epcomm operation", "last stdout line" (a run),
                           "last plain line" (a log file without streams), "none" */
  int status;           /* exit status as a shell reports it (128+N when killed by signal N) */
  int signal;           /* the signal that killed the command, 0 if it exited */
  double wall_s;
  size_t count[DR_NPHASE]; /* warning lines per phase */
  size_t ignored;          /* lines matched by an `ignore` rule */
  int ranks_phased;        /* ranks whose tagged lines were phased against their own work */
} dr_log_t;

/* Runs argv (fork/exec), passing its output through unchanged (its stdout goes to our stderr when
 * quiet_stdout, so that our stdout carries only a JSON report), and records every line. Writes a
 * timestamped copy to log_path when not NULL. Returns 0, or -1 if the command could not start. */
int dr_capture(char **argv, int quiet_stdout, const char *log_path, dr_log_t *log);
/* Reads an existing log: plain text, or the timestamped format written by `run --log`. */
int dr_read_log(const char *path, dr_log_t *log);
/* Finds the work markers, then the phase and the rule of every warning line. */
void dr_classify(dr_log_t *log, const dr_rulebook_t *rb);
void dr_log_free(dr_log_t *log);
/* Writes argv as one shell-quoted line. */
void dr_print_command(FILE *f, char **argv);
/* Replaces digits and hex numbers with '#', so that similar lines share one key. */
void dr_mask(const char *in, char *out, size_t len);

/* Counts by phase read back from a `doctor run --json` report. */
typedef struct {
  int ok;
  int status;
  double wall_s;
  long count[DR_NPHASE];
} dr_baseline_t;
int dr_read_baseline(const char *path, dr_baseline_t *b);
/* verify's notion of noise: |t1 - t0| <= max(0.5 s, 20% of t0). */
int dr_within_noise(double t0, double t1);

/* ---- environment checks ---------------------------------------------------------------------- */

enum { DR_OK = 0, DR_WARN, DR_FAIL, DR_INFO };

typedef struct {
  char check[40];
  int status;
  char detail[512];
  char fix[320];
} dr_check_t;

typedef struct {
  dr_check_t *v;
  size_t n, cap;
} dr_checks_t;

/* Appends one check; detail and fix are printf formats separated by the caller. */
void dr_check_add(dr_checks_t *c, const char *check, int status, const char *fix,
                  const char *detail_fmt, ...) __attribute__((format(printf, 5, 6)));
/* Runs every environment check; config_bytes is the shared memory one job needs. */
void dr_env_run(dr_checks_t *out, uint64_t config_bytes);
const char *dr_status_name(int status);
/* The checks about jobs across hosts (tools/doctor_net.c): the split into hosts, the engines. */
void dr_net_run(dr_checks_t *out);
/* NCCL_SOCKET_IFNAME must leave an interface that is up: DR_INFO, or DR_FAIL with *fix. */
int dr_judge_socket_ifname(const char *v, const char **fix);
/* NCCL_IB_DISABLE=1 on a host with InfiniBand/RoCE devices: DR_WARN with *fix; else DR_INFO. */
int dr_judge_ib_disable(const char *v, const char **fix);

#endif
