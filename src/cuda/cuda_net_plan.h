/* Building the layout of a dispatch across hosts on the CUDA backend (cuda_net_plan.c). */
#ifndef EP_CUDA_NET_PLAN_H
#define EP_CUDA_NET_PLAN_H

#include "cuda/cuda_net.h"

cuda_nplan_t *cuda_nplan_new(cuda_state_t *s, int N);
/* From the (checked) ids: in_rank [N][R], this rank's tokens per rank, per host, and per host
 * those that meet one rank there (their partial is one bf16 row). */
void cuda_nplan_send_side(const cuda_state_t *s, cuda_nplan_t *p, const int64_t *ids, int topk,
                          int per, uint8_t *in_rank, int32_t *to_rank, int32_t *to_host,
                          int32_t *one_host);
/* Every rank's counts: cnt, hcnt, this rank's rows, its column, its blocks' entries. */
void cuda_nplan_counts(const cuda_state_t *s, cuda_nplan_t *p, const int32_t *counts, int cw);
/* Rows rank d receives. */
int32_t cuda_nplan_rows_of(const cuda_nplan_t *p, int d);
/* Bytes of the partials that source `src` gets back from host g (one per token it sent there). */
int64_t cuda_nplan_pbytes(const cuda_nplan_t *p, int src, int g);
/* This rank's record headers (token, entry, partial offset, its row on each rank of the host)
 * and tok [N][H] (epk_net_reduce_t.tok); false: out of memory. */
bool cuda_nplan_headers(const cuda_state_t *s, cuda_nplan_t *p, const uint8_t *in_rank,
                        int64_t *tok);
/* The handle's device arrays from the arena; false: the arena is full. */
bool cuda_nplan_device(cuda_nplan_t *p, bool with_hdr);

#endif
