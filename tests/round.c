#include "round.h"

#include "ref.h"

enum { H = 128, K = 2 };

typedef struct {
  int n;
  uint16_t *x;
  int64_t *idx;
} inputs_t;

/* Rank s's tokens: 16..47 of them, each to K distinct experts out of E. */
static void gen(inputs_t *in, int E, uint64_t seed, int s) {
  t_rng r = t_seed(seed, (uint64_t)s);
  in->n = 16 + t_below(&r, 32);
  in->x = t_xmalloc((size_t)in->n * H * 2);
  in->idx = t_xmalloc((size_t)in->n * K * sizeof(int64_t));
  for (int i = 0; i < in->n * H; i++) in->x[i] = t_rand_bf16(&r);
  for (int t = 0; t < in->n; t++) {
    int64_t a = t_below(&r, E), b = (a + 1 + t_below(&r, E - 1)) % E;
    in->idx[t * K] = a, in->idx[t * K + 1] = b;
  }
}

static long diff16(const uint16_t *a, const uint16_t *b, size_t n) {
  long d = 0;
  for (size_t i = 0; i < n; i++) d += a[i] != b[i];
  return d;
}

ep_status_t t_round(ep_buffer_t buf, int R, int me, uint64_t seed, long *wrong) {
  int E = 2 * R;
  inputs_t *in = calloc((size_t)R, sizeof *in);
  ref_rank_input_t *ri = calloc((size_t)R, sizeof *ri);
  ref_recv_t *want = calloc((size_t)R, sizeof *want);
  uint16_t **y = calloc((size_t)R, sizeof *y), **out = calloc((size_t)R, sizeof *out);
  for (int s = 0; s < R; s++) {
    gen(&in[s], E, seed, s);
    ri[s] = (ref_rank_input_t){in[s].n, in[s].x, NULL, in[s].idx, NULL};
  }
  T_CHECK(ref_dispatch(R, E, K, H * 2, 0, 0, ri, want) == 0, "reference dispatch");
  for (int s = 0; s < R; s++) {
    y[s] = (uint16_t *)want[s].x; /* the experts return their inputs */
    out[s] = t_xmalloc((size_t)in[s].n * H * 2 + 2);
  }
  T_CHECK(
      ref_combine(R, H, K, ri, want, (const uint16_t *const *)y, NULL, NULL, NULL, out, NULL) == 0,
      "reference combine");
  int cap = 0, nr = -1;
  for (int s = 0; s < R; s++) cap += in[s].n; /* every token could come here */
  /* Tensors where the buffer's backend wants them (device memory on cuda: t_dalloc). */
  size_t xb = (size_t)in[me].n * H * 2, ib = (size_t)in[me].n * K * 8;
  void *dx = t_dalloc(xb + 2), *didx = t_dalloc(ib + 8);
  t_copy_to_dev(dx, in[me].x, xb), t_copy_to_dev(didx, in[me].idx, ib);
  void *drx = t_dalloc((size_t)cap * H * 2 + 2), *dgot = t_dalloc(xb + 2);
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = dx, a.dtype = EP_DTYPE_BF16, a.num_tokens = in[me].n, a.hidden = H;
  a.topk_idx = didx, a.topk = K, a.num_experts = E;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = drx, o.capacity = cap;
  ep_status_t st = ep_dispatch(buf, &a, &o);
  *wrong = 0;
  if (!st) {
    nr = o.num_recv_tokens;
    *wrong += nr != want[me].nr ? labs((long)nr - want[me].nr) + 1 : 0;
    uint16_t *rx = t_to_host(drx, (size_t)cap * H * 2 + 2);
    if (nr == want[me].nr) *wrong += diff16(rx, y[me], (size_t)nr * H);
    free(rx);
    ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
    c.handle = o.handle, c.x = drx, c.out = dgot;
    st = ep_combine(buf, &c);
    t_dsync();
    uint16_t *got = t_to_host(dgot, xb + 2);
    if (!st) *wrong += diff16(got, out[me], (size_t)in[me].n * H);
    free(got);
    T_OK(ep_handle_destroy(o.handle));
  }
  t_dfree(dx), t_dfree(didx), t_dfree(drx), t_dfree(dgot);
  for (int s = 0; s < R; s++) free(in[s].x), free(in[s].idx), free(out[s]), ref_free_recv(&want[s]);
  free(in), free(ri), free(want), free(y), free(out);
  return st;
}
