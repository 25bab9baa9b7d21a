/* Low-latency variants, after the main rows, each its own loop and each checked against the main
 * rows' checked outputs (digests): combine with y = the bf16 view the experts wrote into, and
 * zero copy (y in ep_ll_get_combine_buffer's area); the two-phase form, each phase timed apart;
 * on backends that capture, dispatch + combine replayed as a CUDA graph; on the GPU, the overlap
 * of send -> the caller's compute kernel -> receive with its efficiency. */
#include <stdio.h>
#include <stdlib.h>

#include "bench_gpu.h"
#include "bench_ll.h"

typedef struct {
  ll_t *u;
  const char *label;
  void *zy;       /* zero copy: the handle's combine buffer */
  void *graph;    /* graph replay: the captured dispatch + combine */
  float *sink;    /* overlap: the compute kernel's */
  int burn, comm; /* overlap: compute kernel length (0: none), with communication */
} var_t;

static int call_dispatch(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_dispatch(v->u, 0) || bench_ll_view(c, v->u, it);
}

/* The experts write their outputs into the view (bf16), combine reads them in place. */
static int fill_view(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_put_y(v->u, v->u->v.recv_x);
}

static int call_combine_view(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_combine(v->u, v->u->v.recv_x, 0);
}

/* Zero copy: the experts write into the combine buffer of the handle. */
static int fill_zero_copy(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  TRY(ep_ll_get_combine_buffer(c->buf, v->u->h, &v->zy));
  return bench_ll_put_y(v->u, v->zy);
fail:
  return 1;
}

static int call_combine_zero_copy(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_combine(v->u, v->zy, 0);
}

static int check_and_drop(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_check_out(c, v->u, it, v->label) || bench_ll_drop(c, v->u, it);
}

static int one_phase(ll_t *u, const char *key, const char *label,
                     int (*fill)(bench_ctx_t *, void *, int),
                     int (*combine)(bench_ctx_t *, void *, int)) {
  var_t v = {u, label, NULL, NULL, NULL, 0, 0};
  bench_step_t s[] = {{call_dispatch, -1, 0},
                      {fill, -1, 0},
                      {combine, bench_row(u->c, key, label, BENCH_K_COMBINE), 0},
                      {check_and_drop, -1, 0}};
  return bench_run(u->c, &v, s, 4, label);
}

/* ------------------------------------------------------------------ two phases */

static int send_dispatch(bench_ctx_t *c, void *state, int it) {
  return bench_ll_dispatch(((var_t *)state)->u, 1);
}

static int receive(bench_ctx_t *c, void *state, int it) {
  TRY(ep_ll_recv(c->buf, ((var_t *)state)->u->h));
  return 0;
fail:
  return 1;
}

static int send_combine(bench_ctx_t *c, void *state, int it) {
  ll_t *u = ((var_t *)state)->u;
  return bench_ll_combine(u, u->y, 1);
}

/* The last iteration's view against the main dispatch's (its output: check_and_drop). */
static int check_view(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  uint64_t d = 0;
  if (it != c->o->iters - 1) return 0;
  const int rc = bench_ll_view(c, v->u, it) || bench_ll_view_digest(v->u, &v->u->v, &d);
  /* Agreed: the combine is next. */
  if (bench_agree_check(c, 0, !rc, "a variant's view")) return 1;
  if (d != v->u->digest_view) {
    char m[BENCH_MSG];
    snprintf(m, sizeof m,
             "rank %d: two-phase dispatch: the received rows differ from the main "
             "dispatch's (checked) ones",
             c->me);
    bench_rank_fail(c->res, 1, m);
  }
  return 0;
}

/* Timed apart; on the CPU backend a barrier before each phase, so that a receive measures the
 * wait for the slowest sender's data, not the sender's own skew. */
static int two_phase(ll_t *u) {
  bench_ctx_t *c = u->c;
  var_t v = {u, "two-phase combine", NULL, NULL, NULL, 0, 0};
  bench_step_t s[] = {
      {send_dispatch, bench_row(c, "dispatch_send", "two-phase dispatch: send", BENCH_K_DISPATCH),
       0},
      {receive, bench_row(c, "dispatch_recv", "two-phase dispatch: receive", BENCH_K_TIME), 0},
      {check_view, -1, 0},
      {send_combine, bench_row(c, "combine_send", "two-phase combine: send", BENCH_K_COMBINE), 0},
      {receive, bench_row(c, "combine_recv", "two-phase combine: receive", BENCH_K_TIME), 0},
      {check_and_drop, -1, 0}};
  return bench_run(c, &v, s, 6, "two-phase form");
}

/* ------------------------------------------------------------------ graph replay */

static int replay(bench_ctx_t *c, void *state, int it) {
  if (!bgpu_graph_launch(((var_t *)state)->graph, c->stream)) return 0;
  return fprintf(stderr, "epcomm bench: graph replay: %s\n", bgpu_error()), 1;
}

static int check_replay(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  return bench_ll_check_out(c, v->u, it, v->label);
}

/* Dispatch + combine (y = tensor) captured once; the captured handle keeps its result slot while
 * the graph is replayed. */
static int graph(ll_t *u) {
  bench_ctx_t *c = u->c;
  var_t v = {u, "graph replay", NULL, NULL, NULL, 0, 0};
  int rc = bench_sync(c) || bgpu_capture_begin(c->stream);
  if (rc) return fprintf(stderr, "epcomm bench: graph capture: %s\n", bgpu_error()), 1;
  rc = bench_ll_dispatch(u, 0) || bench_ll_combine(u, u->y, 0);
  if (bgpu_capture_end(c->stream, &v.graph) && !rc) {
    fprintf(stderr, "epcomm bench: graph capture: %s\n", bgpu_error());
    rc = 1;
  }
  bench_step_t s[] = {
      {replay, bench_row(c, "graph", "graph replay: dispatch+combine", BENCH_K_TIME), 0},
      {check_replay, -1, 0}};
  if (!rc) rc = bench_run(c, &v, s, 2, v.label);
  bgpu_graph_free(v.graph);
  if (u->h) rc |= bench_ll_drop(c, u, 0);
  return rc;
}

/* ------------------------------------------------------------------ overlap */

/* send -> compute -> receive, for the dispatch and then for the combine; either part may be
 * left out (communication alone, compute alone). */
static int round_trip(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  ll_t *u = v->u;
  if (v->comm && bench_ll_dispatch(u, 1)) return 1;
  if (v->burn && bgpu_burn(v->sink, v->burn, c->stream)) goto gpu_fail;
  if (v->comm && (receive(c, v, it) || bench_ll_combine(u, u->y, 1))) return 1;
  if (v->burn && bgpu_burn(v->sink, v->burn, c->stream)) goto gpu_fail;
  return v->comm ? receive(c, v, it) : 0;
gpu_fail:
  return fprintf(stderr, "epcomm bench: compute kernel: %s\n", bgpu_error()), 1;
}

static int after_round(bench_ctx_t *c, void *state, int it) {
  var_t *v = state;
  if (!v->comm) return 0;
  return v->burn ? check_and_drop(c, state, it) : bench_ll_drop(c, v->u, it);
}

/* The compute kernel's length for about --compute-us on the slowest rank, all ranks running it
 * at once as they will between the phases. */
static int calibrate(ll_t *u, var_t *v) {
  bench_ctx_t *c = u->c;
  bgpu_events_t *e = bgpu_events_new(2);
  double mine, all[1024];
  int rc = !e || c->R > 1024;
  v->burn = 4096;
  for (int round = 0; round < 3 && !rc; round++) {
    rc = bench_sync(c) || ep_group_barrier(c->g) || bgpu_record(e, 0, c->stream) ||
         bgpu_burn(v->sink, v->burn, c->stream) || bgpu_record(e, 1, c->stream) || bench_sync(c);
    mine = rc ? 0 : bgpu_elapsed(e, 0, 1);
    rc = rc || mine <= 0 || ep_group_allgather(c->g, &mine, all, sizeof mine);
    for (int r = 0; !rc && r < c->R; r++) mine = all[r] > mine ? all[r] : mine;
    if (!rc) v->burn = (int)(v->burn * c->o->compute_us * 1e-6 / mine) + 64;
  }
  if (rc) fprintf(stderr, "epcomm bench: calibrating the compute kernel failed\n");
  bgpu_events_free(e);
  return rc;
}

static int overlap(ll_t *u) {
  bench_ctx_t *c = u->c;
  var_t v = {u, "overlapped combine", NULL, NULL, bench_alloc(c, 4096), 0, 0};
  int rc = !v.sink || calibrate(u, &v), burn = v.burn;
  static const struct {
    const char *key, *label;
    int burn, comm;
  } kinds[] = {{"overlap_comm", "overlap: communication alone", 0, 1},
               {"overlap_compute", "overlap: compute alone", 1, 0},
               {"overlap", "overlap: send, compute, receive", 1, 1}};
  for (int k = 0; k < 3 && !rc; k++) {
    v.burn = kinds[k].burn ? burn : 0, v.comm = kinds[k].comm;
    bench_step_t s[] = {{round_trip, bench_row(c, kinds[k].key, kinds[k].label, BENCH_K_TIME), 0},
                        {after_round, -1, 0}};
    rc = bench_run(c, &v, s, 2, kinds[k].label);
  }
  bench_free(c, v.sink);
  return rc;
}

int bench_ll_variants(ll_t *u) {
  bench_ctx_t *c = u->c;
  int rc = 0;
  if (!u->fp8)
    rc = one_phase(u, "combine_view", "epcomm combine, y = view", fill_view, call_combine_view);
  if (!rc)
    rc = one_phase(u, "combine_zero_copy", "epcomm combine, zero copy", fill_zero_copy,
                   call_combine_zero_copy);
  if (!rc) rc = two_phase(u);
  if (!rc && (c->caps & EP_CAP_GRAPH_CAPTURE)) rc = graph(u);
  if (!rc && c->dev) rc = overlap(u);
  return rc;
}
