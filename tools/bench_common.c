/* Shared by `epcomm bench` and the MPI baseline: see bench_common.h. */
#include "bench_common.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref.h"

/* ------------------------------------------------------------------ options */

void bench_usage(FILE *f, const char *tool, int mpi) {
  fprintf(f,
          "usage: %s [--mode normal|ll] [--backend cpu|cuda] [--tokens N] [--hidden H]\n"
          "       [--topk K] [--experts E] [--dtype bf16|fp8] [--routing uniform|zipf|grouped]\n"
          "       [--warmup W] [--iters I] [--threads T] [--seed S]\n%s"
          "defaults: DeepEP's sizes: normal 4096 tokens, ll 128 tokens; H 7168, topk 8,\n"
          "          E 256 (normal) / 288 (ll), rounded down to a multiple of the rank count;\n"
          "          bf16, uniform routing, 2 warm-up and 10 timed iterations (ll: 10 and 50),\n"
          "          1 thread\n"
          "ranges:   N 0..16777216, H 1..1048576 (H x dtype bytes a multiple of 16; fp8: H a\n"
          "          multiple of 128), K 1..64, E a multiple of the ranks from max(ranks, K) to\n"
          "          65536, W 0..1048576, I 1..1048576, T 1..256\n%s",
          tool,
          mpi ? "       [--raw FILE]   (results for epcomm bench to merge)\n"
              : "       [--json [FILE]] [--baseline auto|on|off] [--timeout S]\n",
          mpi ? ""
              : "--json alone: JSON on stdout instead of the table; --json FILE: table and file.\n"
                "Run it under `epcomm launch -n R` or mpirun; only rank 0 prints. On a terminal,\n"
                "rank 0 shows its progress on stderr (never with --json).\n");
}

/* This process's rank from the launcher's environment, before any group exists: only rank 0
 * (or a process started alone) prints usage and option errors, not every rank. */
int bench_env_rank(void) {
  static const char *const names[] = {"EP_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                      "SLURM_PROCID"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    const char *v = getenv(names[i]);
    if (v && *v) return atoi(v);
  }
  return 0;
}

/* One of `names`: its index, or 0 and the choices in `why`. */
static int pick(const char *k, const char *v, const char *const *names, int *out, char *why,
                size_t n) {
  int len = snprintf(why, n, "%s '%s': want one of ", k, v);
  for (int i = 0; names[i]; i++) {
    if (!strcmp(v, names[i])) return *out = i, 1;
    if (len > 0 && (size_t)len < n) len += snprintf(why + len, n - (size_t)len, "%s%s", i ? "|" : "", names[i]);
  }
  return 0;
}

static int num(const char *k, const char *v, long lo, long hi, int *out, char *why, size_t n) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno || x < lo || x > hi) {
    snprintf(why, n, "%s '%s': want an integer from %ld to %ld", k, v, lo, hi);
    return 0;
  }
  *out = (int)x;
  return 1;
}

/* One option with a value; returns 1 if understood and valid, else 0 with the reason in `why`. */
static int take(bench_opts_t *o, const char *k, const char *v, int mpi, char *why, size_t n) {
  static const char *const modes[] = {"normal", "ll", NULL}, *const backends[] = {"cpu", "cuda", NULL},
                           *const routings[] = {"uniform", "zipf", "grouped", NULL},
                           *const dtypes[] = {"bf16", "fp8", NULL},
                           *const baselines[] = {"auto", "on", "off", NULL};
  if (!strcmp(k, "--mode")) return pick(k, v, modes, &o->mode, why, n);
  if (!strcmp(k, "--backend")) return pick(k, v, backends, &o->backend_cuda, why, n);
  if (!strcmp(k, "--routing")) return pick(k, v, routings, &o->routing, why, n);
  if (!strcmp(k, "--dtype")) return pick(k, v, dtypes, &o->dtype, why, n) && ++o->dtype;
  if (!strcmp(k, "--tokens")) return o->set_tokens = 1, num(k, v, 0, 1 << 24, &o->tokens, why, n);
  if (!strcmp(k, "--hidden")) return num(k, v, 1, 1 << 20, &o->hidden, why, n);
  if (!strcmp(k, "--topk")) return num(k, v, 1, 64, &o->topk, why, n);
  if (!strcmp(k, "--experts")) return o->set_experts = 1, num(k, v, 1, 1 << 16, &o->experts, why, n);
  if (!strcmp(k, "--warmup")) return o->set_warmup = 1, num(k, v, 0, 1 << 20, &o->warmup, why, n);
  if (!strcmp(k, "--iters")) return o->set_iters = 1, num(k, v, 1, 1 << 20, &o->iters, why, n);
  if (!strcmp(k, "--threads")) return num(k, v, 1, 256, &o->threads, why, n);
  if (!strcmp(k, "--seed")) {
    char *end;
    errno = 0;
    o->seed = strtoull(v, &end, 0);
    if (*v && *v != '-' && !*end && !errno) return 1;
    return snprintf(why, n, "%s '%s': want an unsigned 64-bit integer", k, v), 0;
  }
  if (mpi && !strcmp(k, "--raw")) return o->raw = v, 1;
  if (!mpi && !strcmp(k, "--baseline")) return pick(k, v, baselines, &o->baseline, why, n);
  if (!mpi && !strcmp(k, "--json")) return o->json = v, 1;
  if (!mpi && !strcmp(k, "--timeout")) {
    char *end;
    o->timeout_s = strtod(v, &end);
    if (*v && !*end && o->timeout_s > 0 && o->timeout_s <= 1e9) return 1;
    return snprintf(why, n, "%s '%s': want seconds, a number > 0 and <= 1e9", k, v), 0;
  }
  return snprintf(why, n, "unknown option '%s'", k), 0;
}

static int check_opts(const bench_opts_t *o, char *why, size_t n) {
  if (o->dtype == BENCH_FP8 && o->hidden % 128)
    snprintf(why, n, "--dtype fp8 needs --hidden a multiple of 128 (fp8 scales cover 128 "
             "channels); --hidden is %d", o->hidden);
  else if ((size_t)o->hidden * (o->dtype == BENCH_FP8 ? 1 : 2) % 16)
    snprintf(why, n, "--hidden %d: a row (hidden x %d bytes) must be a multiple of 16 bytes: "
             "want a multiple of %d", o->hidden, o->dtype == BENCH_FP8 ? 1 : 2,
             o->dtype == BENCH_FP8 ? 16 : 8);
  else
    return 0;
  return 2;
}

static int defaults(bench_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->dtype = BENCH_BF16;
  o->hidden = 7168;
  o->topk = 8;
  o->warmup = 2;
  o->iters = 10;
  o->threads = 1;
  o->seed = 20250101;
  o->timeout_s = 600;
  return 0;
}

/* Parses; on an error returns 2 with the reason in `why`; -1 for --help. */
static int parse_args(int argc, char **argv, int mpi, bench_opts_t *o, char *why, size_t n) {
  for (int i = 1; i < argc; i++) {
    const char *k = argv[i];
    if (!strcmp(k, "-h") || !strcmp(k, "--help")) return -1;
    if (!mpi && !strcmp(k, "--json") && (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2))) {
      o->json = "-";
      continue;
    }
    if (i + 1 >= argc) { /* the last word: a known option without its value, or unknown */
      if (take(o, k, "", mpi, why, n) || strncmp(why, "unknown option", 14))
        snprintf(why, n, "option %s needs a value", k);
      return 2;
    }
    if (!take(o, k, argv[i + 1], mpi, why, n)) return 2;
    i++;
  }
  if (!o->set_tokens) o->tokens = o->mode == BENCH_LL ? 128 : 4096;
  if (!o->set_experts) o->experts = o->mode == BENCH_LL ? 288 : 256;
  if (!o->set_warmup && o->mode == BENCH_LL) o->warmup = 10; /* calls of microseconds */
  if (!o->set_iters && o->mode == BENCH_LL) o->iters = 50;
  return check_opts(o, why, n);
}

int bench_parse(int argc, char **argv, const char *tool, int mpi, bench_opts_t *o) {
  char why[256] = "";
  defaults(o);
  int rc = parse_args(argc, argv, mpi, o, why, sizeof why);
  int speak = bench_env_rank() == 0;
  if (rc < 0) {
    if (speak) bench_usage(stdout, tool, mpi);
    return 1 << 8; /* caller: exit 0 */
  }
  if (rc && speak) {
    fprintf(stderr, "%s: %s\n", tool, why);
    bench_usage(stderr, tool, mpi);
  }
  return rc;
}

/* Every rank holds E / R experts and each token picks topk distinct ones: E must be a multiple
 * of R, at least max(R, topk). A value that is not a multiple is rounded down to one, if that is
 * still valid. */
int bench_fix_experts(bench_opts_t *o, int nranks, char *why, size_t n) {
  int R = nranks, need = o->topk > R ? o->topk : R;
  int lo = (need + R - 1) / R * R, hi = (1 << 16) / R * R, e = o->experts - o->experts % R;
  if (e >= lo && e <= hi) {
    int changed = e != o->experts;
    o->experts = e;
    return changed;
  }
  int len = snprintf(why, n, "--experts %d: with %d rank%s and --topk %d, want a multiple of %d "
                     "from %d to %d (every rank holds experts/%d of them, each token picks %d "
                     "distinct ones)", o->experts, R, R > 1 ? "s" : "", o->topk, R, lo, hi, R,
                     o->topk);
  if (e != o->experts && len > 0 && (size_t)len < n)
    snprintf(why + len, n - (size_t)len, "; %d would round down to %d", o->experts, e);
  return -1;
}

const char *bench_routing_name(int r) {
  return r == BENCH_ZIPF ? "zipf" : r == BENCH_GROUPED ? "grouped" : "uniform";
}

/* ------------------------------------------------------------------ generator */

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return mix64(seed ^ mix64(a + 0x9e3779b97f4a7c15ull * (b + 1) + 0x632be59bd9b4e019ull * (c + 1)));
}

typedef struct {
  uint64_t s;
} rng_t;
static uint64_t next(rng_t *r) { return mix64(r->s += 0x9e3779b97f4a7c15ull); }

size_t bench_row_bytes(const bench_opts_t *o) {
  return (size_t)o->hidden * (o->dtype == BENCH_FP8 ? 1 : 2);
}

int bench_num_scales(const bench_opts_t *o) { return o->dtype == BENCH_FP8 ? o->hidden / 128 : 0; }

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

void bench_gen_x(const bench_opts_t *o, int src, void *x, float *scales) {
  size_t row = bench_row_bytes(o);
  int ns = bench_num_scales(o);
  for (int t = 0; t < o->tokens; t++) {
    uint64_t k = key(o->seed, 1, (uint64_t)src, (uint64_t)t);
    if (o->dtype == BENCH_FP8)
      fill_fp8(k, (uint8_t *)x + (size_t)t * row, o->hidden, scales + (size_t)t * ns, ns);
    else
      fill_bf16(k, (uint16_t *)((uint8_t *)x + (size_t)t * row), o->hidden);
  }
}

void bench_gen_y_row(const bench_opts_t *o, int dst, int src, int t, uint16_t *row) {
  fill_bf16(key(o->seed, 2 + ((uint64_t)dst << 32), (uint64_t)src, (uint64_t)t), row, o->hidden);
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
  rng_t r = {key(seed, 3, 0, 0)};
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
    if (z->cdf[mid] < u) lo = mid + 1;
    else hi = mid;
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
      if (o->routing == BENCH_ZIPF && tries < 64) e = zipf_draw(z, E, r);
      else if (o->routing == BENCH_GROUPED) {
        int j = (int)(next(r) % (uint64_t)(TG * per));
        e = (int64_t)groups[j / per] * per + j % per;
      } else e = (int64_t)(next(r) % (uint64_t)E);
      tries++;
    } while (has(ids, k, e)); /* topk distinct experts, like torch.topk over router scores */
    ids[k] = e;
  }
}

void bench_gen_route(const bench_opts_t *o, int src, int64_t *idx, float *w) {
  rng_t r = {key(o->seed, 4, (uint64_t)src, 0)};
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

/* ------------------------------------------------------------------ checks */

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

static int goes_to(const int64_t *ids, int topk, int per, int d) {
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
    for (int t = 0; t < o->tokens; t++) n += goes_to(idx + (size_t)t * o->topk, o->topk, per, me);
    if (recv_from) recv_from[s] = n;
    if (s == me && send_to)
      for (int d = 0; d < R; d++) {
        send_to[d] = 0;
        for (int t = 0; t < o->tokens; t++)
          send_to[d] += goes_to(idx + (size_t)t * o->topk, o->topk, per, d);
      }
  }
  free(idx);
  free(w);
}

#define FAIL(...)                                                  \
  do {                                                             \
    if (!bad++) snprintf(msg, msg_len, __VA_ARGS__);               \
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
    if (!goes_to(ids, K, per, me)) continue;
    int r = (*j)++;
    if (r >= rv->nr) {
      FAIL("rank %d: fewer rows than expected (%d) from rank %d", me, rv->nr, s);
      break;
    }
    if (rv->src_idx && rv->src_idx[r] != t)
      FAIL("rank %d row %d: src_idx %d, expected %d (rank %d)", me, r, rv->src_idx[r], t, s);
    uint64_t k = key(o->seed, 1, (uint64_t)s, (uint64_t)t);
    if (o->dtype == BENCH_FP8) fill_fp8(k, x, o->hidden, sc, ns);
    else fill_bf16(k, (uint16_t *)x, o->hidden);
    if (memcmp(x, (const uint8_t *)rv->x + (size_t)r * row, row))
      FAIL("rank %d row %d: payload differs from token %d of rank %d", me, r, t, s);
    if (ns && memcmp(sc, rv->scales + (size_t)r * ns, (size_t)ns * sizeof *sc))
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

long bench_check_combine(const bench_opts_t *o, int R, int me, const uint16_t *out, char *msg,
                         size_t msg_len) {
  int K = o->topk, per = o->experts / R, H = o->hidden;
  int64_t *idx = malloc((size_t)o->tokens * K * sizeof *idx + 8);
  float *w = malloc((size_t)o->tokens * K * sizeof *w + 4), *acc = malloc((size_t)H * sizeof *acc);
  uint16_t *y = malloc((size_t)H * 2);
  long bad = 0;
  msg[0] = '\0';
  bench_gen_route(o, me, idx, w);
  for (int t = 0; t < o->tokens && bad < 1000; t++) {
    for (int h = 0; h < H; h++) acc[h] = 0.0f;
    for (int r = 0; r < R; r++) {
      if (!goes_to(idx + (size_t)t * K, K, per, r)) continue;
      bench_gen_y_row(o, r, me, t, y);
      for (int h = 0; h < H; h++) acc[h] += ref_bf16_to_f32(y[h]);
    }
    for (int h = 0; h < H; h++)
      if (out[(size_t)t * H + h] != ref_f32_to_bf16(acc[h])) {
        FAIL("rank %d: combined token %d channel %d is %#06x, expected %#06x", me, t, h,
             out[(size_t)t * H + h], ref_f32_to_bf16(acc[h]));
        break;
      }
  }
  free(idx), free(w), free(acc), free(y);
  return bad;
}

/* ------------------------------------------------------------------ statistics */

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double quantile(const double *s, int n, double q) {
  double pos = q * (n - 1);
  int i = (int)floor(pos);
  if (i >= n - 1) return s[n - 1];
  return s[i] + (pos - i) * (s[i + 1] - s[i]);
}

bench_stat_t bench_stats(const double *v, int n) {
  bench_stat_t st = {0, 0, 0};
  if (n <= 0) return st;
  double *s = malloc((size_t)n * sizeof *s);
  memcpy(s, v, (size_t)n * sizeof *s);
  qsort(s, (size_t)n, sizeof *s, cmp_d);
  st.median = quantile(s, n, 0.5);
  st.p10 = quantile(s, n, 0.1);
  st.p90 = quantile(s, n, 0.9);
  free(s);
  return st;
}

double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
