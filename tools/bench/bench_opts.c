/* The options of `epcomm bench` and of its MPI baseline: one table, one parser, one usage text.
 * Every refusal names the option, the value and what is valid, and only rank 0 says it. */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"

enum { K_INT, K_PICK, K_U64, K_SECS, K_STR, K_FLAG_STR };

typedef struct {
  const char *name;
  int kind, tools;
  size_t off;                 /* field of bench_opts_t */
  long lo, hi;                /* K_INT range; K_SECS: upper bound */
  const char *const *choices; /* K_PICK */
  int pick_base;              /* K_PICK: value of the first choice */
  size_t set_off;             /* its set_* flag, or 0 */
} opt_t;

static const char *const modes[] = {"normal", "ll", NULL},
                         *const backends[] = {"cpu", "cuda", NULL},
                         *const routings[] = {"uniform", "zipf", "grouped", NULL},
                         *const dtypes[] = {"bf16", "fp8", NULL},
                         *const baselines[] = {"auto", "on", "off", NULL},
                         *const variants[] = {"all", "main", NULL};

#define F(x) offsetof(bench_opts_t, x)
#define EP BENCH_TOOL_EPCOMM
#define BOTH (BENCH_TOOL_EPCOMM | BENCH_TOOL_MPI)
static const opt_t opts[] = {
    {"--mode", K_PICK, BOTH, F(mode), 0, 0, modes, 0, 0},
    {"--backend", K_PICK, BOTH, F(backend), 0, 0, backends, 0, 0},
    {"--tokens", K_INT, BOTH, F(tokens), 0, 1 << 24, NULL, 0, F(set_tokens)},
    {"--hidden", K_INT, BOTH, F(hidden), 1, 1 << 20, NULL, 0, 0},
    {"--topk", K_INT, BOTH, F(topk), 1, 64, NULL, 0, 0},
    {"--experts", K_INT, BOTH, F(experts), 1, 1 << 16, NULL, 0, F(set_experts)},
    {"--dtype", K_PICK, BOTH, F(dtype), 0, 0, dtypes, BENCH_BF16, 0},
    {"--routing", K_PICK, BOTH, F(routing), 0, 0, routings, 0, 0},
    {"--warmup", K_INT, BOTH, F(warmup), 0, 1 << 20, NULL, 0, F(set_warmup)},
    {"--iters", K_INT, BOTH, F(iters), 1, 1 << 20, NULL, 0, F(set_iters)},
    {"--threads", K_INT, BOTH, F(threads), 1, 256, NULL, 0, F(set_threads)},
    {"--sms", K_INT, EP, F(threads), 1, 1024, NULL, 0, F(set_sms)},
    {"--variants", K_PICK, EP, F(variants), 0, 0, variants, 0, 0},
    {"--compute-us", K_SECS, EP, F(compute_us), 0, 1000000, NULL, 0, F(set_compute)},
    {"--seed", K_U64, BOTH, F(seed), 0, 0, NULL, 0, 0},
    {"--json", K_FLAG_STR, BOTH, F(json), 0, 0, NULL, 0, 0},
    {"--baseline", K_PICK, EP, F(baseline), 0, 0, baselines, 0, 0},
    {"--timeout", K_SECS, EP, F(timeout_s), 0, 1000000000, NULL, 0, 0},
    {"--hosts", K_INT, EP, F(hosts), 1, 4096, NULL, 0, 0},
    {"--raw", K_STR, BENCH_TOOL_MPI, F(raw), 0, 0, NULL, 0, 0},
};

void bench_usage(FILE *f, const char *name, int tool) {
  int ep = tool == BENCH_TOOL_EPCOMM;
  fprintf(f,
          "usage: %s [--mode normal|ll] [--backend cpu|cuda] [--tokens N] [--hidden H]\n"
          "       [--topk K] [--experts E] [--dtype bf16|fp8] [--routing uniform|zipf|grouped]\n"
          "       [--warmup W] [--iters I] [--threads T] [--seed S] [--json [FILE]]\n%s"
          "defaults: DeepEP's sizes: normal 4096 tokens, ll 128 tokens; H 7168, topk 8,\n"
          "          E 256 (normal) / 288 (ll), rounded down to a multiple of the rank count;\n"
          "          bf16, uniform routing; warm-up + timed iterations: cpu 2 + 10 (ll 10 + 50),\n"
          "          cuda 10 + 30 (ll 20 + 200); cpu: 1 thread; cuda: 24 SMs (16 from 8 ranks;\n"
          "          ll: the library's default)\n"
          "ranges:   N 0..16777216, H 1..1048576 (H x dtype bytes a multiple of 16; fp8: H a\n"
          "          multiple of 128), K 1..64, E a multiple of the ranks from max(ranks, K) to\n"
          "          65536, W 0..1048576, I 1..1048576, T 1..256, S (SMs) 1..1024\n%s",
          name,
          ep ? "       [--sms S] [--variants all|main] [--compute-us U] [--baseline auto|on|off]\n"
               "       [--timeout S] [--hosts H]\n"
             : "       [--raw FILE]   (results for epcomm bench to merge)\n",
          ep ? "--json alone: JSON on stdout instead of the table; --json FILE: table and file.\n"
               "--threads: worker threads per rank (cpu); --sms: SMs per rank (cuda; --threads\n"
               "says the same there). Run it under `epcomm launch -n R` or mpirun; only rank 0\n"
               "prints. On a terminal, rank 0 shows its progress on stderr (never with --json).\n"
               "--hosts H: the ranks form H pretend hosts (EP_HOSTS; run under\n"
               "`epcomm launch -n R --hosts H` or mpirun): normal mode also reports the bytes\n"
               "that crossed the network and stayed inside hosts, next to the flat baseline's.\n"
             : "Run it under mpirun; only rank 0 prints.\n");
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

/* One of the choices: its index, or 0 and the choices in `why`. */
static int pick(const opt_t *d, const char *v, int *out, char *why, size_t n) {
  int len = snprintf(why, n, "%s '%s': want one of ", d->name, v);
  for (int i = 0; d->choices[i]; i++) {
    if (!strcmp(v, d->choices[i])) return *out = d->pick_base + i, 1;
    if (len > 0 && (size_t)len < n)
      len += snprintf(why + len, n - (size_t)len, "%s%s", i ? "|" : "", d->choices[i]);
  }
  return 0;
}

static int integer(const opt_t *d, const char *v, int *out, char *why, size_t n) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno || x < d->lo || x > d->hi)
    return snprintf(why, n, "%s '%s': want an integer from %ld to %ld", d->name, v, d->lo, d->hi),
           0;
  *out = (int)x;
  return 1;
}

/* The value of one option into its field; 0 with the reason in `why`. */
static int take(const opt_t *d, bench_opts_t *o, const char *v, char *why, size_t n) {
  char *f = (char *)o + d->off, *end;
  if (d->set_off) *(int *)((char *)o + d->set_off) = 1;
  errno = 0;
  switch (d->kind) {
    case K_PICK:
      return pick(d, v, (int *)f, why, n);
    case K_INT:
      return integer(d, v, (int *)f, why, n);
    case K_U64:
      *(uint64_t *)f = strtoull(v, &end, 0);
      if (*v && *v != '-' && !*end && !errno) return 1;
      return snprintf(why, n, "%s '%s': want an unsigned 64-bit integer", d->name, v), 0;
    case K_SECS:
      *(double *)f = strtod(v, &end);
      if (*v && !*end && *(double *)f > 0 && *(double *)f <= (double)d->hi) return 1;
      return snprintf(why, n, "%s '%s': want a number > 0 and <= %ld", d->name, v, d->hi), 0;
    default:
      return *(const char **)f = v, 1;
  }
}

static const opt_t *find(const char *k, int tool, const char *name, char *why, size_t n) {
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
    if (strcmp(k, opts[i].name)) continue;
    if (opts[i].tools & tool) return &opts[i];
    snprintf(why, n, "option %s is not one of %s's (it belongs to %s)", k, name,
             tool == BENCH_TOOL_MPI ? "epcomm bench" : "the MPI baseline program");
    return NULL;
  }
  snprintf(why, n, "unknown option '%s'", k);
  return NULL;
}

/* Parses the words; on an error returns 2 with the reason in `why`; -1 for --help. */
static int parse_words(int argc, char **argv, int tool, const char *name, bench_opts_t *o,
                       char *why, size_t n) {
  for (int i = 1; i < argc; i++) {
    const char *k = argv[i];
    if (!strcmp(k, "-h") || !strcmp(k, "--help")) return -1;
    const opt_t *d = find(k, tool, name, why, n);
    if (!d) return 2;
    int bare = i + 1 >= argc || !strncmp(argv[i + 1], "--", 2);
    if (d->kind == K_FLAG_STR && bare) { /* --json alone: JSON on stdout */
      o->json = "-";
      continue;
    }
    if (i + 1 >= argc) return snprintf(why, n, "option %s needs a value", k), 2;
    if (!take(d, o, argv[++i], why, n)) return 2;
  }
  return 0;
}

static void defaults(bench_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->dtype = BENCH_BF16;
  o->hidden = 7168;
  o->topk = 8;
  o->seed = 20250101;
  o->timeout_s = 600;
  o->compute_us = 200;
}

/* Defaults that depend on the mode and the backend: calls of microseconds (GPU, low latency) need
 * more iterations for a stable median than calls of milliseconds. */
static void mode_defaults(bench_opts_t *o) {
  int ll = o->mode == BENCH_LL, cuda = o->backend == BENCH_CUDA;
  if (!o->set_tokens) o->tokens = ll ? 128 : 4096;
  if (!o->set_experts) o->experts = ll ? 288 : 256;
  if (!o->set_warmup) o->warmup = cuda ? (ll ? 20 : 10) : (ll ? 10 : 2);
  if (!o->set_iters) o->iters = cuda ? (ll ? 200 : 30) : (ll ? 50 : 10);
  if (!o->set_threads && !o->set_sms) o->threads = cuda ? 0 : 1;
}

/* Combinations that cannot run, refused by the option's name before any work. */
static int check_combination(const bench_opts_t *o, int tool, char *why, size_t n) {
  int cuda = o->backend == BENCH_CUDA, ll = o->mode == BENCH_LL, fp8 = o->dtype == BENCH_FP8;
  if (fp8 && o->hidden % 128)
    snprintf(why, n,
             "--dtype fp8 needs --hidden a multiple of 128 (fp8 scales cover 128 "
             "channels); --hidden is %d",
             o->hidden);
  else if ((size_t)o->hidden * (fp8 ? 1 : 2) % 16)
    snprintf(why, n,
             "--hidden %d: a row (hidden x %d bytes) must be a multiple of 16 bytes: "
             "want a multiple of %d",
             o->hidden, fp8 ? 1 : 2, fp8 ? 16 : 8);
  else if (o->set_sms && !cuda)
    snprintf(why, n,
             "--sms %d: only with --backend cuda (SMs per rank); on cpu, --threads T "
             "sets the worker threads",
             o->threads);
  else if (o->set_sms && o->set_threads)
    snprintf(why, n, "--sms and --threads: give one (on cuda both set the SMs per rank)");
  else if (o->set_compute && !(cuda && ll))
    snprintf(why, n,
             "--compute-us: only with --mode ll --backend cuda (the length of the GPU "
             "kernel that the two-phase calls overlap)");
  else if (o->baseline == BENCH_BASELINE_ON && ll)
    snprintf(why, n,
             "--baseline on: --mode ll has no baseline (the MPI and the cudaMemcpy "
             "baselines implement normal mode)");
  else if (tool == BENCH_TOOL_MPI && cuda)
    snprintf(why, n,
             "--backend cuda: the MPI baseline moves host memory (the GPU's baseline, "
             "cudaMemcpy, runs inside `epcomm bench --backend cuda`)");
  else if (tool == BENCH_TOOL_MPI && ll)
    snprintf(why, n, "--mode ll: only --mode normal has an MPI baseline");
  else
    return 0;
  return 2;
}

int bench_parse(int argc, char **argv, const char *name, int tool, bench_opts_t *o) {
  char why[320] = "";
  defaults(o);
  int rc = parse_words(argc, argv, tool, name, o, why, sizeof why);
  if (!rc) mode_defaults(o);
  if (!rc) rc = check_combination(o, tool, why, sizeof why);
  int speak = bench_env_rank() == 0;
  if (rc < 0) {
    if (speak) bench_usage(stdout, name, tool);
    return 1 << 8; /* caller: exit 0 */
  }
  if (rc && speak) {
    fprintf(stderr, "%s: %s\n", name, why);
    bench_usage(stderr, name, tool);
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
  int len = snprintf(why, n,
                     "--experts %d: with %d rank%s and --topk %d, want a multiple of %d "
                     "from %d to %d (every rank holds experts/%d of them, each token picks %d "
                     "distinct ones)",
                     o->experts, R, R > 1 ? "s" : "", o->topk, R, lo, hi, R, o->topk);
  if (e != o->experts && len > 0 && (size_t)len < n)
    snprintf(why + len, n - (size_t)len, "; %d would round down to %d", o->experts, e);
  return -1;
}

const char *bench_routing_name(int r) {
  return routings[r >= 0 && r <= 2 ? r : 0];
}
const char *bench_dtype_name(int dtype) {
  return dtype == BENCH_FP8 ? "fp8" : "bf16";
}
