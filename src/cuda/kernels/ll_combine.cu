/* Low-latency combine (SEMANTICS.md §6.5; protocol in ll_kernels.h). Send: the expert rank
 * pushes each received row into its source's area at (token, k), or, when y is its combine input
 * (zero copy), moves nothing and lets the sources read it there; the source's receive reduces in
 * k order with one fused multiply-add per step and rounds once to bf16. */
#include "cuda/kernels/ll_common.cuh"

#define CT 512
#define CW (CT / 32)

using namespace epk_ll;

namespace {

/* Block 0: the combine may leave a slot out (-1) but select nothing the dispatch did not; keeps
 * the weights and the slots to reduce (two-phase callers need only keep `out`). */
__device__ void check(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_combine_t &a,
                      uint32_t c) {
  __shared__ unsigned long long s_bad;
  const int64_t *ids = slot_arr<int64_t>(ll, a.slot, ll.lay.ps_idx);
  float *w = slot_arr<float>(ll, a.slot, ll.lay.ps_w);
  uint8_t *use = slot_arr<uint8_t>(ll, a.slot, ll.lay.ps_use);
  if (threadIdx.x == 0) s_bad = ~0ull;
  __syncthreads();
  const long long nk = (long long)a.n * a.topk;
  const bool rec = ll.opt & EPK_LL_OPT_CMETA;
  int4 *recs = slot_arr<int4>(ll, a.slot, ll.lay.ps_rec);
  const int32_t *rowpos = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos);
  for (long long i = threadIdx.x; i < nk; i += CT) {
    const int64_t e = __ldg(a.topk_idx + i), de = ids[i];
    if (e != -1 && e != de) atomicMin(&s_bad, (unsigned long long)i);
    use[i] = e != -1;
    const float wi = __ldg(a.topk_weights + i);
    w[i] = wi;
    if (rec) { /* what the receive needs of (t, k), in one load: expert rank (-1: left out), row */
      const int r = e != -1 && de >= 0 ? (int)(de / ll.lay.L) : -1;
      const int row = r >= 0 ? (int)(de - (int64_t)r * ll.lay.L) * ll.lay.RT + rowpos[i] : 0;
      recs[i] = make_int4(r, row, (int)__float_as_uint(wi), 0);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const bool ok = s_bad == ~0ull;
  epk_ll_report_t v = no_report();
  if (!ok) {
    v.status = EP_ERR_MISMATCH, v.item = (int32_t)s_bad;
    v.value = __ldg(a.topk_idx + s_bad), v.want = ids[s_bad];
  }
  if (a.ticket) report(&b.host->ll_send, v, a.ticket);
  if (!ok && !a.ticket) defer(b, v, EPK_PH_LL_CHECK, a.topk);
  slot_state(ll, a.slot)->c = ok ? c : 0;
  priv(ll)->comb_ok = ok;
}

/* Received rows f of this rank (expert block l, row j) go back to their sources' areas. */
__device__ void push(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_combine_t &a,
                     int32_t *prefix, const int32_t *peer) {
  const int L = ll.lay.L, RT = ll.lay.RT, H = ll.lay.H;
  uint8_t *c = ctrl(b, ll, b.rank, a.slot);
  const int32_t *count = reinterpret_cast<const int32_t *>(c + ll.lay.c_count);
  const int32_t *src = reinterpret_cast<const int32_t *>(c + ll.lay.c_src);
  const int32_t *route = reinterpret_cast<const int32_t *>(c + ll.lay.c_route);
  if (ll.opt & EPK_LL_OPT_CMETA) { /* written by this slot's dispatch gate */
    const int32_t *pre = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_prefix);
    for (int l = threadIdx.x; l <= L; l += CT) prefix[l] = __ldcg(pre + l);
  } else if (threadIdx.x == 0) {
    int run = 0;
    for (int l = 0; l < L; l++) prefix[l] = run, run += count[l];
    prefix[L] = run;
  }
  __syncthreads();
  const int total = prefix[L], step = gridDim.x * CW;
  for (int f = blockIdx.x * CW + (threadIdx.x >> 5); f < total; f += step) {
    int lo = 0, hi = L; /* the last l with prefix[l] <= f */
    while (hi - lo > 1) {
      const int m = (lo + hi) / 2;
      if (prefix[m] <= f)
        lo = m;
      else
        hi = m;
    }
    const int64_t r = (int64_t)lo * RT + (f - prefix[lo]);
    const int32_t rt = __ldcg(route + r), t = __ldcg(src + r), s = rt >> 8, k = rt & 255;
    uint8_t *area = data(b, ll, s, peer[s]) + ll.lay.d_area;
    epk_warp_copy<false>(
        reinterpret_cast<int4 *>(area + ((int64_t)t * a.topk + k) * 2 * H),
        reinterpret_cast<const int4 *>(static_cast<const uint8_t *>(a.y) + r * 2 * H), H / 8);
  }
}

/* ------------------------------------------------------------------ receive */

/* Waits for every expert rank's flag of combine c; zc[r] says whether its rows stay in its
 * combine input. Returns the lowest rank that rejected the combine, INT_MAX if none, -1 when
 * this rank gave up waiting. Every block reaches the same answer. */
__device__ int await_rows(const epk_buf_t &b, const epk_ll_t &ll, int slot, uint32_t c,
                          uint8_t *zc) {
  __shared__ int s_rej, s_fail;
  if (threadIdx.x == 0) s_rej = INT_MAX, s_fail = 0;
  __syncthreads();
  uint8_t *ct = ctrl(b, ll, b.rank, slot);
  for (int r = threadIdx.x; r < b.nranks; r += CT) {
    const uint32_t *f = flag(ct, ll.lay.c_comb, r), *rej = creject(b, ll, r);
    waiter w;
    w.reset();
    for (;;) {
      uint32_t v = epk_ld_acq(f);
      if ((v & ~EPK_LL_ZC) == c) {
        zc[r] = v >> 31;
        break;
      }
      /* A rejection of this combine or a later one; in the later case the rank stored its flag
       * for this one before that rejection, so the reload sees it. */
      if (seq_ge(epk_ld_acq(rej), c)) {
        v = epk_ld_acq(f);
        if ((v & ~EPK_LL_ZC) == c) {
          zc[r] = v >> 31;
          break;
        }
        atomicMin(&s_rej, r);
        break;
      }
      if (w.tick(b, r, EPK_PH_LL_COMB)) {
        atomicOr(&s_fail, 1);
        break;
      }
    }
  }
  __syncthreads();
  return s_fail ? -1 : s_rej;
}

/* The same from the (t, k) records of the send's check (EPK_LL_OPT_CMETA): one 16-byte load of
 * metadata per k instead of four dependent ones. */
__device__ void reduce8_rec(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_combine_t &a,
                            const int32_t *peer, const uint8_t *zc, int t, int h0) {
  const int H = ll.lay.H;
  const int4 *recs = slot_arr<int4>(ll, a.slot, ll.lay.ps_rec) + (int64_t)t * a.topk;
  const uint8_t *area = data(b, ll, b.rank, a.slot) + ll.lay.d_area;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  constexpr int G = 8; /* loads in flight; the adds stay in k order */
  for (int k0 = 0; k0 < a.topk; k0 += G) {
    int4 v[G], m[G];
#pragma unroll
    for (int j = 0; j < G; j++)
      m[j] = k0 + j < a.topk ? __ldcg(recs + k0 + j) : make_int4(-1, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < G; j++) {
      const int r = m[j].x;
      if (r < 0) continue;
      const int64_t i = (int64_t)t * a.topk + k0 + j;
      const uint8_t *row = zc[r] ? data(b, ll, r, peer[r]) + ll.lay.d_cin + (int64_t)m[j].y * 2 * H
                                 : area + i * 2 * H;
      v[j] = __ldcg(reinterpret_cast<const int4 *>(row + 2 * h0));
    }
#pragma unroll
    for (int j = 0; j < G; j++)
      if (m[j].x >= 0) fma8(acc, v[j], __uint_as_float((uint32_t)m[j].z));
  }
  reinterpret_cast<int4 *>(static_cast<uint16_t *>(a.out) + (int64_t)t * H + h0)[0] = pack8(acc);
}

/* out[t][h0 .. h0+7] of one lane: acc = fmaf(y(t, k), w[t][k], acc) for k ascending. */
__device__ void reduce8(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_combine_t &a,
                        const int32_t *peer, const uint8_t *zc, int t, int h0) {
  const int L = ll.lay.L, RT = ll.lay.RT, H = ll.lay.H;
  const int64_t *ids = slot_arr<int64_t>(ll, a.slot, ll.lay.ps_idx);
  const int32_t *rowpos = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_rowpos);
  const float *w = slot_arr<float>(ll, a.slot, ll.lay.ps_w);
  const uint8_t *use = slot_arr<uint8_t>(ll, a.slot, ll.lay.ps_use);
  const uint8_t *area = data(b, ll, b.rank, a.slot) + ll.lay.d_area;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  constexpr int G = 8; /* loads in flight; the adds stay in k order */
  for (int k0 = 0; k0 < a.topk; k0 += G) {
    int4 v[G];
    float wk[G];
    bool u[G];
#pragma unroll
    for (int j = 0; j < G; j++) {
      const int k = k0 + j;
      const int64_t i = (int64_t)t * a.topk + k;
      u[j] = k < a.topk && __ldcg(use + i); /* written by the send's check (L2: a fused kernel) */
      if (!u[j]) continue;
      wk[j] = __ldcg(w + i);
      const int64_t e = ids[i];
      const int r = (int)(e / L);
      const uint8_t *row = zc[r] ? data(b, ll, r, peer[r]) + ll.lay.d_cin +
                                       ((e - (int64_t)r * L) * RT + rowpos[i]) * 2 * H
                                 : area + i * 2 * H;
      v[j] = __ldcg(reinterpret_cast<const int4 *>(row + 2 * h0));
    }
#pragma unroll
    for (int j = 0; j < G; j++)
      if (u[j]) fma8(acc, v[j], wk[j]);
  }
  reinterpret_cast<int4 *>(static_cast<uint16_t *>(a.out) + (int64_t)t * H + h0)[0] = pack8(acc);
}

/* The receive of combine c into a.out: waits for every expert rank's flag (or rejection),
 * reports the verdict to a host waiting with `ticket`, reduces, and the last block marks every
 * expert's combine input read (zdone = done). Trace points tp + 1 .. tp + 3. Block-wide, every
 * block of the kernel. */
__device__ void combine_receive(const epk_buf_t &b, const epk_ll_t &ll, const epk_ll_combine_t &a,
                                const int32_t *peer, uint8_t *zc, uint32_t c, uint32_t ticket,
                                uint32_t done, int kind, int tp) {
  /* c == 0: this rank rejected its own combine (its send said why); nobody sent rows. */
  const int rej = c ? await_rows(b, ll, a.slot, c, zc) : b.rank;
  if (blockIdx.x == 0) tr_set(ll, tp + 1);
  if (blockIdx.x == 0 && threadIdx.x == 0 && rej >= 0) {
    epk_ll_report_t v = no_report();
    if (rej != INT_MAX) v.status = EP_ERR_PEER_INVALID, v.peer = rej;
    if (ticket) report(&b.host->ll_recv, v, ticket);
    if (rej != INT_MAX && rej != b.rank && !ticket) defer(b, v, EPK_PH_LL_COMB, a.topk);
  }
  if (rej == INT_MAX) {
    const int chunks = (ll.lay.H + 255) / 256, lane = threadIdx.x & 31;
    const long long items = (long long)a.n * chunks, step = (long long)gridDim.x * CW;
    for (long long it = (long long)blockIdx.x * CW + (threadIdx.x >> 5); it < items; it += step) {
      const int t = (int)(it / chunks), h0 = (int)(it % chunks) * 256 + lane * 8;
      if (h0 >= ll.lay.H) continue;
      if (ll.opt & EPK_LL_OPT_CMETA)
        reduce8_rec(b, ll, a, peer, zc, t, h0);
      else
        reduce8(b, ll, a, peer, zc, t, h0);
    }
  }
  __syncthreads();
  tr_max(ll, tp + 2);
  __shared__ int s_last;
  const bool last = last_block(&priv(ll)->done_recv);
  if (threadIdx.x == 0) s_last = last;
  __syncthreads();
  if (!s_last) return;
  /* Every block has read what it needed: the experts may reuse their combine input. Whatever
   * happened, so that nobody waits for a reader that will not come. */
  if (ll.opt & EPK_LL_OPT_FLAGS) {
    for (int r = threadIdx.x; r < b.nranks; r += CT)
      epk_st_rel(flag(ctrl(b, ll, r, peer[r]), ll.lay.c_zdone, b.rank), done);
  } else if (threadIdx.x == 0) {
    for (int r = 0; r < b.nranks; r++)
      epk_st_rel(flag(ctrl(b, ll, r, peer[r]), ll.lay.c_zdone, b.rank), done);
  }
  __syncthreads();
  if (threadIdx.x == 0) tr_commit(ll, kind, tp + 3);
}

/* The receive of a two-phase combine (the hook's launch). */
__device__ __forceinline__ void reduce(const epk_buf_t &b, const epk_ll_t &ll,
                                       const epk_ll_combine_t &a) {
  extern __shared__ int32_t smem[]; /* peer[R], then zc[R] bytes */
  int32_t *peer = smem;
  uint8_t *zc = reinterpret_cast<uint8_t *>(smem + b.nranks);
  const int32_t *ps = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_peer);
  for (int r = threadIdx.x; r < b.nranks; r += CT) peer[r] = ps[r], zc[r] = 0;
  const uint32_t c = slot_state(ll, a.slot)->c;
  tr_min(ll, 0);
  __syncthreads();
  combine_receive(b, ll, a, peer, zc, c, a.ticket,
                  *reinterpret_cast<volatile uint32_t *>(&priv(ll)->c),
                  a.ybuf ? EPK_LL_TR_CRECV_BUF : EPK_LL_TR_CRECV, 0);
}

/* The send of a combine; with a.recv_too (one phase, EPK_LL_OPT_FUSE) every block then goes on
 * to the receive, in the same kernel (one launch, no second grid start). */
__device__ __forceinline__ void send(const epk_buf_t &b, const epk_ll_t &ll,
                                     const epk_ll_combine_t &a) {
  extern __shared__ int32_t smem[]; /* peer[R], prefix[L + 1], zc[R] bytes */
  int32_t *peer = smem, *prefix = smem + b.nranks;
  uint8_t *zc = reinterpret_cast<uint8_t *>(prefix + ll.lay.L + 1);
  const uint32_t c = *reinterpret_cast<volatile uint32_t *>(&priv(ll)->c) + 1; /* stable: the
                                                     last block of this kernel advances it */
  const int32_t *ps = slot_arr<int32_t>(ll, a.slot, ll.lay.ps_peer);
  tr_min(ll, 0);
  for (int r = threadIdx.x; r < b.nranks; r += CT) peer[r] = ps[r], zc[r] = 0;
  __syncthreads();
  if (blockIdx.x == 0) check(b, ll, a, c);
  if (blockIdx.x == 0) tr_set(ll, 1);
  if (!a.zero_copy) push(b, ll, a, prefix, peer);
  __syncthreads();
  tr_max(ll, 2);
  __shared__ int s_last;
  const bool last = last_block(&priv(ll)->done_comb);
  if (threadIdx.x == 0) s_last = last;
  __syncthreads();
  if (s_last) {
    /* The last block: every row is pushed and the check is done (block 0's fence preceded its
     * count); raise the flags, or say that this rank rejected the combine. */
    epk_ll_priv_t *p = priv(ll);
    const bool ok = *reinterpret_cast<volatile int32_t *>(&p->comb_ok);
    const uint32_t v = c | (a.zero_copy ? EPK_LL_ZC : 0u);
    if (ok && (ll.opt & EPK_LL_OPT_FLAGS)) {
      for (int s = threadIdx.x; s < b.nranks; s += CT)
        epk_st_rel(flag(ctrl(b, ll, s, peer[s]), ll.lay.c_comb, b.rank), v);
    } else if (threadIdx.x == 0) {
      if (ok)
        for (int s = 0; s < b.nranks; s++)
          epk_st_rel(flag(ctrl(b, ll, s, peer[s]), ll.lay.c_comb, b.rank), v);
      else
        epk_st_rel(creject(b, ll, b.rank), c);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      slot_state(ll, a.slot)->zc = ok && a.zero_copy ? c : 0;
      p->c = c;
      if (a.recv_too)
        tr_set(ll, 3);
      else
        tr_commit(ll, a.zero_copy ? EPK_LL_TR_CZC : EPK_LL_TR_CPUSH, 3);
    }
  }
  /* One phase: the receive waits for every rank's flag of combine c, this rank's own included
   * (raised, or its rejection stored, by the last block above, after every block's fence): what
   * block 0's check wrote (records, weights) is visible once that flag is acquired, and the
   * receive reads it through L2. */
  if (a.recv_too)
    combine_receive(b, ll, a, peer, zc, c, a.rticket, c,
                    a.zero_copy ? EPK_LL_TR_C1_ZC
                    : a.ybuf    ? EPK_LL_TR_C1_VIEW
                                : EPK_LL_TR_C1,
                    3);
}

/* A handle whose combine was not received: its readers' marks go up all the same. */
__global__ void __launch_bounds__(128, 1) ll_release_kernel(EPK_BUF_ARG b, epk_ll_t ll, int slot) {
  const int32_t *ps = slot_arr<int32_t>(ll, slot, ll.lay.ps_peer);
  const uint32_t done = *reinterpret_cast<volatile uint32_t *>(&priv(ll)->c);
  __threadfence_system();
  for (int r = threadIdx.x; r < b.nranks; r += blockDim.x)
    epk_st_rel(flag(ctrl(b, ll, r, ps[r]), ll.lay.c_zdone, b.rank), done);
}

}  // namespace

/* Both phases are one kernel, epcomm::ll::combine, as the dispatch's (ep_kernels.h, kernel
 * names). */
namespace epcomm::ll {
__global__ void __launch_bounds__(CT, 1) combine(EPK_BUF_ARG b, epk_ll_t ll, epk_ll_combine_t a) {
  if (a.recv_only)
    reduce(b, ll, a);
  else
    send(b, ll, a);
}
}  // namespace epcomm::ll

extern "C" cudaError_t epk_ll_launch_combine(const epk_buf_t *b, const epk_ll_t *ll,
                                             const epk_ll_combine_t *a, cudaStream_t s) {
  size_t smem = 4 * ((size_t)b->nranks + (size_t)ll->lay.L + 1) + (size_t)b->nranks + 16;
  epcomm::ll::combine<<<ll->blocks, CT, smem, s>>>(*b, *ll, *a);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_ll_launch_combine_recv(const epk_buf_t *b, const epk_ll_t *ll,
                                                  const epk_ll_combine_t *a, cudaStream_t s) {
  size_t smem = 5 * (size_t)b->nranks + 16;
  epk_ll_combine_t r = *a;
  r.recv_only = 1;
  epcomm::ll::combine<<<ll->blocks, CT, smem, s>>>(*b, *ll, r);
  return cudaGetLastError();
}

extern "C" cudaError_t epk_ll_launch_release(const epk_buf_t *b, const epk_ll_t *ll, int slot,
                                             cudaStream_t s) {
  ll_release_kernel<<<1, 128, 0, s>>>(*b, *ll, slot);
  return cudaGetLastError();
}
