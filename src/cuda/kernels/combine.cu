/* Combine: every source pulls the rows of its tokens from the ranks that hold them and reduces
 * them in registers (bias0 + bias1, then each rank's row in ascending rank order, in fp32; one
 * RNE rounding to bf16). A rank's rows are read where they are when its input x lies in its
 * area D (for instance the bf16 dispatch view, overwritten by the expert), at the start of its
 * area C (ep_get_combine_buffer) or in memory it registered (ep_register_memory: its ctab entry
 * names the registration, which every peer has mapped); otherwise the rank first stages them in
 * its area C. When staging cannot hold all rows at once, the call runs in
 * rounds over chunks of source tokens; each round: stage -> "staged" -> pull -> "done". */
#include "cuda/kernels/common.cuh"

/* Shapes (tools/kernel_variants.sh times others, through -D): 12 warps; the reduction keeps
 * EPK_HG holders x EPK_RU vectors per lane in flight; staging copies EPK_SU vectors deep. At
 * 384/4/2/8: 168 registers (no spills when chosen; CUDA 13.0's ptxas spills 40 bytes). 256
 * threads with 7 x 2 vectors (246 registers) pulled as fast at R=2 but staged 40% slower (fewer
 * warps); deeper staging spills at 384 threads. */
#ifndef EPK_CT
#define EPK_CT 384
#endif
#define CT EPK_CT
#define CWARPS (CT / 32)
#ifndef EPK_SU
#define EPK_SU 8
#endif
/* 1: a block with fewer tokens than warps reduces each token's channels in parts, a warp each
 * (reduce); 0: a warp per token (kernel_variants.sh compares). */
#ifndef EPK_CSPLIT
#define EPK_CSPLIT 1
#endif

namespace {

struct cstate {
  long long *xo, *wo; /* [R] per holder r: our row 0 of x (its address here) and of the weights
                         (byte offset in r's pool) */
  int *pre, *cme;     /* [R] per source s: first row of s's rows here, and how many */
  int *lo, *hi, *so;  /* [R] rows of s in this round, and where they are staged */
};

__device__ int lower_bound(const int32_t *v, int n, int key) {
  int a = 0, z = n;
  while (a < z) {
    int m = (a + z) / 2;
    if (v[m] < key)
      a = m + 1;
    else
      z = m;
  }
  return a;
}

/* Waits until flag[r] of this rank's pool reaches `target` for every r. */
__device__ bool wait_all(const epk_buf_t &b, uint64_t off, uint32_t target, uint32_t phase) {
  bool fail = false;
  for (int r = threadIdx.x; r < b.nranks && !fail; r += CT) {
    const uint32_t *f = epk_u32(b.peers[b.rank], off, r);
    epk_waiter w;
    w.reset();
    while (epk_ld_peer(b, f) < target)
      if (w.tick(b, r, phase)) {
        fail = true;
        break;
      }
  }
  return !__syncthreads_or(fail);
}

/* Signals `value` into flag[me] of every peer once all blocks passed this point. */
__device__ void signal_all(const epk_buf_t &b, unsigned *counter, unsigned round, uint64_t off) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  epk_fence_peers(b);
  if (atomicAdd(counter, 1u) != (round + 1) * gridDim.x - 1) return;
  epk_fence_peers(b);
  for (int s = 0; s < b.nranks; s++) epk_st_peer(b, epk_u32(b.peers[s], off, b.rank), round + 1);
}

__device__ void round_rows(const epk_buf_t &b, const epk_combine_t &a, const cstate &c, int k,
                           int K, int tc, int *total) {
  __shared__ int s_total;
  for (int s = threadIdx.x; s < b.nranks; s += CT) {
    if (K == 1) {
      c.lo[s] = 0, c.hi[s] = c.cme[s];
      continue;
    }
    int n = (int)max((int64_t)0, min((int64_t)c.cme[s], a.hsrc_cap - c.pre[s]));
    const int32_t *v = a.hsrc + c.pre[s];
    c.lo[s] = lower_bound(v, n, k * tc);
    c.hi[s] = lower_bound(v, n, (k + 1) * tc);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int s = 0; s < b.nranks; s++) c.so[s] = run, run += c.hi[s] - c.lo[s];
    s_total = run;
  }
  __syncthreads();
  *total = s_total;
}

/* Stages this block's share of the round's rows in area C and publishes where every source
 * finds its rows (ctab). */
__device__ void stage(const epk_buf_t &b, const epk_combine_t &a, const cstate &c, int k, int K,
                      int tc) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, R = b.nranks;
  const uint64_t xrow = (uint64_t)a.hidden * 2, wrow = (uint64_t)a.topk * 4;
  const uint64_t wgap = 256ull * (uint64_t)a.wgap256; /* x in area C: weights after it */
  const int64_t cap = epk_stage_rows(b.area_bytes - wgap, a.direct ? 0 : xrow, a.has_w ? wrow : 0);
  const uint64_t sx = b.off_area_c, sw = b.off_area_c + (a.direct ? wgap : epk_al(cap * xrow, 256));
  uint8_t *pool = b.peers[b.rank];
  int M;
  round_rows(b, a, c, k, K, tc, &M);
  const int a0 = (int)((int64_t)M * blockIdx.x / gridDim.x);
  const int a1 = (int)((int64_t)M * (blockIdx.x + 1) / gridDim.x);
  for (int i = a0 + warp; (!a.direct || a.has_w) && i < a1; i += CWARPS) {
    int s = 0;
    while (s + 1 < R && c.so[s + 1] <= i) s++;
    const int64_t row = c.pre[s] + c.lo[s] + (i - c.so[s]);
    if (row >= a.x_rows) continue;
    if (!a.direct)
      epk_warp_copy<false, EPK_SU>(
          reinterpret_cast<int4 *>(pool + sx + (uint64_t)i * xrow),
          reinterpret_cast<const int4 *>(static_cast<const uint8_t *>(a.x) + row * xrow),
          (int)(xrow / 16));
    float *wd = reinterpret_cast<float *>(pool + sw) + (int64_t)i * a.topk;
    for (int j = lane; a.has_w && j < a.topk; j += 32) wd[j] = a.w[row * a.topk + j];
  }
  for (int s = threadIdx.x; blockIdx.x == 0 && s < R; s += CT) {
    long long *ct = reinterpret_cast<long long *>(pool + b.off_ctab) + 4 * s;
    const long long shift = (long long)c.so[s] - c.lo[s];
    ct[0] = a.direct ? a.x_off + (long long)c.pre[s] * (long long)xrow
                     : (long long)sx + shift * (long long)xrow;
    ct[1] = (long long)sw + shift * (long long)wrow;
    ct[2] = a.direct ? a.x_reg : -1; /* ct[0] is relative to: the pool, or that registration */
  }
}

/* Points the warp's table at token t's rows of holders g .. g+31; returns their mask. */
__device__ unsigned load_group(const epk_buf_t &b, const epk_combine_t &a, const cstate &c, int t,
                               int g, const uint8_t **sx, const float **sw) {
  const int lane = threadIdx.x & 31, r = g + lane, R = b.nranks;
  const int32_t *pos = epk_plan_pos(const_cast<int32_t *>(a.plan), R);
  __syncwarp();
  int p = r < R ? pos[(int64_t)t * R + r] : -1;
  if (p >= 0) {
    sx[lane] = reinterpret_cast<const uint8_t *>(c.xo[r]) + (int64_t)p * a.hidden * 2;
    sw[lane] = reinterpret_cast<const float *>(b.peers[r] + c.wo[r]) + (int64_t)p * a.topk;
  }
  unsigned m = __ballot_sync(EPK_FULL, p >= 0);
  __syncwarp();
  return m;
}

__device__ __forceinline__ void add8(float *acc, int4 v) {
  const uint32_t u[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    acc[2 * e] += __uint_as_float(u[e] << 16);
    acc[2 * e + 1] += __uint_as_float(u[e] & 0xffff0000u);
  }
}

/* out[t] and out_w[t] from every holder's row of t (ascending rank). The loads set the pace, so
 * each lane keeps RU vectors of 8 channels of HG holders in flight at once (their adds then go in
 * ascending rank order, as the reference's). */
#ifndef EPK_RU
#define EPK_RU 4
#endif
#ifndef EPK_HG
#define EPK_HG 2
#endif
#define RU EPK_RU
#define HG EPK_HG
__device__ void reduce_token(const epk_buf_t &b, const epk_combine_t &a, const cstate &c, int t,
                             int it0, int it1, bool weights, const uint8_t **sx, const float **sw) {
  const int lane = threadIdx.x & 31, R = b.nranks, nv = a.hidden / 8;
  const int64_t H = a.hidden;
  const int4 *b0 =
      a.bias0 ? reinterpret_cast<const int4 *>(static_cast<const uint16_t *>(a.bias0) + t * H)
              : nullptr;
  const int4 *b1 =
      a.bias1 ? reinterpret_cast<const int4 *>(static_cast<const uint16_t *>(a.bias1) + t * H)
              : nullptr;
  int4 *out = reinterpret_cast<int4 *>(static_cast<uint16_t *>(a.out) + t * H);
  unsigned mask = 0;
  const uint64_t pol = epk_l2_policy(a.stream);
  const int first = it0 * 32 * RU, end = min(nv, it1 * 32 * RU);
  for (int i0 = first; i0 < end; i0 += 32 * RU) {
    float acc[RU][8];
#pragma unroll
    for (int u = 0; u < RU; u++)
      if (i0 + 32 * u + lane < nv) epk_init8(acc[u], b0, b1, i0 + 32 * u + lane);
    for (int g = 0; g < R; g += 32) {
      if (R > 32 || i0 == first) mask = load_group(b, a, c, t, g, sx, sw);
      for (unsigned m = mask; m;) {
        const int4 *src[HG];
#pragma unroll
        for (int h = 0; h < HG; h++) {
          src[h] = m ? reinterpret_cast<const int4 *>(sx[__ffs(m) - 1]) + i0 + lane : nullptr;
          m &= m - 1;
        }
        int4 v[HG][RU];
#pragma unroll
        for (int h = 0; h < HG; h++)
#pragma unroll
          for (int u = 0; u < RU; u++)
            if (src[h] && i0 + 32 * u + lane < nv) v[h][u] = epk_ld_cg(src[h] + 32 * u, pol);
#pragma unroll
        for (int h = 0; h < HG; h++)
#pragma unroll
          for (int u = 0; u < RU; u++)
            if (src[h] && i0 + 32 * u + lane < nv) add8(acc[u], v[h][u]);
      }
    }
#pragma unroll
    for (int u = 0; u < RU; u++)
      if (i0 + 32 * u + lane < nv) epk_st_hint(out + i0 + 32 * u + lane, epk_pack8(acc[u]), pol);
  }
  for (int k0 = 0; weights && a.has_w && k0 < a.topk; k0 += 32) {
    const int k = k0 + lane;
    float acc = 0.0f;
    for (int g = 0; g < R; g += 32) {
      if (R > 32 || first >= end || k0 == 0) mask = load_group(b, a, c, t, g, sx, sw);
      for (unsigned m = mask; m; m &= m - 1)
        if (k < a.topk) acc += __ldcg(sw[__ffs(m) - 1] + k);
    }
    if (k < a.topk) a.out_w[(int64_t)t * a.topk + k] = acc;
  }
}

/* Where holder r keeps this rank's rows: its ctab entry for us (published before its "staged"
 * flag), or, when every holder reads x in place and stages nothing (priv->comb_hello), its hello
 * of this call (x's registration and offset) and the counts (its rows of ranks before us). */
__device__ void holder_rows(const epk_buf_t &b, const epk_combine_t &a, int r, bool hello,
                            long long *reg, long long *off, long long *wo) {
  if (!hello) {
    const long long *ct = reinterpret_cast<const long long *>(b.peers[r] + b.off_ctab) + 4 * b.rank;
    *reg = __ldcg(ct + 2), *off = __ldcg(ct), *wo = __ldcg(ct + 1);
    return;
  }
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(const_cast<int32_t *>(a.plan));
  const epk_hello_t *h = epk_hello(b, b.rank, (int)(b.priv->seq & 1), r);
  long long pre = 0;
  for (int q = 0; q < b.rank; q++) pre += cnt[q * R + r];
  *reg = (long long)__ldcg(&h->xreg1) - 1;
  *off = __ldcg(reinterpret_cast<const long long *>(&h->xoff)) + pre * 2ll * a.hidden;
  *wo = 0; /* no weights in this form */
}

__device__ void reduce(const epk_buf_t &b, const epk_combine_t &a, const cstate &c, int k, int tc,
                       bool hello) {
  __shared__ const uint8_t *s_x[CWARPS][32];
  __shared__ const float *s_w[CWARPS][32];
  const int warp = threadIdx.x >> 5, R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(const_cast<int32_t *>(a.plan));
  bool bad = false;
  for (int r = threadIdx.x; r < R; r += CT) {
    long long reg, off, wo;
    holder_rows(b, a, r, hello, &reg, &off, &wo);
    const uint8_t *xb = b.peers[r];
    if (reg != -1) { /* rank r's registration: it must be one mapped here, holding our rows */
      const int64_t i = reg * R + r;
      const uint64_t size = reg >= 0 && reg < EPK_MAX_REGS ? b.reg_bytes[i] : 0;
      const uint64_t need = (uint64_t)max(cnt[b.rank * R + r], 0) * 2ull * (uint64_t)a.hidden;
      xb = size ? b.regs[i] : nullptr;
      if (!xb || off < 0 || (uint64_t)off > size || need > size - (uint64_t)off) {
        epk_fail(b, EP_ERR_INTERNAL, EPK_PH_CHECK, r, (uint32_t)reg, true);
        bad = true, xb = b.peers[r];
      }
    }
    c.xo[r] = reinterpret_cast<long long>(xb + off);
    c.wo[r] = wo;
  }
  /* A bad entry stops this rank's call: nothing is read, the flags still go up for the peers. */
  if (__syncthreads_or(bad)) return;
  const int64_t t0 = (int64_t)k * tc, t1 = min((int64_t)a.num_tokens, t0 + tc), n = t1 - t0;
  if (n <= 0) return;
  const int64_t lo = t0 + n * blockIdx.x / gridDim.x, hi = t0 + n * (blockIdx.x + 1) / gridDim.x;
  /* Fewer tokens than warps (small batches): a token's channels in S parts, a warp each, of
   * whole steps of 32 x RU vectors. A warp's token is a chain of dependent load waves, one per
   * step, and one warp per token left most of the block idle (128 tokens at R = 4: 5 of 12
   * warps). Every channel is still summed by one lane in ascending rank order. */
  const int steps = (a.hidden / 8 + 32 * RU - 1) / (32 * RU);
  const int64_t nb = hi - lo;
  const int S =
      EPK_CSPLIT && nb > 0 ? (int)max((int64_t)1, min((int64_t)steps, (int64_t)CWARPS / nb)) : 1;
  for (int64_t i = warp; i < nb * S; i += CWARPS) {
    const int part = (int)(i % S);
    reduce_token(b, a, c, (int)(lo + i / S), part * steps / S, (part + 1) * steps / S, part == 0,
                 s_x[warp], s_w[warp]);
  }
}

__device__ void finish(const epk_buf_t &b) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&b.priv->finished, 1u) != gridDim.x - 1) return;
  for (int s = 0; s < b.nranks; s++) {
    *epk_u32(b.peers[b.rank], b.off_staged, s) = 0;
    *epk_u32(b.peers[b.rank], b.off_cdone, s) = 0;
  }
  b.priv->cnt_a = 0;
  b.priv->cnt_b = 0;
  b.priv->finished = 0;
  epk_fence_peers(b);
}

}  // namespace

/* The kernel's name: ep_kernels.h says why. */
namespace epcomm::normal {
__global__ void __launch_bounds__(CT, 1) combine(EPK_BUF_ARG b, epk_combine_t a) {
  extern __shared__ long long csm[];
  const int R = b.nranks;
  epk_grid_wait();            /* for the notify kernel before it (epk_launch_dependent) */
  if (epk_stopped(b)) return; /* the hello failed: nothing moves */
  epk_tr_min(b, EPK_TR_D_START);
  epk_tr_max(b, EPK_TR_D_START_LAST);
  int *ints = reinterpret_cast<int *>(csm + 2 * R);
  cstate c = {csm, csm + R, ints, ints + R, ints + 2 * R, ints + 3 * R, ints + 4 * R};
  const int K = b.priv->comb_k, tc = b.priv->comb_tc;
  const int32_t *cnt = epk_plan_cnt(const_cast<int32_t *>(a.plan));
  for (int s = threadIdx.x; s < R; s += CT) {
    int pre = 0;
    for (int q = 0; q < s; q++) pre += cnt[q * R + b.rank];
    c.pre[s] = pre;
    c.cme[s] = cnt[s * R + b.rank];
  }
  __syncthreads();
  const bool hello = b.priv->comb_hello; /* one round, nothing staged: no "staged" flags */
  for (int k = 0; k < K; k++) {
    if (k > 0 && !wait_all(b, b.off_cdone, (uint32_t)k, EPK_PH_CDONE)) return;
    if (!hello) {
      stage(b, a, c, k, K, tc);
      signal_all(b, &b.priv->cnt_a, (unsigned)k, b.off_staged);
      if (!wait_all(b, b.off_staged, (uint32_t)k + 1, EPK_PH_STAGED)) return;
    }
    reduce(b, a, c, k, tc, hello);
    signal_all(b, &b.priv->cnt_b, (unsigned)k, b.off_cdone);
  }
  epk_tr_min(b, EPK_TR_D_OWN_FIRST);
  epk_tr_max(b, EPK_TR_D_OWN);
  /* Our rows (perhaps the caller's x itself) stay readable until every source is done. */
  if (!wait_all(b, b.off_cdone, (uint32_t)K, EPK_PH_CDONE)) return;
  epk_tr_max(b, EPK_TR_D_PEERS);
  finish(b);
  epk_tr_max(b, EPK_TR_D_END);
}

}  // namespace epcomm::normal

extern "C" cudaError_t epk_launch_combine(const epk_buf_t *b, const epk_combine_t *a,
                                          cudaStream_t s) {
  size_t smem = (size_t)b->nranks * (2 * sizeof(long long) + 5 * sizeof(int));
  return epk_launch_dependent(epcomm::normal::combine, b->blocks, CT, smem, s, *b, *a);
}
