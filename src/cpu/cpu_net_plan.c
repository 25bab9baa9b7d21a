/* The layout of one dispatch across hosts (cpu_nplan_t, cpu_net.h): this rank's tokens per host,
 * the counts of every rank, and the fan-out lists of the blocks this rank forwards. */
#include "cpu_net_plan.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_net.h"

void cpu_nplan_free(void *plan) {
  cpu_nplan_t *p = plan;
  if (!p) return;
  cpu_plan_free(p->flat);
  free(p->cnt), free(p->hcnt), free(p->hsend_off), free(p->hsend_idx), free(p->tok_j);
  free(p->tok_nfan), free(p->col), free(p->blk_base), free(p->fan_off), free(p->fan_l);
  free(p->fan_row), free(p->row_src), free(p->row_j);
  free(p);
}

cpu_nplan_t *cpu_nplan_new(const cpu_state_t *s, int N) {
  cpu_nplan_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  int R = s->gnranks, H = s->topo->nhosts;
  size_t nh = (size_t)N * (size_t)H + 1;
  p->H = H, p->L = s->topo->local_size;
  p->flat = cpu_plan_new(R, s->channels, N);
  p->cnt = calloc((size_t)R * R, sizeof *p->cnt);
  p->hcnt = calloc((size_t)R * H, sizeof *p->hcnt);
  p->hsend_off = calloc((size_t)H + 1, sizeof *p->hsend_off);
  p->hsend_idx = malloc(nh * sizeof *p->hsend_idx);
  p->tok_j = malloc(nh * sizeof *p->tok_j);
  p->tok_nfan = calloc(nh, sizeof *p->tok_nfan);
  p->col = malloc((size_t)H * sizeof *p->col);
  p->blk_base = calloc((size_t)H + 1, sizeof *p->blk_base);
  if (!p->flat || !p->cnt || !p->hcnt || !p->hsend_off || !p->hsend_idx || !p->tok_j ||
      !p->tok_nfan || !p->col || !p->blk_base) {
    cpu_nplan_free(p);
    return NULL;
  }
  return p;
}

/* This rank's tokens per host, in token order, and how many ranks of each host a token meets. */
void cpu_nplan_send_side(const cpu_state_t *s, cpu_nplan_t *p, int32_t *to_rank, int32_t *to_host) {
  const ep_topo_t *t = s->topo;
  int N = p->flat->N, R = s->gnranks, H = p->H;
  memset(to_rank, 0, (size_t)R * sizeof *to_rank);
  memset(to_host, 0, (size_t)H * sizeof *to_host);
  for (int tk = 0; tk < N; tk++) {
    const uint8_t *m = p->flat->in_rank + (size_t)tk * R;
    int32_t *nf = p->tok_nfan + (size_t)tk * H;
    for (int r = 0; r < R; r++) to_rank[r] += m[r], nf[t->host_of[r]] += m[r];
    for (int g = 0; g < H; g++) to_host[g] += nf[g] > 0;
  }
  for (int g = 0, k = 0; g < H; g++) {
    p->hsend_off[g] = k;
    for (int tk = 0; tk < N; tk++) {
      bool go = p->tok_nfan[(size_t)tk * H + g] > 0;
      p->tok_j[(size_t)tk * H + g] = go ? k - p->hsend_off[g] : -1;
      if (go) p->hsend_idx[k++] = tk;
    }
    p->hsend_off[g + 1] = k;
  }
}

static int cmp_int(const void *a, const void *b) {
  return *(const int *)a - *(const int *)b;
}

/* Everyone's counts (key, to_rank[R], to_host[H] per rank) give the receive side: rank_prefix,
 * the rows of this rank, the blocks this rank forwards and room for their fan-out lists. */
bool cpu_nplan_recv_side(const cpu_state_t *s, cpu_nplan_t *p, const int32_t *counts, int cw) {
  const ep_topo_t *t = s->topo;
  int R = s->gnranks, H = p->H, L = p->L, key = (int)(sizeof(ep_call_key_t) / 4);
  for (int src = 0; src < R; src++) {
    memcpy(p->cnt + (size_t)src * R, counts + (size_t)src * cw + key, (size_t)R * sizeof(int32_t));
    memcpy(p->hcnt + (size_t)src * H, counts + (size_t)src * cw + key + R,
           (size_t)H * sizeof(int32_t));
  }
  int32_t *pre = p->flat->rank_prefix;
  for (int i = 0; i < R; i++)
    for (int d = 0; d < R; d++)
      pre[(size_t)i * R + d] = p->cnt[(size_t)i * R + d] + (i ? pre[(size_t)(i - 1) * R + d] : 0);
  p->flat->Nr = pre[(size_t)(R - 1) * R + s->grank];
  for (int g = 0; g < H; g++) p->col[g] = t->rank_at[g * L + t->local_rank];
  qsort(p->col, (size_t)H, sizeof *p->col, cmp_int);
  int64_t nfan = 0;
  for (int b = 0; b < H; b++) {
    p->blk_base[b + 1] = p->blk_base[b] + p->hcnt[(size_t)p->col[b] * H + t->host];
    for (int l = 0; l < L; l++) nfan += p->cnt[(size_t)p->col[b] * R + t->rank_at[t->host * L + l]];
  }
  int32_t entries = p->blk_base[H];
  p->nfan = (int32_t)nfan;
  p->fan_off = calloc((size_t)entries + 1, sizeof *p->fan_off);
  p->fan_l = malloc(((size_t)nfan + 1) * sizeof *p->fan_l);
  p->fan_row = malloc(((size_t)nfan + 1) * sizeof *p->fan_row);
  p->row_src = malloc(((size_t)p->flat->Nr + 1) * sizeof *p->row_src);
  p->row_j = malloc(((size_t)p->flat->Nr + 1) * sizeof *p->row_j);
  if (!p->fan_off || !p->fan_l || !p->fan_row || !p->row_src || !p->row_j) return false;
  /* Where each block's fan-out lists start: known from the counts, so that blocks can be
   * listed independently, as they arrive. */
  for (int b = 0, f = 0; b < H; b++) {
    p->fan_off[p->blk_base[b]] = f;
    for (int l = 0; l < L; l++) f += p->cnt[(size_t)p->col[b] * R + t->rank_at[t->host * L + l]];
  }
  return true;
}

void cpu_nplan_fan(const cpu_state_t *s, cpu_nplan_t *p, int b, int j, const int64_t *ids, int topk,
                   int num_local, int32_t *next) {
  const ep_topo_t *t = s->topo;
  int L = p->L, R = s->gnranks, src = p->col[b], i = p->blk_base[b] + j;
  uint8_t mark[L];
  memset(mark, 0, sizeof mark);
  for (int k = 0; k < topk; k++) {
    if (ids[k] < 0) continue;
    int d = (int)(ids[k] / num_local);
    if (t->host_of[d] == t->host) mark[t->local_of[d]] = 1;
  }
  int32_t f = p->fan_off[i];
  const int32_t *pre = p->flat->rank_prefix;
  for (int l = 0; l < L; l++) {
    if (!mark[l]) continue;
    int d = t->rank_at[t->host * L + l];
    p->fan_l[f] = (uint16_t)l;
    p->fan_row[f++] = (src ? pre[(size_t)(src - 1) * R + d] : 0) + next[l]++;
  }
  p->fan_off[i + 1] = f;
}
