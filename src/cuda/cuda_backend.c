/* The CUDA backend's ops table, and buffer create/destroy. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "cuda/cuda_ll.h"
#include "cuda/cuda_net.h"

static ep_status_t cuda_size_hint(const ep_buffer_config_t *cfg, int nranks, size_t *bytes) {
  epk_buf_t kb;
  epk_ll_layout_t ll;
  uint64_t off_ll;
  long arena_mb = ep_env_int("EP_CUDA_ARENA_MB");
  /* pool (low-latency region included) + handle arena + private words and scratch */
  *bytes = cuda_pool_layout(nranks, cfg->num_channels, cfg->queue_bytes,
                            cuda_ll_region_bytes(cfg, nranks, &ll), &off_ll, &kb) +
           ((size_t)(arena_mb > 1 ? arena_mb : 1) << 20) + 4096 + 16ull * (size_t)nranks +
           16ull * EP_MAX_MEM_REGS * (size_t)nranks + 8ull * EP_MAX_LOCAL_EXPERTS * (size_t)nranks +
           sizeof(epk_plan_scr_t) + cuda_ll_private_bytes(cfg, nranks);
  return EP_OK;
}

/* EP_CUDA_TRACE=1: device memory for the phase sums of normal-mode calls (ep_kernels.h). */
static ep_status_t trace_setup(cuda_state_t *s) {
  if (!ep_env_int("EP_CUDA_TRACE")) return EP_OK;
  epk_trace_t *t = calloc(1, sizeof *t); /* ~74 KiB: not on the stack */
  if (!t) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "trace", "oom");
  epk_trace_fold(t); /* no call yet: points cleared, kind -1 */
  ep_status_t st =
      cuda_check(s, cudaMalloc((void **)&s->trace_mem, sizeof *t), "ep_buffer_create", "trace");
  if (!st)
    st = cuda_check(s, cudaMemcpy(s->trace_mem, t, sizeof *t, cudaMemcpyHostToDevice),
                    "ep_buffer_create", "trace");
  if (!st) s->kb.trace = s->trace_mem;
  free(t);
  return st;
}

static int cmp_u32(const void *a, const void *b) {
  const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* The median of phase i (EPK_TR_POINTS: the idle time before the call) over the kept calls of
 * kind k, in microseconds. */
static double trace_median(const epk_trace_t *t, int k, int i) {
  const int n = t->n[k] < EPK_TR_RING ? (int)t->n[k] : EPK_TR_RING;
  uint32_t v[EPK_TR_RING];
  for (int c = 0; c < n; c++) v[c] = i == EPK_TR_POINTS ? t->idle_ring[k][c] : t->ring[k][c][i];
  qsort(v, (size_t)n, sizeof v[0], cmp_u32);
  return n ? 1e-3 * (n % 2 ? (double)v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + v[n / 2])) : 0.0;
}

/* Per kind of call, one line of means and one of medians (of the last EPK_TR_RING calls) of
 * every phase, in microseconds, on stderr (kernels quiesced). */
static void trace_print(cuda_state_t *s) {
  static const char *kind[EPK_TR_KINDS] = {
      "dispatch (full)",         "dispatch (cached)",         "combine",
      "dispatch (full, arrays)", "dispatch (cached, arrays)", "dispatch (full, no wait)"};
  static const char *pt[EPK_TR_POINTS] = {"",
                                          "notify: plan",
                                          "post",
                                          "wait peers",
                                          "finish",
                                          "gap to data",
                                          "data: blocks' start spread",
                                          "data: first own part done",
                                          "data: own part, the rest",
                                          "data: peers",
                                          "data: rest"};
  epk_trace_t *t = malloc(sizeof *t);
  if (!t || cudaMemcpy(t, s->trace_mem, sizeof *t, cudaMemcpyDeviceToHost) != cudaSuccess) {
    free(t);
    return;
  }
  epk_trace_fold(t); /* the last call */
  for (int k = 0; k < EPK_TR_KINDS; k++) {
    for (int med = 0; t->n[k] && med < 2; med++) {
      char line[768];
      const double n = (double)t->n[k];
      int o =
          snprintf(line, sizeof line, "epcomm trace rank %d: %-25s %6llu calls, %s us: total %.1f",
                   s->rank, kind[k], (unsigned long long)t->n[k], med ? "median" : "mean",
                   med ? trace_median(t, k, 0) : 1e-3 * (double)t->sum[k][0] / n);
      for (int i = 1; i < EPK_TR_POINTS && o > 0 && o < (int)sizeof line; i++)
        o += snprintf(line + o, sizeof line - (size_t)o, ", %s %.1f", pt[i],
                      med ? trace_median(t, k, i) : 1e-3 * (double)t->sum[k][i] / n);
      /* The idle time by its median only: its mean holds the pauses between a program's loops
       * (checks, barriers, other work), hundreds of microseconds or more. */
      if (med && o > 0 && o < (int)sizeof line)
        snprintf(line + o, sizeof line - (size_t)o, "; idle before %.1f",
                 trace_median(t, k, EPK_TR_POINTS));
      fprintf(stderr, "%s\n", line);
    }
  }
  free(t);
}

static void cuda_path_counts(void *state, ep_buffer_info_t *i) {
  cuda_state_t *s = state;
  i->combines_in_place = cuda_path_count(s, CUDA_PATH_COMBINE_IN_PLACE);
  i->dispatches_in_place = cuda_path_count(s, CUDA_PATH_DISPATCH_IN_PLACE);
  i->dispatches_early = cuda_path_count(s, CUDA_PATH_DISPATCH_EARLY);
  i->combines_copied = cuda_path_count(s, CUDA_PATH_COMBINE_COPIED);
  /* The GPU decides and counts (dispatch.cu); a call still running may not be in yet. */
  i->dispatches_pulled = __atomic_load_n(&s->host->pulled, __ATOMIC_ACQUIRE);
}

static ep_status_t cuda_create(ep_ctx_t *ctx, const ep_buffer_config_t *cfg, void **state) {
  cuda_state_t *s = calloc(1, sizeof *s);
  if (!s) return ep_ctx_fail(ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  int hosts = ep_ctx_topo(ctx)->nhosts;
  s->ctx = ctx;
  s->rank = ep_ctx_rank(ctx);
  s->nranks = ep_ctx_nranks(ctx);
  s->channels = cfg->num_channels;
  s->queue_bytes = cfg->queue_bytes;
  s->device = -1;
  s->late_hello = ep_env_int("EP_CUDA_LATE_HELLO") != 0;
  s->pull = ep_env_int("EP_CUDA_PULL") != 0;
  s->early_data = ep_env_int("EP_CUDA_EARLY_DATA") != 0;
  s->combine_copy = ep_env_int("EP_CUDA_COMBINE_COPY") != 0;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  ep_status_t st = cuda_mem_setup(s, cfg);
  if (!st) st = trace_setup(s);
  if (!st && hosts > 1) st = cuda_net_create(s, cfg);
  if (st) {
    cuda_net_destroy(s, false);
    if (s->trace_mem) cudaFree(s->trace_mem);
    cuda_mem_teardown(s, false);
    free(s);
  } else {
    *state = s;
    EP_LOG(ctx, EP_LOG_INFO, "init",
           "cuda buffer on device %d: %d blocks, pool %llu bytes, flags between ranks at %s "
           "scope",
           s->device, s->kb.blocks, (unsigned long long)s->kb.pool_bytes,
           s->kb.one_gpu ? "gpu (every rank on this GPU)" : "system");
  }
  if (prev >= 0) cudaSetDevice(prev);
  return st;
}

static ep_status_t cuda_destroy(void *state, bool collective) {
  cuda_state_t *s = state;
  ep_status_t st = EP_OK;
  int prev;
  cuda_set_device(s->device, &prev);
  /* A local release never waits for peers: kernels still waiting on them stop now. */
  if (!collective) __atomic_store_n(&s->host->abort, 1u, __ATOMIC_RELEASE);
  /* Quiesce: our kernels first (bounded), then every rank's (barrier), so that no peer still
   * writes into a pool when it goes away. */
  if (!cuda_quiesce(s, collective ? ep_ctx_timeout(s->ctx) : 1.0) && collective)
    st = ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, -1, "ep_buffer_destroy", "quiesce",
                     "kernels of this buffer did not finish; they were told to stop");
  if (collective && !st) st = ep_ctx_barrier(s->ctx);
  if (s->trace_mem) {
    if (!st) trace_print(s);
    cudaFree(s->trace_mem);
  }
  cuda_net_destroy(s, collective && !st);
  cuda_mem_teardown(s, collective && !st);
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
  free(s);
  return st;
}

/* Built in is not enough: the static runtime loads the driver on first use, and a machine
 * without one (or without a device) says so here. */
static ep_status_t cuda_available(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    return ep_err(EP_ERR_UNSUPPORTED, "no usable GPU: %s", cudaGetErrorString(e));
  if (n < 1) return ep_err(EP_ERR_UNSUPPORTED, "no usable GPU: no CUDA device");
  return EP_OK;
}

static const struct ep_backend_ops cuda_ops = {
    .name = "cuda",
    .id = EP_BACKEND_CUDA,
    .caps = EP_CAP_DISPATCH_VIEWS | EP_CAP_DEVICE_MEMORY | EP_CAP_GRAPH_CAPTURE |
            EP_CAP_COMBINE_BUFFER | EP_CAP_REGISTER_MEMORY,
    /* Across hosts every call waits on the host (counts, gate, network) and registrations are
     * refused (cuda_net.h, cuda_reg.c). */
    .caps_one_host = EP_CAP_GRAPH_CAPTURE | EP_CAP_REGISTER_MEMORY,
    .dispatch_view_lifetime = EP_LIFETIME_NEXT_DISPATCH,
    .ll_view_lifetime = EP_LIFETIME_HANDLE,
    .available = cuda_available,
    .size_hint = cuda_size_hint,
    .create = cuda_create,
    .destroy = cuda_destroy,
    .layout = cuda_layout,
    .dispatch = cuda_dispatch,
    .combine = cuda_combine,
    .combine_buffer = cuda_combine_buffer,
    .reject = cuda_reject,
    .mem_register = cuda_mem_register,
    .mem_deregister = cuda_mem_deregister,
    .ll_dispatch = cuda_ll_dispatch,
    .ll_recv = cuda_ll_recv,
    .ll_combine = cuda_ll_combine,
    .ll_view = cuda_ll_view,
    .ll_combine_buffer = cuda_ll_combine_buffer,
    .ll_release = cuda_ll_release,
    .ll_reject = cuda_ll_reject,
    .traffic = cuda_net_traffic,
    .path_counts = cuda_path_counts,
};

const struct ep_backend_ops *ep_backend_cuda(void) {
  return &cuda_ops;
}
