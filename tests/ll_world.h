/* Shared by the low-latency tests: one low-latency call's "world" (every rank's inputs, rebuilt
 * identically by every rank from a seed, and the single-process reference of the whole group),
 * the calls themselves, and the comparisons with the reference (bit for bit). */
#ifndef EP_TESTS_LL_WORLD_H
#define EP_TESTS_LL_WORLD_H

#include "common.h"
#include "ref.h"

typedef struct {
  int T, H, E, K; /* buffer sizes: ll_max_tokens, ll_hidden, ll_num_experts, ll_max_topk */
} llw_cfg_t;

enum { RT_UNIFORM, RT_SKEW, RT_MASKED, RT_EMPTY_RANK, RT_ALLMASK };
enum { NM_RANDOM, NM_FULL, NM_ZERO_SOME };
enum { F_BF16, F_FP8, F_FP8_ROUND, F_FP8_UE8M0 };

typedef struct {
  int topk, routing, nmode, fmt;
  int two_phase; /* dispatch and combine in two phases, with other work in between */
  int in_place;  /* combine y = the view's recv_x (bf16 only) */
  int cmask;     /* the combine leaves some selected slots out (-1) */
  int zero_copy; /* combine y = ep_ll_get_combine_buffer's area, the expert outputs written there */
  int cols;      /* fp8 scales in the column-major layout (EP_SCALES_COL_MAJOR) */
} llw_case_t;

typedef struct {
  int R, me;
  llw_cfg_t c;
  llw_case_t k;
  ref_rank_input_t *in; /* [R] */
  uint16_t **x;
  int64_t **idx;
  float **w;
  ref_ll_recv_t *ref; /* [R] */
  ep_ll_handle_t h;   /* this rank's handle, NULL before the dispatch / after destroy */
  /* This rank's inputs where the backend reads them (device memory with EP_BACKEND=cuda). */
  void *dx;
  int64_t *didx;
  float *dw;
} llw_round_t;

/* Work done between the two phases of a two-phase call (collective when it uses the group). */
typedef void (*llw_between_fn)(void *arg);

extern const char *llw_rt_names[], *llw_nm_names[], *llw_fmt_names[];

void llw_buffer(ep_group_t g, const llw_cfg_t *c, ep_buffer_t *buf);
void llw_gen(llw_round_t *rd, int R, int me, const llw_cfg_t *c, const llw_case_t *k,
             uint64_t seed);
void llw_free(llw_round_t *rd); /* destroys the handle too */
/* Copies this rank's (changed) host inputs to where the backend reads them again. */
void llw_upload(llw_round_t *rd);
/* This rank's (valid) arguments of the round's dispatch (the handle is ep_ll_dispatch's
 * third argument: &rd->h). */
void llw_args(llw_round_t *rd, ep_ll_dispatch_args_t *a);
/* Dispatch (and, two-phase, `between` then ep_ll_recv), then check the view. */
void llw_dispatch(llw_round_t *rd, ep_buffer_t buf, llw_between_fn between, void *arg);
void llw_check_view(const llw_round_t *rd);
/* Combine with random (or in-place) y, checked against ref_ll_combine (fused). */
void llw_combine(llw_round_t *rd, ep_buffer_t buf, uint64_t seed, llw_between_fn between,
                 void *arg);
void llw_cmp(const void *got, const void *want, size_t n, const char *what);
/* A small normal-mode dispatch + combine on `buf`, checked against the reference. */
void llw_normal_round(ep_buffer_t buf, int R, int me, uint64_t seed);

#endif
