/* The CPU backend's ops table, and buffer create/destroy. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"
#include "cpu_ll.h"
#include "cpu_net.h"

static ep_status_t cpu_size_hint(const ep_buffer_config_t *cfg, int nranks, size_t *bytes) {
  cpu_seg_hdr_t l;
  *bytes = cpu_seg_size(nranks, nranks, cfg->num_channels, cfg->queue_bytes, cfg, &l);
  return EP_OK;
}

/* A segment's pages are backed only once written, but one that could never be backed in full is
 * a mistake of the config (e.g. low-latency sizes far beyond the host), said now rather than as
 * a SIGBUS mid-run. */
static ep_status_t cpu_check_config(const ep_buffer_config_t *cfg, int nranks) {
  size_t bytes;
  cpu_size_hint(cfg, nranks, &bytes);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  double ram = pages > 0 && page > 0 ? (double)pages * (double)page : 0;
  if (ram > 0 && (double)bytes > ram)
    return ep_err(EP_ERR_TOO_LARGE,
                  "cfg: one rank's segment would take %.1f GiB (low-latency "
                  "sizes T=%d, H=%d, E=%d, K=%d; queues %zu x %d channels x %d ranks) but this "
                  "host has %.1f GiB of memory",
                  (double)bytes / (1 << 30), cfg->ll_max_tokens, cfg->ll_hidden,
                  cfg->ll_num_experts, cfg->ll_max_topk, cfg->queue_bytes, cfg->num_channels,
                  nranks, ram / (1 << 30));
  return EP_OK;
}

/* clean: the engine endpoints close with every rank (after a successful quiesce). */
static void state_free(cpu_state_t *s, bool clean) {
  cpu_net_destroy(s, clean);
  cpu_ll_destroy(s);
  cpu_workers_stop(s);
  cpu_seg_teardown(s);
  free(s);
}

static ep_status_t cpu_create(ep_ctx_t *ctx, const ep_buffer_config_t *cfg, void **state) {
  cpu_state_t *s = calloc(1, sizeof *s);
  if (!s) return ep_ctx_fail(ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  s->ctx = ctx;
  s->topo = ep_ctx_topo(ctx);
  s->grank = ep_ctx_rank(ctx);
  s->gnranks = ep_ctx_nranks(ctx);
  /* Shared memory joins the ranks of one host; across hosts the network engine does the rest. */
  s->rank = s->topo->local_rank;
  s->nranks = s->topo->local_size;
  s->channels = cfg->num_channels;
  s->queue_bytes = cfg->queue_bytes;
  s->spin_s = 1e-6 * (double)ep_env_int("EP_SPIN_US");
  ep_status_t st = cpu_workers_start(s);
  if (!st) st = cpu_seg_setup(s, cfg);
  if (!st) st = cpu_ll_create(s, cfg);
  if (!st && s->topo->nhosts > 1) st = cpu_net_create(s);
  if (st) {
    state_free(s, !ep_ctx_peer_lost(ctx));
    return st;
  }
  *state = s;
  return EP_OK;
}

static ep_status_t cpu_destroy(void *state, bool collective) {
  cpu_state_t *s = state;
  ep_status_t st = EP_OK;
  /* Quiesce: no peer may still be moving data through our segment when we unmap it (their own
   * mapping would survive, but their call would then wait for us in vain). */
  if (collective) st = ep_ctx_barrier(s->ctx);
  /* Engine endpoints close cleanly unless a peer is gone (MPI would wait for it). */
  state_free(s, !ep_ctx_peer_lost(s->ctx));
  return st;
}

static ep_status_t cpu_available(void) {
  return EP_OK;
} /* shared memory: every Linux host */

static const struct ep_backend_ops cpu_ops = {
    .name = "cpu",
    .id = EP_BACKEND_CPU,
    .caps = 0,
    .dispatch_view_lifetime = EP_LIFETIME_NONE,
    .ll_view_lifetime = EP_LIFETIME_HANDLE,
    .available = cpu_available,
    .check_config = cpu_check_config,
    .size_hint = cpu_size_hint,
    .create = cpu_create,
    .destroy = cpu_destroy,
    .layout = cpu_layout,
    .dispatch = cpu_dispatch,
    .combine = cpu_combine,
    .reject = cpu_reject,
    .ll_dispatch = cpu_ll_dispatch,
    .ll_recv = cpu_ll_recv,
    .ll_combine = cpu_ll_combine,
    .ll_view = cpu_ll_view,
    .ll_combine_buffer = cpu_ll_combine_buffer,
    .ll_release = cpu_ll_release,
    .ll_reject = cpu_ll_reject,
    .traffic = cpu_net_traffic,
};

const struct ep_backend_ops *ep_backend_cpu(void) {
  return &cpu_ops;
}
