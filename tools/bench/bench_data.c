/* The deterministic generator shared by `epcomm bench` and its baselines (bench_common.h): every
 * item (a token's row, a token's routing, an expert output row) comes from a key derived from the
 * seed and its coordinates, so any process regenerates any rank's data alone. */
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "tk_rng.h"

uint64_t bench_key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return tk_mix64(seed ^ tk_mix64(a + TK_GOLDEN64 * (b + 1) + 0x632be59bd9b4e019ull * (c + 1)));
}

typedef struct {
  uint64_t s;
} rng_t;
static uint64_t next(rng_t *r) {
  return tk_splitmix(&r->s);
}

size_t bench_row_bytes(const bench_opts_t *o) {
  return (size_t)o->hidden * (o->dtype == BENCH_FP8 ? 1 : 2);
}

int bench_num_scales(const bench_opts_t *o) {
  return o->dtype == BENCH_FP8 ? o->hidden / 128 : 0;
}

/* Finite bf16 values, magnitudes 2^-7 .. 2^8: sums of a few stay far from overflow. */
static void fill_bf16(uint64_t k, uint16_t *row, int H) {
  rng_t r = {k};
  for (int h = 0; h < H; h += 4) {
    uint64_t v = next(&r);
    for (int i = 0; i < 4 && h + i < H; i++, v >>= 16) {
      uint16_t s = (uint16_t)v;
      row[h + i] = (uint16_t)((s & 0x807f) | ((0x78 + ((s >> 7) & 0xf)) << 7));
    }
  }
}

static void fill_fp8(uint64_t k, uint8_t *row, int H, float *scales, int ns) {
  rng_t r = {k};
  for (int h = 0; h < H; h += 8) {
    uint64_t v = next(&r);
    for (int i = 0; i < 8 && h + i < H; i++, v >>= 8) {
      uint8_t b = (uint8_t)v;
      row[h + i] = (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b; /* no NaN */
    }
  }
  for (int s = 0; s < ns; s++) scales[s] = (float)(1 + next(&r) % 4096) / 1024.0f;
}

void bench_gen_x_row(const bench_opts_t *o, int src, int t, void *row, float *scales) {
  uint64_t k = bench_key(o->seed, 1, (uint64_t)src, (uint64_t)t);
  if (o->dtype == BENCH_FP8)
    fill_fp8(k, row, o->hidden, scales, bench_num_scales(o));
  else
    fill_bf16(k, row, o->hidden);
}

void bench_gen_x(const bench_opts_t *o, int src, void *x, float *scales) {
  size_t row = bench_row_bytes(o), ns = (size_t)bench_num_scales(o);
  for (int t = 0; t < o->tokens; t++)
    bench_gen_x_row(o, src, t, (uint8_t *)x + (size_t)t * row, scales ? scales + t * ns : NULL);
}

void bench_gen_y_row(const bench_opts_t *o, int dst, int src, int t, uint16_t *row) {
  fill_bf16(bench_key(o->seed, 2 + ((uint64_t)dst << 32), (uint64_t)src, (uint64_t)t), row,
            o->hidden);
}

static int has(const int64_t *v, int n, int64_t e) {
  for (int i = 0; i < n; i++)
    if (v[i] == e) return 1;
  return 0;
}

/* Zipf(s = 1) over E experts, hot experts scattered by a fixed permutation. */
typedef struct {
  double *cdf;
  int *perm;
} zipf_t;

static int zipf_init(zipf_t *z, int E, uint64_t seed) {
  z->cdf = malloc((size_t)E * sizeof *z->cdf);
  z->perm = malloc((size_t)E * sizeof *z->perm);
  if (!z->cdf || !z->perm) return -1;
  double acc = 0;
  for (int e = 0; e < E; e++) z->cdf[e] = acc += 1.0 / (e + 1);
  for (int e = 0; e < E; e++) z->cdf[e] /= acc, z->perm[e] = e;
  rng_t r = {bench_key(seed, 3, 0, 0)};
  for (int e = E - 1; e > 0; e--) {
    int j = (int)(next(&r) % (uint64_t)(e + 1)), tmp = z->perm[e];
    z->perm[e] = z->perm[j], z->perm[j] = tmp;
  }
  return 0;
}

static int zipf_draw(const zipf_t *z, int E, rng_t *r) {
  double u = (double)(next(r) >> 11) * 0x1.0p-53;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (z->cdf[mid] < u)
      lo = mid + 1;
    else
      hi = mid;
  }
  return z->perm[lo];
}

/* DeepSeek-V3-like group limit: experts in G groups, each token picks topk within TG groups. */
static void groups_of(const bench_opts_t *o, int *G, int *TG) {
  *G = 1;
  for (int g = 8; g > 1; g /= 2)
    if (o->experts % g == 0) {
      *G = g;
      break;
    }
  *TG = *G < 4 ? *G : 4;
  while (*TG < *G && (o->experts / *G) * *TG < o->topk) (*TG)++;
}

static void route_token(const bench_opts_t *o, rng_t *r, const zipf_t *z, int G, int TG,
                        int64_t *ids) {
  int E = o->experts, per = E / G, groups[8];
  for (int g = 0; g < TG && o->routing == BENCH_GROUPED; g++) {
    int c;
    int dup;
    do {
      c = (int)(next(r) % (uint64_t)G);
      dup = 0;
      for (int i = 0; i < g; i++) dup |= groups[i] == c;
    } while (dup);
    groups[g] = c;
  }
  for (int k = 0; k < o->topk; k++) {
    int64_t e;
    int tries = 0;
    do {
      if (o->routing == BENCH_ZIPF && tries < 64)
        e = zipf_draw(z, E, r);
      else if (o->routing == BENCH_GROUPED) {
        int j = (int)(next(r) % (uint64_t)(TG * per));
        e = (int64_t)groups[j / per] * per + j % per;
      } else
        e = (int64_t)(next(r) % (uint64_t)E);
      tries++;
    } while (has(ids, k, e)); /* topk distinct experts, like torch.topk over router scores */
    ids[k] = e;
  }
}

void bench_gen_route(const bench_opts_t *o, int src, int64_t *idx, float *w) {
  rng_t r = {bench_key(o->seed, 4, (uint64_t)src, 0)};
  zipf_t z = {NULL, NULL};
  if (o->routing == BENCH_ZIPF && zipf_init(&z, o->experts, o->seed)) abort();
  int G, TG;
  groups_of(o, &G, &TG);
  for (int t = 0; t < o->tokens; t++) {
    int64_t *ids = idx + (size_t)t * o->topk;
    route_token(o, &r, &z, G, TG, ids);
    for (int k = 0; k < o->topk; k++)
      w[(size_t)t * o->topk + k] = (float)(1 + next(&r) % 1000) / 1024.0f;
  }
  free(z.cdf);
  free(z.perm);
}

/* ------------------------------------------------------------------ counts, digests */

uint64_t bench_digest(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    memcpy(&v, b + i, 8);
    h = (h ^ v) * 0x100000001b3ull + (h >> 29);
  }
  for (; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

int bench_goes_to(const int64_t *ids, int topk, int per, int d) {
  for (int k = 0; k < topk; k++)
    if (ids[k] >= 0 && ids[k] / per == d) return 1;
  return 0;
}

void bench_counts(const bench_opts_t *o, int R, int me, int32_t *recv_from, int32_t *send_to) {
  int64_t *idx = malloc((size_t)o->tokens * o->topk * sizeof *idx + 8);
  float *w = malloc((size_t)o->tokens * o->topk * sizeof *w + 4);
  int per = o->experts / R;
  for (int s = 0; s < R; s++) {
    bench_gen_route(o, s, idx, w);
    int32_t n = 0;
    for (int t = 0; t < o->tokens; t++)
      n += bench_goes_to(idx + (size_t)t * o->topk, o->topk, per, me);
    if (recv_from) recv_from[s] = n;
    if (s == me && send_to)
      for (int d = 0; d < R; d++) {
        send_to[d] = 0;
        for (int t = 0; t < o->tokens; t++)
          send_to[d] += bench_goes_to(idx + (size_t)t * o->topk, o->topk, per, d);
      }
  }
  free(idx);
  free(w);
}

bench_bytes_t bench_normal_bytes(const bench_opts_t *o, int nr, int self) {
  double row = (double)bench_row_bytes(o) + bench_num_scales(o) * 4.0;
  double meta = 4.0 + o->topk * 12.0; /* source index, topk ids (8) and weights (4) */
  double back = o->hidden * 2.0;
  return (bench_bytes_t){nr * row, (nr - self) * (row + meta), nr * back, (nr - self) * back};
}
