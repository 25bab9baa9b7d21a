/* Device helpers of the low-latency kernels: addresses in the region (ll_kernels.h), waits with
 * the buffer's deadline and the host's abort word, sequence-number comparisons, reports to a
 * waiting host, and the bit-exact numerics of SEMANTICS.md §1.3, §5 (ports of the CPU backend's
 * src/cpu/cpu_ll_kernels.c: every rounding is explicit, so nvcc's contraction cannot change a
 * bit). Ordering between ranks is that of common.cuh: plain stores, a system fence, a release
 * store of the flag; the reader acquires the flag and reads through L2. */
#pragma once

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/ll_kernels.h"

namespace epk_ll {

/* ------------------------------------------------------------------ addresses */

__device__ __forceinline__ epk_ll_priv_t *priv(const epk_ll_t &ll) {
  return reinterpret_cast<epk_ll_priv_t *>(ll.priv);
}
__device__ __forceinline__ uint8_t *slot_mem(const epk_ll_t &ll, int i) {
  return ll.priv + ll.lay.p_slot + (uint64_t)i * ll.lay.p_slot_bytes;
}
__device__ __forceinline__ epk_ll_slot_t *slot_state(const epk_ll_t &ll, int i) {
  return reinterpret_cast<epk_ll_slot_t *>(slot_mem(ll, i));
}
template <typename T>
__device__ __forceinline__ T *slot_arr(const epk_ll_t &ll, int i, uint64_t off) {
  return reinterpret_cast<T *>(slot_mem(ll, i) + off);
}
__device__ __forceinline__ uint8_t *region(const epk_buf_t &b, const epk_ll_t &ll, int rank) {
  return b.peers[rank] + ll.lay.off;
}
__device__ __forceinline__ epk_ll_entry_t *entry(const epk_buf_t &b, const epk_ll_t &ll, int rank,
                                                 uint32_t q) {
  return reinterpret_cast<epk_ll_entry_t *>(region(b, ll, rank) + (q & 1u) * ll.lay.entry_bytes);
}
__device__ __forceinline__ int32_t *entry_sel(epk_ll_entry_t *e) {
  return reinterpret_cast<int32_t *>(e + 1);
}
__device__ __forceinline__ uint32_t *creject(const epk_buf_t &b, const epk_ll_t &ll, int rank) {
  return reinterpret_cast<uint32_t *>(region(b, ll, rank) + ll.lay.creject);
}
/* Control and data parts of slot `slot` in `rank`'s pool. */
__device__ __forceinline__ uint8_t *ctrl(const epk_buf_t &b, const epk_ll_t &ll, int rank,
                                         int slot) {
  return region(b, ll, rank) + ll.lay.ctrl + (uint64_t)slot * ll.lay.ctrl_bytes;
}
__device__ __forceinline__ uint8_t *data(const epk_buf_t &b, const epk_ll_t &ll, int rank,
                                         int slot) {
  return region(b, ll, rank) + ll.lay.data + (uint64_t)slot * ll.lay.data_bytes;
}
__device__ __forceinline__ uint32_t *flag(uint8_t *ctrl_part, uint64_t off, int writer) {
  return reinterpret_cast<uint32_t *>(ctrl_part + off) + writer;
}

/* ------------------------------------------------------------------ ordering */

/* a >= b for sequence numbers that may wrap. */
__device__ __forceinline__ bool seq_ge(uint32_t a, uint32_t b) {
  return (int32_t)(a - b) >= 0;
}

__device__ __forceinline__ uint32_t ld_acq_gpu(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_rel_gpu(uint32_t *p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* A spin-wait: tick() once per unsuccessful poll; true when the caller must give up: the host
 * asked every kernel to stop (it reports why itself), or `patience` deadlines passed (recorded
 * as a timeout naming `peer`). Blocks that wait on another block of their own kernel, which
 * waits on the peers itself, use patience 2 so that the precise failure is the one recorded. */
struct waiter {
  uint64_t t0;
  uint32_t n;
  __device__ void reset() { t0 = 0, n = 0; }
  __device__ bool tick(const epk_buf_t &b, int peer, uint32_t phase, uint32_t patience = 1) {
    if (++n & 15u) return false;
    if ((n & 1023u) == 0 && *reinterpret_cast<volatile uint32_t *>(&b.host->abort)) return true;
    const uint64_t now = epk_now();
    if (!t0)
      t0 = now;
    else if (now - t0 > patience * b.timeout_ns) {
      epk_fail(b, EP_ERR_TIMEOUT, phase, peer, 0, false);
      return true;
    }
    return false;
  }
};

/* The verdict for a host waiting with `ticket`: fields first, then the ticket, each behind a
 * system fence. Ticket 0: the fields alone (a deferred failure's copy in ll_defer). */
__device__ __forceinline__ void report(epk_ll_report_t *to, const epk_ll_report_t &v,
                                       uint32_t ticket) {
  volatile epk_ll_report_t *r = to;
  r->status = v.status, r->peer = v.peer, r->nrecv = v.nrecv, r->item = v.item;
  r->dup_k = v.dup_k, r->mine = v.mine, r->theirs = v.theirs, r->field = v.field, r->topk = v.topk;
  r->value = v.value, r->want = v.want;
  __threadfence_system();
  if (!ticket) return;
  r->ticket = ticket;
  __threadfence_system();
}

/* A failure that moved no data, seen by a call nobody waits for on the host (graph capture):
 * the next call on the buffer reports it (cuda_sync.c) from its own copy of the verdict, which
 * no later call's report overwrites (one a host waits for may land before the host reads it),
 * with the call's topk to decode the entry. */
__device__ __forceinline__ void defer(const epk_buf_t &b, epk_ll_report_t v, uint32_t phase,
                                      int topk) {
  const unsigned long long w = epk_err_pack((uint32_t)v.status, phase, v.peer, (uint32_t)v.item);
  if (!epk_err_claim(b, w)) return; /* an earlier failure is reported first */
  v.topk = topk;
  report(&b.host->ll_defer, v, 0);
  epk_err_post(b, w);
}

__device__ __forceinline__ epk_ll_report_t no_report() {
  epk_ll_report_t v;
  v.ticket = 0, v.status = EP_OK, v.peer = -1, v.nrecv = 0, v.item = -1, v.dup_k = -1;
  v.mine = v.theirs = v.field = v.topk = 0;
  v.value = v.want = 0;
  return v;
}

/* Last block out: true in exactly one thread 0 of the kernel, after every block reached here;
 * the counter is reset for the next kernel. The fences make every block's writes visible to
 * that block (and, system scope, to the peers it then releases a flag to). */
__device__ __forceinline__ bool last_block(uint32_t *counter) {
  __syncthreads();
  if (threadIdx.x != 0) return false;
  __threadfence_system();
  if (atomicAdd(counter, 1u) != gridDim.x - 1) return false;
  __threadfence_system();
  *counter = 0;
  return true;
}

/* ------------------------------------------------------------------ trace (EP_CUDA_LL_TRACE) */

__device__ __forceinline__ epk_ll_trace_t *trace(const epk_ll_t &ll) {
  return reinterpret_cast<epk_ll_trace_t *>(ll.priv + ll.lay.p_trace);
}
/* Point i of the current kernel: the earliest (first block start), set once, or the latest. */
__device__ __forceinline__ void tr_min(const epk_ll_t &ll, int i) {
  if (ll.trace && threadIdx.x == 0) atomicMin(&trace(ll)->at[i], (unsigned long long)epk_now());
}
__device__ __forceinline__ void tr_set(const epk_ll_t &ll, int i) {
  if (ll.trace && threadIdx.x == 0) atomicExch(&trace(ll)->at[i], (unsigned long long)epk_now());
}
__device__ __forceinline__ void tr_max(const epk_ll_t &ll, int i) {
  if (ll.trace && threadIdx.x == 0) atomicMax(&trace(ll)->at[i], (unsigned long long)epk_now());
}
/* The last block, thread 0, once every other block's points are in (after last_block): point
 * `last` is now; the deltas go to the sums of `kind`, the points are reset. A point nobody set
 * (0) takes the previous one's time. */
__device__ __forceinline__ void tr_commit(const epk_ll_t &ll, int kind, int last) {
  if (!ll.trace) return;
  epk_ll_trace_t *t = trace(ll);
  t->at[last] = epk_now();
  unsigned long long prev = t->at[0];
  for (int i = 1; i <= last; i++) {
    unsigned long long v = t->at[i] ? t->at[i] : prev;
    v = v < prev ? prev : v;
    t->sum[kind][i] += v - prev;
    prev = v;
  }
  t->sum[kind][0] += prev - t->at[0];
  t->n[kind]++;
  t->at[0] = ~0ull;
  for (int i = 1; i < EPK_LL_TR_POINTS; i++) t->at[i] = 0;
  __threadfence();
}

/* ------------------------------------------------------------------ numerics */

__device__ __forceinline__ float bf16_f32(uint32_t b16) {
  return __uint_as_float(b16 << 16);
}

/* Round to nearest even; NaN gives 0x7fff (SEMANTICS.md §1.3). */
__device__ __forceinline__ uint32_t f32_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* fp32 -> e4m3fn (SEMANTICS.md §5.1): nearest even, |x| >= 448 saturates, NaN -> 0x7f. */
__device__ __forceinline__ uint32_t f32_e4m3(float f) {
  const uint32_t u = __float_as_uint(f), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  if (a > 0x7f800000u) return 0x7fu;
  if (a >= 0x43e00000u) return sign | 0x7eu;
  if (a < 0x3c800000u) /* the add rounds |x| to a multiple of 2^-9 (the ulp of 2^14), even ties */
    return sign | (__float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(0x46800000u))) -
                   0x46800000u);
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return sign | ((r - (120u << 3)) & 0xffu);
}

/* Scale of one block of 128 from its amax (SEMANTICS.md §5.3-5.4): returns the multiplier; *inv
 * gets the stored scale and *e its exponent (round_scale). */
__device__ __forceinline__ float block_scale(float amax, bool round_scale, float *inv, int *e) {
  const float inv448 = 1.0f / 448.0f; /* 0x3b124925, as the C constant */
  if (!round_scale) {
    *inv = __fmul_rn(amax, inv448);
    *e = 0;
    return __fdiv_rn(448.0f, amax);
  }
  const uint32_t bits = __float_as_uint(__fmul_rn(amax, inv448));
  *e = (int)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0); /* ceil(log2) */
  *inv = __uint_as_float((uint32_t)(*e + 127) << 23);
  return __uint_as_float((uint32_t)(127 - *e) << 23);
}

/* |x| of 8 bf16 folded into a: a NaN never compares greater, so it never raises amax. */
__device__ __forceinline__ void amax8(int4 v, float *a) {
  const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float lo = fabsf(bf16_f32(w[i] & 0xffffu)), hi = fabsf(bf16_f32(w[i] >> 16));
    *a = lo > *a ? lo : *a;
    *a = hi > *a ? hi : *a;
  }
}

/* 8 e4m3 codes of 8 bf16 times mult, in channel order. */
__device__ __forceinline__ uint2 e4m3x8(int4 v, float mult) {
  const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t lo = f32_e4m3(__fmul_rn(bf16_f32(w[i] & 0xffffu), mult));
    const uint32_t hi = f32_e4m3(__fmul_rn(bf16_f32(w[i] >> 16), mult));
    out[i / 2] |= (lo | hi << 8) << (16 * (i % 2));
  }
  return make_uint2(out[0], out[1]);
}

/* acc[j] = fmaf(float(bf16 j of v), w, acc[j]): one rounding per step (SEMANTICS.md §6.5). */
__device__ __forceinline__ void fma8(float *acc, int4 v, float w) {
  const uint32_t u[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    acc[2 * i] = __fmaf_rn(bf16_f32(u[i] & 0xffffu), w, acc[2 * i]);
    acc[2 * i + 1] = __fmaf_rn(bf16_f32(u[i] >> 16), w, acc[2 * i + 1]);
  }
}

__device__ __forceinline__ int4 pack8(const float *acc) {
  uint32_t u[4];
#pragma unroll
  for (int i = 0; i < 4; i++) u[i] = f32_bf16(acc[2 * i]) | f32_bf16(acc[2 * i + 1]) << 16;
  return make_int4((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
}

/* The sender's fp8 cast of token row src (SEMANTICS.md §5) into q (H bytes) and its scales:
 * a lane casts 8 channels per step, a half-warp one block of 128. sc(b) is where block b's
 * scale goes (float, or its exponent byte). */
template <typename ScaleAt>
__device__ void cast_row(const int4 *src, int H, int fmt, uint8_t *q, ScaleAt sc) {
  const int lane = threadIdx.x & 31, nv = H / 8, steps = (nv + 31) / 32;
  const bool round = fmt & (EPK_LL_ROUND | EPK_LL_UE8M0), ue8m0 = fmt & EPK_LL_UE8M0;
  constexpr int U = 4;
  for (int s0 = 0; s0 < steps; s0 += U) {
    int4 v[U];
    float amax[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int i = (s0 + u) * 32 + lane;
      amax[u] = 1e-4f;
      v[u] = i < nv ? __ldg(src + i) : make_int4(0, 0, 0, 0);
      if (i < nv) amax8(v[u], &amax[u]);
    }
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int o = 8; o; o >>= 1) { /* over the half-warp: max is exact in any order */
        const float x = __shfl_xor_sync(EPK_FULL, amax[u], o);
        amax[u] = x > amax[u] ? x : amax[u];
      }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int i = (s0 + u) * 32 + lane;
      if (i >= nv) continue;
      float inv;
      int e;
      const float mult = block_scale(amax[u], round, &inv, &e);
      reinterpret_cast<uint2 *>(q)[i] = e4m3x8(v[u], mult);
      if ((lane & 15) == 0) sc(i / 16, ue8m0, inv, e);
    }
  }
}

/* A block's scale as one word: the float's bits, or (use_ue8m0) the exponent byte e + 127. */
__device__ __forceinline__ uint32_t scale_word(bool ue8m0, float inv, int e) {
  return ue8m0 ? (uint32_t)(e + 127) : __float_as_uint(inv);
}

/* Block blk's scale word v of row `row` of local expert le into the receive layout (SEMANTICS.md
 * §6.4): rows [L][RT][NS] floats or bytes; columns [L][NS][RT] floats, or with use_ue8m0
 * [L][NS/4][RT] int32 holding block 4j+i in byte i. */
__device__ __forceinline__ void put_scale(uint8_t *scales, bool cols, bool ue8m0, int le, int row,
                                          int NS, int RT, int blk, uint32_t v) {
  const int64_t r = (int64_t)le * RT + row;
  if (ue8m0)
    scales[cols ? (((int64_t)le * (NS / 4) + blk / 4) * RT + row) * 4 + blk % 4 : r * NS + blk] =
        (uint8_t)v;
  else
    reinterpret_cast<float *>(scales)[cols ? ((int64_t)le * NS + blk) * RT + row : r * NS + blk] =
        __uint_as_float(v);
}

}  // namespace epk_ll
