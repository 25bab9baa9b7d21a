/* Unit tests of the reference implementation (tools/ref/ref.c) on hand-computed cases; every
 * expected value below was derived by hand (the derivation is in the comments), not copied from a
 * run.
 *
 *   test_ref          all tests; conversions: every bf16 / e4m3 code, and fp32 inputs built to hit
 *                     every binade and every rounding tie (+- 1 ulp)   (well under a second)
 *   test_ref --full   also every one of the 2^32 fp32 inputs for both encoders (about a minute)
 * Exit 0: pass; 1: fail (each failure printed).
 * Build: cc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wshadow -O2 -I../tools/ref -I../tools/lib
 *        test_ref.c ../tools/ref/ref.c ../tools/lib/tk_num.c -lm */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

static int failures;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      failures++;                                               \
      if (failures <= 60) {                                     \
        printf("FAIL %s:%d: (%s) ", __FILE__, __LINE__, #cond); \
        printf(__VA_ARGS__);                                    \
        printf("\n");                                           \
      }                                                         \
    }                                                           \
  } while (0)

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* bf16 bit patterns used below (sign | exponent+127 << 7 | 7 mantissa bits) */
enum {
  BF_0 = 0x0000,
  BF_M0 = 0x8000,
  BF_1 = 0x3f80,
  BF_2 = 0x4000,
  BF_3 = 0x4040,
  BF_4 = 0x4080,
  BF_5 = 0x40a0,
  BF_6 = 0x40c0,
  BF_7 = 0x40e0,
  BF_8 = 0x4100,
  BF_9 = 0x4110,
  BF_11 = 0x4130,
  BF_13 = 0x4150,
  BF_15 = 0x4170,
  BF_HALF = 0x3f00,
  BF_MHALF = 0xbf00,
  BF_QUARTER = 0x3e80,
  BF_M1_5 = 0xbfc0,
  BF_1_75 = 0x3fe0,
  BF_M3 = 0xc040,
  BF_448 = 0x43e0,
  BF_2P24 = 0x4b80, /* 2^24: exponent 151 = 0x97 */
  BF_M2P24 = 0xcb80,
  BF_2PM8 = 0x3b80,  /* 2^-8: exponent 119 = 0x77 */
  BF_2PM10 = 0x3a80, /* 2^-10: exponent 117 = 0x75 */
  BF_3PM10 = 0x3b40, /* 3*2^-10 = 1.5 * 2^-9: exponent 118, mantissa .1000000 */
  BF_2PM20 = 0x3580, /* 2^-20: exponent 107 = 0x6b */
  BF_2PM24 = 0x3380, /* 2^-24: exponent 103 = 0x67 */
  BF_1P7 = 0x3f81,   /* 1 + 2^-7 */
  BF_M1P7 = 0xbf81,
};

/* ================================================================== bf16 */

static void test_bf16_spot(void) {
  static const struct {
    uint32_t in;
    uint16_t out;
  } c[] = {
      {0x3f800000, 0x3f80}, /* 1.0 */
      {0xc0000000, 0xc000}, /* -2.0 */
      {0x3f808000, 0x3f80}, /* 1 + 2^-8: halfway 0x3f80 / 0x3f81, tie -> even 0x3f80 */
      {0x3f818000, 0x3f82}, /* 1 + 3*2^-8: halfway 0x3f81 / 0x3f82 -> even 0x3f82 */
      {0x3f808001, 0x3f81}, /* just above the tie */
      {0x3f807fff, 0x3f80}, /* just below the tie */
      {0xbf808001, 0xbf81}, /* negative: same magnitude rule */
      {0x7f7fffff, 0x7f80}, /* FLT_MAX is above bf16 max + half ulp -> inf */
      {0x7f7f8000, 0x7f80}, /* exactly bf16 max + half ulp: tie, 0x7f7f odd -> 0x7f80 = inf */
      {0x7f7f7fff, 0x7f7f}, /* below that tie -> bf16 max */
      {0x80000000, 0x8000}, /* -0 */
      {0x7f800000, 0x7f80}, /* inf */
      {0xff800000, 0xff80}, /* -inf */
      {0x00000001, 0x0000}, /* smallest subnormal -> +0 */
      {0x00008000, 0x0000}, /* tie, even -> 0 */
      {0x00018000, 0x0002}, /* tie, 0x0001 odd -> 0x0002 */
      {0x00008001, 0x0001},
      {0x7fc00000, 0x7fff}, /* NaN -> canonical NaN */
      {0xffc00001, 0x7fff},
      {0x7f800001, 0x7fff}, /* signalling NaN whose payload is in the dropped bits: still NaN */
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    uint16_t got = ref_f32_to_bf16(u2f(c[i].in));
    CHECK(got == c[i].out, "bf16(0x%08x) = 0x%04x, want 0x%04x", c[i].in, got, c[i].out);
  }
  CHECK(ref_bf16_to_f32(0x3f80) == 1.0f, "bf16 0x3f80 -> 1");
  CHECK(ref_bf16_to_f32(0xc040) == -3.0f, "bf16 0xc040 -> -3");
  CHECK(ref_bf16_to_f32(0x0001) == 0x1p-133f, "bf16 0x0001 -> 2^-133");
}

/* Every bf16 code: decode is the bit shift, encode(decode(b)) == b, NaN stays NaN. */
static void test_bf16_all_codes(void) {
  for (uint32_t b = 0; b < 0x10000; b++) {
    float f = ref_bf16_to_f32((uint16_t)b);
    CHECK(f2u(f) == b << 16, "decode 0x%04x", b);
    int nan = (b & 0x7fff) > 0x7f80;
    CHECK((isnan(f) != 0) == nan, "decode 0x%04x nan-ness", b);
    uint16_t back = ref_f32_to_bf16(f);
    if (nan)
      CHECK(isnan(ref_bf16_to_f32(back)), "0x%04x NaN -> 0x%04x", b, back);
    else
      CHECK(back == b, "roundtrip 0x%04x -> 0x%04x", b, back);
  }
}

/* Independent rounding rule: choose between the two bf16 neighbours lo (truncated toward zero)
 * and hi (next away from zero) by comparing |f| with their midpoint (exact in double). */
static uint16_t bf16_model(uint32_t u) {
  float f = u2f(u);
  if (isnan(f)) return 0x7fff;
  uint32_t lo = u & 0xffff0000u;
  if (lo == u) return (uint16_t)(u >> 16);
  uint32_t hi = lo + 0x10000u;
  double a = fabs((double)f), dl = fabs((double)u2f(lo)), dh = fabs((double)u2f(hi));
  if (isinf(dh)) dh = 0x1p128; /* next after bf16 max, as if the exponent went on (IEEE overflow) */
  double mid = (dl + dh) / 2;
  if (a < mid) return (uint16_t)(lo >> 16);
  if (a > mid) return (uint16_t)(hi >> 16);
  return (uint16_t)((((lo >> 16) & 1) ? hi : lo) >> 16);
}

/* fp32 inputs that cover every bf16 neighbourhood and tie: every high half x low-half patterns */
static const uint32_t bf16_low[] = {0x0000, 0x0001, 0x0002, 0x3fff, 0x4000, 0x7ffe, 0x7fff, 0x8000,
                                    0x8001, 0x8002, 0xbfff, 0xfffe, 0xffff, 0x1234, 0x9abc, 0x5555};

static void test_bf16_encode(int full) {
  long bad = 0;
  if (full) {
    for (uint64_t v = 0; v < (1ull << 32); v++) {
      uint32_t u = (uint32_t)v;
      uint16_t got = ref_f32_to_bf16(u2f(u)), want = bf16_model(u);
      if (got != want && bad++ < 5) CHECK(0, "bf16(0x%08x) = 0x%04x, want 0x%04x", u, got, want);
    }
  } else {
    for (uint32_t h = 0; h < 0x10000; h++)
      for (size_t i = 0; i < sizeof bf16_low / sizeof bf16_low[0]; i++) {
        uint32_t u = h << 16 | bf16_low[i];
        uint16_t got = ref_f32_to_bf16(u2f(u)), want = bf16_model(u);
        if (got != want && bad++ < 5) CHECK(0, "bf16(0x%08x) = 0x%04x, want 0x%04x", u, got, want);
      }
  }
  CHECK(bad == 0, "%ld bf16 encode mismatches", bad);
}

/* ================================================================== e4m3 */

static void test_e4m3_decode(void) {
  /* hand values: e = bits 6..3, m = bits 2..0; normal (1 + m/8) 2^(e-7), subnormal m 2^-9 */
  static const struct {
    uint8_t v;
    float f;
  } spot[] = {
      {0x00, 0.0f},
      {0x01, 0x1p-9f},
      {0x07, 7 * 0x1p-9f},
      {0x08, 0x1p-6f},
      {0x09, 1.125f * 0x1p-6f},
      {0x38, 1.0f},
      {0x3f, 1.875f},
      {0x40, 2.0f},
      {0x44, 3.0f},
      {0x77, 240.0f},
      {0x78, 256.0f},
      {0x7d, 416.0f},
      {0x7e, 448.0f},
      {0xb8, -1.0f},
      {0xc4, -3.0f},
      {0xfe, -448.0f},
      {0x81, -0x1p-9f},
  };
  for (size_t i = 0; i < sizeof spot / sizeof spot[0]; i++)
    CHECK(ref_e4m3_to_f32(spot[i].v) == spot[i].f, "e4m3 0x%02x -> %g, want %g", spot[i].v,
          ref_e4m3_to_f32(spot[i].v), spot[i].f);
  CHECK(f2u(ref_e4m3_to_f32(0x80)) == 0x80000000u, "0x80 -> -0");
  CHECK(isnan(ref_e4m3_to_f32(0x7f)) && isnan(ref_e4m3_to_f32(0xff)), "0x7f/0xff -> NaN");
  /* all codes: the structure pins the table down given the spot values above. Positive codes
   * 0..0x7e increase with step 2^-9 up to code 8, then step 2^(c/8 - 10) in binade c/8; negative
   * codes mirror them; only 0x7f/0xff are NaN. */
  for (int c = 0; c < 0x7e; c++) {
    float step = c < 8 ? 0x1p-9f : ldexpf(1.0f, c / 8 - 10);
    CHECK(ref_e4m3_to_f32((uint8_t)(c + 1)) - ref_e4m3_to_f32((uint8_t)c) == step, "step at 0x%02x",
          c);
  }
  for (int c = 0; c < 0x80; c++) {
    float p = ref_e4m3_to_f32((uint8_t)c), n = ref_e4m3_to_f32((uint8_t)(c | 0x80));
    if (c == 0x7f) continue;
    CHECK(!isnan(p) && n == -p && signbit(n), "mirror 0x%02x", c);
    /* encode(decode(c)) == c for every non-NaN code, including -0 */
    CHECK(ref_f32_to_e4m3(p) == c && ref_f32_to_e4m3(n) == (c | 0x80), "roundtrip 0x%02x", c);
  }
}

static void test_e4m3_encode_spot(void) {
  static const struct {
    float f;
    uint8_t out;
  } c[] = {
      {1.0f, 0x38},
      {-3.0f, 0xc4},
      {448.0f, 0x7e},
      {449.0f, 0x7e}, /* above max: saturate */
      {464.0f, 0x7e}, /* would round to 480, which e4m3fn does not have: saturate */
      {1e30f, 0x7e},
      {-1e30f, 0xfe},
      {432.0f, 0x7e}, /* halfway 416 (0x7d) / 448 (0x7e): tie -> even 0x7e */
      {424.0f, 0x7d},
      {248.0f, 0x78},       /* halfway 240 (0x77) / 256 (0x78) -> even 0x78 */
      {1.0625f, 0x38},      /* halfway 1 (0x38) / 1.125 (0x39) -> even 0x38 */
      {1.1875f, 0x3a},      /* halfway 1.125 (0x39) / 1.25 (0x3a) -> even 0x3a */
      {0x1p-10f, 0x00},     /* halfway 0 / 2^-9 (subnormal) -> even 0 */
      {3 * 0x1p-10f, 0x02}, /* halfway 2^-9 (0x01) / 2^-8 (0x02) -> even 0x02 */
      {0x1p-10f + 0x1p-20f, 0x01},
      {15 * 0x1p-10f, 0x08}, /* halfway 7*2^-9 (0x07) / 2^-6 (0x08) -> even 0x08 */
      {0.0009f, 0x00},       /* below 2^-10 */
      {-0x1p-12f, 0x80},     /* tiny negative -> -0 */
      {0x1p-149f, 0x00},
      {-0.0f, 0x80},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    uint8_t got = ref_f32_to_e4m3(c[i].f);
    CHECK(got == c[i].out, "e4m3(%a) = 0x%02x, want 0x%02x", c[i].f, got, c[i].out);
  }
  CHECK(ref_f32_to_e4m3(INFINITY) == 0x7e && ref_f32_to_e4m3(-INFINITY) == 0xfe, "inf saturates");
  CHECK(ref_f32_to_e4m3(NAN) == 0x7f && ref_f32_to_e4m3(-NAN) == 0x7f, "NaN -> 0x7f");
}

/* Independent rounding rule: nearest of the 127 finite non-negative e4m3 values (decoded, so
 * resting on test_e4m3_decode), ties to the even code, >= 448 saturates; sign copied. */
static float e4m3_pos[127];
static uint8_t e4m3_model(uint32_t u) {
  float f = u2f(u);
  if (isnan(f)) return 0x7f;
  uint8_t sign = (u >> 31) ? 0x80 : 0;
  float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e;
  int lo = 0, hi = 126; /* largest c with e4m3_pos[c] <= a */
  while (lo < hi) {
    int m = (lo + hi + 1) / 2;
    if (e4m3_pos[m] <= a)
      lo = m;
    else
      hi = m - 1;
  }
  if (e4m3_pos[lo] == a) return sign | (uint8_t)lo;
  double mid = ((double)e4m3_pos[lo] + (double)e4m3_pos[lo + 1]) / 2; /* exact */
  int c = a < mid ? lo : a > mid ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return sign | (uint8_t)c;
}

static void test_e4m3_encode(int full) {
  for (int c = 0; c < 127; c++) e4m3_pos[c] = ref_e4m3_to_f32((uint8_t)c);
  long bad = 0;
  if (full) {
    for (uint64_t v = 0; v < (1ull << 32); v++) {
      uint32_t u = (uint32_t)v;
      uint8_t got = ref_f32_to_e4m3(u2f(u)), want = e4m3_model(u);
      if (got != want && bad++ < 5) CHECK(0, "e4m3(0x%08x) = 0x%02x, want 0x%02x", u, got, want);
    }
  } else {
    /* Every sign, every fp32 exponent, every value of the top 9 mantissa bits (e4m3 ties need at
     * most 5, subnormal ties included), with the low 14 bits set to patterns around 0 and full:
     * hits every tie exactly and +- 1 ulp around it. */
    static const uint32_t low[] = {0x0000, 0x0001, 0x0002, 0x1fff, 0x2000, 0x3ffe, 0x3fff, 0x2a5a};
    for (uint32_t top = 0; top < (1u << 18); top++) /* sign | exponent | 9 mantissa bits */
      for (size_t i = 0; i < sizeof low / sizeof low[0]; i++) {
        uint32_t u = top << 14 | low[i];
        uint8_t got = ref_f32_to_e4m3(u2f(u)), want = e4m3_model(u);
        if (got != want && bad++ < 5) CHECK(0, "e4m3(0x%08x) = 0x%02x, want 0x%02x", u, got, want);
        /* and the fp32 neighbour just below (crosses into the previous top pattern's end) */
        uint32_t d = u - 1;
        got = ref_f32_to_e4m3(u2f(d));
        want = e4m3_model(d);
        if (got != want && bad++ < 5) CHECK(0, "e4m3(0x%08x) = 0x%02x, want 0x%02x", d, got, want);
      }
  }
  CHECK(bad == 0, "%ld e4m3 encode mismatches", bad);
}

/* ============================================================ SEMANTICS.md §2 layout */

/* The shared small case: R = 2, E = 4 (2 experts per rank: rank 0 has 0,1; rank 1 has 2,3),
 * topk = 2.
 *   rank 0: t0 {0, 3} -> ranks 0,1;  t1 {1, -1} -> rank 0;  t2 {-1, -1} -> none
 *   rank 1: t0 {2, 3} -> rank 1;     t1 {3, 0} -> ranks 1,0 */
static const int64_t ids0[] = {0, 3, 1, -1, -1, -1};
static const int64_t ids1[] = {2, 3, 3, 0};
static const float w0[] = {0.5f, 0.25f, 1.0f, 7.0f, 3.0f, 3.0f};
static const float w1[] = {0.125f, 0.375f, 0.75f, 0.0625f};

static void test_layout(void) {
  int32_t tpr[2], tpe[4];
  uint8_t in[6];
  CHECK(ref_layout(ids0, 3, 2, 4, 2, tpr, tpe, in) == 0, "layout rank 0");
  CHECK(tpr[0] == 2 && tpr[1] == 1, "tokens_per_rank %d %d", tpr[0], tpr[1]);
  CHECK(tpe[0] == 1 && tpe[1] == 1 && tpe[2] == 0 && tpe[3] == 1, "tokens_per_expert");
  static const uint8_t want0[] = {1, 1, 1, 0, 0, 0};
  CHECK(memcmp(in, want0, 6) == 0, "is_token_in_rank rank 0");
  CHECK(ref_layout(ids1, 2, 2, 4, 2, tpr, tpe, in) == 0, "layout rank 1");
  CHECK(tpr[0] == 1 && tpr[1] == 2, "tokens_per_rank");
  CHECK(tpe[0] == 1 && tpe[1] == 0 && tpe[2] == 1 && tpe[3] == 2, "tokens_per_expert");
  static const uint8_t want1[] = {0, 1, 1, 1};
  CHECK(memcmp(in, want1, 4) == 0, "is_token_in_rank rank 1");
  /* duplicates count per slot in tokens_per_expert, once in tokens_per_rank */
  static const int64_t dup[] = {1, 1};
  CHECK(ref_layout(dup, 1, 2, 4, 2, tpr, tpe, NULL) == 0 && tpe[1] == 2 && tpr[0] == 1,
        "duplicate");
  CHECK(ref_layout(ids0, 3, 2, 4, 2, NULL, NULL, NULL) == 0, "all outputs NULL");

  /* bad ids: -1 returned, outputs untouched */
  static const int64_t bad_hi[] = {0, 4}, bad_lo[] = {-2, 0};
  memset(tpr, 0x5a, sizeof tpr);
  memset(tpe, 0x5a, sizeof tpe);
  memset(in, 0x5a, sizeof in);
  CHECK(ref_layout(bad_hi, 1, 2, 4, 2, tpr, tpe, in) == -1, "id == E rejected");
  CHECK(ref_layout(bad_lo, 1, 2, 4, 2, tpr, tpe, in) == -1, "id < -1 rejected");
  CHECK(tpr[0] == 0x5a5a5a5a && tpe[3] == 0x5a5a5a5a && in[0] == 0x5a, "outputs untouched");
  CHECK(ref_layout(ids0, 3, 2, 3, 2, tpr, tpe, in) == -1, "E %% R != 0 rejected");
}

/* ============================================================ SEMANTICS.md §3 dispatch */

static void fill_rows(uint8_t *x, int s, int n) { /* byte i of token t: s<<6 | t<<4 | i */
  for (int t = 0; t < n; t++)
    for (int i = 0; i < 16; i++) x[t * 16 + i] = (uint8_t)(s << 6 | t << 4 | i);
}

static int row_is(const uint8_t *row, int s, int t) {
  for (int i = 0; i < 16; i++)
    if (row[i] != (uint8_t)(s << 6 | t << 4 | i)) return 0;
  return 1;
}

static void test_dispatch(void) {
  uint8_t x0[3 * 16], x1[2 * 16];
  fill_rows(x0, 0, 3);
  fill_rows(x1, 1, 2);
  static const float sc0[] = {10, 11, 12}, sc1[] = {20, 21};
  ref_rank_input_t in[2] = {{3, x0, sc0, ids0, w0}, {2, x1, sc1, ids1, w1}};
  ref_recv_t out[2];
  CHECK(ref_dispatch(2, 4, 2, 16, 1, 2, in, out) == 0, "dispatch");

  /* rank 0 receives s0 t0, s0 t1, s1 t1 */
  ref_recv_t *o = &out[0];
  CHECK(o->nr == 3, "rank 0 nr %d", o->nr);
  if (o->nr == 3) {
    CHECK(row_is(o->x, 0, 0) && row_is(o->x + 16, 0, 1) && row_is(o->x + 32, 1, 1), "rank 0 x");
    CHECK(o->scales[0] == 10 && o->scales[1] == 11 && o->scales[2] == 21, "rank 0 scales");
    CHECK(o->src_idx[0] == 0 && o->src_idx[1] == 1 && o->src_idx[2] == 1, "rank 0 src_idx");
    CHECK(o->src_rank[0] == 0 && o->src_rank[1] == 0 && o->src_rank[2] == 1, "rank 0 src_rank");
    /* local ids: {0,3} -> {0,-1}; {1,-1} -> {1,-1}; {3,0} -> {-1,0} */
    static const int64_t ti[] = {0, -1, 1, -1, -1, 0};
    static const float tw[] = {0.5f, 0, 1.0f, 0, 0, 0.0625f};
    CHECK(memcmp(o->topk_idx, ti, sizeof ti) == 0, "rank 0 topk_idx");
    CHECK(memcmp(o->topk_weights, tw, sizeof tw) == 0, "rank 0 topk_weights");
    /* expert 0: s0t0, s1t1 -> 2 -> aligned 2; expert 1: s0t1 -> 1 -> aligned 2 */
    CHECK(o->tokens_per_expert[0] == 2 && o->tokens_per_expert[1] == 2, "rank 0 tokens_per_expert");
  }
  /* rank 1 receives s0 t0, s1 t0, s1 t1 */
  o = &out[1];
  CHECK(o->nr == 3, "rank 1 nr %d", o->nr);
  if (o->nr == 3) {
    CHECK(row_is(o->x, 0, 0) && row_is(o->x + 16, 1, 0) && row_is(o->x + 32, 1, 1), "rank 1 x");
    CHECK(o->scales[0] == 10 && o->scales[1] == 20 && o->scales[2] == 21, "rank 1 scales");
    CHECK(o->src_idx[0] == 0 && o->src_idx[1] == 0 && o->src_idx[2] == 1, "rank 1 src_idx");
    CHECK(o->src_rank[0] == 0 && o->src_rank[1] == 1 && o->src_rank[2] == 1, "rank 1 src_rank");
    /* {0,3} -> {-1,1}; {2,3} -> {0,1}; {3,0} -> {1,-1} */
    static const int64_t ti[] = {-1, 1, 0, 1, 1, -1};
    static const float tw[] = {0, 0.25f, 0.125f, 0.375f, 0.75f, 0};
    CHECK(memcmp(o->topk_idx, ti, sizeof ti) == 0, "rank 1 topk_idx");
    CHECK(memcmp(o->topk_weights, tw, sizeof tw) == 0, "rank 1 topk_weights");
    /* expert 2: s1t0 -> 1 -> 2; expert 3: s0t0, s1t0, s1t1 -> 3 -> 4 */
    CHECK(o->tokens_per_expert[0] == 2 && o->tokens_per_expert[1] == 4, "rank 1 tokens_per_expert");
  }
  /* sends: s0 -> {2, 1}, s1 -> {1, 2}; prefix rows: {2, 1}, {3, 3}; same on every rank */
  static const int32_t rp[] = {2, 1, 3, 3};
  CHECK(memcmp(out[0].rank_prefix, rp, sizeof rp) == 0, "rank_prefix on rank 0");
  CHECK(memcmp(out[1].rank_prefix, rp, sizeof rp) == 0, "rank_prefix on rank 1");
  ref_free_recv(&out[0]);
  ref_free_recv(&out[1]);

  /* no alignment, no scales, no weights */
  ref_rank_input_t in2[2] = {{3, x0, NULL, ids0, NULL}, {2, x1, NULL, ids1, NULL}};
  CHECK(ref_dispatch(2, 4, 2, 16, 0, 0, in2, out) == 0, "dispatch without extras");
  CHECK(out[0].scales == NULL && out[0].topk_weights == NULL, "no scales / weights");
  CHECK(out[0].tokens_per_expert[0] == 2 && out[0].tokens_per_expert[1] == 1, "unaligned rank 0");
  CHECK(out[1].tokens_per_expert[0] == 1 && out[1].tokens_per_expert[1] == 3, "unaligned rank 1");
  ref_free_recv(&out[0]);
  ref_free_recv(&out[1]);

  /* rank with no tokens, and the errors */
  ref_rank_input_t in3[2] = {{0, NULL, NULL, NULL, NULL}, {2, x1, NULL, ids1, NULL}};
  CHECK(ref_dispatch(2, 4, 2, 16, 0, 1, in3, out) == 0, "dispatch with an empty rank");
  CHECK(out[0].nr == 1 && out[1].nr == 2, "nr %d %d", out[0].nr, out[1].nr);
  ref_free_recv(&out[0]);
  ref_free_recv(&out[1]);
  static const int64_t bad[] = {0, 4, 1, -1, -1, -1};
  ref_rank_input_t in4[2] = {{3, x0, NULL, bad, NULL}, {2, x1, NULL, ids1, NULL}};
  CHECK(ref_dispatch(2, 4, 2, 16, 0, 1, in4, out) == -1, "bad id rejected");
  ref_rank_input_t in5[2] = {{3, x0, NULL, ids0, w0}, {2, x1, NULL, ids1, NULL}};
  CHECK(ref_dispatch(2, 4, 2, 16, 0, 1, in5, out) == -1, "weights on one rank only rejected");
  CHECK(ref_dispatch(2, 4, 2, 16, 1, 1, in2, out) == -1, "missing scales rejected");
}

/* ============================================================= SEMANTICS.md §4 combine */

static void test_combine(void) {
  uint8_t x0[3 * 16], x1[2 * 16];
  fill_rows(x0, 0, 3);
  fill_rows(x1, 1, 2);
  ref_rank_input_t in[2] = {{3, x0, NULL, ids0, w0}, {2, x1, NULL, ids1, w1}};
  ref_recv_t rv[2];
  if (ref_dispatch(2, 4, 2, 16, 0, 0, in, rv) != 0 || rv[0].nr != 3 || rv[1].nr != 3) {
    CHECK(0, "dispatch for combine");
    return;
  }
  /* H = 2. Receive rows: rank 0 = [s0t0, s0t1, s1t1], rank 1 = [s0t0, s1t0, s1t1]. */
  const uint16_t y0[] = {BF_1, BF_M0, BF_2, BF_2PM8, BF_3, BF_1};
  const uint16_t y1[] = {BF_4, BF_M0, BF_5, BF_6, BF_6, BF_2PM8};
  const uint16_t *y[2] = {y0, y1};
  const float *w[2] = {rv[0].topk_weights, rv[1].topk_weights};
  uint16_t o0[3 * 2], o1[2 * 2];
  float ow0[3 * 2], ow1[2 * 2];
  uint16_t *out[2] = {o0, o1};
  float *out_w[2] = {ow0, ow1};
  CHECK(ref_combine(2, 2, 2, in, rv, y, w, NULL, NULL, out, out_w) == 0, "combine");
  /* s0t0: 1 + 4 = 5; +0 + -0 + -0 = +0 (the accumulator starts at +0, +0 + -0 = +0)
   * s0t1: 2; 2^-8      s0t2: went nowhere -> 0, 0
   * s1t0: 5; 6         s1t1: 3 + 6 = 9; 1 + 2^-8 = tie between 0x3f80 / 0x3f81 -> 0x3f80 */
  static const uint16_t e0[] = {BF_5, BF_0, BF_2, BF_2PM8, BF_0, BF_0};
  static const uint16_t e1[] = {BF_5, BF_6, BF_9, BF_1};
  for (int i = 0; i < 6; i++)
    CHECK(o0[i] == e0[i], "out[0][%d] = 0x%04x, want 0x%04x", i, o0[i], e0[i]);
  for (int i = 0; i < 4; i++)
    CHECK(o1[i] == e1[i], "out[1][%d] = 0x%04x, want 0x%04x", i, o1[i], e1[i]);
  /* weights come back where the id was valid, 0 for the -1 slot (7.0 was dropped) and for t2 */
  static const float ew0[] = {0.5f, 0.25f, 1.0f, 0, 0, 0};
  static const float ew1[] = {0.125f, 0.375f, 0.75f, 0.0625f};
  CHECK(memcmp(ow0, ew0, sizeof ew0) == 0 && memcmp(ow1, ew1, sizeof ew1) == 0, "combined weights");

  /* Biases and accumulation order. rank 0 row s0t0 = {1, 1}, rank 1 row s0t0 = {-2^24, 2^-8};
   * bias0[s0] t0 = {2^24, 2^-20}, bias1[s0] t0 = {0, 0}.
   *   col 0: (2^24 + 0) + 1 = 2^24 (tie, even), + -2^24 = 0.  (rows first would give 1.)
   *   col 1: 2^-20 + 1 = 1 + 2^-20 (exact), + 2^-8 = 1 + 2^-8 + 2^-20, above the bf16 tie ->
   *          0x3f81.  (rounding to bf16 at each step would give 0x3f80.)
   * s0t2 went nowhere: bias0 {-0, 1} + bias1 {-0, 1} = {-0 + -0 = -0, 2}.
   * s0t1 (rank 0 row {2, 2^-8}), biases 0: unchanged. Rank 1 gives no biases. */
  const uint16_t y0b[] = {BF_1, BF_1, BF_2, BF_2PM8, BF_3, BF_1};
  const uint16_t y1b[] = {BF_M2P24, BF_2PM8, BF_5, BF_6, BF_6, BF_2PM8};
  const uint16_t *yb[2] = {y0b, y1b};
  const uint16_t b00[] = {BF_2P24, BF_2PM20, BF_0, BF_0, BF_M0, BF_1};
  const uint16_t b10[] = {BF_0, BF_0, BF_0, BF_0, BF_M0, BF_1};
  const uint16_t *b0[2] = {b00, NULL}, *b1[2] = {b10, NULL};
  CHECK(ref_combine(2, 2, 2, in, rv, yb, NULL, b0, b1, out, NULL) == 0, "combine with bias");
  static const uint16_t eb0[] = {BF_0, BF_1P7, BF_2, BF_2PM8, BF_M0, BF_2};
  for (int i = 0; i < 6; i++)
    CHECK(o0[i] == eb0[i], "bias out[0][%d] = 0x%04x, want 0x%04x", i, o0[i], eb0[i]);
  CHECK(o1[0] == BF_5 && o1[1] == BF_6 && o1[2] == BF_9 && o1[3] == BF_1, "bias out[1]");
  ref_free_recv(&rv[0]);
  ref_free_recv(&rv[1]);

  /* Rank order with R = 3, E = 3, topk = 3: rank 0's single token selects {0, 1, 2}, so it goes
   * to all three ranks. H = 1. Rows: rank 0: 2^24, rank 1: 1, rank 2: -2^24.
   *   ascending: 2^24 + 1 = 2^24 (tie, even), - 2^24 = 0   (descending would give 1)
   * weights slot 0: 2^24, 1, -2^24 -> 0 likewise; slot 1: 1 + 2 + 3 = 6; slot 2: 0. */
  static const int64_t ids3[] = {0, 1, 2};
  uint16_t x3 = BF_1;
  ref_rank_input_t in3[3] = {
      {1, &x3, NULL, ids3, NULL}, {0, NULL, NULL, NULL, NULL}, {0, NULL, NULL, NULL, NULL}};
  ref_recv_t rv3[3];
  if (ref_dispatch(3, 3, 3, 2, 0, 0, in3, rv3) != 0) {
    CHECK(0, "dispatch R=3");
    return;
  }
  CHECK(rv3[0].nr == 1 && rv3[1].nr == 1 && rv3[2].nr == 1, "R=3 nr");
  const uint16_t ya = BF_2P24, yb1 = BF_1, yc = BF_M2P24;
  const uint16_t *y3[3] = {&ya, &yb1, &yc};
  const float wa[] = {0x1p24f, 1, 0}, wb[] = {1, 2, 0}, wc[] = {-0x1p24f, 3, 0};
  const float *w3[3] = {wa, wb, wc};
  uint16_t o3;
  float ow3[3];
  uint16_t *out3[3] = {&o3, NULL, NULL};
  float *outw3[3] = {ow3, NULL, NULL};
  CHECK(ref_combine(3, 1, 3, in3, rv3, y3, w3, NULL, NULL, out3, outw3) == 0, "combine R=3");
  CHECK(o3 == BF_0, "ascending rank order: got 0x%04x, want 0x0000", o3);
  CHECK(ow3[0] == 0.0f && ow3[1] == 6.0f && ow3[2] == 0.0f, "weights %g %g %g", ow3[0], ow3[1],
        ow3[2]);

  /* Across hosts (§4.6): ranks 0 | 1, 2 on two hosts: host 1's partial first, 1 + -2^24 =
   * -(2^24 - 1) (exact), then 2^24 + that = 1. One host (or host_of NULL) is §4.2: 0. */
  const int host_of[3] = {0, 1, 1}, one_host[3] = {0, 0, 0};
  CHECK(ref_combine_hosts(3, 2, host_of, 1, 3, in3, rv3, y3, w3, NULL, NULL, out3, outw3) == 0,
        "combine across hosts");
  CHECK(o3 == BF_1, "host partials: got 0x%04x, want 0x3f80", o3);
  CHECK(ow3[0] == 1.0f && ow3[1] == 6.0f, "host-partial weights %g %g", ow3[0], ow3[1]);
  CHECK(ref_combine_hosts(3, 1, one_host, 1, 3, in3, rv3, y3, w3, NULL, NULL, out3, outw3) == 0 &&
            o3 == BF_0,
        "one host is the flat order: got 0x%04x", o3);
  CHECK(ref_combine_hosts(3, 2, NULL, 1, 3, in3, rv3, y3, w3, NULL, NULL, out3, outw3) == -1,
        "hosts without host_of");
  /* Host outputs of the layout: the token goes to both hosts, once each. */
  int32_t per_host[2];
  uint8_t in_host[2];
  CHECK(ref_layout_hosts(ids3, 1, 3, 3, 3, 2, host_of, per_host, in_host) == 0 &&
            per_host[0] == 1 && per_host[1] == 1 && in_host[0] == 1 && in_host[1] == 1,
        "layout hosts");
  for (int r = 0; r < 3; r++) ref_free_recv(&rv3[r]);
}

/* ============================================================ SEMANTICS.md §5 fp8 cast */

static void test_ll_cast(void) {
  /* 4 blocks of 128 */
  uint16_t x[512];
  for (int i = 0; i < 512; i++) x[i] = BF_0;
  /* block 0: amax 448 -> non-round: scale = 448/448 = 1; scale_inv = 448 * fl(1/448) = 1 (fl(1/7) =
   * 1/7 + 3/7 * 2^-26, so 7 * fl(1/7) = 1 + 3 * 2^-26, which rounds to 1). round: e = 0. */
  x[0] = BF_448;
  x[1] = BF_1;
  x[2] = BF_M3;
  x[3] = BF_2PM10;
  x[4] = BF_3PM10;
  x[5] = BF_M0;
  /* block 1: amax 1 -> non-round: scale 448, scale_inv = fl(1/448) = 0x3b124925 (1/7 = 0.(001)b,
   * rounded up at bit 24; exponent -9). round: fl(1/448) has exponent -9 and a nonzero mantissa,
   * so e = -8: scale 256, scale_inv 2^-8, ue8m0 119. */
  x[128] = BF_1;
  x[129] = BF_MHALF;
  x[130] = BF_QUARTER;
  /* block 2: all zero but a -0: amax floored at 1e-4; round: 1e-4/448 = 2.23e-7 lies in
   * [2^-23, 2^-22) -> e = -22, ue8m0 105 */
  x[256] = BF_M0;
  /* block 3: amax 3: scale = fl(448/3) = 149.33..; 1 -> 149.33 in [128,256), spacing 16 -> 144 =
   * 0x71; -2 -> -298.67 in [256,512), spacing 32 -> -288 = 0xf9; 3 -> ~448 -> 0x7e.
   * round: 3/448 in [2^-8, 2^-7) -> e = -7, scale 128: 1 -> 128 = 0x70, -2 -> -256 = 0xf8,
   * 3 -> 384 = 0x7c */
  x[384] = BF_1;
  x[385] = 0xc000 /* -2 */;
  x[386] = BF_3;

  uint8_t q[512], ue[4];
  float sc[4];
  ref_ll_cast_row(x, 512, 0, 0, q, sc, NULL);
  static const uint8_t q0[] = {0x7e, 0x38, 0xc4, 0x00, 0x02, 0x80, 0x00};
  CHECK(memcmp(q, q0, sizeof q0) == 0, "block 0 values");
  CHECK(sc[0] == 1.0f, "block 0 scale_inv %a", sc[0]);
  CHECK(q[128] == 0x7e && q[129] == 0xf6 && q[130] == 0x6e && q[131] == 0x00, "block 1 values");
  CHECK(f2u(sc[1]) == 0x3b124925u, "block 1 scale_inv 0x%08x", f2u(sc[1]));
  CHECK(q[256] == 0x80 && q[257] == 0x00, "block 2 values");
  CHECK(sc[2] > 2.23e-7f && sc[2] < 2.24e-7f, "block 2 scale_inv %g", sc[2]);
  CHECK(q[384] == 0x71 && q[385] == 0xf9 && q[386] == 0x7e, "block 3 values %02x %02x %02x", q[384],
        q[385], q[386]);
  int zeros = 1;
  for (int b = 0; b < 4; b++)
    for (int i = 7; i < 128; i++) zeros &= q[b * 128 + i] == 0;
  CHECK(zeros, "zero channels -> 0x00");

  ref_ll_cast_row(x, 512, 1, 1, q, sc, ue);
  CHECK(memcmp(q, q0, sizeof q0) == 0, "round: block 0 values");
  CHECK(sc[0] == 1.0f && ue[0] == 127, "round: block 0 scale %a / %d", sc[0], ue[0]);
  CHECK(q[128] == 0x78 && q[129] == 0xf0 && q[130] == 0x68, "round: block 1 values");
  CHECK(sc[1] == 0x1p-8f && ue[1] == 119, "round: block 1 scale %a / %d", sc[1], ue[1]);
  CHECK(q[256] == 0x80 && sc[2] == 0x1p-22f && ue[2] == 105, "round: block 2 %a / %d", sc[2],
        ue[2]);
  CHECK(q[384] == 0x70 && q[385] == 0xf8 && q[386] == 0x7c && sc[3] == 0x1p-7f && ue[3] == 120,
        "round: block 3");

  /* The order of the non-round scale matters: amax = 0x3fc4 = 49/32, x = 0x3c2f = 175 * 2^-14.
   * Exactly, x * 448 / amax = 25/8 = 3.125, a tie between 3.0 (0x44) and 3.25 (0x45) -> 0x44.
   * But scale = fl(448 / amax) = fl(2^11 / 7) = 2^11 fl(1/7) = 2^11/7 + (3/7) 2^-15, and
   * x * scale = 3.125 + 75 * 2^-29 = 3.125 + 0.59 ulp (ulp 2^-22) -> fl = 3.125 + 2^-22, above the
   * tie -> 0x45. (Computing 448 * fl(1/amax), or (x * 448) / amax, lands on 0x44.)
   * round: amax / 448 ~ 0.0034 in [2^-9, 2^-8) -> e = -8, x * 256 = 175 * 2^-6 = 2.734375, spacing
   * 0.25 in [2, 4): 10.94 -> 11 -> 2.75 = 0x43. */
  uint16_t xo[128] = {0x3fc4, 0x3c2f};
  ref_ll_cast_row(xo, 128, 0, 0, q, sc, NULL);
  CHECK(q[0] == 0x7e && q[1] == 0x45, "scale order: 0x%02x 0x%02x", q[0], q[1]);
  ref_ll_cast_row(xo, 128, 1, 0, q, sc, NULL);
  CHECK(q[1] == 0x43 && sc[0] == 0x1p-8f, "scale order, round: 0x%02x %a", q[1], sc[0]);

  /* scale_inv is amax * fl(1/448), not amax / 448: amax = 0x3f82 = 65/64, fl(1/448) =
   * 9586981 * 2^-32, product = 623153765 * 2^-38; to 24 bits: 623153765 / 64 = 9736777.58 ->
   * 9736778 * 2^-32 = 0x3b14924a. (65/64/448 = 9736777.14 * 2^-32 would round to 0x3b149249.) */
  uint16_t xa[128] = {0x3f82};
  ref_ll_cast_row(xa, 128, 0, 0, q, sc, NULL);
  CHECK(f2u(sc[0]) == 0x3b14924au && q[0] == 0x7e, "scale_inv 0x%08x", f2u(sc[0]));
}

/* ================================================== SEMANTICS.md §6 ll dispatch/combine */

/* R = 2, E = 4 (L = 2), T = 3, topk = 2, H = 128. Every channel of token (s,t) holds v(s,t):
 *   rank 0: t0 {1, 2} v 1,  t1 {2, -1} v 2
 *   rank 1: t0 {2, 0} v 11, t1 {-1, -1} v 12, t2 {1, 2} v 13
 * Receive rows (source ascending, token ascending):
 *   rank 0, expert 0: [s1t0]                    layout {s0: 0 @0, s1: 1 @0}
 *   rank 0, expert 1: [s0t0, s1t2]              layout {1 @0, 1 @1}
 *   rank 1, expert 2: [s0t0, s0t1, s1t0, s1t2]  layout {2 @0, 2 @2}
 *   rank 1, expert 3: []                        layout {0, 0} */
static const int64_t lid0[] = {1, 2, 2, -1};
static const int64_t lid1[] = {2, 0, -1, -1, 1, 2};
static const float lw0[] = {0.5f, 0.25f, 1.5f, 99.0f};
static const float lw1[] = {1.0f, 2.0f, 5.0f, 5.0f, 0.5f, -0.5f};

static void fill_const(uint16_t *row, uint16_t v) {
  for (int h = 0; h < 128; h++) row[h] = v;
}

static int row_const(const uint16_t *row, uint16_t v) {
  for (int h = 0; h < 128; h++)
    if (row[h] != v) return 0;
  return 1;
}

static void test_ll(void) {
  enum { H = 128, T = 3, RT = 6 };
  uint16_t x0[2 * H], x1[3 * H];
  fill_const(x0, BF_1);
  fill_const(x0 + H, BF_2);
  fill_const(x1, BF_11);
  fill_const(x1 + H, 0x4140 /* 12 */);
  fill_const(x1 + 2 * H, BF_13);
  ref_rank_input_t in[2] = {{2, x0, NULL, lid0, lw0}, {3, x1, NULL, lid1, lw1}};
  ref_ll_recv_t o[2];
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, in, 0, 0, 0, o) == 0, "ll dispatch");
  CHECK(o[0].count[0] == 1 && o[0].count[1] == 2 && o[1].count[0] == 4 && o[1].count[1] == 0,
        "counts");
  const uint16_t *r0 = o[0].x, *r1 = o[1].x;
  CHECK(row_const(r0, BF_11), "rank 0 e0 row 0");
  CHECK(row_const(r0 + (size_t)RT * H, BF_1) && row_const(r0 + (size_t)(RT + 1) * H, BF_13),
        "rank 0 e1 rows");
  CHECK(row_const(r1, BF_1) && row_const(r1 + H, BF_2) && row_const(r1 + 2 * H, BF_11) &&
            row_const(r1 + 3 * H, BF_13),
        "rank 1 e2 rows");
  CHECK(o[0].src_info[0] == 0 && o[0].src_info[RT] == 0 && o[0].src_info[RT + 1] == 2,
        "rank 0 src_info");
  CHECK(o[1].src_info[0] == 0 && o[1].src_info[1] == 1 && o[1].src_info[2] == 0 &&
            o[1].src_info[3] == 2,
        "rank 1 src_info");
  CHECK(o[1].src_info[RT] == -1, "unused row src_info -1");
  const int64_t *lr0 = o[0].layout_range, *lr1 = o[1].layout_range;
  CHECK(lr0[0] == 0 && lr0[1] == 1, "rank 0 e0 layout %llx %llx", (long long)lr0[0],
        (long long)lr0[1]);
  CHECK(lr0[2] == 1 && lr0[3] == ((1ll << 32) | 1), "rank 0 e1 layout");
  CHECK(lr1[0] == 2 && lr1[1] == ((2ll << 32) | 2), "rank 1 e2 layout");
  CHECK(lr1[2] == 0 && lr1[3] == 0, "rank 1 e3 layout");

  /* combine: y row values (all channels): rank 0 e0 row0 = 4; e1 rows = 2, 5;
   * rank 1 e2 rows = 3, 6, 7, 8.
   *   s0t0 {e1 row0, e2 row0} w {0.5, 0.25}: 1 + 0.75 = 1.75
   *   s0t1 {e2 row1, -}       w {1.5, 99}:   9
   *   s1t0 {e2 row2, e0 row0} w {1, 2}:      7 + 8 = 15
   *   s1t1 {-, -}:                           0
   *   s1t2 {e1 row1, e2 row3} w {.5, -.5}:   2.5 - 4 = -1.5 */
  uint16_t *y0 = calloc((size_t)2 * RT * H, 2), *y1 = calloc((size_t)2 * RT * H, 2);
  fill_const(y0, BF_4);
  fill_const(y0 + (size_t)RT * H, BF_2);
  fill_const(y0 + (size_t)(RT + 1) * H, BF_5);
  fill_const(y1, BF_3);
  fill_const(y1 + H, BF_6);
  fill_const(y1 + 2 * H, BF_7);
  fill_const(y1 + 3 * H, BF_8);
  const uint16_t *y[2] = {y0, y1};
  uint16_t c0[2 * H], c1[3 * H];
  uint16_t *out[2] = {c0, c1};
  for (int fused = 0; fused < 2; fused++) {
    CHECK(ref_ll_combine(2, T, 4, H, 2, in, y, fused, out) == 0, "ll combine");
    CHECK(row_const(c0, BF_1_75) && row_const(c0 + H, BF_9), "ll combine rank 0 (fused %d)", fused);
    CHECK(row_const(c1, BF_15) && row_const(c1 + H, BF_0) && row_const(c1 + 2 * H, BF_M1_5),
          "ll combine rank 1 (fused %d)", fused);
  }
  free(y0);
  free(y1);
  ref_ll_free(&o[0]);
  ref_ll_free(&o[1]);

  /* fp8: rows are the casts of their source rows. Token value 1 everywhere, round_scale:
   * amax 1 -> e = -8 (see test_ll_cast) -> 256 = 0x78, ue8m0 119. */
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, in, 1, 1, 1, o) == 0, "ll dispatch fp8 ue8m0");
  CHECK(o[0].x == NULL && o[0].scales == NULL && o[0].ue8m0_exp != NULL, "ue8m0 format");
  CHECK(o[1].q[0] == 0x78 && o[1].q[H - 1] == 0x78 && o[1].ue8m0_exp[0] == 119, "fp8 row s0t0");
  ref_ll_free(&o[0]);
  ref_ll_free(&o[1]);
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, in, 1, 0, 0, o) == 0, "ll dispatch fp8");
  uint8_t q[H];
  float sc;
  ref_ll_cast_row(x1 + 2 * H, H, 0, 0, q, &sc, NULL); /* s1t2 is rank 1 e2 row 3 */
  CHECK(memcmp(o[1].q + 3 * H, q, H) == 0 && o[1].scales[3] == sc, "fp8 row = cast of source");
  ref_ll_free(&o[0]);
  ref_ll_free(&o[1]);

  /* errors */
  CHECK(ref_ll_dispatch(2, 2, 4, H, 2, in, 0, 0, 0, o) == -1, "n > T rejected");
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, in, 1, 0, 1, o) == -1, "ue8m0 without round_scale rejected");
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, in, 0, 1, 0, o) == -1, "round_scale without fp8 rejected");
  CHECK(ref_ll_dispatch(2, T, 4, 64, 2, in, 1, 0, 0, o) == -1, "fp8 with H %% 128 != 0 rejected");
  static const int64_t dup[] = {1, 1, 2, -1};
  ref_rank_input_t ind[2] = {{2, x0, NULL, dup, lw0}, {3, x1, NULL, lid1, lw1}};
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, ind, 0, 0, 0, o) == -1, "duplicate expert rejected");
  static const int64_t oor[] = {1, 4, 2, -1};
  ref_rank_input_t ino[2] = {{2, x0, NULL, oor, lw0}, {3, x1, NULL, lid1, lw1}};
  CHECK(ref_ll_dispatch(2, T, 4, H, 2, ino, 0, 0, 0, o) == -1, "id out of range rejected");
  ref_rank_input_t inw[2] = {{2, x0, NULL, lid0, NULL}, {3, x1, NULL, lid1, lw1}};
  uint16_t yz[2 * RT * H];
  const uint16_t *yy[2] = {yz, yz};
  CHECK(ref_ll_combine(2, T, 4, H, 2, inw, yy, 0, out) == -1, "combine without weights rejected");
}

/* fused vs separate multiply-add (R = 1, E = 2, T = 1, H = 1, token {0, 1}):
 *   y(e0) = -(1 + 2^-7), y(e1) = 1 + 2^-7, w = {1 + 2^-17, 1 + 2^-17}
 *   exact products: +-(1 + 2^-7 + 2^-17 + 2^-24); 2^-24 is half an ulp at 1 and the lower
 *   neighbour is even, so each product rounds to +-(1 + 2^-7 + 2^-17).
 *   slot 0: acc = -(1 + 2^-7 + 2^-17) either way.
 *   slot 1 fused: acc + exact product = 2^-24 -> bf16 0x3380; separate: 0 -> 0x0000. */
static void test_ll_fma(void) {
  static const int64_t ids[] = {0, 1};
  const float w[] = {1.0f + 0x1p-17f, 1.0f + 0x1p-17f};
  uint16_t x[128];
  fill_const(x, BF_1);
  ref_rank_input_t in = {1, x, NULL, ids, w};
  uint16_t y[2 * 128]; /* [L = 2][RT = 1][H = 128] */
  fill_const(y, BF_M1P7);
  fill_const(y + 128, BF_1P7);
  const uint16_t *yp[1] = {y};
  uint16_t o[128];
  uint16_t *op[1] = {o};
  CHECK(ref_ll_combine(1, 1, 2, 128, 2, &in, yp, 1, op) == 0 && o[0] == BF_2PM24, "fused: 0x%04x",
        o[0]);
  CHECK(ref_ll_combine(1, 1, 2, 128, 2, &in, yp, 0, op) == 0 && o[0] == BF_0, "separate: 0x%04x",
        o[0]);
}

/* ================================================================== randomized invariants */

static uint32_t rng = 12345;
static uint32_t rnd(void) {
  rng = rng * 1664525u + 1013904223u;
  return rng >> 8;
}

/* Not hand-computed: properties that must hold on random routing. Small-integer rows keep the
 * combine sums exact: combining y = received x gives x * (number of ranks the token went to). */
static void test_random(void) {
  enum { R = 4, E = 16, K = 4, H = 8, NMAX = 20 };
  for (int iter = 0; iter < 50; iter++) {
    int64_t ids[R][NMAX * K];
    uint16_t x[R][NMAX * H];
    int32_t tpr[R][R], tpe[R][E];
    ref_rank_input_t in[R];
    for (int s = 0; s < R; s++) {
      int n = (int)(rnd() % (NMAX + 1));
      for (int i = 0; i < n * K; i++) ids[s][i] = (int64_t)(rnd() % (E + 1)) - 1;
      for (int i = 0; i < n * H; i++) x[s][i] = ref_f32_to_bf16((float)(rnd() % 64) - 32);
      in[s] = (ref_rank_input_t){n, x[s], NULL, ids[s], NULL};
      CHECK(ref_layout(ids[s], n, K, E, R, tpr[s], tpe[s], NULL) == 0, "layout");
    }
    ref_recv_t rv[R];
    if (ref_dispatch(R, E, K, H * 2, 0, 0, in, rv) != 0) {
      CHECK(0, "random dispatch");
      return;
    }
    for (int r = 0; r < R; r++) {
      int nr = 0;
      for (int s = 0; s < R; s++) nr += tpr[s][r];
      CHECK(rv[r].nr == nr, "nr = sum of tokens_per_rank");
      CHECK(rv[r].rank_prefix[(R - 1) * R + r] == nr, "last rank_prefix row = nr");
      for (int l = 0; l < E / R; l++) {
        int c = 0;
        for (int s = 0; s < R; s++) c += tpe[s][r * (E / R) + l];
        CHECK(rv[r].tokens_per_expert[l] == c, "tokens_per_expert = sum of layouts");
      }
    }
    const uint16_t *y[R];
    uint16_t out[R][NMAX * H];
    uint16_t *outp[R];
    for (int r = 0; r < R; r++) y[r] = (const uint16_t *)rv[r].x, outp[r] = out[r];
    CHECK(ref_combine(R, H, K, in, rv, y, NULL, NULL, NULL, outp, NULL) == 0, "random combine");
    for (int s = 0; s < R; s++)
      for (int t = 0; t < in[s].n; t++) {
        int m = 0;
        for (int r = 0; r < R; r++)
          for (int k = 0; k < K; k++)
            if (ids[s][t * K + k] >= 0 && ids[s][t * K + k] / (E / R) == r) {
              m++;
              break;
            }
        for (int h = 0; h < H; h++)
          CHECK(ref_bf16_to_f32(out[s][t * H + h]) == ref_bf16_to_f32(x[s][t * H + h]) * (float)m ||
                    (m == 0 && out[s][t * H + h] == 0),
                "combine(dispatch(x)) = x * ranks");
      }
    for (int r = 0; r < R; r++) ref_free_recv(&rv[r]);
  }
}

int main(int argc, char **argv) {
  int full = argc > 1 && strcmp(argv[1], "--full") == 0;
  test_bf16_spot();
  test_bf16_all_codes();
  test_bf16_encode(full);
  test_e4m3_decode();
  test_e4m3_encode_spot();
  test_e4m3_encode(full);
  test_layout();
  test_dispatch();
  test_combine();
  test_ll_cast();
  test_ll();
  test_ll_fma();
  test_random();
  if (failures) {
    printf("test_ref: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_ref: all passed%s\n", full ? " (full fp32 sweeps)" : "");
  return 0;
}
