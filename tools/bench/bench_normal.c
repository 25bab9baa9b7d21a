/* Normal mode, the main rows: a full dispatch (synchronous path; outputs from an allocator
 * callback as a framework allocates them, or views where the backend has them), a combine of
 * expert outputs in a separate tensor, and the ceiling. On the CPU backend every iteration is
 * barrier, ceiling, barrier, dispatch, barrier, combine; on the GPU each row is its own loop of
 * calls issued back to back. The expert outputs are generated once from what the first dispatch
 * delivered; the last iteration's outputs are checked against the generator (bench_check.c). */
#include "bench_normal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The allocator callback: outputs grown once and touched, so no iteration pays for page
 * faults (device memory on the GPU). */
int bench_normal_grow(normal_t *u, int n) {
  if (n <= u->alloc.cap) return 0;
  bench_ctx_t *c = u->c;
  size_t rows = (size_t)n;
  bench_free(c, u->alloc.x), bench_free(c, u->alloc.scales), bench_free(c, u->alloc.idx);
  bench_free(c, u->alloc.w), bench_free(c, u->alloc.src);
  u->alloc.x = bench_alloc(c, rows * u->row);
  u->alloc.scales = bench_alloc(c, rows * u->ns * sizeof(float));
  u->alloc.idx = bench_alloc(c, rows * u->K * sizeof(int64_t));
  u->alloc.w = bench_alloc(c, rows * u->K * sizeof(float));
  u->alloc.src = bench_alloc(c, rows * sizeof(int32_t));
  u->alloc.cap = n;
  if (u->alloc.x && u->alloc.scales && u->alloc.idx && u->alloc.w && u->alloc.src) return 0;
  u->alloc.cap = 0;
  return -1;
}

static int alloc_cb(void *ctx, const ep_dispatch_args_t *a, int n, ep_dispatch_out_t *out) {
  normal_t *u = ctx;
  if (bench_normal_grow(u, n)) return -1;
  out->recv_x = u->alloc.x;
  out->recv_x_scales = u->ns ? u->alloc.scales : NULL;
  out->recv_topk_idx = a->topk_idx ? u->alloc.idx : NULL; /* a cached dispatch returns no ids */
  out->recv_topk_weights = a->topk_idx ? u->alloc.w : NULL;
  out->recv_src_idx = u->alloc.src;
  return 0;
}

int bench_normal_dispatch(normal_t *u, ep_handle_t cached, ep_output_mode_t mode, void *recv_x,
                          float *recv_scales) {
  const bench_opts_t *o = u->c->o;
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = u->x, a.dtype = (ep_dtype_t)o->dtype, a.num_tokens = o->tokens, a.hidden = o->hidden;
  a.x_scales = u->ns ? u->xs : NULL, a.topk_idx = u->idx, a.topk_weights = u->w;
  a.topk = o->topk, a.num_experts = o->experts, a.cached = cached, a.stream = u->c->stream;
  ep_dispatch_out_t d = EP_DISPATCH_OUT_INIT;
  d.mode = mode, d.alloc = alloc_cb, d.alloc_ctx = u;
  d.worst_case = u->worst_case && !cached;
  d.capacity = d.worst_case && u->nr < 1 ? 1 : u->nr; /* worst case: at least a row */
  d.recv_x = recv_x, d.recv_x_scales = recv_scales;
  d.rank_prefix = cached ? NULL : u->prefix, d.recv_tokens_per_expert = cached ? NULL : u->tpe;
  TRY(ep_dispatch(u->c->buf, &a, &d));
  u->last = d;
  if (d.num_recv_tokens >= 0) u->nr = d.num_recv_tokens; /* -1: worst case, routing fixed */
  if (!cached) u->h = d.handle;
  return 0;
fail:
  return 1;
}

int bench_normal_digest(normal_t *u, const void *x, const float *scales, uint64_t *d) {
  size_t nr = (size_t)u->nr;
  void *hx = bench_fetch(u->c, x, nr * u->row);
  float *hs = u->ns && hx ? bench_fetch(u->c, scales, nr * u->ns * 4) : NULL;
  int rc = !hx || (u->ns && !hs);
  if (!rc) *d = bench_digest(hx, nr * u->row, BENCH_DIGEST_SEED);
  if (!rc && hs) *d = bench_digest(hs, nr * u->ns * 4, *d);
  free(hx), free(hs);
  return rc;
}

/* ------------------------------------------------------------------ the steps */

static int call_dispatch(bench_ctx_t *c, void *state, int it) {
  normal_t *u = state;
  return bench_normal_dispatch(u, NULL, u->views ? EP_OUTPUT_VIEWS : EP_OUTPUT_ALLOC, NULL, NULL);
}

static int call_combine(bench_ctx_t *c, void *state, int it) {
  normal_t *u = state;
  ep_combine_args_t a = EP_COMBINE_ARGS_INIT;
  a.handle = u->h, a.x = u->y, a.out = u->out, a.stream = c->stream;
  TRY(ep_combine(c->buf, &a));
  return 0;
fail:
  return 1;
}

int bench_normal_drop(normal_t *u) {
  ep_handle_t h = u->h;
  u->h = NULL;
  return bench_said(ep_handle_destroy(h), "ep_handle_destroy");
}

static int call_drop(bench_ctx_t *c, void *state, int it) {
  bench_traffic_step(c, it, &c->res->net_c, &c->res->local_c);
  return bench_normal_drop(state);
}

/* Expert outputs: row j (from source s, token src_idx[j]) gets bench_gen_y_row(me, s, t). */
static int make_y(normal_t *u) {
  bench_ctx_t *c = u->c;
  int32_t *src = bench_fetch(c, u->last.recv_src_idx, (size_t)u->nr * 4);
  int32_t *prefix = bench_fetch(c, u->prefix, (size_t)u->R * u->R * 4);
  uint16_t *y = malloc((size_t)(u->nr ? u->nr : 1) * u->H * 2);
  int rc =
      !src || !prefix || !y || !(u->y = bench_alloc(c, (size_t)(u->nr ? u->nr : 1) * u->H * 2));
  for (int s = 0, j = 0; !rc && s < u->R; s++)
    for (; j < prefix[(size_t)s * u->R + u->me] && j < u->nr; j++)
      bench_gen_y_row(c->o, u->me, s, src[j], y + (size_t)j * u->H);
  if (!rc && bench_upload(c, u->y, y, (size_t)u->nr * u->H * 2)) rc = 1;
  free(src), free(prefix), free(y);
  return rc;
}

/* Rows received in all and from itself, and what they weigh (bench_normal_bytes). */
static void figures(normal_t *u, const int32_t *prefix) {
  int R = u->R, me = u->me;
  int self = prefix[(size_t)me * R + me] - (me ? prefix[(size_t)(me - 1) * R + me] : 0);
  u->c->res->recv_rows = u->nr, u->c->res->self_rows = self;
  u->bytes = bench_normal_bytes(u->c->o, u->nr, self);
}

/* The last dispatch's outputs against the generator; their digests kept for the variants. */
static int check_dispatch(normal_t *u) {
  bench_ctx_t *c = u->c;
  const ep_dispatch_out_t *d = &u->last;
  size_t nr = (size_t)u->nr;
  void *x = bench_fetch(c, d->recv_x, nr * u->row);
  float *sc = u->ns ? bench_fetch(c, d->recv_x_scales, nr * u->ns * 4) : NULL;
  int64_t *idx = bench_fetch(c, d->recv_topk_idx, nr * u->K * 8);
  float *w = bench_fetch(c, d->recv_topk_weights, nr * u->K * 4);
  int32_t *src = bench_fetch(c, d->recv_src_idx, nr * 4);
  int32_t *prefix = bench_fetch(c, u->prefix, (size_t)u->R * u->R * 4);
  int32_t *tpe = bench_fetch(c, u->tpe, (size_t)(c->o->experts / u->R) * 4);
  int rc = !x || (u->ns && !sc) || !idx || !w || !src || !prefix || !tpe;
  if (!rc) {
    bench_recv_t rv = {u->nr, x, sc, idx, w, src, prefix, tpe};
    char m[BENCH_MSG] = "";
    bench_rank_fail(c->res, bench_check_dispatch(c->o, u->R, u->me, &rv, m, sizeof m), m);
    u->digest_rows = bench_digest(x, nr * u->row, BENCH_DIGEST_SEED);
    u->digest_x = sc ? bench_digest(sc, nr * u->ns * 4, u->digest_rows) : u->digest_rows;
    c->res->digest_rows = u->digest_rows, c->res->digest_x = u->digest_x;
    figures(u, prefix);
  }
  free(x), free(sc), free(idx), free(w), free(src), free(prefix), free(tpe);
  return rc;
}

/* Across hosts, from this rank's routing: (token, other host) pairs, and the rows a flat
 * all-to-all sends to ranks of other hosts and to other ranks of this host. */
static void host_figures(normal_t *u, const int64_t *idx) {
  const bench_opts_t *o = u->c->o;
  int K = o->topk, per = o->experts / u->R, G = o->nhosts, R = u->R, me = u->me;
  bench_rank_t *f = u->c->res;
  uint8_t *rank_seen = malloc((size_t)R), *host_seen = malloc((size_t)G);
  for (int t = 0; rank_seen && host_seen && t < o->tokens; t++) {
    memset(rank_seen, 0, (size_t)R), memset(host_seen, 0, (size_t)G);
    for (int k = 0; k < K; k++)
      if (idx[(size_t)t * K + k] >= 0) rank_seen[idx[(size_t)t * K + k] / per] = 1;
    for (int r = 0; r < R; r++) {
      if (!rank_seen[r]) continue;
      int away = o->host_of[r] != o->host_of[me];
      f->remote_rank_rows += away, f->local_rank_rows += !away && r != me;
      if (away && !host_seen[o->host_of[r]]) host_seen[o->host_of[r]] = 1, f->host_pairs++;
    }
  }
  free(rank_seen), free(host_seen);
}

/* After a dispatch: the expert outputs the first time, the check the last time. */
static int call_keep(bench_ctx_t *c, void *state, int it) {
  normal_t *u = state;
  bench_traffic_step(c, it, &c->res->net_d, &c->res->local_d);
  /* Agreed: a rank without its expert outputs would leave its peers in the combine. */
  if (!u->y && bench_agree(c, !make_y(u), "its expert outputs")) return 1;
  /* Agreed too: a rank that could not fetch its outputs would leave its peers in the next
   * collective call until their deadline. */
  return it == c->o->iters - 1 &&
         bench_agree_check(c, 0, !check_dispatch(u), "the dispatch's outputs");
}

static int check_combine(normal_t *u) {
  bench_ctx_t *c = u->c;
  uint16_t *out = bench_fetch(c, u->out, u->N * u->H * 2);
  if (!out) return 1;
  char m[BENCH_MSG] = "";
  bench_rank_fail(c->res, bench_check_combine(c->o, u->R, u->me, out, m, sizeof m), m);
  u->digest_out = c->res->digest_out = bench_digest(out, u->N * u->H * 2, BENCH_DIGEST_SEED);
  free(out);
  return 0;
}

/* After the loop that ended in rc: its outputs checked, and agreed whatever happened here, so
 * that no rank goes on into the variants' collective calls alone. */
static int checked_combine(normal_t *u, int rc) {
  return bench_agree_check(u->c, rc, rc || !check_combine(u), "the combined outputs");
}

/* ------------------------------------------------------------------ main rows */

/* CPU: one interleaved loop. GPU: each row alone, back to back; the combine along one handle
 * (its x a separate tensor: how many calls copied it into the combine buffer is reported). */
static int main_rows(normal_t *u, int d, int cm, int m) {
  bench_ctx_t *c = u->c;
  const char *what = "normal mode, warm-up and timed";
  if (!c->dev) {
    bench_step_t s[] = {{bench_ceiling_copy, m, 0},
                        {call_dispatch, d, 0},
                        {call_keep, -1, 0},
                        {call_combine, cm, 0},
                        {call_drop, -1, 0}};
    return checked_combine(u, bench_run(c, u, s, 5, what));
  }
  bench_step_t sm[] = {{bench_ceiling_copy, m, 0}},
               sd[] = {{call_dispatch, d, 0}, {call_keep, -1, 0}, {call_drop, -1, 0}},
               sc[] = {{call_combine, cm, 0}};
  if (bench_run(c, u, sm, 1, "the copy ceiling") || bench_run(c, u, sd, 3, what) ||
      call_dispatch(c, u, 0))
    return 1;
  const uint64_t copied = bench_info(c).combines_copied;
  if (bench_run(c, u, sc, 1, "normal mode, combine")) return 1;
  bench_path_set(c, &c->res->combine_copy, copied, bench_info(c).combines_copied);
  return checked_combine(u, 0) || call_drop(c, u, 0);
}

static int inputs(normal_t *u) {
  bench_ctx_t *c = u->c;
  const bench_opts_t *o = c->o;
  void *x = malloc(u->N * u->row + 1);
  float *xs = malloc(u->N * u->ns * 4 + 4), *w = malloc(u->N * u->K * 4 + 4);
  int64_t *idx = malloc(u->N * u->K * 8 + 8);
  int rc = !x || !xs || !w || !idx;
  if (!rc) {
    bench_gen_x(o, u->me, x, u->ns ? xs : NULL);
    bench_gen_route(o, u->me, idx, w);
    if (o->nhosts > 1) host_figures(u, idx);
    u->x = bench_alloc(c, u->N * u->row), u->xs = bench_alloc(c, u->N * u->ns * 4);
    u->idx = bench_alloc(c, u->N * u->K * 8), u->w = bench_alloc(c, u->N * u->K * 4);
    u->out = bench_alloc(c, u->N * u->H * 2);
    u->prefix = bench_alloc(c, (size_t)u->R * u->R * 4);
    u->tpe = bench_alloc(c, (size_t)(o->experts / u->R) * 4);
    rc = !u->x || !u->xs || !u->idx || !u->w || !u->out || !u->prefix || !u->tpe ||
         bench_upload(c, u->x, x, u->N * u->row) || bench_upload(c, u->xs, xs, u->N * u->ns * 4) ||
         bench_upload(c, u->idx, idx, u->N * u->K * 8) || bench_upload(c, u->w, w, u->N * u->K * 4);
  }
  free(x), free(xs), free(w), free(idx);
  return rc;
}

static void release(normal_t *u) {
  bench_ctx_t *c = u->c;
  if (u->h) ep_handle_destroy(u->h);
  bench_free(c, u->x), bench_free(c, u->xs), bench_free(c, u->idx), bench_free(c, u->w);
  bench_free(c, u->y), bench_free(c, u->out), bench_free(c, u->prefix), bench_free(c, u->tpe);
  bench_free(c, u->alloc.x), bench_free(c, u->alloc.scales), bench_free(c, u->alloc.idx);
  bench_free(c, u->alloc.w), bench_free(c, u->alloc.src);
}

/* On the GPU the receive area holds the worst case (every token to every rank): views need
 * every row at once. */
static void buffer_config(const bench_opts_t *o, int dev, ep_buffer_config_t *cfg) {
  size_t H = (size_t)o->hidden;
  size_t per_row = H * 2 + (size_t)o->topk * 12 + 4 + H / 128 * 4;
  if (dev) cfg->queue_bytes = (size_t)o->tokens * per_row + ((size_t)1 << 20);
}

int bench_normal(bench_ctx_t *c) {
  const bench_opts_t *o = c->o;
  normal_t u = {.c = c,
                .R = c->R,
                .me = c->me,
                .N = (size_t)o->tokens,
                .K = (size_t)o->topk,
                .H = (size_t)o->hidden,
                .row = bench_row_bytes(o),
                .ns = (size_t)bench_num_scales(o)};
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  buffer_config(o, o->backend == BENCH_CUDA, &cfg);
  int rc = bench_ctx_open(c, &cfg);
  if (!rc) rc = bench_agree(c, !inputs(&u), "its inputs"); /* no rank in a dispatch alone */
  u.views = (c->caps & EP_CAP_DISPATCH_VIEWS) != 0;
  int row[3];
  bench_main_rows(c, row);
  if (!rc) bench_traffic_step(c, -1, NULL, NULL); /* the counters before the first call */
  if (!rc) rc = main_rows(&u, row[0], row[1], row[2]);
  if (!rc && o->variants == BENCH_VARIANTS_ALL) rc = bench_normal_variants(&u);
  if (!rc && o->baseline != BENCH_BASELINE_OFF && c->dev) rc = bench_cubase(&u);
  bench_apply_bytes(c, &u.bytes);
  release(&u);
  bench_ctx_close(c);
  return rc;
}
