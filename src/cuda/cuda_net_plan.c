/* The layout of one dispatch across hosts on the CUDA backend (cuda_nplan_t): planned on the
 * host from the ids and every rank's counts. A sender knows, once the counts are in, the final
 * row of each of its tokens on every rank it goes to (rows are grouped by source rank, each
 * source's in token order: SEMANTICS.md §3.3), so its records carry those rows and the forwarder
 * only copies. */
#include "cuda/cuda_net_plan.h"

#include <stdlib.h>
#include <string.h>

void cuda_nplan_free(void *plan) {
  cuda_nplan_t *p = plan;
  if (!p) return;
  if (p->arena) {
    if (p->d_hdr) cuda_arena_free(p->arena, p->d_hdr, p->b_hdr);
    if (p->d_tok) cuda_arena_free(p->arena, p->d_tok, p->b_tok);
    if (p->d_poff) cuda_arena_free(p->arena, p->d_poff, p->b_poff);
    if (p->d_fan) cuda_arena_free(p->arena, p->d_fan, p->b_fan);
    if (p->d_meta) cuda_arena_free(p->arena, p->d_meta, p->b_meta);
    cuda_arena_unref(p->arena);
  }
  free(p->cnt), free(p->hcnt), free(p->ocnt), free(p->hsend_off), free(p->col), free(p->blk_base),
      free(p->hdr);
  free(p);
}

cuda_nplan_t *cuda_nplan_new(cuda_state_t *s, int N) {
  cuda_nplan_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  int R = s->nranks, H = s->net->H;
  p->N = N, p->R = R, p->H = H, p->L = s->net->L, p->nr = -1;
  p->arena = s->arena;
  cuda_arena_ref(s->arena);
  p->cnt = calloc((size_t)R * R, sizeof *p->cnt);
  p->hcnt = calloc((size_t)R * H, sizeof *p->hcnt);
  p->ocnt = calloc((size_t)R * H, sizeof *p->ocnt);
  p->hsend_off = calloc((size_t)H + 1, sizeof *p->hsend_off);
  p->col = calloc((size_t)H, sizeof *p->col);
  p->blk_base = calloc((size_t)H + 1, sizeof *p->blk_base);
  if (!p->cnt || !p->hcnt || !p->ocnt || !p->hsend_off || !p->col || !p->blk_base) {
    cuda_nplan_free(p);
    return NULL;
  }
  return p;
}

/* Which ranks each token goes to ([N][R] bytes), from ids already checked. */
static void route(const cuda_state_t *s, const int64_t *ids, int N, int topk, int per,
                  uint8_t *in_rank) {
  int R = s->nranks;
  memset(in_rank, 0, (size_t)N * (size_t)R);
  for (int t = 0; t < N; t++)
    for (int k = 0; k < topk; k++) {
      int64_t e = ids[(size_t)t * (size_t)topk + (size_t)k];
      if (e >= 0) in_rank[(size_t)t * R + (size_t)(e / per)] = 1;
    }
}

void cuda_nplan_send_side(const cuda_state_t *s, cuda_nplan_t *p, const int64_t *ids, int topk,
                          int per, uint8_t *in_rank, int32_t *to_rank, int32_t *to_host,
                          int32_t *one_host) {
  const cuda_net_t *n = s->net;
  int N = p->N, R = p->R, H = p->H;
  route(s, ids, N, topk, per, in_rank);
  memset(to_rank, 0, (size_t)R * sizeof *to_rank);
  memset(to_host, 0, (size_t)H * sizeof *to_host);
  memset(one_host, 0, (size_t)H * sizeof *one_host);
  for (int t = 0; t < N; t++) {
    int32_t hs[H];
    memset(hs, 0, sizeof hs);
    for (int r = 0; r < R; r++)
      if (in_rank[(size_t)t * R + r]) to_rank[r]++, hs[n->host_of[r]]++;
    for (int g = 0; g < H; g++) to_host[g] += hs[g] > 0, one_host[g] += hs[g] == 1;
  }
  for (int g = 0; g < H; g++) p->hsend_off[g + 1] = p->hsend_off[g] + to_host[g];
}

static int cmp_int(const void *a, const void *b) {
  return *(const int *)a - *(const int *)b;
}

void cuda_nplan_counts(const cuda_state_t *s, cuda_nplan_t *p, const int32_t *counts, int cw) {
  const cuda_net_t *n = s->net;
  int R = p->R, H = p->H, L = p->L, key = (int)(sizeof(ep_call_key_t) / 4);
  for (int src = 0; src < R; src++) {
    memcpy(p->cnt + (size_t)src * R, counts + (size_t)src * cw + key, (size_t)R * 4);
    memcpy(p->hcnt + (size_t)src * H, counts + (size_t)src * cw + key + R, (size_t)H * 4);
    memcpy(p->ocnt + (size_t)src * H, counts + (size_t)src * cw + key + R + H, (size_t)H * 4);
  }
  p->nr = 0;
  for (int i = 0; i < R; i++) p->nr += p->cnt[(size_t)i * R + s->rank];
  for (int g = 0; g < H; g++) p->col[g] = n->rank_at[g * L + n->lrank];
  qsort(p->col, (size_t)H, sizeof *p->col, cmp_int);
  for (int b = 0; b < H; b++) {
    p->blk_base[b + 1] = p->blk_base[b] + p->hcnt[(size_t)p->col[b] * H + n->host];
    if (p->col[b] == s->rank) p->own = b;
  }
  p->entries = p->blk_base[H];
}

int32_t cuda_nplan_rows_of(const cuda_nplan_t *p, int d) {
  int32_t nr = 0;
  for (int i = 0; i < p->R; i++) nr += p->cnt[(size_t)i * p->R + d];
  return nr;
}

int64_t cuda_nplan_pbytes(const cuda_nplan_t *p, int src, int g) {
  int64_t n = p->hcnt[(size_t)src * p->H + g], one = p->ocnt[(size_t)src * p->H + g];
  return one * (int64_t)epk_net_psize(p->hidden, p->topk, 1) +
         (n - one) * (int64_t)epk_net_psize(p->hidden, p->topk, 0);
}

bool cuda_nplan_headers(const cuda_state_t *s, cuda_nplan_t *p, const uint8_t *in_rank,
                        int64_t *tok) {
  const cuda_net_t *n = s->net;
  int N = p->N, R = p->R, H = p->H, L = p->L, w = EPK_NET_HDR + L;
  int32_t sent = p->hsend_off[H];
  p->hdr = malloc(((size_t)sent + 1) * (size_t)w * sizeof *p->hdr);
  int32_t *row = calloc((size_t)R, sizeof *row); /* next row of this rank's tokens on rank d */
  if (!p->hdr || !row) {
    free(row);
    return false;
  }
  for (int d = 0; d < R; d++)
    for (int i = 0; i < s->rank; i++) row[d] += p->cnt[(size_t)i * R + d];
  int32_t next[H];
  int64_t poff[H]; /* where the next partial of each host's block starts */
  for (int g = 0; g < H; g++) next[g] = 0, poff[g] = 0;
  for (int t = 0; t < N; t++)
    for (int g = 0; g < H; g++) {
      const uint8_t *m = in_rank + (size_t)t * R;
      int nf = 0;
      for (int l = 0; l < L; l++) nf += m[n->rank_at[g * L + l]];
      tok[(size_t)t * H + g] = nf ? 2 * poff[g] + (nf == 1) : -1;
      if (!nf) continue;
      int32_t *h = p->hdr + (size_t)(p->hsend_off[g] + next[g]) * (size_t)w;
      h[0] = t, h[1] = next[g]++;
      h[2] = (int32_t)(uint32_t)((uint64_t)poff[g] & 0xffffffffu);
      h[3] = (int32_t)(uint32_t)((uint64_t)poff[g] >> 32);
      poff[g] += (int64_t)epk_net_psize(p->hidden, p->topk, nf == 1);
      for (int l = 0; l < L; l++) {
        int d = n->rank_at[g * L + l];
        h[EPK_NET_HDR + l] = m[d] ? row[d]++ : -1;
      }
    }
  free(row);
  return true;
}

bool cuda_nplan_device(cuda_nplan_t *p, bool with_hdr) {
  int w = EPK_NET_HDR + p->L;
  p->b_hdr = with_hdr ? ((size_t)p->hsend_off[p->H] * (size_t)w + 1) * 4 : 0;
  p->b_tok = ((size_t)p->N * (size_t)p->H + 1) * 8;
  p->b_fan = ((size_t)p->entries * (size_t)p->L + 1) * 4;
  p->b_meta = ((size_t)p->nr * 2 + 1) * 4;
  p->b_poff = ((size_t)p->entries + 1) * 8;
  if (with_hdr && !(p->d_hdr = cuda_arena_alloc(p->arena, p->b_hdr))) return false;
  return (p->d_tok = cuda_arena_alloc(p->arena, p->b_tok)) &&
         (p->d_fan = cuda_arena_alloc(p->arena, p->b_fan)) &&
         (p->d_meta = cuda_arena_alloc(p->arena, p->b_meta)) &&
         (p->d_poff = cuda_arena_alloc(p->arena, p->b_poff));
}
