#include "common.h"


int t_rank = -1;
const char *t_case = NULL;

uint16_t t_rand_bf16(t_rng *r) {
  float f = (t_unit(r) - 0.5f) * 8.0f;
  union {
    float f;
    uint32_t u;
  } v = {f};
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

void *t_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) T_FAILF("out of memory (%zu bytes)", n);
  memset(p, T_POISON, n ? n : 1);
  return p;
}

void t_init(ep_group_t *g, int *rank, int *nranks) {
  T_OK(ep_group_create_from_env(NULL, g));
  T_OK(ep_group_rank(*g, rank));
  T_OK(ep_group_nranks(*g, nranks));
  t_rank = *rank;
}

void t_fini(ep_group_t g) { T_OK(ep_group_destroy(g)); }

void t_hosts(ep_group_t g, int *nhosts, int **host_of) {
  ep_group_info_t i = EP_GROUP_INFO_INIT;
  T_OK(ep_group_query(g, &i));
  *nhosts = i.nhosts;
  *host_of = t_xmalloc((size_t)i.nranks * sizeof(int));
  T_OK(ep_group_allgather(g, &i.host, *host_of, sizeof(int)));
}

bool t_cuda(void) {
  const char *b = getenv("EP_BACKEND");
  return b && !strcmp(b, "cuda");
}

void t_require_backend(void) {
  if (!t_cuda()) return;
#ifdef EP_HAVE_CUDA
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return;
  printf("skipped: no GPU (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
#else
  printf("skipped: no GPU (the CUDA backend is not built)\n");
#endif
  fflush(stdout);
  exit(T_SKIP);
}

void *t_dalloc(size_t n) {
  if (!t_cuda()) return t_xmalloc(n);
#ifdef EP_HAVE_CUDA
  void *p = NULL;
  T_CUDA(cudaMalloc(&p, n ? n : 1));
  T_CUDA(cudaMemset(p, T_POISON, n ? n : 1));
  return p;
#else
  T_FAILF("t_dalloc: CUDA not built");
#endif
}

void t_copy_to_dev(void *dev, const void *host, size_t n) {
  if (!n) return;
  if (!t_cuda()) {
    memcpy(dev, host, n);
    return;
  }
#ifdef EP_HAVE_CUDA
  T_CUDA(cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice));
#endif
}

void *t_to_dev(const void *host, size_t n) {
  if (!host) return NULL;
  void *d = t_dalloc(n);
  t_copy_to_dev(d, host, n);
  return d;
}

void *t_to_host(const void *dev, size_t n) {
  void *h = t_xmalloc(n);
  if (!n || !dev) return h;
  if (!t_cuda()) {
    memcpy(h, dev, n);
    return h;
  }
#ifdef EP_HAVE_CUDA
  T_CUDA(cudaMemcpy(h, dev, n, cudaMemcpyDeviceToHost));
#endif
  return h;
}

void t_dfree(void *dev) {
  if (!dev) return;
  if (!t_cuda()) {
    free(dev);
    return;
  }
#ifdef EP_HAVE_CUDA
  T_CUDA(cudaFree(dev));
#endif
}

void t_dsync(void) {
#ifdef EP_HAVE_CUDA
  if (t_cuda()) T_CUDA(cudaDeviceSynchronize());
#endif
}
