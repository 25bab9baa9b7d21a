/* The one registry of environment variables epcomm reads. `epcomm info` prints it; a set EP_*
 * variable that is not here is reported once at warn level (it is probably a typo). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

extern char **environ;

static const struct ep_env_var {
  const char *name, *type, *dflt, *help;
} env_table[] = {
    {"EP_LOG", "enum", "warn", "log level: none, warn, info, debug, trace"},
    {"EP_LOG_FILE", "path", "", "append log lines to this file instead of stderr"},
    {"EP_TIMEOUT_S", "float", "100", "deadline in seconds for every wait (config overrides)"},
    {"EP_BACKEND", "enum", "cpu", "backend when the config says AUTO: cpu or cuda"},
    {"EP_QUEUE_BYTES", "size", "1048576", "bytes of each per-(peer, channel) normal-mode queue"},
    {"EP_CHANNELS", "int", "1", "channels (worker threads on cpu) per rank"},
    {"EP_SPIN_US", "int", "50", "microseconds a waiter spins before it sleeps on a futex"},
    {"EP_LL_WIDE_BYTES", "size", "1048576", "cpu: a low-latency call moving this many bytes "
     "splits its copies over the buffer's channels"},
    {"EP_RANK", "int", "", "this process's rank (set by epcomm launch)"},
    {"EP_NRANKS", "int", "", "number of ranks (set by epcomm launch)"},
    {"EP_LOCAL_RANK", "int", "", "rank on this host (set by epcomm launch)"},
    {"EP_LOCAL_SIZE", "int", "", "ranks on this host (set by epcomm launch)"},
    {"EP_JOB_ID", "string", "", "rendezvous name shared by the ranks of one job"},
    {"EP_NOTIFY_FD", "int", "", "socket on which epcomm launch reports dead ranks"},
    {"EP_DOCTOR_RULES", "path", "", "rulebook used by epcomm doctor"},
    {"EP_CUDA_DEVICE", "int", "", "CUDA device of this rank (default: local rank modulo devices)"},
    {"EP_CUDA_SMS", "int", "0", "blocks (SMs) per rank of the CUDA kernels; 0: 24 in normal "
     "mode, the rank's share of the GPU in low-latency mode (config num_sms overrides); never "
     "more than the GPU's SMs shared among its ranks"},
    {"EP_CUDA_ARENA_MB", "int", "64", "device memory per CUDA buffer for dispatch handles"},
    {"EP_CUDA_LL_ASYNC", "int", "0", "cuda: 1 = low-latency calls never wait on the host for "
     "their verdict (as in a graph capture: errors come with the next call, counts are -1)"},
};
#define ENV_COUNT (sizeof env_table / sizeof env_table[0])

static const struct ep_env_var *env_find(const char *name, size_t len) {
  for (size_t i = 0; i < ENV_COUNT; i++)
    if (strlen(env_table[i].name) == len && !strncmp(env_table[i].name, name, len))
      return &env_table[i];
  return NULL;
}

const char *ep_env_str(const char *name) {
  /* Reading an unregistered name is a programming error inside epcomm: keep the registry whole. */
  if (!env_find(name, strlen(name))) return NULL;
  return getenv(name);
}

double ep_env_double(const char *name, double dflt) {
  const char *s = ep_env_str(name);
  if (!s || !*s) return dflt;
  char *end;
  double v = strtod(s, &end);
  return (*end == '\0') ? v : dflt;
}

long ep_env_long(const char *name, long dflt) {
  const char *s = ep_env_str(name);
  if (!s || !*s) return dflt;
  char *end;
  long v = strtol(s, &end, 0);
  return (*end == '\0') ? v : dflt;
}

void ep_env_print(FILE *f) {
  fprintf(f, "%-16s %-7s %-9s %-22s %s\n", "variable", "type", "default", "value", "meaning");
  for (size_t i = 0; i < ENV_COUNT; i++) {
    const char *v = getenv(env_table[i].name);
    fprintf(f, "%-16s %-7s %-9s %-22s %s\n", env_table[i].name, env_table[i].type,
            *env_table[i].dflt ? env_table[i].dflt : "-", v ? v : "(unset)", env_table[i].help);
  }
}

/* Called once from the logger's one-time initialisation. */
void ep_env_check_unknown(void) {
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "EP_", 3) != 0) continue;
    const char *eq = strchr(*e, '=');
    size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
    if (!env_find(*e, len))
      ep_log_at(EP_LOG_WARN, -1, "init", "unknown variable %.*s is set; `epcomm info` lists the "
                "EP_* variables epcomm reads", (int)len, *e);
    else if (ep_log_enabled(EP_LOG_INFO))
      ep_log_at(EP_LOG_INFO, -1, "init", "%s set by environment", *e);
  }
}
