/* Low-latency mode inside `epcomm bench`: the state the main rows (bench_ll.c) and the variants
 * (bench_ll_var.c) share. */
#ifndef EP_TOOLS_BENCH_LL_H
#define EP_TOOLS_BENCH_LL_H

#include "bench.h"

typedef struct {
  bench_ctx_t *c;
  int R, me, L, fp8, max_rows;
  size_t T, K, H;
  /* inputs, where the backend wants them */
  uint16_t *x, *out; /* bf16 [T][H] tokens, combine output */
  int64_t *idx;      /* [T][K] */
  float *w;          /* [T][K] */
  uint16_t *y;       /* expert outputs [L][max_rows][H] in the view's row order */
  uint16_t *y_host;  /* the same on the host (only the received rows are ever touched) */
  int32_t *count;    /* [L] rows received per local expert (the routing never changes) */
  int32_t *dcount;   /* the same in device memory (GPU: bench_ll_put_y's one kernel) */
  int fill_copies;   /* EP_BENCH_LL_FILL=copies: bench_ll_put_y as one cudaMemcpyAsync per
                        expert (L per call) instead of one kernel, to compare the two */
  ep_ll_handle_t h;  /* of the last dispatch, until dropped */
  ep_ll_recv_view_t v;
  uint64_t digest_view, digest_out; /* of the checked main outputs */
  bench_bytes_t bytes;              /* of this rank's calls (the ll definitions, bench_ll.c) */
} ll_t;

/* One dispatch (two_phase: only its send), with u->h set. */
int bench_ll_dispatch(ll_t *u, int two_phase);
/* One combine of u->h with expert outputs y into u->out (two_phase: only its send). */
int bench_ll_combine(ll_t *u, const void *y, int two_phase);
/* Copies the expert outputs (received rows of every expert) into `dst`, on the stream: on the
 * GPU one kernel (one launch per call, equal on every rank), unless u->fill_copies. */
int bench_ll_put_y(ll_t *u, void *dst);
/* Digest of the received rows (and scales) of a view: of a host view, or of a view fetched. */
uint64_t bench_ll_digest(const ll_t *u, const ep_ll_recv_view_t *host_view);
int bench_ll_view_digest(ll_t *u, const ep_ll_recv_view_t *v, uint64_t *d);
/* bench_step_t calls: get the view; destroy the handle. */
int bench_ll_view(bench_ctx_t *c, void *state, int it);
int bench_ll_drop(bench_ctx_t *c, void *state, int it);
/* On the last iteration: u->out identical to the main combine's checked output. */
int bench_ll_check_out(bench_ctx_t *c, void *state, int it, const char *label);

int bench_ll_variants(ll_t *u);

/* Checks (bench_ll_check.c): mismatches, the first described in msg. */
long bench_ll_verify_view(const ll_t *u, const ep_ll_recv_view_t *host_view, char *msg,
                          size_t msg_len);
long bench_ll_verify_out(const ll_t *u, const uint16_t *host_out, char *msg, size_t msg_len);
/* The expert output for token t of rank src at expert e (one row per (token, expert)). */
void bench_ll_y_row(const bench_opts_t *o, int e, int src, int t, uint16_t *row);
/* A host copy of a view after the stream's work (the received rows of every expert; on the CPU
 * backend the view itself); free it with bench_ll_free_view. */
int bench_ll_fetch_view(ll_t *u, const ep_ll_recv_view_t *v, ep_ll_recv_view_t *host_view);
void bench_ll_free_view(ll_t *u, ep_ll_recv_view_t *host_view);

#endif
