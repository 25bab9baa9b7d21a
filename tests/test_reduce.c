/* The combine reduction kernels (src/cpu/cpu_reduce.c): every kernel this CPU has must give the
 * same bits as the scalar loop, and that loop the reference's arithmetic (tools/ref/ref.c), over
 * random rows with the awkward values mixed in: +-0, denormals, +-inf, values whose sum overflows,
 * NaN (every NaN result is the canonical 0x7fff, whatever payload the adds propagated). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_reduce.h"
#include "ref.h"

static uint64_t state = 88172645463325252ull;
static uint32_t rnd(void) {
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return (uint32_t)state;
}

static uint16_t value(int nan_ok) {
  static const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80,
                                     0x7f7f, 0xff7f, 0x3f80, 0xbf80, 0x0080, 0x7fc0};
  uint32_t r = rnd();
  if (r % 8 == 0) {
    uint16_t v = special[(r >> 3) % (sizeof special / sizeof special[0] - (nan_ok ? 0 : 1))];
    return v;
  }
  uint16_t v = (uint16_t)(r >> 16);
  if (!nan_ok && (v & 0x7f80) == 0x7f80 && (v & 0x7f)) v &= 0xff80; /* NaN -> inf */
  return v;
}

static int first_diff(const uint16_t *a, const uint16_t *b, int H) {
  for (int h = 0; h < H; h++)
    if (a[h] != b[h]) return h;
  return -1;
}

static int check(int H, int n, int with_b0, int with_b1, int nan_ok) {
  uint16_t *rows[8], *b0 = malloc((size_t)H * 2), *b1 = malloc((size_t)H * 2);
  uint16_t *want = malloc((size_t)H * 2), *got = malloc((size_t)H * 2),
           *ref = malloc((size_t)H * 2);
  for (int i = 0; i < n; i++) {
    rows[i] = malloc((size_t)H * 2);
    for (int h = 0; h < H; h++) rows[i][h] = value(nan_ok);
  }
  for (int h = 0; h < H; h++) b0[h] = value(nan_ok), b1[h] = value(nan_ok);
  const uint16_t *p0 = with_b0 ? b0 : NULL, *p1 = with_b1 ? b1 : NULL;
  int bad = 0;
  cpu_reduce_rows_with(CPU_REDUCE_SCALAR, want, (const uint16_t *const *)rows, n, p0, p1, H, 0);
  for (int h = 0; h < H; h++) { /* the reference's rule, written out */
    float acc = (p0 ? ref_bf16_to_f32(p0[h]) : 0.0f) + (p1 ? ref_bf16_to_f32(p1[h]) : 0.0f);
    for (int i = 0; i < n; i++) acc += ref_bf16_to_f32(rows[i][h]);
    ref[h] = ref_f32_to_bf16(acc);
    if (ref[h] != want[h]) {
      printf("scalar kernel differs from the reference at H=%d h=%d: %#06x vs %#06x\n", H, h,
             want[h], ref[h]);
      bad = 1;
      break;
    }
  }
  static const char *const names[] = {"", "scalar", "vector", "avx2", "avx512"};
  for (int k = CPU_REDUCE_VECTOR; k <= CPU_REDUCE_AVX512; k++) {
    memset(got, 0xee, (size_t)H * 2);
    if (cpu_reduce_rows_with((cpu_reduce_kind_t)k, got, (const uint16_t *const *)rows, n, p0, p1, H,
                             (int)(rnd() & 1)) != 0)
      continue;
    int h = first_diff(got, want, H);
    if (h >= 0) {
      printf("%s kernel differs at H=%d n=%d bias=%d%d h=%d: %#06x vs %#06x\n", names[k], H, n,
             with_b0, with_b1, h, got[h], want[h]);
      bad = 1;
    }
  }
  memset(got, 0xee, (size_t)H * 2);
  cpu_reduce_rows(got, (const uint16_t *const *)rows, n, p0, p1, H, 1);
  cpu_reduce_fence();
  if (first_diff(got, want, H) >= 0) printf("the chosen kernel differs at H=%d\n", H), bad = 1;
  for (int i = 0; i < n; i++) free(rows[i]);
  free(b0), free(b1), free(want), free(got), free(ref);
  return bad;
}

int main(void) {
  static const int Hs[] = {8, 16, 24, 32, 40, 56, 64, 136, 7168};
  int bad = 0, have = 0;
  for (int k = CPU_REDUCE_AVX2; k <= CPU_REDUCE_AVX512; k++) {
    uint16_t o[8], r0[8] = {0};
    const uint16_t *rows[1] = {r0};
    have += cpu_reduce_rows_with((cpu_reduce_kind_t)k, o, rows, 1, NULL, NULL, 8, 0) == 0;
  }
  for (size_t i = 0; i < sizeof Hs / sizeof Hs[0]; i++)
    for (int n = 0; n <= 8; n++)
      for (int b = 0; b < 4; b++)
        for (int nan_ok = 0; nan_ok < 2; nan_ok++) bad |= check(Hs[i], n, b & 1, b >> 1, nan_ok);
  printf("reduce kernels: %s (%d of 2 x86 kernels available here)\n",
         bad ? "MISMATCH" : "bit-identical", have);
  return bad;
}
