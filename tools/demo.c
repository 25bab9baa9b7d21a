/* `epcomm demo` (run under `epcomm launch -n R`): one MoE layer's worth of traffic on the default
 * CPU backend. Every rank dispatches random tokens, "runs experts" (scales each row by 2), combines
 * them back, checks both steps bit for bit against the single-process reference of
 * docs/SEMANTICS.md, and
 * rank 0 prints a table of what moved and how fast. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "epcomm.h"
#include "ref.h"
#include "tk_clock.h"
#include "tk_rng.h"

typedef struct {
  int tokens, hidden, topk, experts, iters;
} demo_opts_t;

typedef struct {
  int32_t recv;
  double dispatch_s, combine_s, bytes_in;
  int32_t ok;
} figures_t;

#define CHECK(call)                                                                   \
  do {                                                                                \
    ep_status_t st_ = (call);                                                         \
    if (st_) {                                                                        \
      fprintf(stderr, "epcomm demo: %s: %s\n", ep_status_name(st_), ep_last_error()); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

/* Rank r's tokens, rebuilt identically by every rank (the reference needs all of them). */
static void make_input(const demo_opts_t *o, int r, uint16_t *x, int64_t *idx) {
  uint64_t s = 1234567 + (uint64_t)r;
  for (size_t i = 0; i < (size_t)o->tokens * o->hidden; i++)
    x[i] = ref_f32_to_bf16((float)(int)(tk_splitmix(&s) % 2001 - 1000) / 256.0f);
  for (int t = 0; t < o->tokens; t++)
    for (int k = 0; k < o->topk; k++) {
      int64_t e;
      int dup;
      do { /* topk distinct experts, like torch.topk over router scores */
        e = (int64_t)(tk_splitmix(&s) % (uint64_t)o->experts);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= idx[(size_t)t * o->topk + j] == e;
      } while (dup);
      idx[(size_t)t * o->topk + k] = e;
    }
}

/* The reference for the whole group; returns whether this rank's outputs match it. */
static int verify(const demo_opts_t *o, int R, int me, const uint16_t *rx, int nr,
                  const uint16_t *out) {
  ref_rank_input_t *in = calloc((size_t)R, sizeof *in);
  ref_recv_t *rr = calloc((size_t)R, sizeof *rr);
  uint16_t **xs = calloc((size_t)R, sizeof *xs), **ys = calloc((size_t)R, sizeof *ys);
  uint16_t **outs = calloc((size_t)R, sizeof *outs);
  int64_t **idx = calloc((size_t)R, sizeof *idx);
  for (int r = 0; r < R; r++) {
    xs[r] = malloc((size_t)o->tokens * o->hidden * 2);
    idx[r] = malloc((size_t)o->tokens * o->topk * 8);
    make_input(o, r, xs[r], idx[r]);
    in[r] = (ref_rank_input_t){o->tokens, xs[r], NULL, idx[r], NULL};
    outs[r] = malloc((size_t)o->tokens * o->hidden * 2 + 2);
  }
  int ok = ref_dispatch(R, o->experts, o->topk, (size_t)o->hidden * 2, 0, 1, in, rr) == 0;
  for (int r = 0; r < R && ok; r++) { /* the "expert": y = 2x, exact in bf16 */
    ys[r] = malloc((size_t)rr[r].nr * o->hidden * 2 + 2);
    for (size_t i = 0; i < (size_t)rr[r].nr * o->hidden; i++)
      ys[r][i] = ref_f32_to_bf16(2.0f * ref_bf16_to_f32(((uint16_t *)rr[r].x)[i]));
  }
  ok = ok && ref_combine(R, o->hidden, o->topk, in, rr, (const uint16_t *const *)ys, NULL, NULL,
                         NULL, outs, NULL) == 0;
  ok = ok && rr[me].nr == nr && !memcmp(rx, rr[me].x, (size_t)nr * o->hidden * 2) &&
       !memcmp(out, outs[me], (size_t)o->tokens * o->hidden * 2);
  for (int r = 0; r < R; r++) {
    ref_free_recv(&rr[r]);
    free(xs[r]), free(ys[r]), free(outs[r]), free(idx[r]);
  }
  free(in), free(rr), free(xs), free(ys), free(outs), free(idx);
  return ok;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: epcomm demo [--tokens N] [--hidden H] [--topk K] [--experts E] [--iters I]\n"
          "Run it under `epcomm launch -n R`: every rank dispatches N random bf16 tokens of\n"
          "hidden size H to K of E experts, scales the rows by 2, combines them back, checks\n"
          "both against the reference, and rank 0 prints the figures (best of I calls).\n"
          "defaults: N 512, H 7168, K 8, E 256 (rounded down to a multiple of the ranks), I 5\n"
          "ranges:   N 1..65536, H 8..65536 (a multiple of 8), K 1..64, E R..65536 and >= K,\n"
          "          I 1..1000\n");
}

/* Only rank 0 (or a process started alone) prints usage and option errors. */
static int speaks(void) {
  const char *r = getenv("EP_RANK");
  return !r || atoi(r) == 0;
}

/* Returns -1 to go on, else an exit status. */
static int parse_one(demo_opts_t *o, const char *k, const char *v) {
  static const struct {
    const char *name;
    size_t off;
    int lo, hi;
  } opts[] = {{"--tokens", offsetof(demo_opts_t, tokens), 1, 65536},
              {"--hidden", offsetof(demo_opts_t, hidden), 8, 65536},
              {"--topk", offsetof(demo_opts_t, topk), 1, 64},
              {"--experts", offsetof(demo_opts_t, experts), 1, 65536},
              {"--iters", offsetof(demo_opts_t, iters), 1, 1000}};
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
    if (strcmp(k, opts[i].name)) continue;
    char *end;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < opts[i].lo || x > opts[i].hi) {
      if (speaks())
        fprintf(stderr, "epcomm demo: %s '%s': want an integer from %d to %d\n", k, v ? v : "",
                opts[i].lo, opts[i].hi);
      return 2;
    }
    *(int *)((char *)o + opts[i].off) = (int)x;
    return -1;
  }
  if (speaks()) fprintf(stderr, "epcomm demo: unknown option '%s'\n", k), usage(stderr);
  return 2;
}

static int parse(int argc, char **argv, demo_opts_t *o) {
  *o = (demo_opts_t){512, 7168, 8, 256, 5};
  for (int i = 1; i < argc; i += 2) { /* "--name value" pairs */
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      if (speaks()) usage(stdout);
      return 1 << 8; /* caller: exit 0 */
    }
    int rc = parse_one(o, argv[i], i + 1 < argc ? argv[i + 1] : NULL);
    if (rc >= 0) return rc;
  }
  if (o->hidden % 8) {
    if (speaks())
      fprintf(stderr,
              "epcomm demo: --hidden %d: a bf16 row must be a multiple of 16 "
              "bytes: want a multiple of 8\n",
              o->hidden);
    return 2;
  }
  return 0;
}

/* One timed dispatch + "expert" + combine; the last iteration's outputs are kept for checking. */
static void run_iters(ep_buffer_t buf, const demo_opts_t *o, const uint16_t *x, const int64_t *idx,
                      uint16_t *rx, int cap, uint16_t *y, uint16_t *out, figures_t *f) {
  f->dispatch_s = f->combine_s = 1e30;
  for (int it = 0; it < o->iters; it++) {
    ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
    a.x = x, a.dtype = EP_DTYPE_BF16, a.num_tokens = o->tokens, a.hidden = o->hidden;
    a.topk_idx = idx, a.topk = o->topk, a.num_experts = o->experts;
    ep_dispatch_out_t d = EP_DISPATCH_OUT_INIT;
    d.mode = EP_OUTPUT_CALLER, d.recv_x = rx, d.capacity = cap;
    double t0 = tk_now_s();
    CHECK(ep_dispatch(buf, &a, &d));
    double t1 = tk_now_s();
    int nr = d.num_recv_tokens;
    ep_handle_t h = d.handle;
    for (size_t i = 0; i < (size_t)nr * o->hidden; i++)
      y[i] = ref_f32_to_bf16(2.0f * ref_bf16_to_f32(rx[i]));
    ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = y, .out = out};
    double t2 = tk_now_s();
    CHECK(ep_combine(buf, &c));
    double t3 = tk_now_s();
    CHECK(ep_handle_destroy(h));
    if (t1 - t0 < f->dispatch_s) f->dispatch_s = t1 - t0; /* best of the iterations */
    if (t3 - t2 < f->combine_s) f->combine_s = t3 - t2;
    f->recv = nr;
  }
  f->bytes_in = (double)f->recv * o->hidden * 2;
}

static void print_table(const demo_opts_t *o, int R, const figures_t *all) {
  printf(
      "epcomm demo: %d ranks, cpu backend, %d tokens/rank, hidden %d (bf16), topk %d, "
      "%d experts\n\n",
      R, o->tokens, o->hidden, o->topk, o->experts);
  printf("rank  recv_tokens  recv_MB  dispatch_ms  dispatch_GB/s  combine_ms  combine_GB/s\n");
  int ok = 1;
  for (int r = 0; r < R; r++) {
    const figures_t *f = &all[r];
    printf("%4d  %11d  %7.1f  %11.2f  %13.2f  %10.2f  %12.2f\n", r, f->recv, f->bytes_in / 1e6,
           f->dispatch_s * 1e3, f->bytes_in / f->dispatch_s / 1e9, f->combine_s * 1e3,
           f->bytes_in / f->combine_s / 1e9);
    ok &= f->ok;
  }
  printf("\n(GB/s as DeepEP counts it: received rows x row bytes / time; best of %d calls)\n",
         o->iters);
  printf("check: %s\n", ok ? "dispatch and combine match the reference bit for bit on every rank"
                           : "MISMATCH against the reference");
}

int ep_cmd_demo(int argc, char **argv) {
  demo_opts_t o;
  int rc = parse(argc, argv, &o);
  if (rc) return rc == 1 << 8 ? 0 : rc;
  ep_group_t g;
  int me, R;
  CHECK(ep_group_create_from_env(NULL, &g));
  CHECK(ep_group_rank(g, &me));
  CHECK(ep_group_nranks(g, &R));
  int asked = o.experts;
  o.experts -= o.experts % R;                /* nearest E divisible by R */
  if (o.experts < R || o.experts < o.topk) { /* every rank stops; rank 0 says why */
    int lo = ((o.topk > R ? o.topk : R) + R - 1) / R * R;
    if (me == 0)
      fprintf(stderr,
              "epcomm demo: --experts %d: with %d ranks and --topk %d, want a multiple "
              "of %d from %d to 65536\n",
              asked, R, o.topk, R, lo);
    CHECK(ep_group_destroy(g));
    return 2;
  }
  ep_buffer_t buf;
  CHECK(ep_buffer_create(g, NULL, &buf));
  uint16_t *x = malloc((size_t)o.tokens * o.hidden * 2);
  int64_t *idx = malloc((size_t)o.tokens * o.topk * 8);
  int cap = o.tokens * R;
  uint16_t *rx = malloc((size_t)cap * o.hidden * 2), *y = malloc((size_t)cap * o.hidden * 2);
  uint16_t *out = malloc((size_t)o.tokens * o.hidden * 2);
  make_input(&o, me, x, idx);
  figures_t f, *all = calloc((size_t)R, sizeof *all);
  run_iters(buf, &o, x, idx, rx, cap, y, out, &f);
  f.ok = verify(&o, R, me, rx, f.recv, out);
  CHECK(ep_group_allgather(g, &f, all, sizeof f));
  if (me == 0) print_table(&o, R, all);
  int ok = 1;
  for (int r = 0; r < R; r++) ok &= all[r].ok;
  free(x), free(idx), free(rx), free(y), free(out), free(all);
  CHECK(ep_buffer_destroy(buf));
  CHECK(ep_group_destroy(g));
  return ok ? 0 : 1;
}
