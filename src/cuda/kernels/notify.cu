/* The count exchange that opens every call: this rank's plan (rows it sends to each
 * destination, in token order; notify_plan.cuh, spread over the launch's blocks), then in one
 * block its hello into every peer's pool, the wait for every peer's hello, the cross-rank checks,
 * and the receive side (counts matrix, rank_prefix, per-expert counts, combine rounds). A rank
 * that rejected its arguments still posts a hello (status REJECTED) so that its peers fail at
 * once instead of timing out. */
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/notify_plan.cuh"

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

__device__ void fill_header(epk_hello_t *h, const epk_notify_t &a, int status) {
  h->key = a.key;
  h->key.rejected = status == EPK_HELLO_REJECTED;
  h->num_tokens = a.num_tokens;
  h->direct = a.direct;
  h->recv_rows = a.recv_rows;
  h->wgap256 = a.wgap256;
  h->xreg1 = a.xreg1;
  h->xcap = a.xcap;
  h->late = a.late;
  h->pull = a.pull;
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
    for (int i = threadIdx.x; i < a.num_experts; i += NT)
      hello_to_rank(hello_slot(b, i / L, par, me))[R + i % L] = __ldcg(&b.pec[i]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    epk_fence_peers(b);
    for (int d = 0; d < R; d++) epk_st_peer(b, &hello_slot(b, d, par, me)->seq, seq);
  }
  /* The expert counts are zero again for the next call (they were read above). */
  for (int i = threadIdx.x; a.kind == EPK_NOTIFY_DISPATCH && i < a.num_experts; i += NT)
    b.pec[i] = 0;
}

/* Waits for every peer's hello; false when this rank must give up (failure recorded). */
__device__ bool gather(const epk_buf_t &b, uint32_t seq) {
  bool fail = false;
  for (int r = threadIdx.x; r < b.nranks && !fail; r += NT) {
    epk_hello_t *h = hello_slot(b, b.rank, seq & 1, r);
    epk_waiter w;
    w.reset();
    while (epk_ld_peer(b, &h->seq) != seq)
      if (w.tick(b, r, EPK_PH_NOTIFY)) {
        fail = true;
        break;
      }
  }
  return !__syncthreads_or(fail);
}

/* The core's ep_call_key_diff, on the device: the peer's fields loaded at once (one L2 round
 * trip, not one per field), compared with this rank's own key. */
__device__ int first_difference(const ep_call_key_t &m, const epk_hello_t *p) {
  int32_t v[EP_CF_COUNT];
#pragma unroll
  for (int f = 0; f < EP_CF_COUNT; f++) v[f] = rd(&p->key.f[f]);
  if (rd(&p->key.rejected)) return EP_CF_REJECTED;
  for (int f = 0; f < EP_CF_COUNT; f++)
    if (m.f[f] != v[f]) return f;
  return -1;
}

/* Every rank compares with every peer and reports the lowest culprit, so all agree. */
__device__ bool compare(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq) {
  __shared__ int worst;
  if (threadIdx.x == 0) worst = INT_MAX;
  __syncthreads();
  for (int r = threadIdx.x; r < b.nranks; r += NT) {
    if (r == b.rank) continue;
    int f = first_difference(a.key, hello_slot(b, b.rank, seq & 1, r));
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

/* The counts matrix in shared memory for R <= 32, so that the column sums below run at shared
 * memory latency (serial loads through L2 cost ~0.5 us each). */
__shared__ int32_t s_counts[32 * 32];

/* Receive side of a dispatch: counts matrix, tokens per rank, rank_prefix, expert counts. A
 * thread loads all of its entries before it stores any (the stores could alias the loads for
 * the compiler, which then waits one L2 round trip per array). */
__device__ void finish_dispatch(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq) {
  const int R = b.nranks, me = b.rank, par = seq & 1, L = a.num_experts / R;
  int32_t *cnt = epk_plan_cnt(a.plan), *ntok = epk_plan_ntok(a.plan, R);
  const int n_all = max(R * R, a.recv_per_expert ? L : 0);
  for (int i0 = 0; i0 < n_all; i0 += NT) {
    const int i = i0 + (int)threadIdx.x;
    int32_t c = 0, nt = 0;
    int64_t n = 0;
    if (i < R * R) c = rd(hello_to_rank(hello_slot(b, me, par, i / R)) + i % R);
    if (i < R) nt = rd(&hello_slot(b, me, par, i)->num_tokens);
    if (a.recv_per_expert && i < L) {
#pragma unroll 8 /* eight loads in flight, not one L2 round trip per source (R of them) */
      for (int s = 0; s < R; s++) n += rd(hello_to_rank(hello_slot(b, me, par, s)) + R + i);
    }
    if (i < R * R) {
      cnt[i] = c;
      if (R <= 32) s_counts[i] = c;
    }
    if (i < R) ntok[i] = nt;
    if (a.recv_per_expert && i < L) {
      if (a.align > 1) n = (n + a.align - 1) / a.align * a.align;
      a.recv_per_expert[i] = (int32_t)n;
    }
  }
}

/* rank_prefix and the receive count from the counts matrix (in s_counts already when `loaded`). */
__device__ void write_prefix(const epk_buf_t &b, const epk_notify_t &a, bool loaded) {
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(a.plan);
  if (R <= 32 && !loaded)
    for (int i = threadIdx.x; i < R * R; i += NT) s_counts[i] = cnt[i];
  __syncthreads();
  if (R <= 32) cnt = s_counts;
  for (int j = threadIdx.x; a.rank_prefix && j < R; j += NT) {
    int32_t run = 0;
    for (int i = 0; i < R; i++) a.rank_prefix[i * R + j] = run += cnt[i * R + j];
  }
  if (threadIdx.x == 0) {
    int32_t nr = 0;
    for (int s = 0; s < R; s++) nr += cnt[s * R + b.rank];
    a.plan[EPK_PLAN_NR] = nr;
    if (a.ticket) b.host->nr = nr; /* else the data kernel tells a waiting host */
  }
}

/* Combine rounds: one round when every rank can stage all of its rows, else token chunks small
 * enough that any rank can stage R chunks' worth. Same inputs on every rank, same answer. */
__device__ void finish_combine(const epk_buf_t &b, const epk_notify_t &a, uint32_t seq) {
  __shared__ unsigned long long s_over; /* (rank << 32) | rows of the lowest rank over its limit */
  __shared__ long long s_min_cap;
  __shared__ int s_max_n, s_fits;
  const int R = b.nranks;
  const int32_t *cnt = epk_plan_cnt(a.plan), *ntok = epk_plan_ntok(a.plan, R);
  __shared__ int s_direct;
  if (threadIdx.x == 0)
    s_over = ~0ull, s_min_cap = LLONG_MAX, s_max_n = 1, s_fits = 1, s_direct = !a.has_w;
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += NT) { /* one rank per thread (was one thread: ~5 us) */
    const epk_hello_t *h = hello_slot(b, b.rank, seq & 1, r);
    int64_t need = 0;
    for (int s = 0; s < R; s++) need += cnt[s * R + r];
    if (need > rd(&h->recv_rows)) {
      atomicMin(&s_over, ((unsigned long long)r << 32) | (uint32_t)need);
      continue;
    }
    const int direct = rd(&h->direct);
    if (!direct) s_direct = 0;
    int64_t cap = epk_stage_rows(b.area_bytes - 256ull * (uint64_t)rd(&h->wgap256),
                                 direct ? 0 : a.xrow, a.wrow);
    if (need > cap) s_fits = 0;
    atomicMin(&s_min_cap, (long long)cap);
    atomicMax(&s_max_n, ntok[r]);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (s_over != ~0ull) {
    epk_fail(b, EP_ERR_TOO_LARGE, EPK_PH_CHECK, (int)(s_over >> 32), (uint32_t)s_over, true);
    return;
  }
  const int64_t max_n = s_max_n;
  int64_t tc = s_fits ? max_n : s_min_cap / R;
  if (tc < 1) {
    epk_fail(b, EP_ERR_TOO_LARGE, EPK_PH_CHECK, -1, 0, true);
    return;
  }
  b.priv->comb_tc = (int32_t)min(tc, max_n);
  b.priv->comb_k = (int32_t)((max_n + tc - 1) / tc);
  /* Same hellos on every rank, same answer: nothing to stage anywhere, one round. */
  b.priv->comb_hello = s_direct && b.priv->comb_k == 1;
}

/* failed: the count exchange failed here (its own word goes with the ticket: the host preset 0,
 * so a call that went through spends no load on it). */
__device__ void publish(const epk_buf_t &b, const epk_notify_t &a, bool failed) {
  __syncthreads();
  if (threadIdx.x == 0 && a.ticket) { /* the fence orders nr and the error words before it */
    if (failed) epk_call_err_post(b);
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t *>(&b.host->ticket) = a.ticket;
  } /* no fence after: it would only hold the kernel's end (and the data kernel) back ~1-2 us */
}

}  // namespace

/* The kernel's name: ep_kernels.h says why. */
namespace epcomm::normal {
__global__ void __launch_bounds__(NT) notify(EPK_BUF_ARG b, epk_notify_t a) {
  __shared__ uint32_t s_seq;
  if (threadIdx.x == 0) {
    /* Stored back by the block that goes on alone (below). A plan block that starts after that
     * store reads seq + 1, but it can only find every tile taken and never uses seq. Likewise
     * block 0 starting that late would fold this call's first trace points (EP_CUDA_TRACE
     * figures only). */
    s_seq = b.priv->seq + 1;
    if (b.trace && blockIdx.x == 0) { /* the previous call's data kernel has ended: fold it */
      epk_trace_fold(b.trace);
      const bool arr = a.out_arrays != 0;
      b.trace->kind = a.kind == EPK_NOTIFY_DISPATCH  ? (arr         ? EPK_TR_FULL_ARR
                                                        : a.no_wait ? EPK_TR_FULL_NOWAIT
                                                                    : EPK_TR_FULL)
                      : a.kind == EPK_NOTIFY_CACHED  ? (arr ? EPK_TR_CACHED_ARR : EPK_TR_CACHED)
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
  long long bad = INT64_MAX;
  bool stuck = false;
  const bool tiled = a.kind == EPK_NOTIFY_DISPATCH && b.nranks <= 32;
  if (tiled) {
    if (!plan_tiles(b, a, seq, cnt_me, &bad, &stuck)) return; /* another block goes on */
  } else if (a.kind == EPK_NOTIFY_DISPATCH) {
    bad = epk_first_bad(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
    if (bad == INT64_MAX) plan_rows(b, a, cnt_me);
  }
  /* One block from here on (plan_tiles cleared call_status before it read `stuck`). */
  if (threadIdx.x == 0) {
    b.priv->seq = seq;
    if (!tiled) epk_call_reset(b);
  }
  __syncthreads();
  if (stuck) { /* the plan is not usable: nothing moves, the peers are told so */
    status = EPK_HELLO_REJECTED;
    if (threadIdx.x == 0) epk_fail(b, EP_ERR_TIMEOUT, EPK_PH_NOTIFY, -1, 0, true);
  } else if (bad != INT64_MAX) {
    status = EPK_HELLO_REJECTED;
    if (threadIdx.x == 0) {
      b.host->bad_value = a.topk_idx[bad];
      __threadfence_system(); /* the host reads it once it sees the error word */
      epk_fail(b, EP_ERR_OUT_OF_RANGE, EPK_PH_CHECK, -1, (uint32_t)bad, true);
    }
  }
  epk_tr_set(b, EPK_TR_N_PLAN);
  post(b, a, seq, status, cnt_me);
  epk_tr_set(b, EPK_TR_N_POST);
  if (tiled) plan_done_poster(b);
  if (status != EPK_HELLO_OK || !gather(b, seq) || !compare(b, a, seq)) {
    publish(b, a, true);
    return;
  }
  epk_tr_set(b, EPK_TR_N_GATHER);
  epk_grid_trigger(); /* the data kernel may be scheduled; it waits for this grid's end */
  if (a.kind == EPK_NOTIFY_DISPATCH) finish_dispatch(b, a, seq);
  if (a.kind != EPK_NOTIFY_COMBINE)
    write_prefix(b, a, a.kind == EPK_NOTIFY_DISPATCH);
  else
    finish_combine(b, a, seq); /* (a combine: no ticket) */
  publish(b, a, false);
  epk_tr_set(b, EPK_TR_N_END);
}

}  // namespace epcomm::normal

extern "C" cudaError_t epk_launch_notify(const epk_buf_t *b, const epk_notify_t *a,
                                         cudaStream_t s) {
  /* R > 32 plans in one block (plan_rows); so does every other kind of call, which has no plan. */
  const bool tiled = a->kind == EPK_NOTIFY_DISPATCH && b->nranks <= 32;
  const int grid = tiled ? min(epk_plan_tiles(a->num_tokens) + 1, EPK_PLAN_GRID) : 1;
  epk_carveout(epcomm::normal::notify);
  epcomm::normal::notify<<<grid, NT, 0, s>>>(*b, *a);
  return cudaGetLastError();
}
