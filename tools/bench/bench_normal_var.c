/* Normal-mode variants, after the main rows: a cached dispatch (what DeepEP's tuning loop
 * times) with the main output mode, a full and a cached dispatch paired in one loop (and, bf16,
 * the same pair with a combine after each dispatch), where the backend has views a full
 * dispatch in the worst-case form (no host wait for the count) and a full dispatch followed by
 * two cached ones, and one followed by an L2 flush and a cached one, into caller tensors, and
 * into caller tensors registered with the buffer (backends that write registered memory in
 * place: recv_x written by the senders, no copy-out pass); a combine whose input is the bf16
 * dispatch view the experts wrote into (backends with views); a combine whose input is
 * ep_get_combine_buffer's memory, alone and with the experts' write, beside the same write into
 * a separate tensor (backends with a combine buffer); a combine whose input is a separate tensor
 * registered with the buffer (ep_register_memory), alone and with the experts' write (backends
 * that read registered memory in place); where the main dispatch returns views, a full
 * dispatch whose allocator gives plain memory and one whose allocator gives registered memory
 * (with EP_CUDA_LATE_HELLO=1 the senders write its recv_x in place: run the bench with 0 and 1
 * to time the late hello against the copy-out). Each is its own loop; its last outputs must be
 * identical to the main rows' checked ones (digests). */
#include <stdio.h>
#include <stdlib.h>

#include "bench_gpu.h"
#include "bench_normal.h"

typedef struct {
  normal_t *u;
  ep_handle_t h;         /* the handle it runs along */
  ep_output_mode_t mode; /* dispatch: where the rows go */
  void *rx;              /* EP_OUTPUT_CALLER: the caller's tensors */
  float *rs;
  const void *x; /* combine: its input */
  const char *label;
} var_t;

static int call_cached(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_normal_dispatch(v->u, v->h, v->mode, v->rx, v->rs);
}

static int call_combine(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  ep_combine_args_t a = EP_COMBINE_ARGS_INIT;
  a.handle = v->h, a.x = v->x, a.out = v->u->out, a.stream = c->stream;
  TRY(ep_combine(c->buf, &a));
  return 0;
fail:
  return 1;
}

static void differs(bench_ctx_t *c, const char *label, const char *what) {
  char m[BENCH_MSG];
  snprintf(m, sizeof m, "rank %d: %s: %s differ from the main rows' (checked) ones", c->me, label,
           what);
  bench_rank_fail(c->res, 1, m);
}

/* The last iteration's received rows against the main dispatch's. */
static int check_rows(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  uint64_t d;
  if (it != c->o->iters - 1) return 0;
  int rc = bench_normal_digest(v->u, v->u->last.recv_x, v->u->last.recv_x_scales, &d);
  if (!rc && d != v->u->digest_x) differs(c, v->label, "the received rows");
  return bench_agree_check(c, 0, !rc, "a variant's received rows");
}

static int check_out(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  if (it != c->o->iters - 1) return 0;
  uint16_t *out = bench_fetch(c, v->u->out, v->u->N * v->u->H * 2);
  if (out && bench_digest(out, v->u->N * v->u->H * 2, BENCH_DIGEST_SEED) != v->u->digest_out)
    differs(c, v->label, "the combined outputs");
  const int ok = out != NULL;
  free(out);
  return bench_agree_check(c, 0, ok, "a variant's combined outputs");
}

static int cached(normal_t *u, var_t *v, const char *key) {
  bench_step_t s[] = {{call_cached, bench_row(u->c, key, v->label, BENCH_K_DISPATCH), 0},
                      {check_rows, -1, 0}};
  return bench_run(u->c, v, s, 2, v->label);
}

/* The experts write their outputs into the dispatch view, which combine then reads in place. */
static int combine_view(normal_t *u) {
  bench_ctx_t *c = u->c;
  var_t v = {u, NULL, EP_OUTPUT_VIEWS, NULL, NULL, NULL, "epcomm combine, x = view"};
  if (bench_normal_dispatch(u, NULL, EP_OUTPUT_VIEWS, NULL, NULL)) return 1;
  v.h = u->h, u->h = NULL, v.x = u->last.recv_x;
  bench_step_t s[] = {{call_combine, bench_row(c, "combine_view", v.label, BENCH_K_COMBINE), 0},
                      {check_out, -1, 0}};
  int rc = bench_copy(c, u->last.recv_x, u->y, (size_t)u->nr * u->H * 2);
  if (rc) fprintf(stderr, "epcomm bench: %s\n", bench_dev_error());
  if (!rc) rc = bench_run(c, &v, s, 2, v.label);
  ep_handle_destroy(v.h);
  return rc;
}

/* The experts' write (a device copy of their output rows into x), then the combine of x. */
static int call_write_combine(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  if (!bench_copy(c, (void *)v->x, v->u->y, (size_t)v->u->nr * v->u->H * 2))
    return call_combine(c, state, it);
  return fprintf(stderr, "epcomm bench: %s\n", bench_dev_error()), 1;
}

static int write_combine(normal_t *u, var_t *v, const char *key, const char *label,
                         int (*call)(bench_ctx_t *, void *, int)) {
  v->label = label;
  bench_step_t s[] = {{call, bench_row(u->c, key, label, BENCH_K_COMBINE), 0}, {check_out, -1, 0}};
  return bench_run(u->c, v, s, 2, label);
}

/* Memory inside the buffer that the experts write and the peers read in place: the combine
 * alone (written once: nothing else writes the area between these calls), then the experts'
 * write + combine, into the buffer and into a separate tensor. */
static int combine_buffer(normal_t *u, ep_output_mode_t mode) {
  bench_ctx_t *c = u->c;
  size_t bytes = (size_t)(u->nr ? u->nr : 1) * u->H * 2;
  var_t v = {u, NULL, mode, NULL, NULL, NULL, ""};
  if (bench_normal_dispatch(u, NULL, mode, NULL, NULL)) return 1;
  v.h = u->h, u->h = NULL;
  void *cb = NULL, *tensor = NULL;
  int rc = bench_said(ep_get_combine_buffer(c->buf, v.h, &cb), "ep_get_combine_buffer");
  if (!rc && (rc = bench_copy(c, cb, u->y, (size_t)u->nr * u->H * 2)))
    fprintf(stderr, "epcomm bench: %s\n", bench_dev_error());
  v.x = cb;
  if (!rc) rc = write_combine(u, &v, "combine_cbuf", "epcomm combine, x = comb. buf", call_combine);
  if (!rc)
    rc = write_combine(u, &v, "write_combine_cbuf", "epcomm write + combine, comb. buf",
                       call_write_combine);
  v.x = tensor = rc ? NULL : bench_alloc(c, bytes);
  if (!rc)
    rc = !tensor || write_combine(u, &v, "write_combine_tensor",
                                  "epcomm write + combine, x = tensor", call_write_combine);
  bench_free(c, tensor);
  ep_handle_destroy(v.h);
  return rc;
}

/* A separate tensor, registered with the buffer: the peers read it in place. The combine alone
 * (the rows written once), then the experts' write + combine. A registration the backend
 * refuses (alike on every rank) skips the rows with a note. */
static int combine_registered(normal_t *u, ep_output_mode_t mode) {
  bench_ctx_t *c = u->c;
  size_t bytes = (size_t)(u->nr ? u->nr : 1) * u->H * 2;
  var_t v = {u, NULL, mode, NULL, NULL, NULL, ""};
  void *tensor = bench_alloc(c, bytes);
  ep_mem_t mem = NULL;
  if (!tensor) return 1;
  ep_status_t st = ep_register_memory(c->buf, tensor, bytes, &mem);
  if (st) {
    fprintf(stderr, "epcomm bench: no registered-tensor rows: %s\n", ep_last_error());
    bench_free(c, tensor);
    return st == EP_ERR_UNSUPPORTED ? 0 : 1;
  }
  int rc = bench_normal_dispatch(u, NULL, mode, NULL, NULL);
  if (!rc) v.h = u->h, u->h = NULL;
  if (!rc && (rc = bench_copy(c, tensor, u->y, (size_t)u->nr * u->H * 2)))
    fprintf(stderr, "epcomm bench: %s\n", bench_dev_error());
  v.x = tensor;
  if (!rc)
    rc = write_combine(u, &v, "combine_reg", "epcomm combine, x = reg. tensor", call_combine);
  if (!rc)
    rc = write_combine(u, &v, "write_combine_reg", "epcomm write + combine, reg. tensor",
                       call_write_combine);
  ep_handle_destroy(v.h);
  if (bench_said(ep_deregister_memory(c->buf, mem), "ep_deregister_memory")) rc = 1;
  bench_free(c, tensor);
  return rc;
}

/* The cached dispatch into a caller recv_x registered with the buffer (ep_register_memory): the
 * senders write its rows in place. A registration the backend refuses skips the row with a note. */
static int cached_registered(normal_t *u, var_t *v) {
  bench_ctx_t *c = u->c;
  const size_t bytes = (size_t)(u->nr ? u->nr : 1) * u->row;
  ep_mem_t mem = NULL;
  v->mode = EP_OUTPUT_CALLER, v->label = "epcomm dispatch, cached, reg. caller";
  v->rx = bench_alloc(c, bytes);
  v->rs = !u->ns ? NULL : bench_alloc(c, (size_t)(u->nr ? u->nr : 1) * u->ns * 4);
  int rc = !v->rx || (u->ns && !v->rs);
  ep_status_t st = rc ? EP_OK : ep_register_memory(c->buf, v->rx, bytes, &mem);
  if (st) {
    fprintf(stderr, "epcomm bench: no registered caller-tensor row: %s\n", ep_last_error());
    rc = st != EP_ERR_UNSUPPORTED;
  } else if (!rc) {
    rc = cached(u, v, "dispatch_cached_reg");
    if (bench_said(ep_deregister_memory(c->buf, mem), "ep_deregister_memory")) rc = 1;
  }
  bench_free(c, v->rx), bench_free(c, v->rs);
  v->rx = NULL, v->rs = NULL;
  return rc;
}

/* A full dispatch and a cached one along its handle in every iteration, timed apart: full -
 * cached (the count exchange) from calls that see the same state of the GPU. Each in its own
 * loop, at R = 8 under MPS, the two differed by anything from -20 to +230 us from run to run
 * (one loop's calls all slower or faster by up to ~15%, whichever loop it was). */
static int pair_full(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_normal_dispatch(v->u, NULL, v->mode, NULL, NULL);
}

static int pair_cached(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_normal_dispatch(v->u, v->u->h, v->mode, NULL, NULL);
}

static int pair_drop(bench_ctx_t *c, void *state, int it) {
  return bench_normal_drop(((var_t *)state)->u);
}

static int full_cached_pair(normal_t *u, ep_output_mode_t mode) {
  var_t v = {u, NULL, mode, NULL, NULL, NULL, "epcomm dispatch pair, cached"};
  bench_step_t s[] = {
      {pair_full,
       bench_row(u->c, "dispatch_pair_full", "epcomm dispatch pair, full", BENCH_K_DISPATCH), 0},
      {pair_cached, bench_row(u->c, "dispatch_pair_cached", v.label, BENCH_K_DISPATCH), 0},
      {check_rows, -1, 0},
      {pair_drop, -1, 0}};
  return bench_run(u->c, &v, s, 4, "full and cached dispatch, paired");
}

/* A full dispatch and two cached ones along its handle in every iteration: whether a cached
 * call right after a full one pays for a state that full call left (the second then does not)
 * or for the fresh handle itself (both do). */
static int full_cached_triple(normal_t *u, ep_output_mode_t mode) {
  var_t v = {u, NULL, mode, NULL, NULL, NULL, "epcomm dispatch triple, second cached"};
  bench_step_t s[] = {
      {pair_full,
       bench_row(u->c, "dispatch_tri_full", "epcomm dispatch triple, full", BENCH_K_DISPATCH), 0},
      {pair_cached,
       bench_row(u->c, "dispatch_tri_cached1", "epcomm dispatch triple, first cached",
                 BENCH_K_DISPATCH),
       0},
      {pair_cached, bench_row(u->c, "dispatch_tri_cached2", v.label, BENCH_K_DISPATCH), 0},
      {check_rows, -1, 0},
      {pair_drop, -1, 0}};
  return bench_run(u->c, &v, s, 5, "full and two cached dispatches");
}

/* A full dispatch, then (untimed) a device copy of 64 MB, which reads and writes more than the
 * L2 of any GPU this runs on holds, so the full call's lines leave it, the stream's end and a
 * barrier of the ranks (on one GPU the ranks' copies would otherwise run beside the next call),
 * then a cached one along its handle; and the same without the copy. When the cached call is as
 * fast as in its own loop with the copy only, what a full call leaves for the next one
 * (dispatch_tri_cached1) is in the L2. */
#define FLUSH_BYTES (64u << 20)
typedef struct {
  var_t v;       /* first: the dispatch steps take the state as a var_t */
  void *scratch; /* the copy's two halves; NULL: no copy */
} flush_t;

static int flush_l2(bench_ctx_t *c, void *state, int it) {
  uint8_t *s = ((flush_t *)state)->scratch;
  if (s && bgpu_copy(s + FLUSH_BYTES, s, FLUSH_BYTES, c->stream))
    return fprintf(stderr, "epcomm bench: L2 flush copy: %s\n", bgpu_error()), 1;
  if (bench_sync(c)) return fprintf(stderr, "epcomm bench: %s\n", bench_dev_error()), 1;
  if (ep_group_barrier(c->g))
    return fprintf(stderr, "epcomm bench: ep_group_barrier: %s\n", ep_last_error()), 1;
  return 0;
}

static int full_flush_cached(normal_t *u, ep_output_mode_t mode, int copy) {
  const char *key[2][2] = {{"dispatch_sync_full", "dispatch_sync_cached"},
                           {"dispatch_flush_full", "dispatch_flush_cached"}};
  const char *label[2][2] = {
      {"epcomm dispatch, full before barrier", "epcomm dispatch, cached after barrier"},
      {"epcomm dispatch, full before flush", "epcomm dispatch, cached after flush"}};
  flush_t f = {{u, NULL, mode, NULL, NULL, NULL, label[copy][1]}, NULL};
  if (copy && !(f.scratch = bench_alloc(u->c, 2 * (size_t)FLUSH_BYTES)))
    fprintf(stderr, "epcomm bench: out of device memory for the L2 flush\n");
  if (!bench_all_ok(u->c, !copy || f.scratch)) { /* not one rank in the loop alone */
    bench_free(u->c, f.scratch); /* a diagnostic loop: the rows after it still run */
    fprintf(stderr, "epcomm bench: no %s rows: not every rank could prepare them\n", key[copy][0]);
    return 0;
  }
  bench_step_t s[] = {
      {pair_full, bench_row(u->c, key[copy][0], label[copy][0], BENCH_K_DISPATCH), 0},
      {flush_l2, -1, 0},
      {pair_cached, bench_row(u->c, key[copy][1], label[copy][1], BENCH_K_DISPATCH), 0},
      {check_rows, -1, 0},
      {pair_drop, -1, 0}};
  int rc = bench_run(u->c, &f, s, 5,
                     copy ? "full dispatch, L2 flush, cached" : "full dispatch, barrier, cached");
  bench_free(u->c, f.scratch);
  return rc;
}

/* The same pair in a MoE layer's order: each dispatch followed by a combine of its received rows
 * (untimed; a view where the backend has them), so that the two dispatches follow the same kind
 * of call. Above, the cached call follows the full one and pays for what it left behind: on an
 * H100 under MPS at R = 8, ~90 us in bf16 and ~170 in fp8, not for its ids and weights (a build
 * without them pays as much; twenty-eighth session, docs/PERFORMANCE.md). */
static int layer_combine(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  v->h = v->u->h, v->x = v->u->last.recv_x;
  return call_combine(c, state, it);
}

static int full_cached_layer(normal_t *u, ep_output_mode_t mode) {
  var_t v = {u, NULL, mode, NULL, NULL, NULL, "epcomm dispatch + combine pair, cached"};
  bench_step_t s[] = {
      {pair_full,
       bench_row(u->c, "dispatch_lpair_full", "epcomm dispatch + combine pair, full",
                 BENCH_K_DISPATCH),
       0},
      {layer_combine, -1, 0},
      {pair_cached, bench_row(u->c, "dispatch_lpair_cached", v.label, BENCH_K_DISPATCH), 0},
      {layer_combine, -1, 0},
      {check_rows, -1, 0},
      {pair_drop, -1, 0}};
  return bench_run(u->c, &v, s, 6, "full and cached dispatch, each with a combine, paired");
}

/* Full dispatches in the worst-case form (views of nr rows, the routing being fixed): the same
 * kernels with no host wait for the count, so that full - worst case is what that wait costs
 * and worst case - cached what the count exchange costs on the GPU. */
static int worst_case(normal_t *u, ep_output_mode_t mode) {
  var_t v = {u, NULL, mode, NULL, NULL, NULL, "epcomm dispatch, worst case"};
  bench_step_t s[] = {{pair_full, bench_row(u->c, "dispatch_wc", v.label, BENCH_K_DISPATCH), 0},
                      {check_rows, -1, 0},
                      {pair_drop, -1, 0}};
  u->worst_case = 1;
  int rc = bench_run(u->c, &v, s, 3, v.label);
  u->worst_case = 0;
  return rc;
}

/* Full dispatches into the allocator's outputs (bench_normal.c), the handle dropped each time. */
static int full_alloc(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_normal_dispatch(v->u, NULL, EP_OUTPUT_ALLOC, NULL, NULL);
}

static int alloc_rows(normal_t *u, const char *key, const char *label) {
  var_t v = {u, NULL, EP_OUTPUT_ALLOC, NULL, NULL, NULL, label};
  bench_step_t s[] = {{full_alloc, bench_row(u->c, key, label, BENCH_K_DISPATCH), 0},
                      {check_rows, -1, 0},
                      {pair_drop, -1, 0}};
  return bench_run(u->c, &v, s, 3, label);
}

/* The allocator path, where the main rows time views: its outputs plain, then registered. */
static int full_allocator(normal_t *u) {
  bench_ctx_t *c = u->c;
  const uint64_t pulled = bench_info(c).dispatches_pulled;
  int rc = alloc_rows(u, "dispatch_alloc", "epcomm dispatch, allocator");
  if (!rc) bench_path_set(c, &c->res->alloc_pull, pulled, bench_info(c).dispatches_pulled);
  if (rc || !(c->caps & EP_CAP_REGISTER_MEMORY)) return rc;
  if (bench_normal_grow(u, u->nr > 0 ? u->nr : 1)) /* a rank that receives nothing registers too */
    return fprintf(stderr, "epcomm bench: out of memory for the allocator's outputs\n"), 1;
  ep_mem_t mem = NULL;
  ep_status_t st = ep_register_memory(c->buf, u->alloc.x, (size_t)u->alloc.cap * u->row, &mem);
  if (st) {
    fprintf(stderr, "epcomm bench: no registered allocator row: %s\n", ep_last_error());
    return st != EP_ERR_UNSUPPORTED;
  }
  /* The routing is fixed: the count never grows, so the callback never frees registered memory. */
  const uint64_t before = bench_info(c).dispatches_in_place;
  rc = alloc_rows(u, "dispatch_alloc_reg", "epcomm dispatch, allocator, reg.");
  if (!rc) /* a silent fallback to the copy-out would look like "no gain" */
    bench_path_set(c, &c->res->alloc_reg, before, bench_info(c).dispatches_in_place);
  if (bench_said(ep_deregister_memory(c->buf, mem), "ep_deregister_memory")) rc = 1;
  return rc;
}

int bench_normal_variants(normal_t *u) {
  bench_ctx_t *c = u->c;
  ep_output_mode_t main_mode = u->views ? EP_OUTPUT_VIEWS : EP_OUTPUT_ALLOC;
  if (bench_normal_dispatch(u, NULL, main_mode, NULL, NULL)) return 1;
  var_t v = {u, u->h, main_mode, NULL, NULL, NULL, "epcomm dispatch, cached"};
  u->h = NULL;
  int rc = cached(u, &v, "dispatch_cached");
  if (!rc) rc = full_cached_pair(u, main_mode);
  if (!rc && u->views) rc = worst_case(u, main_mode);
  if (!rc && u->views) rc = full_cached_triple(u, main_mode);
  if (!rc && u->views) rc = full_flush_cached(u, main_mode, 0);
  if (!rc && u->views) rc = full_flush_cached(u, main_mode, 1);
  v.mode = EP_OUTPUT_CALLER, v.label = "epcomm dispatch, cached, caller";
  v.rx = rc ? NULL : bench_alloc(c, (size_t)(u->nr ? u->nr : 1) * u->row);
  v.rs = rc || !u->ns ? NULL : bench_alloc(c, (size_t)(u->nr ? u->nr : 1) * u->ns * 4);
  const uint64_t pulled = bench_info(c).dispatches_pulled;
  if (!rc) /* no rank in the loop alone */
    rc = bench_agree(c, v.rx && (!u->ns || v.rs), "its caller tensors for the caller-tensor rows");
  if (!rc) rc = cached(u, &v, "dispatch_cached_caller");
  if (!rc) /* pulled or pushed is the GPU's choice: say which it made */
    bench_path_set(c, &c->res->caller_pull, pulled, bench_info(c).dispatches_pulled);
  bench_free(c, v.rx), bench_free(c, v.rs);
  if (!rc && (c->caps & EP_CAP_REGISTER_MEMORY)) rc = cached_registered(u, &v);
  if (!rc && u->views && c->o->dtype == BENCH_BF16) rc = combine_view(u);
  if (!rc && c->o->dtype == BENCH_BF16) rc = full_cached_layer(u, main_mode);
  if (!rc && (c->caps & EP_CAP_COMBINE_BUFFER)) rc = combine_buffer(u, main_mode);
  if (!rc && (c->caps & EP_CAP_REGISTER_MEMORY)) rc = combine_registered(u, main_mode);
  if (!rc && u->views) rc = full_allocator(u);
  ep_handle_destroy(v.h);
  return rc;
}
