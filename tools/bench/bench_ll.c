/* Low-latency mode (SEMANTICS.md §6, §9), the main rows: one-phase ep_ll_dispatch and
 * ep_ll_combine (expert outputs in a separate tensor), and the ceiling. On the CPU backend every
 * iteration is barrier, ceiling, barrier, dispatch, barrier, combine; on the GPU the ceiling is
 * its own loop and dispatch + combine are issued back to back (EP_CUDA_LL_ASYNC=1 unless set
 * otherwise: no host wait between the calls). Bytes as DeepEP's low-latency test counts them:
 * selections of this rank's tokens x row bytes (fp8: H + H/128 x 4 scale bytes; combine: bf16
 * rows). The expert outputs are generated per (token, expert) once from the first dispatch's
 * view; the last iteration's view and output are checked (bench_ll_check.c). */
#include "bench_ll.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_gpu.h"

int bench_ll_dispatch(ll_t *u, int two_phase) {
  ep_ll_dispatch_args_t a = EP_LL_DISPATCH_ARGS_INIT;
  a.x = u->x, a.num_tokens = (int)u->T, a.topk_idx = u->idx, a.topk = (int)u->K;
  a.use_fp8 = u->fp8, a.two_phase = two_phase, a.stream = u->c->stream;
  TRY(ep_ll_dispatch(u->c->buf, &a, &u->h));
  return 0;
fail:
  return 1;
}

int bench_ll_combine(ll_t *u, const void *y, int two_phase) {
  ep_ll_combine_args_t a = EP_LL_COMBINE_ARGS_INIT;
  a.handle = u->h, a.y = y, a.topk_idx = u->idx, a.topk_weights = u->w, a.out = u->out;
  a.two_phase = two_phase, a.stream = u->c->stream;
  TRY(ep_ll_combine(u->c->buf, &a));
  return 0;
fail:
  return 1;
}

int bench_ll_view(bench_ctx_t *c, void *state, int it) {
  ll_t *u = state;
  u->v = (ep_ll_recv_view_t)EP_LL_RECV_VIEW_INIT;
  TRY(ep_ll_get_recv_view(u->h, &u->v));
  return 0;
fail:
  return 1;
}

int bench_ll_drop(bench_ctx_t *c, void *state, int it) {
  ep_ll_handle_t h = ((ll_t *)state)->h;
  ((ll_t *)state)->h = NULL; /* gone even when the destroy fails: never destroyed twice */
  return bench_said(ep_ll_handle_destroy(h), "ep_ll_handle_destroy");
}

/* The fill sits between the untimed dispatch and the timed combine of the view and zero-copy
 * rows, and a combine ends only after every peer's push, i.e. after every peer's fill: as L
 * copies (144 per call at R = 2, each its own operation on the stream and its own host call)
 * the ranks' fills ended apart and the earlier rank's combine window held the difference
 * (PERFORMANCE.md, the R = 2 view and zero-copy rows). One kernel keeps it short and alike. */
int bench_ll_put_y(ll_t *u, void *dst) {
  size_t blk = (size_t)u->max_rows * u->H;
  if (u->c->dev && !u->fill_copies) {
    if (!bgpu_copy_rows(dst, u->y, u->dcount, u->L, blk * 2, u->H * 2, u->c->stream)) return 0;
    return fprintf(stderr, "epcomm bench: %s\n", bgpu_error()), 1;
  }
  for (int l = 0; l < u->L; l++)
    if (bench_copy(u->c, (uint16_t *)dst + l * blk, u->y + l * blk, (size_t)u->count[l] * u->H * 2))
      return fprintf(stderr, "epcomm bench: %s\n", bench_dev_error()), 1;
  return 0;
}

/* Expert outputs y [L][max_rows][H] (only the received rows) from a host view; on the GPU the
 * received rows of each expert are uploaded. */
static int make_y(ll_t *u, const ep_ll_recv_view_t *v) {
  bench_ctx_t *c = u->c;
  size_t blk = (size_t)u->max_rows * u->H, n = (size_t)u->L * blk * 2;
  u->y_host = malloc(n + 64); /* address space; only the received rows are ever touched */
  if (!u->y_host || (c->dev && !(u->y = bench_alloc(c, n)))) return 1;
  for (int l = 0; l < u->L; l++)
    for (int s = 0; s < u->R; s++) {
      int64_t rg = v->recv_layout_range[(size_t)l * u->R + s];
      for (int i = (int)(rg >> 32); i < (int)(rg >> 32) + (int)(rg & 0xffffffff); i++)
        bench_ll_y_row(c->o, u->me * u->L + l, s, v->recv_src_info[l * (size_t)u->max_rows + i],
                       u->y_host + l * blk + (size_t)i * u->H);
    }
  if (!c->dev) return u->y = u->y_host, 0;
  if (!(u->dcount = bench_alloc(c, (size_t)u->L * 4)) ||
      bench_upload(c, u->dcount, u->count, (size_t)u->L * 4))
    return 1; /* both said why */
  for (int l = 0; l < u->L; l++)
    if (bench_upload(c, u->y + l * blk, u->y_host + l * blk, (size_t)u->count[l] * u->H * 2))
      return 1;
  return 0;
}

/* Bytes per call of this rank (DeepEP's low-latency test), and the rows it received. */
static void figures(ll_t *u, const ep_ll_recv_view_t *v) {
  bench_ctx_t *c = u->c;
  size_t row = u->fp8 ? u->H + u->H / 128 * 4 : u->H * 2;
  int64_t *idx = bench_fetch(c, u->idx, u->T * u->K * 8);
  long sel = 0, remote = 0;
  for (size_t i = 0; idx && i < u->T * u->K; i++)
    if (idx[i] >= 0) sel++, remote += idx[i] / u->L != u->me;
  free(idx);
  c->res->recv_rows = c->res->self_rows = 0;
  for (int l = 0; l < u->L; l++) {
    c->res->recv_rows += u->count[l];
    c->res->self_rows += (int)(v->recv_layout_range[(size_t)l * u->R + u->me] & 0xffffffff);
  }
  u->bytes = (bench_bytes_t){(double)sel * row, (double)remote * (row + 8), (double)sel * u->H * 2,
                             (double)remote * u->H * 2};
}

static int check_view(ll_t *u, const ep_ll_recv_view_t *hv) {
  char m[BENCH_MSG] = "";
  bench_rank_fail(u->c->res, bench_ll_verify_view(u, hv, m, sizeof m), m);
  figures(u, hv);
  u->digest_view = bench_ll_digest(u, hv);
  return 0;
}

/* After a dispatch: its view; the expert outputs the first time, the check the last time. */
static int call_keep(bench_ctx_t *c, void *state, int it) {
  ll_t *u = state;
  bench_traffic_step(c, it, &c->res->net_d, &c->res->local_d);
  int first = !u->y, last = it == c->o->iters - 1;
  int rc = bench_ll_view(c, u, it); /* on the first call, agreed below even when it fails */
  if (!first && !last) return rc;
  if (!rc && first && !(u->count = bench_fetch(c, u->v.recv_count, (size_t)u->L * 4))) rc = 1;
  ep_ll_recv_view_t hv;
  memset(&hv, 0, sizeof hv);
  if (!rc)
    rc = bench_ll_fetch_view(u, &u->v, &hv) || (first && make_y(u, &hv)) ||
         (last && check_view(u, &hv));
  bench_ll_free_view(u, &hv);
  /* Agreed the first time: a rank without its expert outputs would leave its peers in the
   * combine. */
  if (first && bench_agree(c, !rc, "its expert outputs")) rc = 1;
  /* And the last time: the next step (the combine) is collective. */
  if (last && !first && bench_agree_check(c, 0, !rc, "the dispatch's view")) rc = 1;
  return rc;
}

static int call_dispatch(bench_ctx_t *c, void *state, int it) {
  return bench_ll_dispatch(state, 0);
}

static int call_combine(bench_ctx_t *c, void *state, int it) {
  ll_t *u = state;
  return bench_ll_combine(u, u->y, 0);
}

static int call_drop(bench_ctx_t *c, void *state, int it) {
  bench_traffic_step(c, it, &c->res->net_c, &c->res->local_c);
  return bench_ll_drop(c, state, it);
}

static int check_out(ll_t *u) {
  uint16_t *out = bench_fetch(u->c, u->out, u->T * u->H * 2);
  if (!out) return 1;
  char m[BENCH_MSG] = "";
  bench_rank_fail(u->c->res, bench_ll_verify_out(u, out, m, sizeof m), m);
  u->digest_out = u->c->res->digest_out = bench_digest(out, u->T * u->H * 2, BENCH_DIGEST_SEED);
  free(out);
  return 0;
}

/* After the loop that ended in rc: its outputs checked, and agreed whatever happened here, so
 * that no rank goes on into the variants' collective calls alone. */
static int checked_out(ll_t *u, int rc) {
  return bench_agree_check(u->c, rc, rc || !check_out(u), "the combined outputs");
}

int bench_ll_check_out(bench_ctx_t *c, void *state, int it, const char *label) {
  ll_t *u = state;
  if (it != c->o->iters - 1) return 0;
  uint16_t *out = bench_fetch(c, u->out, u->T * u->H * 2);
  if (out && bench_digest(out, u->T * u->H * 2, BENCH_DIGEST_SEED) != u->digest_out) {
    char m[BENCH_MSG];
    snprintf(m, sizeof m,
             "rank %d: %s: the combined outputs differ from the main combine's "
             "(checked) ones",
             c->me, label);
    bench_rank_fail(c->res, 1, m);
  }
  const int ok = out != NULL;
  free(out);
  return bench_agree_check(c, 0, ok, "a variant's combined outputs");
}

static int main_rows(ll_t *u, int d, int cm, int m) {
  bench_ctx_t *c = u->c;
  const char *what = "low-latency mode, warm-up and timed";
  bench_step_t s[] = {{bench_ceiling_copy, m, 0},
                      {call_dispatch, d, 0},
                      {call_keep, -1, 0},
                      {call_combine, cm, 0},
                      {call_drop, -1, 0}};
  if (!c->dev) return checked_out(u, bench_run(c, u, s, 5, what));
  return checked_out(u,
                     bench_run(c, u, s, 1, "the copy ceiling") || bench_run(c, u, s + 1, 4, what));
}

static int inputs(ll_t *u) {
  bench_ctx_t *c = u->c;
  bench_opts_t ob = *c->o;
  ob.dtype = BENCH_BF16; /* the low-latency input is bf16 */
  uint16_t *x = malloc(u->T * u->H * 2 + 2);
  int64_t *idx = malloc(u->T * u->K * 8 + 8);
  float *w = malloc(u->T * u->K * 4 + 4);
  int rc = !x || !idx || !w;
  if (!rc) {
    bench_gen_x(&ob, u->me, x, NULL);
    bench_gen_route(c->o, u->me, idx, w);
    u->x = bench_alloc(c, u->T * u->H * 2), u->out = bench_alloc(c, u->T * u->H * 2);
    u->idx = bench_alloc(c, u->T * u->K * 8), u->w = bench_alloc(c, u->T * u->K * 4);
    rc = !u->x || !u->out || !u->idx || !u->w || bench_upload(c, u->x, x, u->T * u->H * 2) ||
         bench_upload(c, u->idx, idx, u->T * u->K * 8) || bench_upload(c, u->w, w, u->T * u->K * 4);
  }
  free(x), free(idx), free(w);
  return rc;
}

static void release(ll_t *u) {
  bench_ctx_t *c = u->c;
  if (u->h) ep_ll_handle_destroy(u->h);
  bench_free(c, u->x), bench_free(c, u->out), bench_free(c, u->idx), bench_free(c, u->w);
  if (c->dev) bench_free(c, u->y), bench_free(c, u->dcount);
  free(u->y_host), free(u->count);
}

int bench_ll(bench_ctx_t *c) {
  const bench_opts_t *o = c->o;
  ll_t u = {.c = c,
            .R = c->R,
            .me = c->me,
            .L = o->experts / c->R,
            .fp8 = o->dtype == BENCH_FP8,
            .max_rows = c->R * o->tokens,
            .T = (size_t)o->tokens,
            .K = (size_t)o->topk,
            .H = (size_t)o->hidden};
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = o->tokens, cfg.ll_hidden = o->hidden, cfg.ll_num_experts = o->experts;
  cfg.ll_max_topk = o->topk;
  /* The GPU time of the calls, queued back to back: no host wait for a call's verdict. */
  if (o->backend == BENCH_CUDA) setenv("EP_CUDA_LL_ASYNC", "1", 0);
  u.fill_copies = o->ll_fill_copies;
  int rc = bench_ctx_open(c, &cfg);
  if (!rc) rc = bench_agree(c, !inputs(&u), "its inputs"); /* no rank in a dispatch alone */
  int row[3];
  bench_main_rows(c, row);
  if (!rc) rc = main_rows(&u, row[0], row[1], row[2]);
  if (!rc && o->variants == BENCH_VARIANTS_ALL) rc = bench_ll_variants(&u);
  bench_apply_bytes(c, &u.bytes);
  release(&u);
  bench_ctx_close(c);
  return rc;
}
