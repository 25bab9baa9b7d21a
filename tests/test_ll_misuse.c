/* Low-latency misuse and failure paths, for whatever number of ranks `epcomm launch -n R` gives:
 *   - bad arguments on one rank: that rank gets the specific error naming the argument, the
 *     others' matching call fails at once with EP_ERR_PEER_INVALID, nothing is written (a live
 *     result stays bit-exact with the reference) and the buffer stays usable;
 *   - ranks that disagree (topk, fp8 flags): EP_ERR_MISMATCH everywhere;
 *   - a third live handle: EP_ERR_BUSY (on one rank or on all), results untouched;
 *   - calls in the wrong state (view or combine before the receive, two combines, a receive with
 *     nothing pending), a disabled low-latency mode, bad low-latency configs, a view after the
 *     buffer is gone;
 *   - the two kinds of handle kept apart: a low-latency handle cast to ep_handle_t (or a normal
 *     one cast to ep_ll_handle_t) is refused by every call of the other kind, destroy included,
 *     with EP_ERR_INVALID_ARG, and survives it. */
#include "ll_world.h"

static const llw_cfg_t cfg = {8, 256, 48, 8};
static const llw_case_t base = {.topk = 4, .routing = RT_UNIFORM, .nmode = NM_FULL, .fmt = F_BF16};

typedef struct {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  llw_round_t keep; /* a received result that every failed call must leave alone */
} ctx_t;

static uint64_t seed_no = 0x5eedll;

static void new_round(ctx_t *x, llw_round_t *rd, const llw_case_t *k) {
  llw_gen(rd, x->R, x->me, &cfg, k ? k : &base, seed_no++);
}

/* ------------------------------------------------------------------ one rank's bad arguments */

enum {
  B_TOO_MANY,
  B_ID_HIGH,
  B_ID_LOW,
  B_DUP,
  B_UE8M0,
  B_ROUND,
  B_TOPK,
  B_HANDLE,
  B_X,
  B_SIZE,
  B_ARGS,
  B_LAYOUT,
  B_PACKED,
  B_COUNT
};
static const struct {
  ep_status_t st;
  const char *needle;
} bad_want[] = {
    {EP_ERR_TOO_LARGE, "num_tokens"},
    {EP_ERR_OUT_OF_RANGE, "topk_idx[0][0]"},
    {EP_ERR_OUT_OF_RANGE, "topk_idx[0][1]"},
    {EP_ERR_INVALID_ARG, "twice"},
    {EP_ERR_INVALID_ARG, "round_scale"},
    {EP_ERR_INVALID_ARG, "use_fp8"},
    {EP_ERR_TOO_LARGE, "topk"},
    {EP_ERR_NULL_ARG, "handle"},
    {EP_ERR_NULL_ARG, "x is NULL"},
    {EP_ERR_CONFIG, "args: size"},
    {EP_ERR_NULL_ARG, "args is NULL"},
    {EP_ERR_INVALID_ARG, "scale_layout"},
    {EP_ERR_SHAPE, "multiple of 512"},
};

/* Spoils the expert ids (host copy; the caller uploads them). */
static void spoil_ids(int64_t *idx, int kind) {
  switch (kind) {
    case B_ID_HIGH:
      idx[0] = cfg.E;
      break;
    case B_ID_LOW:
      idx[1] = -2;
      break;
    case B_DUP:
      idx[1] = idx[0];
      break;
    default:
      break;
  }
}

/* Spoils the call's arguments (args, or the handle out-parameter). */
static void spoil(const ep_ll_dispatch_args_t **ap, ep_ll_dispatch_args_t *a, ep_ll_handle_t **hp,
                  int kind) {
  switch (kind) {
    case B_TOO_MANY:
      a->num_tokens = cfg.T + 1;
      break;
    case B_ID_HIGH:
    case B_ID_LOW:
    case B_DUP:
      break;
    case B_UE8M0:
      a->use_fp8 = 1, a->use_ue8m0 = 1;
      break;
    case B_ROUND:
      a->round_scale = 1;
      break;
    case B_TOPK:
      a->topk = cfg.K + 1;
      break;
    case B_HANDLE:
      *hp = NULL;
      break;
    case B_X:
      a->x = NULL;
      break;
    case B_SIZE:
      a->size = 12;
      break;
    case B_LAYOUT:
      a->scale_layout = 2;
      break;
    case B_PACKED: /* column-major exponent bytes pack four blocks: H = 256 has two */
      a->use_fp8 = a->round_scale = a->use_ue8m0 = 1, a->scale_layout = EP_SCALES_COL_MAJOR;
      break;
    default:
      *ap = NULL;
      break;
  }
}

static void bad_dispatch(ctx_t *x, int kind) {
  static char desc[64];
  snprintf(desc, sizeof desc, "bad dispatch argument %d", kind);
  t_case = desc;
  llw_round_t rd;
  new_round(x, &rd, NULL);
  int culprit = kind % x->R;
  if (x->me == culprit) {
    spoil_ids(rd.idx[x->me], kind);
    llw_upload(&rd);
  }
  ep_ll_dispatch_args_t a;
  llw_args(&rd, &a);
  const ep_ll_dispatch_args_t *ap = &a;
  ep_ll_handle_t got = (ep_ll_handle_t)(uintptr_t)0x5a5a, *hp = &got; /* must stay untouched */
  if (x->me == culprit) {
    spoil(&ap, &a, &hp, kind);
    T_STATUS(bad_want[kind].st, ep_ll_dispatch(x->buf, ap, hp));
    T_CHECK(strstr(ep_last_error(), bad_want[kind].needle), "message '%s' does not name '%s'",
            ep_last_error(), bad_want[kind].needle);
    T_CHECK(!strcmp(ep_buffer_last_error(x->buf), ep_last_error()), "buffer's last error differs");
  } else {
    T_STATUS(EP_ERR_PEER_INVALID, ep_ll_dispatch(x->buf, ap, hp));
  }
  T_CHECK(got == (ep_ll_handle_t)(uintptr_t)0x5a5a, "a failed dispatch wrote the handle");
  llw_check_view(&x->keep);
  llw_free(&rd);
}

/* Every rank must pass the same topk and fp8 flags: all fail alike when one differs. */
static void disagree(ctx_t *x, int what) {
  if (x->R == 1) return;
  t_case = what ? "ranks disagree on use_fp8" : "ranks disagree on topk";
  llw_round_t rd;
  llw_case_t k = base;
  if (x->me == x->R - 1) what ? (void)(k.fmt = F_FP8) : (void)(k.topk = 3);
  new_round(x, &rd, &k);
  ep_ll_dispatch_args_t a;
  llw_args(&rd, &a);
  T_STATUS(EP_ERR_MISMATCH, ep_ll_dispatch(x->buf, &a, &rd.h));
  T_CHECK(rd.h == NULL, "a failed dispatch returned a handle");
  llw_check_view(&x->keep);
  llw_free(&rd);
}

/* ------------------------------------------------------------------ combine misuse */

static void bad_combine(ctx_t *x) {
  t_case = "bad combine on one rank";
  llw_round_t rd;
  new_round(x, &rd, NULL);
  llw_dispatch(&rd, x->buf, NULL, NULL);
  int culprit = (x->R - 1) / 2, n = rd.in[x->me].n;
  void *out = t_dalloc((size_t)n * cfg.H * 2);
  int64_t *idx = t_xmalloc((size_t)n * base.topk * 8);
  memcpy(idx, rd.idx[x->me], (size_t)n * base.topk * 8);
  if (x->me == culprit)
    idx[0] = (idx[0] + 1) % cfg.E == idx[1] ? (idx[0] + 2) % cfg.E : (idx[0] + 1) % cfg.E;
  void *didx = t_to_dev(idx, (size_t)n * base.topk * 8);
  ep_ll_combine_args_t a = EP_LL_COMBINE_ARGS_INIT;
  a.handle = rd.h, a.y = t_dalloc((size_t)cfg.E / x->R * x->R * cfg.T * cfg.H * 2);
  a.topk_idx = didx, a.topk_weights = rd.dw, a.out = out;
  if (x->me == culprit) {
    T_STATUS(EP_ERR_MISMATCH, ep_ll_combine(x->buf, &a));
    T_CHECK(strstr(ep_last_error(), "topk_idx[0][0]"), "message: %s", ep_last_error());
  } else {
    T_STATUS(EP_ERR_PEER_INVALID, ep_ll_combine(x->buf, &a));
  }
  t_dfree((void *)a.y), t_dfree(out), t_dfree(didx), free(idx);
  llw_free(&rd); /* a failed combine: destroy and dispatch again */
  llw_check_view(&x->keep);
}

static void wrong_state(ctx_t *x) {
  t_case = "calls in the wrong state";
  llw_round_t rd;
  llw_case_t k = base;
  k.two_phase = 1;
  new_round(x, &rd, &k);
  ep_ll_dispatch_args_t a;
  llw_args(&rd, &a);
  T_OK(ep_ll_dispatch(x->buf, &a, &rd.h));
  ep_ll_combine_args_t c =
      EP_LL_COMBINE_ARGS_INIT; /* every call with it fails before moving data */
  c.handle = rd.h, c.y = rd.dx, c.topk_idx = rd.didx, c.topk_weights = rd.dw;
  c.out = rd.dx;
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_combine(x->buf, &c)); /* before the receive: all ranks */
  void *zy = NULL;
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_get_combine_buffer(x->buf, rd.h, &zy)); /* not received */
  T_OK(ep_ll_recv(x->buf, rd.h));
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_recv(x->buf, rd.h)); /* nothing pending */
  T_STATUS(EP_ERR_NULL_ARG, ep_ll_get_combine_buffer(x->buf, rd.h, NULL));
  T_OK(ep_ll_get_combine_buffer(x->buf, rd.h, &zy));
  T_CHECK(zy != NULL, "no combine buffer");
  llw_check_view(&rd);
  llw_combine(&rd, x->buf, 77, NULL, NULL);
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_combine(x->buf, &c)); /* second combine: all ranks */
  T_CHECK(strstr(ep_last_error(), "already combined"), "message: %s", ep_last_error());
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_get_combine_buffer(x->buf, rd.h, &zy));
  if (x->me == 0) c.y = NULL; /* the core's check on rank 0, the backend's elsewhere */
  T_STATUS(x->me == 0 ? EP_ERR_NULL_ARG : EP_ERR_INVALID_ARG, ep_ll_combine(x->buf, &c));
  llw_free(&rd);
}

/* ------------------------------------------------------------------ the third live handle */

static void third_handle(ctx_t *x) {
  t_case = "third live handle";
  llw_round_t two, third;
  new_round(x, &two, NULL);
  llw_dispatch(&two, x->buf, NULL, NULL); /* with keep: two results alive */
  new_round(x, &third, NULL);
  ep_ll_dispatch_args_t a;
  llw_args(&third, &a);
  T_STATUS(EP_ERR_BUSY, ep_ll_dispatch(x->buf, &a, &third.h));
  T_CHECK(strstr(ep_last_error(), "ep_ll_handle_destroy"), "message: %s", ep_last_error());
  T_CHECK(third.h == NULL, "a refused dispatch returned a handle");
  llw_check_view(&x->keep), llw_check_view(&two);
  if (x->R > 1) { /* BUSY on rank 0 only: the others fail with PEER_INVALID */
    if (x->me != 0) {
      T_OK(ep_ll_handle_destroy(two.h));
      two.h = NULL;
    }
    T_STATUS(x->me == 0 ? EP_ERR_BUSY : EP_ERR_PEER_INVALID, ep_ll_dispatch(x->buf, &a, &third.h));
    T_CHECK(third.h == NULL, "a refused dispatch returned a handle");
    llw_check_view(&x->keep);
    if (x->me == 0) llw_check_view(&two);
  }
  if (two.h) {
    T_OK(ep_ll_handle_destroy(two.h));
    two.h = NULL;
  }
  llw_dispatch(&third, x->buf, NULL, NULL); /* a slot is free again everywhere */
  llw_combine(&third, x->buf, 5, NULL, NULL);
  llw_free(&third), llw_free(&two);
}

/* ------------------------------------------------------------------ the two kinds of handle */

static void expect_kind(ep_status_t got, const char *call, const char *arg) {
  T_CHECK(got == EP_ERR_INVALID_ARG, "%s: got %s, expected EP_ERR_INVALID_ARG (%s)", call,
          ep_status_name(got), ep_last_error());
  T_CHECK(strstr(ep_last_error(), arg), "%s: message does not name '%s': %s", call, arg,
          ep_last_error());
}

/* A normal-mode handle and a low-latency one are distinct registry objects: a cast (the C
 * compiler cannot stop it) is refused by every call of the other kind, and both handles stay
 * alive and usable. Every rank makes the same bad calls. */
static void handle_kinds(ctx_t *x) {
  t_case = "handle kinds kept apart";
  enum { N = 3, H = 128, K = 2 };
  int E = 2 * x->R, R = x->R;
  uint16_t hx[N * H];
  int64_t hidx[N * K];
  for (int i = 0; i < N * H; i++) hx[i] = (uint16_t)(0x3f80 + i % 5);
  for (int t = 0; t < N; t++) hidx[t * K] = (t + x->me) % E, hidx[t * K + 1] = -1;
  void *xs = t_to_dev(hx, sizeof hx), *rx = t_dalloc((size_t)N * R * H * 2);
  void *out = t_dalloc(N * H * 2), *idx = t_to_dev(hidx, sizeof hidx);
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = xs, a.dtype = EP_DTYPE_BF16, a.num_tokens = N, a.hidden = H;
  a.topk_idx = idx, a.topk = K, a.num_experts = E;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = rx, o.capacity = N * R;
  T_OK(ep_dispatch(x->buf, &a, &o));
  ep_handle_t hn = o.handle;
  ep_ll_handle_t hl = x->keep.h;
  int nr = -7;
  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  /* A low-latency handle where a normal one is expected. */
  expect_kind(ep_handle_destroy((ep_handle_t)hl), "ep_handle_destroy(ll handle)", "handle");
  expect_kind(ep_handle_num_recv_tokens((ep_handle_t)hl, &nr), "ep_handle_num_recv_tokens",
              "handle");
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  c.handle = (ep_handle_t)hl, c.x = rx, c.out = out;
  expect_kind(ep_combine(x->buf, &c), "ep_combine(ll handle)", "args->handle");
  ep_dispatch_args_t ca = a;
  ep_dispatch_out_t co = EP_DISPATCH_OUT_INIT;
  ca.cached = (ep_handle_t)hl;
  co.mode = EP_OUTPUT_CALLER, co.recv_x = rx, co.capacity = N * R;
  expect_kind(ep_dispatch(x->buf, &ca, &co), "ep_dispatch(cached = ll handle)", "args->cached");
  /* A normal handle where a low-latency one is expected. */
  expect_kind(ep_ll_handle_destroy((ep_ll_handle_t)hn), "ep_ll_handle_destroy(normal handle)",
              "handle");
  expect_kind(ep_ll_handle_num_recv_tokens((ep_ll_handle_t)hn, &nr), "ep_ll_handle_num_recv_tokens",
              "handle");
  expect_kind(ep_ll_get_recv_view((ep_ll_handle_t)hn, &v), "ep_ll_get_recv_view", "handle");
  expect_kind(ep_ll_recv(x->buf, (ep_ll_handle_t)hn), "ep_ll_recv", "handle");
  void *zy = NULL;
  expect_kind(ep_ll_get_combine_buffer(x->buf, (ep_ll_handle_t)hn, &zy), "ep_ll_get_combine_buffer",
              "handle");
  T_CHECK(zy == NULL, "a refused query wrote its result");
  ep_ll_combine_args_t lc = EP_LL_COMBINE_ARGS_INIT;
  lc.handle = (ep_ll_handle_t)hn, lc.y = rx, lc.topk_idx = idx;
  lc.topk_weights = x->keep.dw, lc.out = out;
  expect_kind(ep_ll_combine(x->buf, &lc), "ep_ll_combine(normal handle)", "args->handle");
  T_CHECK(nr == -7, "a refused query wrote num_recv_tokens");
  /* Both survived and still work. */
  T_OK(ep_handle_num_recv_tokens(hn, &nr));
  T_CHECK(nr == o.num_recv_tokens, "normal handle: %d rows, the dispatch said %d", nr,
          o.num_recv_tokens);
  c.handle = hn;
  T_OK(ep_combine(x->buf, &c));
  T_OK(ep_handle_destroy(hn));
  llw_check_view(&x->keep);
  t_dfree(xs), t_dfree(rx), t_dfree(out), t_dfree(idx);
}

/* ------------------------------------------------------------------ configs */

static void configs(ctx_t *x) {
  t_case = "low-latency configs";
  ep_buffer_config_t c = EP_BUFFER_CONFIG_INIT;
  c.ll_max_tokens = 128, c.ll_hidden = 7168, c.ll_num_experts = 288, c.ll_max_topk = 9;
  /* The documented bound, and what every backend holds at least: per slot, the slab and the
   * zero-copy combine input, [L][R*T][H] bf16 each. */
  size_t bytes = 0, normal = 0,
         want = 2 * ((size_t)288 * 128 * (4 * 7168 + 8) + 2 * (size_t)128 * 9 * 7168);
  size_t least = 2 * (size_t)288 * 128 * 4 * 7168;
  ep_buffer_config_t off = EP_BUFFER_CONFIG_INIT; /* the same buffer without low-latency mode */
  T_OK(ep_buffer_size_hint(&c, 4, &bytes));
  T_OK(ep_buffer_size_hint(&off, 4, &normal));
  T_CHECK(bytes - normal >= least && bytes - normal < want + (1u << 20),
          "low-latency part of the size hint: %zu bytes, formula %zu", bytes - normal, want);
  c.ll_num_experts = 50;
  T_STATUS(EP_ERR_SHAPE, ep_buffer_size_hint(&c, 4, &bytes));
  c.ll_num_experts = 288, c.ll_hidden = 100;
  T_STATUS(EP_ERR_SHAPE, ep_buffer_size_hint(&c, 4, &bytes));
  c.ll_hidden = 0;
  T_STATUS(EP_ERR_OUT_OF_RANGE, ep_buffer_size_hint(&c, 4, &bytes));
  ep_buffer_t b = NULL;
  c.ll_hidden = 64, c.ll_num_experts = 24 * x->R + 1; /* never divisible (R > 1), or E=25 */
  if (x->R > 1) T_STATUS(EP_ERR_SHAPE, ep_buffer_create(x->g, &c, &b));
  c.ll_num_experts = 24 * x->R, c.ll_max_tokens = 4; /* H = 64: bf16 only */
  T_OK(ep_buffer_create(x->g, &c, &b));
  llw_round_t rd;
  llw_cfg_t small = {4, 64, 24 * x->R, 9};
  llw_gen(&rd, x->R, x->me, &small, &base, 9);
  ep_ll_dispatch_args_t a;
  llw_args(&rd, &a);
  a.use_fp8 = 1;
  T_STATUS(EP_ERR_SHAPE, ep_ll_dispatch(b, &a, &rd.h));
  llw_free(&rd);
  T_OK(ep_buffer_destroy(b));
  ep_buffer_config_t plain = EP_BUFFER_CONFIG_INIT; /* low-latency mode disabled */
  T_OK(ep_buffer_create(x->g, &plain, &b));
  ep_ll_handle_t none = NULL;
  T_STATUS(EP_ERR_INVALID_ARG, ep_ll_dispatch(b, &a, &none));
  T_CHECK(strstr(ep_last_error(), "disabled"), "message: %s", ep_last_error());
  T_CHECK(none == NULL, "a refused dispatch returned a handle");
  T_OK(ep_buffer_destroy(b));
}

/* A view needs its buffer; the handle itself outlives it. */
static void view_after_destroy(ctx_t *x) {
  t_case = "view after the buffer is destroyed";
  ep_buffer_t b;
  llw_buffer(x->g, &cfg, &b);
  llw_round_t rd;
  new_round(x, &rd, NULL);
  llw_dispatch(&rd, b, NULL, NULL);
  T_OK(ep_buffer_destroy(b));
  ep_ll_recv_view_t v = {.size = sizeof v + 8};
  T_STATUS(EP_ERR_CONFIG, ep_ll_get_recv_view(rd.h, &v));
  v.size = 12;
  T_STATUS(EP_ERR_CONFIG, ep_ll_get_recv_view(rd.h, &v));
  v.size = sizeof v;
  T_STATUS(EP_ERR_DESTROYED, ep_ll_get_recv_view(rd.h, &v));
  llw_free(&rd);
}

int main(void) {
  ctx_t x;
  t_require_backend(); /* EP_BACKEND=cuda without a GPU: "skipped: no GPU" */
  t_init(&x.g, &x.me, &x.R);
  llw_buffer(x.g, &cfg, &x.buf);
  t_case = "setup";
  new_round(&x, &x.keep, NULL);
  llw_dispatch(&x.keep, x.buf, NULL, NULL);
  for (int k = 0; k < B_COUNT; k++) bad_dispatch(&x, k);
  disagree(&x, 0), disagree(&x, 1);
  bad_combine(&x);
  wrong_state(&x);
  third_handle(&x);
  handle_kinds(&x);
  t_case = "after the failures";
  llw_combine(&x.keep, x.buf, 3, NULL, NULL);
  llw_free(&x.keep);
  configs(&x);
  view_after_destroy(&x);
  t_case = NULL;
  T_OK(ep_buffer_destroy(x.buf));
  t_fini(x.g);
  if (x.me == 0) printf("test_ll_misuse: R=%d passed\n", x.R);
  return T_PASS;
}
