/* The layout of one normal-mode dispatch as the CPU backend keeps it (a handle's priv). */
#ifndef EP_CPU_PLAN_H
#define EP_CPU_PLAN_H

#include "cpu.h"

typedef struct {
  int R, C, N, Nr;
  uint8_t *in_rank;     /* [N][R] */
  int32_t *send_idx;    /* per destination, its tokens ascending: send_off[d] .. send_off[d+1] */
  int32_t *send_off;    /* [R+1] */
  int32_t *send_chan;   /* [R][C+1]: channel c of destination d is send_chan[d][c] .. [c+1] */
  int32_t *recv_cnt;    /* [R][C]: rows from source s on channel c */
  int32_t *recv_base;   /* [R][C]: first output row of (s, c) */
  int32_t *rank_prefix; /* [R][R] */
} cpu_plan_t;

cpu_plan_t *cpu_plan_new(int R, int C, int N);
void cpu_plan_free(void *plan);
/* Send side from is_token_in_rank (plan->in_rank filled). */
void cpu_plan_send_side(cpu_plan_t *p);
/* Token range of channel c among N tokens (DeepEP's split: ceil(N / C) per channel). */
static inline void cpu_chan_range(int N, int C, int c, int *begin, int *end) {
  int chunk = (N + C - 1) / C;
  *begin = c * chunk < N ? c * chunk : N;
  *end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
}

/* Record sizes: every field 16-byte aligned so that rows copy with wide moves. */
static inline size_t cpu_al16(size_t x) {
  return (x + 15) & ~(size_t)15;
}

#endif
