/* The NCCL engine (src/net/net_nccl.c) through the network layer's contract, on GPU memory:
 * open (rank 0's unique id through the group's exchange), batches of grouped sends and receives
 * between every pair of ranks (sizes from 16 bytes to 8 MiB, each checked byte for byte), and a
 * clean close; then a cuda buffer (its own NCCL endpoint across hosts) is created and destroyed,
 * with and without low-latency sizes (tests/test_ll and test_normal check the data).
 *
 * Run across pretend hosts under mpirun (tools/gpu_check.sh, step net): every rank claims its own
 * NCCL host (NCCL_HOSTID), so that several ranks can share one GPU; NCCL then uses its socket
 * transport. Exits 77 ("skipped: ...") without a GPU, without NCCL, or in a build without the
 * engine. */
#include "common.h"
#include "core/backend.h" /* the network layer's contract and ep_now */

#ifdef EP_HAVE_CUDA
#include <cuda_runtime_api.h>

static ep_status_t allgather(void *ctx, const void *send, void *recv, size_t bytes) {
  return ep_group_allgather(ctx, send, recv, bytes);
}

static uint8_t pattern(int from, int to, int round, size_t i) {
  return (uint8_t)(from * 31 + to * 7 + round * 13 + i * 3);
}

/* One round: every rank sends `bytes` to every other rank and receives as much from each. */
static void round_trip(const struct ep_net_engine *e, ep_net_t *n, int R, int me, size_t bytes,
                       int round, cudaStream_t st) {
  ep_net_xfer_t *x = calloc(2 * (size_t)R, sizeof *x);
  uint8_t *host = malloc(bytes * 2 * (size_t)R), *dev = NULL;
  T_CHECK(x && host && cudaMalloc((void **)&dev, bytes * 2 * (size_t)R) == cudaSuccess, "alloc");
  for (int r = 0; r < R; r++)
    for (size_t i = 0; i < bytes; i++) host[(size_t)r * bytes + i] = pattern(me, r, round, i);
  T_CHECK(cudaMemcpy(dev, host, bytes * (size_t)R, cudaMemcpyHostToDevice) == cudaSuccess, "copy");
  T_CHECK(cudaMemset(dev + bytes * (size_t)R, 0xA5, bytes * (size_t)R) == cudaSuccess, "memset");
  int k = 0;
  for (int r = 0; r < R; r++) {
    if (r == me) continue;
    x[k++] = (ep_net_xfer_t){r, 1, 0, dev + (size_t)r * bytes, bytes, 0, 0, 0};
    x[k++] = (ep_net_xfer_t){r, 0, 0, dev + bytes * (size_t)(R + r), bytes, 0, 0, 0};
  }
  T_OK(e->post(n, x, k, st));
  T_OK(ep_net_wait(e, n, x, k, ep_now() + 60, 60, NULL, NULL, "NCCL round"));
  T_CHECK(cudaMemcpy(host, dev + bytes * (size_t)R, bytes * (size_t)R, cudaMemcpyDeviceToHost) ==
              cudaSuccess,
          "copy back");
  for (int r = 0; r < R; r++)
    for (size_t i = 0; r != me && i < bytes; i++)
      T_CHECK(host[(size_t)r * bytes + i] == pattern(r, me, round, i),
              "round %d, %zu bytes: byte %zu from rank %d is %#x, expected %#x", round, bytes, i, r,
              host[(size_t)r * bytes + i], pattern(r, me, round, i));
  cudaFree(dev);
  free(host), free(x);
}

/* Every rank its own NCCL host (NCCL refuses two ranks of one host on one GPU), over loopback. */
static void pretend_nccl_hosts(int me) {
  char id[32];
  snprintf(id, sizeof id, "epcomm-test-%d", me);
  setenv("NCCL_HOSTID", id, 0);
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  setenv("NCCL_IB_DISABLE", "1", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
}

int main(void) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
    printf("skipped: no GPU\n");
    return T_SKIP;
  }
  const struct ep_net_engine *e = ep_net_find("nccl");
  if (!e || e->probe() != EP_OK) {
    printf("skipped: no NCCL engine (%s)\n", ep_last_error());
    return T_SKIP;
  }
  ep_group_t g;
  int me, R;
  t_init(&g, &me, &R);
  pretend_nccl_hosts(me);
  ep_group_info_t gi = EP_GROUP_INFO_INIT;
  T_OK(ep_group_query(g, &gi));
  ep_net_open_t how = {me, R, gi.local_rank % ndev, ep_now() + 120, allgather, g, NULL};
  ep_net_t *n;
  T_OK(e->open(&how, &n));
  cudaStream_t st;
  T_CHECK(cudaStreamCreate(&st) == cudaSuccess, "stream");
  static const size_t sizes[] = {16, 4096, 1 << 20, 8 << 20};
  for (int round = 0; round < 8; round++) round_trip(e, n, R, me, sizes[round % 4], round, st);
  T_OK(ep_group_barrier(g));
  e->close(n, true);
  cudaStreamDestroy(st);
  /* A cuda buffer across hosts opens its NCCL endpoint, with low-latency sizes too. */
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.backend = EP_BACKEND_CUDA;
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, &cfg, &b));
  T_OK(ep_buffer_destroy(b));
  if (gi.nhosts > 1) {
    cfg.ll_max_tokens = 16, cfg.ll_hidden = 128, cfg.ll_num_experts = 2 * R;
    T_OK(ep_buffer_create(g, &cfg, &b));
    /* Across hosts every call waits on the host: no graph capture, no registration claimed. */
    ep_buffer_info_t bi = {.size = sizeof bi};
    T_OK(ep_buffer_query(b, &bi));
    T_CHECK((bi.caps & EP_CAP_LOW_LATENCY) &&
                !(bi.caps & (EP_CAP_GRAPH_CAPTURE | EP_CAP_REGISTER_MEMORY)),
            "caps across hosts: 0x%x", bi.caps);
    T_OK(ep_buffer_destroy(b));
  }
  t_fini(g);
  if (me == 0)
    printf(
        "test_nccl_engine: %d ranks on %d host(s): 8 rounds of grouped send/receive checked; "
        "cuda buffers created (normal, and low-latency sizes)\n",
        R, gi.nhosts);
  return T_PASS;
}
#else
int main(void) {
  printf("skipped: no GPU (the CUDA backend is not built)\n");
  return T_SKIP;
}
#endif
