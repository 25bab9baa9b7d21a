/* The per-call cost of the C API on the smallest possible work: a dispatch and a combine of one
 * token (hidden 64, topk 1, one expert per rank) on the CPU backend, and the cheapest query
 * (ep_buffer_query). It is the figure the Python layer is measured against
 * (bench/py_overhead.py; README.md, "Python"). Run: epcomm launch -n R build/bin/call_overhead
 * [ITERS]. Rank 0 prints the medians, in microseconds. */
#include <epcomm.h>
#include <stdio.h>
#include <stdlib.h>

#include "tk_clock.h"

#define CHECK(call)                                               \
  do {                                                            \
    if ((call) != EP_OK) {                                        \
      fprintf(stderr, "%s failed: %s\n", #call, ep_last_error()); \
      exit(1);                                                    \
    }                                                             \
  } while (0)

enum { H = 64, WARMUP = 200 };

static double now_us(void) {
  return 1e6 * tk_now_s();
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return v[n / 2];
}

/* One dispatch of this rank's token to the next rank's expert, its combine, its handle freed. */
static void round_trip(ep_buffer_t buf, int rank, int R, uint16_t *x, uint16_t *recv_x,
                       uint16_t *out) {
  int64_t idx = (rank + 1) % R;
  ep_dispatch_args_t d = EP_DISPATCH_ARGS_INIT;
  d.x = x, d.dtype = EP_DTYPE_BF16, d.num_tokens = 1, d.hidden = H, d.topk_idx = &idx;
  d.topk = 1, d.num_experts = R;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.capacity = R, o.recv_x = recv_x;
  CHECK(ep_dispatch(buf, &d, &o));
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  c.handle = o.handle, c.x = recv_x, c.out = out;
  CHECK(ep_combine(buf, &c));
  CHECK(ep_handle_destroy(o.handle));
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 10000, rank, R;
  ep_group_t group;
  ep_buffer_t buf;
  CHECK(ep_group_create_from_env(NULL, &group));
  CHECK(ep_group_rank(group, &rank));
  CHECK(ep_group_nranks(group, &R));
  CHECK(ep_buffer_create(group, NULL, &buf));
  uint16_t x[H] = {0}, *recv_x = calloc((size_t)R * H, 2), out[H];
  double *t = malloc(sizeof *t * (size_t)iters);
  for (int i = 0; i < WARMUP + iters; i++) {
    double t0 = now_us();
    round_trip(buf, rank, R, x, recv_x, out);
    if (i >= WARMUP) t[i - WARMUP] = now_us() - t0;
  }
  double call = median(t, iters);
  for (int i = 0; i < iters; i++) {
    ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
    double t0 = now_us();
    CHECK(ep_buffer_query(buf, &info));
    t[i] = now_us() - t0;
  }
  double query = median(t, iters);
  if (rank == 0)
    printf("C API, %d ranks, median of %d: dispatch+combine %.2f us, ep_buffer_query %.3f us\n", R,
           iters, call, query);
  free(t), free(recv_x);
  CHECK(ep_buffer_destroy(buf));
  CHECK(ep_group_destroy(group));
  return 0;
}
