/* Bad input (SEMANTICS.md §8.3-8.4), table-driven: for every public function, each argument
 * that can be wrong gets its specific status, a message that names the argument, and no output
 * byte written (the caller's arrays, and ep_dispatch's out struct: num_recv_tokens, handle and
 * every other field stay as they were). Runs on any number of ranks (every rank makes the same
 * bad call, so each rejects it locally and the peers stay in step); with 2+ ranks it also checks
 * that disagreements across ranks are detected collectively and that a rank's rejection fails
 * its peers' matching call at once (EP_ERR_PEER_INVALID) instead of letting them wait for the
 * deadline. */
#include <limits.h>

#include "common.h"

enum { N = 6, H = 64, K = 2, CAP = 64 };

typedef struct {
  int R, me, E;
  ep_group_t g;
  ep_buffer_t b;
  uint16_t x[N * H];
  float scales[N * 4];
  int64_t idx[N * K];
  float w[N * K];
  /* outputs, poisoned before every call */
  uint16_t rx[CAP * H], out[N * H];
  float rs[CAP * 4], rw[CAP * K], ow[N * K];
  int64_t ri[CAP * K];
  int32_t src[CAP], prefix[64], per_expert[64], pr[64], pe[256];
  uint8_t in_rank[N * 64];
  ep_dispatch_out_t o, o0; /* ep_dispatch's out struct, and its bytes before the call */
  ep_handle_t good_handle, dead_handle;
  bool views; /* the backend has EP_OUTPUT_VIEWS */
} fx_t;

#define NR_POISON (-12345)
#define H_POISON ((ep_handle_t)(uintptr_t)0x5a5a)

/* The out struct of a valid call into the caller's arrays; results poisoned. */
static ep_dispatch_out_t good_out(fx_t *f) {
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.capacity = CAP;
  o.recv_x = f->rx, o.recv_topk_idx = f->ri, o.recv_topk_weights = f->rw;
  o.recv_src_idx = f->src, o.rank_prefix = f->prefix, o.recv_tokens_per_expert = f->per_expert;
  o.num_recv_tokens = NR_POISON, o.handle = H_POISON;
  return o;
}

static void poison(fx_t *f) {
  memset(f->rx, T_POISON, sizeof f->rx), memset(f->out, T_POISON, sizeof f->out);
  memset(f->rs, T_POISON, sizeof f->rs), memset(f->rw, T_POISON, sizeof f->rw);
  memset(f->ow, T_POISON, sizeof f->ow), memset(f->ri, T_POISON, sizeof f->ri);
  memset(f->src, T_POISON, sizeof f->src), memset(f->prefix, T_POISON, sizeof f->prefix);
  memset(f->per_expert, T_POISON, sizeof f->per_expert), memset(f->pr, T_POISON, sizeof f->pr);
  memset(f->pe, T_POISON, sizeof f->pe), memset(f->in_rank, T_POISON, sizeof f->in_rank);
  f->o = good_out(f);
  memcpy(&f->o0, &f->o, sizeof f->o);
}

/* ep_dispatch into f->o, remembering its bytes first (check_untouched compares). */
static ep_status_t dispatch(fx_t *f, const ep_dispatch_args_t *a) {
  memcpy(&f->o0, &f->o, sizeof f->o);
  return ep_dispatch(f->b, a, &f->o);
}

static bool all_poison(const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != T_POISON) return false;
  return true;
}

static void check_untouched(const fx_t *f, const char *what) {
  T_CHECK(all_poison(f->rx, sizeof f->rx) && all_poison(f->out, sizeof f->out) &&
              all_poison(f->rs, sizeof f->rs) && all_poison(f->rw, sizeof f->rw) &&
              all_poison(f->ow, sizeof f->ow) && all_poison(f->ri, sizeof f->ri) &&
              all_poison(f->src, sizeof f->src) && all_poison(f->prefix, sizeof f->prefix) &&
              all_poison(f->per_expert, sizeof f->per_expert) && all_poison(f->pr, sizeof f->pr) &&
              all_poison(f->pe, sizeof f->pe) && all_poison(f->in_rank, sizeof f->in_rank),
          "%s: an output was written by a failing call", what);
  T_CHECK(f->o.num_recv_tokens == f->o0.num_recv_tokens,
          "%s: out->num_recv_tokens was written by a failing call", what);
  T_CHECK(f->o.handle == f->o0.handle, "%s: out->handle was written by a failing call", what);
  T_CHECK(!memcmp(&f->o, &f->o0, sizeof f->o), "%s: the out struct was written by a failing call",
          what);
}

static ep_dispatch_args_t good_dispatch(fx_t *f) {
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = f->x, a.dtype = EP_DTYPE_BF16, a.num_tokens = N, a.hidden = H;
  a.topk_idx = f->idx, a.topk_weights = f->w, a.topk = K, a.num_experts = f->E;
  return a;
}

/* ------------------------------------------------------------------ the table */

typedef void (*mutate_fn)(fx_t *f, ep_dispatch_args_t *a, ep_dispatch_out_t *o);
typedef struct {
  const char *name;
  mutate_fn mutate;
  ep_status_t want;
  const char *names; /* the message must contain this argument name */
} dcase_t;

static int alloc_never(void *ctx, const ep_dispatch_args_t *a, int n, ep_dispatch_out_t *o) {
  (void)ctx, (void)a, (void)n, (void)o;
  T_FAILF("the alloc callback was called by a call with bad arguments");
}

#define M(name) static void name(fx_t *f, ep_dispatch_args_t *a, ep_dispatch_out_t *o)
M(m_size) {
  (void)f, (void)o, a->size = 3;
}
M(m_out_size) {
  (void)f, (void)a, o->size = sizeof *o + 8;
}
M(m_dtype) {
  (void)f, (void)o, a->dtype = (ep_dtype_t)9;
}
M(m_ntok) {
  (void)f, (void)o, a->num_tokens = -1;
}
M(m_hidden0) {
  (void)f, (void)o, a->hidden = 0;
}
M(m_hidden7) {
  (void)f, (void)o, a->hidden = 7;
} /* 14-byte rows */
M(m_hidden_fp8) {
  a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 24, a->x_scales = f->scales, o->recv_x_scales = f->rs;
}
M(m_x) {
  (void)f, (void)o, a->x = NULL;
}
M(m_topk0) {
  (void)f, (void)o, a->topk = 0;
}
M(m_topk_big) {
  (void)f, (void)o, a->topk = 1000;
}
M(m_idx) {
  (void)f, (void)o, a->topk_idx = NULL;
}
M(m_e0) {
  (void)f, (void)o, a->num_experts = 0;
}
M(m_e_div) {
  (void)o, a->num_experts = f->E + 1;
}
M(m_e_big) {
  (void)o, a->num_experts = f->R * 5000;
}
M(m_id_high) {
  (void)a, (void)o, f->idx[3 * K + 1] = f->E;
}
M(m_id_low) {
  (void)a, (void)o, f->idx[2 * K] = -2;
}
M(m_scales) {
  a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 128, a->num_tokens = 2, o->recv_x_scales = f->rs;
}
M(m_rscales) {
  (void)o, a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 128, a->num_tokens = 2,
           a->x_scales = f->scales;
}
M(m_bf16_scales) {
  (void)o, a->x_scales = f->scales;
}
M(m_bf16_rscales) {
  (void)a, o->recv_x_scales = f->rs;
}
M(m_nscales) {
  a->dtype = EP_DTYPE_FP8_E4M3, a->x_scales = f->scales, o->recv_x_scales = f->rs,
  a->num_scales = -1;
}
M(m_recv_x) {
  (void)f, (void)a, o->recv_x = NULL;
}
M(m_mode0) {
  (void)f, (void)a, o->mode = (ep_output_mode_t)0;
}
M(m_mode_big) {
  (void)f, (void)a, o->mode = (ep_output_mode_t)7;
}
M(m_mode_neg) {
  (void)f, (void)a, o->mode = (ep_output_mode_t)-1;
}
M(m_views) {
  (void)f, (void)a, o->mode = EP_OUTPUT_VIEWS;
}
M(m_alloc_null) {
  (void)f, (void)a, o->mode = EP_OUTPUT_ALLOC, o->alloc = NULL;
}
M(m_alloc_worst) {
  (void)f, (void)a, o->mode = EP_OUTPUT_ALLOC, o->alloc = alloc_never, o->worst_case = 1;
}
M(m_worst_cap0) {
  (void)f, (void)a, o->worst_case = 1, o->capacity = 0;
}
M(m_worst_neg) {
  (void)f, (void)a, o->worst_case = 1, o->capacity = -1;
}
M(m_cap_neg) {
  (void)f, (void)a, o->capacity = -1;
}
M(m_align) {
  (void)f, (void)o, a->expert_alignment = -3;
}
M(m_rw) {
  (void)f, (void)o, a->topk_weights = NULL;
}
M(m_cached_dead) {
  (void)o, a->cached = f->dead_handle;
}
M(m_cached_shape) {
  (void)o, a->cached = f->good_handle, a->hidden = 2 * H;
}
M(m_bad_handle_id) {
  (void)f, (void)o, a->cached = (ep_handle_t)(uintptr_t)0x77;
}
#undef M

static const dcase_t dcases[] = {
    {"args->size", m_size, EP_ERR_CONFIG, "args: size"},
    {"out->size", m_out_size, EP_ERR_CONFIG, "out: size"},
    {"dtype", m_dtype, EP_ERR_INVALID_ARG, "dtype"},
    {"num_tokens < 0", m_ntok, EP_ERR_OUT_OF_RANGE, "num_tokens"},
    {"hidden 0", m_hidden0, EP_ERR_OUT_OF_RANGE, "hidden"},
    {"hidden: 14-byte rows", m_hidden7, EP_ERR_SHAPE, "hidden"},
    {"hidden: 24-byte fp8 rows", m_hidden_fp8, EP_ERR_SHAPE, "hidden"},
    {"x NULL", m_x, EP_ERR_NULL_ARG, "x"},
    {"topk 0", m_topk0, EP_ERR_OUT_OF_RANGE, "topk"},
    {"topk 1000", m_topk_big, EP_ERR_OUT_OF_RANGE, "topk"},
    {"topk_idx NULL", m_idx, EP_ERR_NULL_ARG, "topk_idx"},
    {"num_experts 0", m_e0, EP_ERR_OUT_OF_RANGE, "num_experts"},
    {"num_experts % R", m_e_div, EP_ERR_SHAPE, "num_experts"},
    {"num_experts too many per rank", m_e_big, EP_ERR_TOO_LARGE, "num_experts"},
    {"expert id = E", m_id_high, EP_ERR_OUT_OF_RANGE, "topk_idx[3][1]"},
    {"expert id -2", m_id_low, EP_ERR_OUT_OF_RANGE, "topk_idx[2][0]"},
    {"fp8 without x_scales", m_scales, EP_ERR_NULL_ARG, "x_scales"},
    {"fp8 without recv_x_scales", m_rscales, EP_ERR_NULL_ARG, "out->recv_x_scales"},
    {"bf16 with x_scales", m_bf16_scales, EP_ERR_INVALID_ARG, "x_scales"},
    {"bf16 with recv_x_scales", m_bf16_rscales, EP_ERR_INVALID_ARG, "out->recv_x_scales"},
    {"num_scales -1", m_nscales, EP_ERR_OUT_OF_RANGE, "num_scales"},
    {"recv_x NULL", m_recv_x, EP_ERR_NULL_ARG, "out->recv_x"},
    {"out->mode unset", m_mode0, EP_ERR_INVALID_ARG, "out->mode"},
    {"out->mode 7", m_mode_big, EP_ERR_INVALID_ARG, "out->mode"},
    {"out->mode -1", m_mode_neg, EP_ERR_INVALID_ARG, "out->mode"},
    {"views on a backend without them", m_views, EP_ERR_UNSUPPORTED, "out->mode"},
    {"alloc mode without alloc", m_alloc_null, EP_ERR_NULL_ARG, "out->alloc"},
    {"alloc mode with worst_case", m_alloc_worst, EP_ERR_INVALID_ARG, "out->worst_case"},
    {"worst_case with capacity 0", m_worst_cap0, EP_ERR_OUT_OF_RANGE, "out->capacity"},
    {"worst_case with capacity < 0", m_worst_neg, EP_ERR_OUT_OF_RANGE, "out->capacity"},
    {"capacity < 0", m_cap_neg, EP_ERR_OUT_OF_RANGE, "out->capacity"},
    {"expert_alignment < 0", m_align, EP_ERR_OUT_OF_RANGE, "expert_alignment"},
    {"recv weights without weights", m_rw, EP_ERR_INVALID_ARG, "out->recv_topk_weights"},
    {"cached: destroyed handle", m_cached_dead, EP_ERR_DESTROYED, "args->cached"},
    {"cached: hidden differs", m_cached_shape, EP_ERR_MISMATCH, "hidden"},
    {"cached: not a handle", m_bad_handle_id, EP_ERR_INVALID_ARG, "args->cached"},
};

static void expect(fx_t *f, ep_status_t got, ep_status_t want, const char *arg, const char *what) {
  T_CHECK(got == want, "%s: got %s, expected %s (%s)", what, ep_status_name(got),
          ep_status_name(want), ep_last_error());
  T_CHECK(strstr(ep_last_error(), arg), "%s: message does not name '%s': %s", what, arg,
          ep_last_error());
  check_untouched(f, what);
}

static void reset_inputs(fx_t *f) {
  for (int i = 0; i < N * H; i++) f->x[i] = (uint16_t)(0x3f80 + i % 7);
  for (int i = 0; i < N * K; i++) f->idx[i] = (i * 3 + f->me) % f->E, f->w[i] = 0.5f;
  for (int i = 0; i < N * 4; i++) f->scales[i] = 1.0f;
}

/* A valid dispatch + combine still works: the failures left the buffer consistent. */
static void still_works(fx_t *f, const char *after) {
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  ep_status_t st = dispatch(f, &a);
  T_CHECK(st == EP_OK, "after '%s', a valid dispatch fails: %s: %s", after, ep_status_name(st),
          ep_last_error());
  T_CHECK(f->o.handle && f->o.handle != H_POISON && f->o.num_recv_tokens >= 0,
          "after '%s': a valid dispatch returned handle %p, %d rows", after, (void *)f->o.handle,
          f->o.num_recv_tokens);
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  c.handle = f->o.handle, c.x = f->rx, c.out = f->out;
  T_OK(ep_combine(f->b, &c));
  T_OK(ep_handle_destroy(f->o.handle));
}

/* ep_dispatch_out_t grew after API 0.2 (on_wait at its end): the 0.2 size still works, a size it
 * never had is refused (on every rank alike: nothing collective starts). */
static void out_sizes(fx_t *f) {
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  f->o.size = offsetof(ep_dispatch_out_t, on_wait);
  t_case = "dispatch: out of the API 0.2 size";
  T_OK(dispatch(f, &a));
  T_CHECK(f->o.handle && f->o.handle != H_POISON && f->o.num_recv_tokens >= 0,
          "%s: handle %p, %d rows", t_case, (void *)f->o.handle, f->o.num_recv_tokens);
  T_OK(ep_handle_destroy(f->o.handle));
  reset_inputs(f);
  poison(f);
  f->o.size = offsetof(ep_dispatch_out_t, on_wait_ctx);
  t_case = "dispatch: out of a size between";
  expect(f, dispatch(f, &a), EP_ERR_CONFIG, "out: size", t_case);
}

static void dispatch_table(fx_t *f) {
  for (size_t i = 0; i < sizeof dcases / sizeof dcases[0]; i++) {
    t_case = dcases[i].name;
    if (dcases[i].mutate == m_e_div && f->R == 1) continue; /* every E divides by 1 */
    if (dcases[i].mutate == m_views && f->views) continue;  /* views are valid there */
    reset_inputs(f);
    poison(f);
    ep_dispatch_args_t a = good_dispatch(f);
    dcases[i].mutate(f, &a, &f->o);
    expect(f, dispatch(f, &a), dcases[i].want, dcases[i].names, dcases[i].name);
  }
  t_case = "ep_dispatch(NULL args)";
  poison(f);
  expect(f, dispatch(f, NULL), EP_ERR_NULL_ARG, "args is NULL", t_case);
  t_case = "ep_dispatch(NULL out)";
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  expect(f, ep_dispatch(f->b, &a, NULL), EP_ERR_NULL_ARG, "out is NULL", t_case);
  still_works(f, "the dispatch table");
}

/* A cached dispatch returns no handle (out->handle = NULL, written on success) and leaves the
 * cached one alive. */
static void cached_case(fx_t *f) {
  t_case = "cached dispatch: no handle returned";
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  a.cached = f->good_handle;
  T_OK(dispatch(f, &a));
  T_CHECK(f->o.handle == NULL, "a cached dispatch returned handle %p", (void *)f->o.handle);
  int nr = -1;
  T_OK(ep_handle_num_recv_tokens(f->good_handle, &nr));
  T_CHECK(f->o.num_recv_tokens == nr, "cached dispatch: %d rows, the handle says %d",
          f->o.num_recv_tokens, nr);
}

/* EP_OUTPUT_ALLOC callbacks: one that fails, one that gives no recv_x for its rows, and one
 * that works (it sees the call's args and the row count, and its arrays come back in out). */
typedef struct {
  fx_t *f;
  int how; /* 0: fail, 1: leave recv_x NULL, 2: give f's arrays */
  int calls, rows, hidden;
} alloc_ctx_t;

static int alloc_cb(void *ctx, const ep_dispatch_args_t *a, int n, ep_dispatch_out_t *o) {
  alloc_ctx_t *c = ctx;
  c->calls++, c->rows = n, c->hidden = a->hidden;
  o->recv_topk_idx = c->f->ri, o->recv_src_idx = c->f->src; /* must not reach the caller... */
  if (c->how == 0) return -1;
  if (c->how == 1) return 0; /* ...unless the call succeeds */
  o->recv_x = c->f->rx, o->recv_topk_weights = c->f->rw;
  return 0;
}

/* Outputs too small, or an allocator that fails, are found only after the count exchange:
 * drained, nothing written. */
static void capacity_cases(fx_t *f) {
  t_case = "capacity too small";
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  f->o.capacity = 1;
  for (int i = 0; i < N * K; i++) f->idx[i] = f->me * (f->E / f->R); /* all to this rank */
  expect(f, dispatch(f, &a), EP_ERR_TOO_LARGE, "out->capacity", t_case);
  t_case = "worst-case capacity too small";
  poison(f);
  f->o.worst_case = 1, f->o.capacity = 1;
  expect(f, dispatch(f, &a), EP_ERR_TOO_LARGE, "out->capacity", t_case);
  for (int how = 0; how < 2; how++) { /* every rank receives N > 0 rows */
    t_case = how ? "alloc leaves recv_x NULL" : "alloc fails";
    poison(f);
    alloc_ctx_t ac = {f, how, 0, 0, 0};
    ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
    o.mode = EP_OUTPUT_ALLOC, o.alloc = alloc_cb, o.alloc_ctx = &ac;
    o.rank_prefix = f->prefix, o.recv_tokens_per_expert = f->per_expert;
    o.num_recv_tokens = NR_POISON, o.handle = H_POISON;
    f->o = o;
    /* A failing callback is out of memory; one that says "done" without recv_x is a bug of the
     * callback, named as the missing pointer. */
    expect(f, dispatch(f, &a), how ? EP_ERR_NULL_ARG : EP_ERR_NO_MEMORY,
           how ? "out->recv_x" : "alloc", t_case);
    T_CHECK(ac.calls == 1 && ac.rows == N, "%s: the callback was called %d times, for %d rows",
            t_case, ac.calls, ac.rows);
  }
  t_case = "alloc gives the arrays";
  poison(f);
  alloc_ctx_t ac = {f, 2, 0, 0, 0};
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_ALLOC, o.alloc = alloc_cb, o.alloc_ctx = &ac;
  T_OK(ep_dispatch(f->b, &a, &o));
  T_CHECK(ac.calls == 1 && ac.rows == N && ac.hidden == H && o.num_recv_tokens == N,
          "alloc: %d calls, %d rows, hidden %d; %d rows received", ac.calls, ac.rows, ac.hidden,
          o.num_recv_tokens);
  T_CHECK(o.recv_x == f->rx && o.recv_topk_idx == f->ri && o.recv_topk_weights == f->rw &&
              o.recv_src_idx == f->src && o.recv_x_scales == NULL,
          "alloc: the callback's arrays did not come back in out");
  T_CHECK(!all_poison(f->rx, (size_t)N * H * 2), "alloc: no row was written to recv_x");
  T_OK(ep_handle_destroy(o.handle));
  still_works(f, "too-small outputs");
}

static void layout_table(fx_t *f) {
  struct {
    const char *name;
    size_t size;
    const int64_t *idx;
    int n, topk, E;
    ep_status_t want;
    const char *arg;
  } c[] = {
      {"layout: args->size", 4, f->idx, N, K, f->E, EP_ERR_CONFIG, "args: size"},
      {"layout: topk_idx NULL", 0, NULL, N, K, f->E, EP_ERR_NULL_ARG, "topk_idx"},
      {"layout: num_tokens -1", 0, f->idx, -1, K, f->E, EP_ERR_OUT_OF_RANGE, "num_tokens"},
      {"layout: topk 0", 0, f->idx, N, 0, f->E, EP_ERR_OUT_OF_RANGE, "topk"},
      {"layout: E % R", 0, f->idx, N, K, f->E + 1, EP_ERR_SHAPE, "num_experts"},
      {"layout: id >= E", 0, f->idx, N, K, 1 * f->R, EP_ERR_OUT_OF_RANGE, "topk_idx["},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    t_case = c[i].name;
    if (c[i].want == EP_ERR_SHAPE && f->R == 1) continue; /* every E divides by 1 */
    reset_inputs(f);
    poison(f);
    ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
    if (c[i].size) l.size = c[i].size;
    l.topk_idx = c[i].idx, l.num_tokens = c[i].n, l.topk = c[i].topk, l.num_experts = c[i].E;
    l.tokens_per_rank = f->pr, l.tokens_per_expert = f->pe, l.is_token_in_rank = f->in_rank;
    expect(f, ep_get_dispatch_layout(f->b, &l), c[i].want, c[i].arg, c[i].name);
  }
  t_case = "layout: args NULL";
  poison(f);
  expect(f, ep_get_dispatch_layout(f->b, NULL), EP_ERR_NULL_ARG, "args is NULL", t_case);
  /* The struct grew after API 0.2 (host outputs at its end): the 0.2 size still works, a size
   * it never had does not. */
  reset_inputs(f);
  ep_layout_args_t l = EP_LAYOUT_ARGS_INIT;
  l.topk_idx = f->idx, l.num_tokens = N, l.topk = K, l.num_experts = f->E;
  l.tokens_per_rank = f->pr, l.tokens_per_expert = f->pe, l.is_token_in_rank = f->in_rank;
  l.size = offsetof(ep_layout_args_t, tokens_per_host);
  t_case = "layout: API 0.2 size";
  T_OK(ep_get_dispatch_layout(f->b, &l));
  l.size = offsetof(ep_layout_args_t, is_token_in_host);
  t_case = "layout: a size between";
  poison(f);
  expect(f, ep_get_dispatch_layout(f->b, &l), EP_ERR_CONFIG, "args: size", t_case);
}

static void combine_table(fx_t *f) {
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  T_OK(dispatch(f, &a));
  ep_handle_t h = f->o.handle;
  int nr = f->o.num_recv_tokens;
  struct {
    const char *name;
    ep_combine_args_t c;
    ep_status_t want;
    const char *arg;
  } c[] = {
      {"combine: size",
       {.size = 1, .handle = h, .x = f->rx, .out = f->out},
       EP_ERR_CONFIG,
       "args: size"},
      {"combine: handle NULL",
       {.size = sizeof(ep_combine_args_t), .x = f->rx, .out = f->out},
       EP_ERR_NULL_ARG,
       "args->handle"},
      {"combine: not a handle",
       {.size = sizeof(ep_combine_args_t),
        .handle = (ep_handle_t)(uintptr_t)0x77,
        .x = f->rx,
        .out = f->out},
       EP_ERR_INVALID_ARG,
       "args->handle"},
      {"combine: destroyed handle",
       {.size = sizeof(ep_combine_args_t), .handle = f->dead_handle, .x = f->rx, .out = f->out},
       EP_ERR_DESTROYED,
       "args->handle"},
      {"combine: x NULL",
       {.size = sizeof(ep_combine_args_t), .handle = h, .out = f->out},
       EP_ERR_NULL_ARG,
       "x"},
      {"combine: out NULL",
       {.size = sizeof(ep_combine_args_t), .handle = h, .x = f->rx},
       EP_ERR_NULL_ARG,
       "out"},
      {"combine: weights without out",
       {.size = sizeof(ep_combine_args_t),
        .handle = h,
        .x = f->rx,
        .out = f->out,
        .topk_weights = f->rw},
       EP_ERR_NULL_ARG,
       "out_topk_weights"},
      {"combine: out weights without weights",
       {.size = sizeof(ep_combine_args_t),
        .handle = h,
        .x = f->rx,
        .out = f->out,
        .out_topk_weights = f->ow},
       EP_ERR_INVALID_ARG,
       "out_topk_weights"},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    t_case = c[i].name;
    bool needs_x = c[i].c.x != NULL; /* the NULL-x case needs rows to exist */
    (void)needs_x;
    memset(f->out, T_POISON, sizeof f->out), memset(f->ow, T_POISON, sizeof f->ow);
    ep_status_t st = ep_combine(f->b, &c[i].c);
    if (!strcmp(c[i].name, "combine: x NULL") && nr == 0) continue; /* nothing to read */
    T_CHECK(st == c[i].want, "%s: got %s, expected %s (%s)", c[i].name, ep_status_name(st),
            ep_status_name(c[i].want), ep_last_error());
    T_CHECK(strstr(ep_last_error(), c[i].arg), "%s: message does not name %s: %s", c[i].name,
            c[i].arg, ep_last_error());
    T_CHECK(all_poison(f->out, sizeof f->out) && all_poison(f->ow, sizeof f->ow),
            "%s: out written by a failing call", c[i].name);
  }
  t_case = "combine: args NULL";
  T_STATUS(EP_ERR_NULL_ARG, ep_combine(f->b, NULL));
  T_CHECK(strstr(ep_last_error(), "args is NULL"), "message: %s", ep_last_error());
  /* ep_get_combine_buffer: arguments named; the memory only on backends that have it. */
  t_case = "ep_get_combine_buffer";
  void *cb = NULL;
  T_STATUS(EP_ERR_NULL_ARG, ep_get_combine_buffer(f->b, h, NULL));
  T_STATUS(EP_ERR_NULL_ARG, ep_get_combine_buffer(NULL, h, &cb));
  T_STATUS(EP_ERR_DESTROYED, ep_get_combine_buffer(f->b, f->dead_handle, &cb));
  T_CHECK(cb == NULL, "a failing ep_get_combine_buffer wrote x");
  ep_buffer_info_t bi = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(f->b, &bi));
  ep_status_t cst = ep_get_combine_buffer(f->b, h, &cb);
  if (bi.caps & EP_CAP_COMBINE_BUFFER)
    T_CHECK((cst == EP_OK && cb) || cst == EP_ERR_TOO_LARGE, "ep_get_combine_buffer: %s (%s)",
            ep_status_name(cst), ep_last_error());
  else
    T_CHECK(cst == EP_ERR_UNSUPPORTED && cb == NULL && strstr(ep_last_error(), "backend"),
            "ep_get_combine_buffer without the capability: %s (%s)", ep_status_name(cst),
            ep_last_error());
  T_OK(ep_handle_destroy(h));
  still_works(f, "the combine table");
}

static void object_table(fx_t *f) {
  int v;
  size_t bytes;
  ep_group_t g2;
  ep_buffer_t b2;
  t_case = "objects";
  T_STATUS(EP_ERR_NULL_ARG, ep_group_rank(f->g, NULL));
  T_STATUS(EP_ERR_NULL_ARG, ep_group_nranks(f->g, NULL));
  T_STATUS(EP_ERR_NULL_ARG, ep_group_rank(NULL, &v));
  T_STATUS(EP_ERR_NULL_ARG, ep_group_create_from_env(NULL, NULL));
  ep_group_config_t gc = EP_GROUP_CONFIG_INIT;
  gc.magic = 1;
  T_STATUS(EP_ERR_CONFIG, ep_group_create_from_env(&gc, &g2));
  T_CHECK(strstr(ep_last_error(), "magic"), "no 'magic' in: %s", ep_last_error());
  T_STATUS(EP_ERR_NULL_ARG, ep_group_create(NULL, NULL, &g2));
  ep_bootstrap_t bs = {0, 1, NULL, NULL, NULL};
  T_STATUS(EP_ERR_NULL_ARG, ep_group_create(&bs, NULL, &g2));
  T_CHECK(strstr(ep_last_error(), "allgather"), "no 'allgather' in: %s", ep_last_error());
  T_STATUS(EP_ERR_NULL_ARG, ep_group_allgather(f->g, NULL, &v, 4));
  T_STATUS(EP_ERR_OUT_OF_RANGE, ep_group_allgather(f->g, &v, &v, 0));
  T_STATUS(EP_ERR_NULL_ARG, ep_buffer_create(f->g, NULL, NULL));
  ep_buffer_config_t bc = EP_BUFFER_CONFIG_INIT;
  bc.num_channels = 65;
  T_STATUS(EP_ERR_OUT_OF_RANGE, ep_buffer_create(f->g, &bc, &b2));
  T_CHECK(strstr(ep_last_error(), "num_channels"), "no 'num_channels': %s", ep_last_error());
  bc = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
  bc.queue_bytes = 100;
  T_STATUS(EP_ERR_OUT_OF_RANGE, ep_buffer_create(f->g, &bc, &b2));
  T_CHECK(strstr(ep_last_error(), "queue_bytes"), "no 'queue_bytes': %s", ep_last_error());
  bc = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
  bc.backend = (ep_backend_t)42;
  T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_create(f->g, &bc, &b2));
  bc = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
  bc.size = 8;
  T_STATUS(EP_ERR_CONFIG, ep_buffer_size_hint(&bc, 2, &bytes));
  T_STATUS(EP_ERR_NULL_ARG, ep_buffer_size_hint(NULL, 2, NULL));
  T_STATUS(EP_ERR_OUT_OF_RANGE, ep_buffer_size_hint(NULL, 0, &bytes));
  T_STATUS(EP_ERR_NULL_ARG, ep_handle_num_recv_tokens(f->good_handle, NULL));
  T_STATUS(EP_ERR_DESTROYED, ep_handle_num_recv_tokens(f->dead_handle, &v));
  T_STATUS(EP_ERR_DESTROYED, ep_handle_destroy(f->dead_handle));
  T_CHECK(strstr(ep_last_error(), "handle"), "no 'handle' in: %s", ep_last_error());
  /* ep_buffer_query: info required, info->size checked, nothing written on failure. */
  T_STATUS(EP_ERR_NULL_ARG, ep_buffer_query(f->b, NULL));
  T_CHECK(strstr(ep_last_error(), "info"), "no 'info' in: %s", ep_last_error());
  const size_t bad_sizes[] = {0, 4, 12, sizeof(ep_buffer_info_t) + 8};
  for (size_t i = 0; i < sizeof bad_sizes / sizeof *bad_sizes; i++) {
    ep_buffer_info_t info, before;
    memset(&info, T_POISON, sizeof info);
    info.size = bad_sizes[i];
    memcpy(&before, &info, sizeof info);
    T_STATUS(EP_ERR_CONFIG, ep_buffer_query(f->b, &info));
    T_CHECK(strstr(ep_last_error(), "info->size"), "no 'info->size' in: %s", ep_last_error());
    T_CHECK(!memcmp(&info, &before, sizeof info), "a failing ep_buffer_query wrote info");
  }
  ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
  T_STATUS(EP_ERR_NULL_ARG, ep_buffer_query(NULL, &info));
  T_OK(ep_buffer_query(f->b, &info));
  T_CHECK(info.backend != EP_BACKEND_AUTO && info.rank == f->me && info.nranks == f->R &&
              info.config.size == sizeof info.config && info.config.magic == EP_CONFIG_MAGIC &&
              info.bytes > 0,
          "ep_buffer_query: backend %d, rank %d of %d, %zu bytes", (int)info.backend, info.rank,
          info.nranks, info.bytes);
  T_CHECK(!(info.caps & EP_CAP_LOW_LATENCY) && info.ll_view_lifetime == EP_LIFETIME_NONE,
          "ep_buffer_query: a buffer without low-latency sizes reports low-latency mode");
  T_CHECK(!(info.caps & EP_CAP_DISPATCH_VIEWS) == (info.dispatch_view_lifetime == EP_LIFETIME_NONE),
          "ep_buffer_query: views cap %u but lifetime %d", info.caps & EP_CAP_DISPATCH_VIEWS,
          (int)info.dispatch_view_lifetime);
  T_CHECK(strcmp(ep_status_name(EP_ERR_TIMEOUT), "EP_ERR_TIMEOUT") == 0, "status table");
  T_CHECK(strcmp(ep_status_name((ep_status_t)999), "EP_ERR_UNKNOWN") == 0, "unknown status");
}

static int count_of(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
  return n;
}

/* Smaller defects an adversarial review found: each named, none silently wrong. */
static void review_cases(fx_t *f) {
  t_case = "num_tokens INT_MAX";
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  a.num_tokens = INT_MAX;
  expect(f, dispatch(f, &a), EP_ERR_TOO_LARGE, "num_tokens", t_case);
  ep_layout_args_t l = {
      .size = sizeof l, .topk_idx = f->idx, .num_tokens = INT_MAX, .topk = K, .num_experts = f->E};
  T_STATUS(EP_ERR_TOO_LARGE, ep_get_dispatch_layout(f->b, &l));
  T_CHECK(strstr(ep_last_error(), "num_tokens"), "no 'num_tokens' in: %s", ep_last_error());
  /* A group's id where a buffer is expected, live and destroyed: named as a group. */
  t_case = "group id as a buffer";
  ep_group_t g2;
  T_OK(ep_group_create_from_env(NULL, &g2));
  T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_destroy((ep_buffer_t)g2));
  T_CHECK(strstr(ep_last_error(), "group"), "live group as a buffer: %s", ep_last_error());
  T_OK(ep_group_destroy(g2));
  T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_destroy((ep_buffer_t)g2));
  T_CHECK(strstr(ep_last_error(), "destroyed group"), "destroyed group as a buffer: %s",
          ep_last_error());
  /* Low-latency sizes no host could back: refused at creation on every rank, with the sizes. */
  t_case = "low-latency sizes beyond the host";
  ep_buffer_config_t bc = EP_BUFFER_CONFIG_INIT;
  bc.backend = EP_BACKEND_CPU;
  bc.ll_max_tokens = 4096, bc.ll_hidden = 7168 * 8, bc.ll_num_experts = 64 * f->R;
  ep_buffer_t b2 = NULL;
  T_STATUS(EP_ERR_TOO_LARGE, ep_buffer_create(f->g, &bc, &b2));
  T_CHECK(!b2 && strstr(ep_last_error(), "GiB") && strstr(ep_last_error(), "memory"),
          "oversized low-latency buffer: %s", ep_last_error());
  /* A failure inside a backend's create says the call's name once. */
  t_case = "backend create failure";
  if (!ep_backend_available(EP_BACKEND_CUDA)) {
    bc = (ep_buffer_config_t)EP_BUFFER_CONFIG_INIT;
    bc.backend = EP_BACKEND_CUDA;
    ep_status_t st = ep_buffer_create(f->g, &bc, &b2);
    T_CHECK(st == EP_ERR_UNSUPPORTED || st == EP_ERR_CUDA, "cuda buffer without a GPU: %s",
            ep_status_name(st));
    T_CHECK(count_of(ep_last_error(), "ep_buffer_create") <= 1, "prefix said twice: %s",
            ep_last_error());
  }
}

/* 2+ ranks: rank 1 disagrees (hidden, dtype, topk), or rejects its own call; everyone fails the
 * same call, nobody waits for the deadline, and the buffer remains usable. */
static void collective_cases(fx_t *f) {
  if (f->R < 2) return;
  struct {
    const char *name;
    int hidden, topk;
    ep_dtype_t dtype;
    bool reject;
  } c[] = {{"ranks disagree: hidden", 2 * H, K, EP_DTYPE_BF16, false},
           {"ranks disagree: topk", H, 1, EP_DTYPE_BF16, false},
           {"ranks disagree: dtype", H, K, EP_DTYPE_FP8_E4M3, false},
           {"one rank rejects its call", H, K, EP_DTYPE_BF16, true}};
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    t_case = c[i].name;
    reset_inputs(f);
    poison(f);
    ep_dispatch_args_t a = good_dispatch(f);
    if (f->me == 1) {
      a.hidden = c[i].hidden, a.topk = c[i].topk, a.dtype = c[i].dtype;
      if (a.dtype == EP_DTYPE_FP8_E4M3)
        a.x_scales = f->scales, f->o.recv_x_scales = f->rs, a.num_scales = 1;
      if (c[i].reject) a.x = NULL;
    }
    ep_status_t st = dispatch(f, &a), want = EP_ERR_MISMATCH;
    if (c[i].reject) want = f->me == 1 ? EP_ERR_NULL_ARG : EP_ERR_PEER_INVALID;
    T_CHECK(st == want, "%s: got %s, expected %s (%s)", c[i].name, ep_status_name(st),
            ep_status_name(want), ep_last_error());
    T_CHECK(want != EP_ERR_PEER_INVALID || strstr(ep_last_error(), "rank 1"),
            "%s: message does not name rank 1: %s", c[i].name, ep_last_error());
    if (f->me != 1) check_untouched(f, c[i].name);
  }
  still_works(f, "the cross-rank cases");
}

int main(void) {
  fx_t *f = calloc(1, sizeof *f);
  t_init(&f->g, &f->me, &f->R);
  f->E = 4 * f->R;
  T_OK(ep_buffer_create(f->g, NULL, &f->b));
  ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
  T_OK(ep_buffer_query(f->b, &info));
  f->views = (info.caps & EP_CAP_DISPATCH_VIEWS) != 0;
  /* A handle that is then destroyed, for the cached-dispatch cases. */
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  T_OK(dispatch(f, &a));
  f->good_handle = f->o.handle;
  T_OK(dispatch(f, &a));
  f->dead_handle = f->o.handle;
  T_OK(ep_handle_destroy(f->dead_handle));
  object_table(f);
  dispatch_table(f);
  out_sizes(f);
  cached_case(f);
  T_OK(ep_handle_destroy(f->good_handle));
  capacity_cases(f);
  layout_table(f);
  combine_table(f);
  collective_cases(f);
  review_cases(f);
  t_case = NULL;
  T_OK(ep_buffer_destroy(f->b));
  t_fini(f->g);
  if (f->me == 0)
    printf("test_badargs: R=%d: all bad-argument cases rejected as specified\n", f->R);
  free(f);
  return T_PASS;
}
