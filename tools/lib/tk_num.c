/* The e4m3 conversions of tk_num.h, written to be obviously right rather than fast. */
#include "tk_num.h"

#include <math.h>

uint8_t tk_f32_to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  uint8_t sign = signbit(f) ? 0x80 : 0x00;
  float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e; /* anything from 448 up (inf too) saturates to 448 */
  /* e4m3 values in binade [2^E, 2^(E+1)) are spaced 2^(E-3); below 2^-6 (subnormals) the spacing
   * is 2^-9, i.e. the subnormals share the spacing of the binade E = -6. */
  int E;
  frexpf(a, &E); /* a = m * 2^E with m in [0.5, 1) */
  E -= 1;        /* now a = 1.xxx * 2^E */
  if (a < 0x1p-6f) E = -6;
  float q = ldexpf(a, 3 - E); /* a in units of the spacing: exact (power-of-two scaling) */
  float fl = floorf(q);
  float frac = q - fl; /* exact */
  int m = (int)fl;
  if (frac > 0.5f || (frac == 0.5f && (m & 1))) m++; /* round to nearest, ties to even */
  /* For E >= -6 and m in [8, 16]: code = ((E + 7) << 3) + (m - 8) = (E + 6) * 8 + m; m == 16
   * carries into the next binade. Subnormals (E = -6, m in [0, 8]) give code m, which is also
   * right (m == 8 is 2^-6, the smallest normal). */
  int code = (E + 6) * 8 + m;
  if (code > 0x7e) code = 0x7e; /* unreachable for a < 448, kept as the saturation rule */
  return (uint8_t)(sign | code);
}

float tk_e4m3_to_f32(uint8_t v) {
  int e = (v >> 3) & 15, m = v & 7;
  float a;
  if ((v & 0x7f) == 0x7f)
    a = NAN;
  else if (e == 0)
    a = ldexpf((float)m, -9); /* subnormal: m * 2^-9 */
  else
    a = ldexpf((float)(8 + m), e - 10); /* (1 + m/8) * 2^(e-7) */
  return (v & 0x80) ? -a : a;
}
