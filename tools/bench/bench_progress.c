/* Progress of `epcomm bench` on the user's terminal: a default run takes seconds, a long one
 * minutes, and the table only comes at the end. Rank 0 only, on stderr, only when that reaches a
 * terminal, never with --json (scripts and the test suite stay silent). Whole lines, not
 * carriage returns: under `epcomm launch` they pass through the launcher's line relay with their
 * "[0] " tag. One line per stage, then one at 1, 2, 4, 8 ... s into it: a run of minutes prints
 * a dozen lines at most. */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "tk_clock.h"

/* Our stderr is a terminal, or a pipe to a parent (epcomm launch, mpirun) whose stderr is one.
 * The parent's is read from /proc without opening it. */
static int stderr_reaches_terminal(void) {
  if (isatty(STDERR_FILENO)) return 1;
  struct stat st;
  if (fstat(STDERR_FILENO, &st) != 0 || !S_ISFIFO(st.st_mode)) return 0;
  char link[64], target[PATH_MAX];
  snprintf(link, sizeof link, "/proc/%d/fd/2", (int)getppid());
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return 0;
  target[n] = '\0';
  return !strncmp(target, "/dev/pts/", 9) || !strncmp(target, "/dev/tty", 8);
}

void bench_progress_init(bench_progress_t *p, const bench_opts_t *o, int rank) {
  memset(p, 0, sizeof *p);
  p->on = rank == 0 && !o->json && stderr_reaches_terminal();
  p->t0 = tk_now_s();
}

void bench_progress_stage(bench_progress_t *p, const char *what, int total) {
  if (!p || !p->on) return;
  snprintf(p->what, sizeof p->what, "%s", what);
  p->total = total;
  p->start = tk_now_s();
  p->next = 1.0;
  if (total > 0)
    fprintf(stderr, "epcomm bench: %s: %d iterations (%.1f s so far)\n", what, total,
            p->start - p->t0);
  else
    fprintf(stderr, "epcomm bench: %s (%.1f s so far)\n", what, p->start - p->t0);
}

void bench_progress_step(bench_progress_t *p, int done) {
  if (!p || !p->on) return;
  double t = tk_now_s() - p->start;
  if (t < p->next) return;
  while (p->next <= t) p->next *= 2;
  fprintf(stderr, "epcomm bench: %s: %d of %d done after %.1f s\n", p->what, done, p->total, t);
}
