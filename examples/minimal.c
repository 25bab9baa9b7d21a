/* The README's example, complete: every rank dispatches a few tokens, doubles what it receives
 * (the "experts"), and combines. Run: epcomm launch -n 4 build/examples/minimal */
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

int main(void) {
  ep_group_t group;
  ep_buffer_t buf;
  int rank, R;
  CHECK(ep_group_create_from_env(NULL, &group)); /* ranks from `epcomm launch` or mpirun */
  CHECK(ep_group_rank(group, &rank));
  CHECK(ep_group_nranks(group, &R));
  CHECK(ep_buffer_create(group, NULL, &buf)); /* defaults: CPU backend, 1 MiB queues */

  enum { n = 32, hidden = 256, topk = 2 };
  int E = 4 * R, cap = n * R;
  uint16_t *x = calloc((size_t)n * hidden, 2), *recv_x = calloc((size_t)cap * hidden, 2);
  uint16_t *y = calloc((size_t)cap * hidden, 2), *out = calloc((size_t)n * hidden, 2);
  int64_t topk_idx[n * topk];
  for (int i = 0; i < n * hidden; i++) x[i] = 0x3f80; /* bf16 1.0 */
  for (int i = 0; i < n * topk; i++) topk_idx[i] = (rank + i * 3) % E;

  /* Inputs: x [n][hidden] bf16, topk_idx [n][topk] int64 (-1 = unused slot). */
  ep_dispatch_args_t d = EP_DISPATCH_ARGS_INIT;
  d.x = x, d.dtype = EP_DTYPE_BF16, d.num_tokens = n, d.hidden = hidden;
  d.topk_idx = topk_idx, d.topk = topk, d.num_experts = E;
  /* Outputs: the received rows go into our array of `cap` rows. */
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = recv_x, o.capacity = cap;
  CHECK(ep_dispatch(buf, &d, &o));
  int nr = o.num_recv_tokens;
  for (int i = 0; i < nr * hidden; i++) y[i] = 0x4000; /* the "expert": every value becomes 2.0 */
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  c.handle = o.handle, c.x = y, c.out = out;
  CHECK(ep_combine(buf, &c)); /* out[t] = 2.0 x (number of ranks token t went to) */

  CHECK(ep_handle_destroy(o.handle)); /* destroy in reverse order of creation */
  CHECK(ep_buffer_destroy(buf));
  CHECK(ep_group_destroy(group));
  if (rank == 0) printf("rank 0 received %d tokens; out[0][0] = 0x%04x\n", nr, out[0]);
  free(x), free(recv_x), free(y), free(out);
  return 0;
}
