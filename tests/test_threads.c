/* Threads (SEMANTICS.md §7.4): two groups and two buffers in one process, driven by two threads at
 * once, each doing dispatch/combine checked against the reference; and the rule that calls on
 * one buffer must not overlap, enforced (EP_ERR_BUSY) rather than corrupting state. */
#include <pthread.h>
#include <time.h>

#include "common.h"
#include "ref.h"

enum { N = 40, H = 128, K = 3, ITERS = 30 };

typedef struct {
  ep_group_t g;
  ep_buffer_t b;
  int R, me, which;
  const char *fail;
} worker_t;

/* Every rank's inputs for iteration `it` of worker `which`, rebuilt by all ranks. */
static void inputs(int which, int it, int r, int E, uint16_t *x, int64_t *idx) {
  t_rng g = t_seed((uint64_t)(which * 1000 + it), (uint64_t)r);
  for (int i = 0; i < N * H; i++) x[i] = t_rand_bf16(&g);
  for (int i = 0; i < N * K; i++) idx[i] = t_below(&g, 5) ? t_below(&g, E) : -1;
}

static const char *one_iter(worker_t *w, int it) {
  int R = w->R, E = 2 * R, me = w->me;
  uint16_t *xs = malloc((size_t)R * N * H * 2), *rx = malloc((size_t)R * N * H * 2);
  uint16_t *out = malloc((size_t)N * H * 2), *want = malloc((size_t)N * H * 2 * R);
  int64_t *idx = malloc((size_t)R * N * K * 8);
  ref_rank_input_t *in = calloc((size_t)R, sizeof *in);
  ref_recv_t *rr = calloc((size_t)R, sizeof *rr);
  for (int r = 0; r < R; r++) {
    inputs(w->which, it, r, E, xs + (size_t)r * N * H, idx + (size_t)r * N * K);
    in[r] = (ref_rank_input_t){N, xs + (size_t)r * N * H, NULL, idx + (size_t)r * N * K, NULL};
  }
  const char *err = NULL;
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = in[me].x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = N,
                          .hidden = H,
                          .topk_idx = in[me].topk_idx,
                          .topk = K,
                          .num_experts = E};
  ep_dispatch_out_t o = {
      .size = sizeof o, .mode = EP_OUTPUT_CALLER, .recv_x = rx, .capacity = R * N};
  if (ep_dispatch(w->b, &a, &o) != EP_OK) err = "dispatch failed";
  int nr = o.num_recv_tokens;
  ep_handle_t h = o.handle;
  ref_dispatch(R, E, K, H * 2, 0, 1, in, rr);
  if (!err && (nr != rr[me].nr || memcmp(rx, rr[me].x, (size_t)nr * H * 2)))
    err = "dispatch differs from the reference";
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = rx, .out = out};
  if (!err && ep_combine(w->b, &c) != EP_OK) err = "combine failed";
  if (!err) ep_handle_destroy(h);
  for (int r = 0; r < R; r++) ref_free_recv(&rr[r]);
  free(xs), free(rx), free(out), free(want), free(idx), free(in), free(rr);
  return err;
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  for (int it = 0; it < ITERS && !w->fail; it++) w->fail = one_iter(w, it);
  return NULL;
}

/* Rank 1 enters late; meanwhile rank 0's second thread calls the same buffer: EP_ERR_BUSY. */
typedef struct {
  ep_buffer_t b;
  ep_status_t st;
} overlap_t;

static void *overlap(void *arg) {
  overlap_t *o = arg;
  nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  int64_t idx[1] = {0};
  int32_t pr[64];
  ep_layout_args_t l = {.size = sizeof l,
                        .topk_idx = idx,
                        .num_tokens = 1,
                        .topk = 1,
                        .num_experts = 64,
                        .tokens_per_rank = pr};
  o->st = ep_get_dispatch_layout(o->b, &l);
  return NULL;
}

int main(void) {
  worker_t w[2];
  for (int i = 0; i < 2; i++) {
    memset(&w[i], 0, sizeof w[i]);
    T_OK(ep_group_create_from_env(NULL, &w[i].g)); /* two groups over the same ranks */
    T_OK(ep_group_rank(w[i].g, &w[i].me));
    T_OK(ep_group_nranks(w[i].g, &w[i].R));
    T_OK(ep_buffer_create(w[i].g, NULL, &w[i].b));
    w[i].which = i;
  }
  t_rank = w[0].me;
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, worker_main, &w[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) T_CHECK(!w[i].fail, "thread %d: %s", i, w[i].fail);
  if (w[0].R > 1) {
    overlap_t o = {w[0].b, EP_OK};
    pthread_t t;
    if (w[0].me == 0)
      pthread_create(&t, NULL, overlap, &o);
    else
      nanosleep(&(struct timespec){0, 400 * 1000 * 1000}, NULL);
    T_CHECK(one_iter(&w[0], 99) == NULL, "iteration after the overlap failed");
    if (w[0].me == 0) {
      pthread_join(t, NULL);
      T_CHECK(o.st == EP_ERR_BUSY, "overlapping call on one buffer returned %s, expected BUSY",
              ep_status_name(o.st));
    }
  }
  for (int i = 1; i >= 0; i--) {
    T_OK(ep_buffer_destroy(w[i].b));
    T_OK(ep_group_destroy(w[i].g));
  }
  if (w[0].me == 0)
    printf("test_threads: R=%d: 2 groups x %d iterations concurrently\n", w[0].R, ITERS);
  return T_PASS;
}
