/* Normal-mode dispatch on the GPU (SEMANTICS.md §3). Two kernels on the caller's stream:
 * notify (count exchange, checks) and dispatch (rows straight to their final place in each
 * destination's receive area). The core describes the call (src/core/call.c); paths:
 *   - synchronous: the host waits for notify through mapped memory, learns the receive count,
 *     sets up outputs (caller's, allocator's, or views), then launches the data kernel;
 *   - worst case (out->worst_case): no host wait, fixed-size outputs; capturable;
 *   - cached: the handle's plan, no count exchange (no host wait when the count is known).
 * Outputs: EP_OUTPUT_VIEWS hands out the receive area itself, valid until the next dispatch on
 * this buffer; otherwise a receiver-side copy fills the caller's (or allocator's) arrays. When
 * the caller's recv_x (EP_OUTPUT_CALLER) lies in one of this rank's registrations of caller
 * memory (ep_register_memory), the hello says where, and the senders write x rows straight
 * there through their mapping of it; only the other arrays are copied out. An allocator's
 * outputs exist only after the hello: unless EP_CUDA_LATE_HELLO=0, and when this rank has
 * registrations at all, its hello
 * promises a late one, which the data kernel posts first (where the allocator's recv_x lies, if
 * in a registration), and the senders wait for it before choosing where x rows go. When every
 * rank copies out into unregistered arrays and every rank's tokens and received rows fit area D
 * at once, the rows are pulled instead (EP_CUDA_PULL, on by default): each source stages its tokens
 * once in its own area D and the receivers copy from there, one pass over the tokens instead of one
 * over the received rows (dispatch.cu). */
#include <stdint.h>
#include <string.h>

#include "cuda/cuda.h"
#include "cuda/cuda_net.h"

static const char OP[] = "ep_dispatch";

typedef struct {
  ep_dispatch_call_t *c;
  const ep_dispatch_args_t *a; /* inputs (c->in) */
  ep_dispatch_out_t *o;        /* outputs (c->out) */
  cuda_plan_t *plan;
  int mode;
  epk_recv_layout_t lay;
  bool reg_ok;   /* outputs are the caller's, copied out: recv_x may be written in place */
  bool in_place; /* the hello asked the senders to write recv_x there */
  bool late;     /* allocator path: the hello promises a late one (post_late in dispatch.cu) */
  bool early;    /* allocator path in two data kernels (EPK_EARLY_*, launch_early) */
  bool pull_ok;  /* this rank may take part in a pulled exchange (epk_hello_t.pull) */
} call_t;

static bool aligned16(const void *p) {
  return ((uintptr_t)p & 15) == 0;
}

/* Host-side checks; every failure here is followed by a reject (peers fail at once too). */
static ep_status_t check(cuda_state_t *s, const call_t *c, cudaStream_t st) {
  const ep_dispatch_args_t *a = c->a;
  if (c->lay.rows < 1)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "one row takes %zu bytes and more; the receive area (%llu bytes) holds "
                       "none: raise queue_bytes",
                       c->c->row_bytes, (unsigned long long)s->kb.area_bytes);
  if (!aligned16(a->x) || !aligned16(c->o->recv_x))
    return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                       "%s must be 16-byte aligned on the CUDA backend",
                       !aligned16(a->x) ? "args->x" : "out->recv_x");
  if (c->c->views && c->o->worst_case && c->o->capacity > c->lay.rows)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "out->capacity %d exceeds the %lld rows the receive area holds (views "
                       "need every row at once): raise queue_bytes",
                       c->o->capacity, (long long)c->lay.rows);
  if (c->c->sync && (!c->c->cached || c->plan->nr < 0) && cuda_capturing(st))
    return ep_ctx_fail(s->ctx, EP_ERR_INVALID_ARG, -1, OP, "arguments",
                       "the call waits on the host for the receive count and cannot be captured "
                       "in a graph: set out->worst_case");
  return EP_OK;
}

/* recv_x inside one of this rank's registrations for all the rows the outputs hold: its slot + 1,
 * byte offset and rows go into the hello (senders write x rows there), else slot + 1 = 0. */
static void fill_reg(const cuda_state_t *s, const call_t *c, epk_notify_t *n) {
  const int64_t cap = c->o->capacity;
  int64_t off = 0;
  if (!c->reg_ok || cap < 0 || cap > INT32_MAX) return;
  const int slot = cuda_reg_find(s, c->o->recv_x, (uint64_t)cap * c->c->row_bytes, &off);
  if (slot < 0) return;
  n->xreg1 = slot + 1;
  n->xcap = (int32_t)cap;
  n->xoff = off;
}

static void fill_notify(const cuda_state_t *s, const call_t *c, epk_notify_t *n) {
  const ep_dispatch_args_t *a = c->a;
  const ep_dispatch_call_t *d = c->c;
  memset(n, 0, sizeof *n);
  n->key = d->key;
  n->kind = d->cached ? EPK_NOTIFY_CACHED : EPK_NOTIFY_DISPATCH;
  n->hidden = a->hidden;
  n->dtype = a->dtype;
  n->topk = d->topk;
  n->num_experts = d->num_experts;
  n->num_scales = a->dtype == EP_DTYPE_FP8_E4M3 ? a->num_scales : 0;
  n->has_w = d->has_w;
  n->num_tokens = a->num_tokens;
  n->topk_idx = a->topk_idx;
  n->plan = c->plan->plan;
  n->rank_prefix = c->o->rank_prefix;
  n->recv_per_expert = d->cached ? NULL : c->o->recv_tokens_per_expert;
  n->align = a->expert_alignment;
  n->out_arrays = !d->views;
  n->no_wait = !d->sync;
  n->late = c->late ? EPK_LATE_PROMISED : EPK_LATE_NONE;
  fill_reg(s, c, n);
}

/* The bytes of x rows a dispatch writes over all ranks (EP_CUDA_L2_HINT), were every rank's
 * routing uniform and its tokens as many as ours: a token reaches R (1 - (1 - 1/R)^topk) ranks. */
static uint64_t rows_written(const cuda_state_t *s, int tokens, int topk, size_t row) {
  double miss = 1.0;
  for (int k = 0; k < topk && k < 64; k++) miss *= 1.0 - 1.0 / s->nranks;
  return (uint64_t)((double)s->nranks * tokens * (double)row * s->nranks * (1.0 - miss));
}

static void fill_data(cuda_state_t *s, const call_t *c, int64_t cap, epk_dispatch_t *k) {
  const ep_dispatch_args_t *a = c->a;
  const ep_dispatch_call_t *d = c->c;
  const ep_dispatch_out_t *o = c->o;
  const bool fp8 = a->dtype == EP_DTYPE_FP8_E4M3;
  *k = (epk_dispatch_t){.cached = d->cached != NULL,
                        .num_tokens = a->num_tokens,
                        .num_scales = fp8 ? a->num_scales : 0,
                        .topk = d->topk,
                        .has_w = d->has_w,
                        .local_experts = d->num_local,
                        .mode = c->mode,
                        .tail = o->worst_case != 0,
                        .quiet = d->sync,
                        .cap = cap,
                        .row = d->row_bytes,
                        .x = a->x,
                        .x_scales = a->x_scales,
                        .scale_tok = a->scale_token_stride,
                        .scale_hid = a->scale_hidden_stride,
                        .topk_idx = a->topk_idx,
                        .topk_weights = a->topk_weights,
                        .plan = c->plan->plan,
                        .hsrc = c->plan->src,
                        .hsrc_cap = c->plan->src_cap,
                        .recv_x = o->recv_x,
                        .recv_scales = o->recv_x_scales,
                        .recv_w = o->recv_topk_weights,
                        .recv_idx = o->recv_topk_idx,
                        .recv_src = o->recv_src_idx,
                        .lay = c->lay};
  k->stream = cuda_l2_stream(s, rows_written(s, a->num_tokens, d->topk, d->row_bytes));
  if (c->mode != EPK_MODE_VIEW) return;
  uint8_t *ad = s->pool + s->kb.off_area_d;
  k->recv_x = ad + c->lay.off_x;
  k->recv_scales = fp8 ? (float *)(ad + c->lay.off_s) : NULL;
  k->recv_idx = d->cached ? NULL : (int64_t *)(ad + c->lay.off_i);
  k->recv_w = d->cached || !d->has_w ? NULL : (float *)(ad + c->lay.off_w);
  k->recv_src = (int32_t *)(ad + c->lay.off_src);
}

/* Views go back to the caller through the output description. */
static void publish_views(const epk_dispatch_t *k, ep_dispatch_out_t *o) {
  o->recv_x = k->recv_x;
  o->recv_x_scales = k->recv_scales;
  o->recv_topk_idx = k->recv_idx;
  o->recv_topk_weights = k->recv_w;
  o->recv_src_idx = k->recv_src;
}

/* The number a host waits for (never 0: 0 means nobody waits; so when `wait` is false), with
 * the count cleared: a count published beside it says the call's exchange went through
 * (wait_count: whose error an error word is). */
static uint32_t arm_wait(cuda_state_t *s, bool wait) {
  if (!wait) return 0;
  __atomic_store_n(&s->host->nr, -1, __ATOMIC_RELEASE);
  __atomic_store_n(&s->host->call_err, 0ull, __ATOMIC_RELEASE);
  return ++s->ticket ? s->ticket : ++s->ticket;
}

/* ticket != 0: notify itself publishes the count (the host launches the data kernel after). */
static ep_status_t launch_notify(cuda_state_t *s, call_t *c, cudaStream_t st, uint32_t ticket) {
  epk_notify_t n;
  fill_notify(s, c, &n);
  n.ticket = ticket;
  s->prev_key = s->err_key;
  s->err_key = c->c->key;
  c->in_place = n.xreg1 != 0;
  n.pull = c->pull_ok && !c->in_place;
  return cuda_check(s, epk_launch_notify(&s->kb, &n, st), OP, "launch");
}

/* An earlier call's error, reported with that call's key (it names its slot or field). */
static ep_status_t earlier(cuda_state_t *s, const char *op) {
  const ep_call_key_t mine = s->err_key;
  s->err_key = s->prev_key;
  ep_status_t rc = cuda_deferred(s, op);
  s->err_key = mine;
  return rc;
}

/* This call's count exchange failed: its own word (published with the ticket) says why, also when
 * an earlier call's failure that moved no data holds the error word (a second such failure cannot
 * replace it there): that one is then logged with its call's key, as cuda_enter would have. */
static ep_status_t own_failure(cuda_state_t *s) {
  const uint64_t own = __atomic_load_n(&s->host->call_err, __ATOMIC_ACQUIRE);
  const uint64_t v = __atomic_load_n(&s->host->err, __ATOMIC_ACQUIRE);
  if (!own || v == own || (v && !epk_code_no_data((uint32_t)(v >> 56))))
    return cuda_take_error(s, OP);
  ep_status_t rc = v ? earlier(s, OP) : EP_OK; /* 0: the other word is not posted yet (a replay) */
  return rc ? rc : cuda_explain_word(s, own, OP);
}

/* The receive count of a synchronous call, once it is published. An error word seen then may be
 * an earlier asynchronous call's (its kernels end before this call's notify starts, but after
 * this call's cuda_enter looked). The count tells: it is published only when this call's count
 * exchange went through (the host set it to -1 before; notify, or the data kernel, writes -1 or
 * nothing when it failed), and then the peers expect this rank's data kernel, so an error
 * beside it is an earlier call's (logged when it moved no data, as cuda_enter does); a failed
 * exchange comes with its own word (own_failure). */
static ep_status_t wait_count(cuda_state_t *s, call_t *c, uint32_t ticket, int *nr) {
  ep_status_t rc = cuda_wait_ticket(s, ticket, OP, earlier);
  if (rc) return rc;
  const bool in = __atomic_load_n(&s->host->ticket, __ATOMIC_ACQUIRE) == ticket;
  const int32_t got = in ? __atomic_load_n(&s->host->nr, __ATOMIC_ACQUIRE) : -1;
  rc = got >= 0 ? earlier(s, OP) : own_failure(s);
  if (!rc && got < 0)
    rc = ep_ctx_fail(s->ctx, EP_ERR_INTERNAL, -1, OP, "notify",
                     "the count exchange ended with neither a count nor an error");
  if (!rc) *nr = c->plan->nr = got;
  return rc;
}

/* The caller's own work while the count is on its way (ep_dispatch_out_t.on_wait), a step at a
 * time and only while the count is not in: the host would spin meanwhile, and at small batches
 * the Python layer's allocations for its next calls fit in that time. Bounded: 64 steps, and
 * none after an error word (the wait below reports it). */
static void while_waiting(const cuda_state_t *s, const call_t *c, uint32_t ticket) {
  const ep_wait_fn step_fn = c->o->on_wait;
  for (int step = 0; step_fn && step < 64; step++) {
    if (__atomic_load_n(&s->host->ticket, __ATOMIC_ACQUIRE) == ticket ||
        __atomic_load_n(&s->host->err, __ATOMIC_ACQUIRE))
      return;
    if (!step_fn(c->o->on_wait_ctx, step)) return;
  }
}

/* The handle's source index for `cap` rows; when the arena cannot hold it the call drains (peers
 * still get our part of the exchange) and launch_data reports it. */
static void alloc_src(call_t *c, int64_t cap) {
  if (!c->plan->src && !cuda_plan_src(c->plan, cap)) c->mode = EPK_MODE_DRAIN;
}

/* The late hello's content: the allocator's recv_x, when all its rows lie in a registration. */
static void fill_late(const cuda_state_t *s, call_t *c, int64_t cap, epk_dispatch_t *k) {
  k->late = 1;
  int64_t off = 0;
  const int slot = c->mode != EPK_MODE_COPY || cap <= 0 || cap > INT32_MAX
                       ? -1
                       : cuda_reg_find(s, c->o->recv_x, (uint64_t)cap * c->c->row_bytes, &off);
  if (slot < 0) return;
  k->lreg1 = slot + 1;
  k->lcap = (int32_t)cap;
  k->loff = off;
  c->in_place = true;
}

/* ticket != 0: the data kernel publishes the count, as soon as the notify before it ended. */
static ep_status_t launch_data(cuda_state_t *s, call_t *c, cudaStream_t st, int64_t cap,
                               uint32_t ticket) {
  if (!c->plan->src) cap = 0;
  epk_dispatch_t k;
  fill_data(s, c, cap, &k);
  k.ticket = ticket;
  if (c->early) k.early = EPK_EARLY_COPY;
  if (c->late) fill_late(s, c, cap, &k);
  ep_status_t rc = cuda_check(s, epk_launch_dispatch(&s->kb, &k, st), OP, "launch");
  if (!rc && c->mode == EPK_MODE_VIEW) publish_views(&k, c->o);
  if (!rc && c->mode == EPK_MODE_DRAIN && !c->plan->src)
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "outputs",
                     "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
  return rc;
}

/* EP_CUDA_EARLY_DATA: the rows move while the host waits for the count and allocates (the GPU
 * would otherwise idle through both; at 128 tokens that is most of a Python layer step's gap).
 * Views into area D, with the handle's source index left to the second kernel, which the host
 * can only size once it knows the count. */
static ep_status_t launch_early(cuda_state_t *s, call_t *c, cudaStream_t st) {
  epk_dispatch_t k;
  c->mode = EPK_MODE_VIEW;
  fill_data(s, c, c->lay.rows, &k);
  k.hsrc = NULL;
  k.hsrc_cap = 0;
  k.early = EPK_EARLY_SEND;
  return cuda_check(s, epk_launch_dispatch(&s->kb, &k, st), OP, "launch");
}

/* Allocator path: the host needs Nr before any output exists, so it waits in between. Not with
 * a late hello, whose senders wait for the outputs anyway. */
static ep_status_t run_alloc(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr) {
  const bool wait = c->plan->nr < 0;
  const uint32_t t = arm_wait(s, wait);
  c->late = s->late_hello && cuda_reg_any(s);
  c->early = s->early_data && !c->late;
  /* Pulled as in run(): the outputs exist only after the count, but the receiver copies out
   * (or drains) either way; not when the senders write in place (late) or move the rows as
   * views before the outputs exist (early). */
  c->pull_ok = s->pull && !c->late && !c->early && c->a->num_tokens <= c->lay.rows;
  ep_status_t rc = launch_notify(s, c, st, t);
  if (!rc && c->early) rc = launch_early(s, c, st);
  *nr = c->plan->nr;
  if (!rc && wait) {
    while_waiting(s, c, t);
    rc = wait_count(s, c, t, nr);
  }
  if (rc) return rc;
  ep_status_t out_rc = ep_call_outputs_ready(s->ctx, c->c, *nr, c->lay.rows);
  if (!out_rc && !aligned16(c->o->recv_x))
    out_rc = ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "outputs",
                         "the alloc callback gave a recv_x that is not 16-byte aligned");
  c->mode = out_rc ? EPK_MODE_DRAIN : EPK_MODE_COPY;
  alloc_src(c, *nr);
  rc = launch_data(s, c, st, *nr, 0);
  return rc ? rc : out_rc;
}

/* Every other path launches both kernels back to back (the GPU never waits for the host); a
 * synchronous call then waits for the count, which it returns. Rows beyond the outputs' capacity
 * are drained by the kernel and reported here. */
static ep_status_t run(cuda_state_t *s, call_t *c, cudaStream_t st, int *nr) {
  if (c->c->sync && c->o->mode == EP_OUTPUT_ALLOC) return run_alloc(s, c, st, nr);
  const int64_t cap = ep_call_out_rows(c->c, c->lay.rows);
  const bool wait = c->c->sync && c->plan->nr < 0;
  const uint32_t t = arm_wait(s, wait);
  c->mode = c->c->views ? EPK_MODE_VIEW : EPK_MODE_COPY;
  if (c->c->sync && c->plan->nr > cap) c->mode = EPK_MODE_DRAIN; /* cached, count known */
  alloc_src(c, cap); /* before the hello: a rank that drains must not have x written in place */
  c->reg_ok = c->mode == EPK_MODE_COPY && c->o->mode == EP_OUTPUT_CALLER;
  /* Pulled rows (EP_CUDA_PULL): the source stages its tokens in its own area D, so they must
   * fit there; the receiver copies out, so it must not be a view or drain (known here). */
  c->pull_ok = s->pull && c->mode == EPK_MODE_COPY && c->a->num_tokens <= c->lay.rows;
  ep_status_t rc = launch_notify(s, c, st, 0);
  if (!rc) rc = launch_data(s, c, st, cap, t);
  *nr = c->c->sync ? c->plan->nr : -1;
  if (!rc && wait) {
    while_waiting(s, c, t);
    rc = wait_count(s, c, t, nr);
  }
  if (!rc && c->c->sync) rc = ep_call_outputs_ready(s->ctx, c->c, *nr, c->lay.rows);
  return rc;
}

ep_status_t cuda_dispatch(void *state, ep_dispatch_call_t *d, ep_handle_info_t *out) {
  cuda_state_t *s = state;
  if (s->net) return cuda_net_dispatch(s, d, out);
  const ep_dispatch_args_t *a = &d->in;
  call_t c = {.c = d, .a = a, .o = &d->out, .plan = d->cached ? d->cached->priv : NULL};
  c.lay = epk_recv_layout(s->kb.area_bytes, d->row_bytes,
                          a->dtype == EP_DTYPE_FP8_E4M3 ? a->num_scales : 0,
                          d->cached ? 0 : d->topk, d->has_w);
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  if (!(rc = check(s, &c, st)) && !d->cached && !(c.plan = cuda_plan_new(s, a->num_tokens)))
    rc = ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "arguments",
                     "the handle arena is full: destroy handles or raise EP_CUDA_ARENA_MB");
  if (rc) {
    cuda_leave(s, st, false);
    cuda_reject(s);
    return rc;
  }
  int nr = -1;
  rc = run(s, &c, st, &nr);
  cuda_leave(s, st, true);
  if (!rc && c.in_place) cuda_path_took(s, CUDA_PATH_DISPATCH_IN_PLACE);
  if (!rc && c.early) cuda_path_took(s, CUDA_PATH_DISPATCH_EARLY);
  if (rc || d->cached) {
    if (!d->cached) cuda_plan_free(c.plan);
    if (!rc) d->out.num_recv_tokens = nr >= 0 ? nr : c.plan->nr;
    return rc;
  }
  d->out.num_recv_tokens = nr;
  *out = ep_call_handle_info(d, nr, c.plan, cuda_plan_free);
  return EP_OK;
}
