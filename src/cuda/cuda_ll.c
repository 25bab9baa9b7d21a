/* Low-latency mode of the CUDA backend: the region's size, the private device state, result
 * slots, views, host waits and their messages, rejections. The protocol: cuda/kernels/ll_kernels.h;
 * the host side's rules: cuda_ll.h. */
#include "cuda/cuda_ll.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_net.h"

static const char OP[] = "ep_buffer_create";

static bool ll_enabled(const ep_buffer_config_t *cfg) {
  return cfg && cfg->ll_max_tokens > 0 && cfg->ll_hidden > 0 && cfg->ll_num_experts > 0;
}

uint64_t cuda_ll_region_bytes(const ep_buffer_config_t *cfg, int nranks, epk_ll_layout_t *lay) {
  memset(lay, 0, sizeof *lay);
  if (!ll_enabled(cfg) || nranks < 1 || cfg->ll_num_experts % nranks) return 0;
  epk_ll_layout(cfg->ll_max_tokens, cfg->ll_hidden, cfg->ll_num_experts, cfg->ll_max_topk, nranks,
                lay);
  return lay->total;
}

uint64_t cuda_ll_private_bytes(const ep_buffer_config_t *cfg, int nranks) {
  epk_ll_layout_t lay;
  return cuda_ll_region_bytes(cfg, nranks, &lay) ? lay.p_total : 0;
}

/* Dynamic shared memory of the dispatch send kernel: the gate's counts and masks per expert,
 * then the slot of every peer. Too many experts for one block's shared memory is refused here,
 * on every rank alike (same config, same device kind). */
static ep_status_t shared_memory(cuda_state_t *s, cuda_ll_t *ll) {
  size_t need = 4 * (2 * (size_t)ll->k.lay.E + (size_t)s->nranks);
  int most = 0;
  cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, s->device);
  /* The parallel numbering's marks: 16 warps x E words, when they fit (else the serial one). */
  if ((ll->k.opt & EPK_LL_OPT_GATE) && need + 64 * (size_t)ll->k.lay.E + 4096 <= (size_t)most)
    need += 64 * (size_t)ll->k.lay.E;
  else
    ll->k.opt &= ~EPK_LL_OPT_GATE;
  if (need + 4096 > (size_t)most)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "init",
                       "cfg->ll_num_experts: %d experts need %zu bytes of shared memory in one "
                       "block of the low-latency dispatch; this GPU gives %d",
                       ll->k.lay.E, need, most);
  ll->k.smem = (int)need;
  return cuda_check(s, epk_ll_setup(&ll->k), OP, "init");
}

/* The hook stream: the highest priority, so that when the caller's kernels fill the GPU the
 * send's blocks are placed first as SMs free up; non-blocking, so that it never waits for the
 * legacy default stream. */
static ep_status_t hook_stream(cuda_state_t *s, cuda_ll_t *ll) {
  const long how = ep_env_int("EP_CUDA_LL_HOOK_STREAM");
  if (!how) return EP_OK;
  int least = 0, greatest = 0;
  ep_status_t st =
      cuda_check(s, cudaDeviceGetStreamPriorityRange(&least, &greatest), OP, "hook stream");
  if (!st)
    st = cuda_check(
        s,
        cudaStreamCreateWithPriority(&ll->hook, cudaStreamNonBlocking, how == 1 ? greatest : least),
        OP, "hook stream");
  if (!st)
    st = cuda_check(s, cudaEventCreateWithFlags(&ll->fork, cudaEventDisableTiming), OP,
                    "hook stream");
  return st;
}

ep_status_t cuda_ll_send_stream(cuda_state_t *s, cudaStream_t st, bool two_phase, const char *op,
                                cudaStream_t *run) {
  cuda_ll_t *ll = s->ll;
  *run = st;
  if (!two_phase || !ll->hook || cuda_capturing(st)) return EP_OK;
  ep_status_t rc = cuda_check(s, cudaEventRecord(ll->fork, st), op, "hook stream");
  if (!rc) rc = cuda_check(s, cudaStreamWaitEvent(ll->hook, ll->fork, 0), op, "hook stream");
  if (!rc) *run = ll->hook;
  return rc;
}

ep_status_t cuda_ll_create(cuda_state_t *s, const ep_buffer_config_t *cfg) {
  epk_ll_layout_t lay;
  if (!cuda_ll_region_bytes(cfg, s->nranks, &lay)) return EP_OK;
  cuda_ll_t *ll = calloc(1, sizeof *ll);
  if (!ll) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  s->ll = ll;
  ll->k.lay = lay;
  ll->k.lay.off = s->off_ll;
  /* Every SM of this rank's share of its GPU, unless the config or EP_CUDA_SMS says fewer: like
   * DeepEP's low-latency kernels, which take most of a GPU. Blocks that wait for peers are at
   * most this share per rank, so that every rank's waiting blocks fit on the GPU at once. */
  long want = cfg->num_sms > 0 ? cfg->num_sms : ep_env_int("EP_CUDA_SMS");
  ll->k.blocks = want > 0 && want < s->fit_blocks ? (int)want : s->fit_blocks;
  ll->async = ep_env_int("EP_CUDA_LL_ASYNC") != 0;
  ll->k.opt = (int)ep_env_int("EP_CUDA_LL_OPT") & EPK_LL_OPT_ALL;
  ll->k.trace = ep_env_int("EP_CUDA_LL_TRACE") != 0;
  ep_status_t st = hook_stream(s, ll);
  if (st) return st;
  st = cuda_check(s, cudaMalloc(&ll->priv_mem, lay.p_total), OP, "private memory");
  if (!st) st = cuda_check(s, cudaMemset(ll->priv_mem, 0, lay.p_total), OP, "private memory");
  if (st) return st;
  ll->k.priv = ll->priv_mem;
  if (ll->k.trace) {
    epk_ll_trace_t t;
    memset(&t, 0, sizeof t);
    t.at[0] = ~0ull;
    st = cuda_check(
        s, cudaMemcpy((uint8_t *)ll->priv_mem + lay.p_trace, &t, sizeof t, cudaMemcpyHostToDevice),
        OP, "private memory");
    if (st) return st;
  }
  for (int i = 0; i < EPK_LL_SLOTS; i++) {
    cuda_ll_slot_t *sl = &ll->slot[i];
    sl->index = i;
    sl->ll = ll;
    sl->ctrl = s->pool + s->off_ll + lay.ctrl + (uint64_t)i * lay.ctrl_bytes;
    sl->data = s->pool + s->off_ll + lay.data + (uint64_t)i * lay.data_bytes;
  }
  return shared_memory(s, ll);
}

/* EP_CUDA_LL_TRACE=1: the mean time of every phase of every kind of low-latency kernel this
 * buffer ran, in microseconds, on stderr (one line per kind). */
static void print_trace(cuda_state_t *s, cuda_ll_t *ll) {
  static const char *kind[EPK_LL_TR_KINDS] = {
      "dispatch bf16 one phase",   "dispatch bf16 send",      "dispatch fp8 one phase",
      "dispatch fp8 send",         "dispatch receive",        "combine send (push)",
      "combine send (zero copy)",  "combine receive",         "combine one phase (fused)",
      "combine receive, y in buf", "combine fused, y = view", "combine fused, zero copy"};
  static const char *dpt[] = {"number", "post", "peers", "place", "copy", "flags", "recv"};
  static const char *cpt[] = {"check", "push", "flags"};
  static const char *rpt[] = {"await", "reduce", "flags"};
  static const char *fpt[] = {"check", "push", "flags", "await", "reduce", "zdone"};
  epk_ll_trace_t t;
  if (cudaMemcpy(&t, (uint8_t *)ll->priv_mem + ll->k.lay.p_trace, sizeof t,
                 cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  for (int k = 0; k < EPK_LL_TR_KINDS; k++) {
    if (!t.n[k]) continue;
    const bool recv = k == EPK_LL_TR_CRECV || k == EPK_LL_TR_CRECV_BUF;
    const bool fused = k == EPK_LL_TR_C1 || k == EPK_LL_TR_C1_VIEW || k == EPK_LL_TR_C1_ZC;
    const char **pt = k <= EPK_LL_TR_D8_SEND ? dpt
                      : k == EPK_LL_TR_DRECV ? NULL
                      : recv                 ? rpt
                      : fused                ? fpt
                                             : cpt;
    const int np = k <= EPK_LL_TR_D8_SEND ? 7 : k == EPK_LL_TR_DRECV ? 0 : fused ? 6 : 3;
    char line[512];
    int o = snprintf(line, sizeof line,
                     "epcomm ll trace rank %d: %-26s %6llu calls, mean us: "
                     "kernel %.1f",
                     s->rank, kind[k], (unsigned long long)t.n[k],
                     1e-3 * (double)t.sum[k][0] / (double)t.n[k]);
    for (int i = 0; i < np && o > 0 && o < (int)sizeof line; i++)
      o += snprintf(line + o, sizeof line - (size_t)o, ", %s %.1f", pt[i],
                    1e-3 * (double)t.sum[k][i + 1] / (double)t.n[k]);
    fprintf(stderr, "%s\n", line);
  }
}

void cuda_ll_destroy(cuda_state_t *s) {
  cuda_ll_t *ll = s->ll;
  if (!ll) return;
  if (ll->priv_mem && ll->k.trace) print_trace(s, ll);
  if (ll->hook) cudaStreamSynchronize(ll->hook); /* its last send may still read priv */
  if (ll->priv_mem) cudaFree(ll->priv_mem);
  if (ll->fork) cudaEventDestroy(ll->fork);
  if (ll->hook) cudaStreamDestroy(ll->hook);
  free(ll);
  s->ll = NULL;
}

/* ------------------------------------------------------------------ views */

ep_status_t cuda_ll_view(const ep_handle_info_t *h, ep_ll_recv_view_t *v) {
  const cuda_ll_slot_t *sl = h->priv;
  /* A slot's arrays never move: a two-phase caller may learn where its rows will land before
   * they do (DeepEP's return_recv_hook returns the tensors first); contents follow ep_ll_recv. */
  if (sl->state == EP_LLS_FREE || sl->state == EP_LLS_FAILED)
    return ep_err(EP_ERR_INVALID_ARG, "ep_ll_get_recv_view: no view: %s",
                  ep_ll_state_why(sl->state));
  const epk_ll_layout_t *l = &sl->ll->k.lay;
  const bool fp8 = sl->fmt & EPK_LL_FP8;
  uint8_t *slab = sl->data + l->d_slab;
  v->num_local_experts = l->L;
  v->max_rows = l->RT;
  v->hidden = l->H;
  v->num_scales = fp8 ? l->NS : 0;
  v->use_fp8 = fp8, v->round_scale = (sl->fmt & EPK_LL_ROUND) != 0;
  v->use_ue8m0 = (sl->fmt & EPK_LL_UE8M0) != 0;
  v->recv_x = slab;
  v->recv_x_scales = fp8 ? slab + (uint64_t)l->L * l->RT * l->H : NULL;
  v->recv_count = (const int32_t *)(sl->ctrl + l->c_count);
  v->recv_src_info = (const int32_t *)(sl->ctrl + l->c_src);
  v->recv_layout_range = (const int64_t *)(sl->ctrl + l->c_range);
  v->scale_layout = sl->fmt & EPK_LL_COLS ? EP_SCALES_COL_MAJOR : EP_SCALES_ROW_MAJOR;
  return EP_OK;
}

ep_status_t cuda_ll_combine_buffer(const ep_handle_info_t *h, void **y) {
  const cuda_ll_slot_t *sl = h->priv;
  if (sl->state != EP_LLS_RECEIVED)
    return ep_err(EP_ERR_INVALID_ARG,
                  "ep_ll_get_combine_buffer: the handle cannot be combined: "
                  "%s",
                  ep_ll_state_why(sl->state));
  *y = sl->data + sl->ll->k.lay.d_cin;
  return EP_OK;
}

/* ------------------------------------------------------------------ slots */

/* A handle whose combine was not received (or never made) tells the expert ranks that it will
 * not read their combine input; after a received combine its receive kernel already did. */
void cuda_ll_release(void *state, ep_handle_info_t *h) {
  cuda_state_t *s = state;
  cuda_ll_slot_t *sl = h->priv;
  if (!sl) return;
  const int was = sl->state;
  sl->state = EP_LLS_FREE;
  sl->stamp = ++sl->ll->clock;
  if (s->net) { /* across hosts nobody reads this rank's pool: only transfers to settle */
    cuda_net_ll_settle(s, sl);
    return;
  }
  if (was == EP_LLS_COMBINED || was == EP_LLS_SENT) return;
  int prev;
  if (cuda_set_device(s->device, &prev)) return;
  if (s->last_valid) cudaStreamWaitEvent(s->side, s->last, 0);
  if (epk_ll_launch_release(&s->kb, &sl->ll->k, sl->index, s->side) == cudaSuccess &&
      cudaEventRecord(s->last, s->side) == cudaSuccess) {
    s->last_stream = s->side;
    s->last_valid = true;
  }
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
}

/* The rejection takes the call's number on the device, like an accepted call, so that the
 * ranks keep counting alike; the peers' matching call fails at once. */
void cuda_ll_reject(void *state, bool combine) {
  cuda_state_t *s = state;
  if (!s->ll) return;
  if (s->net) {
    cuda_net_ll_reject(s, combine);
    return;
  }
  int prev;
  if (cuda_set_device(s->device, &prev)) return;
  if (s->last_valid) cudaStreamWaitEvent(s->side, s->last, 0);
  if (epk_ll_launch_reject(&s->kb, &s->ll->k, combine, s->side) == cudaSuccess &&
      cudaEventRecord(s->last, s->side) == cudaSuccess) {
    s->last_stream = s->side;
    s->last_valid = true;
  } else {
    ep_ctx_mark_broken(s->ctx); /* the peers wait for a call that never comes */
  }
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
}

ep_status_t cuda_ll_recv(void *state, ep_handle_info_t *h) {
  cuda_state_t *s = state;
  cuda_ll_slot_t *sl = h->priv;
  if (sl->state == EP_LLS_SENT) return cuda_ll_recv_dispatch(s, sl, "ep_ll_recv");
  if (sl->state == EP_LLS_COMB_SENT) return cuda_ll_recv_combine(s, sl, "ep_ll_recv");
  return ep_err(EP_ERR_INVALID_ARG, "ep_ll_recv: the handle has nothing to receive: %s",
                ep_ll_state_why(sl->state));
}

/* ------------------------------------------------------------------ host waits */

bool cuda_ll_eager(cuda_state_t *s, cudaStream_t st, uint32_t *ticket) {
  *ticket = 0;
  if (s->ll->async || cuda_capturing(st)) return false;
  if (!++s->ll->ticket) ++s->ll->ticket; /* 0 means "nobody waits" to the kernels */
  *ticket = s->ll->ticket;
  return true;
}

/* The kernel reports the ticket with its verdict unless it gave up waiting for a peer: a
 * deadline, recorded in the error word (which ends the wait), or the host's abort (after the
 * host gave up itself). An error word that moved no data comes from an earlier call nobody
 * waited for (a replayed graph; a kernel with a ticket never defers its own): it is logged as at
 * a call's entry, and this call's verdict stands (cuda_wait_settled: also one found in place of
 * the breaking word that ended the wait). */
ep_status_t cuda_ll_wait(cuda_state_t *s, const epk_ll_report_t *r, uint32_t ticket, const char *op,
                         bool comb, const char *phase) {
  ep_status_t st = cuda_wait_settled(s, &r->ticket, ticket, op, phase, cuda_deferred);
  if (!st) st = cuda_deferred(s, op);
  if (!st && __atomic_load_n(&r->status, __ATOMIC_ACQUIRE) != EP_OK)
    st = cuda_ll_explain(s, r, op, comb, phase);
  return st;
}

/* The same words as the CPU backend's (cpu_ll_sync.c, cpu_ll_dispatch.c, cpu_ll_combine.c). */
ep_status_t cuda_ll_explain(cuda_state_t *s, const epk_ll_report_t *r, const char *op, bool comb,
                            const char *phase) {
  const int topk = r->topk > 0                    ? r->topk /* a deferred verdict's own call */
                   : s->err_key.f[EP_CF_TOPK] > 0 ? s->err_key.f[EP_CF_TOPK]
                                                  : 1;
  const int t = r->item / topk, k = r->item % topk;
  switch (r->status) {
    case EP_ERR_OUT_OF_RANGE: /* this rank's own argument: no phase, as the CPU says it */
      return ep_call_bad_expert(NULL, op, t, k, r->value, s->ll->k.lay.E); /* the buffer's */
    case EP_ERR_INVALID_ARG:
      return ep_err(EP_ERR_INVALID_ARG,
                    "%s: topk_idx[%d] selects expert %lld twice (slots %d "
                    "and %d); each expert at most once per token",
                    op, t, (long long)r->value, r->dup_k, k);
    case EP_ERR_PEER_INVALID:
      return ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r->peer, op, phase,
                         "rank %d rejected its "
                         "arguments for this %s (see its error)",
                         r->peer, comb ? "combine" : "call");
    case EP_ERR_MISMATCH:
      if (r->item >= 0 && r->peer < 0) /* the combine's check: neither the dispatch's id nor -1 */
        return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, -1, op, phase,
                           "topk_idx[%d][%d] is %lld "
                           "but the dispatch had %lld (a combine may only set slots to -1)",
                           t, k, (long long)r->value, (long long)r->want);
      if (r->field == 0)
        return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r->peer, op, phase,
                           "topk is %d on rank 0 "
                           "and %d on rank %d (must agree on all ranks)",
                           r->mine, r->theirs, r->peer);
      return ep_ctx_fail(s->ctx, EP_ERR_MISMATCH, r->peer, op, phase,
                         "use_fp8/round_scale/use_ue8m0/scale_layout are %d/%d/%d/%d on rank 0 "
                         "and %d/%d/%d/%d on rank %d (must agree on all ranks)",
                         r->mine & 1, (r->mine >> 1) & 1, (r->mine >> 2) & 1, (r->mine >> 3) & 1,
                         r->theirs & 1, (r->theirs >> 1) & 1, (r->theirs >> 2) & 1,
                         (r->theirs >> 3) & 1, r->peer);
    default:
      return ep_ctx_fail(s->ctx, (ep_status_t)r->status, r->peer, op, phase, "a kernel failed");
  }
}
