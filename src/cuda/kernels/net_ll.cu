/* Kernels of low-latency mode across hosts (net_kernels.h; host side src/cuda/cuda_net_ll.c).
 * The host placed every row after the gate, and NCCL moves the records, so nothing here waits
 * on a peer: one warp per record, row or token. The casts (cast_row) and the reduction (fma8,
 * pack8) are the one-host kernels' own (ll_common.cuh), so both paths give the same bits. */

#include "cuda/kernels/ll_common.cuh"
#include "cuda/kernels/net_kernels.h"

#define NT 256

using namespace epk_ll;

namespace {

__device__ __forceinline__ int warp_id() {
  return (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}
__device__ __forceinline__ int warps() {
  return (int)((gridDim.x * blockDim.x) >> 5);
}

/* Records of this rank's (token, k), in send order: header, then the row or its fp8 cast. */
__global__ void __launch_bounds__(NT) pack_kernel(epk_nll_pack_t a) {
  const int lane = threadIdx.x & 31;
  const uint64_t rec = epk_nll_rec(a.H, a.NS, a.fmt & EPK_LL_FP8);
  for (int i = warp_id(); i < a.n; i += warps()) {
    const int4 it = a.items[i];
    uint8_t *r = a.out + (uint64_t)i * rec;
    if (lane == 0) *reinterpret_cast<int4 *>(r) = it;
    const int4 *x =
        reinterpret_cast<const int4 *>(static_cast<const uint16_t *>(a.x) + (int64_t)it.x * a.H);
    if (!(a.fmt & EPK_LL_FP8)) {
      epk_warp_copy<false>(reinterpret_cast<int4 *>(r + 16), x, a.H / 8);
      continue;
    }
    uint32_t *sc = reinterpret_cast<uint32_t *>(r + 16 + a.H);
    cast_row(x, a.H, a.fmt, r + 16,
             [&](int blk, bool ue8m0, float inv, int ex) { sc[blk] = scale_word(ue8m0, inv, ex); });
  }
}

/* Received records into the slot: the row at its place, its scales in the call's layout, the
 * source token in recv_src_info. A record whose row is outside the slab is dropped and flagged
 * (the host then fails the call: a sender that disagrees about the layout). */
__global__ void __launch_bounds__(NT) unpack_kernel(epk_nll_unpack_t a) {
  const int lane = threadIdx.x & 31;
  const bool fp8 = a.fmt & EPK_LL_FP8, cols = a.fmt & EPK_LL_COLS, ue8m0 = a.fmt & EPK_LL_UE8M0;
  const uint64_t rec = epk_nll_rec(a.H, a.NS, fp8);
  const int64_t rows = (int64_t)a.L * a.RT;
  for (int i = warp_id(); i < a.n; i += warps()) {
    const uint8_t *r = a.in + (uint64_t)i * rec;
    const int4 h = *reinterpret_cast<const int4 *>(r);
    if (h.y < 0 || h.y >= rows) {
      if (lane == 0) atomicExch(a.bad, 1);
      continue;
    }
    if (lane == 0) a.src[h.y] = h.x;
    if (!fp8) {
      epk_warp_copy<false>(reinterpret_cast<int4 *>(a.slab + (int64_t)h.y * 2 * a.H),
                           reinterpret_cast<const int4 *>(r + 16), a.H / 8);
      continue;
    }
    epk_warp_copy<false>(reinterpret_cast<int4 *>(a.slab + (int64_t)h.y * a.H),
                         reinterpret_cast<const int4 *>(r + 16), a.H / 16);
    const uint32_t *sc = reinterpret_cast<const uint32_t *>(r + 16 + a.H);
    uint8_t *scales = a.slab + rows * a.H;
    const int le = h.y / a.RT, pos = h.y - le * a.RT;
    for (int blk = lane; blk < a.NS; blk += 32)
      put_scale(scales, cols, ue8m0, le, pos, a.NS, a.RT, blk, sc[blk]);
  }
}

__global__ void __launch_bounds__(NT) gather_kernel(epk_nll_gather_t a) {
  for (int i = warp_id(); i < a.n; i += warps())
    epk_warp_copy<false>(reinterpret_cast<int4 *>(a.out + (int64_t)i * 2 * a.H),
                         reinterpret_cast<const int4 *>(a.y + (int64_t)a.rows[i] * 2 * a.H),
                         a.H / 8);
}

/* out[t] = bf16(fmaf chain over k ascending) (SEMANTICS.md §6.5); a token with nothing to
 * reduce gets +0. One warp per token, 8 channels per lane and step. */
__global__ void __launch_bounds__(NT) reduce_kernel(epk_nll_reduce_t a) {
  const int lane = threadIdx.x & 31;
  for (int t = warp_id(); t < a.n; t += warps()) {
    const int32_t *map = a.map + (int64_t)t * a.topk;
    const float *w = a.w + (int64_t)t * a.topk;
    for (int h0 = lane * 8; h0 < a.H; h0 += 256) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < a.topk; k++) {
        const int m = map[k];
        if (m < 0) continue;
        const int4 v =
            *reinterpret_cast<const int4 *>(a.in + (int64_t)m * 2 * a.H + 2 * (int64_t)h0);
        fma8(acc, v, w[k]);
      }
      reinterpret_cast<int4 *>(static_cast<uint16_t *>(a.out) + (int64_t)t * a.H + h0)[0] =
          pack8(acc);
    }
  }
}

int grid(int items, int blocks) {
  const int need = (items + NT / 32 - 1) / (NT / 32);
  return need < 1 ? 1 : need < blocks ? need : blocks;
}

/* One warp per item; nothing to launch for none. */
template <typename A>
cudaError_t launch(void (*kernel)(A), const A *a, int items, int blocks, cudaStream_t s) {
  if (!items) return cudaSuccess;
  kernel<<<grid(items, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epk_nll_launch_pack(const epk_nll_pack_t *a, int blocks, cudaStream_t s) {
  return launch(pack_kernel, a, a->n, blocks, s);
}

extern "C" cudaError_t epk_nll_launch_unpack(const epk_nll_unpack_t *a, int blocks,
                                             cudaStream_t s) {
  return launch(unpack_kernel, a, a->n, blocks, s);
}

extern "C" cudaError_t epk_nll_launch_gather(const epk_nll_gather_t *a, int blocks,
                                             cudaStream_t s) {
  return launch(gather_kernel, a, a->n, blocks, s);
}

extern "C" cudaError_t epk_nll_launch_reduce(const epk_nll_reduce_t *a, int blocks,
                                             cudaStream_t s) {
  return launch(reduce_kernel, a, a->n, blocks, s);
}
