/* The count exchange that opens every call (one block): this rank's plan (rows it sends to
 * each destination, in token order), its hello into every peer's pool, the wait for every
 * peer's hello, the cross-rank checks, and the receive side (counts matrix, rank_prefix,
 * per-expert counts, combine rounds). A rank that rejected its arguments still posts a hello
 * (status REJECTED) so that its peers fail at once instead of timing out. */
#include "cuda/kernels/common.cuh"

#define NT 1024
#define NW (NT / 32)
static_assert(NW <= 32, "one warp scans the per-warp counts");
static_assert(sizeof(epk_hello_t) % 8 == 0, "the counts after a hello stay aligned");

namespace {

__device__ __forceinline__ epk_hello_t *hello_slot(const epk_buf_t &b, int owner, int parity,
                                                   int writer) {
  return epk_hello(b, owner, parity, writer);
}
__device__ __forceinline__ int32_t *hello_to_rank(epk_hello_t *h) {
  return reinterpret_cast<int32_t *>(h + 1);
}
/* Peers write our slots: read them through L2, never from a possibly stale L1 line. */
__device__ __forceinline__ int32_t rd(const int32_t *p) {
  return __ldcg(p);
}

#define SMEM_EXPERTS 4096
__shared__ int32_t s_ecount[SMEM_EXPERTS]; /* selections per expert, when E fits */

__device__ __forceinline__ int32_t *ecount(const epk_buf_t &b, const epk_notify_t &a) {
  return a.num_experts <= SMEM_EXPERTS ? s_ecount : b.ecount;
}

/* pos[t][d]: 1 if token t goes to d, then rewritten as its row among the rows to d, or -1. */
__device__ void plan_rows(const epk_buf_t &b, const epk_notify_t &a, int32_t *cnt_me) {
  const int R = b.nranks, n = a.num_tokens, topk = a.topk, L = a.num_experts / R;
  int32_t *pos = epk_plan_pos(a.plan, R), *ec = ecount(b, a);
  for (int e = threadIdx.x; e < a.num_experts; e += NT) ec[e] = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < n; t += NT) {
    int32_t *row = pos + (size_t)t * R;
    for (int d = 0; d < R; d++) row[d] = 0;
    for (int k = 0; k < topk; k++) {
      int64_t e = a.topk_idx[(size_t)t * topk + k];
      if (e < 0) continue;
      row[e / L] = 1;
      atomicAdd(&ec[e], 1);
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
  __syncthreads();
}

/* The same plan for R <= 32 in one pass over the ids, NT tokens at a time in token order: each
 * thread reads its token's ids (checking them, counting experts) into a mask of destinations;
 * ballots turn the masks into rows per destination. Returns the first bad slot (an id < -1 or
 * >= E), or INT64_MAX; when there is one the plan is not used (the call is rejected). */
__shared__ int32_t s_wcnt[32][33]; /* [warp][d]: rows of the warp's tokens to d, then its first */
__shared__ int32_t s_base[32];     /* [d]: rows to d of the passes before */
__shared__ int32_t s_pbase[32];    /* [d]: s_base at the start of the current pass */
__shared__ unsigned long long s_bad;
/* R <= STAGE_R: a pass's positions gathered here (relative to s_pbase, -1: not sent) and written
 * out in token-major order by consecutive threads, instead of each thread writing its token's R
 * words R x 4 bytes apart from its neighbour's (one partial sector per word). */
#define STAGE_R 8
__shared__ int16_t s_stage[NT * STAGE_R];

__device__ long long plan_fast(const epk_buf_t &b, const epk_notify_t &a, int32_t *cnt_me) {
  const int R = b.nranks, n = a.num_tokens, topk = a.topk, E = a.num_experts, L = E / R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t *pos = epk_plan_pos(a.plan, R), *ec = ecount(b, a);
  for (int e = threadIdx.x; e < E; e += NT) ec[e] = 0;
  if (threadIdx.x < 32) s_base[threadIdx.x] = 0;
  if (threadIdx.x == 0) s_bad = ~0ull;
  __syncthreads();
  for (int t0 = 0; t0 < n; t0 += NT) {
    const int t = t0 + (int)threadIdx.x;
    uint32_t mask = 0;
    if (t < n) {
      const int64_t *ids = a.topk_idx + (int64_t)t * topk;
      for (int k0 = 0; k0 < topk; k0 += 8) {
        int64_t e[8];
#pragma unroll
        for (int u = 0; u < 8; u++) e[u] = k0 + u < topk ? __ldg(ids + k0 + u) : -1;
#pragma unroll
        for (int u = 0; u < 8; u++) {
          if (e[u] < -1 || e[u] >= E) {
            atomicMin(&s_bad, (unsigned long long)((int64_t)t * topk + k0 + u));
          } else if (e[u] >= 0) {
            mask |= 1u << (int)(e[u] / L);
            atomicAdd(&ec[e[u]], 1);
          }
        }
      }
    }
    for (int d = 0; d < R; d++) {
      unsigned m = __ballot_sync(EPK_FULL, (mask >> d) & 1u);
      if (lane == 0) s_wcnt[warp][d] = __popc(m);
    }
    __syncthreads();
    if (warp < R) { /* warp d: exclusive scan of the per-warp counts to d, plus the base */
      const int d = warp;
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
      else if (t < n)
        pos[(int64_t)t * R + d] = p;
    }
    if (stage) {
      __syncthreads();
      const int words = min(NT, n - t0) * R;
      int32_t *out = pos + (int64_t)t0 * R;
      for (int i = threadIdx.x; i < words; i += NT) {
        const int v = s_stage[i];
        out[i] = v < 0 ? -1 : s_pbase[i % R] + v;
      }
    }
    __syncthreads(); /* s_wcnt, s_stage and s_pbase are rewritten by the next pass */
  }
  if (threadIdx.x < R) cnt_me[threadIdx.x] = s_base[threadIdx.x];
  const unsigned long long bad = s_bad;
  __syncthreads();
  return bad == ~0ull ? INT64_MAX : (long long)bad;
}

__device__ void fill_header(epk_hello_t *h, const epk_notify_t &a, int status) {
  h->key = a.key;
  h->key.rejected = status == EPK_HELLO_REJECTED;
  h->num_tokens = a.num_tokens;
  h->direct = a.direct;
  h->recv_rows = a.recv_rows;
  h->wgap256 = a.wgap256;
  h->xreg1 = a.xreg1;
  h->xcap = a.xcap;
  h->pad = 0;
  h->xoff = a.xoff;
}

/* Writes this rank's hello into every peer's slot, then publishes all of them. */
__device__ void post(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq, int status,
                     const int32_t *cnt_me) {
  const int R = b.nranks, me = b.rank, par = seq & 1;
  const bool counts = a.kind == EPK_NOTIFY_DISPATCH && status == EPK_HELLO_OK;
  for (int d = threadIdx.x; d < R; d += NT) fill_header(hello_slot(b, d, par, me), a, status);
  for (int i = threadIdx.x; counts && i < R * R; i += NT)
    hello_to_rank(hello_slot(b, i / R, par, me))[i % R] = cnt_me[i % R];
  if (counts) {
    const int L = a.num_experts / R;
    const int32_t *ec = ecount(b, a);
    for (int i = threadIdx.x; i < a.num_experts; i += NT)
      hello_to_rank(hello_slot(b, i / L, par, me))[R + i % L] = ec[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < R; d++) epk_st_rel(&hello_slot(b, d, par, me)->seq, seq);
  }
}

/* Waits for every peer's hello; false when this rank must give up (failure recorded). */
__device__ bool gather(const epk_buf_t &b, uint32_t seq) {
  bool fail = false;
  for (int r = threadIdx.x; r < b.nranks && !fail; r += NT) {
    epk_hello_t *h = hello_slot(b, b.rank, seq & 1, r);
    epk_waiter w;
    w.reset();
    while (epk_ld_acq(&h->seq) != seq)
      if (w.tick(b, r, EPK_PH_NOTIFY)) {
        fail = true;
        break;
      }
  }
  return !__syncthreads_or(fail);
}

/* The core's ep_call_key_diff, on the device. */
__device__ int first_difference(const epk_hello_t *m, const epk_hello_t *p) {
  if (rd(&p->key.rejected)) return EP_CF_REJECTED;
  for (int f = 0; f < EP_CF_COUNT; f++)
    if (rd(&m->key.f[f]) != rd(&p->key.f[f])) return f;
  return -1;
}

/* Every rank compares with every peer and reports the lowest culprit, so all agree. */
__device__ bool compare(const epk_buf_t &b, uint32_t seq) {
  __shared__ int worst;
  if (threadIdx.x == 0) worst = INT_MAX;
  __syncthreads();
  epk_hello_t *mine = hello_slot(b, b.rank, seq & 1, b.rank);
  for (int r = threadIdx.x; r < b.nranks; r += NT) {
    if (r == b.rank) continue;
    int f = first_difference(mine, hello_slot(b, b.rank, seq & 1, r));
    if (f >= 0) atomicMin(&worst, r * 16 + f);
  }
  __syncthreads();
  int w = worst;
  if (w != INT_MAX && threadIdx.x == 0)
    epk_fail(b, (w & 15) == EP_CF_REJECTED ? EP_ERR_PEER_INVALID : EP_ERR_MISMATCH, EPK_PH_NOTIFY,
             w / 16, (uint32_t)(w & 15), true);
  __syncthreads();
  return w == INT_MAX;
}

/* Receive side of a dispatch: counts matrix, tokens per rank, rank_prefix, expert counts. */
__device__ void finish_dispatch(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq) {
  const int R = b.nranks, me = b.rank, par = seq & 1, L = a.num_experts / R;
  int32_t *cnt = epk_plan_cnt(a.plan), *ntok = epk_plan_ntok(a.plan, R);
  for (int i = threadIdx.x; i < R * R; i += NT)
    cnt[i] = rd(hello_to_rank(hello_slot(b, me, par, i / R)) + i % R);
  for (int s = threadIdx.x; s < R; s += NT) ntok[s] = rd(&hello_slot(b, me, par, s)->num_tokens);
  for (int l = threadIdx.x; a.recv_per_expert && l < L; l += NT) {
    int64_t n = 0;
    for (int s = 0; s < R; s++) n += rd(hello_to_rank(hello_slot(b, me, par, s)) + R + l);
    if (a.align > 1) n = (n + a.align - 1) / a.align * a.align;
    a.recv_per_expert[l] = (int32_t)n;
  }
}

__device__ void write_prefix(const epk_buf_t &b, const epk_notify_t &a) {
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(a.plan);
  __syncthreads();
  for (int j = threadIdx.x; a.rank_prefix && j < R; j += NT) {
    int32_t run = 0;
    for (int i = 0; i < R; i++) a.rank_prefix[i * R + j] = run += cnt[i * R + j];
  }
  if (threadIdx.x == 0) {
    int32_t nr = 0;
    for (int s = 0; s < R; s++) nr += cnt[s * R + b.rank];
    a.plan[EPK_PLAN_NR] = nr;
    b.host->nr = nr;
  }
}

/* Combine rounds: one round when every rank can stage all of its rows, else token chunks small
 * enough that any rank can stage R chunks' worth. Same inputs on every rank, same answer. */
__device__ void finish_combine(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq) {
  if (threadIdx.x != 0) return;
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(a.plan), *ntok = epk_plan_ntok(a.plan, R);
  int64_t min_cap = INT64_MAX, max_n = 1;
  bool fits = true;
  for (int r = 0; r < R; r++) {
    const epk_hello_t *h = hello_slot(b, b.rank, seq & 1, r);
    int64_t need = 0;
    for (int s = 0; s < R; s++) need += cnt[s * R + r];
    if (need > rd(&h->recv_rows)) {
      epk_fail(b, EP_ERR_TOO_LARGE, EPK_PH_CHECK, r, (uint32_t)need, true);
      return;
    }
    int64_t cap = epk_stage_rows(b.area_bytes - 256ull * (uint64_t)rd(&h->wgap256),
                                 rd(&h->direct) ? 0 : a.xrow, a.wrow);
    fits &= need <= cap;
    min_cap = min(min_cap, cap);
    max_n = max(max_n, (int64_t)ntok[r]);
  }
  int64_t tc = fits ? max_n : min_cap / R;
  if (tc < 1) {
    epk_fail(b, EP_ERR_TOO_LARGE, EPK_PH_CHECK, -1, 0, true);
    return;
  }
  b.priv->comb_tc = (int32_t)min(tc, max_n);
  b.priv->comb_k = (int32_t)((max_n + tc - 1) / tc);
}

__device__ void publish(const epk_buf_t &b, const epk_notify_t &a) {
  __syncthreads();
  if (threadIdx.x == 0 && a.ticket) {
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t *>(&b.host->ticket) = a.ticket;
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(NT, 1) epk_notify_kernel(epk_buf_t b, epk_notify_t a) {
  __shared__ uint32_t s_seq;
  if (threadIdx.x == 0) {
    s_seq = b.priv->seq + 1;
    b.priv->seq = s_seq;
    b.priv->call_status = 0;
    if (b.trace) { /* the previous call's data kernel has ended (stream order): fold it */
      epk_trace_fold(b.trace);
      b.trace->kind = a.kind == EPK_NOTIFY_DISPATCH  ? EPK_TR_FULL
                      : a.kind == EPK_NOTIFY_CACHED  ? EPK_TR_CACHED
                      : a.kind == EPK_NOTIFY_COMBINE ? EPK_TR_COMBINE
                                                     : -1;
      b.trace->at[EPK_TR_N_START] = epk_now();
    }
  }
  __syncthreads();
  const uint32_t seq = s_seq;
  int status = a.kind == EPK_NOTIFY_REJECT ? EPK_HELLO_REJECTED : EPK_HELLO_OK;
  int32_t *cnt_me =
      a.kind == EPK_NOTIFY_DISPATCH ? epk_plan_cnt(a.plan) + b.rank * b.nranks : nullptr;
  if (a.kind == EPK_NOTIFY_DISPATCH) {
    const bool fast = b.nranks <= 32;
    long long bad = fast ? plan_fast(b, a, cnt_me)
                         : epk_first_bad(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
    if (bad != INT64_MAX) {
      status = EPK_HELLO_REJECTED;
      if (threadIdx.x == 0) {
        b.host->bad_value = a.topk_idx[bad];
        epk_fail(b, EP_ERR_OUT_OF_RANGE, EPK_PH_CHECK, -1, (uint32_t)bad, true);
      }
    } else if (!fast) {
      plan_rows(b, a, cnt_me);
    }
  }
  epk_tr_set(b, EPK_TR_N_PLAN);
  post(b, a, seq, status, cnt_me);
  epk_tr_set(b, EPK_TR_N_POST);
  if (status != EPK_HELLO_OK || !gather(b, seq) || !compare(b, seq)) {
    publish(b, a);
    return;
  }
  epk_tr_set(b, EPK_TR_N_GATHER);
  if (a.kind == EPK_NOTIFY_DISPATCH) finish_dispatch(b, a, seq);
  if (a.kind != EPK_NOTIFY_COMBINE)
    write_prefix(b, a);
  else
    finish_combine(b, a, seq);
  publish(b, a);
  epk_tr_set(b, EPK_TR_N_END);
}

}  // namespace

extern "C" cudaError_t epk_launch_notify(const epk_buf_t *b, const epk_notify_t *a,
                                         cudaStream_t s) {
  epk_notify_kernel<<<1, NT, 0, s>>>(*b, *a);
  return cudaGetLastError();
}
