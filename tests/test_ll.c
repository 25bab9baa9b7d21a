/* Low-latency mode against the reference (SEMANTICS.md §6), for whatever number of ranks
 * `epcomm launch -n R` gives: dispatch in bf16 and the three fp8 formats (values, scales and
 * exponent bytes bit for bit; scales row-major or column-major, §6.4), combine bit for bit with
 * the reference's fused multiply-add chain (y in caller memory, the view, or the zero-copy area),
 * over a table of buffer sizes, routings (random, skewed, masked, a rank nobody selects, all slots
 * masked on some ranks), token counts (N < T, N = T, N = 0 on some ranks) and topk up to 9; the
 * two-phase form with normal-mode calls on the same buffer between send and receive; and many
 * consecutive calls with two results alive (the buffer flip).
 *
 * The same body runs on either backend (EP_BACKEND=cuda: inputs and outputs in device memory,
 * moved with the t_d* helpers).
 *
 * Usage: tests/test_ll [matrix|flip|all] [iterations of flip]   (default: all 40)
 *        tests/test_ll time T H E TOPK ITERS [fp8]   microseconds per call (a measuring aid;
 *                                                    `epcomm bench --mode ll` is the benchmark) */
#include <time.h>

#include "ll_world.h"
#include "tk_clock.h"

static const llw_cfg_t cfgs[] = {
    {16, 256, 48, 9}, /* general */
    {6, 7168, 24, 8}, /* DeepEP's hidden size */
    {12, 64, 72, 4},  /* H not a multiple of 128: bf16 only */
    {4, 128, 288, 9}, /* DeepEP's expert count */
    {4, 128, 24, 4},  /* small: consecutive calls */
};
#define NCFG ((int)(sizeof cfgs / sizeof cfgs[0]))

typedef struct {
  int cfg;
  llw_case_t k; /* topk, routing, N, format, two_phase, in_place, combine mask, zero copy,
                  column-major scales */
} tcase_t;

static const tcase_t cases[] = {
    {0, {8, RT_UNIFORM, NM_RANDOM, F_BF16, 0, 0, 0, 0, 0}},
    {0, {9, RT_MASKED, NM_FULL, F_FP8, 1, 0, 1, 0, 0}},
    {0, {6, RT_SKEW, NM_ZERO_SOME, F_FP8_ROUND, 0, 0, 0, 0, 0}},
    {0, {4, RT_EMPTY_RANK, NM_RANDOM, F_FP8_UE8M0, 1, 0, 0, 0, 0}},
    {0, {1, RT_UNIFORM, NM_FULL, F_BF16, 1, 1, 0, 0, 0}},
    {0, {5, RT_ALLMASK, NM_RANDOM, F_FP8, 0, 0, 1, 0, 0}},
    {1, {8, RT_UNIFORM, NM_FULL, F_BF16, 0, 1, 0, 0, 0}},
    {1, {8, RT_MASKED, NM_RANDOM, F_FP8, 1, 0, 0, 0, 0}},
    {1, {8, RT_SKEW, NM_ZERO_SOME, F_FP8_UE8M0, 0, 0, 1, 0, 0}},
    {2, {3, RT_UNIFORM, NM_RANDOM, F_BF16, 1, 0, 1, 0, 0}},
    {2, {4, RT_MASKED, NM_ZERO_SOME, F_BF16, 0, 1, 0, 0, 0}},
    {3, {9, RT_UNIFORM, NM_FULL, F_FP8_ROUND, 1, 0, 0, 0, 0}},
    {3, {9, RT_SKEW, NM_RANDOM, F_BF16, 0, 0, 1, 0, 0}},
    {0, {7, RT_MASKED, NM_RANDOM, F_FP8, 0, 0, 1, 1, 0}}, /* zero-copy combine */
    {1, {8, RT_UNIFORM, NM_FULL, F_BF16, 1, 0, 0, 1, 0}}, /* zero-copy, two-phase */
    {2, {4, RT_SKEW, NM_ZERO_SOME, F_BF16, 0, 0, 0, 1, 0}},
    {1, {8, RT_UNIFORM, NM_FULL, F_FP8, 0, 0, 0, 0, 1}}, /* column-major scales */
    {1, {6, RT_MASKED, NM_RANDOM, F_FP8_UE8M0, 1, 0, 0, 1, 1}},
    {0, {5, RT_SKEW, NM_ZERO_SOME, F_FP8_ROUND, 0, 0, 1, 0, 1}},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

typedef struct {
  int R, me;
  ep_buffer_t buf[NCFG];
} ctx_t;

/* The "other work" of a two-phase call: a whole normal-mode dispatch and combine on the same
 * buffer while this call's low-latency rows are (or are not yet) arriving. */
typedef struct {
  ctx_t *x;
  ep_buffer_t buf;
  uint64_t seed;
} between_t;

static void normal_between(void *arg) {
  between_t *b = arg;
  llw_normal_round(b->buf, b->x->R, b->x->me, b->seed++);
}

static void describe(int idx, const llw_cfg_t *c, const llw_case_t *k) {
  static char desc[200];
  snprintf(desc, sizeof desc, "case %d: T=%d H=%d E=%d K=%d topk=%d %s %s %s%s%s%s%s%s", idx, c->T,
           c->H, c->E, c->K, k->topk, llw_rt_names[k->routing], llw_nm_names[k->nmode],
           llw_fmt_names[k->fmt], k->cols ? " col-major" : "", k->two_phase ? " two-phase" : "",
           k->in_place ? " y=recv_x" : "", k->zero_copy ? " zero-copy" : "",
           k->cmask ? " combine-mask" : "");
  t_case = desc;
}

static void run_case(ctx_t *x, int i) {
  const tcase_t *tc = &cases[i];
  const llw_cfg_t *c = &cfgs[tc->cfg];
  if (c->E % x->R) return;
  describe(i, c, &tc->k);
  uint64_t seed = 0x11a0000ull + (uint64_t)i * 7919 + (uint64_t)x->R;
  llw_round_t rd;
  llw_gen(&rd, x->R, x->me, c, &tc->k, seed);
  between_t b = {x, x->buf[tc->cfg], seed};
  llw_dispatch(&rd, b.buf, normal_between, &b);
  llw_combine(&rd, b.buf, seed, normal_between, &b);
  llw_free(&rd);
}

/* Round i keeps its handle while round i+1 dispatches (two results alive, slots alternate), then
 * round i is checked again (untouched by i+1's rows), combined and destroyed. */
static void flip(ctx_t *x, int iters) {
  const int cfg = NCFG - 1;
  ep_buffer_t buf = x->buf[cfg];
  llw_round_t prev = {0}, cur;
  between_t b = {x, buf, 0xf11b};
  for (int i = 0; i <= iters; i++) {
    llw_case_t k = {.topk = 1 + i % 4,
                    .routing = i % 5,
                    .nmode = i % 3,
                    .fmt = i % 4,
                    .two_phase = i % 2,
                    .cmask = i % 5 == 0};
    k.in_place = k.fmt == F_BF16 && i % 3 == 0;
    k.zero_copy = !k.in_place && i % 4 == 1;
    k.cols = k.fmt != F_BF16 && i % 3 == 1 && (k.fmt != F_FP8_UE8M0 || cfgs[cfg].H % 512 == 0);
    static char desc[120];
    snprintf(desc, sizeof desc, "flip %d: %s %s %s%s", i, llw_rt_names[k.routing],
             llw_nm_names[k.nmode], llw_fmt_names[k.fmt], k.two_phase ? " two-phase" : "");
    t_case = desc;
    if (i < iters) {
      llw_gen(&cur, x->R, x->me, &cfgs[cfg], &k, 0xf1000ull + (uint64_t)i);
      llw_dispatch(&cur, buf, i % 7 == 3 ? normal_between : NULL, &b);
    }
    if (prev.h) {
      llw_check_view(&prev);
      llw_combine(&prev, buf, 0xc0000ull + (uint64_t)i, i % 6 == 1 ? normal_between : NULL, &b);
      llw_free(&prev);
    }
    if (i < iters) prev = cur;
  }
}

/* ------------------------------------------------------------------ timing */

enum { D1, C1, DS, DR, CS, CR, NFIG }; /* one-phase dispatch, combine; two-phase phases */
static const char *fig_names[] = {"dispatch",      "combine",      "dispatch send",
                                  "dispatch recv", "combine send", "combine recv"};

static double now_us(void) {
  return 1e6 * tk_now_s();
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* One dispatch + combine; lap[] gets the microseconds of each phase. Ranks start together. */
static void timed_call(ep_group_t g, ep_buffer_t buf, llw_round_t *rd, const void *y, void *out,
                       int two, double *lap) {
  ep_ll_dispatch_args_t a;
  llw_args(rd, &a);
  a.two_phase = two;
  ep_ll_combine_args_t c = {.size = sizeof c,
                            .y = y,
                            .topk_idx = rd->didx,
                            .topk_weights = rd->dw,
                            .two_phase = two,
                            .out = out};
  T_OK(ep_group_barrier(g));
  double t0 = now_us(), t1, t2, t3;
  T_OK(ep_ll_dispatch(buf, &a, &rd->h));
  t1 = now_us();
  if (two) T_OK(ep_ll_recv(buf, rd->h));
  t2 = now_us();
  c.handle = rd->h;
  T_OK(ep_ll_combine(buf, &c));
  t3 = now_us();
  if (two) T_OK(ep_ll_recv(buf, rd->h));
  double t4 = now_us();
  if (two)
    lap[DS] = t1 - t0, lap[DR] = t2 - t1, lap[CS] = t3 - t2, lap[CR] = t4 - t3;
  else
    lap[D1] = t2 - t0, lap[C1] = t4 - t2;
  t_dsync(); /* a call returns once its work is queued on the device (cuda) */
  T_OK(ep_ll_handle_destroy(rd->h));
  rd->h = NULL;
}

static void print_figures(const llw_round_t *rd, const double *all, int fp8) {
  int R = rd->R;
  size_t row = fp8 ? (size_t)rd->c.H + (size_t)rd->c.H / 128 * 4 : (size_t)rd->c.H * 2;
  long sel = 0;
  for (int l = 0; l < rd->c.E / R; l++) sel += rd->ref[0].count[l];
  printf(
      "ll timing: R=%d T=%d H=%d E=%d topk=%d %s; median us per call over ranks "
      "(max / mean); rank 0 receives %ld rows of %zu bytes\n",
      R, rd->c.T, rd->c.H, rd->c.E, rd->k.topk, fp8 ? "fp8" : "bf16", sel, row);
  for (int f = 0; f < NFIG; f++) {
    double mx = 0, sum = 0;
    for (int r = 0; r < R; r++)
      mx = all[r * NFIG + f] > mx ? all[r * NFIG + f] : mx, sum += all[r * NFIG + f];
    printf("  %-14s %9.1f / %9.1f us", fig_names[f], mx, sum / R);
    if (f == D1)
      printf("   %.2f GB/s received by rank 0", (double)sel * (double)row / all[f] * 1e-3);
    printf("\n");
  }
}

static void time_ll(ep_group_t g, int R, int me, char **argv, int argc) {
  T_CHECK(argc >= 7, "usage: test_ll time T H E TOPK ITERS [fp8]");
  llw_cfg_t c = {atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5])};
  int iters = atoi(argv[6]), fp8 = argc > 7 && !strcmp(argv[7], "fp8"), warm = 20;
  llw_case_t k = {
      .topk = c.K, .routing = RT_UNIFORM, .nmode = NM_FULL, .fmt = fp8 ? F_FP8 : F_BF16};
  ep_buffer_t buf;
  llw_buffer(g, &c, &buf);
  llw_round_t rd;
  llw_gen(&rd, R, me, &c, &k, 42);
  size_t yn = (size_t)c.E * c.T * c.H;
  uint16_t *hy = t_xmalloc(yn * 2), *out = t_dalloc((size_t)c.T * c.H * 2);
  for (size_t i = 0; i < yn; i++) hy[i] = 0x3f80;
  uint16_t *y = t_to_dev(hy, yn * 2);
  free(hy);
  double *lap = t_xmalloc(sizeof(double) * NFIG * (size_t)iters), mine[NFIG];
  for (int two = 0; two < 2; two++)
    for (int i = -warm; i < iters; i++)
      timed_call(g, buf, &rd, y, out, two, i < 0 ? mine : lap + (size_t)i * NFIG);
  for (int f = 0; f < NFIG; f++) { /* median of each phase */
    double *v = t_xmalloc(sizeof(double) * (size_t)iters);
    for (int i = 0; i < iters; i++) v[i] = lap[(size_t)i * NFIG + f];
    qsort(v, (size_t)iters, sizeof *v, cmp_double);
    mine[f] = v[iters / 2];
    free(v);
  }
  double *all = t_xmalloc(sizeof(double) * NFIG * (size_t)R);
  T_OK(ep_group_allgather(g, mine, all, sizeof mine));
  if (me == 0) print_figures(&rd, all, fp8);
  t_dfree(y), t_dfree(out), free(lap), free(all);
  llw_free(&rd);
  T_OK(ep_buffer_destroy(buf));
}

int main(int argc, char **argv) {
  ep_group_t g;
  ctx_t x;
  t_require_backend(); /* EP_BACKEND=cuda without a GPU: "skipped: no GPU" */
  t_init(&g, &x.me, &x.R);
  const char *what = argc > 1 ? argv[1] : "all";
  if (!strcmp(what, "time")) {
    time_ll(g, x.R, x.me, argv, argc);
    t_fini(g);
    return T_PASS;
  }
  int iters = argc > 2 ? atoi(argv[2]) : 40;
  bool matrix = !strcmp(what, "all") || !strcmp(what, "matrix");
  bool flips = !strcmp(what, "all") || !strcmp(what, "flip");
  T_CHECK(matrix || flips, "usage: test_ll [matrix|flip|all] [iterations]");
  for (int c = 0; c < NCFG; c++) {
    x.buf[c] = NULL;
    if (cfgs[c].E % x.R == 0) llw_buffer(g, &cfgs[c], &x.buf[c]);
  }
  int ran = 0;
  for (int i = 0; matrix && i < NCASES; i++, ran++) run_case(&x, i);
  if (flips && x.buf[NCFG - 1]) flip(&x, iters), ran++;
  t_case = NULL;
  for (int c = NCFG - 1; c >= 0; c--) T_OK(ep_buffer_destroy(x.buf[c]));
  t_fini(g);
  if (x.me == 0) printf("test_ll %s: R=%d, %d cases passed\n", what, x.R, ran);
  return T_PASS;
}
