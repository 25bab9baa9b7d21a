/* Hosts of a group: which ranks share a machine (and so shared memory or CUDA IPC), from what
 * every rank says about itself. Every rank computes the same answer from the same gathered
 * identities, so a bad split fails on every rank alike, named.
 *
 * A rank's host is, first match: EP_HOST_ID (its value names the host), EP_HOSTS=H (the job's
 * consecutive ranks split into H pretend hosts, for tests and benchmarks on one machine), else
 * the machine it runs on (hostname and boot id). Hosts are numbered in the order of their lowest
 * rank; a rank's local index is its place among the ranks of its host, by rank. Every host must
 * hold the same number of ranks: the hierarchical data path pairs rank (host g, local l) with
 * the rank of the same local index on every other host. */
#include "topo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void ep_ident_fill(ep_ident_t *me, const char *hostkey) {
  memset(me, 0, sizeof *me);
  me->pid = (int32_t)getpid();
  me->hosts = (int32_t)ep_env_int("EP_HOSTS");
  const char *id = ep_env_str("EP_HOST_ID");
  me->has_id = id && *id;
  if (me->has_id) snprintf(me->host_id, sizeof me->host_id, "%s", id);
  snprintf(me->hostkey, sizeof me->hostkey, "%s", hostkey);
}

bool ep_ident_wants_hosts(const ep_ident_t *me) {
  return me->has_id || me->hosts > 1;
}

/* The name of rank r's host, by the rule above (pretend hosts: "EP_HOSTS part g"). */
static void key_of(const ep_ident_t *all, int R, int r, char *out, size_t n) {
  if (all[r].has_id)
    snprintf(out, n, "id:%s", all[r].host_id);
  else if (all[r].hosts > 1)
    snprintf(out, n, "part:%d", r / (R / all[r].hosts));
  else
    snprintf(out, n, "machine:%s", all[r].hostkey);
}

/* Ranks must agree on how hosts are named before the names can be compared. */
static ep_status_t check_rule(const ep_ident_t *all, int R) {
  for (int r = 1; r < R; r++) {
    if (all[r].has_id != all[0].has_id) {
      int with = all[0].has_id ? 0 : r, without = all[0].has_id ? r : 0;
      return ep_err(EP_ERR_INVALID_ARG,
                    "EP_HOST_ID is set on rank %d ('%s') but not on rank %d: "
                    "set it on every rank or on none",
                    with, all[with].host_id, without);
    }
    if (!all[0].has_id && all[r].hosts != all[0].hosts)
      return ep_err(EP_ERR_MISMATCH,
                    "EP_HOSTS is %d on rank 0 and %d on rank %d: set the same "
                    "value on every rank",
                    all[0].hosts, all[r].hosts, r);
  }
  if (!all[0].has_id && all[0].hosts > 1 && R % all[0].hosts)
    return ep_err(EP_ERR_SHAPE,
                  "EP_HOSTS=%d does not divide the %d ranks of the group (every "
                  "host holds the same number of ranks)",
                  all[0].hosts, R);
  return EP_OK;
}

/* Ranks of one host share memory: they must run on one machine. */
static ep_status_t check_machines(const ep_ident_t *all, const ep_topo_t *t, int R) {
  for (int r = 0; r < R; r++) {
    int first = t->rank_at[t->host_of[r] * t->local_size];
    if (strcmp(all[r].hostkey, all[first].hostkey))
      return ep_err(EP_ERR_INVALID_ARG,
                    "ranks %d and %d form host %d (%s) but run on different "
                    "machines (%.40s, %.40s): the ranks of one host share memory, so they must "
                    "run on one machine",
                    first, r, t->host_of[r],
                    all[r].has_id ? "same EP_HOST_ID" : "same EP_HOSTS part", all[first].hostkey,
                    all[r].hostkey);
  }
  return EP_OK;
}

static ep_status_t number_hosts(const ep_ident_t *all, int R, ep_topo_t *t, int *count) {
  char(*keys)[96] = calloc((size_t)R, sizeof *keys);
  if (!keys) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  int H = 0;
  for (int r = 0; r < R; r++) {
    char k[96];
    key_of(all, R, r, k, sizeof k);
    int h = 0;
    while (h < H && strcmp(keys[h], k)) h++;
    if (h == H) snprintf(keys[H++], sizeof keys[0], "%s", k);
    t->local_of[r] = count[h]++;
    t->host_of[r] = h;
  }
  t->nhosts = H;
  ep_status_t st = EP_OK;
  for (int h = 1; h < H && !st; h++)
    if (count[h] != count[0])
      st = ep_err(EP_ERR_SHAPE,
                  "host %d (%.60s) has %d rank(s) and host 0 (%.60s) has %d: every "
                  "host must hold the same number of ranks",
                  h, keys[h], count[h], keys[0], count[0]);
  free(keys);
  return st;
}

ep_status_t ep_topo_build(const ep_ident_t *all, int R, int me, ep_topo_t *t) {
  memset(t, 0, sizeof *t);
  ep_status_t st = check_rule(all, R);
  if (st) return st;
  int *mem = calloc((size_t)R * 4, sizeof *mem);
  if (!mem) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  t->mem = mem;
  t->host_of = mem, t->local_of = mem + R, t->rank_at = mem + 2 * R;
  int *count = mem + 3 * R;
  if ((st = number_hosts(all, R, t, count))) {
    ep_topo_free(t);
    return st;
  }
  t->local_size = count[0];
  for (int r = 0; r < R; r++) t->rank_at[t->host_of[r] * t->local_size + t->local_of[r]] = r;
  if ((st = check_machines(all, t, R))) {
    ep_topo_free(t);
    return st;
  }
  t->host = t->host_of[me];
  t->local_rank = t->local_of[me];
  return EP_OK;
}

ep_status_t ep_topo_single(int R, int me, ep_topo_t *t) {
  memset(t, 0, sizeof *t);
  int *mem = calloc((size_t)R * 4, sizeof *mem);
  if (!mem) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  t->mem = mem;
  t->host_of = mem, t->local_of = mem + R, t->rank_at = mem + 2 * R;
  for (int r = 0; r < R; r++) t->local_of[r] = r, t->rank_at[r] = r;
  t->nhosts = 1, t->local_size = R, t->local_rank = me;
  return EP_OK;
}

void ep_topo_free(ep_topo_t *t) {
  free(t->mem);
  memset(t, 0, sizeof *t);
}
