/* Number formats of the data the library moves: bf16 and OCP fp8 e4m3fn, as docs/SEMANTICS.md
 * defines the conversions (what CUDA's cvt instructions do). One definition for the tools, the
 * reference (tools/ref) and the tests; tests/test_ref.c checks them on every code. The bf16 pair
 * is inline so that loops over it vectorise (the MPI baseline's reduction). */
#ifndef EP_TK_NUM_H
#define EP_TK_NUM_H

#include <stdint.h>
#include <string.h>

/* bf16 -> fp32: exact. */
static inline float tk_bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* fp32 -> bf16, round to nearest even; overflow gives inf; NaN gives 0x7fff (the canonical NaN
 * of CUDA's cvt.rn.bf16.f32). */
static inline uint16_t tk_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  /* Keep the high 16 bits, rounding on the low 16: adding 0x7fff rounds up anything above half,
   * and the extra +1 when the kept lsb is odd makes an exact half round up to even. A carry into
   * the exponent is right (including overflow to inf). */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 -> e4m3fn (bias 7, 3 mantissa bits, subnormals down to 2^-9, no infinities): nearest
 * even, subnormals included; |value| that rounds above 448 (inf too) saturates to +-448 (0x7e /
 * 0xfe); NaN -> 0x7f; -0 -> 0x80. Like __NV_SATFINITE. */
uint8_t tk_f32_to_e4m3(float f);
float tk_e4m3_to_f32(uint8_t v); /* exact; 0x7f / 0xff -> NaN */

#endif
