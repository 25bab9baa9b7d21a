/* Logging: EP_LOG=warn|info|debug|trace (default warn), to stderr or EP_LOG_FILE.
 * Lines look like  "epcomm: info: host:pid:tid [rank 3] run: message".
 * The level and sink are read once per process (pthread_once) and never change afterwards:
 * immutable after start-up, so no locking on the hot path. */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

static struct {
  pthread_once_t once;
  int level;
  FILE *sink; /* stderr, or EP_LOG_FILE opened in append mode */
  char host[64];
  atomic_bool env_checked;
} logger = {PTHREAD_ONCE_INIT, EP_LOG_WARN, NULL, "", false};

static int parse_level(const char *s) {
  static const char *names[] = {"none", "warn", "info", "debug", "trace"};
  if (!s || !*s) return EP_LOG_WARN;
  for (int i = 0; i < 5; i++)
    if (!strcasecmp(s, names[i])) return i;
  return EP_LOG_WARN;
}

static void logger_init(void) {
  logger.level = parse_level(ep_env_str("EP_LOG"));
  logger.sink = stderr;
  const char *path = ep_env_str("EP_LOG_FILE");
  if (path && *path) {
    FILE *f = fopen(path, "ae");
    if (f) {
      setvbuf(f, NULL, _IOLBF, 0);
      logger.sink = f; /* closed by process exit: log lines may come from exit-time reports */
    }
  }
  if (gethostname(logger.host, sizeof logger.host) != 0) snprintf(logger.host, 64, "?");
  logger.host[sizeof logger.host - 1] = '\0';
}

bool ep_log_enabled(int level) {
  pthread_once(&logger.once, logger_init);
  /* The environment check logs, so it cannot run inside the once-routine itself. */
  if (!atomic_load_explicit(&logger.env_checked, memory_order_relaxed) &&
      !atomic_exchange(&logger.env_checked, true))
    ep_env_check_unknown();
  return level <= logger.level;
}

void ep_log_raw(int level, int rank, const char *phase, const char *fmt, va_list ap) {
  static const char *lvl[] = {"", "warn", "info", "debug", "trace"};
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  char rk[24] = "";
  if (rank >= 0) snprintf(rk, sizeof rk, " [rank %d]", rank);
  /* One fprintf per line so that lines of concurrent threads do not interleave. */
  fprintf(logger.sink, "epcomm: %s: %s:%d:%ld%s %s: %s\n", lvl[level], logger.host, (int)getpid(),
          (long)syscall(SYS_gettid), rk, phase ? phase : "-", msg);
}

void ep_log_at(int level, int rank, const char *phase, const char *fmt, ...) {
  if (!ep_log_enabled(level)) return;
  va_list ap;
  va_start(ap, fmt);
  ep_log_raw(level, rank, phase, fmt, ap);
  va_end(ap);
}
