/* Low-latency self-checks (SEMANTICS.md §6): the view of the last main dispatch against every
 * rank's regenerated tokens (and the reference's fp8 cast), the combine output against the FMA
 * chain; views fetched from the device on the GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ll.h"
#include "ref.h"
#include "tk_dev.h"

#define FAIL(...)                                    \
  do {                                               \
    if (!bad++) snprintf(msg, msg_len, __VA_ARGS__); \
  } while (0)

static int rows_from(const ep_ll_recv_view_t *v, int l, int R, int s) {
  return (int)(v->recv_layout_range[(size_t)l * R + s] & 0xffffffff);
}

/* The rows of source s in the view against its tokens. cnt[L] counts them per expert. */
static long check_source(const ll_t *u, const ep_ll_recv_view_t *v, int s, const uint16_t *x,
                         const int64_t *idx, int *cnt, char *msg, size_t msg_len) {
  int L = u->L, R = u->R, H = (int)u->H, me = u->me;
  uint8_t *q = malloc((size_t)H + 1);
  float *sc = malloc((size_t)H / 128 * 4 + 4);
  long bad = 0;
  if (!q || !sc) FAIL("rank %d: out of memory for the check", me);
  for (size_t t = 0; t < u->T && !bad; t++)
    for (size_t k = 0; k < u->K; k++) {
      int64_t e = idx[t * u->K + k];
      if (e < (int64_t)me * L || e >= (int64_t)(me + 1) * L) continue;
      int l = (int)(e - (int64_t)me * L), i = (int)(v->recv_layout_range[(size_t)l * R + s] >> 32);
      if (++cnt[l] > rows_from(v, l, R, s)) {
        FAIL("rank %d expert %d: more rows from rank %d than layout_range says", me, l, s);
        continue;
      }
      size_t at = (size_t)l * v->max_rows + (size_t)(i + cnt[l] - 1);
      if (v->recv_src_info[at] != (int32_t)t)
        FAIL("rank %d expert %d row %zu: src_info %d, expected %d", me, l, at, v->recv_src_info[at],
             (int)t);
      if (!u->fp8) {
        if (memcmp((const uint16_t *)v->recv_x + at * H, x + t * H, (size_t)H * 2))
          FAIL("rank %d expert %d: payload differs from token %d of rank %d", me, l, (int)t, s);
        continue;
      }
      ref_ll_cast_row(x + t * H, H, 0, 0, q, sc, NULL);
      if (memcmp((const uint8_t *)v->recv_x + at * H, q, (size_t)H) ||
          memcmp((const float *)v->recv_x_scales + at * (H / 128), sc, (size_t)H / 128 * 4))
        FAIL("rank %d expert %d: fp8 row or scales differ from the reference cast", me, l);
    }
  free(q), free(sc);
  return bad;
}

long bench_ll_verify_view(const ll_t *u, const ep_ll_recv_view_t *v, char *msg, size_t msg_len) {
  const bench_opts_t *o = u->c->o;
  bench_opts_t ob = *o;
  ob.dtype = BENCH_BF16; /* the low-latency input is bf16; fp8 is the dispatch's cast */
  uint16_t *x = malloc(u->T * u->H * 2 + 2);
  int64_t *idx = malloc(u->T * u->K * 8 + 8);
  float *w = malloc(u->T * u->K * 4 + 4);
  int *cnt = calloc((size_t)u->L, sizeof *cnt);
  long bad = !x || !idx || !w || !cnt;
  if (bad) snprintf(msg, msg_len, "rank %d: out of memory for the check", u->me);
  for (int s = 0; s < u->R && !bad; s++) {
    char m[BENCH_MSG];
    bench_gen_x(&ob, s, x, NULL);
    bench_gen_route(o, s, idx, w);
    memset(cnt, 0, (size_t)u->L * sizeof *cnt);
    long b = check_source(u, v, s, x, idx, cnt, m, sizeof m);
    for (int l = 0; l < u->L; l++)
      if (cnt[l] != rows_from(v, l, u->R, s) && !b++)
        snprintf(m, sizeof m, "rank %d expert %d: %d rows from rank %d, layout_range says %d",
                 u->me, l, cnt[l], s, rows_from(v, l, u->R, s));
    if (b && !bad) snprintf(msg, msg_len, "%s", m);
    bad += b;
  }
  free(x), free(idx), free(w), free(cnt);
  return bad;
}

/* The expert output for token t of rank src at expert e (a row per (token, expert)). */
void bench_ll_y_row(const bench_opts_t *o, int e, int src, int t, uint16_t *row) {
  bench_gen_y_row(o, 1 << 20 | e, src, t, row);
}

/* out[t] = bf16(fmaf chain over k ascending of y(t, k) x w[t][k]), SEMANTICS.md §6.5. */
long bench_ll_verify_out(const ll_t *u, const uint16_t *out, char *msg, size_t msg_len) {
  size_t K = u->K, H = u->H;
  int64_t *idx = malloc(u->T * K * 8 + 8);
  float *w = malloc(u->T * K * 4 + 4), *acc = malloc(H * 4 + 4);
  uint16_t *y = malloc(H * 2 + 2);
  long bad = 0;
  if (!idx || !w || !acc || !y)
    FAIL("rank %d: out of memory for the check", u->me);
  else
    bench_gen_route(u->c->o, u->me, idx, w);
  for (size_t t = 0; t < u->T && !bad; t++) {
    for (size_t h = 0; h < H; h++) acc[h] = 0.0f;
    for (size_t k = 0; k < K; k++) {
      if (idx[t * K + k] < 0) continue;
      bench_ll_y_row(u->c->o, (int)idx[t * K + k], u->me, (int)t, y);
      for (size_t h = 0; h < H; h++) acc[h] = fmaf(ref_bf16_to_f32(y[h]), w[t * K + k], acc[h]);
    }
    for (size_t h = 0; h < H; h++)
      if (out[t * H + h] != ref_f32_to_bf16(acc[h])) {
        FAIL("rank %d: combined token %d channel %d is %#06x, expected %#06x", u->me, (int)t,
             (int)h, out[t * H + h], ref_f32_to_bf16(acc[h]));
        break;
      }
  }
  free(idx), free(w), free(acc), free(y);
  return bad;
}

/* ------------------------------------------------------------------ views on the host */

static int fetch_block(ll_t *u, void *dst, const void *src, size_t per_row, int l) {
  size_t at = (size_t)l * u->max_rows * per_row;
  return tk_dev_download(1, (char *)dst + at, (const char *)src + at,
                         (size_t)u->count[l] * per_row);
}

int bench_ll_fetch_view(ll_t *u, const ep_ll_recv_view_t *v, ep_ll_recv_view_t *hv) {
  bench_ctx_t *c = u->c;
  *hv = *v;
  if (!c->dev) return 0;
  hv->recv_count = hv->recv_src_info = NULL, hv->recv_layout_range = NULL;
  hv->recv_x = hv->recv_x_scales = NULL;
  if (bench_sync(c)) return fprintf(stderr, "epcomm bench: %s\n", bench_dev_error()), 1;
  size_t L = (size_t)u->L, slots = L * u->max_rows, ns = u->fp8 ? u->H / 128 : 0;
  size_t es = u->fp8 ? 1 : 2;
  hv->recv_count = bench_fetch(c, v->recv_count, L * 4);
  hv->recv_src_info = bench_fetch(c, v->recv_src_info, slots * 4);
  hv->recv_layout_range = bench_fetch(c, v->recv_layout_range, L * u->R * 8);
  hv->recv_x = malloc(slots * u->H * es + 1);
  hv->recv_x_scales = ns ? malloc(slots * ns * 4) : NULL;
  int rc = !hv->recv_count || !hv->recv_src_info || !hv->recv_layout_range || !hv->recv_x ||
           (ns && !hv->recv_x_scales);
  for (int l = 0; !rc && l < u->L; l++)
    rc = fetch_block(u, hv->recv_x, v->recv_x, u->H * es, l) ||
         (ns && fetch_block(u, hv->recv_x_scales, v->recv_x_scales, ns * 4, l));
  return rc;
}

void bench_ll_free_view(ll_t *u, ep_ll_recv_view_t *hv) {
  if (!u->c->dev) return;
  free((void *)hv->recv_count), free((void *)hv->recv_src_info);
  free((void *)hv->recv_layout_range), free(hv->recv_x), free(hv->recv_x_scales);
}

uint64_t bench_ll_digest(const ll_t *u, const ep_ll_recv_view_t *hv) {
  size_t es = u->fp8 ? 1 : 2, ns = u->fp8 ? u->H / 128 : 0;
  uint64_t d = BENCH_DIGEST_SEED;
  for (int l = 0; l < u->L; l++) {
    size_t at = (size_t)l * u->max_rows, n = (size_t)u->count[l];
    d = bench_digest((const char *)hv->recv_x + at * u->H * es, n * u->H * es, d);
    if (ns) d = bench_digest((const float *)hv->recv_x_scales + at * ns, n * ns * 4, d);
  }
  return d;
}

int bench_ll_view_digest(ll_t *u, const ep_ll_recv_view_t *v, uint64_t *d) {
  ep_ll_recv_view_t hv;
  memset(&hv, 0, sizeof hv);
  int rc = bench_ll_fetch_view(u, v, &hv);
  if (!rc) *d = bench_ll_digest(u, &hv);
  bench_ll_free_view(u, &hv);
  return rc;
}
