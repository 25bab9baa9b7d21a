/* The row kernels of the CPU backend's low-latency mode (src/cpu/cpu_ll_kernels.c) against the
 * reference, single process: the fp8 cast over every bf16 value (in shuffled blocks with
 * scales over the whole range, all-zero, NaN and infinite blocks) for the three formats, the
 * scalar e4m3 conversion over a sample of all floats, and the combine's reduction (fmaf chain,
 * bf16 rounding, NaN) for 0..9 rows. Both kernel sets: the portable one and the one the
 * processor gets. Internal API: this test includes a backend header on purpose. */
#include <math.h>

#include "common.h"
#include "cpu/cpu_ll.h"
#include "ref.h"

#define H 65536 /* one row holding every bf16 value once */

static void shuffle(uint16_t *x, int n, t_rng *r) {
  for (int i = n - 1; i > 0; i--) {
    int j = t_below(r, i + 1);
    uint16_t t = x[i];
    x[i] = x[j], x[j] = t;
  }
}

/* Blocks of 128: every bf16 code somewhere, a few blocks rescaled to one binade, special ones. */
static void make_row(uint16_t *x, t_rng *r) {
  for (int i = 0; i < H; i++) x[i] = (uint16_t)i;
  shuffle(x, H, r);
  for (int b = 0; b < H / 128; b += 3) { /* keep signs/mantissas, narrow the exponents */
    int e = 100 + t_below(r, 60);
    for (int i = b * 128; i < b * 128 + 128; i++)
      x[i] = (uint16_t)((x[i] & 0x807f) | (e + t_below(r, 3)) << 7);
  }
  for (int i = 0; i < 128; i++) x[i] = 0;                                     /* amax floor */
  for (int i = 128; i < 256; i++) x[i] = (uint16_t)(i & 1 ? 0x7f80 : 0x3f80); /* +inf */
  for (int i = 256; i < 384; i++) x[i] = (uint16_t)(i & 1 ? 0x7fc1 : 0xbf80); /* NaN */
  for (int i = 384; i < 512; i++) x[i] = (uint16_t)(i & 7);                   /* bf16 subnormals */
}

static void check_cast(const cpu_ll_kernels_t *k, const char *name, const uint16_t *x) {
  uint8_t *q = t_xmalloc(H), *wq = t_xmalloc(H), *e8 = t_xmalloc(H / 128),
          *we8 = t_xmalloc(H / 128);
  float *sc = t_xmalloc(H / 128 * 4), *wsc = t_xmalloc(H / 128 * 4);
  for (int fmt = 0; fmt < 3; fmt++) {
    int round = fmt > 0, ue8m0 = fmt == 2;
    ref_ll_cast_row(x, H, round, ue8m0, wq, wsc, we8);
    k->cast_row(x, H, round, ue8m0, q, ue8m0 ? (void *)e8 : (void *)sc);
    for (int i = 0; i < H; i++)
      T_CHECK(q[i] == wq[i],
              "%s cast (format %d): value %d (bf16 0x%04x, block scale %g) is "
              "0x%02x, reference 0x%02x (scale %g)",
              name, fmt, i, x[i], (double)wsc[i / 128], q[i], wq[i], (double)sc[i / 128]);
    if (ue8m0)
      T_CHECK(!memcmp(e8, we8, H / 128), "%s cast: ue8m0 bytes differ", name);
    else
      T_CHECK(!memcmp(sc, wsc, H / 128 * 4), "%s cast (format %d): scales differ", name, fmt);
  }
  free(q), free(wq), free(e8), free(we8), free(sc), free(wsc);
}

static void check_e4m3_sample(void) {
  for (uint64_t u = 0; u < (1ull << 32); u += 251) {
    float f;
    uint32_t b = (uint32_t)u;
    memcpy(&f, &b, 4);
    T_CHECK(cpu_ll_f32_to_e4m3(f) == ref_f32_to_e4m3(f), "e4m3(0x%08x): 0x%02x, reference 0x%02x",
            b, cpu_ll_f32_to_e4m3(f), ref_f32_to_e4m3(f));
  }
}

/* The reduction of SEMANTICS.md §6.5, written out as the reference does it. */
static void reduce_ref(const uint16_t *const *rows, const float *w, int n, int h0, int len,
                       uint16_t *out) {
  for (int h = h0; h < h0 + len; h++) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = fmaf(ref_bf16_to_f32(rows[i][h]), w[i], acc);
    out[h] = ref_f32_to_bf16(acc);
  }
}

static void check_reduce(const cpu_ll_kernels_t *k, const char *name, t_rng *r) {
  const int len = 7168 + 24; /* a tail after the 16-wide blocks */
  uint16_t *rows[9], *got = t_xmalloc(len * 2), *want = t_xmalloc(len * 2);
  float w[9];
  for (int i = 0; i < 9; i++) {
    rows[i] = t_xmalloc(len * 2);
    for (int h = 0; h < len; h++) rows[i][h] = t_rand_bf16(r);
    rows[i][5] = 0x7fc0, rows[i][6] = 0x7f80, rows[i][7] = (uint16_t)(i % 2 ? 0xff80 : 0x8000);
  }
  for (int n = 0; n <= 9; n++) {
    for (int i = 0; i < n; i++) w[i] = (t_unit(r) - 0.5f) * ldexpf(1.0f, t_below(r, 20) - 10);
    k->reduce((const uint16_t *const *)rows, w, n, len, got);
    reduce_ref((const uint16_t *const *)rows, w, n, 0, len, want);
    T_CHECK(!memcmp(got, want, len * 2), "%s reduce of %d rows differs from the reference", name,
            n);
  }
  for (int i = 0; i < 9; i++) free(rows[i]);
  free(got), free(want);
}

int main(void) {
  t_rank = 0;
  cpu_ll_kernels_t scalar, picked;
  cpu_ll_kernels_scalar(&scalar);
  cpu_ll_kernels_pick(&picked);
  uint16_t *x = t_xmalloc(H * 2);
  t_rng r = t_seed(4, 1);
  for (int rep = 0; rep < 3; rep++) {
    make_row(x, &r);
    t_case = "cast";
    check_cast(&scalar, "scalar", x);
    check_cast(&picked, "picked", x);
  }
  t_case = "e4m3";
  check_e4m3_sample();
  t_case = "reduce";
  check_reduce(&scalar, "scalar", &r);
  check_reduce(&picked, "picked", &r);
  free(x);
  printf("test_ll_kernels: %s kernels agree with the reference\n",
         picked.reduce == scalar.reduce ? "portable (no AVX2+FMA here)" : "portable and AVX2+FMA");
  return T_PASS;
}
