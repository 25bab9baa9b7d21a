/* The CPU backend across hosts: engine endpoints, staging, the count exchange, waits. The data
 * paths are in cpu_net_dispatch.c, cpu_net_combine.c and cpu_net_ll.c (cpu_net.h). */
#include "cpu_net.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ll.h"

/* Both ends of a block must cut it into the same chunks: every rank uses the smallest value any
 * rank has (EP_NET_CHUNK may differ between hosts). */
static ep_status_t agree_chunk(cpu_state_t *s) {
  uint64_t mine = s->net->chunk, *all = calloc((size_t)s->gnranks, sizeof *all);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  ep_status_t st = ep_ctx_allgather(s->ctx, &mine, all, sizeof mine);
  for (int r = 0; !st && r < s->gnranks; r++)
    if (all[r] < s->net->chunk) s->net->chunk = all[r];
  free(all);
  return st;
}

/* More ranks on this host than CPUs they may use: a waiter that spins only takes the CPU from
 * the rank it waits for (the hierarchical path waits often: forwarders in lockstep with the
 * ranks they serve). Then waiters sleep at once, unless EP_SPIN_US says otherwise. */
static void spin_policy(cpu_state_t *s) {
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  if (!ep_env_text("EP_SPIN_US") && cpus > 0 && s->nranks > cpus) s->spin_s = 0;
}

/* One engine endpoint per mode: their calls are independent sequences (SEMANTICS.md §1.4). */
ep_status_t cpu_net_create(cpu_state_t *s) {
  spin_policy(s);
  cpu_net_t *n = calloc(1, sizeof *n);
  if (!n) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  s->net = n;
  n->chunk = (size_t)ep_env_int("EP_NET_CHUNK");
  n->cw = (int)(sizeof(ep_call_key_t) / 4) + s->gnranks + s->topo->nhosts;
  n->counts = malloc((size_t)s->gnranks * (size_t)n->cw * sizeof *n->counts);
  if (!n->counts)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  ep_status_t st = agree_chunk(s);
  if (!st) st = ep_ctx_net_open(s->ctx, "mpi", -1, &n->e, &n->normal);
  if (!st && s->ll) st = ep_ctx_net_open(s->ctx, "mpi", -1, &n->e, &n->ll);
  if (!st && s->ll) st = cpu_net_ll_create(s);
  if (st) return ep_ctx_fail(s->ctx, st, -1, "ep_buffer_create", "network", "%s", ep_last_error());
  return EP_OK;
}

void cpu_net_destroy(cpu_state_t *s, bool clean) {
  cpu_net_t *n = s->net;
  if (!n) return;
  cpu_net_ll_destroy(s, clean);
  if (n->ll) n->e->close(n->ll, clean);
  if (n->normal) n->e->close(n->normal, clean);
  free(n->send.p), free(n->recv.p), free(n->counts);
  free(n);
  s->net = NULL;
}

void cpu_net_traffic(void *state, uint64_t *net, uint64_t *local) {
  cpu_state_t *s = state;
  *net = s->net ? atomic_load(&s->net->net_bytes) : 0;
  *local = s->net ? atomic_load(&s->net->local_bytes) : 0;
}

void *cpu_stage(cpu_state_t *s, cpu_stage_t *st, size_t bytes) {
  if (bytes <= st->cap) return st->p;
  size_t cap = bytes + bytes / 4 + 4096;
  unsigned char *p = aligned_alloc(64, (cap + 63) & ~(size_t)63);
  if (!p) {
    ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_dispatch", "network",
                "out of memory for %zu "
                "bytes of network staging",
                bytes);
    return NULL;
  }
  free(st->p);
  st->p = p, st->cap = cap;
  return p;
}

const char *cpu_net_who(const cpu_state_t *s, int rank, char *buf, size_t n) {
  return ep_ctx_who(s->ctx, rank, buf, n);
}

ep_status_t cpu_net_wait(cpu_state_t *s, ep_net_t *n, ep_net_xfer_t *x, int count, const char *op,
                         const char *phase) {
  return ep_ctx_net_wait(s->ctx, s->net->e, n, x, count, op, phase);
}

ep_status_t cpu_net_all_to_all(cpu_state_t *s, ep_net_t *n, int tag, const void *mine, void *all,
                               size_t bytes, const char *op, const char *phase) {
  return ep_ctx_net_allgather(s->ctx, s->net->e, n, tag, mine, all, bytes, op, phase);
}

ep_status_t cpu_net_counts(cpu_state_t *s, const int32_t *mine, const char *op) {
  cpu_net_t *n = s->net;
  cpu_call_begin(s);
  size_t bytes = (size_t)n->cw * sizeof *mine;
  ep_status_t st =
      cpu_net_all_to_all(s, n->normal, NET_TAG_COUNTS, mine, n->counts, bytes, op, "counts");
  if (st) return st;
  return ep_call_keys_check(s->ctx, op, (const ep_call_key_t *)mine, n->counts, (size_t)n->cw,
                            s->gnranks, s->grank);
}

/* A rejected call still takes part in the count exchange, so that the peers fail at once and
 * every rank's next call pairs with the right one. The caller's message is kept. */
void cpu_net_reject(cpu_state_t *s) {
  int32_t *mine = calloc((size_t)s->net->cw, sizeof *mine);
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  if (mine) {
    ((ep_call_key_t *)mine)->rejected = 1;
    ep_status_t st = cpu_net_counts(s, mine, "rejected call");
    if (st && st != EP_ERR_PEER_INVALID && st != EP_ERR_MISMATCH) ep_ctx_mark_broken(s->ctx);
  } else {
    ep_ctx_mark_broken(s->ctx);
  }
  free(mine);
  s->seq++;
  ep_ctx_restore_error(saved);
}
