/* Groups: bootstrap from the environment or from user callbacks, liveness, collective destroy. */
#include "group.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define RENDEZVOUS_MAX 80

typedef struct {
  int32_t pid;
  char hostkey[EP_HOSTKEY_MAX];
} peer_info_t;

static void host_key(char *out) {
  char host[64] = "?", boot[40] = "";
  gethostname(host, sizeof host);
  host[sizeof host - 1] = '\0';
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
  if (f) {
    if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
    fclose(f);
  }
  boot[strcspn(boot, "\n")] = '\0';
  snprintf(out, EP_HOSTKEY_MAX, "%s/%s", host, boot);
}

static double resolve_timeout(double cfg) {
  if (cfg > 0) return cfg;
  double t = ep_env_double("EP_TIMEOUT_S", 100.0);
  return t > 0 ? t : 100.0;
}

ep_status_t ep_group_fail(ep_group *g, ep_status_t st, const char *op) {
  ep_err_prefix(op);
  ep_errbox_put(&g->err, ep_last_error());
  return st;
}

static void group_free(ep_group *g) {
  if (!g) return;
  ep_boot_close(&g->boot);
  ep_live_fini(&g->live);
  free(g->hostkeys);
  free(g->buffers);
  pthread_mutex_destroy(&g->lock);
  pthread_mutex_destroy(&g->boot_lock);
  ep_errbox_fini(&g->err);
  g->magic = 0;
  free(g);
}

static int notify_fd_from_env(void) {
  long fd = ep_env_long("EP_NOTIFY_FD", -1);
  if (fd < 0 || fd > 1 << 20 || fcntl((int)fd, F_GETFD) < 0) return -1;
  return (int)fd;
}

/* Everything after the rendezvous name is known: connect, exchange pids and hosts. */
static ep_status_t group_init(ep_group *g, const char *name, int notify_fd) {
  double deadline = ep_now() + g->timeout_s;
  ep_status_t st = ep_boot_open(&g->boot, name, g->rank, g->nranks, deadline);
  if (st) return st;
  peer_info_t me = {(int32_t)getpid(), ""}, *all = calloc((size_t)g->nranks, sizeof *all);
  int *same = calloc((size_t)g->nranks, sizeof *same);
  pid_t *pids = calloc((size_t)g->nranks, sizeof *pids);
  g->hostkeys = calloc((size_t)g->nranks, sizeof *g->hostkeys);
  if (!all || !same || !pids || !g->hostkeys) st = ep_err(EP_ERR_NO_MEMORY, "out of memory");
  host_key(me.hostkey);
  if (!st) st = ep_boot_allgather(&g->boot, &me, all, sizeof me, deadline);
  for (int r = 0; !st && r < g->nranks; r++) {
    pids[r] = all[r].pid;
    memcpy(g->hostkeys[r], all[r].hostkey, EP_HOSTKEY_MAX);
    g->hostkeys[r][EP_HOSTKEY_MAX - 1] = '\0';
    same[r] = !strcmp(g->hostkeys[r], me.hostkey);
  }
  if (!st && ep_live_init(&g->live, g->rank, g->nranks, pids, same, notify_fd) != 0)
    st = ep_err(EP_ERR_NO_MEMORY, "out of memory");
  free(all);
  free(same);
  free(pids);
  return st;
}

static ep_status_t group_new(int rank, int nranks, const ep_group_config_t *cfg, ep_group **out) {
  ep_group *g = calloc(1, sizeof *g);
  if (!g) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  g->magic = EP_GROUP_MAGIC;
  g->rank = rank;
  g->nranks = nranks;
  g->timeout_s = resolve_timeout(cfg->timeout_s);
  g->boot.listen_fd = -1;
  g->live.dead = -1;
  pthread_mutex_init(&g->lock, NULL);
  pthread_mutex_init(&g->boot_lock, NULL);
  ep_errbox_init(&g->err);
  *out = g;
  return EP_OK;
}

static ep_status_t group_finish(ep_group *g, const char *name, int notify_fd, ep_group_t *out) {
  ep_status_t st = group_init(g, name, notify_fd);
  if (!st) st = ep_reg_add(EP_OBJ_GROUP, g, g->rank, &g->id);
  if (st) {
    ep_log_at(EP_LOG_INFO, g->rank, "init", "group creation failed: %s", ep_last_error());
    group_free(g);
    return st;
  }
  ep_log_at(EP_LOG_INFO, g->rank, "init", "group %#" PRIx64 " up: %d ranks, rendezvous %s, "
            "timeout %.1f s", g->id, g->nranks, name, g->timeout_s);
  *out = ep_id_to_ptr(g->id);
  return EP_OK;
}

static ep_status_t load_group_config(const ep_group_config_t *cfg, ep_group_config_t *c) {
  *c = (ep_group_config_t)EP_GROUP_CONFIG_INIT;
  return cfg ? ep_struct_load(c, sizeof *c, cfg, "cfg", true) : EP_OK;
}

/* EP_* names go through the registry (src/core/env.c); the launchers' own names do not. */
static const char *env_get(const char *name) {
  return strncmp(name, "EP_", 3) ? getenv(name) : ep_env_str(name);
}

/* The launchers whose environment gives a rank and a size, tried in this order: torchrun comes
 * before mpirun and srun because it may run under them, and then its children's RANK is the one
 * that counts. A launcher counts only when it set both numbers. */
typedef struct {
  const char *rank, *size;
  bool torchrun; /* the job name is derived (torch_job_id) */
} env_source_t;

static const env_source_t env_sources[] = {
    {"EP_RANK", "EP_NRANKS", false},
    {"RANK", "WORLD_SIZE", true},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", false},
    {"PMI_RANK", "PMI_SIZE", false},
    {"SLURM_PROCID", "SLURM_NTASKS", false},
};

static int env_int(const char *name, int *out) {
  const char *s = env_get(name);
  if (!s || !*s) return 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (*end != '\0' || v < 0 || v >= (1 << 24)) return 0;
  *out = (int)v;
  return 1;
}

static const env_source_t *env_ranks(int *rank, int *nranks) {
  for (size_t i = 0; i < sizeof env_sources / sizeof env_sources[0]; i++)
    if (env_int(env_sources[i].rank, rank) && env_int(env_sources[i].size, nranks))
      return &env_sources[i];
  return NULL;
}

/* torchrun's ranks share the address of their store, which no other live job on this host can
 * have; its run id names the job when the store is not given (or is the only name given). */
static const char *torch_job_id(char *buf, size_t n) {
  const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
  const char *run = getenv("TORCHELASTIC_RUN_ID");
  if (addr && *addr && port && *port) {
    snprintf(buf, n, "torch-%s:%s", addr, port);
    return buf;
  }
  if (run && *run && strcmp(run, "none") != 0) {
    snprintf(buf, n, "torch-%s", run);
    return buf;
  }
  return NULL;
}

static const char *env_job_id(const env_source_t *src, char *buf, size_t n) {
  static const char *const names[] = {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
                                      "SLURM_STEP_ID", NULL};
  const char *s = env_get("EP_JOB_ID");
  if (s && *s) return s;
  if (src->torchrun && (s = torch_job_id(buf, n))) return s;
  for (const char *const *name = names; *name; name++)
    if ((s = env_get(*name)) && *s) return s;
  return NULL;
}

ep_status_t ep_group_create_from_env(const ep_group_config_t *cfg, ep_group_t *group) {
  if (!group) return ep_err(EP_ERR_NULL_ARG, "ep_group_create_from_env: group is NULL");
  ep_group_config_t c;
  ep_status_t st = load_group_config(cfg, &c);
  if (st) return st;
  int rank, nranks;
  const env_source_t *src = env_ranks(&rank, &nranks);
  if (!src)
    return ep_err(EP_ERR_BOOTSTRAP, "ep_group_create_from_env: no rank in the environment "
                  "(EP_RANK/EP_NRANKS): start the program with `epcomm launch -n R`, torchrun "
                  "or mpirun");
  if (nranks < 1 || rank >= nranks)
    return ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_create_from_env: rank %d of %d (%s, %s)", rank,
                  nranks, src->rank, src->size);
  char derived[RENDEZVOUS_MAX];
  const char *job = c.job_id ? c.job_id : env_job_id(src, derived, sizeof derived);
  if (!job)
    return ep_err(EP_ERR_BOOTSTRAP, "ep_group_create_from_env: no job id (EP_JOB_ID) to meet "
                  "the other ranks under (%s is set, but no name of its job)", src->rank);
  char name[RENDEZVOUS_MAX];
  /* Every rank creates its groups in the same order, so the counter agrees across ranks. */
  snprintf(name, sizeof name, "%.60s.%u", job, ep_reg_next_env_group());
  ep_group *g;
  st = group_new(rank, nranks, &c, &g);
  return st ? st : group_finish(g, name, notify_fd_from_env(), group);
}

static ep_status_t check_bootstrap(const ep_bootstrap_t *b) {
  if (!b) return ep_err(EP_ERR_NULL_ARG, "ep_group_create: boot is NULL");
  if (!b->allgather) return ep_err(EP_ERR_NULL_ARG, "ep_group_create: boot->allgather is NULL");
  if (b->nranks < 1)
    return ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_create: boot->nranks is %d, must be >= 1",
                  b->nranks);
  if (b->rank < 0 || b->rank >= b->nranks)
    return ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_create: boot->rank is %d, must be in [0, %d)",
                  b->rank, b->nranks);
  return EP_OK;
}

ep_status_t ep_group_create(const ep_bootstrap_t *boot, const ep_group_config_t *cfg,
                            ep_group_t *group) {
  ep_status_t st = check_bootstrap(boot);
  if (st) return st;
  if (!group) return ep_err(EP_ERR_NULL_ARG, "ep_group_create: group is NULL");
  ep_group_config_t c;
  if ((st = load_group_config(cfg, &c))) return st;
  /* Rank 0 picks a random rendezvous name; the user's allgather carries it to everyone. */
  char mine[RENDEZVOUS_MAX] = "", *all = calloc((size_t)boot->nranks, RENDEZVOUS_MAX);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  uint64_t rnd = 0;
  if (boot->rank == 0) {
    if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) rnd = (uint64_t)ep_now() * 1e9;
    snprintf(mine, sizeof mine, "cb.%d.%016" PRIx64, (int)getpid(), rnd);
  }
  if (boot->allgather(boot->ctx, mine, all, RENDEZVOUS_MAX) != 0) {
    free(all);
    return ep_err(EP_ERR_BOOTSTRAP, "ep_group_create: the user allgather callback failed");
  }
  char name[RENDEZVOUS_MAX];
  memcpy(name, all, RENDEZVOUS_MAX);
  name[RENDEZVOUS_MAX - 1] = '\0';
  free(all);
  ep_group *g;
  st = group_new(boot->rank, boot->nranks, &c, &g);
  if (!st) st = group_finish(g, name, -1, group);
  /* The callbacks' own barrier keeps the user's framework in step with ours. */
  if (!st && boot->barrier && boot->barrier(boot->ctx) != 0) {
    ep_group_release(*group);
    *group = NULL;
    st = ep_err(EP_ERR_BOOTSTRAP, "ep_group_create: the user barrier callback failed");
  }
  return st;
}

/* ------------------------------------------------------------------ use and teardown */

ep_status_t ep_group_check(ep_group *g, int *dead, const char **how) {
  int r = ep_live_check(&g->live);
  if (r < 0) return EP_OK;
  if (dead) *dead = r;
  if (how) *how = g->live.how;
  g->broken = true;
  return ep_err(EP_ERR_PEER_FAILED, "rank %d (pid %d) %s", r, (int)g->live.pids[r], g->live.how);
}

ep_status_t ep_group_explain(ep_group *g, ep_status_t st) {
  if (st != EP_ERR_PEER_FAILED && st != EP_ERR_TIMEOUT) return st;
  /* A closed socket can be seen a moment before the process is reaped and the launcher says how
   * it died: give the better explanation 200 ms to show up. */
  char saved[EP_ERRMSG_MAX];
  snprintf(saved, sizeof saved, "%s", ep_last_error());
  for (int i = 0; i < 40; i++) {
    int dead;
    if (ep_group_check(g, &dead, NULL) == EP_ERR_PEER_FAILED) return EP_ERR_PEER_FAILED;
    if (st == EP_ERR_TIMEOUT) break;
    nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
  }
  ep_err_set_msg(saved);
  return st;
}

bool ep_group_same_host(const ep_group *g) {
  for (int r = 0; r < g->nranks; r++)
    if (strcmp(g->hostkeys[r], g->hostkeys[g->rank])) return false;
  return true;
}

ep_status_t ep_group_add_buffer(ep_group *g, ep_id_t buf) {
  pthread_mutex_lock(&g->lock);
  if (g->nbuffers == g->capbuffers) {
    int cap = g->capbuffers ? 2 * g->capbuffers : 4;
    ep_id_t *b = realloc(g->buffers, (size_t)cap * sizeof *b);
    if (!b) {
      pthread_mutex_unlock(&g->lock);
      return ep_err(EP_ERR_NO_MEMORY, "out of memory");
    }
    g->buffers = b;
    g->capbuffers = cap;
  }
  g->buffers[g->nbuffers++] = buf;
  pthread_mutex_unlock(&g->lock);
  return EP_OK;
}

void ep_group_remove_buffer(ep_group *g, ep_id_t buf) {
  pthread_mutex_lock(&g->lock);
  for (int i = 0; i < g->nbuffers; i++)
    if (g->buffers[i] == buf) g->buffers[i] = g->buffers[--g->nbuffers];
  pthread_mutex_unlock(&g->lock);
}

static ep_status_t group_get(ep_group_t group, bool exclusive, ep_group **g) {
  return ep_reg_acquire(ep_ptr_to_id(group), EP_OBJ_GROUP, exclusive, (void **)g);
}

ep_status_t ep_group_rank(ep_group_t group, int *rank) {
  ep_group *g;
  if (!rank) return ep_err(EP_ERR_NULL_ARG, "ep_group_rank: rank is NULL");
  ep_status_t st = group_get(group, false, &g);
  if (st) return st;
  *rank = g->rank;
  ep_reg_release(g->id);
  return EP_OK;
}

ep_status_t ep_group_nranks(ep_group_t group, int *nranks) {
  ep_group *g;
  if (!nranks) return ep_err(EP_ERR_NULL_ARG, "ep_group_nranks: nranks is NULL");
  ep_status_t st = group_get(group, false, &g);
  if (st) return st;
  *nranks = g->nranks;
  ep_reg_release(g->id);
  return EP_OK;
}

const char *ep_group_last_error(ep_group_t group) {
  ep_group *g;
  if (group_get(group, false, &g)) return ep_last_error();
  const char *m = ep_errbox_get(&g->err);
  ep_reg_release(g->id);
  return m;
}

/* Barrier and allgather share one path: exclusive use of the bootstrap channel, and a failure
 * breaks the group (a peer may be gone). */
static ep_status_t group_exchange(ep_group_t group, const void *send, void *recv, size_t bytes,
                                  const char *op) {
  ep_group *g;
  ep_status_t st = group_get(group, false, &g);
  if (st) return st;
  if (g->broken) st = ep_err(EP_ERR_BROKEN, "group is broken by an earlier failure");
  if (!st) {
    pthread_mutex_lock(&g->boot_lock);
    double deadline = ep_now() + g->timeout_s;
    st = send ? ep_boot_allgather(&g->boot, send, recv, bytes, deadline)
              : ep_boot_barrier(&g->boot, deadline);
    pthread_mutex_unlock(&g->boot_lock);
  }
  if (st) {
    if (st != EP_ERR_BROKEN) st = ep_group_explain(g, st);
    g->broken = true;
    st = ep_group_fail(g, st, op);
  }
  ep_reg_release(g->id);
  return st;
}

ep_status_t ep_group_barrier(ep_group_t group) {
  return group_exchange(group, NULL, NULL, 0, "ep_group_barrier");
}

ep_status_t ep_group_allgather(ep_group_t group, const void *send, void *recv, size_t bytes) {
  if (!send || !recv)
    return ep_err(EP_ERR_NULL_ARG, "ep_group_allgather: %s is NULL", send ? "recv" : "send");
  if (bytes == 0 || bytes > (64u << 20))
    return ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_allgather: bytes is %zu, must be in [1, 64 MiB]",
                  bytes);
  return group_exchange(group, send, recv, bytes, "ep_group_allgather");
}

static ep_status_t busy_with_buffers(ep_group *g, const char *op) {
  pthread_mutex_lock(&g->lock);
  int n = g->nbuffers;
  unsigned long long first = n ? (unsigned long long)g->buffers[0] : 0;
  pthread_mutex_unlock(&g->lock);
  if (n == 0) return EP_OK;
  return ep_err(EP_ERR_BUSY, "%s: %d buffer(s) of this group are still alive (first: %#llx); "
                "destroy buffers before their group", op, n, first);
}

ep_status_t ep_group_destroy(ep_group_t group) {
  if (!group) return EP_OK;
  ep_group *g;
  ep_status_t st = group_get(group, true, &g);
  if (st) return st;
  if ((st = busy_with_buffers(g, "ep_group_destroy"))) {
    ep_reg_release(g->id);
    return st;
  }
  ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group %#llx: destroy", (unsigned long long)g->id);
  /* Quiesce: nobody leaves before everyone has arrived, so no peer is still talking to us. A
   * broken group skips this: its peers are gone or failing too. */
  ep_status_t q = g->broken ? EP_OK : ep_boot_barrier(&g->boot, ep_now() + g->timeout_s);
  ep_reg_release(g->id);
  void *obj;
  if ((st = ep_reg_remove(g->id, EP_OBJ_GROUP, &obj))) return st;
  if (q) ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group destroy: peers not quiesced: %s",
                   ep_last_error());
  group_free(g);
  return q;
}

ep_status_t ep_group_release(ep_group_t group) {
  if (!group) return EP_OK;
  ep_group *g;
  ep_status_t st = group_get(group, true, &g);
  if (st) return st;
  /* Crash path: buffers go first (local release), then the group. */
  for (;;) {
    pthread_mutex_lock(&g->lock);
    ep_id_t b = g->nbuffers ? g->buffers[g->nbuffers - 1] : 0;
    pthread_mutex_unlock(&g->lock);
    if (!b) break;
    if ((st = ep_buffer_release(ep_id_to_ptr(b)))) {
      ep_reg_release(g->id);
      return st;
    }
  }
  ep_reg_release(g->id);
  void *obj;
  if ((st = ep_reg_remove(g->id, EP_OBJ_GROUP, &obj))) return st;
  ep_log_at(EP_LOG_INFO, g->rank, "teardown", "group released (local)");
  group_free(g);
  return EP_OK;
}
