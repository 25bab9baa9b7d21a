/* The network layer's own services: the table of engines, the bounded wait, dlopen. */
#include "net/net.h"

#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/backend.h"

/* The engines this build has. NCCL needs the CUDA runtime (and nccl.h for its types), so it
 * comes with the CUDA backend. */
static const struct ep_net_engine *engine_at(int i) {
  typedef const struct ep_net_engine *(*getter_t)(void);
  static const getter_t engines[] = {
      ep_net_mpi,
#ifdef EP_HAVE_NCCL
      ep_net_nccl,
#endif
  };
  return i < (int)(sizeof engines / sizeof engines[0]) ? engines[i]() : NULL;
}

const struct ep_net_engine *ep_net_find(const char *name) {
  for (int i = 0; engine_at(i); i++)
    if (!strcmp(engine_at(i)->name, name)) return engine_at(i);
  ep_err(
      EP_ERR_UNSUPPORTED, "the %s engine is not built into this library%s", name,
      !strcmp(name, "nccl") ? " (it comes with the CUDA backend: build where nvcc is found)" : "");
  return NULL;
}

const struct ep_net_engine *ep_net_world_engine(void) {
  return ep_net_mpi();
}

/* ------------------------------------------------------------------ waiting */

#define CHECK_PERIOD_S 0.002 /* liveness checks while waiting */
#define BUSY_S 0.002         /* after a completion, test back to back (yielding) this long */
#define SLEEP_MAX_US 500     /* then sleep between tests, up to this */

static void nap_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

static int first_pending(const ep_net_xfer_t *x, int count) {
  for (int i = 0; i < count; i++)
    if (!x[i].done) return i;
  return -1;
}

ep_status_t ep_net_wait(const struct ep_net_engine *e, ep_net_t *n, ep_net_xfer_t *x, int count,
                        double deadline, double timeout_s, ep_net_check_fn check, void *ctx,
                        const char *what) {
  double next_check = 0, busy_until = ep_now() + BUSY_S;
  int ndone_seen = -1;
  long nap = 0;
  for (;;) {
    int ndone = 0;
    ep_status_t st = e->test(n, x, count, &ndone);
    if (st) return st;
    if (ndone == count) return EP_OK;
    double now = ep_now();
    if (ndone != ndone_seen) ndone_seen = ndone, busy_until = now + BUSY_S, nap = 0;
    if (now >= next_check) {
      next_check = now + CHECK_PERIOD_S;
      if (check && (st = check(ctx))) return st;
      if (now >= deadline) {
        int i = first_pending(x, count);
        return ep_err(EP_ERR_TIMEOUT,
                      "%s: deadline of %.1f s passed waiting for rank %d (%s of "
                      "%zu bytes not complete)",
                      what, timeout_s, x[i].peer, x[i].send ? "a send" : "a receive", x[i].bytes);
      }
    }
    /* MPI moves data only inside its calls: test often while transfers complete, then back
     * off so that the ranks sharing this host's cores can run. */
    if (now < busy_until) {
      sched_yield();
    } else {
      nap = nap ? (nap * 2 > SLEEP_MAX_US ? SLEEP_MAX_US : nap * 2) : 20;
      nap_us(nap);
    }
  }
}

/* ------------------------------------------------------------------ loading */

void *ep_net_dlopen(const char *env_name, const char *const *names, char *loaded, size_t n) {
  const char *forced = ep_env_text(env_name);
  char tried[400] = "";
  size_t used = 0;
  for (int i = forced ? -1 : 0; i < 0 || names[i]; i++) {
    const char *lib = i < 0 ? forced : names[i];
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (h) {
      snprintf(loaded, n, "%s", lib);
      return h;
    }
    const char *why = dlerror();
    if (used < sizeof tried)
      used += (size_t)snprintf(tried + used, sizeof tried - used, "%s%s (%s)", used ? ", " : "",
                               lib, why ? why : "not found");
    if (i < 0) break; /* the variable names the library: nothing else is tried */
  }
  ep_err(EP_ERR_UNSUPPORTED, "cannot load %s: tried %s; install it or set %s to its path", names[0],
         tried, env_name);
  return NULL;
}
