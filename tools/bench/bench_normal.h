/* Normal mode inside `epcomm bench`: the state the main rows (bench_normal.c), the variants
 * (bench_normal_var.c) and the cudaMemcpy baseline (bench_cubase.c) share. */
#ifndef EP_TOOLS_BENCH_NORMAL_H
#define EP_TOOLS_BENCH_NORMAL_H

#include "bench.h"

typedef struct {
  bench_ctx_t *c;
  int R, me, views;        /* views: the main dispatch returns views (EP_CAP_DISPATCH_VIEWS) */
  size_t N, K, H, row, ns; /* tokens, topk, hidden, row bytes, scales per row */
  /* inputs, where the backend wants them */
  void *x;
  float *xs, *w;
  int64_t *idx;
  uint16_t *y;           /* expert outputs [nr][H], from the first dispatch's rows */
  uint16_t *out;         /* combine output [N][H] */
  int32_t *prefix, *tpe; /* rank_prefix [R][R], recv_tokens_per_expert [E/R] */
  struct {               /* outputs of the allocator callback: allocated once, at the first count */
    void *x;
    float *scales, *w;
    int64_t *idx;
    int32_t *src;
    int cap;
  } alloc;
  ep_dispatch_out_t last; /* outputs of the last dispatch */
  ep_handle_t h;          /* of the last full dispatch, until dropped */
  int nr;                 /* rows this rank receives */
  int worst_case;         /* full dispatches in the worst-case form: capacity nr, no host wait */
  uint64_t digest_x, digest_rows, digest_out; /* of the checked main outputs */
  bench_bytes_t bytes; /* of this rank's calls, once the first dispatch is checked */
} normal_t;

/* A full (cached: along `cached`) dispatch with outputs in `mode` (EP_OUTPUT_CALLER: into
 * recv_x / recv_scales); u->last, u->nr and (full) u->h set. 0, or 1 after saying why. */
int bench_normal_dispatch(normal_t *u, ep_handle_t cached, ep_output_mode_t mode, void *recv_x,
                          float *recv_scales);
/* The allocator callback's outputs grown to hold n rows; 0, or -1 when out of memory. */
int bench_normal_grow(normal_t *u, int n);
/* Destroys u->h (the last full dispatch's handle) and clears it, even when the destroy fails:
 * never destroyed twice. 0, or 1 after saying why. */
int bench_normal_drop(normal_t *u);
/* Digest of received rows (then scales) at x / scales, after the stream's work; 0 on failure. */
int bench_normal_digest(normal_t *u, const void *x, const float *scales, uint64_t *d);

/* Rows of the variants (bench_normal_var.c) and of the cudaMemcpy baseline (bench_cubase.c),
 * after the main rows; 0, or 1 after saying why. */
int bench_normal_variants(normal_t *u);
int bench_cubase(normal_t *u);

#endif
