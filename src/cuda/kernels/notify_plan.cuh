/* The full dispatch's plan, the first step of its notify launch: for each of this rank's tokens
 * its row among the rows it sends to each destination (token order), the rows to each
 * destination, and the selections per expert. Included by notify.cu only.
 *
 * R <= 32: spread over the launch's blocks in token tiles (ep_kernels.h, epk_plan_scr_t). A block
 * takes tiles from a counter; per tile it reads every token's ids once (checking them, counting
 * experts) into a mask of destinations, publishes the tile's rows per destination, adds up the
 * published counts of the tiles before it, and only then writes the tile's positions. One block
 * did all of this alone before, pass after pass: 24.7 us at R = 4 and 41.6 us at R = 8 for 4096
 * tokens (EP_CUDA_TRACE, H200), the largest part of what a full dispatch costs over a cached one.
 * The launch has a block more than tiles: the block that finds no tile left waits for every
 * tile's counts and posts the hello while the others write their positions, instead of the
 * last block to finish posting it after every position is written.
 * R > 32: one block, one destination at a time (plan_rows). */
#pragma once

#define NT EPK_NOTIFY_NT
#define NW (NT / 32)
static_assert(NW <= 32, "one warp scans the per-warp counts");
static_assert(NT > 32, "plan_done_poster runs in a warp other than the one waiting for hellos");

namespace {

#define SMEM_EXPERTS 4096
__shared__ int32_t s_ecount[SMEM_EXPERTS]; /* a block's selections per expert, when E fits */

/* Counts of one block go to b.pec at its end (one atomic per expert it saw, not per selection). */
__device__ void ecount_begin(const epk_notify_t &a) {
  for (int e = threadIdx.x; a.num_experts <= SMEM_EXPERTS && e < a.num_experts; e += NT)
    s_ecount[e] = 0;
  __syncthreads();
}
__device__ void ecount_flush(const epk_buf_t &b, const epk_notify_t &a) {
  __syncthreads();
  for (int e = threadIdx.x; a.num_experts <= SMEM_EXPERTS && e < a.num_experts; e += NT)
    if (s_ecount[e]) atomicAdd(&b.pec[e], s_ecount[e]);
}
__device__ __forceinline__ void ecount_add(const epk_buf_t &b, const epk_notify_t &a, int64_t e) {
  atomicAdd(a.num_experts <= SMEM_EXPERTS ? &s_ecount[e] : &b.pec[e], 1);
}

/* R > 32, one block: pos[t][d] = 1 if token t goes to d, then its row among the rows to d, or -1.
 * The ids were checked before (epk_first_bad). */
__device__ void plan_rows(const epk_buf_t &b, const epk_notify_t &a, int32_t *cnt_me) {
  const int R = b.nranks, n = a.num_tokens, topk = a.topk, L = a.num_experts / R;
  int32_t *pos = epk_plan_pos(a.plan, R);
  ecount_begin(a);
  for (int t = threadIdx.x; t < n; t += NT) {
    int32_t *row = pos + (size_t)t * R;
    for (int d = 0; d < R; d++) row[d] = 0;
    for (int k = 0; k < topk; k++) {
      int64_t e = a.topk_idx[(size_t)t * topk + k];
      if (e < 0) continue;
      row[e / L] = 1;
      ecount_add(b, a, e);
    }
  }
  __syncthreads();
  const int chunk = (n + NT - 1) / NT;
  const int t0 = min(n, (int)threadIdx.x * chunk), t1 = min(n, t0 + chunk);
  for (int d = 0; d < R; d++) {
    int c = 0, total;
    for (int t = t0; t < t1; t++) c += pos[(size_t)t * R + d];
    int run = epk_block_scan<NT>(c, &total);
    for (int t = t0; t < t1; t++) {
      int32_t *p = pos + (size_t)t * R + d;
      *p = *p ? run++ : -1;
    }
    if (threadIdx.x == 0) cnt_me[d] = total;
  }
  ecount_flush(b, a);
}

/* Token t's destinations as a mask (R <= 32); with `count`, also checks its ids (the first bad
 * slot, encoded ~0 - slot, goes to pscr->bad by atomicMax) and counts its experts. */
__device__ uint32_t token_mask(const epk_buf_t &b, const epk_notify_t &a, int t, bool count) {
  const int topk = a.topk, E = a.num_experts, L = E / b.nranks;
  const int64_t *ids = a.topk_idx + (int64_t)t * topk;
  uint32_t mask = 0;
  for (int k0 = 0; k0 < topk; k0 += 8) {
    int64_t e[8];
#pragma unroll
    for (int u = 0; u < 8; u++) e[u] = k0 + u < topk ? __ldg(ids + k0 + u) : -1;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      if (e[u] < -1 || e[u] >= E) {
        if (count)
          atomicMax(&b.pscr->bad, ~0ull - (unsigned long long)((int64_t)t * topk + k0 + u));
      } else if (e[u] >= 0) {
        mask |= 1u << (int)(e[u] / L);
        if (count) ecount_add(b, a, e[u]);
      }
    }
  }
  return mask;
}

__shared__ int32_t s_cnt[32];      /* [d]: rows of the current tile to d */
__shared__ int32_t s_base[32];     /* [d]: rows to d before the current pass */
__shared__ int32_t s_pbase[32];    /* [d]: s_base at the start of the current pass */
__shared__ int32_t s_wcnt[NW][33]; /* [warp][d]: rows of the warp's tokens to d, then its first */
/* R <= STAGE_R: a pass's positions gathered here (relative to s_pbase, -1: not sent) and written
 * out in token-major order by consecutive threads, instead of each thread writing its token's R
 * words R x 4 bytes apart from its neighbour's (one partial sector per word). */
#define STAGE_R 8
__shared__ int16_t s_stage[NT * STAGE_R];

/* Positions of the pass of NT tokens at t0 (this thread's token: `mask`), after s_base. */
__device__ void write_pass(const epk_notify_t &a, int R, int t0, int t1, uint32_t mask) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = t0 + (int)threadIdx.x;
  int32_t *pos = epk_plan_pos(a.plan, R);
  for (int d = 0; d < R; d++) {
    unsigned m = __ballot_sync(EPK_FULL, (mask >> d) & 1u);
    if (lane == 0) s_wcnt[warp][d] = __popc(m);
  }
  __syncthreads();
  /* warp w scans destinations w, w + NW, ...: exclusive scan of the per-warp counts, plus base */
  for (int d = warp; d < R; d += NW) {
    const int v = lane < NW ? s_wcnt[lane][d] : 0;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(EPK_FULL, x, o);
      if (lane >= o) x += y;
    }
    const int base = s_base[d];
    __syncwarp();
    if (lane < NW) s_wcnt[lane][d] = base + x - v;
    if (lane == 31) s_base[d] = base + x, s_pbase[d] = base;
  }
  __syncthreads();
  const bool stage = R <= STAGE_R;
  for (int d = 0; d < R; d++) {
    const bool in = (mask >> d) & 1u;
    unsigned m = __ballot_sync(EPK_FULL, in);
    const int p = in ? s_wcnt[warp][d] + __popc(m & ((1u << lane) - 1u)) : -1;
    if (stage)
      s_stage[threadIdx.x * R + d] = (int16_t)(in ? p - s_pbase[d] : -1);
    else if (t < t1)
      pos[(int64_t)t * R + d] = p;
  }
  if (stage) {
    __syncthreads();
    const int words = min(NT, t1 - t0) * R;
    int32_t *out = pos + (int64_t)t0 * R;
    for (int i = threadIdx.x; i < words; i += NT) {
      const int v = s_stage[i];
      out[i] = v < 0 ? -1 : s_pbase[i % R] + v;
    }
  }
  __syncthreads(); /* s_wcnt, s_stage and s_pbase are rewritten by the next pass */
}

/* s_base[d] = rows to d of the tiles before `tile`. Those tiles were taken before this one by
 * blocks that are running and publish their counts without waiting for anything, so the wait
 * ends (the scan's usual forward-progress argument). It still has the buffer's deadline, for
 * what that argument does not cover (two calls on one buffer at once, against the API's rules,
 * would share this scratch): past it the tile gives up, marks the plan stuck and stops this
 * rank's call (epk_fail), so that nothing moves along positions from a partial base: the block
 * that posts the hello reads the mark (the call is then rejected on every rank) or, when the mark
 * comes after that read, this rank's data kernel stops and its peers time out. */
__device__ void tile_base(const epk_buf_t &b, int tile, uint32_t seq) {
  const int R = b.nranks;
  if (threadIdx.x < R) s_base[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < tile * R; i += NT) {
    const int j = i / R, d = i % R;
    unsigned long long f;
    uint64_t t0 = 0;
    for (unsigned n = 1;; n++) {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];"
                   : "=l"(f)
                   : "l"(&b.pscr->agg[j][d])
                   : "memory");
      if ((uint32_t)(f >> 32) == seq) break;
      if (n & 255u) continue;
      const uint64_t now = epk_now();
      if (!t0) t0 = now;
      /* Once one wait gave up, every other gives up too (a thread waits for several tiles, and
       * the poster for all of them: one deadline each would add up). */
      if (now - t0 > b.timeout_ns || *reinterpret_cast<volatile uint32_t *>(&b.host->abort) ||
          __ldcg(&b.pscr->stuck)) {
        atomicExch(&b.pscr->stuck, 1u);
        __threadfence();
        epk_fail(b, EP_ERR_TIMEOUT, EPK_PH_NOTIFY, -1, 0, true);
        break;
      }
    }
    atomicAdd(&s_base[d], (int32_t)(uint32_t)f); /* given up: stale, the plan is never used */
  }
  __syncthreads();
}

/* A tile's tokens [begin, end), in passes of NT. */
struct tile_span_t {
  int begin, end, passes;
};
__device__ tile_span_t tile_span(const epk_notify_t &a, int tile) {
  const int tt = epk_plan_tile_tokens(a.num_tokens);
  const int begin = tile * tt, end = min(a.num_tokens, begin + tt);
  return {begin, end, (end - begin + NT - 1) / NT};
}

/* A tile's counts: its selections per expert (flushed to b.pec, and its bad slots noted, before
 * its rows per destination are published, so that whoever has seen every tile's rows has every
 * count), its rows per destination (agg, tagged with seq); then the base of the tiles before it.
 * Returns this thread's mask of a one-pass tile. */
__device__ uint32_t tile_count(const epk_buf_t &b, const epk_notify_t &a, int tile, uint32_t seq) {
  const int R = b.nranks, lane = threadIdx.x & 31;
  const tile_span_t sp = tile_span(a, tile);
  if (threadIdx.x < R) s_cnt[threadIdx.x] = 0;
  ecount_begin(a);
  uint32_t keep = 0;
  for (int p = 0; p < sp.passes; p++) {
    const int t = sp.begin + p * NT + (int)threadIdx.x;
    const uint32_t mask = t < sp.end ? token_mask(b, a, t, true) : 0;
    keep = mask;
    for (int d = 0; d < R; d++) {
      unsigned m = __ballot_sync(EPK_FULL, (mask >> d) & 1u);
      if (lane == 0 && m) atomicAdd(&s_cnt[d], __popc(m));
    }
  }
  ecount_flush(b, a);
  __syncthreads();
  if (threadIdx.x < R) { /* after the block's expert counts and bad slots (the barrier above) */
    const unsigned long long v = (unsigned long long)seq << 32 | (uint32_t)s_cnt[threadIdx.x];
    __threadfence();
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(&b.pscr->agg[tile][threadIdx.x]),
                 "l"(v)
                 : "memory");
  }
  tile_base(b, tile, seq);
  return keep;
}

/* A tile's positions, after s_base (tile_count); `keep`: the mask of a one-pass tile. */
__device__ void tile_positions(const epk_buf_t &b, const epk_notify_t &a, int tile, uint32_t keep) {
  const tile_span_t sp = tile_span(a, tile);
  for (int p = 0; p < sp.passes; p++) {
    const int t0 = sp.begin + p * NT, t = t0 + (int)threadIdx.x;
    const uint32_t mask = sp.passes == 1 ? keep : t < sp.end ? token_mask(b, a, t, false) : 0;
    write_pass(a, b.nranks, t0, sp.end, mask);
  }
}

/* The last block done with the plan's scratch resets it for the next call. */
__device__ void plan_reset(const epk_buf_t &b) {
  __threadfence(); /* after every block's last use of the scratch (their `done` came after) */
  b.pscr->next_tile = 0, b.pscr->done = 0, b.pscr->bad = 0, b.pscr->stuck = 0;
}

/* A block that took tiles is done with the scratch. */
__device__ void plan_done(const epk_buf_t &b) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&b.pscr->done, 1u) == gridDim.x - 1) plan_reset(b);
  }
}

/* The poster is done (after its hello is out): one thread of the last warp, which the wait for
 * the peers' hellos leaves idle (R <= 32: warp 0 waits), and no barrier, so that the atomic's
 * round trip overlaps that wait instead of preceding it. No fence before the atomic: the
 * poster's reads of the scratch are complete, their values went into the hello. */
__device__ void plan_done_poster(const epk_buf_t &b) {
  if (threadIdx.x == NT - 1 && atomicAdd(&b.pscr->done, 1u) == gridDim.x - 1) plan_reset(b);
}

/* Every block of the launch takes tiles until none is left. The block that first finds none
 * left (the counter hands out `ntiles` once) writes no positions after that: it waits for every
 * tile's counts and returns true with the totals in cnt_me, the first bad slot in *bad
 * (INT64_MAX: none) and whether a tile gave up in *stuck, to post the hello while the others
 * still write their positions, and then calls plan_done_poster. The others return false, done. */
__device__ bool plan_tiles(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq, int32_t *cnt_me,
                           long long *bad, bool *stuck) {
  __shared__ int s_tile;
  __shared__ bool s_stuck;
  __shared__ unsigned long long s_bad;
  const int R = b.nranks, ntiles = epk_plan_tiles(a.num_tokens);
  bool poster;
  for (;;) {
    if (threadIdx.x == 0) s_tile = (int)atomicAdd(&b.pscr->next_tile, 1u);
    __syncthreads();
    const int tile = s_tile;
    __syncthreads();
    if (tile >= ntiles) {
      poster = tile == ntiles;
      break;
    }
    tile_positions(b, a, tile, tile_count(b, a, tile, seq));
  }
  if (poster) {
    if (threadIdx.x == 0) epk_call_reset(b); /* before `stuck` is read (tile_base) */
    tile_base(b, ntiles, seq);               /* every tile's rows: the totals */
    if (threadIdx.x < R) cnt_me[threadIdx.x] = s_base[threadIdx.x];
    __syncthreads();
    /* One read for the whole block: a tile still waiting may set `stuck` meanwhile, and threads
     * that disagreed would post different hellos and meet different barriers. */
    if (threadIdx.x == 0) {
      __threadfence();
      s_bad = __ldcg(&b.pscr->bad);
      s_stuck = __ldcg(&b.pscr->stuck) != 0;
    }
    __syncthreads();
    *bad = s_bad ? (long long)(~0ull - s_bad) : INT64_MAX;
    *stuck = s_stuck;
  }
  if (!poster) plan_done(b);
  return poster;
}

}  // namespace
