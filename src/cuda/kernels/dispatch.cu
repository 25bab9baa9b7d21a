/* Dispatch data phase. Each block owns a contiguous slice of this rank's tokens; a warp reads a
 * token's row once and writes it straight to its final row in every destination's area D (the
 * row index comes from the plan: rows of source s start at sum of cnt[s' < s][d]). When a
 * destination's rows do not fit its area at once, they go in windows of W rows: the receiver
 * copies a window out to the caller's outputs, then frees it for the next one. Every block polls
 * both sides (its sends, and its share of the receive side), so no block ever waits on work that
 * only a waiting block could do.
 * Pulled (every rank copies out into unregistered arrays and everything fits at once; the hellos'
 * `pull`): a source writes each token's row once, into its own area D at row t, and only the
 * metadata into the destinations' areas; the receiver copies each row from its source's area.
 * Pushed, a row crosses memory three times per destination (sent, read back, written out);
 * pulled, twice per destination and twice per token: 25% fewer bytes at R = 8 with top-8 of 256
 * experts, where a copy-out dispatch is bound by the memory bandwidth the ranks share. */
#include "cuda/kernels/common.cuh"

/* Shape (tools/kernel_variants.sh times others): 16 warps x 8 vectors per lane; 256 threads x
 * 16 was 20% slower for fp8 at R=2 and within 3% elsewhere. */
#ifndef EPK_DT
#define EPK_DT 512
#endif
#define DT EPK_DT
#define DWARPS (DT / 32)
#ifndef EPK_UNR
#define EPK_UNR 8
#endif
#define UNR EPK_UNR
/* 1: a token's scales, ids and weights loaded once for all its destinations; 0: once per
 * destination (kernel_variants.sh compares). */
#ifndef EPK_DMETA
#define EPK_DMETA 1
#endif
/* Pulled rows (tools/gpu_session.sh 10 times the variants): 1: a source's rows copied as soon as
 * it arrived; 0: once all have. SPLIT 1: a block takes a share of every source's rows; 0: a
 * slice of all rows (one or two sources at R = 8); 2: the share from EPK_PULL_SHARE_R ranks up,
 * else the slice. On an H100, 4096 tokens, bf16: the share was 5% faster at R = 8 (every block
 * busy with whichever source arrived) and the slice 4% faster at R = 4; EACH 1 was 1-7% faster
 * at R = 4 and within 1% at R = 8 (docs/PERFORMANCE.md). */
#ifndef EPK_PULL_EACH
#define EPK_PULL_EACH 1
#endif
#ifndef EPK_PULL_SPLIT
#define EPK_PULL_SPLIT 2
#endif
#ifndef EPK_PULL_SHARE_R
#define EPK_PULL_SHARE_R 8
#endif
/* Where blocks take a share of every source (SPLIT 1, or 2 from SHARE_R up), CLAIM 1: the
 * share taken in runs of RUN rows from a counter by whichever warp comes next (claim_rows); 0:
 * a fixed share per block. */
#ifndef EPK_PULL_CLAIM
#define EPK_PULL_CLAIM 1
#endif
#ifndef EPK_PULL_RUN
#define EPK_PULL_RUN 8
#endif
static_assert(EPK_PULL_RUN >= 1 && EPK_PULL_RUN <= 32, "a lane loads each row's token of a run");

namespace {

struct dstate {
  int64_t *base;  /* [R] first row of this rank's rows in destination d */
  int *rounds;    /* [R] windows of destination d */
  int *wcur;      /* [R] window of d being sent */
  int *open;      /* [R] is wcur[d] free to write now */
  uint8_t **xdst; /* [R] d's recv_x as mapped here when d's x rows go straight there (its hello
                     names a registration holding it, and its rows fit), else NULL */
  int64_t *rbase; /* [R + 1] pulled: first row of source s's rows here, then the total */
  uint8_t *got;   /* [R] pulled: source s's rows (pull_step) */
  bool pull;      /* rows pulled (every hello allows it and every destination's rows fit) */
};

/* Asynchronous copies global -> shared (no register holds the value meanwhile); before sm_80,
 * which has no cp.async, plain copies. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define EPK_CP_ASYNC 1
#else
#define EPK_CP_ASYNC 0
#endif
/* One T (4 or 8 bytes) from gmem to smem. */
template <typename T>
__device__ __forceinline__ void cp_async(T *smem, const T *gmem) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async .ca copies 4, 8 or 16 bytes");
#if EPK_CP_ASYNC
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(gmem), "n"(sizeof(T))
               : "memory");
#else
  *smem = *gmem;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if EPK_CP_ASYNC
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/* This thread's copies have landed (each lane reads only its own slots: no warp sync needed). */
__device__ __forceinline__ void cp_async_wait() {
#if EPK_CP_ASYNC
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

/* A token's scales (<= 64), ids and weights (<= 32 slots), fetched into the warp's shared slots
 * while its row is copied: lane k fetches (and later reads) slot k and k + 32. The kernel runs at
 * 128 registers a thread, so the values cannot stay in registers across the row; loading them
 * after it cost one dependent load latency a token (bf16: the full dispatch's data kernel took
 * ~7 us more than the cached one's at R = 2, EP_CUDA_TRACE). */
struct token_meta {
  int64_t id[DWARPS][32];
  float w[DWARPS][32], sc[DWARPS][64];
};

__device__ void meta_fetch(const epk_dispatch_t &a, int t, bool hs, bool hk, token_meta &m) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (hs && lane < a.num_scales)
    cp_async(&m.sc[warp][lane], a.x_scales + t * a.scale_tok + lane * a.scale_hid);
  if (hs && lane + 32 < a.num_scales)
    cp_async(&m.sc[warp][lane + 32], a.x_scales + t * a.scale_tok + (lane + 32) * a.scale_hid);
  if (hk && lane < a.topk) {
    cp_async(&m.id[warp][lane], a.topk_idx + (int64_t)t * a.topk + lane);
    if (a.has_w) cp_async(&m.w[warp][lane], a.topk_weights + (int64_t)t * a.topk + lane);
  }
  cp_async_commit();
}

/* Row and metadata of token t to every destination in `mask` (lane l: destination g + l, whose
 * area D is dst[l], whose window-local row is jw[l] and whose x row goes to dx[l]). */
__device__ void send_token(const epk_dispatch_t &a, int t, int g, unsigned mask, uint8_t **dst,
                           int64_t *jw, uint8_t **dx, bool pull, uint8_t *stage) {
  __shared__ token_meta s_meta;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool hs = EPK_DMETA && a.num_scales <= 64, hk = EPK_DMETA && !a.cached && a.topk <= 32;
  meta_fetch(a, t, hs, hk, s_meta);
  const uint8_t *src = static_cast<const uint8_t *>(a.x) + (uint64_t)t * a.row;
  const int nv = (int)(a.row / 16);
  /* Pulled: the row goes once to this rank's own stage row (NULL: staged already) instead. */
  const unsigned xmask = pull ? (stage ? 1u : 0u) : mask;
  /* The token's row is read once; a destination's copy is written once, but a staged row is
   * read by every destination that pulls it: normal priority there. */
  const uint64_t lpol = epk_l2_policy(a.stream), pol = epk_l2_policy(a.stream && !pull);
  for (int i0 = 0; xmask && i0 < nv; i0 += 32 * UNR) {
    int4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; u++) {
      int i = i0 + 32 * u + lane;
      if (i < nv) v[u] = epk_ld_once(reinterpret_cast<const int4 *>(src) + i, lpol);
    }
    for (unsigned m = xmask; m; m &= m - 1) {
      int l = __ffs(m) - 1;
      int4 *out = reinterpret_cast<int4 *>(pull ? stage : dx[l]);
#pragma unroll
      for (int u = 0; u < UNR; u++) {
        int i = i0 + 32 * u + lane;
        if (i < nv) epk_st_hint(out + i, v[u], pol);
      }
    }
  }
  /* The token's scales, ids and weights, fetched once (meta_fetch, above) for all of its
   * destinations; loading them per destination cost one (ids) or two (fp8: scales too) load
   * latencies per destination. More than 64 scales or 32 slots: loaded per destination. */
  cp_async_wait();
  float s0 = 0.0f, s1 = 0.0f, wk = 0.0f;
  int64_t ek = -1;
  if (hs && lane < a.num_scales) s0 = s_meta.sc[warp][lane];
  if (hs && lane + 32 < a.num_scales) s1 = s_meta.sc[warp][lane + 32];
  if (hk && lane < a.topk) {
    ek = s_meta.id[warp][lane];
    if (a.has_w) wk = s_meta.w[warp][lane];
  }
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __ffs(m) - 1;
    uint8_t *ad = dst[l];
    int64_t r = jw[l];
    if (lane == 0) reinterpret_cast<int32_t *>(ad + a.lay.off_src)[r] = t;
    float *sc = reinterpret_cast<float *>(ad + a.lay.off_s) + r * a.num_scales;
    if (hs) {
      if (lane < a.num_scales) sc[lane] = s0;
      if (lane + 32 < a.num_scales) sc[lane + 32] = s1;
    }
    for (int i = lane; !hs && i < a.num_scales; i += 32)
      sc[i] = a.x_scales[t * a.scale_tok + i * a.scale_hid];
    if (a.cached) continue;
    /* The ids and weights at the token loads' priority (evict-first when the call streams,
     * pulled too: each is read once, not staged): held at normal priority, their ~96 bytes a
     * row (16.6 MB a call over 8 ranks at 4096 tokens, bf16) made the full dispatch ~5% slower
     * and the call after it ~4% (an H100 under MPS, docs/PERFORMANCE.md). */
    const int64_t lo = (int64_t)(g + l) * a.local_experts;
    int64_t *ids = reinterpret_cast<int64_t *>(ad + a.lay.off_i) + r * a.topk;
    float *ws = reinterpret_cast<float *>(ad + a.lay.off_w) + r * a.topk;
    if (hk && lane < a.topk) {
      const int64_t le = ek >= lo && ek < lo + a.local_experts ? ek - lo : -1;
      epk_st_hint_b64(ids + lane, le, lpol);
      if (a.has_w) epk_st_hint_f32(ws + lane, le >= 0 ? wk : 0.0f, lpol);
    }
    for (int k = lane; !hk && k < a.topk; k += 32) {
      int64_t e = a.topk_idx[(int64_t)t * a.topk + k];
      int64_t le = e >= lo && e < lo + a.local_experts ? e - lo : -1;
      epk_st_hint_b64(ids + k, le, lpol);
      if (a.has_w)
        epk_st_hint_f32(ws + k, le >= 0 ? a.topk_weights[(int64_t)t * a.topk + k] : 0.0f, lpol);
    }
  }
}

/* One pass over this block's tokens: every (token, destination) whose row falls in the
 * destination's open window. */
__device__ void send_pass(const epk_buf_t &b, const epk_dispatch_t &a, const dstate &st, int t0,
                          int t1) {
  __shared__ uint8_t *s_dst[DWARPS][32];
  __shared__ int64_t s_jw[DWARPS][32];
  __shared__ uint8_t *s_dx[DWARPS][32];
  const int R = b.nranks, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t *pos = epk_plan_pos(const_cast<int32_t *>(a.plan), R);
  const int64_t W = a.lay.rows;
  /* Pulled: token t's row goes once to row t of this rank's own area D (the first group of
   * destinations that takes it stages it). No reader of the previous call is still at it: this
   * kernel starts after this call's notify saw every peer's hello, which each peer posts from a
   * plain launch, after its previous call's kernels ended (the same order keeps pushing
   * senders out of a receiver's area D). */
  uint8_t *const own = b.peers[b.rank] + b.off_area_d + a.lay.off_x;
  for (int t = t0 + warp; t < t1; t += DWARPS) {
    bool staged = !st.pull;
    for (int g = 0; g < R; g += 32) {
      int d = g + lane;
      bool ok = false;
      if (d < R && st.open[d]) {
        int p = pos[(int64_t)t * R + d];
        int64_t j = st.base[d] + p, w = st.rounds[d] == 1 ? 0 : j / W; /* no division if one */
        if (p >= 0 && w == st.wcur[d]) {
          ok = true;
          uint8_t *ad = b.peers[d] + b.off_area_d, *xd = st.xdst[d];
          s_jw[warp][lane] = j - w * W;
          s_dst[warp][lane] = ad;
          s_dx[warp][lane] = xd ? xd + (uint64_t)j * a.row : ad + a.lay.off_x + (j - w * W) * a.row;
        }
      }
      unsigned mask = __ballot_sync(EPK_FULL, ok);
      __syncwarp();
      if (mask)
        send_token(a, t, g, mask, s_dst[warp], s_jw[warp], s_dx[warp], st.pull,
                   staged ? nullptr : own + (uint64_t)t * a.row);
      staged |= mask != 0;
      __syncwarp();
    }
  }
}

/* Row r of area D's metadata (and its x row from src, unless xdirect) to output row gi. */
__device__ __forceinline__ void copy_row(const epk_dispatch_t &a, const uint8_t *ad, bool xdirect,
                                         int64_t gi, int64_t r, const int4 *src) {
  const int lane = threadIdx.x & 31;
  const int32_t *rsrc = reinterpret_cast<const int32_t *>(ad + a.lay.off_src);
  if (!xdirect)
    epk_warp_copy<true>(reinterpret_cast<int4 *>(static_cast<uint8_t *>(a.recv_x) + gi * a.row),
                        src, (int)(a.row / 16));
  const float *sc = reinterpret_cast<const float *>(ad + a.lay.off_s) + r * a.num_scales;
  for (int i = lane; a.recv_scales && i < a.num_scales; i += 32)
    a.recv_scales[gi * a.num_scales + i] = __ldcg(sc + i);
  const long long *ids = reinterpret_cast<const long long *>(ad + a.lay.off_i) + r * a.topk;
  const float *ws = reinterpret_cast<const float *>(ad + a.lay.off_w) + r * a.topk;
  for (int k = lane; !a.cached && k < a.topk; k += 32) {
    if (a.recv_idx) a.recv_idx[gi * a.topk + k] = __ldcg(ids + k);
    if (a.recv_w && a.has_w) a.recv_w[gi * a.topk + k] = __ldcg(ws + k);
  }
  if (lane == 0 && a.recv_src) a.recv_src[gi] = __ldcg(rsrc + r);
  if (lane == 0 && a.hsrc && gi < a.hsrc_cap) a.hsrc[gi] = __ldcg(rsrc + r);
}

/* Receiver: rows [lo, hi) of window rw, from area D (or, pulled, from source `from`'s stage:
 * every row of the range is that source's) to the caller's outputs (COPY), and the source index
 * of every row into the handle (combine rounds search it). With views only the latter, one row
 * per thread (a row per warp left this a chain of dependent loads). xdirect: the x rows are in
 * recv_x already (registered output), only the rest is copied; when that is just source
 * indices, one row per thread too. */
__device__ void copy_rows(const epk_buf_t &b, const epk_dispatch_t &a, int mode, bool xdirect,
                          int64_t first, int64_t lo, int64_t hi, int from) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint8_t *ad = b.peers[b.rank] + b.off_area_d;
  const int32_t *rsrc = reinterpret_cast<const int32_t *>(ad + a.lay.off_src);
  if (mode != EPK_MODE_COPY) { /* views: only the handle's source index, a row per thread */
    for (int64_t r = lo + threadIdx.x; a.hsrc && r < hi && first + r < a.hsrc_cap; r += DT)
      a.hsrc[first + r] = __ldcg(rsrc + r);
    return;
  }
  const bool meta =
      (a.recv_scales && a.num_scales > 0) || (!a.cached && (a.recv_idx || (a.recv_w && a.has_w)));
  if (xdirect && !meta) { /* only source indices: a row per thread */
    for (int64_t r = lo + threadIdx.x; r < hi; r += DT) {
      const int64_t gi = first + r;
      const int32_t v = __ldcg(rsrc + r);
      if (a.recv_src) a.recv_src[gi] = v;
      if (a.hsrc && gi < a.hsrc_cap) a.hsrc[gi] = v;
    }
    return;
  }
  /* Pulled: the row of token tok in the source's stage, the tokens of the warp's next 32 rows
   * loaded at once (lane k: the k-th), so that a row's loads do not wait for its own index. */
  const uint8_t *stage = from >= 0 ? b.peers[from] + b.off_area_d + a.lay.off_x : nullptr;
  int k = 0;
  int32_t tok = 0;
  for (int64_t r = lo + warp; r < hi; r += DWARPS, k = (k + 1) & 31) {
    const int4 *src = reinterpret_cast<const int4 *>(ad + a.lay.off_x + (uint64_t)r * a.row);
    if (stage) {
      const int64_t rk = r + (int64_t)lane * DWARPS;
      if (k == 0) tok = rk < hi ? __ldcg(rsrc + rk) : 0;
      src = reinterpret_cast<const int4 *>(stage + (uint64_t)__shfl_sync(EPK_FULL, tok, k) * a.row);
    }
    copy_row(a, ad, xdirect, first + r, r, src);
  }
}

#if EPK_PULL_CLAIM
/* Pulled, wherever blocks would take a share of every source (by default from EPK_PULL_SHARE_R
 * ranks up): source s's rows (copied out, not xdirect) taken by this rank's warps in runs of
 * EPK_PULL_RUN rows from a counter, whichever warp comes next (a block on an SM that moves less
 * takes fewer, where a fixed share made its rank wait for it). The counter is this rank's
 * consumed[s]: a pulled call has a single window (every destination's rows fit), so send_step
 * never reads it and no receiver frees a window there; finish() clears it with the rest. A
 * pulled call with several windows would need a counter of its own. */
__device__ void claim_rows(const epk_buf_t &b, const epk_dispatch_t &a, const dstate &st, int s) {
  const int lane = threadIdx.x & 31;
  const uint8_t *ad = b.peers[b.rank] + b.off_area_d;
  const int32_t *rsrc = reinterpret_cast<const int32_t *>(ad + a.lay.off_src);
  const uint8_t *stage = b.peers[s] + b.off_area_d + a.lay.off_x;
  uint32_t *cnt = epk_u32(b.peers[b.rank], b.off_consumed, s);
  const int64_t base = st.rbase[s], n = st.rbase[s + 1] - base;
  for (;;) {
    uint32_t c = 0;
    if (lane == 0) c = atomicAdd(cnt, (uint32_t)EPK_PULL_RUN);
    c = __shfl_sync(EPK_FULL, c, 0);
    if ((int64_t)c >= n) return;
    const int64_t lo = base + c, hi = base + min(n, (int64_t)c + EPK_PULL_RUN);
    const int32_t tok = lo + lane < hi ? __ldcg(rsrc + lo + lane) : 0; /* the run's tokens */
    for (int64_t r = lo; r < hi; r++) {
      const int32_t t = __shfl_sync(EPK_FULL, tok, (int)(r - lo));
      copy_row(a, ad, false, r, r, reinterpret_cast<const int4 *>(stage + (uint64_t)t * a.row));
    }
  }
}
#endif

/* This block's share of window rw (pushed rows: all in area D). */
__device__ void copy_window(const epk_buf_t &b, const epk_dispatch_t &a, int mode, bool xdirect,
                            int rw, int64_t nr) {
  const int64_t W = a.lay.rows, first = (int64_t)rw * W, n = min(W, nr - first);
  if (n <= 0 || mode == EPK_MODE_DRAIN) return;
  copy_rows(b, a, mode, xdirect, first, n * blockIdx.x / gridDim.x,
            n * (blockIdx.x + 1) / gridDim.x, -1);
}

/* Worst-case path: rows past the receive count carry ids -1, weights 0, source -1. */
__device__ void fill_tail(const epk_dispatch_t &a, int64_t nr) {
  const int64_t rows = a.tail ? a.cap - nr : 0;
  if (rows <= 0) return;
  const int64_t step = (int64_t)gridDim.x * DT, me = (int64_t)blockIdx.x * DT + threadIdx.x;
  for (int64_t i = me; !a.cached && i < rows * a.topk; i += step) {
    if (a.recv_idx) a.recv_idx[nr * a.topk + i] = -1;
    if (a.recv_w) a.recv_w[nr * a.topk + i] = 0.0f;
  }
  for (int64_t i = me; a.recv_src && i < rows; i += step) a.recv_src[nr + i] = -1;
}

/* Every block of source s has delivered window rw here. */
__device__ __forceinline__ bool arrived(const epk_buf_t &b, int s, int rw) {
  return epk_ld_peer(b, epk_u32(b.peers[b.rank], b.off_arrive, s)) >=
         (uint32_t)(rw + 1) * (uint32_t)b.peer_blocks[s];
}

/* Who we wait for, for a timeout message: a window not freed, else rows not arrived. */
__device__ int laggard(const epk_buf_t &b, const dstate &st, int rw, uint32_t *phase) {
  for (int d = 0; d < b.nranks; d++)
    if (st.wcur[d] < st.rounds[d] && !st.open[d]) {
      *phase = EPK_PH_WINDOW;
      return d;
    }
  *phase = EPK_PH_ARRIVE;
  for (int s = 0; s < b.nranks; s++)
    if (!arrived(b, s, rw)) return s;
  return -1;
}

/* Last block out puts this call's counters back to zero (every peer is done writing them). */
__device__ void finish(const epk_buf_t &b) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&b.priv->finished, 1u) != gridDim.x - 1) return;
  for (int s = 0; s < b.nranks; s++) {
    *epk_u32(b.peers[b.rank], b.off_arrive, s) = 0;
    *epk_u32(b.peers[b.rank], b.off_consumed, s) = 0;
  }
  b.priv->wdone = 0;
  b.priv->finished = 0;
  epk_fence_peers(b);
}

/* The late hello (allocator path): where this rank's outputs are, now that they exist, into this
 * call's hello slot of every rank, then the flag. Block 0, before anything waits for it. */
__device__ void post_late(const epk_buf_t &b, const epk_dispatch_t &a) {
  const int R = b.nranks, par = (int)(b.priv->seq & 1);
  for (int d = threadIdx.x; d < R; d += DT) {
    epk_hello_t *h = epk_hello(b, d, par, b.rank);
    h->xreg1 = a.lreg1;
    h->xcap = a.lcap;
    h->xoff = a.loff;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    epk_fence_peers(b);
    for (int d = 0; d < R; d++)
      epk_st_peer(b, &epk_hello(b, d, par, b.rank)->late, EPK_LATE_POSTED);
  }
  __syncthreads(); /* the block goes on together (its stop check below) */
}

/* d's hello promised a late one: wait for it (bounded like every wait); false: give up. Only
 * for this rank and the destinations it sends rows to (xd of the others is never used); every
 * sender waits for all of them before it sends anything, so the slowest sets the start (to be
 * measured). */
__device__ bool await_late(const epk_buf_t &b, const epk_hello_t *h, int d) {
  uint32_t v = epk_ld_peer(b, &h->late); /* acquire: the fields after it are read next */
  epk_waiter w;
  w.reset();
  while (v == EPK_LATE_PROMISED) {
    if (w.tick(b, d, EPK_PH_LATE)) return false;
    v = epk_ld_peer(b, &h->late);
  }
  return true;
}

/* false: a late hello did not come (failure recorded; the caller stops). */
__device__ bool setup(const epk_buf_t &b, const epk_dispatch_t &a, dstate &st, int64_t *nr) {
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(const_cast<int32_t *>(a.plan));
  const int par = (int)(b.priv->seq & 1); /* this call's hellos (notify has gathered them) */
  bool ok = true;
  int pull = 1;
  for (int d = threadIdx.x; d < R; d += DT) {
    int64_t n = 0, base = 0;
    for (int s = 0; s < R; s++) {
      n += cnt[s * R + d];
      if (s < b.rank) base += cnt[s * R + d];
    }
    /* d's registered recv_x: every rank decides alike from d's hello and the counts (rows
     * beyond its capacity: d drains, so they go to area D as without a registration). */
    const epk_hello_t *h = epk_hello(b, b.rank, par, d);
    /* Its own always: every block must agree on xdirect (whether x rows came in place). */
    const bool needed = d == b.rank || cnt[b.rank * R + d] > 0;
    if (needed && !await_late(b, h, d)) {
      ok = false;
      continue;
    }
    const int reg1 = needed ? __ldcg(&h->xreg1) : 0; /* else maybe still being written */
    uint8_t *xd = nullptr;
    if (reg1 > 0 && n <= (int64_t)__ldcg(&h->xcap)) {
      uint8_t *rb = b.regs[(int64_t)(reg1 - 1) * R + d];
      if (rb) xd = rb + __ldcg(reinterpret_cast<const long long *>(&h->xoff));
    }
    st.xdst[d] = xd;
    st.base[d] = base;
    st.rounds[d] = (int)max((int64_t)1, (n + a.lay.rows - 1) / a.lay.rows);
    st.wcur[d] = 0;
    if (d == b.rank) *nr = n;
    /* Written in d's hello before its release (never rewritten by a late one): every rank
     * reads the same R flags and counts, so all choose alike. */
    pull &= __ldcg(&h->pull) != 0 && n <= a.lay.rows;
    int64_t rb = 0; /* where source d's rows start here */
    for (int s = 0; s < d; s++) rb += cnt[s * R + b.rank];
    st.rbase[d] = rb;
    st.got[d] = 0;
    if (d == R - 1) st.rbase[R] = rb + cnt[d * R + b.rank];
  }
  st.pull = __syncthreads_and(pull);
  return !__syncthreads_or(!ok);
}

/* The allocator path in two kernels (EPK_EARLY_*): true when this kernel's part of the call
 * ends here. Whether every destination's rows fit its area D at once comes from the plan, which
 * every rank holds whole, so all ranks choose alike, and before setup (whose late-hello waits a
 * SEND that moves nothing must not make): SEND moves the rows only then (as views: nothing is
 * copied out before the outputs exist), and COPY then only copies this rank's rows out of area
 * D, where SEND left them (this grid starts after SEND's has ended). */
__device__ bool early_done(const epk_buf_t &b, const epk_dispatch_t &a) {
  __shared__ int64_t s_mine;
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(const_cast<int32_t *>(a.plan));
  int fits = 1;
  for (int d = threadIdx.x; d < R; d += DT) {
    int64_t n = 0;
    for (int s = 0; s < R; s++) n += cnt[s * R + d];
    fits &= n <= a.lay.rows;
    if (d == b.rank) s_mine = n;
  }
  fits = __syncthreads_and(fits);
  if (a.early == EPK_EARLY_SEND) return !fits; /* not all at once: COPY exchanges everything */
  if (!fits) return false;
  /* x too: an allocator's recv_x is never named in this rank's hello (no late hello on this
   * path), so no sender wrote it in place. cap is the count the host allocated for (or the mode
   * is DRAIN: the host reports why). */
  if (a.mode == EPK_MODE_COPY && s_mine <= a.cap)
    copy_window(b, a, EPK_MODE_COPY, false, 0, s_mine);
  epk_tr_max(b, EPK_TR_D_END);
  return true;
}

/* Sends whatever windows are open; true if anything was sent. */
__device__ bool send_step(const epk_buf_t &b, const epk_dispatch_t &a, const dstate &st, int t0,
                          int t1) {
  int any = 0;
  for (int d = threadIdx.x; d < b.nranks; d += DT) {
    int w = st.wcur[d];
    int o = w < st.rounds[d] &&
            (w == 0 || epk_ld_peer(b, epk_u32(b.peers[b.rank], b.off_consumed, d)) >= (uint32_t)w);
    st.open[d] = o;
    any |= o;
  }
  if (!__syncthreads_or(any)) return false;
  send_pass(b, a, st, t0, t1);
  __syncthreads();
  epk_tr_min(b, EPK_TR_D_OWN_FIRST);
  epk_tr_max(b, EPK_TR_D_OWN);
  if (threadIdx.x == 0) {
    epk_fence_peers(b);
    for (int d = 0; d < b.nranks; d++)
      if (st.open[d]) {
        epk_add_peer(b, epk_u32(b.peers[d], b.off_arrive, b.rank), 1);
        st.wcur[d]++;
      }
  }
  return true;
}

/* Window rw copied out by this block: the last block frees it for the senders (when another
 * follows), and the block goes on to the next. */
__device__ void window_done(const epk_buf_t &b, int rw, int my_rounds, int *s_rw) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  unsigned old = atomicAdd(&b.priv->wdone, 1u);
  if (old == (unsigned)(rw + 1) * gridDim.x - 1 && rw + 1 < my_rounds) {
    epk_fence_peers(b);
    for (int s = 0; s < b.nranks; s++)
      epk_st_peer(b, epk_u32(b.peers[s], b.off_consumed, b.rank), (uint32_t)(rw + 1));
  }
  *s_rw = rw + 1;
}

/* Copies out window *rw once every source's blocks have delivered it; true if it did. */
__device__ bool recv_step(const epk_buf_t &b, const epk_dispatch_t &a, int mode, bool xdirect,
                          int *s_rw, int my_rounds, int64_t nr) {
  const int rw = *s_rw;
  if (rw >= my_rounds) return false;
  int ok = 1;
  for (int s = threadIdx.x; s < b.nranks; s += DT) ok &= arrived(b, s, rw);
  if (!__syncthreads_and(ok)) return false;
  epk_tr_max(b, EPK_TR_D_PEERS);
  copy_window(b, a, mode, xdirect, rw, nr);
  window_done(b, rw, my_rounds, s_rw);
  return true;
}

/* Pulled (one window): this block's share of each source's rows, copied as soon as that
 * source's blocks have all staged theirs, sources in the order they arrive (got[s]: 0 not yet,
 * 2 arrived since the last step, 1 copied), starting after this rank so that the receivers do
 * not all read one source at first. With EPK_PULL_EACH 0, only once every source arrived (all
 * rows in one pass, as a pushed window). True if it copied anything. */
__device__ bool pull_step(const epk_buf_t &b, const epk_dispatch_t &a, const dstate &st, int mode,
                          bool xdirect, int *s_rw) {
  if (*s_rw >= 1) return false;
  const int R = b.nranks;
  int fresh = 0, left = 0;
  for (int s = threadIdx.x; s < R; s += DT) {
    if (st.got[s]) continue;
    if (arrived(b, s, 0)) {
      st.got[s] = 2;
      fresh = 1;
    } else {
      left = 1;
    }
  }
  fresh = __syncthreads_or(fresh);
  left = __syncthreads_or(left);
  if (!fresh || (!EPK_PULL_EACH && left)) return false;
  if (!left) epk_tr_max(b, EPK_TR_D_PEERS);
  const bool share = EPK_PULL_SPLIT == 1 || (EPK_PULL_SPLIT == 2 && R >= EPK_PULL_SHARE_R);
  for (int i = 1; i <= R && mode != EPK_MODE_DRAIN; i++) {
    const int s = (b.rank + i) % R;
    if (st.got[s] != 2) continue;
    int64_t lo, hi;
#if EPK_PULL_CLAIM
    if (share && mode == EPK_MODE_COPY && !xdirect) { /* always so when pulled (the hellos) */
      claim_rows(b, a, st, s);
      continue;
    }
#endif
    if (share) { /* a share of every source's rows */
      const int64_t n = st.rbase[s + 1] - st.rbase[s];
      lo = st.rbase[s] + n * blockIdx.x / gridDim.x;
      hi = st.rbase[s] + n * (blockIdx.x + 1) / gridDim.x;
    } else { /* the part from s of this block's slice of all rows */
      const int64_t n = st.rbase[R];
      lo = max(st.rbase[s], n * blockIdx.x / gridDim.x);
      hi = min(st.rbase[s + 1], n * (blockIdx.x + 1) / gridDim.x);
    }
    if (lo < hi) copy_rows(b, a, mode, xdirect, 0, lo, hi, s);
  }
  __syncthreads(); /* every thread has read got[] */
  for (int s = threadIdx.x; s < R; s += DT)
    if (st.got[s] == 2) st.got[s] = 1;
  if (!left) window_done(b, 0, 1, s_rw);
  return true;
}

/* The count for a host that waits (synchronous call): the notify's outcome is complete here,
 * failures included (their error word went out with a system fence). So are notify's writes
 * of recv_tokens_per_expert, which may be page-locked host memory the host reads once it sees
 * the ticket: that grid has completed (griddepcontrol.wait), its stores to host memory were
 * issued before it did, and the GPU's posted writes to host memory reach it in order; the fence
 * below keeps the ticket after them from this thread's side. */
__device__ void publish_count(const epk_buf_t &b, const epk_dispatch_t &a) {
  /* -1: this call's count exchange failed (notify, which cleared call_status at its start, is
   * over), and call_err says why (the host preset 0): the host then reports that failure as this
   * call's, whatever earlier call's the error word holds. */
  const bool stopped = epk_stopped(b);
  *reinterpret_cast<volatile int32_t *>(&b.host->nr) = stopped ? -1 : a.plan[EPK_PLAN_NR];
  if (stopped) {
    __threadfence(); /* call_err was set before call_status (epk_fail) */
    epk_call_err_post(b);
  }
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t *>(&b.host->ticket) = a.ticket;
}

}  // namespace

/* The kernel's name: ep_kernels.h says why. */
namespace epcomm::normal {
__global__ void __launch_bounds__(DT, 1) dispatch(EPK_BUF_ARG b, epk_dispatch_t a) {
  extern __shared__ int64_t dsm[];
  __shared__ int64_t s_nr;
  __shared__ int s_rw, s_flag;
  const int R = b.nranks;
  epk_grid_wait(); /* for the notify kernel before it (epk_launch_dependent) */
  if (a.ticket && blockIdx.x == 0 && threadIdx.x == 0) publish_count(b, a);
  /* Promised in this call's hello: posted even when the call stopped, so no peer waits for it
   * (a host whose count wait failed never launches this kernel: its peers then time out in the
   * late-hello phase, naming it). */
  if (a.late && blockIdx.x == 0) post_late(b, a);
  if (epk_stopped(b)) return; /* the count exchange failed: nothing moves */
  epk_tr_min(b, EPK_TR_D_START);
  epk_tr_max(b, EPK_TR_D_START_LAST);
  int *ints = reinterpret_cast<int *>(dsm + 3 * R + 1);
  dstate st = {dsm,
               ints,
               ints + R,
               ints + 2 * R,
               reinterpret_cast<uint8_t **>(dsm + R),
               dsm + 2 * R,
               reinterpret_cast<uint8_t *>(ints + 3 * R),
               false};
  if (threadIdx.x == 0) s_rw = 0;
  if (a.early && early_done(b, a)) return;
  if (!setup(b, a, st, &s_nr)) return;
  if (st.pull && blockIdx.x == 0 && threadIdx.x == 0)
    *reinterpret_cast<volatile unsigned long long *>(&b.host->pulled) = ++b.priv->pulled;
  const int64_t nr = s_nr;
  const int my_rounds = st.rounds[b.rank];
  const bool xdirect = st.xdst[b.rank] != nullptr;
  int mode = a.mode;
  if (nr > a.cap || (mode == EPK_MODE_VIEW && nr > a.lay.rows)) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !a.quiet)
      epk_fail(b, EP_ERR_TOO_LARGE, EPK_PH_CHECK, -1, (uint32_t)nr, false);
    mode = EPK_MODE_DRAIN; /* still take part, so that peers complete */
  }
  const int chunk = (a.num_tokens + gridDim.x - 1) / gridDim.x;
  const int t0 = min(a.num_tokens, (int)blockIdx.x * chunk), t1 = min(a.num_tokens, t0 + chunk);
  epk_waiter w;
  w.reset();
  for (;;) {
    bool moved = send_step(b, a, st, t0, t1);
    moved |= st.pull ? pull_step(b, a, st, mode, xdirect, &s_rw)
                     : recv_step(b, a, mode, xdirect, &s_rw, my_rounds, nr);
    __syncthreads();
    if (threadIdx.x == 0) {
      bool done = s_rw == my_rounds;
      for (int d = 0; d < R && done; d++) done = st.wcur[d] == st.rounds[d];
      s_flag = done;
      if (!done && moved) w.reset();
      if (!done && !moved) {
        uint32_t phase = 0;
        int who = laggard(b, st, s_rw, &phase);
        if (w.tick(b, who, phase)) s_flag = 2;
      }
    }
    __syncthreads();
    if (s_flag == 1) break;
    if (s_flag == 2) return;
  }
  if (mode != EPK_MODE_DRAIN) fill_tail(a, nr);
  finish(b);
  epk_tr_max(b, EPK_TR_D_END);
}

}  // namespace epcomm::normal

extern "C" cudaError_t epk_launch_dispatch(const epk_buf_t *b, const epk_dispatch_t *a,
                                           cudaStream_t s) {
  size_t smem = (size_t)b->nranks * (3 * sizeof(int64_t) + 3 * sizeof(int) + sizeof(uint8_t)) +
                sizeof(int64_t);
  return epk_launch_dependent(epcomm::normal::dispatch, b->blocks, DT, smem, s, *b, *a);
}
