#include "cpu_plan.h"

#include <stdlib.h>
#include <string.h>

void cpu_plan_free(void *plan) {
  cpu_plan_t *p = plan;
  if (!p) return;
  free(p->in_rank);
  free(p->send_idx);
  free(p->send_off);
  free(p->send_chan);
  free(p->recv_cnt);
  free(p->recv_base);
  free(p->rank_prefix);
  free(p);
}

cpu_plan_t *cpu_plan_new(int R, int C, int N) {
  cpu_plan_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->R = R;
  p->C = C;
  p->N = N;
  size_t n = (size_t)N, r = (size_t)R, c = (size_t)C;
  p->in_rank = calloc(n * r + 1, 1);
  p->send_idx = malloc((n * r + 1) * sizeof(int32_t));
  p->send_off = calloc(r + 1, sizeof(int32_t));
  p->send_chan = calloc(r * (c + 1), sizeof(int32_t));
  p->recv_cnt = calloc(r * c, sizeof(int32_t));
  p->recv_base = calloc(r * c, sizeof(int32_t));
  p->rank_prefix = calloc(r * r, sizeof(int32_t));
  if (!p->in_rank || !p->send_idx || !p->send_off || !p->send_chan || !p->recv_cnt ||
      !p->recv_base || !p->rank_prefix) {
    cpu_plan_free(p);
    return NULL;
  }
  return p;
}

void cpu_plan_send_side(cpu_plan_t *p) {
  int R = p->R, C = p->C;
  for (int d = 0; d < R; d++) {
    int32_t *chan = p->send_chan + (size_t)d * (size_t)(C + 1);
    int32_t k = p->send_off[d];
    for (int c = 0; c < C; c++) {
      int b, e;
      cpu_chan_range(p->N, C, c, &b, &e);
      chan[c] = k - p->send_off[d];
      for (int t = b; t < e; t++)
        if (p->in_rank[(size_t)t * (size_t)R + (size_t)d]) p->send_idx[k++] = t;
    }
    chan[C] = k - p->send_off[d];
    p->send_off[d + 1] = k;
  }
}
