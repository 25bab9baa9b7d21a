/* Normal-mode combine on the GPU (SEMANTICS.md §4): a hello kernel (checks, rounds), then the
 * combine kernel; both on the caller's stream, no host synchronisation. When x lies in this rank's
 * receive area (for instance the bf16 dispatch view, overwritten in place by the expert), is the
 * combine buffer, or lies in memory this rank registered (ep_register_memory), peers read it
 * where it is; otherwise it is copied into the combine buffer first (EP_CUDA_COMBINE_COPY, when it
 * fits), or the kernel stages it in the combine area. */
#include <stdint.h>
#include <string.h>

#include "cuda/cuda.h"
#include "cuda/cuda_net.h"

static const char OP[] = "ep_combine";

static bool aligned16(const void *p) {
  return ((uintptr_t)p & 15) == 0;
}

/* Byte offset of x in the pool when all its rows lie in area D, else -1. */
static int64_t direct_offset(const cuda_state_t *s, const void *x, int64_t rows, uint64_t row) {
  const uint8_t *lo = s->pool + s->kb.off_area_d, *hi = lo + s->kb.area_bytes, *p = x;
  if (!x || p < lo || p >= hi || !aligned16(x)) return -1;
  if ((uint64_t)(hi - p) < (uint64_t)rows * row) return -1;
  return (int64_t)(p - s->pool);
}

/* ep_get_combine_buffer: the start of area C, when it holds the handle's rows (and, after them,
 * the weights of at least one row per rank). A combine whose x is that pointer reads it in place
 * (direct, like a view in area D) and stages only weights, after the rows. */
static uint64_t c_rows_bytes(const ep_handle_info_t *h) {
  return epk_al((uint64_t)h->recv_rows * (uint64_t)h->hidden * 2, 256);
}

static bool fits_area_c(const cuda_state_t *s, const ep_handle_info_t *h, uint64_t wrow) {
  const uint64_t need = c_rows_bytes(h);
  return need + 512 + (uint64_t)s->nranks * wrow <= s->kb.area_bytes;
}

ep_status_t cuda_combine_buffer(void *state, const ep_handle_info_t *h, void **x) {
  cuda_state_t *s = state;
  if (s->net) return cuda_net_combine_buffer(s, h, x);
  const uint64_t wrow = 4 * (uint64_t)(h->topk > 0 ? h->topk : 0);
  if (!fits_area_c(s, h, wrow))
    return ep_err(EP_ERR_TOO_LARGE,
                  "ep_get_combine_buffer: %d rows of %d bytes (%llu with room "
                  "for weights) do not fit the combine area of %llu bytes: raise queue_bytes",
                  h->recv_rows, h->hidden * 2,
                  (unsigned long long)(c_rows_bytes(h) + 512 + (uint64_t)s->nranks * wrow),
                  (unsigned long long)s->kb.area_bytes);
  *x = s->pool + s->kb.off_area_c;
  return EP_OK;
}

/* EP_CUDA_COMBINE_COPY: the bytes of x to copy into the combine buffer (its rows: the count,
 * which the host knows after a synchronous dispatch; 0 after a worst-case one, whose x holds
 * only the rows that arrived, and the host does not know how many), when no peer can read x
 * where it lies, it fits the combine buffer (rows and weights) and does not overlap it; else 0. */
static size_t copy_bytes(const cuda_state_t *s, const void *x, const ep_handle_info_t *h,
                         bool has_w) {
  const cuda_plan_t *p = h->priv;
  const uint8_t *c = s->pool + s->kb.off_area_c, *q = x;
  const size_t bytes =
      p->nr > 0 && p->nr <= h->recv_rows ? (size_t)p->nr * (size_t)h->hidden * 2 : 0;
  const bool ok = s->combine_copy && bytes && fits_area_c(s, h, has_w ? 4ull * h->topk : 0) &&
                  (q + bytes <= c || q >= c + s->kb.area_bytes);
  return ok ? bytes : 0;
}

/* x into the combine buffer, by cudaMemcpyAsync on the call's stream, before the hello: the
 * peers read it there as if the experts had written it (the speed of a view), and the copy runs
 * at the memory's rate, where the kernel's staging pass ran on the rank's SMs. Stream order
 * keeps it after this rank's previous combine, whose kernel returned only once every peer had
 * read its area C, and the hello after it keeps the peers' reads after the copy. false: the copy
 * could not be queued (the kernel stages x instead); its error is cleared, so that the next
 * launch does not report it as its own. */
static bool copy_in(cuda_state_t *s, const void *x, size_t bytes, cudaStream_t st) {
  if (cudaMemcpyAsync(s->pool + s->kb.off_area_c, x, bytes, cudaMemcpyDefault, st) == cudaSuccess)
    return true;
  (void)cudaGetLastError();
  return false;
}

static ep_status_t check(cuda_state_t *s, const ep_combine_args_t *a, const ep_handle_info_t *h,
                         bool has_w) {
  const void *ptrs[] = {a->x, a->out, a->bias[0], a->bias[1]};
  static const char *names[] = {"x", "out", "bias[0]", "bias[1]"};
  for (int i = 0; i < 4; i++)
    if (!aligned16(ptrs[i]))
      return ep_ctx_fail(s->ctx, EP_ERR_SHAPE, -1, OP, "arguments",
                         "%s must be 16-byte aligned on the CUDA backend", names[i]);
  uint64_t row = (uint64_t)h->hidden * 2, wrow = has_w ? (uint64_t)h->topk * 4 : 0;
  if (a->x == s->pool + s->kb.off_area_c) {
    if (!fits_area_c(s, h, wrow))
      return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                         "x is the combine buffer, but this handle's %d rows do not fit it "
                         "(ep_get_combine_buffer refuses this handle)",
                         h->recv_rows);
    return EP_OK;
  }
  int64_t rows = epk_stage_rows(s->kb.area_bytes, row, wrow);
  if (rows < s->nranks)
    return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, -1, OP, "arguments",
                       "the combine area (%llu bytes) holds %lld rows of %llu bytes, fewer than "
                       "the %d ranks: raise queue_bytes",
                       (unsigned long long)s->kb.area_bytes, (long long)rows,
                       (unsigned long long)(row + wrow), s->nranks);
  return EP_OK;
}

ep_status_t cuda_combine(void *state, const ep_combine_args_t *a, const ep_handle_info_t *h) {
  cuda_state_t *s = state;
  if (s->net) return cuda_net_combine(s, a, h);
  const cuda_plan_t *p = h->priv;
  const bool has_w = a->topk_weights != NULL;
  cudaStream_t st;
  ep_status_t rc = cuda_enter(s, a->stream, OP, &st);
  if (rc) return rc;
  if ((rc = check(s, a, h, has_w))) {
    cuda_leave(s, st, false);
    cuda_reject(s);
    return rc;
  }
  const uint64_t row = (uint64_t)h->hidden * 2;
  bool in_c = a->x == s->pool + s->kb.off_area_c;
  int64_t xoff = in_c ? (int64_t)s->kb.off_area_c : direct_offset(s, a->x, h->recv_rows, row);
  const int x_reg = xoff >= 0 ? -1 : cuda_reg_find(s, a->x, (uint64_t)h->recv_rows * row, &xoff);
  const size_t cbytes = xoff < 0 ? copy_bytes(s, a->x, h, has_w) : 0;
  const bool copied = cbytes > 0 && copy_in(s, a->x, cbytes, st);
  if (copied) in_c = true, xoff = (int64_t)s->kb.off_area_c;
  const int wgap256 = in_c ? (int)(c_rows_bytes(h) / 256) : 0;
  epk_notify_t n;
  memset(&n, 0, sizeof n);
  ep_call_combine_key(a, h, &n.key);
  s->err_key = n.key;
  n.kind = EPK_NOTIFY_COMBINE;
  n.hidden = h->hidden;
  n.topk = h->topk;
  n.has_w = has_w;
  n.num_tokens = h->num_tokens;
  n.direct = xoff >= 0;
  n.xreg1 = n.direct ? x_reg + 1 : 0; /* where the peers find x when they read it in place */
  n.xoff = n.direct ? xoff : 0;
  n.wgap256 = wgap256;
  n.recv_rows = h->recv_rows;
  n.plan = p->plan;
  n.xrow = row;
  n.wrow = has_w ? (uint64_t)h->topk * 4 : 0;
  epk_combine_t k = {.num_tokens = h->num_tokens,
                     .hidden = h->hidden,
                     .topk = h->topk,
                     .has_w = has_w,
                     .direct = xoff >= 0,
                     .wgap256 = wgap256,
                     .x_off = xoff,
                     .x_rows = h->recv_rows,
                     .x = a->x,
                     .w = a->topk_weights,
                     .bias0 = a->bias[0],
                     .bias1 = a->bias[1],
                     .out = a->out,
                     .out_w = a->out_topk_weights,
                     .plan = p->plan,
                     .hsrc = p->src,
                     .hsrc_cap = p->src_cap,
                     .x_reg = x_reg,
                     /* our rows read over all ranks, about R x ours (EP_CUDA_L2_HINT) */
                     .stream = cuda_l2_stream(s, (uint64_t)s->nranks * h->recv_rows * row)};
  rc = cuda_check(s, epk_launch_notify(&s->kb, &n, st), OP, "launch");
  if (!rc) rc = cuda_check(s, epk_launch_combine(&s->kb, &k, st), OP, "launch");
  if (!rc && k.direct)
    cuda_path_took(s, copied ? CUDA_PATH_COMBINE_COPIED : CUDA_PATH_COMBINE_IN_PLACE);
  cuda_leave(s, st, true);
  return rc;
}
