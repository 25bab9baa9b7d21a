/* Device helpers shared by the kernels: flags between ranks, deadlines, failure records, scans.
 *
 * Flags between ranks: data is written with plain stores, then one thread fences and publishes a
 * flag with release semantics; the reader acquires the flag, then reads the data through L2
 * (ld.cg), never through a possibly stale L1 line. The scope is the system's (peers may be
 * other GPUs over NVLink/PCIe), except for the normal-mode kernels of a buffer whose ranks all
 * run on one GPU (epk_buf_t.one_gpu, the *_peer helpers below): the GPU's. */
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/kernels/ep_kernels.h"
#include "epcomm.h"

#define EPK_FULL 0xffffffffu

static __device__ __forceinline__ uint64_t epk_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

static __device__ __forceinline__ uint32_t epk_ld_acq(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ void epk_st_rel(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* The normal-mode kernels' flags and fences between ranks: at .gpu scope when every rank of the
 * buffer runs on this GPU (processes sharing it under MPS: one L2 orders them all), .sys
 * otherwise. Under MPS a .sys fence cost ~1.5 us, and at 128 tokens the .gpu scope made the
 * calls 2-12% faster on an H100 (docs/PERFORMANCE.md). b.one_gpu is the buffer's constant: every
 * thread takes the same branch. */
static __device__ __forceinline__ void epk_fence_peers(const epk_buf_t &b) {
  if (b.one_gpu)
    __threadfence();
  else
    __threadfence_system();
}
static __device__ __forceinline__ uint32_t epk_ld_peer(const epk_buf_t &b, const uint32_t *p) {
  uint32_t v;
  if (b.one_gpu)
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
/* Flags to many peers after one epk_fence_peers: the fence followed by relaxed stores is a
 * release pattern for every one of them (PTX memory model), where a st.release per peer would
 * fence again each time (measured: ~1.5 us per peer under MPS, serial in one thread). */
static __device__ __forceinline__ void epk_st_peer(const epk_buf_t &b, uint32_t *p, uint32_t v) {
  if (b.one_gpu)
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void epk_add_peer(const epk_buf_t &b, uint32_t *p, uint32_t v) {
  if (b.one_gpu)
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ uint32_t *epk_u32(uint8_t *base, uint64_t off, int i) {
  return reinterpret_cast<uint32_t *>(base + off) + i;
}

/* hello[parity][writer] in the pool of `owner` (ep_kernels.h). */
static __device__ __forceinline__ epk_hello_t *epk_hello(const epk_buf_t &b, int owner, int parity,
                                                         int writer) {
  uint8_t *base = b.peers[owner] + b.off_hello;
  return reinterpret_cast<epk_hello_t *>(
      base + ((uint64_t)parity * (uint64_t)b.nranks + (uint64_t)writer) * b.slot_bytes);
}

static __device__ __forceinline__ bool epk_stopped(const epk_buf_t &b) {
  return *reinterpret_cast<volatile uint32_t *>(&b.priv->call_status) != 0;
}

/* A call's start: no failure of its own yet (call_status, and call_err, the word behind it). */
static __device__ __forceinline__ void epk_call_reset(const epk_buf_t &b) {
  b.priv->call_status = 0, b.priv->call_err = 0ull;
}

/* A failed synchronous call's own word, for the host waiting with its ticket (fence after it:
 * the caller's, before the ticket). The host preset 0. */
static __device__ __forceinline__ void epk_call_err_post(const epk_buf_t &b) {
  *reinterpret_cast<volatile unsigned long long *>(&b.host->call_err) =
      *reinterpret_cast<volatile unsigned long long *>(&b.priv->call_err);
}

/* The buffer's first failure wins the device word (epk_err_claim), except that one breaking the
 * buffer replaces one that moved no data: the latter may sit there, left by a call nobody waited
 * for, while a host waits (cuda_sync.c), and the host must see the former at once. */
static __device__ __forceinline__ bool epk_err_claim(const epk_buf_t &b, unsigned long long v) {
  const bool mild = epk_code_no_data((uint32_t)(v >> 56));
  for (unsigned long long old = 0ull;;) {
    const unsigned long long seen = atomicCAS(&b.priv->err, old, v);
    if (seen == old) return true;
    if (seen && (mild || !epk_code_no_data((uint32_t)(seen >> 56)))) return false;
    old = seen; /* 0: the host cleared the word meanwhile */
  }
}

/* A winner mirrors its word to the host, after whatever explains it. Two winners (a no-data word,
 * then the breaking one that replaced it) post in no set order: the no-data one looks at the
 * device word after its post and, if it was replaced, posts the replacement, so that the host
 * ends with the breaking word whichever post came last. */
static __device__ __noinline__ void epk_err_post(const epk_buf_t &b, unsigned long long v) {
  for (;;) {
    *reinterpret_cast<volatile unsigned long long *>(&b.host->err) = v;
    __threadfence_system();
    if (!epk_code_no_data((uint32_t)(v >> 56))) return;
    const unsigned long long now = atomicOr(&b.priv->err, 0ull);
    if (now == v || now == 0ull) return; /* 0: the host took it meanwhile */
    v = now;
  }
}

/* Records a failure of the buffer (device word, mirrored to the host; see epk_err_claim) and,
 * when `stop`, makes every block of this rank's current call give up. */
static __device__ __noinline__ void epk_fail(const epk_buf_t &b, uint32_t code, uint32_t phase,
                                             int peer, uint32_t detail, bool stop) {
  unsigned long long v = epk_err_pack(code, phase, peer, detail);
  if (stop) { /* before the word and call_status: whoever sees either finds it */
    atomicCAS(&b.priv->call_err, 0ull, v);
    __threadfence();
  }
  if (epk_err_claim(b, v)) epk_err_post(b, v);
  if (stop) atomicExch(&b.priv->call_status, code);
}

/* One spin-wait: call tick() once per unsuccessful poll; it returns true when the caller must
 * give up (deadline passed: recorded as a timeout naming `peer`; another block failed; or the
 * host asked every kernel to stop). */
struct epk_waiter {
  uint64_t t0;
  uint32_t n;
  __device__ void reset() { t0 = 0, n = 0; }
  __device__ bool tick(const epk_buf_t &b, int peer, uint32_t phase) {
    ++n;
    if (n & 15u) return false;
    if (epk_stopped(b)) return true;
    if ((n & 1023u) == 0 && *reinterpret_cast<volatile uint32_t *>(&b.host->abort)) {
      atomicExch(&b.priv->call_status, (uint32_t)EP_ERR_PEER_FAILED);
      return true;
    }
    uint64_t now = epk_now();
    if (!t0)
      t0 = now;
    else if (now - t0 > b.timeout_ns) {
      epk_fail(b, EP_ERR_TIMEOUT, phase, peer, 0, true);
      return true;
    }
    return false;
  }
};

/* Measurement (tools/gpu_session.sh 18; default -1: the driver's choice): every normal-mode
 * kernel asks for the same split of an SM's L1 and shared memory, EPK_CARVEOUT percent of the
 * most shared memory. By default the notify kernel (26 KB a block, up to four blocks an SM) gets
 * a larger shared part than the data kernels (one block an SM): a full dispatch runs its notify
 * on ~17 SMs a rank, a cached one on one, and an SM keeps a split until it is idle for a kernel
 * that wants another; the question is whether R = 8's data kernels then run with less L1. */
#ifndef EPK_CARVEOUT
#define EPK_CARVEOUT -1
#endif
template <typename... P>
static void epk_carveout(void (*k)(P...)) {
#if EPK_CARVEOUT >= 0
  (void)cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, EPK_CARVEOUT);
#else
  (void)k;
#endif
}

/* Programmatic dependent launch (sm_90): a data kernel is launched to overlap the end of the
 * notify kernel before it in the stream (its launch and block scheduling, ~6-9 us between the two
 * kernels under MPS, EP_CUDA_TRACE "gap to data"). It must wait for the notify grid, whose
 * writes it reads, before anything else: epk_grid_wait() first, always. The notify kernel lets it
 * start once every peer's hello is in (epk_grid_trigger). */
static __device__ __forceinline__ void epk_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif /* older GPUs: plain stream order, nothing to wait for */
}
static __device__ __forceinline__ void epk_grid_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
template <typename... P, typename... A>
static cudaError_t epk_launch_dependent(void (*k)(P...), int grid, int block, size_t smem,
                                        cudaStream_t s, A... args) {
  epk_carveout(k);
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid), c.blockDim = dim3(block), c.dynamicSmemBytes = smem, c.stream = s;
  c.attrs = at, c.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&c, k, args...);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  (void)cudaGetLastError(); /* a device without it: the plain launch */
  c.numAttrs = 0;
  return cudaLaunchKernelEx(&c, k, args...);
}

/* L2 eviction priority of the rows a call moves (EP_CUDA_L2_HINT; the kernel arguments'
 * `stream`). A dispatch reads each token's row once and writes it once per destination (a row
 * staged for pulling, read by every destination, keeps normal priority); a combine reads each
 * received row once and writes each output row once; a full dispatch's ids and weights, read
 * once too, take the same priority (epk_st_hint_b64 / _f32). Streamed evict-first, those bytes
 * stop pushing out of L2 what is still being filled or reused: the source indices that several
 * warps write a line of, the flags, the plan. Measured on an H100
 * (docs/PERFORMANCE.md): up to 14% faster calls from ~13 MB of rows over all ranks (R = 4 and 8
 * at 128 tokens, R = 2 from 512), within 1% at R = 4 and 4096 tokens, ~3% slower at ~7 MB (bf16,
 * R = 2, 128 tokens): whence the host's size test (cuda_l2_stream). */
static __device__ __forceinline__ uint64_t epk_l2_policy(bool first) {
  uint64_t p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
#else
  (void)first;
#endif
  return p;
}
/* 16 bytes of read-only memory (not cached in L1: read once), at the policy's L2 priority. */
static __device__ __forceinline__ int4 epk_ld_once(const int4 *p, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
#else
  (void)pol;
  return __ldg(p);
#endif
}
/* 16 bytes another rank writes (cached in L2 only, as __ldcg), at the policy's L2 priority. */
static __device__ __forceinline__ int4 epk_ld_cg(const int4 *p, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  int4 v;
  asm volatile("ld.global.cg.L2::cache_hint.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol)
               : "memory");
  return v;
#else
  (void)pol;
  return __ldcg(p);
#endif
}
static __device__ __forceinline__ void epk_st_hint(int4 *p, int4 v, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("st.global.L2::cache_hint.v4.s32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
               : "memory");
#else
  (void)pol;
  *p = v;
#endif
}
/* One scalar store at the policy's L2 priority (a full dispatch's ids and weights): NAME(p, v,
 * pol) for T, its PTX type and its asm constraint. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define EPK_ST_HINT_SCALAR(NAME, T, PTX, CON)                                                \
  static __device__ __forceinline__ void NAME(T *p, T v, uint64_t pol) {                     \
    asm volatile("st.global.L2::cache_hint." PTX " [%0], %1, %2;" ::"l"(p), CON(v), "l"(pol) \
                 : "memory");                                                                \
  }
#else
#define EPK_ST_HINT_SCALAR(NAME, T, PTX, CON)                            \
  static __device__ __forceinline__ void NAME(T *p, T v, uint64_t pol) { \
    (void)pol;                                                           \
    *p = v;                                                              \
  }
#endif
EPK_ST_HINT_SCALAR(epk_st_hint_b64, int64_t, "b64", "l")
EPK_ST_HINT_SCALAR(epk_st_hint_f32, float, "f32", "f")

/* EP_CUDA_TRACE points (ep_kernels.h): thread 0 of the calling block. */
static __device__ __forceinline__ void epk_tr_set(const epk_buf_t &b, int i) {
  if (b.trace && threadIdx.x == 0) atomicExch(&b.trace->at[i], (unsigned long long)epk_now());
}
static __device__ __forceinline__ void epk_tr_min(const epk_buf_t &b, int i) {
  if (b.trace && threadIdx.x == 0) atomicMin(&b.trace->at[i], (unsigned long long)epk_now());
}
static __device__ __forceinline__ void epk_tr_max(const epk_buf_t &b, int i) {
  if (b.trace && threadIdx.x == 0) atomicMax(&b.trace->at[i], (unsigned long long)epk_now());
}

/* Block-wide exclusive sum of one int per thread; *total gets the sum. All threads call it. */
template <int NT>
static __device__ __forceinline__ int epk_block_scan(int v, int *total) {
  __shared__ int warp_sum[NT / 32];
  __shared__ int all;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(EPK_FULL, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads(); /* warp_sum may still be read by a previous call */
  if (lane == 31) warp_sum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < NT / 32 ? warp_sum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(EPK_FULL, s, o);
      if (lane >= o) s += y;
    }
    if (lane < NT / 32) warp_sum[lane] = s;
    if (lane == 31) all = s;
  }
  __syncthreads();
  *total = all;
  return (warp ? warp_sum[warp - 1] : 0) + x - v;
}

/* First slot of topk_idx[n][topk] holding an id < -1 or >= E, or INT64_MAX. Block-wide. */
static __device__ __forceinline__ long long epk_first_bad(const int64_t *idx, int n, int topk,
                                                          int E) {
  __shared__ unsigned long long bad;
  if (threadIdx.x == 0) bad = ~0ull;
  __syncthreads();
  const long long total = (long long)n * topk;
  for (long long i = threadIdx.x; i < total; i += blockDim.x) {
    int64_t e = idx[i];
    if (e < -1 || e >= E) atomicMin(&bad, (unsigned long long)i);
  }
  __syncthreads();
  long long r = bad == ~0ull ? INT64_MAX : (long long)bad;
  __syncthreads();
  return r;
}

/* One warp copies nv 16-byte vectors, U loads in flight per lane (latency, not bandwidth, is
 * what a single load per lane would be bound by). L2: the source may have been written by a
 * peer (ld.cg); otherwise the read-only path. */
template <bool L2, int U = 8>
static __device__ __forceinline__ void epk_warp_copy(int4 *dst, const int4 *src, int nv) {
  const int lane = threadIdx.x & 31;
  for (int i0 = 0; i0 < nv; i0 += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      int i = i0 + 32 * u + lane;
      if (i < nv) v[u] = L2 ? __ldcg(src + i) : __ldg(src + i);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      int i = i0 + 32 * u + lane;
      if (i < nv) dst[i] = v[u];
    }
  }
}

/* Eight bf16 channels (one int4) as floats: exact. */
static __device__ __forceinline__ void epk_cvt8(float *x, int4 v) {
  const uint32_t u[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    x[2 * e] = __uint_as_float(u[e] << 16);
    x[2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
  }
}

/* The reference's float(b0) + float(b1) for vector i of the biases, an absent bias being +0.0f
 * (so -0.0 behaves alike): where every combine's accumulator starts. */
static __device__ __forceinline__ void epk_init8(float *acc, const int4 *b0, const int4 *b1,
                                                 size_t i) {
  float x[8], y[8];
  if (b0) epk_cvt8(x, __ldg(b0 + i));
  if (b1) epk_cvt8(y, __ldg(b1 + i));
#pragma unroll
  for (int e = 0; e < 8; e++) acc[e] = (b0 ? x[e] : 0.0f) + (b1 ? y[e] : 0.0f);
}

/* Eight floats rounded to bf16 (RNE), one int4. */
static __device__ __forceinline__ int4 epk_pack8(const float *acc) {
  uint32_t u[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * e]));
    uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * e + 1]));
    u[e] = lo | (hi << 16);
  }
  return make_int4((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
}
