/*
 * What `epcomm bench` (either backend) and its MPI_Alltoallv baseline (bench/mpi_baseline.c)
 * share, so that all of them move the same data, check it the same way and report it the same
 * way: options, the deterministic generator of tokens and routing, the self-checks. No
 * dependency on the library or on MPI: static target ep_benchcore. Results and the report:
 * bench_result.h.
 */
#ifndef EP_TOOLS_BENCH_COMMON_H
#define EP_TOOLS_BENCH_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { BENCH_NORMAL = 0, BENCH_LL = 1 };
enum { BENCH_CPU = 0, BENCH_CUDA = 1 };
enum { BENCH_UNIFORM = 0, BENCH_ZIPF = 1, BENCH_GROUPED = 2 };
enum { BENCH_BF16 = 1, BENCH_FP8 = 2 }; /* the values of ep_dtype_t */
enum { BENCH_BASELINE_AUTO = 0, BENCH_BASELINE_ON = 1, BENCH_BASELINE_OFF = 2 };
enum { BENCH_VARIANTS_ALL = 0, BENCH_VARIANTS_MAIN = 1 };

/* The programs that parse these options; each accepts its own subset. */
enum { BENCH_TOOL_EPCOMM = 1, BENCH_TOOL_MPI = 2 };

typedef struct {
  int mode, backend;
  int tokens, hidden, topk, experts, dtype, routing;
  int warmup, iters;
  int threads;       /* workers per rank: cpu channels (and memcpy threads), cuda SMs; 0: default */
  int variants;      /* BENCH_VARIANTS_*: the main rows only, or every variant the buffer can do */
  double compute_us; /* cuda ll: length of the compute kernel of the overlap measurement */
  uint64_t seed;
  const char *json; /* NULL: table only; "-": JSON on stdout instead of the table; else a file */
  /* epcomm bench only */
  int baseline;       /* BENCH_BASELINE_* */
  double timeout_s;   /* group deadline (must cover the baseline run) */
  int hosts;          /* --hosts H: the ranks form H pretend hosts (EP_HOSTS); 0: not given */
  int nhosts;         /* hosts of the group once it exists (0 or 1: one host) */
  char refuse[128];   /* EP_BENCH_REFUSE, for tests ("": none; bench_run.c) */
  int ll_fill_copies; /* EP_BENCH_LL_FILL=copies (bench_ll.c) */
  const int *host_of; /* [R] host of every rank when nhosts > 1 (the combine's order) */
  /* MPI baseline only */
  const char *raw; /* results file for epcomm bench to merge */
  /* set explicitly on the command line (defaults depend on the mode and the backend) */
  int set_tokens, set_experts, set_warmup, set_iters, set_threads, set_sms, set_compute;
  struct bench_progress *progress; /* epcomm bench: rank 0's progress lines; NULL: none */
} bench_opts_t;

/* Parses argv[1..] (argv[0] is the subcommand) for program `tool` (BENCH_TOOL_*), named `name`
 * in messages. Returns 0, 1 << 8 after --help (exit 0), or 2 for a bad option or a combination
 * this program or backend cannot run: the reason, naming the option, the value and the valid
 * range, and the usage are printed by rank 0 only (the rank from the launcher's environment,
 * bench_env_rank). Defaults: DeepEP's sizes for the mode. Experts are checked against the rank
 * count later (bench_fix_experts). */
int bench_parse(int argc, char **argv, const char *name, int tool, bench_opts_t *o);
void bench_usage(FILE *f, const char *name, int tool);
/* EP_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID; 0 when none is set. */
int bench_env_rank(void);
/* E rounded down to a multiple of R; returns 0 (unchanged), 1 (rounded), or -1 when no multiple
 * of R at or below E is in [max(R, topk) rounded up to R, 65536], with the valid range in `why`. */
int bench_fix_experts(bench_opts_t *o, int nranks, char *why, size_t why_len);
const char *bench_routing_name(int r);
const char *bench_dtype_name(int dtype);

/* ---- data (identical in every process for the same options and seed) */
size_t bench_row_bytes(const bench_opts_t *o); /* hidden x dtype size */
int bench_num_scales(const bench_opts_t *o);   /* fp8: hidden / 128, else 0 */
/* Rank `src`'s token rows [tokens][row bytes], scales [tokens][num_scales] (fp8, else NULL). */
void bench_gen_x(const bench_opts_t *o, int src, void *x, float *scales);
/* Rank `src`'s routing: topk_idx [tokens][topk], topk_weights [tokens][topk]. */
void bench_gen_route(const bench_opts_t *o, int src, int64_t *idx, float *w);
/* The "expert output" row that rank `dst` hands to combine for token `t` of rank `src`. */
void bench_gen_y_row(const bench_opts_t *o, int dst, int src, int t, uint16_t *row);
/* Rows rank `me` receives from each source (recv_from[R]) and sends to each rank (send_to[R]). */
void bench_counts(const bench_opts_t *o, int R, int me, int32_t *recv_from, int32_t *send_to);
/* 1 if a token with experts ids[topk] goes to rank d (`per` experts per rank). */
int bench_goes_to(const int64_t *ids, int topk, int per, int d);
/* Derives the stream key of one generated item, so that every item is reproducible alone. */
uint64_t bench_key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
/* The row of token `t` of rank `src` (bf16 or fp8 bytes), and its scales (fp8). */
void bench_gen_x_row(const bench_opts_t *o, int src, int t, void *row, float *scales);

/* DeepEP's bytes of one rank's normal-mode calls that receive nr rows, self of them from the rank
 * itself: dispatch = rows x (row bytes + fp8 scales), of which cross rank = the rows from other
 * ranks with their metadata (source index, topk ids and weights); combine = the same rows sent
 * back as bf16. */
typedef struct {
  double d_bytes, d_wire, c_bytes, c_wire;
} bench_bytes_t;
bench_bytes_t bench_normal_bytes(const bench_opts_t *o, int nr, int self);

/* 64-bit digest of a byte range (compares outputs across runs and programs cheaply). */
uint64_t bench_digest(const void *p, size_t n, uint64_t h);
#define BENCH_DIGEST_SEED 1469598103934665603ull

/* ---- self-checks. Each returns the number of mismatches (0: pass) and writes the first one into
 * msg (msg_len bytes). */
typedef struct {
  int nr;                           /* received rows */
  const void *x;                    /* [nr][row bytes] */
  const float *scales;              /* [nr][num_scales] (fp8), or NULL: not checked */
  const int64_t *topk_idx;          /* [nr][topk], local ids or -1; NULL: not checked */
  const float *topk_weights;        /* [nr][topk]; NULL: not checked */
  const int32_t *src_idx;           /* [nr]; NULL: not checked */
  const int32_t *rank_prefix;       /* [R][R]; NULL: not checked */
  const int32_t *tokens_per_expert; /* [E/R]; NULL: not checked */
} bench_recv_t;
/* Dispatch outputs of rank `me` of `R` against the generator and SEMANTICS.md §3. */
long bench_check_dispatch(const bench_opts_t *o, int R, int me, const bench_recv_t *rv, char *msg,
                          size_t msg_len);
/* Combine output out [tokens][hidden] bf16 of rank `me`, for expert outputs from
 * bench_gen_y_row: out[t] = bf16(sum over ranks r ascending that t went to of y(r, me, t)); across
 * hosts (o->nhosts > 1) each host's rows first make an fp32 partial, hosts ascending
 * (docs/SEMANTICS.md §4.6). */
long bench_check_combine(const bench_opts_t *o, int R, int me, const uint16_t *out, char *msg,
                         size_t msg_len);

#endif
