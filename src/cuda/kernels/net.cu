/* Kernels of the data path across hosts (net_kernels.h). One warp per record, row or token; the
 * host planned everything, so nothing here waits on a peer: ordering between ranks is the host's
 * (stream order, NCCL's grouped transfers, a barrier between the phases that touch a peer's
 * memory). Adds follow SEMANTICS.md §4.6 exactly: a host's rows in ascending rank order into an
 * fp32 partial (the first row taken as itself), then biases + partials by host ascending. */

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/net_kernels.h"

#define NT 256

namespace {

__device__ __forceinline__ int warp_id() {
  return (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}
__device__ __forceinline__ int warps() {
  return (int)((gridDim.x * blockDim.x) >> 5);
}

/* Rows are whole multiples of 16 bytes (the core checks); int4 when both ends are aligned. */
__device__ __forceinline__ void copy_row(uint8_t *dst, const uint8_t *src, uint64_t bytes) {
  int lane = threadIdx.x & 31;
  if (!(((uintptr_t)dst | (uintptr_t)src) & 15)) {
    int4 *d = (int4 *)dst;
    const int4 *s = (const int4 *)src;
    for (uint64_t i = lane; i < bytes / 16; i += 32) d[i] = s[i];
  } else {
    for (uint64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

__global__ void __launch_bounds__(NT) pack_kernel(epk_net_pack_t a) {
  const int lane = threadIdx.x & 31, L = a.r.L, topk = a.r.topk;
  for (int i = warp_id(); i < a.n; i += warps()) {
    const int32_t *h = a.hdr + (size_t)i * (size_t)(EPK_NET_HDR + L);
    uint8_t *rec = a.out + (size_t)i * a.r.rec;
    const int64_t t = h[0];
    for (int q = lane; q < EPK_NET_HDR + L; q += 32) ((int32_t *)rec)[q] = h[q];
    copy_row(rec + a.r.hdr, a.x + (size_t)t * a.r.row, a.r.row);
    for (int q = lane; q < a.r.ns; q += 32)
      ((float *)(rec + a.r.off_s))[q] = a.scales[t * a.s_tok + q * a.s_hid];
    for (int k = lane; a.r.ids && k < topk; k += 32)
      ((int64_t *)(rec + a.r.off_i))[k] = a.ids[t * topk + k];
    for (int k = lane; a.r.w && k < topk; k += 32)
      ((float *)(rec + a.r.off_w))[k] = a.w[t * topk + k];
  }
}

__global__ void __launch_bounds__(NT) fanout_kernel(epk_net_fanout_t a, int entries) {
  const int lane = threadIdx.x & 31, L = a.r.L, topk = a.r.topk, ns = a.r.ns;
  const epk_recv_layout_t &y = a.lay.a;
  for (int i = warp_id(); i < entries; i += warps()) {
    int b = 0;
    while (b + 1 < a.nblk && i >= a.blk[b + 1].entry0) b++;
    const int e = i - a.blk[b].entry0;
    const uint8_t *rec = a.blk[b].rec + (size_t)e * a.r.rec;
    const int32_t *h = (const int32_t *)rec;
    const int32_t *fan = h + EPK_NET_HDR;
    int nf = 0;
    bool ok = true;
    for (int l = 0; l < L; l++) {
      nf += fan[l] >= 0;
      ok &= fan[l] >= -1 && fan[l] < y.rows;
    }
    const int64_t po = (int64_t)(((uint64_t)(uint32_t)h[3] << 32) | (uint32_t)h[2]);
    ok &=
        nf > 0 && po >= 0 && po % 16 == 0 && po + (nf == 1 ? a.psize1 : a.psize) <= a.blk[b].pbytes;
    if (!ok) {
      if (lane == 0) {
        atomicExch(a.bad, a.blk[b].src + 1);
        if (a.poff) a.poff[i] = -1;
      }
      continue;
    }
    for (int l = lane; a.fan && l < L; l += 32) a.fan[(size_t)i * L + l] = fan[l];
    if (lane == 0 && a.poff) a.poff[i] = a.blk[b].poff0 + po;
    for (int l = 0; l < L; l++) {
      const int64_t row = fan[l];
      if (row < 0) continue;
      uint8_t *d = a.area[l];
      copy_row(d + y.off_x + (uint64_t)row * a.r.row, rec + a.r.hdr, a.r.row);
      for (int q = lane; q < ns; q += 32)
        ((float *)(d + y.off_s))[row * ns + q] = ((const float *)(rec + a.r.off_s))[q];
      for (int k = lane; a.r.ids && k < topk; k += 32)
        ((int64_t *)(d + y.off_i))[row * topk + k] = ((const int64_t *)(rec + a.r.off_i))[k];
      for (int k = lane; a.r.w && k < topk; k += 32)
        ((float *)(d + y.off_w))[row * topk + k] = ((const float *)(rec + a.r.off_w))[k];
      if (lane == 0) {
        ((int32_t *)(d + y.off_src))[row] = h[0];
        ((int32_t *)(d + a.lay.off_meta))[2 * row] = a.blk[b].src;
        ((int32_t *)(d + a.lay.off_meta))[2 * row + 1] = e;
      }
    }
  }
}

__global__ void __launch_bounds__(NT) finish_kernel(epk_net_finish_t a) {
  const int lane = threadIdx.x & 31, topk = a.topk, ns = a.ns;
  const epk_recv_layout_t &y = a.lay.a;
  const uint8_t *ax = a.area + y.off_x;
  const float *as = (const float *)(a.area + y.off_s), *aw = (const float *)(a.area + y.off_w);
  const int64_t *ai = (const int64_t *)(a.area + y.off_i);
  const int32_t *asrc = (const int32_t *)(a.area + y.off_src);
  const int32_t *am = (const int32_t *)(a.area + a.lay.off_meta);
  for (int r = warp_id(); r < a.nr; r += warps()) {
    const size_t rr = (size_t)r;
    if (a.recv_x && a.recv_x != ax) copy_row(a.recv_x + rr * a.row, ax + rr * a.row, a.row);
    for (int q = lane; a.recv_scales && a.recv_scales != as && q < ns; q += 32)
      a.recv_scales[rr * ns + q] = as[rr * ns + q];
    if (lane == 0 && a.recv_src && a.recv_src != asrc) a.recv_src[r] = asrc[r];
    if (lane == 0 && a.meta) a.meta[2 * rr] = am[2 * rr], a.meta[2 * rr + 1] = am[2 * rr + 1];
    if (a.cached) continue;
    for (int k = lane; k < topk; k += 32) {
      const int64_t g = ai[rr * topk + k], e = g - a.first_expert;
      const bool local = g >= 0 && e >= 0 && e < a.num_local;
      const float w = local && a.has_w ? aw[rr * topk + k] : 0.0f;
      if (local && a.ecount) atomicAdd(&a.ecount[e], 1);
      if (a.recv_idx) a.recv_idx[rr * topk + k] = local ? e : -1;
      if (a.recv_w) a.recv_w[rr * topk + k] = w;
    }
  }
}

__global__ void __launch_bounds__(NT) stage_kernel(epk_net_stage_t a) {
  const int lane = threadIdx.x & 31;
  for (int r = warp_id(); r < a.nr; r += warps()) {
    const size_t rr = (size_t)r;
    if (a.x != a.area) copy_row(a.area + rr * a.row, a.x + rr * a.row, a.row);
    for (int k = lane; a.w && k < a.topk; k += 32)
      ((float *)(a.area + a.off_w))[rr * a.topk + k] = a.w[rr * a.topk + k];
  }
}

/* Entry i's partial: the rows of this host's ranks (ascending) added in fp32, the first taken as
 * itself; a single row is stored as it is (bf16), which is the same value. */
__global__ void __launch_bounds__(NT) partial_kernel(epk_net_partial_t a) {
  const int lane = threadIdx.x & 31, L = a.L, nv = a.hidden / 8;
  const uint64_t xrow = 2ull * (uint64_t)a.hidden;
  for (int i = warp_id(); i < a.entries; i += warps()) {
    if (a.poff[i] < 0) continue; /* a record the fan-out dropped */
    const int32_t *fan = a.fan + (size_t)i * L;
    uint8_t *out = a.out + a.poff[i];
    int nf = 0, only = 0;
    for (int l = 0; l < L; l++)
      if (fan[l] >= 0) nf++, only = l;
    float *ow = (float *)(out + (nf == 1 ? 2 : 4) * (uint64_t)a.hidden);
    if (nf == 1) {
      copy_row(out, a.area[only] + (uint64_t)fan[only] * xrow, xrow);
    } else {
      for (int v = lane; v < nv; v += 32) {
        float p[8], y[8];
        bool first = true;
        for (int l = 0; l < L; l++) {
          if (fan[l] < 0) continue;
          epk_cvt8(y, ((const int4 *)(a.area[l] + (uint64_t)fan[l] * xrow))[v]);
#pragma unroll
          for (int e = 0; e < 8; e++) p[e] = first ? y[e] : p[e] + y[e];
          first = false;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) ((float *)out)[8 * v + e] = first ? 0.0f : p[e];
      }
    }
    for (int k = lane; a.has_w && k < a.topk; k += 32) {
      float p = 0.0f;
      bool first = true;
      for (int l = 0; l < L; l++) {
        if (fan[l] < 0) continue;
        float w = ((const float *)(a.area[l] + a.off_w))[(size_t)fan[l] * a.topk + k];
        p = first ? w : p + w;
        first = false;
      }
      ow[k] = p;
    }
  }
}

__global__ void __launch_bounds__(NT) reduce_kernel(epk_net_reduce_t a) {
  const int lane = threadIdx.x & 31, H = a.H, nv = a.hidden / 8;
  const int4 *b0 = (const int4 *)a.bias0, *b1 = (const int4 *)a.bias1;
  for (int t = warp_id(); t < a.n; t += warps()) {
    const int64_t *tj = a.tok + (size_t)t * H;
    for (int v = lane; v < nv; v += 32) {
      float acc[8], y[8];
      const size_t bi = (size_t)t * nv + v;
      epk_init8(acc, b0, b1, bi);
      for (int g = 0; g < H; g++) {
        if (tj[g] < 0) continue;
        const uint8_t *p = a.blk[g] + (tj[g] >> 1);
        if (tj[g] & 1) {
          epk_cvt8(y, ((const int4 *)p)[v]); /* one row: float(bf16), the partial's value */
#pragma unroll
          for (int e = 0; e < 8; e++) acc[e] = acc[e] + y[e];
        } else {
#pragma unroll
          for (int e = 0; e < 8; e++) acc[e] = acc[e] + ((const float *)p)[8 * v + e];
        }
      }
      ((int4 *)a.out)[bi] = epk_pack8(acc);
    }
    for (int k = lane; a.out_w && k < a.topk; k += 32) {
      float acc = 0.0f;
      for (int g = 0; a.has_w && g < H; g++) {
        if (tj[g] < 0) continue;
        const float *p =
            (const float *)(a.blk[g] + (tj[g] >> 1) + ((tj[g] & 1) ? 2 : 4) * (size_t)a.hidden);
        acc = acc + p[k];
      }
      a.out_w[(size_t)t * a.topk + k] = acc;
    }
  }
}

__global__ void experts_kernel(const int32_t *ecount, int32_t *out, int n, int align) {
  for (int l = blockIdx.x * blockDim.x + threadIdx.x; l < n; l += gridDim.x * blockDim.x) {
    int64_t v = ecount[l];
    out[l] = (int32_t)(align > 1 ? (v + align - 1) / align * align : v);
  }
}

int grid(int items, int blocks) {
  int need = (items + NT / 32 - 1) / (NT / 32);
  if (need < 1) need = 1;
  return need < blocks ? need : blocks;
}

}  // namespace

extern "C" cudaError_t epk_net_launch_pack(const epk_net_pack_t *a, int blocks, cudaStream_t s) {
  if (a->n > 0) pack_kernel<<<grid(a->n, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_fanout(const epk_net_fanout_t *a, int entries, int blocks,
                                             cudaStream_t s) {
  if (entries > 0) fanout_kernel<<<grid(entries, blocks), NT, 0, s>>>(*a, entries);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_finish(const epk_net_finish_t *a, int blocks,
                                             cudaStream_t s) {
  if (a->nr > 0) finish_kernel<<<grid(a->nr, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_experts(const int32_t *ecount, int32_t *out, int n, int align,
                                              cudaStream_t s) {
  if (n > 0) experts_kernel<<<(n + NT - 1) / NT, NT, 0, s>>>(ecount, out, n, align);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_stage(const epk_net_stage_t *a, int blocks, cudaStream_t s) {
  if (a->nr > 0) stage_kernel<<<grid(a->nr, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_partial(const epk_net_partial_t *a, int blocks,
                                              cudaStream_t s) {
  if (a->entries > 0) partial_kernel<<<grid(a->entries, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_net_launch_reduce(const epk_net_reduce_t *a, int blocks,
                                             cudaStream_t s) {
  if (a->n > 0) reduce_kernel<<<grid(a->n, blocks), NT, 0, s>>>(*a);
  return cudaGetLastError();
}
