/* `epcomm doctor run|verify|classify`: run a command and capture its lines, then sort the warning
 * lines by phase and cause.
 *
 * The seed's method is to look at *when* the warnings appear relative to the end of the work. The
 * end of the work is the last test result (pytest, unittest, TAP, ctest, the epcomm test runner),
 * else the last epcomm operation line (EP_LOG=info names the phases "run" and "teardown"), else the
 * last line written to stdout. Lines before the first work line are "init", lines after the last
 * one are "exit": a warning at exit says nothing about the results, and everything about teardown.
 * Lines a launcher tagged with a rank are measured against that rank's own work lines. */
#include <ctype.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "doctor.h"
#include "tk_clock.h"
#include "tk_spawn.h"

/* ---- the line store -------------------------------------------------------------------------- */

/* Terminal colour codes (pytest --color=yes, coloured loggers) would defeat the patterns. */
static size_t strip_escapes(char *s, size_t n) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] == '\033' && i + 1 < n && s[i + 1] == '[') {
      i += 2;
      while (i < n && !(s[i] >= '@' && s[i] <= '~')) i++;
      continue;
    }
    if (s[i] == '\r' && i + 1 == n) continue;
    s[o++] = s[i];
  }
  s[o] = '\0';
  return o;
}

static int push_line(dr_log_t *log, double t, char stream, const char *text, size_t n) {
  if (log->n == log->cap) {
    size_t cap = log->cap ? 2 * log->cap : 256;
    dr_line_t *v = realloc(log->v, cap * sizeof *v);
    if (!v) return -1;
    log->v = v;
    log->cap = cap;
  }
  char *copy = malloc(n + 1);
  if (!copy) return -1;
  memcpy(copy, text, n);
  copy[n] = '\0';
  strip_escapes(copy, n);
  log->v[log->n++] = (dr_line_t){.t = t, .stream = stream, .text = copy, .rule = -1, .rank = -1};
  return 0;
}

void dr_log_free(dr_log_t *log) {
  for (size_t i = 0; i < log->n; i++) free(log->v[i].text);
  free(log->v);
  memset(log, 0, sizeof *log);
}

/* ---- running a command ----------------------------------------------------------------------- */

typedef struct {
  int fd;      /* read end of the child's pipe, -1 once closed */
  int out_fd;  /* where the bytes are passed through */
  char stream; /* 'o' or 'e' */
  char *buf;   /* bytes of the line not yet complete */
  size_t len, cap;
} stream_t;

static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return; /* the user's terminal went away: keep capturing anyway */
    p += k;
    n -= (size_t)k;
  }
}

static void log_line(FILE *lf, const dr_line_t *l) {
  if (lf) fprintf(lf, "[%12.6f] %s| %s\n", l->t, l->stream == 'o' ? "out" : "err", l->text);
}

/* Moves every complete line of s->buf into the log, stamped with time t. */
static int split_lines(stream_t *s, dr_log_t *log, double t, FILE *lf, int final) {
  size_t start = 0;
  for (size_t i = 0; i < s->len; i++) {
    if (s->buf[i] != '\n') continue;
    if (push_line(log, t, s->stream, s->buf + start, i - start)) return -1;
    log_line(lf, &log->v[log->n - 1]);
    start = i + 1;
  }
  if (final && start < s->len) {
    if (push_line(log, t, s->stream, s->buf + start, s->len - start)) return -1;
    log_line(lf, &log->v[log->n - 1]);
    start = s->len;
  }
  if (start > 0 && start < s->len) memmove(s->buf, s->buf + start, s->len - start);
  s->len -= start;
  return 0;
}

static void close_stream(stream_t *s, dr_log_t *log, double t0, FILE *lf) {
  if (s->fd < 0) return;
  close(s->fd);
  s->fd = -1;
  split_lines(s, log, tk_now_s() - t0, lf, 1);
}

/* One read from a ready pipe: pass the bytes through unchanged, then keep the lines. */
static int pump(stream_t *s, dr_log_t *log, double t0, FILE *lf) {
  char chunk[65536];
  ssize_t k = read(s->fd, chunk, sizeof chunk);
  if (k < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
  if (k <= 0) return close_stream(s, log, t0, lf), 0;
  write_all(s->out_fd, chunk, (size_t)k);
  if (s->len + (size_t)k > s->cap) {
    size_t cap = 2 * (s->len + (size_t)k);
    char *b = realloc(s->buf, cap);
    if (!b) return -1;
    s->buf = b;
    s->cap = cap;
  }
  memcpy(s->buf + s->len, chunk, (size_t)k);
  s->len += (size_t)k;
  return split_lines(s, log, tk_now_s() - t0, lf, 0);
}

static volatile pid_t g_child = -1;

/* A SIGTERM sent to the doctor (a CI timeout) is meant for the command it runs. */
static void forward_signal(int sig) {
  if (g_child > 0) kill(g_child, sig);
}

/* In the child before exec (the doctor is single-threaded, so setenv is safe here). */
static int child_setup(void *ctx) {
  (void)ctx;
  signal(SIGPIPE, SIG_DFL); /* ignored dispositions survive exec: give the command the defaults */
  signal(SIGINT, SIG_DFL);
  signal(SIGQUIT, SIG_DFL);
  /* Python block-buffers a piped stdout, which would move the test summary after the warnings
   * printed at exit and hide the very ordering the doctor reads. */
  setenv("PYTHONUNBUFFERED", "1", 0);
  unsetenv("EP_DOCTOR_RULES"); /* the doctor's own: the library would call it unknown */
  return 0;
}

/* The command with its stdout and stderr on pipes; 0, or -1 after saying why. */
static int start(char **argv, int out[2], int err[2], pid_t *pid) {
  int e = tk_pipe(out);
  if (!e && (e = tk_pipe(err))) close(out[0]), close(out[1]);
  if (e) {
    fprintf(stderr, "epcomm doctor: pipe: %s\n", strerror(e));
    return -1;
  }
  tk_spawn_t sp = TK_SPAWN_INIT;
  sp.argv = argv, sp.search_path = 1, sp.fd_out = out[1], sp.fd_err = err[1];
  sp.child_setup = child_setup;
  e = tk_spawn(&sp, pid);
  close(out[1]), close(err[1]);
  if (!e) return 0;
  fprintf(stderr, "epcomm doctor: cannot run '%s': %s\n", argv[0], strerror(e));
  close(out[0]), close(err[0]);
  return -1;
}

/* Seconds the pipes are still read after the command exited. What the command itself wrote is in
 * the pipes by then; a process it started in the background (a daemon) may hold them open for
 * ever, and must not keep the doctor from reporting. */
#define DRAIN_S 2.0

/* Reads both pipes until they close (or DRAIN_S after the exit); returns the wait status. */
static int drain(stream_t *s, pid_t pid, dr_log_t *log, double t0, FILE *lf) {
  int ws = 0, reaped = 0;
  double stop_at = 0;
  for (;;) {
    struct pollfd p[2];
    int n = 0, map[2];
    for (int i = 0; i < 2; i++)
      if (s[i].fd >= 0) p[n] = (struct pollfd){s[i].fd, POLLIN, 0}, map[n++] = i;
    if (n == 0 || (reaped && tk_now_s() >= stop_at)) break;
    int ms = reaped ? (int)((stop_at - tk_now_s()) * 1e3) + 1 : 20; /* exit seen within 20 ms */
    if (poll(p, (nfds_t)n, ms) < 0 && errno != EINTR) break;
    for (int j = 0; j < n; j++)
      if (p[j].revents) pump(&s[map[j]], log, t0, lf);
    if (!reaped && waitpid(pid, &ws, WNOHANG) == pid) {
      reaped = 1;
      log->wall_s = tk_now_s() - t0;
      stop_at = tk_now_s() + DRAIN_S;
    }
  }
  close_stream(&s[0], log, t0, lf), close_stream(&s[1], log, t0, lf);
  if (!reaped) {
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
    }
    log->wall_s = tk_now_s() - t0;
  }
  return ws;
}

static void record_status(dr_log_t *log, int wstatus) {
  if (WIFSIGNALED(wstatus)) {
    log->signal = WTERMSIG(wstatus);
    log->status = 128 + log->signal;
  } else {
    log->status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 1;
  }
}

/* Shell-quoted, on one line: plain words bare, others in '...', and words with control
 * characters in bash's $'...' so that the line can be pasted back. */
static void quote_arg(FILE *f, const char *a) {
  int plain = *a != '\0', ctrl = 0;
  for (const char *c = a; *c; c++) {
    plain &= isalnum((unsigned char)*c) || strchr("-_./=:,+@%", *c) != NULL;
    ctrl |= (unsigned char)*c < 0x20;
  }
  if (plain) {
    fputs(a, f);
  } else if (!ctrl) {
    fputc('\'', f);
    for (const char *c = a; *c; c++) *c == '\'' ? fputs("'\\''", f) : fputc(*c, f);
    fputc('\'', f);
  } else {
    fputs("$'", f);
    for (const char *c = a; *c; c++) {
      if (*c == '\n')
        fputs("\\n", f);
      else if (*c == '\t')
        fputs("\\t", f);
      else if ((unsigned char)*c < 0x20)
        fprintf(f, "\\x%02x", (unsigned char)*c);
      else if (*c == '\'' || *c == '\\')
        fprintf(f, "\\%c", *c);
      else
        fputc(*c, f);
    }
    fputc('\'', f);
  }
}

void dr_print_command(FILE *f, char **argv) {
  for (char **a = argv; *a; a++) {
    if (a != argv) fputc(' ', f);
    quote_arg(f, *a);
  }
}

static FILE *open_log(const char *path, char **argv) {
  if (!path) return NULL;
  FILE *lf = fopen(path, "we"); /* not inherited by the command */
  if (!lf) {
    fprintf(stderr, "epcomm doctor: cannot write %s: %s\n", path, strerror(errno));
    return NULL;
  }
  fprintf(lf, "# epcomm doctor log v1; command: ");
  dr_print_command(lf, argv);
  fputc('\n', lf);
  return lf;
}

int dr_capture(char **argv, int quiet_stdout, const char *log_path, dr_log_t *log) {
  memset(log, 0, sizeof *log);
  int out[2], err[2];
  pid_t pid;
  FILE *lf = open_log(log_path, argv);
  double t0 = tk_now_s();
  if (start(argv, out, err, &pid)) {
    if (lf) fclose(lf);
    return -1;
  }
  /* Like system(): Ctrl-C stops the command, and the doctor lives to report on it. */
  struct sigaction ign = {.sa_handler = SIG_IGN}, fwd = {.sa_handler = forward_signal}, old[4];
  g_child = pid;
  sigaction(SIGINT, &ign, &old[0]), sigaction(SIGQUIT, &ign, &old[1]);
  sigaction(SIGPIPE, &ign, &old[2]), sigaction(SIGTERM, &fwd, &old[3]);
  stream_t s[2] = {{out[0], quiet_stdout ? STDERR_FILENO : STDOUT_FILENO, 'o', NULL, 0, 0},
                   {err[0], STDERR_FILENO, 'e', NULL, 0, 0}};
  int ws = drain(s, pid, log, t0, lf);
  g_child = -1;
  sigaction(SIGINT, &old[0], NULL), sigaction(SIGQUIT, &old[1], NULL);
  sigaction(SIGPIPE, &old[2], NULL), sigaction(SIGTERM, &old[3], NULL);
  free(s[0].buf), free(s[1].buf);
  record_status(log, ws);
  if (lf) fprintf(lf, "# exit status %d, wall %.6f s\n", log->status, log->wall_s), fclose(lf);
  return 0;
}

/* ---- reading a log file ---------------------------------------------------------------------- */

/* "[    1.234567] err| text" as written by `run --log`; anything else is a plain line. */
static const char *parse_stamp(const char *s, double *t, char *stream) {
  if (s[0] != '[') return NULL;
  char *end;
  double v = strtod(s + 1, &end);
  if (end == s + 1 || strncmp(end, "] ", 2) != 0) return NULL;
  if (strncmp(end + 2, "out| ", 5) && strncmp(end + 2, "err| ", 5)) return NULL;
  *t = v;
  *stream = end[2] == 'o' ? 'o' : 'e';
  return end + 7;
}

static void parse_trailer(dr_log_t *log, const char *s) {
  int status;
  double wall;
  if (sscanf(s, "# exit status %d, wall %lf s", &status, &wall) == 2) {
    log->status = status;
    log->wall_s = wall;
    log->signal = status > 128 ? status - 128 : 0;
  }
}

int dr_read_log(const char *path, dr_log_t *log) {
  memset(log, 0, sizeof *log);
  FILE *f = !strcmp(path, "-") ? stdin : fopen(path, "r");
  if (!f) {
    fprintf(stderr, "epcomm doctor: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  char *buf = NULL;
  size_t cap = 0;
  ssize_t k;
  int rc = 0;
  while (rc == 0 && (k = getline(&buf, &cap, f)) >= 0) {
    if (k > 0 && buf[k - 1] == '\n') buf[--k] = '\0';
    if (!strncmp(buf, "# epcomm doctor log", 19)) continue;
    if (!strncmp(buf, "# exit status ", 14)) {
      parse_trailer(log, buf);
      continue;
    }
    double t = -1;
    char stream = '?';
    const char *text = parse_stamp(buf, &t, &stream);
    if (!text) text = buf;
    rc = push_line(log, t, stream, text, strlen(text));
  }
  free(buf);
  if (f != stdin) fclose(f);
  return rc;
}

/* ---- work markers ---------------------------------------------------------------------------- */

/* Lines that show work being done. Kept in code rather than in the rulebook because they decide
 * the phases every rule is read against; docs/DOCTOR.md lists them. */
static const struct {
  int kind;
  const char *re;
} markers[] = {
    /* pytest: "===== 5 passed, 1 warning in 3.21s =====", "3 passed in 0.01s" (-q) */
    {DR_WORK_RESULT,
     "^=* *[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)"
     "(, [0-9]+ [a-z]+)* in [0-9.]+s( \\([0-9:]+\\))? *=*$"},
    {DR_WORK_RESULT, "::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)"}, /* pytest -v */
    {DR_WORK_RESULT, "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) [^ ]+::"},     /* pytest -rA */
    {DR_WORK_RESULT, "^[^ ]+\\.py [.FEsxX]+ *(\\[ *[0-9]+%\\])?$"},             /* pytest dots */
    {DR_WORK_RESULT, "(^|[^0-9])[0-9]+ passed, [0-9]+ failed"}, /* the epcomm test runner */
    {DR_WORK_RESULT, "^Ran [0-9]+ tests? in [0-9.]+s$"},        /* unittest */
    {DR_WORK_RESULT, "^(OK|FAILED)( \\((failures|errors|skipped|expected)[^)]*\\))?$"},
    {DR_WORK_RESULT, "^(not )?ok [0-9]+( |$)"},                                   /* TAP */
    {DR_WORK_RESULT, "[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+"}, /* ctest */
    {DR_WORK_RESULT, "^(PASS|FAIL|SKIP)(:| +[^ ])"},
    {DR_WORK_RESULT, "[ :](PASSED|PASS|OK|ok)$"},
    {DR_WORK_START, "^collected [0-9]+ items?"},
    {DR_WORK_START, "^=+ test session starts =+$"},
    /* epcomm's own log at EP_LOG=info: "epcomm: info: host:pid [rank 0] run: dispatch ..." */
    {DR_WORK_OP, "epcomm: (info|debug|trace): .*[] ](run|teardown)[: ]"},
};
#define NMARKERS (sizeof markers / sizeof markers[0])

/* Log lines of the libraries and launchers around a program, never its own output: with no
 * test result or epcomm operation to measure against, the work is the program's own lines, and a
 * library's INFO line at exit (NCCL's "Destroy COMPLETE", Open MPI's help aggregation) must not
 * push the end of work past the exit warnings. Matched after any rank tag, with PyTorch's
 * "[rankN]:" prefix allowed. docs/DOCTOR.md lists them. */
static const char *const library_lines[] = {
    "(^|[] ])(NCCL|NVSHMEM) (INFO|WARN|ERROR|TRACE|ABORT) ", /* host:pid:tid [dev] NCCL INFO */
    "^NCCL version [0-9]",
    "^(\\[rank[0-9]+\\]:)?\\[?[IWEF][0-9]{3,4} [0-9:.]+ ([0-9]+ )?[^ ]+:[0-9]+\\]", /* glog, c10 */
    "^(\\[rank[0-9]+\\]:)?\\[[IWEF] [^ ]+:[0-9]+\\]", /* c10 before PyTorch 2.4 */
    "^(INFO|WARNING|DEBUG|ERROR):torch[.:]",          /* Python logging of torch */
    "^epcomm: (warn|info|debug|trace): ",             /* the library's own log */
    "^epcomm (launch|doctor)[: ]",                    /* epcomm's launcher */
    "^\\[[^] ]+:[0-9]+\\] ",                          /* Open MPI: [host:pid] ... */
};
#define NLIBRARY (sizeof library_lines / sizeof library_lines[0])

/* Words that make any line a warning, known to the rulebook or not. */
static const char warn_words[] = "warn|error|fail|abort|fatal";

typedef struct {
  regex_t mark[NMARKERS];
  regex_t lib[NLIBRARY];
  regex_t words;
} matchers_t;

static void matchers_init(matchers_t *m) {
  for (size_t i = 0; i < NMARKERS; i++)
    regcomp(&m->mark[i], markers[i].re, REG_EXTENDED | REG_NOSUB); /* fixed, tested patterns */
  for (size_t i = 0; i < NLIBRARY; i++)
    regcomp(&m->lib[i], library_lines[i], REG_EXTENDED | REG_NOSUB);
  regcomp(&m->words, warn_words, REG_EXTENDED | REG_NOSUB | REG_ICASE);
}

static void matchers_free(matchers_t *m) {
  for (size_t i = 0; i < NMARKERS; i++) regfree(&m->mark[i]);
  for (size_t i = 0; i < NLIBRARY; i++) regfree(&m->lib[i]);
  regfree(&m->words);
}

static int library_line(const matchers_t *m, const char *s) {
  for (size_t i = 0; i < NLIBRARY; i++)
    if (regexec(&m->lib[i], s, 0, NULL, 0) == 0) return 1;
  return 0;
}

/* Launchers tag each line with its rank: "[3] " (epcomm launch), "[1,3]<stderr>:" (mpirun
 * --tag-output). Markers and rules are matched on the text after such a tag. */
static const char *untagged(const char *s) {
  const char *p = s;
  if (*p++ != '[') return s;
  while ((*p >= '0' && *p <= '9') || *p == ',') p++;
  if (p == s + 1 || *p++ != ']') return s;
  if (!strncmp(p, "<stdout>:", 9) || !strncmp(p, "<stderr>:", 9)) return p + 9;
  return *p == ' ' ? p + 1 : s;
}

static int work_kind(const matchers_t *m, const char *s) {
  for (size_t i = 0; i < NMARKERS; i++)
    if (regexec(&m->mark[i], s, 0, NULL, 0) == 0) return markers[i].kind;
  return DR_PLAIN;
}

/* ---- classification -------------------------------------------------------------------------- */

static void classify_line(dr_log_t *log, dr_line_t *l, const matchers_t *m,
                          const dr_rulebook_t *rb) {
  const char *text = untagged(l->text);
  l->work = work_kind(m, text);
  l->lib = l->work == DR_PLAIN && library_line(m, text);
  l->rule = dr_rules_match(rb, text);
  if (l->rule >= 0 && rb->rules[l->rule].ignore) {
    l->benign = 1;
    log->ignored++;
    return;
  }
  /* A test result that says "1 failed" is a result, not a warning, unless a rule knows it. */
  l->warn = l->rule >= 0 || (l->work == DR_PLAIN && regexec(&m->words, text, 0, NULL, 0) == 0);
}

static int has_kind(const dr_log_t *log, int kind) {
  for (size_t i = 0; i < log->n; i++)
    if (log->v[i].work == kind) return 1;
  return 0;
}

/* Lines that belong to a message rather than to the work: stack traces, tracebacks, and the
 * framed help texts of MPI launchers (between lines made only of '-' or '='). */
static int continuation(const dr_line_t *l, int *in_frame) {
  const char *s = untagged(l->text);
  size_t n = strlen(s);
  if (n >= 20 && (strspn(s, "-") == n || strspn(s, "=") == n)) return *in_frame = !*in_frame, 1;
  return *in_frame || l->benign || !*s || *s == ' ' || *s == '\t' ||
         !strncmp(s, "Traceback ", 10) || !strncmp(s, "Exception raised from ", 22);
}

/* Whether the capture kept stdout and stderr apart: a `run` whose command wrote to both. A log
 * file, or a command that merged its streams (`2>&1 | tee`), is one stream: its lines can only be
 * told apart by what they say. */
static int two_streams(const dr_log_t *log) {
  int out = 0, err = 0;
  for (size_t i = 0; i < log->n; i++)
    out |= log->v[i].stream == 'o', err |= log->v[i].stream == 'e';
  return out && err;
}

/* A line of the program's own output: not empty, not a warning, not part of a message, not a
 * library's or launcher's log line, and on stdout when the capture kept the streams apart. The
 * order of the lines decides, never their times: a log that arrived at once phases as it reads. */
static int own_output(const dr_line_t *l, int part, int two) {
  return !part && !l->warn && !l->lib && (!two || l->stream == 'o');
}

/* Sets l->span on the lines that delimit the work: 2 for work lines, 1 for lines that only open
 * it (pytest's session header). Test results win over epcomm operations, which win over the
 * program's own output (own_output). Returns what the end of work is. */
static const char *mark_work(dr_log_t *log) {
  int kind = has_kind(log, DR_WORK_RESULT) ? DR_WORK_RESULT
             : has_kind(log, DR_WORK_OP)   ? DR_WORK_OP
                                           : 0;
  int in_frame = 0, two = two_streams(log);
  for (size_t i = 0; i < log->n; i++) {
    dr_line_t *l = &log->v[i];
    int part = continuation(l, &in_frame); /* always called: it tracks the frames */
    if (kind)
      l->span = l->work == kind ? 2 : l->work == DR_WORK_START && kind == DR_WORK_RESULT;
    else
      l->span = 2 * own_output(l, part, two);
  }
  return kind == DR_WORK_RESULT ? "test result"
         : kind                 ? "epcomm operation"
         : two                  ? "last stdout line"
                                : "last plain line";
}

/* The rank a launcher tagged the line with ("[3] ", "[1,3]<stderr>:", PyTorch's "[rank3]:"), or -1.
 */
static int rank_of(const char *s) {
  const char *t = untagged(s);
  if (t != s) {
    const char *c = strrchr(s, ',');
    return atoi(c && c < t ? c + 1 : s + 1);
  }
  return !strncmp(s, "[rank", 5) && isdigit((unsigned char)s[5]) ? atoi(s + 5) : -1;
}

typedef struct {
  long first, last;
} span_t;

/* Spans per rank: a rank's warnings after its own last work line are its exit, even while other
 * ranks still work. Index 0 is the whole log, index r + 1 rank r. */
static span_t *find_spans(dr_log_t *log, int *nranks) {
  int max = -1;
  for (size_t i = 0; i < log->n; i++) {
    log->v[i].rank = rank_of(log->v[i].text);
    if (log->v[i].rank > max && log->v[i].rank < 65536) max = log->v[i].rank;
  }
  span_t *sp = malloc((size_t)(max + 2) * sizeof *sp);
  if (!sp) return NULL;
  for (int r = 0; r < max + 2; r++) sp[r] = (span_t){-1, -1};
  for (size_t i = 0; i < log->n; i++) {
    const dr_line_t *l = &log->v[i];
    span_t *own = l->rank >= 0 && l->rank <= max ? &sp[l->rank + 1] : NULL;
    for (span_t *x = sp; x; x = x == sp ? own : NULL) {
      if (l->span && x->first < 0) x->first = (long)i;
      if (l->span == 2) x->last = (long)i;
    }
  }
  *nranks = max + 1;
  return sp;
}

static int phase_in(const span_t *sp, long i) {
  if (sp->last < 0) return DR_RUN; /* no work line: nothing tells init from exit */
  return i < sp->first ? DR_INIT : i > sp->last ? DR_EXIT : DR_RUN;
}

/* Two pipes keep no order between them: a line written to stdout and then one to stderr may be
 * read the other way round when both are ready at once (seen under load in CI). A warning that
 * its rule says comes at exit, read on the other stream than the end of the work and no more
 * than CROSS_STREAM_S before it, came with it: it is an exit line. */
#define CROSS_STREAM_S 0.25
static int exit_across_streams(const dr_log_t *log, const dr_line_t *l, long last,
                               const dr_rulebook_t *rb) {
  if (!l->warn || l->phase == DR_EXIT || last < 0 || l->rule < 0 || l->rule >= rb->n) return 0;
  const dr_line_t *end = &log->v[last];
  if (end->stream == l->stream || end->stream == '?' || l->stream == '?') return 0;
  if (l->t < 0 || end->t < 0 || end->t - l->t > CROSS_STREAM_S) return 0;
  return rb->rules[l->rule].phase_hint == DR_EXIT;
}

void dr_classify(dr_log_t *log, const dr_rulebook_t *rb) {
  matchers_t m;
  matchers_init(&m);
  log->ignored = 0;
  for (size_t i = 0; i < log->n; i++) classify_line(log, &log->v[i], &m, rb);
  matchers_free(&m);
  log->end_kind = mark_work(log);
  int nranks = 0;
  span_t *sp = find_spans(log, &nranks), all = sp ? sp[0] : (span_t){-1, -1};
  log->first = all.first;
  log->last = all.last;
  if (log->last < 0) log->end_kind = "none";
  memset(log->count, 0, sizeof log->count);
  log->ranks_phased = 0;
  for (int r = 0; sp && r < nranks; r++) log->ranks_phased += sp[r + 1].last >= 0;
  for (size_t i = 0; i < log->n; i++) {
    dr_line_t *l = &log->v[i];
    int own = sp && l->rank >= 0 && l->rank < nranks && sp[l->rank + 1].last >= 0;
    const span_t *span = own ? &sp[l->rank + 1] : &all;
    l->phase = phase_in(span, (long)i);
    if (exit_across_streams(log, l, span->last, rb)) l->phase = DR_EXIT;
    if (l->warn) log->count[l->phase]++;
  }
  free(sp);
}

/* ---- grouping helpers ------------------------------------------------------------------------ */

static int is_hex_word(const char *s, size_t n) {
  int digit = 0;
  for (size_t i = 0; i < n; i++) {
    if (!isxdigit((unsigned char)s[i])) return 0;
    digit |= isdigit((unsigned char)s[i]) != 0;
  }
  return digit;
}

void dr_mask(const char *in, char *out, size_t len) {
  size_t o = 0;
  while (*in && o + 4 < len) {
    size_t n = 0;
    while (isalnum((unsigned char)in[n]) || in[n] == '_') n++;
    if (n == 0) {
      out[o++] = *in++;
      continue;
    }
    int hex0x =
        n > 2 && in[0] == '0' && (in[1] == 'x' || in[1] == 'X') && is_hex_word(in + 2, n - 2);
    if (hex0x || is_hex_word(in, n)) {
      o += (size_t)snprintf(out + o, len - o, "%s", hex0x ? "0x#" : "#");
    } else {
      for (size_t i = 0; i < n && o + 2 < len; i++)
        if (!isdigit((unsigned char)in[i]) || !i || !isdigit((unsigned char)in[i - 1]))
          out[o++] = isdigit((unsigned char)in[i]) ? '#' : in[i];
    }
    in += n;
  }
  out[o] = '\0';
}

/* ---- verify's inputs ------------------------------------------------------------------------- */

/* The keys are written first and only once by the JSON report; inside an escaped string a key
 * reads \"key\" and cannot match "key":. */
static int json_number(const char *doc, const char *key, double *v) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(doc, pat);
  if (!p) return -1;
  char *end;
  *v = strtod(p + strlen(pat), &end);
  return end == p + strlen(pat) ? -1 : 0;
}

int dr_read_baseline(const char *path, dr_baseline_t *b) {
  memset(b, 0, sizeof *b);
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "epcomm doctor: cannot open baseline %s: %s\n", path, strerror(errno));
    return -1;
  }
  char *doc = NULL;
  size_t cap = 0;
  ssize_t k = getdelim(&doc, &cap, '\0', f);
  fclose(f);
  double v[5];
  static const char *keys[5] = {"exit_status", "wall_s", "warnings_init", "warnings_run",
                                "warnings_exit"};
  int rc = k > 0 ? 0 : -1;
  for (int i = 0; rc == 0 && i < 5; i++) rc = json_number(doc, keys[i], &v[i]);
  free(doc);
  if (rc) {
    fprintf(stderr, "epcomm doctor: %s is not a `doctor run --json` report\n", path);
    return -1;
  }
  b->ok = 1;
  b->status = (int)v[0];
  b->wall_s = v[1];
  for (int p = 0; p < DR_NPHASE; p++) b->count[p] = (long)v[2 + p];
  return 0;
}

int dr_within_noise(double t0, double t1) {
  double d = t1 > t0 ? t1 - t0 : t0 - t1, tol = 0.2 * t0;
  return d <= (tol > 0.5 ? tol : 0.5);
}
