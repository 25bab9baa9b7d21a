/* Row kernels of low-latency mode: the fp8 cast of a bf16 row and the weighted reduction of the
 * combine. Both are bit-exact with SEMANTICS.md §5 and §6.5 (and tools/ref/ref.c), in a portable
 * scalar form and an AVX2 + FMA form picked at buffer creation when the processor has it. The
 * scalar form uses fmaf(): one rounding per step whatever the compiler's contraction flags. */
#include <math.h>
#include <string.h>

#include "cpu_ll.h"

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline float bf16_f32(uint16_t b) {
  return u2f((uint32_t)b << 16);
}

/* Round to nearest even; NaN gives 0x7fff, the canonical NaN of CUDA's conversion. */
static inline uint16_t f32_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define E4M3_MIN_NORMAL 0x3c800000u /* 2^-6 */
#define E4M3_MAX 0x43e00000u        /* 448 */
#define SUB_MAGIC 0x46800000u       /* 2^14: its ulp is 2^-9, the e4m3 subnormal spacing */

/* fp32 -> e4m3fn: nearest even, |x| >= 448 (inf too) saturates to 0x7e, NaN -> 0x7f. */
static inline uint8_t f32_e4m3(float f) {
  uint32_t u = f2u(f), a = u & 0x7fffffffu;
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  if (a > 0x7f800000u) return 0x7f;
  if (a >= E4M3_MAX) return sign | 0x7e;
  if (a < E4M3_MIN_NORMAL) /* the float add rounds |x| to a multiple of 2^-9, ties to even */
    return sign | (uint8_t)(f2u(u2f(a) + u2f(SUB_MAGIC)) - SUB_MAGIC);
  /* keep 3 of 23 mantissa bits, ties to even; a carry moves into the exponent, as it should */
  uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return sign | (uint8_t)(r - (120u << 3)); /* exponent bias 127 -> 7 */
}

/* Scale of one block of 128 from its amax (SEMANTICS.md §5.3-5.5). Returns the multiplier; *inv
 * and *e get the stored scale and, for round_scale, its exponent. */
static inline float block_scale(float amax, int round_scale, float *inv, int *e) {
  const float inv448 = 1.0f / 448.0f;
  if (!round_scale) {
    *inv = amax * inv448;
    *e = 0;
    return 448.0f / amax;
  }
  uint32_t bits = f2u(amax * inv448);
  *e = (int)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0); /* ceil(log2) */
  *inv = u2f((uint32_t)(*e + 127) << 23);
  return u2f((uint32_t)(127 - *e) << 23);
}

static inline void store_scale(void *sc, int b, int ue8m0, float inv, int e) {
  if (ue8m0)
    ((uint8_t *)sc)[b] = (uint8_t)(e + 127);
  else
    ((float *)sc)[b] = inv;
}

static void cast_row_scalar(const uint16_t *x, int H, int round_scale, int ue8m0, uint8_t *q,
                            void *sc) {
  for (int b = 0; b < H / 128; b++) {
    const uint16_t *xb = x + (size_t)b * 128;
    float amax = 1e-4f;
    for (int i = 0; i < 128; i++) {
      float v = fabsf(bf16_f32(xb[i]));
      amax = v > amax ? v : amax; /* as fmaxf: a NaN does not raise amax */
    }
    float inv;
    int e;
    float scale = block_scale(amax, round_scale || ue8m0, &inv, &e);
    for (int i = 0; i < 128; i++) q[(size_t)b * 128 + i] = f32_e4m3(bf16_f32(xb[i]) * scale);
    store_scale(sc, b, ue8m0, inv, e);
  }
}

static void reduce_scalar(const uint16_t *const *rows, const float *w, int n, int H,
                          uint16_t *out) {
  for (int h = 0; h < H; h++) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = fmaf(bf16_f32(rows[i][h]), w[i], acc);
    out[h] = f32_bf16(acc);
  }
}

void cpu_ll_kernels_scalar(cpu_ll_kernels_t *k) {
  k->cast_row = cast_row_scalar;
  k->reduce = reduce_scalar;
}

uint8_t cpu_ll_f32_to_e4m3(float f) {
  return f32_e4m3(f);
}

/* ------------------------------------------------------------------ AVX2 + FMA */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 load8_bf16(const uint16_t *p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

AVX2 static inline __m128i bf16x8(__m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  r = _mm256_srli_epi32(r, 16);
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fff), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2 static void reduce_avx2(const uint16_t *const *rows, const float *w, int n, int H,
                             uint16_t *out) {
  int h = 0;
  for (; h + 16 <= H; h += 16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
      __m256 wi = _mm256_set1_ps(w[i]);
      a0 = _mm256_fmadd_ps(load8_bf16(rows[i] + h), wi, a0);
      a1 = _mm256_fmadd_ps(load8_bf16(rows[i] + h + 8), wi, a1);
    }
    _mm_storeu_si128((__m128i *)(out + h), bf16x8(a0));
    _mm_storeu_si128((__m128i *)(out + h + 8), bf16x8(a1));
  }
  for (; h < H; h++) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = fmaf(bf16_f32(rows[i][h]), w[i], acc);
    out[h] = f32_bf16(acc);
  }
}

/* Eight e4m3 codes in the low byte of each 32-bit lane; the same rules as f32_e4m3. */
AVX2 static inline __m256i e4m3x8(__m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i nrm = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7ffff)), lsb);
  nrm = _mm256_sub_epi32(_mm256_srli_epi32(nrm, 20), _mm256_set1_epi32(120 << 3));
  __m256 s =
      _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32((int)SUB_MAGIC)));
  __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(s), _mm256_set1_epi32((int)SUB_MAGIC));
  __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)E4M3_MIN_NORMAL), a);
  __m256i code = _mm256_blendv_epi8(nrm, sub, is_sub);
  __m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)E4M3_MAX - 1));
  code = _mm256_or_si256(_mm256_blendv_epi8(code, _mm256_set1_epi32(0x7e), sat), sign);
  __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), nan);
}

/* 32 values -> 32 bytes in order (the packs interleave 128-bit lanes; the permute undoes it). */
AVX2 static inline void store32_e4m3(uint8_t *q, const __m256 *v, __m256 scale) {
  __m256i c0 = e4m3x8(_mm256_mul_ps(v[0], scale)), c1 = e4m3x8(_mm256_mul_ps(v[1], scale));
  __m256i c2 = e4m3x8(_mm256_mul_ps(v[2], scale)), c3 = e4m3x8(_mm256_mul_ps(v[3], scale));
  __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i *)q, b);
}

AVX2 static float amax16(const __m256 *v) {
  __m256 m = _mm256_set1_ps(1e-4f), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  /* max_ps returns its second operand when either is NaN: a NaN does not raise amax */
  for (int i = 0; i < 16; i++) m = _mm256_max_ps(_mm256_and_ps(v[i], abs), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

AVX2 static void cast_row_avx2(const uint16_t *x, int H, int round_scale, int ue8m0, uint8_t *q,
                               void *sc) {
  __m256 v[16];
  for (int b = 0; b < H / 128; b++) {
    for (int i = 0; i < 16; i++) v[i] = load8_bf16(x + (size_t)b * 128 + (size_t)i * 8);
    float inv;
    int e;
    __m256 scale = _mm256_set1_ps(block_scale(amax16(v), round_scale || ue8m0, &inv, &e));
    for (int i = 0; i < 16; i += 4) store32_e4m3(q + (size_t)b * 128 + (size_t)i * 8, v + i, scale);
    store_scale(sc, b, ue8m0, inv, e);
  }
}

void cpu_ll_kernels_pick(cpu_ll_kernels_t *k) {
  cpu_ll_kernels_scalar(k);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    k->cast_row = cast_row_avx2;
    k->reduce = reduce_avx2;
  }
}
#else
void cpu_ll_kernels_pick(cpu_ll_kernels_t *k) {
  cpu_ll_kernels_scalar(k);
}
#endif
