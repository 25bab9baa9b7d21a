/*
 * Reference implementation of docs/SEMANTICS.md §2-6: single process, all R ranks simulated at
 * once, written to be obviously correct rather than fast. No dependency on the library; the
 * tests, `epcomm demo`, `epcomm bench` and its MPI baseline check their results against it
 * (static target ep_ref).
 *
 * Arithmetic follows DeepEP's kernels (SEMANTICS.md §4.2, §5, §6.5; notes at each function):
 *   - normal combine: acc = float(bias0) + float(bias1) (absent = +0), then += float(row) for the
 *     ranks the token went to in ascending rank order; one RNE rounding to bf16 at the end.
 *     Combined topk weights: 0.0f, then += w of each such rank, ascending.
 *   - low-latency fp8 cast: see ref_ll_cast_row.
 *   - low-latency combine: see ref_ll_combine (FMA or separate multiply, chosen by the caller).
 * Every function that can fail returns 0 on success and -1 on bad arguments.
 */
#ifndef EPCOMM_TOOLS_REF_H
#define EPCOMM_TOOLS_REF_H

#include <stddef.h>
#include <stdint.h>

#include "tk_num.h"

/* ------------------------------------------------------------------ numerics */

/* The number formats of docs/SEMANTICS.md, defined once in the tool library (tools/lib/tk_num.h,
 * where each rule is spelled out); tests/test_ref.c checks them on every code.
 *   bf16: round to nearest even; overflow gives inf; NaN gives 0x7fff (CUDA's canonical NaN).
 *   e4m3fn: nearest even with subnormals; |value| rounding above 448 (inf too) saturates to
 *           +-448; NaN -> 0x7f; decoding 0x7f / 0xff gives NaN. */
static inline uint16_t ref_f32_to_bf16(float f) {
  return tk_f32_to_bf16(f);
}
static inline float ref_bf16_to_f32(uint16_t b) {
  return tk_bf16_to_f32(b);
}
static inline uint8_t ref_f32_to_e4m3(float f) {
  return tk_f32_to_e4m3(f);
}
static inline float ref_e4m3_to_f32(uint8_t v) {
  return tk_e4m3_to_f32(v);
}

/* ------------------------------------------------------------ SEMANTICS.md §2 layout */

/* topk_idx[n*topk], -1 = unused slot. Returns 0, or -1 if an id is < -1 or >= E or the shape is
 * bad (n < 0, topk < 0, R <= 0, E % R != 0); outputs are untouched then. Outputs may be NULL.
 *   tokens_per_rank[R]: tokens with at least one expert on rank r (a token counts once per rank)
 *   tokens_per_expert[E]: slots that select expert e
 *   is_token_in_rank[n*R]: 1 if token t has an expert on rank r, else 0 */
int ref_layout(const int64_t *topk_idx, int n, int topk, int E, int R, int32_t *tokens_per_rank,
               int32_t *tokens_per_expert, uint8_t *is_token_in_rank);

/* ------------------------------------------------------ SEMANTICS.md §3-4 normal mode */

/* Inputs of one source rank s. */
typedef struct {
  int n;                     /* tokens of this rank (may be 0) */
  const void *x;             /* [n][row_bytes] raw bytes (bf16 or fp8); ll modes: bf16 [n][H] */
  const float *scales;       /* [n][num_scales] or NULL */
  const int64_t *topk_idx;   /* [n][topk] */
  const float *topk_weights; /* [n][topk] or NULL (required by ref_ll_combine) */
} ref_rank_input_t;

/* Outputs for one destination rank r (malloc'd by ref_dispatch, freed by ref_free_recv). Rows are
 * grouped by source rank ascending, within a source in that source's token order. */
typedef struct {
  int nr;                     /* received rows */
  uint8_t *x;                 /* [nr][row_bytes] */
  float *scales;              /* [nr][num_scales], or NULL when num_scales == 0 */
  int64_t *topk_idx;          /* [nr][topk]: local ids (e - r*E/R), or -1 */
  float *topk_weights;        /* [nr][topk]: 0 where the id is -1; NULL when no rank gave weights */
  int32_t *src_idx;           /* [nr] row in the source's x */
  int32_t *src_rank;          /* [nr] source rank of the row */
  int32_t *rank_prefix;       /* [R][R]: [i][j] = sum over s <= i of the tokens s sends to j */
  int32_t *tokens_per_expert; /* [E/R]: slots per local expert over the received rows, each
                                 rounded up to a multiple of alignment (alignment <= 1: none) */
} ref_recv_t;

/* Dispatch of all R ranks at once: in[R] -> out[R]. num_scales may be 0. Weights are all-or-none:
 * if any rank with tokens gives weights, every rank with tokens must. Returns 0, or -1 on bad
 * arguments (out is zeroed then, nothing left allocated). Duplicate experts within a token are
 * allowed (each slot counts in tokens_per_expert). */
int ref_dispatch(int R, int E, int topk, size_t row_bytes, int num_scales, int alignment,
                 const ref_rank_input_t *in, ref_recv_t *out);
void ref_free_recv(ref_recv_t *r); /* frees and zeroes one rank's outputs; NULL-safe */

/* Combine of all R ranks at once (only in[s].n is read from in). y[r]: rank r's bf16 [nr][H]
 * expert output in its recv row order. w: NULL, or w[r] = [nr][topk]. bias0/bias1: NULL, or per
 * source rank bf16 [n][H] (an entry may be NULL). Writes out[s] bf16 [n_s][H] and, when w is
 * given, out_w[s] [n_s][topk]. Arithmetic: see the top of this file. */
int ref_combine(int R, int H, int topk, const ref_rank_input_t *in, const ref_recv_t *recv,
                const uint16_t *const *y, const float *const *w, const uint16_t *const *bias0,
                const uint16_t *const *bias1, uint16_t **out, float **out_w);

/* SEMANTICS.md §3.9, §4.6: a group whose ranks span hosts. host_of[r]: host of rank r (0 ..
 * nhosts - 1). Dispatch is the same as on one host (ref_dispatch). Combine: per token, each
 * host's rows in ascending rank order make an fp32 partial (its first row, then + the next),
 * then acc = float(bias0) + float(bias1), acc += the partials by ascending host, one RNE
 * rounding; combined weights alike from +0. With nhosts <= 1 (host_of may be NULL) it is
 * ref_combine, bit for bit (§4.2). */
int ref_combine_hosts(int R, int nhosts, const int *host_of, int H, int topk,
                      const ref_rank_input_t *in, const ref_recv_t *recv, const uint16_t *const *y,
                      const float *const *w, const uint16_t *const *bias0,
                      const uint16_t *const *bias1, uint16_t **out, float **out_w);
/* Host outputs of the layout (§2.3): tokens_per_host[nhosts] (a token counts once per host it
 * goes to), is_token_in_host[n][nhosts]; each may be NULL. -1 on bad arguments. */
int ref_layout_hosts(const int64_t *topk_idx, int n, int topk, int E, int R, int nhosts,
                     const int *host_of, int32_t *tokens_per_host, uint8_t *is_token_in_host);

/* ------------------------------------------------ SEMANTICS.md §5-6 low-latency mode */

/* fp8 cast of one bf16 row of H values (H a multiple of 128), per block of 128 channels:
 *   amax = max(1e-4f, max |x|)   (NaN inputs, quiet or signaling, do not raise amax: CUDA's
 *                                 fmaxf; glibc's fmaxf would return NaN for a signaling one)
 *   round_scale == 0: scale = 448.0f / amax (float division); scale_inv = amax * (1.0f / 448.0f)
 *   round_scale != 0: e = ceil(log2(amax * (1.0f / 448.0f))) from the float's bits (unbiased
 *                     exponent, +1 if any mantissa bit is set); scale = 2^-e; scale_inv = 2^e
 *   q[i] = e4m3(x[i] * scale); scales[b] = scale_inv (if non-NULL); ue8m0[b] = e + 127 (if
 *   non-NULL and use_ue8m0; use_ue8m0 implies round_scale). */
void ref_ll_cast_row(const uint16_t *x, int H, int round_scale, int use_ue8m0, uint8_t *q,
                     float *scales, uint8_t *ue8m0);

/* Low-latency receive side of one rank; L = E/R local experts, each with R*T row slots. Rows of
 * local expert l: source rank ascending, then source token order (one row per (token, slot)
 * selecting the expert). Rows past count[l] are zero (src_info -1): SEMANTICS.md §6.3 leaves them
 * unspecified. */
typedef struct {
  int L, RT, H;          /* local experts, rows per expert (R*T), hidden */
  int fp8, ue8m0;        /* format of the rows */
  uint16_t *x;           /* bf16 [L][RT][H]            (fp8 == 0, else NULL) */
  uint8_t *q;            /* e4m3 [L][RT][H]            (fp8 != 0, else NULL) */
  float *scales;         /* [L][RT][H/128] scale_inv   (fp8 && !ue8m0, else NULL) */
  uint8_t *ue8m0_exp;    /* [L][RT][H/128] e + 127     (ue8m0, else NULL) */
  int32_t *count;        /* [L] rows received per local expert */
  int32_t *src_info;     /* [L][RT] token index in its source rank */
  int64_t *layout_range; /* [L][R] (begin << 32) | count of the rows from each source */
} ref_ll_recv_t;

/* Low-latency dispatch of all ranks: in[s].x bf16 [n][H], in[s].topk_idx [n][topk], n <= T.
 * use_fp8 casts with ref_ll_cast_row. Returns -1 on bad arguments: ids out of range, n > T,
 * H <= 0 (or H % 128 != 0 with fp8), round_scale/use_ue8m0 without use_fp8, use_ue8m0 without
 * round_scale, or the same expert twice in one token (DeepEP's ll buffers are indexed by
 * (expert, token), so duplicates have no defined result there). */
int ref_ll_dispatch(int R, int T, int E, int H, int topk, const ref_rank_input_t *in, int use_fp8,
                    int round_scale, int use_ue8m0, ref_ll_recv_t *out /*[R]*/);
void ref_ll_free(ref_ll_recv_t *r); /* frees and zeroes one rank's outputs; NULL-safe */

/* Low-latency combine: y[r] = rank r's bf16 [E/R][R*T][H] expert outputs in the row layout of
 * ref_ll_dispatch; in[s].n, .topk_idx and .topk_weights (required) are read. For every token:
 *   acc = 0.0f; for k ascending with id != -1: acc = acc + w[k] * float(y row)
 *   out = bf16(acc) (RNE).
 * fused != 0: each step is one fmaf(float(y), w, acc) -- what DeepEP's CUDA kernel does, since
 *             nvcc contracts `acc += float(y) * w` into an FMA by default (--fmad=true);
 * fused == 0: the product is rounded to float, then added (two roundings).
 * Writes out[s] bf16 [n_s][H]. */
int ref_ll_combine(int R, int T, int E, int H, int topk, const ref_rank_input_t *in,
                   const uint16_t *const *y, int fused, uint16_t **out /*[R]*/);

#endif
