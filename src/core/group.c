/* Groups: creation from the environment or from user callbacks (group_ops.c has their use and
 * teardown). */
#include "group.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define RENDEZVOUS_MAX EP_RENDEZVOUS_MAX

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
  double t = ep_env_real("EP_TIMEOUT_S");
  return t > 0 ? t : 100.0;
}

ep_status_t ep_group_fail(ep_group *g, ep_status_t st, const char *op) {
  ep_err_prefix(op);
  ep_errbox_put(&g->err, ep_last_error());
  return st;
}

void ep_group_free(ep_group *g) {
  if (!g) return;
  ep_boot_close(&g->boot);
  /* The world engine goes last: closing it may finalize MPI (when epcomm initialized it). */
  ep_world_close(g->world, !g->peer_lost);
  ep_live_fini(&g->live);
  ep_topo_free(&g->topo);
  free(g->hostkeys);
  free(g->buffers);
  pthread_mutex_destroy(&g->lock);
  pthread_mutex_destroy(&g->boot_lock);
  pthread_mutex_destroy(&g->how_lock);
  ep_errbox_fini(&g->err);
  g->magic = 0;
  free(g);
}

/* The launcher's socket (a socket, not any fd that happens to carry the number). */
static int notify_fd_from_env(void) {
  long fd = ep_env_long("EP_NOTIFY_FD", -1);
  struct stat sb;
  if (fd < 0 || fd > 1 << 20 || fstat((int)fd, &sb) != 0 || !S_ISSOCK(sb.st_mode)) return -1;
  return (int)fd;
}

/* Tells `epcomm launch` that this rank starts to create a group ("join") and that its group is
 * complete ("up"): in between, the launcher reports any rank's exit (status 0 included) to the
 * others, who would otherwise wait for it until their deadline. */
static void tell_launcher(int notify_fd, const char *what, int rank) {
  char msg[64];
  int n = snprintf(msg, sizeof msg, "%s rank=%d pid=%d\n", what, rank, (int)getpid());
  if (notify_fd >= 0) (void)!send(notify_fd, msg, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Pids and machines of every rank; liveness watches the ranks of this host. */
static ep_status_t keep_identities(ep_group *g, const ep_ident_t *all) {
  g->hostkeys = calloc((size_t)g->nranks, sizeof *g->hostkeys);
  if (!g->hostkeys) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  for (int r = 0; r < g->nranks; r++) {
    memcpy(g->hostkeys[r], all[r].hostkey, EP_HOSTKEY_MAX);
    g->hostkeys[r][EP_HOSTKEY_MAX - 1] = '\0';
    if (g->topo.host_of[r] == g->topo.host)
      ep_live_set_pid(&g->live, g->topo.local_of[r], all[r].pid,
                      !strcmp(all[r].hostkey, all[g->rank].hostkey));
  }
  return EP_OK;
}

/* One host: connect every rank, exchange pids and machines. The liveness watch starts first: a
 * rank that dies before it connects is reported by the launcher. */
static ep_status_t group_init(ep_group *g, const char *name, const uint8_t *key, int notify_fd,
                              const ep_ident_t *mine) {
  double deadline = ep_now() + g->timeout_s;
  if (ep_live_init(&g->live, g->rank, g->nranks, notify_fd) != 0)
    return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_status_t st = ep_topo_single(g->nranks, g->rank, &g->topo);
  if (!st) st = ep_boot_open(&g->boot, name, key, g->rank, g->nranks, &g->live, deadline);
  if (st) return st;
  ep_ident_t *all = calloc((size_t)g->nranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_boot_begin(&g->boot, EP_OP_GROUP_CREATE);
  st = ep_boot_allgather(&g->boot, mine, all, sizeof *mine, EP_OK, deadline);
  if (!st) st = keep_identities(g, all);
  free(all);
  return st;
}

/* Across hosts: the world engine carries the group's exchanges; the ranks of each host meet on
 * their own local channel ("<rendezvous>.h<host>"), for what only a host can share. Identities
 * first, so that a bad split of hosts fails on every rank alike before anyone waits for a local
 * channel that cannot form. */
static ep_status_t group_init_net(ep_group *g, const char *name, const uint8_t *key, int notify_fd,
                                  const ep_ident_t *mine) {
  double deadline = ep_now() + g->timeout_s;
  ep_ident_t *all = calloc((size_t)g->nranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_boot_begin(&g->boot, EP_OP_GROUP_CREATE);
  int peer;
  ep_ident_t me = *mine;
  ep_status_t st = ep_world_open(&g->world, g->rank, g->nranks, deadline);
  if (!st) me.beat_ms = ep_heartbeat_wanted_ms(g->world);
  if (!st)
    st = ep_world_allgather(g->world, EP_OP_GROUP_CREATE, g->boot.seq, &me, all, sizeof me, EP_OK,
                            deadline, g->timeout_s, NULL, NULL, &peer);
  if (!st) st = ep_topo_build(all, g->nranks, g->rank, &g->topo);
  if (!st && g->topo.nhosts > 1) { /* ring of hosts: watch the next, be watched by the previous */
    const ep_topo_t *t = &g->topo;
    int H = t->nhosts, L = t->local_size, ms = all[0].beat_ms;
    for (int r = 1; r < g->nranks; r++) /* the same on every rank: off if any rank is off */
      ms = all[r].beat_ms <= 0 || ms <= 0 ? 0 : all[r].beat_ms > ms ? all[r].beat_ms : ms;
    st = ep_heartbeat_start(g->world, t->rank_at[((t->host + 1) % H) * L + t->local_rank],
                            t->rank_at[((t->host + H - 1) % H) * L + t->local_rank], ms / 1e3,
                            &g->world->hb);
  }
  if (!st && ep_live_init(&g->live, g->topo.local_rank, g->topo.local_size, notify_fd) != 0)
    st = ep_err(EP_ERR_NO_MEMORY, "out of memory");
  if (!st) st = keep_identities(g, all);
  free(all);
  char local[EP_RENDEZVOUS_MAX];
  snprintf(local, sizeof local, "%.68s.h%d", name, g->topo.host);
  if (!st)
    st = ep_boot_open(&g->boot, local, key, g->topo.local_rank, g->topo.local_size, &g->live,
                      deadline);
  if (!st) ep_boot_begin(&g->boot, EP_OP_GROUP_CREATE); /* the local channel counts alike */
  return st;
}

/* Spanning hosts needs the world engine, which needs a launcher that starts MPI jobs. Said
 * before anything is loaded, for a job started by `epcomm launch` without --hosts. */
static ep_status_t check_world_launcher(const ep_ident_t *mine, const char *op) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", NULL};
  for (int i = 0; vars[i]; i++)
    if (getenv(vars[i])) return EP_OK;
  if (mine->has_id)
    return ep_err(EP_ERR_BOOTSTRAP,
                  "%s: EP_HOST_ID=%s puts ranks on several hosts, which talk "
                  "through MPI: start the ranks with mpirun (or srun --mpi=pmix)",
                  op, mine->host_id);
  if (mine->hosts <= 1)
    return ep_err(EP_ERR_BOOTSTRAP,
                  "%s: the job's ranks run on several machines, whose groups "
                  "talk through MPI: start the ranks with mpirun --hostfile or srun --mpi=pmix "
                  "(torchrun across machines is not supported yet)",
                  op);
  return ep_err(EP_ERR_BOOTSTRAP,
                "%s: EP_HOSTS=%d splits the job into %d hosts, which talk "
                "through MPI: start the ranks with `epcomm launch -n R --hosts %d` or mpirun",
                op, mine->hosts, mine->hosts, mine->hosts);
}

/* A job whose ranks are not all on this machine spans hosts: mpirun, srun and torchrun say how
 * many of the job's ranks run here. (torchrun jobs across machines then need MPI too: said by
 * check_world_launcher, instead of ranks waiting for peers that can never reach them.) */
static bool job_spans_machines(void) {
  static const char *const pairs[][2] = {{"OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"},
                                         {"LOCAL_WORLD_SIZE", "WORLD_SIZE"}};
  for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
    const char *local = getenv(pairs[i][0]), *all = getenv(pairs[i][1]);
    if (local && all && strcmp(local, all)) return true;
  }
  const char *nodes = getenv("SLURM_STEP_NUM_NODES");
  return nodes && strcmp(nodes, "1") && getenv("PMIX_RANK");
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
  pthread_mutex_init(&g->how_lock, NULL);
  ep_errbox_init(&g->err);
  *out = g;
  return EP_OK;
}

static ep_status_t group_finish(ep_group *g, const char *op, const char *name, const uint8_t *key,
                                int notify_fd, const ep_ident_t *mine, bool net, ep_group_t *out) {
  ep_status_t st = net ? group_init_net(g, name, key, notify_fd, mine)
                       : group_init(g, name, key, notify_fd, mine);
  if (!st) st = ep_reg_add(EP_OBJ_GROUP, g, g->rank, &g->id);
  if (st) {
    ep_err_prefix(op);
    ep_log_at(EP_LOG_INFO, g->rank, "init", "group creation failed: %s", ep_last_error());
    ep_group_free(g);
    return st;
  }
  ep_log_at(EP_LOG_INFO, g->rank, "init",
            "group %#" PRIx64
            " up: %d ranks on %d host(s) (this "
            "rank: host %d, local rank %d of %d), rendezvous %s, timeout %.1f s",
            g->id, g->nranks, g->topo.nhosts, g->topo.host, g->topo.local_rank, g->topo.local_size,
            name, g->timeout_s);
  tell_launcher(notify_fd, "up", g->rank);
  *out = ep_id_to_ptr(g->id);
  return EP_OK;
}

/* Also the first read of the environment: an invalid EP_* value fails the creation, named,
 * rather than being replaced by its default. */
static ep_status_t load_group_config(const ep_group_config_t *cfg, ep_group_config_t *c,
                                     const char *op) {
  *c = (ep_group_config_t)EP_GROUP_CONFIG_INIT;
  ep_status_t st = cfg ? ep_struct_load(c, sizeof *c, cfg, "cfg", true) : EP_OK;
  if (!st && (st = ep_env_check())) ep_err_named(st, op, NULL);
  return st;
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
  bool torchrun; /* the job is named by torch_job_id */
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
 * have; its run id names the job when the store is not given. NULL: neither (then the job's
 * other launchers name it, src/core/job.c). EP_JOB_ID, when set, wins over both. */
static const char *torch_job_id(char *buf, size_t n) {
  const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
  const char *run = getenv("TORCHELASTIC_RUN_ID"), *given = env_get("EP_JOB_ID");
  if (given && *given) return NULL;
  if (addr && *addr && port && *port)
    snprintf(buf, n, "torch-%s:%s", addr, port);
  else if (run && *run && strcmp(run, "none") != 0)
    snprintf(buf, n, "torch-%s", run);
  else
    return NULL;
  return buf;
}

ep_status_t ep_group_create_from_env(const ep_group_config_t *cfg, ep_group_t *group) {
  if (!group) return ep_err(EP_ERR_NULL_ARG, "ep_group_create_from_env: group is NULL");
  ep_group_config_t c;
  ep_status_t st = load_group_config(cfg, &c, "ep_group_create_from_env");
  if (st) return st;
  int rank, nranks;
  const env_source_t *src = env_ranks(&rank, &nranks);
  if (!src)
    return ep_err(EP_ERR_BOOTSTRAP,
                  "ep_group_create_from_env: no rank in the environment "
                  "(EP_RANK/EP_NRANKS): start the program with `epcomm launch -n R`, torchrun "
                  "or mpirun");
  if (nranks < 1 || rank >= nranks)
    return ep_err(EP_ERR_OUT_OF_RANGE, "ep_group_create_from_env: rank %d of %d (%s, %s)", rank,
                  nranks, src->rank, src->size);
  char job[64], name[RENDEZVOUS_MAX], torch_job[64];
  uint8_t key[EP_KEY_BYTES];
  const char *given = c.job_id;
  if (!given && src->torchrun) given = torch_job_id(torch_job, sizeof torch_job);
  if ((st = ep_job_from_env(given, job, sizeof job, key))) return st;
  /* Every rank creates its groups in the same order, so the counter agrees across ranks. */
  snprintf(name, sizeof name, "%.60s.%u", job, ep_reg_next_env_group());
  ep_ident_t me;
  char hk[EP_HOSTKEY_MAX];
  host_key(hk);
  ep_ident_fill(&me, hk);
  bool net = ep_ident_wants_hosts(&me) || job_spans_machines();
  if (net && (st = check_world_launcher(&me, "ep_group_create_from_env"))) return st;
  ep_group *g = NULL; /* set by group_new on success (gcc -O3 cannot see that) */
  if ((st = group_new(rank, nranks, &c, &g))) return st;
  int notify_fd = notify_fd_from_env();
  tell_launcher(notify_fd, "join", rank);
  return group_finish(g, "ep_group_create_from_env", name, key, notify_fd, &me, net, group);
}

typedef struct {
  char name[RENDEZVOUS_MAX];
  uint8_t key[EP_KEY_BYTES];
  ep_ident_t ident; /* every rank's own: whether the group spans hosts */
} rendezvous_t;

/* Does any rank ask for hosts, or run on another machine than rank 0? */
static bool spans_hosts(const rendezvous_t *all, int R) {
  for (int r = 0; r < R; r++)
    if (ep_ident_wants_hosts(&all[r].ident) || strcmp(all[r].ident.hostkey, all[0].ident.hostkey))
      return true;
  return false;
}

static ep_status_t random_rendezvous(rendezvous_t *rv) {
  uint64_t rnd;
  if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd ||
      getrandom(rv->key, EP_KEY_BYTES, 0) != EP_KEY_BYTES)
    return ep_err(EP_ERR_SYSTEM, "ep_group_create: getrandom: %s", strerror(errno));
  snprintf(rv->name, sizeof rv->name, "cb.%d.%016" PRIx64, (int)getpid(), rnd);
  return EP_OK;
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
  if ((st = load_group_config(cfg, &c, "ep_group_create"))) return st;
  /* Rank 0 picks a random rendezvous name and job key; the user's allgather carries them to
   * everyone (and to no one else: the callbacks are the user's own channel). */
  rendezvous_t mine, *all = calloc((size_t)boot->nranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  memset(&mine, 0, sizeof mine);
  char hk[EP_HOSTKEY_MAX];
  host_key(hk);
  ep_ident_fill(&mine.ident, hk);
  if (boot->rank == 0 && (st = random_rendezvous(&mine))) {
    free(all);
    return st;
  }
  int cb = boot->allgather(boot->ctx, &mine, all, sizeof mine);
  bool net = cb == 0 && spans_hosts(all, boot->nranks);
  rendezvous_t rv = all[0];
  ep_ident_t ident = mine.ident; /* the secrets are wiped below, not who this rank is */
  explicit_bzero(all, (size_t)boot->nranks * sizeof *all);
  explicit_bzero(&mine, sizeof mine);
  free(all);
  if (cb != 0)
    return ep_err(EP_ERR_BOOTSTRAP, "ep_group_create: the user allgather callback failed");
  rv.name[RENDEZVOUS_MAX - 1] = '\0';
  if (net && (st = check_world_launcher(&ident, "ep_group_create"))) return st;
  ep_group *g = NULL; /* set by group_new on success (gcc -O3 cannot see that) */
  st = group_new(boot->rank, boot->nranks, &c, &g);
  if (!st) st = group_finish(g, "ep_group_create", rv.name, rv.key, -1, &ident, net, group);
  explicit_bzero(&rv, sizeof rv);
  /* The callbacks' own barrier keeps the user's framework in step with ours. */
  if (!st && boot->barrier && boot->barrier(boot->ctx) != 0) {
    ep_group_release(*group);
    *group = NULL;
    st = ep_err(EP_ERR_BOOTSTRAP, "ep_group_create: the user barrier callback failed");
  }
  return st;
}
