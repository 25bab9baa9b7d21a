/* Layout (SEMANTICS.md §2): per-rank token counts, per-expert selection counts, token-in-rank
 * flags. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* First bad id, so the error can name the exact slot. Checked before anything is written. */
static ep_status_t check_ids(cpu_state_t *s, const int64_t *idx, int n, int topk, int E,
                             const char *op) {
  for (size_t i = 0; i < (size_t)n * (size_t)topk; i++)
    if (idx[i] < -1 || idx[i] >= E)
      return ep_call_bad_expert(s->ctx, op, (int64_t)(i / (size_t)topk), (int)(i % (size_t)topk),
                                idx[i], E);
  return EP_OK;
}

/* Host outputs (SEMANTICS.md §2.3): a token goes to a host when it goes to a rank of it. */
static void host_layout(const cpu_state_t *s, const uint8_t *seen, int t, int32_t *per_host,
                        uint8_t *in_host) {
  const ep_topo_t *tp = s->topo;
  int H = tp->nhosts;
  uint8_t hs[H];
  memset(hs, 0, sizeof hs);
  for (int r = 0; r < s->gnranks; r++) hs[tp->host_of[r]] |= seen[r];
  for (int h = 0; h < H; h++) {
    if (per_host) per_host[h] += hs[h];
    if (in_host) in_host[(size_t)t * (size_t)H + (size_t)h] = hs[h];
  }
}

ep_status_t cpu_route(cpu_state_t *s, const int64_t *idx, int n, int topk, int E, int32_t *per_rank,
                      int32_t *per_expert, uint8_t *in_rank, int32_t *per_host, uint8_t *in_host,
                      const char *op) {
  ep_status_t st = check_ids(s, idx, n, topk, E, op);
  if (st) return st;
  int R = s->gnranks, per = E / R;
  if (per_rank) memset(per_rank, 0, (size_t)R * sizeof *per_rank);
  if (per_expert) memset(per_expert, 0, (size_t)E * sizeof *per_expert);
  if (per_host) memset(per_host, 0, (size_t)s->topo->nhosts * sizeof *per_host);
  uint8_t seen[R];
  for (int t = 0; t < n; t++) {
    memset(seen, 0, sizeof seen);
    for (int k = 0; k < topk; k++) {
      int64_t e = idx[(size_t)t * (size_t)topk + (size_t)k];
      if (e < 0) continue;
      seen[e / per] = 1;
      if (per_expert) per_expert[e]++;
    }
    for (int r = 0; r < R; r++) {
      if (per_rank) per_rank[r] += seen[r];
      if (in_rank) in_rank[(size_t)t * (size_t)R + (size_t)r] = seen[r];
    }
    if (per_host || in_host) host_layout(s, seen, t, per_host, in_host);
  }
  return EP_OK;
}

ep_status_t cpu_layout(void *state, const ep_layout_args_t *a) {
  return cpu_route(state, a->topk_idx, a->num_tokens, a->topk, a->num_experts, a->tokens_per_rank,
                   a->tokens_per_expert, a->is_token_in_rank, a->tokens_per_host,
                   a->is_token_in_host, "ep_get_dispatch_layout");
}
