/* Layout (SEMANTICS.md §2) in one block: validate every id first, so that nothing is written when
 * one is out of range, then count. Cheap next to a dispatch (N * topk ids): one block is enough. */
#include "cuda/kernels/common.cuh"

#define LT 1024

namespace {

/* Token t's hosts (SEMANTICS.md §2.3): it goes to a host when it goes to a rank of it. */
__device__ void host_layout(const epk_layout_t &a, const int64_t *row, int t, int L,
                            int *per_host) {
  if (!a.per_host && !a.in_host) return;
  uint8_t *in = a.in_host ? a.in_host + (size_t)t * a.nhosts : nullptr;
  for (int g = 0; in && g < a.nhosts; g++) in[g] = 0;
  for (int k = 0; k < a.topk; k++) {
    if (row[k] < 0) continue;
    int g = a.host_of ? a.host_of[row[k] / L] : 0;
    bool first = true; /* a token counts once per host */
    for (int j = 0; j < k && first; j++)
      first = !(row[j] >= 0 && (a.host_of ? a.host_of[row[j] / L] : 0) == g);
    if (!first) continue;
    atomicAdd(&per_host[g], 1);
    if (in) in[g] = 1;
  }
}

}  // namespace

/* The kernel's name: ep_kernels.h says why. */
namespace epcomm::normal {
__global__ void __launch_bounds__(LT, 1) layout(epk_buf_t b, epk_layout_t a) {
  extern __shared__ int per_rank[]; /* [R], then [nhosts] */
  const int R = b.nranks, L = a.num_experts / R, n = a.num_tokens, topk = a.topk;
  int *per_host = per_rank + R;
  long long bad = epk_first_bad(a.topk_idx, n, topk, a.num_experts);
  if (bad != INT64_MAX) {
    if (threadIdx.x == 0 && a.report) { /* else the host is not waiting: nobody would read it */
      b.host->bad_value = a.topk_idx[bad];
      __threadfence_system(); /* the host reads it once it sees layout_bad */
      b.host->layout_bad = (int32_t)(bad + 1);
      __threadfence_system();
    }
    return;
  }
  for (int d = threadIdx.x; d < R; d += LT) per_rank[d] = 0;
  for (int g = threadIdx.x; g < a.nhosts; g += LT) per_host[g] = 0;
  for (int e = threadIdx.x; a.per_expert && e < a.num_experts; e += LT) a.per_expert[e] = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < n; t += LT) {
    const int64_t *row = a.topk_idx + (size_t)t * topk;
    uint8_t *in = a.in_rank ? a.in_rank + (size_t)t * R : nullptr;
    for (int d = 0; in && d < R; d++) in[d] = 0;
    for (int k = 0; k < topk; k++) {
      int64_t e = row[k];
      if (e < 0) continue;
      if (a.per_expert) atomicAdd(&a.per_expert[e], 1);
      int d = (int)(e / L);
      bool first = true; /* a token counts once per rank */
      for (int j = 0; j < k && first; j++) first = !(row[j] >= 0 && row[j] / L == d);
      if (!first) continue;
      atomicAdd(&per_rank[d], 1);
      if (in) in[d] = 1;
    }
    host_layout(a, row, t, L, per_host);
  }
  __syncthreads();
  for (int d = threadIdx.x; a.per_rank && d < R; d += LT) a.per_rank[d] = per_rank[d];
  for (int g = threadIdx.x; a.per_host && g < a.nhosts; g += LT) a.per_host[g] = per_host[g];
}

}  // namespace epcomm::normal

extern "C" cudaError_t epk_launch_layout(const epk_buf_t *b, const epk_layout_t *a,
                                         cudaStream_t s) {
  size_t smem = sizeof(int) * ((size_t)b->nranks + (size_t)a->nhosts);
  epcomm::normal::layout<<<1, LT, smem, s>>>(*b, *a);
  return cudaGetLastError();
}
