/* The CUDA backend's ops table, and buffer create/destroy. */
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "cuda/cuda_ll.h"

static ep_status_t cuda_size_hint(const ep_buffer_config_t *cfg, int nranks, size_t *bytes) {
  epk_buf_t kb;
  epk_ll_layout_t ll;
  uint64_t off_ll;
  long arena_mb = ep_env_long("EP_CUDA_ARENA_MB", 64);
  /* pool (low-latency region included) + handle arena + private words and scratch */
  *bytes = cuda_pool_layout(nranks, cfg->num_channels, cfg->queue_bytes,
                            cuda_ll_region_bytes(cfg, nranks, &ll), &off_ll, &kb) +
           ((size_t)(arena_mb > 1 ? arena_mb : 1) << 20) + 4096 + 16ull * (size_t)nranks +
           4ull * EP_MAX_LOCAL_EXPERTS * (size_t)nranks + cuda_ll_private_bytes(cfg, nranks);
  return EP_OK;
}

static ep_status_t cuda_create(ep_ctx_t *ctx, const ep_buffer_config_t *cfg, void **state) {
  cuda_state_t *s = calloc(1, sizeof *s);
  if (!s) return ep_ctx_fail(ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  s->ctx = ctx;
  s->rank = ep_ctx_rank(ctx);
  s->nranks = ep_ctx_nranks(ctx);
  s->channels = cfg->num_channels;
  s->queue_bytes = cfg->queue_bytes;
  s->device = -1;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  ep_status_t st = cuda_mem_setup(s, cfg);
  if (st) {
    cuda_mem_teardown(s, false);
    free(s);
  } else {
    *state = s;
    EP_LOG(ctx, EP_LOG_INFO, "init", "cuda buffer on device %d: %d blocks, pool %llu bytes",
           s->device, s->kb.blocks, (unsigned long long)s->kb.pool_bytes);
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
            EP_CAP_COMBINE_BUFFER,
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
    .ll_dispatch = cuda_ll_dispatch,
    .ll_recv = cuda_ll_recv,
    .ll_combine = cuda_ll_combine,
    .ll_view = cuda_ll_view,
    .ll_combine_buffer = cuda_ll_combine_buffer,
    .ll_release = cuda_ll_release,
    .ll_reject = cuda_ll_reject,
};

const struct ep_backend_ops *ep_backend_cuda(void) { return &cuda_ops; }
