/* The self-checks shared by `epcomm bench` and its MPI baseline (bench_common.h): every output
 * against the generator and the reference's arithmetic (tools/ref), with the first mismatch
 * described. */
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "ref.h" /* the reference's number formats: the checks use its arithmetic */

#define FAIL(...)                                    \
  do {                                               \
    if (!bad++) snprintf(msg, msg_len, __VA_ARGS__); \
  } while (0)

/* Rows of source s as rank `me` must see them, checked in order from row `j`. */
static long check_source(const bench_opts_t *o, int R, int me, int s, const bench_recv_t *rv,
                         int *j, int64_t *tpe, char *msg, size_t msg_len) {
  size_t row = bench_row_bytes(o);
  int ns = bench_num_scales(o), per = o->experts / R, K = o->topk;
  int64_t *idx = malloc((size_t)o->tokens * K * sizeof *idx + 8);
  float *w = malloc((size_t)o->tokens * K * sizeof *w + 4);
  uint8_t *x = malloc(row);
  float *sc = malloc((size_t)ns * sizeof *sc + 4);
  long bad = 0;
  bench_gen_route(o, s, idx, w);
  for (int t = 0; t < o->tokens && bad < 1000; t++) {
    const int64_t *ids = idx + (size_t)t * K;
    if (!bench_goes_to(ids, K, per, me)) continue;
    int r = (*j)++;
    if (r >= rv->nr) {
      FAIL("rank %d: fewer rows than expected (%d) from rank %d", me, rv->nr, s);
      break;
    }
    if (rv->src_idx && rv->src_idx[r] != t)
      FAIL("rank %d row %d: src_idx %d, expected %d (rank %d)", me, r, rv->src_idx[r], t, s);
    bench_gen_x_row(o, s, t, x, sc);
    if (memcmp(x, (const uint8_t *)rv->x + (size_t)r * row, row))
      FAIL("rank %d row %d: payload differs from token %d of rank %d", me, r, t, s);
    if (ns && rv->scales && memcmp(sc, rv->scales + (size_t)r * ns, (size_t)ns * sizeof *sc))
      FAIL("rank %d row %d: scales differ from token %d of rank %d", me, r, t, s);
    for (int q = 0; q < K; q++) {
      int local = ids[q] >= 0 && ids[q] / per == me;
      int64_t e = local ? ids[q] - (int64_t)me * per : -1;
      float wt = local ? w[(size_t)t * K + q] : 0.0f;
      if (local) tpe[e]++;
      if (rv->topk_idx && rv->topk_idx[(size_t)r * K + q] != e)
        FAIL("rank %d row %d slot %d: expert %lld, expected %lld", me, r, q,
             (long long)rv->topk_idx[(size_t)r * K + q], (long long)e);
      if (rv->topk_weights && memcmp(&rv->topk_weights[(size_t)r * K + q], &wt, sizeof wt))
        FAIL("rank %d row %d slot %d: weight differs", me, r, q);
    }
  }
  free(idx), free(w), free(x), free(sc);
  return bad;
}

long bench_check_dispatch(const bench_opts_t *o, int R, int me, const bench_recv_t *rv, char *msg,
                          size_t msg_len) {
  int per = o->experts / R;
  int64_t *tpe = calloc((size_t)per, sizeof *tpe);
  int32_t *from = calloc((size_t)R, sizeof *from);
  long bad = 0;
  int j = 0;
  msg[0] = '\0';
  char first[256];
  for (int s = 0; s < R; s++) {
    int before = j;
    long b = check_source(o, R, me, s, rv, &j, tpe, first, sizeof first);
    if (b && !bad) snprintf(msg, msg_len, "%s", first);
    bad += b;
    from[s] = j - before;
  }
  if (j != rv->nr) FAIL("rank %d: received %d rows, expected %d", me, rv->nr, j);
  for (int l = 0; rv->tokens_per_expert && l < per; l++)
    if (rv->tokens_per_expert[l] != tpe[l])
      FAIL("rank %d: tokens_per_expert[%d] = %d, expected %lld", me, l, rv->tokens_per_expert[l],
           (long long)tpe[l]);
  /* rank_prefix[i][me] = rows that ranks 0..i send to me */
  for (int i = 0, acc = 0; rv->rank_prefix && i < R; i++) {
    acc += from[i];
    if (rv->rank_prefix[(size_t)i * R + me] != acc)
      FAIL("rank %d: rank_prefix[%d][%d] = %d, expected %d", me, i, me,
           rv->rank_prefix[(size_t)i * R + me], acc);
  }
  free(tpe);
  free(from);
  return bad;
}

/* Token t's expected output row into acc (fp32, before rounding): §4.2 on one host, §4.6 across
 * hosts (each host's rows make an fp32 partial, its first row then + the others ascending; the
 * partials are added hosts ascending). */
static void expected_row(const bench_opts_t *o, int R, int me, const int64_t *ids, int t,
                         float *acc, float *part, uint16_t *y) {
  int K = o->topk, per = o->experts / R, H = o->hidden, G = o->nhosts > 1 ? o->nhosts : 1;
  for (int h = 0; h < H; h++) acc[h] = 0.0f;
  for (int g = 0; g < G; g++) {
    int rows = 0;
    for (int r = 0; r < R; r++) {
      if (!bench_goes_to(ids, K, per, r) || (G > 1 && o->host_of[r] != g)) continue;
      bench_gen_y_row(o, r, me, t, y);
      for (int h = 0; h < H; h++) {
        float v = ref_bf16_to_f32(y[h]);
        if (G == 1)
          acc[h] += v;
        else
          part[h] = rows ? part[h] + v : v;
      }
      rows++;
    }
    for (int h = 0; G > 1 && rows && h < H; h++) acc[h] += part[h];
  }
}

long bench_check_combine(const bench_opts_t *o, int R, int me, const uint16_t *out, char *msg,
                         size_t msg_len) {
  int K = o->topk, H = o->hidden;
  int64_t *idx = malloc((size_t)o->tokens * K * sizeof *idx + 8);
  float *w = malloc((size_t)o->tokens * K * sizeof *w + 4), *acc = malloc((size_t)H * sizeof *acc);
  float *part = malloc((size_t)H * sizeof *part);
  uint16_t *y = malloc((size_t)H * 2);
  long bad = 0;
  msg[0] = '\0';
  bench_gen_route(o, me, idx, w);
  for (int t = 0; t < o->tokens && bad < 1000; t++) {
    expected_row(o, R, me, idx + (size_t)t * K, t, acc, part, y);
    for (int h = 0; h < H; h++)
      if (out[(size_t)t * H + h] != ref_f32_to_bf16(acc[h])) {
        FAIL("rank %d: combined token %d channel %d is %#06x, expected %#06x", me, t, h,
             out[(size_t)t * H + h], ref_f32_to_bf16(acc[h]));
        break;
      }
  }
  free(idx), free(w), free(acc), free(part), free(y);
  return bad;
}
