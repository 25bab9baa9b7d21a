/* Kernels of cpu_reduce.h. The x86 ones widen bf16 to fp32 by interleaving with zeros
 * (unpacklo/hi within 128-bit lanes) and narrow back with packus, which undoes that interleave
 * lane by lane: no cross-lane shuffles. Rounding is integer arithmetic on the float's bits, never a
 * hardware bf16 conversion (those treat denormals as zero). */
#include "cpu_reduce.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define EP_X86 1
#endif

static inline __attribute__((always_inline)) uint16_t round_bf16(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff; /* the canonical NaN (cpu.h, CUDA) */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Always inlined, so the AVX2 copies of the kernels across hosts compile them with AVX2 too. */
#define EP_INLINE static inline __attribute__((always_inline))

EP_INLINE float widen(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void reduce_scalar(uint16_t *out, const uint16_t *const *rows, int n, const uint16_t *b0,
                          const uint16_t *b1, int h, int H) {
  for (; h < H; h++) {
    float acc = (b0 ? widen(b0[h]) : 0.0f) + (b1 ? widen(b1[h]) : 0.0f);
    for (int i = 0; i < n; i++) acc += widen(rows[i][h]);
    uint32_t u;
    memcpy(&u, &acc, sizeof u);
    out[h] = round_bf16(u);
  }
}

/* ---------------------------------------------------------------- portable vectors */
#if defined(__GNUC__) && !defined(__clang__)
/* 32-byte vectors pass between static inline helpers only: no ABI is involved. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

EP_INLINE f32x8 load8(const uint16_t *p) {
  u16x8 h;
  memcpy(&h, p, sizeof h);
  return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
}

EP_INLINE void store8(uint16_t *p, f32x8 f) {
  u32x8 u = (u32x8)f;
  u32x8 nan = (u32x8)((u & 0x7fffffffu) > 0x7f800000u);
  u32x8 rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u16x8 h = __builtin_convertvector((0x7fffu & nan) | (rne & ~nan), u16x8);
  memcpy(p, &h, sizeof h);
}

static void reduce_vector(uint16_t *out, const uint16_t *const *rows, int n, const uint16_t *b0,
                          const uint16_t *b1, int h, int H) {
  const f32x8 zero = {0};
  for (; h + 8 <= H; h += 8) {
    f32x8 acc = (b0 ? load8(b0 + h) : zero) + (b1 ? load8(b1 + h) : zero);
    for (int i = 0; i < n; i++) acc += load8(rows[i] + h);
    store8(out + h, acc);
  }
  reduce_scalar(out, rows, n, b0, b1, h, H);
}

/* ---------------------------------------------------------------- AVX2 */
#ifdef EP_X86
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i round256(__m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                   _mm256_set1_epi32(0x7f800000));
  __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                   _mm256_and_si256(hi, _mm256_set1_epi32(1))),
                                  16);
  return _mm256_blendv_epi8(rne, _mm256_set1_epi32(0x7fff), nan);
}

AVX2 static void reduce_avx2(uint16_t *out, const uint16_t *const *rows, int n, const uint16_t *b0,
                             const uint16_t *b1, int H, int stream) {
  const __m256i z = _mm256_setzero_si256();
  stream = stream && ((uintptr_t)out & 31) == 0;
  int h = 0;
  for (; h + 16 <= H; h += 16) {
    __m256 lo = _mm256_setzero_ps(), hi = lo, lo1 = lo, hi1 = lo;
    if (b0) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(b0 + h));
      lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
      hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
    }
    if (b1) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(b1 + h));
      lo1 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
      hi1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
    }
    lo = _mm256_add_ps(lo, lo1), hi = _mm256_add_ps(hi, hi1);
    for (int i = 0; i < n; i++) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(rows[i] + h));
      lo = _mm256_add_ps(lo, _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)));
      hi = _mm256_add_ps(hi, _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)));
    }
    __m256i r = _mm256_packus_epi32(round256(lo), round256(hi));
    if (stream)
      _mm256_stream_si256((__m256i *)(out + h), r);
    else
      _mm256_storeu_si256((__m256i *)(out + h), r);
  }
  reduce_vector(out, rows, n, b0, b1, h, H);
}

/* ---------------------------------------------------------------- AVX-512BW */
#define AVX512 __attribute__((target("avx512f,avx512bw")))

AVX512 static inline __m512i round512(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(hi, _mm512_set1_epi32(1))),
                                  16);
  return _mm512_mask_blend_epi32(nan, rne, _mm512_set1_epi32(0x7fff));
}

AVX512 static void reduce_avx512(uint16_t *out, const uint16_t *const *rows, int n,
                                 const uint16_t *b0, const uint16_t *b1, int H, int stream) {
  const __m512i z = _mm512_setzero_si512();
  stream = stream && ((uintptr_t)out & 63) == 0;
  int h = 0;
  for (; h + 32 <= H; h += 32) {
    __m512 lo = _mm512_setzero_ps(), hi = lo, lo1 = lo, hi1 = lo;
    if (b0) {
      __m512i x = _mm512_loadu_si512((const void *)(b0 + h));
      lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
      hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
    }
    if (b1) {
      __m512i x = _mm512_loadu_si512((const void *)(b1 + h));
      lo1 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
      hi1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
    }
    lo = _mm512_add_ps(lo, lo1), hi = _mm512_add_ps(hi, hi1);
    for (int i = 0; i < n; i++) {
      __m512i x = _mm512_loadu_si512((const void *)(rows[i] + h));
      lo = _mm512_add_ps(lo, _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x)));
      hi = _mm512_add_ps(hi, _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x)));
    }
    __m512i r = _mm512_packus_epi32(round512(lo), round512(hi));
    if (stream)
      _mm512_stream_si512((void *)(out + h), r);
    else
      _mm512_storeu_si512((void *)(out + h), r);
  }
  reduce_vector(out, rows, n, b0, b1, h, H);
}
#endif

/* ---------------------------------------------------------------- selection */
typedef void (*reduce_fn)(uint16_t *, const uint16_t *const *, int, const uint16_t *,
                          const uint16_t *, int, int);

static void run_scalar(uint16_t *o, const uint16_t *const *r, int n, const uint16_t *b0,
                       const uint16_t *b1, int H, int stream) {
  (void)stream;
  reduce_scalar(o, r, n, b0, b1, 0, H);
}

static void run_vector(uint16_t *o, const uint16_t *const *r, int n, const uint16_t *b0,
                       const uint16_t *b1, int H, int stream) {
  (void)stream;
  reduce_vector(o, r, n, b0, b1, 0, H);
}

static reduce_fn kernel(cpu_reduce_kind_t kind) {
  switch (kind) {
    case CPU_REDUCE_SCALAR:
      return run_scalar;
    case CPU_REDUCE_VECTOR:
      return run_vector;
#ifdef EP_X86
    case CPU_REDUCE_AVX2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") ? reduce_avx2 : NULL;
    case CPU_REDUCE_AVX512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? reduce_avx512
                                                                                     : NULL;
#endif
    default:
      return NULL;
  }
}

int cpu_reduce_rows_with(cpu_reduce_kind_t kind, uint16_t *out, const uint16_t *const *rows, int n,
                         const uint16_t *bias0, const uint16_t *bias1, int H, int stream) {
  reduce_fn f = kind == CPU_REDUCE_AUTO ? NULL : kernel(kind);
  if (kind == CPU_REDUCE_AUTO) {
    cpu_reduce_rows(out, rows, n, bias0, bias1, H, stream);
  } else {
    if (!f) return -1;
    f(out, rows, n, bias0, bias1, H, stream);
  }
  cpu_reduce_fence();
  return 0;
}

void cpu_reduce_fence(void) {
#ifdef EP_X86
  _mm_sfence();
#endif
}

void cpu_reduce_rows(uint16_t *out, const uint16_t *const *rows, int n, const uint16_t *bias0,
                     const uint16_t *bias1, int H, int stream) {
  static _Atomic(reduce_fn) chosen; /* a race only stores the same pointer twice */
  reduce_fn f = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (!f) {
    f = kernel(CPU_REDUCE_AVX512);
    if (!f) f = kernel(CPU_REDUCE_AVX2);
    if (!f) f = run_vector;
    atomic_store_explicit(&chosen, f, memory_order_relaxed);
  }
  f(out, rows, n, bias0, bias1, H, stream);
}

/* ---------------------------------------------------------------- across hosts (cpu_net.h) */
/* Portable vectors, compiled twice (AVX2 and the baseline; always inlined into each) and chosen
 * once by the CPU: every lane does the same fp32 adds in the same order, so both give the same
 * bits. */

EP_INLINE f32x8 loadf8(const float *p) {
  f32x8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* A host's partial: out = rows[0] + rows[1] + ..., fp32, in order (SEMANTICS.md §4.6). */
EP_INLINE void partial_body(float *out, const uint16_t *const *rows, int n, int H) {
  int h = 0;
  for (; h + 8 <= H; h += 8) {
    f32x8 acc = load8(rows[0] + h);
    for (int i = 1; i < n; i++) acc += load8(rows[i] + h);
    memcpy(out + h, &acc, sizeof acc);
  }
  for (; h < H; h++) {
    float acc = widen(rows[0][h]);
    for (int i = 1; i < n; i++) acc += widen(rows[i][h]);
    out[h] = acc;
  }
}

/* The source's reduction: ((bias0 + bias1) + P[0]) + P[1] ..., one rounding; one pass, eight
 * channels at a time, every input read once. Part i is one fp32 row (nrows[i] == 0) or the
 * nrows[i] bf16 rows of a host, added in fp32 in order first: exactly the partial partial_body
 * would have written, never stored. */
EP_INLINE void final_body(uint16_t *out, const void *const *p, const int *nrows, int n,
                          const uint16_t *b0, const uint16_t *b1, int H) {
  const f32x8 zero = {0};
  int h = 0;
  for (; h + 8 <= H; h += 8) {
    f32x8 a = (b0 ? load8(b0 + h) : zero) + (b1 ? load8(b1 + h) : zero);
    for (int i = 0, k = 0; i < n; i++) {
      if (!nrows[i]) {
        a += loadf8((const float *)p[k++] + h);
        continue;
      }
      f32x8 part = load8((const uint16_t *)p[k++] + h);
      for (int m = 1; m < nrows[i]; m++) part += load8((const uint16_t *)p[k++] + h);
      a += part;
    }
    store8(out + h, a);
  }
  for (; h < H; h++) {
    float a = (b0 ? widen(b0[h]) : 0.0f) + (b1 ? widen(b1[h]) : 0.0f);
    for (int i = 0, k = 0; i < n; i++) {
      if (!nrows[i]) {
        a += ((const float *)p[k++])[h];
        continue;
      }
      float part = widen(((const uint16_t *)p[k++])[h]);
      for (int m = 1; m < nrows[i]; m++) part += widen(((const uint16_t *)p[k++])[h]);
      a += part;
    }
    uint32_t u;
    memcpy(&u, &a, sizeof u);
    out[h] = round_bf16(u);
  }
}

typedef void (*partial_fn)(float *, const uint16_t *const *, int, int);
typedef void (*final_fn)(uint16_t *, const void *const *, const int *, int, const uint16_t *,
                         const uint16_t *, int);

static void partial_base(float *out, const uint16_t *const *rows, int n, int H) {
  partial_body(out, rows, n, H);
}
static void final_base(uint16_t *out, const void *const *p, const int *nrows, int n,
                       const uint16_t *b0, const uint16_t *b1, int H) {
  final_body(out, p, nrows, n, b0, b1, H);
}
#ifdef EP_X86
AVX2 static void partial_avx2(float *out, const uint16_t *const *rows, int n, int H) {
  partial_body(out, rows, n, H);
}
AVX2 static void final_avx2(uint16_t *out, const void *const *p, const int *nrows, int n,
                            const uint16_t *b0, const uint16_t *b1, int H) {
  final_body(out, p, nrows, n, b0, b1, H);
}
#endif

static bool has_avx2(void) {
#ifdef EP_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

void cpu_reduce_partial(float *out, const uint16_t *const *rows, int n, int H) {
  static _Atomic(partial_fn) chosen; /* a race only stores the same pointer twice */
  partial_fn f = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (!f) {
    f = partial_base;
#ifdef EP_X86
    if (has_avx2()) f = partial_avx2;
#endif
    atomic_store_explicit(&chosen, f, memory_order_relaxed);
  }
  f(out, rows, n, H);
}

void cpu_reduce_final(uint16_t *out, const void *const *p, const int *nrows, int n,
                      const uint16_t *b0, const uint16_t *b1, int H) {
  static _Atomic(final_fn) chosen;
  final_fn f = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (!f) {
    f = final_base;
#ifdef EP_X86
    if (has_avx2()) f = final_avx2;
#endif
    atomic_store_explicit(&chosen, f, memory_order_relaxed);
  }
  f(out, p, nrows, n, b0, b1, H);
}
