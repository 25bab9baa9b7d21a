/* A group bootstrapped by another framework's collectives (ep_group_create): MPI_Allgather and
 * MPI_Barrier as the user callbacks of ep_group_create, under mpirun. The group then runs a
 * dispatch/combine checked against the reference, and everything is torn down before
 * MPI_Finalize (epcomm's own threads and sockets are gone by then).
 *
 * With EP_HOSTS set (mpirun -x EP_HOSTS=2) the group spans pretend hosts and epcomm's network
 * engine uses the MPI this program initialized itself: epcomm must neither initialize nor
 * finalize it, so MPI still works after every epcomm object is gone (a barrier, then the
 * program's own MPI_Finalize). */
#include <mpi.h>

#include "common.h"
#include "ref.h"

static int mpi_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
  return MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, *(MPI_Comm *)ctx);
}

static int mpi_barrier(void *ctx) {
  return MPI_Barrier(*(MPI_Comm *)ctx);
}

enum { N = 37, H = 256, K = 4 };

int main(int argc, char **argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm comm = MPI_COMM_WORLD;
  int me, R;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &R);
  t_rank = me;
  ep_bootstrap_t boot = {me, R, mpi_allgather, mpi_barrier, &comm};
  ep_group_t g;
  ep_buffer_t b;
  T_OK(ep_group_create(&boot, NULL, &g));
  int r, n;
  T_OK(ep_group_rank(g, &r));
  T_OK(ep_group_nranks(g, &n));
  T_CHECK(r == me && n == R, "group says rank %d of %d, MPI says %d of %d", r, n, me, R);
  T_OK(ep_buffer_create(g, NULL, &b));
  int E = 4 * R;
  uint16_t *x = t_xmalloc((size_t)R * N * H * 2), *rx = t_xmalloc((size_t)R * N * H * 2);
  int64_t *idx = t_xmalloc((size_t)R * N * K * 8);
  ref_rank_input_t *in = calloc((size_t)R, sizeof *in);
  for (int s = 0; s < R; s++) { /* every rank's inputs, for the reference */
    t_rng g2 = t_seed(77, (uint64_t)s);
    for (int i = 0; i < N * H; i++) x[(size_t)s * N * H + i] = t_rand_bf16(&g2);
    for (int i = 0; i < N * K; i++)
      idx[(size_t)s * N * K + i] = t_below(&g2, 6) ? t_below(&g2, E) : -1;
    in[s] = (ref_rank_input_t){N, x + (size_t)s * N * H, NULL, idx + (size_t)s * N * K, NULL};
  }
  ref_recv_t *rr = calloc((size_t)R, sizeof *rr);
  T_CHECK(ref_dispatch(R, E, K, H * 2, 0, 1, in, rr) == 0, "reference");
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
  T_OK(ep_dispatch(b, &a, &o));
  int nr = o.num_recv_tokens;
  ep_handle_t h = o.handle;
  T_CHECK(nr == rr[me].nr && !memcmp(rx, rr[me].x, (size_t)nr * H * 2),
          "dispatch differs from the reference");
  uint16_t *out = t_xmalloc((size_t)N * H * 2);
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = rx, .out = out};
  T_OK(ep_combine(b, &c));
  T_OK(ep_handle_destroy(h));
  ep_group_info_t gi = EP_GROUP_INFO_INIT;
  T_OK(ep_group_query(g, &gi));
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  int finalized = 1;
  MPI_Finalized(&finalized);
  T_CHECK(!finalized, "epcomm finalized an MPI it did not initialize");
  T_CHECK(MPI_Barrier(comm) == MPI_SUCCESS, "MPI no longer works after the group");
  for (int s = 0; s < R; s++) ref_free_recv(&rr[s]);
  free(x), free(rx), free(idx), free(in), free(rr), free(out);
  if (me == 0)
    printf(
        "test_mpi_bootstrap: %d MPI ranks on %d host(s), group from MPI callbacks, dispatch "
        "checked, MPI left to the program\n",
        R, gi.nhosts);
  MPI_Finalize();
  return T_PASS;
}
