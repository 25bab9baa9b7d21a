/* Reference implementation of docs/SEMANTICS.md §2-6; see ref.h. Simplicity over speed. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ numerics */

/* The conversions themselves are the tool library's (tools/lib/tk_num.h). */

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* ------------------------------------------------------------------ helpers */

static void *zalloc(size_t count, size_t size) {
  return calloc(count ? count : 1, size);
}

/* 1 if token `ids` (topk slots) selects an expert that lives on rank r (L experts per rank). */
static int goes_to(const int64_t *ids, int topk, int L, int r) {
  for (int k = 0; k < topk; k++)
    if (ids[k] >= 0 && ids[k] / L == r) return 1;
  return 0;
}

static int ids_valid(const int64_t *ids, size_t count, int E) {
  for (size_t i = 0; i < count; i++)
    if (ids[i] < -1 || ids[i] >= E) return 0;
  return 1;
}

/* ------------------------------------------------------------ SEMANTICS.md §2 layout */

int ref_layout(const int64_t *topk_idx, int n, int topk, int E, int R, int32_t *tokens_per_rank,
               int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  if (n < 0 || topk < 0 || R <= 0 || E <= 0 || E % R != 0) return -1;
  if (n > 0 && topk > 0 && !topk_idx) return -1;
  if (n > 0 && topk > 0 && !ids_valid(topk_idx, (size_t)n * topk, E)) return -1;
  int L = E / R;
  if (tokens_per_rank) memset(tokens_per_rank, 0, sizeof(int32_t) * R);
  if (tokens_per_expert) memset(tokens_per_expert, 0, sizeof(int32_t) * E);
  for (int t = 0; t < n; t++) {
    const int64_t *ids = topk_idx + (size_t)t * topk;
    for (int r = 0; r < R; r++) {
      int in = goes_to(ids, topk, L, r);
      if (tokens_per_rank) tokens_per_rank[r] += in;
      if (is_token_in_rank) is_token_in_rank[(size_t)t * R + r] = (uint8_t)in;
    }
    if (tokens_per_expert)
      for (int k = 0; k < topk; k++)
        if (ids[k] >= 0) tokens_per_expert[ids[k]]++;
  }
  return 0;
}

/* ------------------------------------------------------ SEMANTICS.md §3-4 normal mode */

void ref_free_recv(ref_recv_t *r) {
  if (!r) return;
  free(r->x);
  free(r->scales);
  free(r->topk_idx);
  free(r->topk_weights);
  free(r->src_idx);
  free(r->src_rank);
  free(r->rank_prefix);
  free(r->tokens_per_expert);
  memset(r, 0, sizeof *r);
}

int ref_dispatch(int R, int E, int topk, size_t row_bytes, int num_scales, int alignment,
                 const ref_rank_input_t *in, ref_recv_t *out) {
  if (R <= 0 || E <= 0 || E % R != 0 || topk < 0 || num_scales < 0 || !in || !out) return -1;
  int L = E / R;
  int has_w = 0;
  for (int s = 0; s < R; s++)
    if (in[s].n > 0 && in[s].topk_weights) has_w = 1;
  for (int s = 0; s < R; s++) {
    const ref_rank_input_t *a = &in[s];
    if (a->n < 0) return -1;
    if (a->n == 0) continue;
    if ((row_bytes > 0 && !a->x) || (num_scales > 0 && !a->scales) || (has_w && !a->topk_weights))
      return -1;
    if (ref_layout(a->topk_idx, a->n, topk, E, R, NULL, NULL, NULL) != 0) return -1;
  }
  memset(out, 0, sizeof *out * R);

  /* send[s][j]: tokens source s sends to rank j */
  int32_t *send = zalloc((size_t)R * R, sizeof *send);
  if (!send) return -1;
  for (int s = 0; s < R; s++)
    for (int t = 0; t < in[s].n; t++)
      for (int j = 0; j < R; j++)
        send[s * R + j] += goes_to(in[s].topk_idx + (size_t)t * topk, topk, L, j);

  for (int r = 0; r < R; r++) {
    ref_recv_t *o = &out[r];
    int nr = 0;
    for (int s = 0; s < R; s++) nr += send[s * R + r];
    o->nr = nr;
    o->x = zalloc((size_t)nr * row_bytes, 1);
    o->scales = num_scales > 0 ? zalloc((size_t)nr * num_scales, sizeof(float)) : NULL;
    o->topk_idx = zalloc((size_t)nr * topk, sizeof(int64_t));
    o->topk_weights = has_w ? zalloc((size_t)nr * topk, sizeof(float)) : NULL;
    o->src_idx = zalloc(nr, sizeof(int32_t));
    o->src_rank = zalloc(nr, sizeof(int32_t));
    o->rank_prefix = zalloc((size_t)R * R, sizeof(int32_t));
    o->tokens_per_expert = zalloc(L, sizeof(int32_t));
    if (!o->x || (num_scales > 0 && !o->scales) || !o->topk_idx || (has_w && !o->topk_weights) ||
        !o->src_idx || !o->src_rank || !o->rank_prefix || !o->tokens_per_expert)
      goto fail;

    int j = 0; /* next receive row */
    for (int s = 0; s < R; s++) {
      for (int t = 0; t < in[s].n; t++) {
        const int64_t *ids = in[s].topk_idx + (size_t)t * topk;
        if (!goes_to(ids, topk, L, r)) continue;
        memcpy(o->x + (size_t)j * row_bytes, (const uint8_t *)in[s].x + (size_t)t * row_bytes,
               row_bytes);
        if (num_scales > 0)
          memcpy(o->scales + (size_t)j * num_scales, in[s].scales + (size_t)t * num_scales,
                 sizeof(float) * num_scales);
        for (int k = 0; k < topk; k++) {
          int mine = ids[k] >= 0 && ids[k] / L == r;
          o->topk_idx[(size_t)j * topk + k] = mine ? ids[k] - (int64_t)r * L : -1;
          if (has_w)
            o->topk_weights[(size_t)j * topk + k] =
                mine ? in[s].topk_weights[(size_t)t * topk + k] : 0.0f;
          if (mine) o->tokens_per_expert[ids[k] - (int64_t)r * L]++;
        }
        o->src_idx[j] = t;
        o->src_rank[j] = s;
        j++;
      }
    }
    for (int l = 0; l < L; l++)
      if (alignment > 1)
        o->tokens_per_expert[l] = (o->tokens_per_expert[l] + alignment - 1) / alignment * alignment;
    for (int i = 0; i < R; i++)
      for (int d = 0; d < R; d++)
        o->rank_prefix[i * R + d] = (i > 0 ? o->rank_prefix[(i - 1) * R + d] : 0) + send[i * R + d];
  }
  free(send);
  return 0;
fail:
  free(send);
  for (int r = 0; r < R; r++) ref_free_recv(&out[r]);
  return -1;
}

/* One channel of a token: §4.2 on one host; across hosts (§4.6) each host's rows first make a
 * partial (its first row, then + the others, ranks ascending), then acc += partial, hosts
 * ascending. row_on[r * total]: the token's row on rank r, or -1. */
static float reduce_channel(int R, int nhosts, const int *host_of, const int32_t *row_on,
                            size_t total, const uint16_t *const *y, int H, int h, float acc) {
  if (nhosts <= 1) {
    for (int r = 0; r < R; r++) {
      int32_t j = row_on[(size_t)r * total];
      if (j >= 0) acc += ref_bf16_to_f32(y[r][(size_t)j * H + h]);
    }
    return acc;
  }
  for (int g = 0; g < nhosts; g++) {
    float p = 0.0f;
    int rows = 0;
    for (int r = 0; r < R; r++) {
      int32_t j = row_on[(size_t)r * total];
      if (j < 0 || host_of[r] != g) continue;
      float v = ref_bf16_to_f32(y[r][(size_t)j * H + h]);
      p = rows++ ? p + v : v;
    }
    if (rows) acc += p;
  }
  return acc;
}

/* The same for combined weights (no biases: the accumulator starts at +0). */
static float reduce_weight(int R, int nhosts, const int *host_of, const int32_t *row_on,
                           size_t total, const float *const *w, int topk, int k) {
  float acc = 0.0f;
  for (int g = 0; g < (nhosts > 1 ? nhosts : 1); g++) {
    float p = 0.0f;
    int rows = 0;
    for (int r = 0; r < R; r++) {
      int32_t j = row_on[(size_t)r * total];
      if (j < 0 || (nhosts > 1 && host_of[r] != g)) continue;
      float v = w[r][(size_t)j * topk + k];
      if (nhosts <= 1)
        acc += v;
      else
        p = rows++ ? p + v : v;
    }
    if (nhosts > 1 && rows) acc += p;
  }
  return acc;
}

int ref_combine_hosts(int R, int nhosts, const int *host_of, int H, int topk,
                      const ref_rank_input_t *in, const ref_recv_t *recv, const uint16_t *const *y,
                      const float *const *w, const uint16_t *const *bias0,
                      const uint16_t *const *bias1, uint16_t **out, float **out_w) {
  if (R <= 0 || H <= 0 || topk < 0 || !in || !recv || !y || !out || (w && !out_w)) return -1;
  if (nhosts > 1 && !host_of) return -1;
  for (int r = 0; nhosts > 1 && r < R; r++)
    if (host_of[r] < 0 || host_of[r] >= nhosts) return -1;
  /* off[s]: first slot of source s in a [sum n] index; where[r][off[s] + t]: row of (s, t) in
   * rank r's receive order, or -1 if the token did not go to r. */
  size_t total = 0;
  int32_t *where = NULL;
  size_t *off = zalloc(R, sizeof *off);
  if (!off) return -1;
  for (int s = 0; s < R; s++) {
    if (in[s].n < 0 || (in[s].n > 0 && (!out[s] || (w && topk > 0 && !out_w[s])))) goto bad;
    off[s] = total;
    total += (size_t)in[s].n;
  }
  for (int r = 0; r < R; r++)
    if (recv[r].nr > 0 && (!y[r] || (w && topk > 0 && !w[r]))) goto bad;
  where = malloc(sizeof(int32_t) * (total ? total : 1) * R);
  if (!where) goto bad;
  for (size_t i = 0; i < total * R; i++) where[i] = -1;
  for (int r = 0; r < R; r++)
    for (int j = 0; j < recv[r].nr; j++) {
      int s = recv[r].src_rank[j], t = recv[r].src_idx[j];
      if (s < 0 || s >= R || t < 0 || t >= in[s].n) goto bad;
      where[(size_t)r * total + off[s] + t] = j;
    }

  for (int s = 0; s < R; s++)
    for (int t = 0; t < in[s].n; t++) {
      const int32_t *row_on = where + off[s] + t; /* row_on[r * total] */
      const uint16_t *b0 = bias0 && bias0[s] ? bias0[s] + (size_t)t * H : NULL;
      const uint16_t *b1 = bias1 && bias1[s] ? bias1[s] + (size_t)t * H : NULL;
      for (int h = 0; h < H; h++) {
        float acc = (b0 ? ref_bf16_to_f32(b0[h]) : 0.0f) + (b1 ? ref_bf16_to_f32(b1[h]) : 0.0f);
        acc = reduce_channel(R, nhosts, host_of, row_on, total, y, H, h, acc);
        out[s][(size_t)t * H + h] = ref_f32_to_bf16(acc);
      }
      for (int k = 0; w && k < topk; k++)
        out_w[s][(size_t)t * topk + k] =
            reduce_weight(R, nhosts, host_of, row_on, total, w, topk, k);
    }
  free(where);
  free(off);
  return 0;
bad:
  free(where);
  free(off);
  return -1;
}

int ref_combine(int R, int H, int topk, const ref_rank_input_t *in, const ref_recv_t *recv,
                const uint16_t *const *y, const float *const *w, const uint16_t *const *bias0,
                const uint16_t *const *bias1, uint16_t **out, float **out_w) {
  return ref_combine_hosts(R, 1, NULL, H, topk, in, recv, y, w, bias0, bias1, out, out_w);
}

int ref_layout_hosts(const int64_t *topk_idx, int n, int topk, int E, int R, int nhosts,
                     const int *host_of, int32_t *tokens_per_host, uint8_t *is_token_in_host) {
  if (nhosts < 1 || (nhosts > 1 && !host_of)) return -1;
  uint8_t *in_rank = zalloc((size_t)n * R, 1);
  if (!in_rank || ref_layout(topk_idx, n, topk, E, R, NULL, NULL, in_rank) != 0) {
    free(in_rank);
    return -1;
  }
  if (tokens_per_host) memset(tokens_per_host, 0, sizeof(int32_t) * nhosts);
  for (int t = 0; t < n; t++)
    for (int g = 0; g < nhosts; g++) {
      int in = 0;
      for (int r = 0; r < R; r++)
        in |= in_rank[(size_t)t * R + r] && (nhosts == 1 || host_of[r] == g);
      if (tokens_per_host) tokens_per_host[g] += in;
      if (is_token_in_host) is_token_in_host[(size_t)t * nhosts + g] = (uint8_t)in;
    }
  free(in_rank);
  return 0;
}

/* ------------------------------------------------ SEMANTICS.md §5-6 low-latency mode */

static const float REF_INV448 = 1.0f / 448.0f; /* the float constant 1/448 */

/* 2^e built from the exponent bits, as DeepEP's fast_pow2 does (exact for -126 <= e <= 127). */
static float pow2_bits(int e) {
  return u2f((uint32_t)(e + 127) << 23);
}

void ref_ll_cast_row(const uint16_t *x, int H, int round_scale, int use_ue8m0, uint8_t *q,
                     float *scales, uint8_t *ue8m0) {
  if (use_ue8m0) round_scale = 1;
  for (int b = 0; b < H / 128; b++) {
    const uint16_t *xb = x + (size_t)b * 128;
    float amax = 1e-4f;
    /* Not fmaxf: glibc's returns NaN for a signaling NaN (C23), CUDA's ignores every NaN. */
    for (int i = 0; i < 128; i++) {
      float v = fabsf(ref_bf16_to_f32(xb[i]));
      amax = v > amax ? v : amax;
    }
    float scale, scale_inv;
    int e = 0;
    if (round_scale) {
      uint32_t bits = f2u(amax * REF_INV448);
      e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0);
      scale = pow2_bits(-e);
      scale_inv = pow2_bits(e);
    } else {
      scale = 448.0f / amax;
      scale_inv = amax * REF_INV448;
    }
    for (int i = 0; i < 128; i++)
      q[(size_t)b * 128 + i] = ref_f32_to_e4m3(ref_bf16_to_f32(xb[i]) * scale);
    if (scales) scales[b] = scale_inv;
    if (ue8m0 && use_ue8m0) ue8m0[b] = (uint8_t)(e + 127);
  }
}

/* Validates the ll inputs and numbers the rows: row[(s*T + t)*topk + k] is the row of (source s,
 * token t, slot k) inside its expert's [R*T] block (-1 for an unused slot); rows of one expert
 * are numbered in the order source ascending, token ascending. count[E] gets rows per expert. */
static int ll_plan(int R, int T, int E, int topk, const ref_rank_input_t *in, int32_t *row,
                   int32_t *count) {
  memset(count, 0, sizeof(int32_t) * E);
  for (int s = 0; s < R; s++) {
    int n = in[s].n;
    if (n < 0 || n > T || (n > 0 && topk > 0 && !in[s].topk_idx)) return -1;
    if (n > 0 && topk > 0 && !ids_valid(in[s].topk_idx, (size_t)n * topk, E)) return -1;
    for (int t = 0; t < n; t++) {
      const int64_t *ids = in[s].topk_idx + (size_t)t * topk;
      for (int k = 0; k < topk; k++) {
        for (int k2 = 0; k2 < k; k2++)
          if (ids[k] >= 0 && ids[k2] == ids[k]) return -1; /* same expert twice in one token */
        row[((size_t)s * T + t) * topk + k] = ids[k] >= 0 ? count[ids[k]]++ : -1;
      }
    }
  }
  return 0;
}

void ref_ll_free(ref_ll_recv_t *r) {
  if (!r) return;
  free(r->x);
  free(r->q);
  free(r->scales);
  free(r->ue8m0_exp);
  free(r->count);
  free(r->src_info);
  free(r->layout_range);
  memset(r, 0, sizeof *r);
}

int ref_ll_dispatch(int R, int T, int E, int H, int topk, const ref_rank_input_t *in, int use_fp8,
                    int round_scale, int use_ue8m0, ref_ll_recv_t *out) {
  if (R <= 0 || T < 0 || E <= 0 || E % R != 0 || H <= 0 || topk < 0 || !in || !out) return -1;
  if ((use_fp8 && H % 128 != 0) || (round_scale && !use_fp8) || (use_ue8m0 && !round_scale))
    return -1;
  for (int s = 0; s < R; s++)
    if (in[s].n > 0 && !in[s].x) return -1;
  int L = E / R, RT = R * T, NS = H / 128;
  int32_t *row = zalloc((size_t)R * T * topk, sizeof *row);
  int32_t *count = zalloc(E, sizeof *count);
  if (!row || !count || ll_plan(R, T, E, topk, in, row, count) != 0) {
    free(row);
    free(count);
    return -1;
  }
  memset(out, 0, sizeof *out * R);

  for (int r = 0; r < R; r++) {
    ref_ll_recv_t *o = &out[r];
    size_t rows = (size_t)L * RT;
    o->L = L;
    o->RT = RT;
    o->H = H;
    o->fp8 = use_fp8 != 0;
    o->ue8m0 = use_ue8m0 != 0;
    o->x = use_fp8 ? NULL : zalloc(rows * H, sizeof(uint16_t));
    o->q = use_fp8 ? zalloc(rows * H, 1) : NULL;
    o->scales = use_fp8 && !use_ue8m0 ? zalloc(rows * NS, sizeof(float)) : NULL;
    o->ue8m0_exp = use_ue8m0 ? zalloc(rows * NS, 1) : NULL;
    o->count = zalloc(L, sizeof(int32_t));
    o->src_info = zalloc(rows, sizeof(int32_t));
    o->layout_range = zalloc((size_t)L * R, sizeof(int64_t));
    if ((!use_fp8 && !o->x) || (use_fp8 && !o->q) || (use_fp8 && !use_ue8m0 && !o->scales) ||
        (use_ue8m0 && !o->ue8m0_exp) || !o->count || !o->src_info || !o->layout_range) {
      for (int i = 0; i <= r; i++) ref_ll_free(&out[i]);
      free(row);
      free(count);
      return -1;
    }
    for (size_t i = 0; i < rows; i++) o->src_info[i] = -1;

    for (int l = 0; l < L; l++) {
      int e = r * L + l;
      o->count[l] = count[e];
      int64_t begin = 0;
      for (int s = 0; s < R; s++) {
        int64_t c = 0;
        for (int t = 0; t < in[s].n; t++)
          for (int k = 0; k < topk; k++) {
            if (in[s].topk_idx[(size_t)t * topk + k] != e) continue;
            size_t j = (size_t)l * RT + row[((size_t)s * T + t) * topk + k]; /* row slot */
            const uint16_t *xt = (const uint16_t *)in[s].x + (size_t)t * H;
            if (use_fp8)
              ref_ll_cast_row(xt, H, round_scale, use_ue8m0, o->q + j * H,
                              o->scales ? o->scales + j * NS : NULL,
                              o->ue8m0_exp ? o->ue8m0_exp + j * NS : NULL);
            else
              memcpy(o->x + j * H, xt, sizeof(uint16_t) * H);
            o->src_info[j] = t;
            c++;
          }
        o->layout_range[(size_t)l * R + s] = (begin << 32) | c;
        begin += c;
      }
    }
  }
  free(row);
  free(count);
  return 0;
}

int ref_ll_combine(int R, int T, int E, int H, int topk, const ref_rank_input_t *in,
                   const uint16_t *const *y, int fused, uint16_t **out) {
  if (R <= 0 || T < 0 || E <= 0 || E % R != 0 || H <= 0 || topk < 0 || !in || !y || !out) return -1;
  for (int s = 0; s < R; s++)
    if (in[s].n > 0 && (!out[s] || (topk > 0 && !in[s].topk_weights))) return -1;
  for (int r = 0; r < R; r++)
    if (!y[r]) return -1;
  int L = E / R, RT = R * T;
  int32_t *row = zalloc((size_t)R * T * topk, sizeof *row);
  int32_t *count = zalloc(E, sizeof *count);
  if (!row || !count || ll_plan(R, T, E, topk, in, row, count) != 0) {
    free(row);
    free(count);
    return -1;
  }
  for (int s = 0; s < R; s++)
    for (int t = 0; t < in[s].n; t++) {
      const int64_t *ids = in[s].topk_idx + (size_t)t * topk;
      const float *wt = in[s].topk_weights + (size_t)t * topk;
      for (int h = 0; h < H; h++) {
        float acc = 0.0f;
        for (int k = 0; k < topk; k++) {
          if (ids[k] < 0) continue;
          int r = (int)(ids[k] / L), l = (int)(ids[k] % L);
          size_t j = (size_t)l * RT + row[((size_t)s * T + t) * topk + k];
          float v = ref_bf16_to_f32(y[r][j * H + h]);
          if (fused) {
            acc = fmaf(v, wt[k], acc);
          } else {
            /* volatile: the product is rounded to float even under -ffp-contract=fast */
            volatile float p = v * wt[k];
            acc = acc + p;
          }
        }
        out[s][(size_t)t * H + h] = ref_f32_to_bf16(acc);
      }
    }
  free(row);
  free(count);
  return 0;
}
