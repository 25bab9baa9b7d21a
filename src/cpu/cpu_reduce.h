/* The reduction of normal-mode combine (SEMANTICS.md §4.2) for one token: out = bf16(bias0 + bias1
 * + rows[0] + ... + rows[n-1]), each sum in fp32 in that order, one round to nearest even at the
 * end (a NaN becomes the canonical 0x7fff, as cpu_f32_to_bf16, the reference and CUDA give). Absent
 * biases count as +0.0f. Every kernel computes exactly this, lane by lane, so they are
 * bit-identical; the fastest one the CPU supports is chosen once. H: a multiple of 8. stream: the
 * output is far larger than the caches; kernels that can write it with non-temporal stores do (the
 * caller issues cpu_reduce_fence() before anyone else may read it). */
#ifndef EP_CPU_REDUCE_H
#define EP_CPU_REDUCE_H

#include <stdint.h>

typedef enum {
  CPU_REDUCE_AUTO = 0,
  CPU_REDUCE_SCALAR = 1, /* reference loop, one channel at a time */
  CPU_REDUCE_VECTOR = 2, /* portable GCC/Clang vector extensions, 8 channels per step */
  CPU_REDUCE_AVX2 = 3,   /* x86-64 AVX2, 16 channels per step */
  CPU_REDUCE_AVX512 = 4, /* x86-64 AVX-512BW, 32 channels per step */
} cpu_reduce_kind_t;

void cpu_reduce_rows(uint16_t *out, const uint16_t *const *rows, int n, const uint16_t *bias0,
                     const uint16_t *bias1, int H, int stream);
void cpu_reduce_fence(void); /* orders earlier non-temporal stores (x86 sfence; else nothing) */
/* For tests: run one kernel; returns 0, or -1 if this CPU or build does not have it. */
int cpu_reduce_rows_with(cpu_reduce_kind_t kind, uint16_t *out, const uint16_t *const *rows, int n,
                         const uint16_t *bias0, const uint16_t *bias1, int H, int stream);

/* Across hosts (SEMANTICS.md §4.6). A host's partial: out[h] = float(rows[0][h]) +
 * float(rows[1][h]) + ..., fp32 in order, n >= 1. */
void cpu_reduce_partial(float *out, const uint16_t *const *rows, int n, int H);
/* The source's reduction: out[h] = bf16(((bias0 + bias1) + P[0][h]) + P[1][h] ...). Part i is
 * one fp32 row (nrows[i] == 0) or nrows[i] >= 1 bf16 rows of one host, summed in fp32 in order
 * first (the host's partial, computed in place: the same bits as cpu_reduce_partial's, a single
 * row as itself). p: the parts' pointers one after another. */
void cpu_reduce_final(uint16_t *out, const void *const *p, const int *nrows, int n,
                      const uint16_t *bias0, const uint16_t *bias1, int H);

#endif
