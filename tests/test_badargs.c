/* Bad input (SEMANTICS.md §8.3-8.4), table-driven: for every public function, each argument
 * that can be wrong gets its specific status, a message that names the argument, and no output
 * byte written. Runs on any number of ranks (every rank makes the same bad call, so each rejects
 * it locally and the peers stay in step); with 2+ ranks it also checks that disagreements across
 * ranks are detected collectively and that a rank's rejection fails its peers' matching call at
 * once (EP_ERR_PEER_INVALID) instead of letting them wait for the deadline. */
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
  int nr;
  ep_handle_t h, good_handle, dead_handle;
} fx_t;

static void poison(fx_t *f) {
  memset(f->rx, T_POISON, sizeof f->rx), memset(f->out, T_POISON, sizeof f->out);
  memset(f->rs, T_POISON, sizeof f->rs), memset(f->rw, T_POISON, sizeof f->rw);
  memset(f->ow, T_POISON, sizeof f->ow), memset(f->ri, T_POISON, sizeof f->ri);
  memset(f->src, T_POISON, sizeof f->src), memset(f->prefix, T_POISON, sizeof f->prefix);
  memset(f->per_expert, T_POISON, sizeof f->per_expert), memset(f->pr, T_POISON, sizeof f->pr);
  memset(f->pe, T_POISON, sizeof f->pe), memset(f->in_rank, T_POISON, sizeof f->in_rank);
  f->nr = -12345;
  f->h = (ep_handle_t)(uintptr_t)0x5a5a;
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
  T_CHECK(f->nr == -12345, "%s: num_recv_tokens was written by a failing call", what);
  T_CHECK(f->h == (ep_handle_t)(uintptr_t)0x5a5a, "%s: handle was written by a failing call", what);
}

static ep_dispatch_args_t good_dispatch(fx_t *f) {
  ep_dispatch_args_t a = {.size = sizeof a, .x = f->x, .dtype = EP_DTYPE_BF16, .num_tokens = N,
                          .hidden = H, .topk_idx = f->idx, .topk_weights = f->w, .topk = K,
                          .num_experts = f->E, .recv_x = f->rx, .recv_topk_idx = f->ri,
                          .recv_topk_weights = f->rw, .recv_src_idx = f->src,
                          .rank_prefix = f->prefix, .recv_tokens_per_expert = f->per_expert,
                          .recv_capacity = CAP, .num_recv_tokens = &f->nr, .handle = &f->h};
  return a;
}

/* ------------------------------------------------------------------ the table */

typedef void (*mutate_fn)(fx_t *f, ep_dispatch_args_t *a);
typedef struct {
  const char *name;
  mutate_fn mutate;
  ep_status_t want;
  const char *names; /* the message must contain this argument name */
} dcase_t;

#define M(name) static void name(fx_t *f, ep_dispatch_args_t *a)
M(m_size) { (void)f, a->size = 3; }
M(m_dtype) { (void)f, a->dtype = (ep_dtype_t)9; }
M(m_ntok) { (void)f, a->num_tokens = -1; }
M(m_hidden0) { (void)f, a->hidden = 0; }
M(m_hidden7) { (void)f, a->hidden = 7; } /* 14-byte rows */
M(m_hidden_fp8) { (void)f, a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 24, a->x_scales = f->scales, a->recv_x_scales = f->rs; }
M(m_x) { (void)f, a->x = NULL; }
M(m_topk0) { (void)f, a->topk = 0; }
M(m_topk_big) { (void)f, a->topk = 1000; }
M(m_idx) { (void)f, a->topk_idx = NULL; }
M(m_e0) { (void)f, a->num_experts = 0; }
M(m_e_div) { a->num_experts = f->E + 1; }
M(m_e_big) { a->num_experts = f->R * 5000; }
M(m_id_high) { f->idx[3 * K + 1] = f->E; (void)a; }
M(m_id_low) { f->idx[2 * K] = -2; (void)a; }
M(m_scales) { (void)f, a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 128, a->num_tokens = 2, a->recv_x_scales = f->rs; }
M(m_rscales) { a->dtype = EP_DTYPE_FP8_E4M3, a->hidden = 128, a->num_tokens = 2, a->x_scales = f->scales; }
M(m_bf16_scales) { a->x_scales = f->scales; }
M(m_nscales) { a->dtype = EP_DTYPE_FP8_E4M3, a->x_scales = f->scales, a->recv_x_scales = f->rs, a->num_scales = -1; }
M(m_recv_x) { (void)f, a->recv_x = NULL; }
M(m_nrecv) { (void)f, a->num_recv_tokens = NULL; }
M(m_worst_neg) { (void)f, a->worst_case_tokens = -1; }
M(m_cap_neg) { (void)f, a->recv_capacity = -1; }
M(m_align) { (void)f, a->expert_alignment = -3; }
M(m_rw) { (void)f, a->topk_weights = NULL; }
M(m_cached_dead) { a->cached = f->dead_handle; a->handle = NULL; }
M(m_cached_out) { a->cached = f->good_handle; }
M(m_cached_shape) { a->cached = f->good_handle, a->handle = NULL, a->hidden = 2 * H; }
M(m_bad_handle_id) { (void)f, a->cached = (ep_handle_t)(uintptr_t)0x77; }
#undef M

static const dcase_t dcases[] = {
    {"args->size", m_size, EP_ERR_CONFIG, "size"},
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
    {"fp8 without recv_x_scales", m_rscales, EP_ERR_NULL_ARG, "recv_x_scales"},
    {"bf16 with x_scales", m_bf16_scales, EP_ERR_INVALID_ARG, "x_scales"},
    {"num_scales -1", m_nscales, EP_ERR_OUT_OF_RANGE, "num_scales"},
    {"recv_x NULL", m_recv_x, EP_ERR_NULL_ARG, "recv_x"},
    {"num_recv_tokens NULL", m_nrecv, EP_ERR_NULL_ARG, "num_recv_tokens"},
    {"worst_case_tokens < 0", m_worst_neg, EP_ERR_OUT_OF_RANGE, "worst_case_tokens"},
    {"recv_capacity < 0", m_cap_neg, EP_ERR_OUT_OF_RANGE, "recv_capacity"},
    {"expert_alignment < 0", m_align, EP_ERR_OUT_OF_RANGE, "expert_alignment"},
    {"recv weights without weights", m_rw, EP_ERR_INVALID_ARG, "recv_topk_weights"},
    {"cached: destroyed handle", m_cached_dead, EP_ERR_DESTROYED, "cached"},
    {"cached: handle output given", m_cached_out, EP_ERR_INVALID_ARG, "handle"},
    {"cached: hidden differs", m_cached_shape, EP_ERR_MISMATCH, "hidden"},
    {"cached: not a handle", m_bad_handle_id, EP_ERR_INVALID_ARG, "cached"},
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
  ep_status_t st = ep_dispatch(f->b, &a);
  T_CHECK(st == EP_OK, "after '%s', a valid dispatch fails: %s: %s", after, ep_status_name(st),
          ep_last_error());
  ep_combine_args_t c = {.size = sizeof c, .handle = f->h, .x = f->rx, .out = f->out};
  T_OK(ep_combine(f->b, &c));
  T_OK(ep_handle_destroy(f->h));
}

static void dispatch_table(fx_t *f) {
  for (size_t i = 0; i < sizeof dcases / sizeof dcases[0]; i++) {
    t_case = dcases[i].name;
    if (dcases[i].mutate == m_e_div && f->R == 1) continue; /* every E divides by 1 */
    reset_inputs(f);
    poison(f);
    ep_dispatch_args_t a = good_dispatch(f);
    dcases[i].mutate(f, &a);
    expect(f, ep_dispatch(f->b, &a), dcases[i].want, dcases[i].names, dcases[i].name);
  }
  t_case = "ep_dispatch(NULL args)";
  poison(f);
  expect(f, ep_dispatch(f->b, NULL), EP_ERR_NULL_ARG, "args", t_case);
  still_works(f, "the dispatch table");
}

/* Outputs too small are found only after the count exchange: drained, nothing written. */
static void capacity_cases(fx_t *f) {
  t_case = "recv_capacity too small";
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  a.recv_capacity = 1;
  for (int i = 0; i < N * K; i++) f->idx[i] = f->me * (f->E / f->R); /* all to this rank */
  expect(f, ep_dispatch(f->b, &a), EP_ERR_TOO_LARGE, "recv_capacity", t_case);
  t_case = "worst_case_tokens too small";
  poison(f);
  a = good_dispatch(f);
  a.worst_case_tokens = 1;
  expect(f, ep_dispatch(f->b, &a), EP_ERR_TOO_LARGE, "worst_case_tokens", t_case);
  still_works(f, "too-small outputs");
}

static void layout_table(fx_t *f) {
  struct {
    const char *name;
    const int64_t *idx;
    int n, topk, E;
    ep_status_t want;
    const char *arg;
  } c[] = {
      {"layout: topk_idx NULL", NULL, N, K, f->E, EP_ERR_NULL_ARG, "topk_idx"},
      {"layout: num_tokens -1", f->idx, -1, K, f->E, EP_ERR_OUT_OF_RANGE, "num_tokens"},
      {"layout: topk 0", f->idx, N, 0, f->E, EP_ERR_OUT_OF_RANGE, "topk"},
      {"layout: E % R", f->idx, N, K, f->E + 1, EP_ERR_SHAPE, "num_experts"},
      {"layout: id >= E", f->idx, N, K, 1 * f->R, EP_ERR_OUT_OF_RANGE, "topk_idx["},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    t_case = c[i].name;
    if (c[i].want == EP_ERR_SHAPE && f->R == 1) continue; /* every E divides by 1 */
    reset_inputs(f);
    poison(f);
    expect(f, ep_get_dispatch_layout(f->b, c[i].idx, c[i].n, c[i].topk, c[i].E, f->pr, f->pe,
                                     f->in_rank, NULL), c[i].want, c[i].arg, c[i].name);
  }
}

static void combine_table(fx_t *f) {
  reset_inputs(f);
  poison(f);
  ep_dispatch_args_t a = good_dispatch(f);
  T_OK(ep_dispatch(f->b, &a));
  ep_handle_t h = f->h;
  struct {
    const char *name;
    ep_combine_args_t c;
    ep_status_t want;
    const char *arg;
  } c[] = {
      {"combine: size", {.size = 1, .handle = h, .x = f->rx, .out = f->out}, EP_ERR_CONFIG, "size"},
      {"combine: handle NULL", {.size = sizeof(ep_combine_args_t), .x = f->rx, .out = f->out}, EP_ERR_NULL_ARG, "handle"},
      {"combine: x NULL", {.size = sizeof(ep_combine_args_t), .handle = h, .out = f->out}, EP_ERR_NULL_ARG, "x"},
      {"combine: out NULL", {.size = sizeof(ep_combine_args_t), .handle = h, .x = f->rx}, EP_ERR_NULL_ARG, "out"},
      {"combine: weights without out", {.size = sizeof(ep_combine_args_t), .handle = h, .x = f->rx, .out = f->out, .topk_weights = f->rw}, EP_ERR_NULL_ARG, "out_topk_weights"},
      {"combine: out weights without weights", {.size = sizeof(ep_combine_args_t), .handle = h, .x = f->rx, .out = f->out, .out_topk_weights = f->ow}, EP_ERR_INVALID_ARG, "out_topk_weights"},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    t_case = c[i].name;
    bool needs_x = c[i].c.x != NULL; /* the NULL-x case needs rows to exist */
    (void)needs_x;
    memset(f->out, T_POISON, sizeof f->out), memset(f->ow, T_POISON, sizeof f->ow);
    ep_status_t st = ep_combine(f->b, &c[i].c);
    if (!strcmp(c[i].name, "combine: x NULL") && f->nr == 0) continue; /* nothing to read */
    T_CHECK(st == c[i].want, "%s: got %s, expected %s (%s)", c[i].name, ep_status_name(st),
            ep_status_name(c[i].want), ep_last_error());
    T_CHECK(strstr(ep_last_error(), c[i].arg), "%s: message does not name %s: %s", c[i].name,
            c[i].arg, ep_last_error());
    T_CHECK(all_poison(f->out, sizeof f->out) && all_poison(f->ow, sizeof f->ow),
            "%s: out written by a failing call", c[i].name);
  }
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
  T_STATUS(EP_ERR_NULL_ARG, ep_buffer_backend(f->b, NULL));
  T_CHECK(strcmp(ep_status_name(EP_ERR_TIMEOUT), "EP_ERR_TIMEOUT") == 0, "status table");
  T_CHECK(strcmp(ep_status_name((ep_status_t)999), "EP_ERR_UNKNOWN") == 0, "unknown status");
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
      if (a.dtype == EP_DTYPE_FP8_E4M3) a.x_scales = f->scales, a.recv_x_scales = f->rs, a.num_scales = 1;
      if (c[i].reject) a.x = NULL;
    }
    ep_status_t st = ep_dispatch(f->b, &a), want = EP_ERR_MISMATCH;
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
  /* A handle that is then destroyed, for the cached-dispatch cases. */
  reset_inputs(f);
  ep_dispatch_args_t a = good_dispatch(f);
  T_OK(ep_dispatch(f->b, &a));
  f->good_handle = f->h;
  T_OK(ep_dispatch(f->b, &a));
  f->dead_handle = f->h;
  T_OK(ep_handle_destroy(f->dead_handle));
  object_table(f);
  dispatch_table(f);
  T_OK(ep_handle_destroy(f->good_handle));
  capacity_cases(f);
  layout_table(f);
  combine_table(f);
  collective_cases(f);
  t_case = NULL;
  T_OK(ep_buffer_destroy(f->b));
  t_fini(f->g);
  if (f->me == 0) printf("test_badargs: R=%d: all bad-argument cases rejected as specified\n", f->R);
  free(f);
  return T_PASS;
}
