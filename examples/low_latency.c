/* Low-latency mode, complete (docs/LOW_LATENCY.md): every rank dispatches a decode step's tokens
 * in two phases with other work in between, runs its "experts" on the received rows in place
 * (every value becomes 2.0), and combines them back with gate weights 1/topk, so that every
 * output value is 2.0. Run: epcomm launch -n 4 build/examples/low_latency */
#include <epcomm.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                               \
  do {                                                            \
    ep_status_t st_ = (call);                                     \
    if (st_ != EP_OK) {                                           \
      fprintf(stderr, "%s failed: %s\n", #call, ep_last_error()); \
      exit(1);                                                    \
    }                                                             \
  } while (0)

enum { T = 16, H = 512, TOPK = 4 };

int main(void) {
  ep_group_t group;
  ep_buffer_t buf;
  int rank, R;
  CHECK(ep_group_create_from_env(NULL, &group));
  CHECK(ep_group_rank(group, &rank));
  CHECK(ep_group_nranks(group, &R));
  int E = 8 * R; /* experts: E/R = 8 on every rank */
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = T, cfg.ll_hidden = H, cfg.ll_num_experts = E, cfg.ll_max_topk = TOPK;
  CHECK(ep_buffer_create(group, &cfg, &buf)); /* shapes are fixed here */

  int n = T - rank % 2; /* this step's tokens: at most T, may differ across ranks */
  uint16_t *x = malloc(sizeof *x * n * H), *out = malloc(sizeof *out * n * H);
  int64_t *idx = malloc(sizeof *idx * n * TOPK);
  float *w = malloc(sizeof *w * n * TOPK);
  for (int i = 0; i < n * H; i++) x[i] = 0x3f80; /* bf16 1.0 */
  for (int t = 0; t < n; t++)
    for (int k = 0; k < TOPK; k++) { /* distinct experts per token */
      idx[t * TOPK + k] = (t + rank + k * (E / TOPK)) % E;
      w[t * TOPK + k] = 1.0f / TOPK;
    }

  ep_ll_handle_t h;
  ep_ll_dispatch_args_t d = EP_LL_DISPATCH_ARGS_INIT;
  d.x = x, d.num_tokens = n, d.topk_idx = idx, d.topk = TOPK, d.two_phase = 1;
  CHECK(ep_ll_dispatch(buf, &d, &h)); /* sends this rank's rows and returns */
  /* ... other work here: epcomm does nothing in between (no thread, no spinning) ... */
  CHECK(ep_ll_recv(buf, h)); /* every row for this rank's experts has arrived */

  ep_ll_recv_view_t v = EP_LL_RECV_VIEW_INIT;
  CHECK(ep_ll_get_recv_view(h, &v));
  for (int l = 0; l < v.num_local_experts; l++) { /* expert l: rows 0 .. recv_count[l] */
    uint16_t *rows = (uint16_t *)v.recv_x + (size_t)l * v.max_rows * H;
    for (int i = 0; i < v.recv_count[l] * H; i++) rows[i] = 0x4000; /* the "expert": 2.0 */
  }
  ep_ll_combine_args_t c = EP_LL_COMBINE_ARGS_INIT;
  c.handle = h, c.y = v.recv_x, c.topk_idx = idx, c.topk_weights = w, c.out = out;
  CHECK(ep_ll_combine(buf, &c)); /* one phase: out[t] = sum_k w[t][k] * y(t, k) */
  int bad = 0;
  for (int i = 0; i < n * H; i++) bad += out[i] != 0x4000;

  CHECK(ep_ll_handle_destroy(h)); /* gives the result slot back */
  CHECK(ep_buffer_destroy(buf));
  CHECK(ep_group_destroy(group));
  if (rank == 0) printf("rank 0: %d tokens combined, %d values differ from 2.0\n", n, bad);
  free(x), free(out), free(idx), free(w);
  return bad != 0;
}
