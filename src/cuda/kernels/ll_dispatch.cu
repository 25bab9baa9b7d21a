/* Low-latency dispatch (SEMANTICS.md §6.2-6.4; protocol in ll_kernels.h): one kernel sends,
 * with the count exchange (the gate) in its block 0; a one-block launch of the same kernel
 * (recv_only; or the send's last block, in one phase) receives. Nothing of epcomm stays resident
 * between the two. */
#include "cuda/kernels/ll_common.cuh"

#define DT 512
#define DW (DT / 32)

using namespace epk_ll;

namespace {

/* ------------------------------------------------------------------ the gate (block 0) */

/* First entry of topk_idx (t * topk + k) that is out of range or repeats an expert of its token,
 * or -1. Every thread returns it. */
__device__ long long first_bad(const epk_ll_t &ll, const epk_ll_dispatch_t &a) {
  __shared__ unsigned long long s_bad;
  if (threadIdx.x == 0) s_bad = ~0ull;
  __syncthreads();
  const long long nk = (long long)a.n * a.topk;
  for (long long i = threadIdx.x; i < nk; i += DT) {
    const int64_t e = __ldg(a.topk_idx + i);
    bool bad = e < -1 || e >= ll.lay.E;
    for (long long j = i - i % a.topk; !bad && e >= 0 && j < i; j++)
      bad = __ldg(a.topk_idx + j) == e;
    if (bad) atomicMin(&s_bad, (unsigned long long)i);
  }
  __syncthreads();
  const long long r = s_bad == ~0ull ? -1 : (long long)s_bad;
  __syncthreads();
  return r;
}

/* Row of every (token, k) among this rank's rows for its expert, in token order (a token selects
 * an expert at most once); cnt[e] ends as this rank's selections of e. Warp 0, 32 tokens at a
 * time: each expert's lanes form a mask whose lowest lane adds the chunk to the count. */
__device__ void number_rows(const epk_ll_t &ll, const epk_ll_dispatch_t &a, int32_t *rowpos,
                            int32_t *cnt, uint32_t *mask) {
  for (int e = threadIdx.x; e < ll.lay.E; e += DT) cnt[e] = 0, mask[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    for (int t0 = 0; t0 < a.n; t0 += 32) {
      const int t = t0 + lane;
      const int64_t *ids = a.topk_idx + (int64_t)t * a.topk;
      for (int k = 0; t < a.n && k < a.topk; k++) {
        const int64_t e = __ldg(ids + k);
        if (e >= 0) atomicOr(&mask[e], 1u << lane);
      }
      __syncwarp();
      for (int k = 0; t < a.n && k < a.topk; k++) {
        const int64_t e = __ldg(ids + k);
        if (e >= 0)
          rowpos[(int64_t)t * a.topk + k] = cnt[e] + __popc(mask[e] & ((1u << lane) - 1u));
      }
      __syncwarp();
      /* Only the expert's lowest lane writes. The others may read the mask before or after it
       * is cleared (either way they are not its lowest lane): atomic reads, so that the read and
       * the clear never race (compute-sanitizer racecheck). */
      for (int k = 0; t < a.n && k < a.topk; k++) {
        const int64_t e = __ldg(ids + k);
        const uint32_t m = e >= 0 ? atomicOr(&mask[e], 0u) : 0u;
        if (m && __ffs(m) - 1 == lane) {
          cnt[e] += __popc(m);
          atomicExch(&mask[e], 0u);
        }
      }
      __syncwarp();
    }
  }
  __syncthreads();
}

/* EPK_LL_OPT_GATE: the ids checked and the rows numbered in one pass, a thread per token (chunks
 * of DT tokens): wm[w][e] collects the lanes of warp w whose token selects e, a lane's row among
 * its warp's is the popcount of the lanes below it, then (in place) wm[w][e] becomes the rows of
 * e in the warps before w. rowpos[t][k] ends as the row of (t, k) among this rank's rows for its
 * expert (token order), cnt[e] as this rank's selections of e. Returns the first bad entry of
 * topk_idx (out of range, or an expert repeated within its token) or -1, as first_bad does. */
__device__ long long number_rows_fast(const epk_ll_t &ll, const epk_ll_dispatch_t &a,
                                      int32_t *rowpos, int32_t *cnt, uint32_t *wm) {
  __shared__ unsigned long long s_bad;
  const int E = ll.lay.E, K = a.topk, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (threadIdx.x == 0) s_bad = ~0ull;
  for (int e = threadIdx.x; e < E; e += DT) cnt[e] = 0;
  for (int t0 = 0; t0 < a.n; t0 += DT) {
    const int nt = min(DT, a.n - t0), nw = (nt + 31) / 32;
    for (int i = threadIdx.x; i < nw * E; i += DT) wm[i] = 0;
    __syncthreads();
    const bool mine = (int)threadIdx.x < nt;
    const int64_t t = (int64_t)t0 + threadIdx.x;
    const int64_t *ids = a.topk_idx + t * K;
    for (int k = 0; mine && k < K; k++) {
      const int64_t e = __ldg(ids + k);
      bool bad = e < -1 || e >= E;
      for (int j = 0; !bad && e >= 0 && j < k; j++) bad = __ldg(ids + j) == e;
      if (bad)
        atomicMin(&s_bad, (unsigned long long)(t * K + k));
      else if (e >= 0)
        atomicOr(&wm[w * E + e], 1u << lane);
    }
    __syncwarp(); /* a warp's marks are its own lanes' */
    for (int k = 0; mine && k < K; k++) {
      const int64_t e = __ldg(ids + k);
      if (e >= 0 && e < E) rowpos[t * K + k] = __popc(wm[w * E + e] & ((1u << lane) - 1u));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += DT) {
      int32_t run = cnt[e];
      for (int v = 0; v < nw; v++) {
        const uint32_t m = wm[v * E + e];
        wm[v * E + e] = (uint32_t)run;
        run += __popc(m);
      }
      cnt[e] = run;
    }
    __syncthreads();
    for (int k = 0; mine && k < K; k++) {
      const int64_t e = __ldg(ids + k);
      if (e >= 0 && e < E) rowpos[t * K + k] += (int32_t)wm[w * E + e];
    }
    __syncthreads(); /* wm is cleared for the next chunk */
  }
  __syncthreads(); /* s_bad and cnt, also when there are no tokens */
  const long long r = s_bad == ~0ull ? -1 : (long long)s_bad;
  __syncthreads();
  return r;
}

/* Waits until every rank's record of call `q` is complete (seq >= q + 1). */
__device__ bool wait_entries(const epk_buf_t &b, const epk_ll_t &ll, uint32_t q, uint32_t phase) {
  bool fail = false;
  for (int r = threadIdx.x; r < b.nranks && !fail; r += DT) {
    const uint32_t *seq = &entry(b, ll, r, q)->seq;
    waiter w;
    w.reset();
    while (!seq_ge(epk_ld_acq(seq), q + 1))
      if (w.tick(b, r, phase)) {
        fail = true;
        break;
      }
  }
  return !__syncthreads_or(fail);
}

__device__ void post_entry(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_dispatch_t &a,
                           uint32_t q, int status, const int32_t *cnt) {
  epk_ll_entry_t *me = entry(b, ll, b.rank, q);
  int32_t *sel = entry_sel(me);
  for (int e = threadIdx.x; e < ll.lay.E; e += DT) sel[e] = status == EPK_LL_ENTERED ? cnt[e] : 0;
  if (threadIdx.x == 0) {
    me->status = status, me->slot = status == EPK_LL_ENTERED ? a.slot : -1;
    me->topk = a.topk, me->fmt = a.fmt, me->num_tokens = a.n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    epk_st_rel(&me->seq, q + 1);
  }
}

/* Every rank reads the same records, so every rank reaches the same verdict: the lowest rank
 * that rejected, else the lowest whose topk or format differs from rank 0's. Block-wide (a
 * thread per rank: the records are read in parallel); thread 0 gets it in *v. */
__device__ void verdict(const epk_buf_t &b, const epk_ll_t &ll, uint32_t q, epk_ll_report_t *v) {
  __shared__ int s_rej, s_diff;
  if (threadIdx.x == 0) s_rej = INT_MAX, s_diff = INT_MAX;
  __syncthreads();
  const epk_ll_entry_t *e0 = entry(b, ll, 0, q);
  const int32_t t0 = __ldcg(&e0->topk), f0 = __ldcg(&e0->fmt);
  for (int r = threadIdx.x; r < b.nranks; r += DT) {
    const epk_ll_entry_t *er = entry(b, ll, r, q);
    if (__ldcg(&er->status) == EPK_LL_REJECTED)
      atomicMin(&s_rej, r);
    else if (__ldcg(&er->topk) != t0 || __ldcg(&er->fmt) != f0)
      atomicMin(&s_diff, r);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (s_rej != INT_MAX) {
    v->status = EP_ERR_PEER_INVALID, v->peer = s_rej;
  } else if (s_diff != INT_MAX) {
    const epk_ll_entry_t *er = entry(b, ll, s_diff, q);
    const int32_t tr = __ldcg(&er->topk), fr = __ldcg(&er->fmt);
    v->status = EP_ERR_MISMATCH, v->peer = s_diff, v->field = tr != t0 ? 0 : 1;
    v->mine = tr != t0 ? t0 : f0, v->theirs = tr != t0 ? tr : fr;
  }
}

/* Places of this rank's rows (the lower ranks' selections of the expert come first), the slot of
 * every peer, the receive layout of this rank's slot, and the dispatch's ids (for the combine's
 * check). Returns the rows this rank receives. */
__device__ int place(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_dispatch_t &a, uint32_t q,
                     int32_t *base) {
  __shared__ int s_nrecv;
  const int R = b.nranks, L = ll.lay.L, me = b.rank;
  int32_t *peer = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_peer);
  int32_t *rowpos = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos);
  int64_t *ids = slot_arr<int64_t>(ll, a.slot, ll.lay.ps_idx);
  if (threadIdx.x == 0) s_nrecv = 0;
  for (int r = threadIdx.x; r < R; r += DT) peer[r] = __ldcg(&entry(b, ll, r, q)->slot);
  for (int e = threadIdx.x; e < ll.lay.E; e += DT) {
    int32_t s = 0;
#pragma unroll 8
    for (int r = 0; r < me; r++) s += __ldcg(entry_sel(entry(b, ll, r, q)) + e);
    base[e] = s;
  }
  __syncthreads();
  const long long nk = (long long)a.n * a.topk;
  for (long long i = threadIdx.x; i < nk; i += DT) {
    const int64_t e = __ldg(a.topk_idx + i);
    ids[i] = e;
    if (e >= 0) rowpos[i] += base[e];
  }
  uint8_t *c = ctrl(b, ll, me, a.slot);
  int32_t *count = reinterpret_cast<int32_t *>(c + ll.lay.c_count);
  int64_t *range = reinterpret_cast<int64_t *>(c + ll.lay.c_range);
  for (int l = threadIdx.x; l < L; l += DT) {
    int64_t begin = 0;
#pragma unroll 8
    for (int r = 0; r < R; r++) {
      const int64_t n = __ldcg(entry_sel(entry(b, ll, r, q)) + (int64_t)me * L + l);
      range[(int64_t)l * R + r] = begin << 32 | n;
      begin += n;
    }
    count[l] = (int32_t)begin;
    atomicAdd(&s_nrecv, (int)begin);
  }
  __syncthreads();
  if (ll.opt & EPK_LL_OPT_CMETA) { /* the combine's push finds row f's expert from these */
    int32_t *pre = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_prefix);
    int32_t run = 0;
    for (int l0 = 0; l0 < L; l0 += DT) {
      const int l = l0 + threadIdx.x;
      int tot;
      const int ex = epk_block_scan<DT>(l < L ? count[l] : 0, &tot);
      if (l < L) pre[l] = run + ex;
      run += tot;
    }
    if (threadIdx.x == 0) pre[L] = run;
    __syncthreads();
  }
  return s_nrecv;
}

/* The count exchange of call q; returns the verdict (status EP_OK: the rows go). */
__device__ bool gate(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_dispatch_t &a, uint32_t q,
                     int32_t *smem) {
  int32_t *cnt = smem;
  uint32_t *mask = reinterpret_cast<uint32_t *>(smem + ll.lay.E);
  epk_ll_report_t v = no_report();
  epk_ll_slot_t *st = slot_state(ll, a.slot);
  int32_t *rowpos = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos);
  long long bad;
  if (ll.opt & EPK_LL_OPT_GATE) {
    bad = number_rows_fast(ll, a, rowpos, cnt,
                           reinterpret_cast<uint32_t *>(smem + 2 * ll.lay.E + b.nranks));
  } else {
    bad = first_bad(ll, a);
    if (bad < 0) number_rows(ll, a, rowpos, cnt, mask);
  }
  tr_set(ll, 1);
  /* The record of q-2 (same parity) may be read until every rank has entered q-1. */
  bool ok = q <= 1 || wait_entries(b, ll, q - 1, EPK_PH_LL_ENTER);
  if (ok) post_entry(b, ll, a, q, bad < 0 ? EPK_LL_ENTERED : EPK_LL_REJECTED, cnt);
  tr_set(ll, 2);
  if (ok && bad >= 0 && threadIdx.x == 0) { /* ours: named by its entry, peers fail at once */
    const int64_t e = __ldg(a.topk_idx + bad);
    v.item = (int32_t)bad, v.value = e;
    v.status = e < -1 || e >= ll.lay.E ? EP_ERR_OUT_OF_RANGE : EP_ERR_INVALID_ARG;
    for (long long j = bad - bad % a.topk; v.status == EP_ERR_INVALID_ARG && j < bad; j++)
      if (__ldg(a.topk_idx + j) == e) {
        v.dup_k = (int32_t)(j % a.topk);
        break;
      }
  }
  ok = ok && bad < 0 && wait_entries(b, ll, q, EPK_PH_LL_GATE);
  tr_set(ll, 3);
  __shared__ epk_ll_report_t s_v;
  if (ok) verdict(b, ll, q, &v);
  if (threadIdx.x == 0) s_v = v;
  __syncthreads();
  v = s_v;
  ok = ok && v.status == EP_OK;
  if (ok) v.nrecv = place(b, ll, a, q, cnt);
  if (threadIdx.x == 0) {
    st->q = ok ? q : 0; /* a receive of a slot whose gate failed has nothing to wait for */
    st->n = a.n, st->topk = a.topk, st->fmt = a.fmt;
    /* A failure that moved nothing is reported (a timeout is already recorded); a call that
     * nobody waits for leaves it to the next call. */
    if (a.ticket && (v.status != EP_OK || ok)) report(&b.host->ll_send, v, a.ticket);
    if (v.status != EP_OK && !a.ticket) defer(b, v, EPK_PH_LL_GATE, a.topk);
    priv(ll)->gate_ok = ok;
    __threadfence();
    st_rel_gpu(&priv(ll)->gate, q);
  }
  tr_set(ll, 4);
  return ok;
}

/* Blocks other than 0 wait for its verdict. */
__device__ bool await_gate(const epk_buf_t &b, const epk_ll_t &ll, uint32_t q) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    waiter w;
    w.reset();
    bool gave_up = false;
    while (!seq_ge(ld_acq_gpu(&priv(ll)->gate), q))
      if (w.tick(b, -1, EPK_PH_LL_GATE, 2)) {
        gave_up = true;
        break;
      }
    s_ok = !gave_up && *reinterpret_cast<volatile int32_t *>(&priv(ll)->gate_ok);
  }
  __syncthreads();
  return s_ok;
}

/* ------------------------------------------------------------------ rows */

/* One (token, k): its row, token and route at their final place in the destination's slot. */
__device__ void send_item(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_dispatch_t &a,
                          long long i, const int32_t *peer) {
  const int64_t e = __ldg(a.topk_idx + i);
  if (e < 0) return;
  const int L = ll.lay.L, H = ll.lay.H, NS = ll.lay.NS, RT = ll.lay.RT;
  const int d = (int)(e / L), le = (int)(e - (int64_t)d * L);
  const int t = (int)(i / a.topk), k = (int)(i % a.topk);
  const int row = __ldcg(slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos) + i);
  const int slot = peer[d];
  const int64_t r = (int64_t)le * RT + row;
  uint8_t *c = ctrl(b, ll, d, slot), *slab = data(b, ll, d, slot) + ll.lay.d_slab;
  if ((threadIdx.x & 31) == 0) {
    reinterpret_cast<int32_t *>(c + ll.lay.c_src)[r] = t;
    reinterpret_cast<int32_t *>(c + ll.lay.c_route)[r] = b.rank * 256 + k;
  }
  const int4 *x =
      reinterpret_cast<const int4 *>(static_cast<const uint16_t *>(a.x) + (int64_t)t * H);
  if (!(a.fmt & EPK_LL_FP8)) {
    epk_warp_copy<false>(reinterpret_cast<int4 *>(slab + r * 2 * H), x, H / 8);
    return;
  }
  uint8_t *scales = slab + (int64_t)L * RT * H;
  const bool cols = a.fmt & EPK_LL_COLS;
  cast_row(x, H, a.fmt, slab + r * H, [&](int blk, bool ue8m0, float inv, int ex) {
    put_scale(scales, cols, ue8m0, le, row, NS, RT, blk, scale_word(ue8m0, inv, ex));
  });
}

/* EPK_LL_OPT_PRECAST: warps of blocks part, part + parts, ... cast tokens once into the stage
 * (the same cast_row, so the same bits), each token's readiness published as the call's number. */
__device__ void cast_stage(const epk_ll_t &ll, const epk_ll_dispatch_t &a, uint32_t q, int part,
                           int parts) {
  const int H = ll.lay.H, NS = ll.lay.NS, lane = threadIdx.x & 31;
  uint8_t *stage = ll.priv + ll.lay.p_stage;
  uint32_t *sc = reinterpret_cast<uint32_t *>(ll.priv + ll.lay.p_stage_sc);
  uint32_t *ready = reinterpret_cast<uint32_t *>(ll.priv + ll.lay.p_ready);
  for (int t = part * DW + (threadIdx.x >> 5); t < a.n; t += parts * DW) {
    const int4 *x =
        reinterpret_cast<const int4 *>(static_cast<const uint16_t *>(a.x) + (int64_t)t * H);
    uint32_t *tsc = sc + (int64_t)t * NS;
    cast_row(x, H, a.fmt, stage + (int64_t)t * H, [&](int blk, bool ue8m0, float inv, int ex) {
      tsc[blk] = scale_word(ue8m0, inv, ex);
    });
    __syncwarp();
    if (lane == 0) st_rel_gpu(ready + t, q);
  }
}

/* One (token, k) of an fp8 dispatch from the stage: the row, its scales, token and route. */
__device__ void send_item_staged(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_dispatch_t &a,
                                 long long i, const int32_t *peer, uint32_t q) {
  const int64_t e = __ldg(a.topk_idx + i);
  if (e < 0) return;
  const int L = ll.lay.L, H = ll.lay.H, NS = ll.lay.NS, RT = ll.lay.RT, lane = threadIdx.x & 31;
  const int d = (int)(e / L), le = (int)(e - (int64_t)d * L);
  const int t = (int)(i / a.topk), k = (int)(i % a.topk);
  const int row = __ldcg(slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos) + i);
  const int64_t r = (int64_t)le * RT + row;
  uint8_t *c = ctrl(b, ll, d, peer[d]), *slab = data(b, ll, d, peer[d]) + ll.lay.d_slab;
  if (lane == 0) {
    reinterpret_cast<int32_t *>(c + ll.lay.c_src)[r] = t;
    reinterpret_cast<int32_t *>(c + ll.lay.c_route)[r] = b.rank * 256 + k;
    const uint32_t *ready = reinterpret_cast<const uint32_t *>(ll.priv + ll.lay.p_ready) + t;
    waiter w;
    w.reset();
    while (ld_acq_gpu(ready) != q)
      if (w.tick(b, -1, EPK_PH_LL_GATE, 2)) break;
  }
  __syncwarp();
  epk_warp_copy<true>(reinterpret_cast<int4 *>(slab + r * H),
                      reinterpret_cast<const int4 *>(ll.priv + ll.lay.p_stage + (int64_t)t * H),
                      H / 16);
  const uint32_t *sc =
      reinterpret_cast<const uint32_t *>(ll.priv + ll.lay.p_stage_sc) + (int64_t)t * NS;
  uint8_t *scales = slab + (int64_t)L * RT * H;
  const bool cols = a.fmt & EPK_LL_COLS, ue8m0 = a.fmt & EPK_LL_UE8M0;
  for (int blk = lane; blk < NS; blk += 32)
    put_scale(scales, cols, ue8m0, le, row, NS, RT, blk, __ldcg(sc + blk));
}

/* ------------------------------------------------------------------ receive */

/* This rank's rows of the slot's dispatch have all arrived; and when the slot's previous
 * combine let the sources read its combine input, every source has finished (the caller may
 * now write it again). Block-wide. */
__device__ void receive(const epk_buf_t &b, const epk_ll_t &ll, int slot) {
  /* Written by block 0 of this kernel (one phase) or an earlier kernel: read through L2. */
  const epk_ll_slot_t *st = slot_state(ll, slot);
  const uint32_t q = __ldcg(&st->q), zc = __ldcg(&st->zc);
  if (!q) return; /* the gate failed: nothing comes, the failure is recorded */
  uint8_t *c = ctrl(b, ll, b.rank, slot);
  bool fail = false;
  for (int r = threadIdx.x; r < b.nranks && !fail; r += blockDim.x) {
    waiter w;
    w.reset();
    while (!fail && epk_ld_acq(flag(c, ll.lay.c_data, r)) != q + 1)
      fail = w.tick(b, r, EPK_PH_LL_DATA);
    w.reset();
    while (!fail && zc && !seq_ge(epk_ld_acq(flag(c, ll.lay.c_zdone, r)), zc))
      fail = w.tick(b, r, EPK_PH_LL_ZDONE);
  }
  __syncthreads();
}

__device__ __forceinline__ void send(const epk_buf_t &b, const epk_ll_t &ll,
                                     const epk_ll_dispatch_t &a) {
  extern __shared__ int32_t smem[]; /* gate: cnt[E], mask[E]; peer[R]; (OPT_GATE) wm[16][E] */
  int32_t *peer = smem + 2 * ll.lay.E;
  const uint32_t q = *reinterpret_cast<volatile uint32_t *>(&priv(ll)->q) + 1; /* stable: the
                                                     last block of this kernel advances it */
  tr_min(ll, 0);
  const bool staged = (a.fmt & EPK_LL_FP8) && (ll.opt & EPK_LL_OPT_PRECAST);
  if (staged && blockIdx.x > 0) cast_stage(ll, a, q, blockIdx.x - 1, gridDim.x - 1);
  const bool ok = blockIdx.x == 0 ? gate(b, ll, a, q, smem) : await_gate(b, ll, q);
  if (staged && gridDim.x == 1) cast_stage(ll, a, q, 0, 1);
  if (ok) {
    const int32_t *ps = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_peer);
    for (int r = threadIdx.x; r < b.nranks; r += DT) peer[r] = __ldcg(ps + r);
    __syncthreads();
    const long long nk = (long long)a.n * a.topk, step = (long long)gridDim.x * DW;
    for (long long i = (long long)blockIdx.x * DW + (threadIdx.x >> 5); i < nk; i += step)
      if (staged)
        send_item_staged(b, ll, a, i, peer, q);
      else
        send_item(b, ll, a, i, peer);
  }
  __syncthreads();
  tr_max(ll, 5);
  __shared__ int s_last;
  const bool last = last_block(&priv(ll)->done_send);
  if (threadIdx.x == 0) s_last = last;
  __syncthreads();
  if (s_last) {
    if (ll.opt & EPK_LL_OPT_FLAGS) { /* one release store per rank, all at once */
      for (int d = threadIdx.x; ok && d < b.nranks; d += DT)
        epk_st_rel(flag(ctrl(b, ll, d, peer[d]), ll.lay.c_data, b.rank), q + 1);
    } else if (threadIdx.x == 0) {
      for (int d = 0; ok && d < b.nranks; d++)
        epk_st_rel(flag(ctrl(b, ll, d, peer[d]), ll.lay.c_data, b.rank), q + 1);
    }
    if (threadIdx.x == 0) priv(ll)->q = q;
    tr_set(ll, 6);
    if (a.recv_too) receive(b, ll, a.slot);
    __syncthreads();
    if (threadIdx.x == 0) {
      const bool fp8 = a.fmt & EPK_LL_FP8;
      tr_commit(ll,
                a.recv_too ? (fp8 ? EPK_LL_TR_D8 : EPK_LL_TR_D16)
                           : (fp8 ? EPK_LL_TR_D8_SEND : EPK_LL_TR_D16_SEND),
                7);
    }
  }
}

/* The receive of a two-phase dispatch (the hook's launch, one block). */
__device__ __forceinline__ void arrive(const epk_buf_t &b, const epk_ll_t &ll, int slot) {
  tr_min(ll, 0);
  receive(b, ll, slot);
  if (threadIdx.x == 0) tr_commit(ll, EPK_LL_TR_DRECV, 1);
}

/* A rejected dispatch still takes its number: after every rank entered q-1, the record of q
 * says REJECTED, so that the peers' gate fails at once. */
__global__ void __launch_bounds__(128, 1)
    ll_reject_kernel(EPK_BUF_ARG b, epk_ll_t ll, int combine) {
  epk_ll_priv_t *p = priv(ll);
  if (combine) {
    if (threadIdx.x == 0) {
      const uint32_t c = p->c + 1;
      __threadfence_system();
      epk_st_rel(creject(b, ll, b.rank), c);
      p->c = c;
    }
    return;
  }
  const uint32_t q = p->q + 1;
  __shared__ int s_fail;
  bool fail = false;
  for (int r = threadIdx.x; q > 1 && r < b.nranks && !fail; r += blockDim.x) {
    const uint32_t *seq = &entry(b, ll, r, q - 1)->seq;
    waiter w;
    w.reset();
    while (!fail && !seq_ge(epk_ld_acq(seq), q)) fail = w.tick(b, r, EPK_PH_LL_ENTER);
  }
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  if (fail) atomicOr(&s_fail, 1);
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (!s_fail) {
    epk_ll_entry_t *me = entry(b, ll, b.rank, q);
    me->status = EPK_LL_REJECTED, me->slot = -1;
    __threadfence_system();
    epk_st_rel(&me->seq, q + 1);
  }
  p->gate_ok = 0;
  p->q = q;
  __threadfence();
  st_rel_gpu(&p->gate, q);
}

}  // namespace

/* Both phases are one kernel, epcomm::ll::dispatch: a profiler counts the receive hook's launch
 * as the dispatch's second phase (ep_kernels.h, kernel names). */
namespace epcomm::ll {
__global__ void __launch_bounds__(DT, 1) dispatch(EPK_BUF_ARG b, epk_ll_t ll, epk_ll_dispatch_t a) {
  if (a.recv_only)
    arrive(b, ll, a.slot);
  else
    send(b, ll, a);
}
}  // namespace epcomm::ll

extern "C" cudaError_t epk_ll_setup(const epk_ll_t *ll) {
  if (ll->smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(epcomm::ll::dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              ll->smem);
}

extern "C" cudaError_t epk_ll_launch_dispatch(const epk_buf_t *b, const epk_ll_t *ll,
                                              const epk_ll_dispatch_t *a, cudaStream_t s) {
  epcomm::ll::dispatch<<<ll->blocks, DT, ll->smem, s>>>(*b, *ll, *a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_ll_launch_dispatch_recv(const epk_buf_t *b, const epk_ll_t *ll, int slot,
                                                   cudaStream_t s) {
  epk_ll_dispatch_t a = {};
  a.slot = slot, a.recv_only = 1;
  epcomm::ll::dispatch<<<1, 128, 0, s>>>(*b, *ll, a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_ll_launch_reject(const epk_buf_t *b, const epk_ll_t *ll, int combine,
                                            cudaStream_t s) {
  ll_reject_kernel<<<1, 128, 0, s>>>(*b, *ll, combine);
  return cudaGetLastError();
}
