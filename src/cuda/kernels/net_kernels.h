/*
 * Kernels of the CUDA backend across hosts (src/cuda/cuda_net*.c; SEMANTICS.md §3.9, §4.6).
 * Plain C, included by the host side and by net.cu.
 *
 * The host plans every call (it knows every rank's counts after the count exchange), so these
 * kernels only move and add rows:
 *   pack     this rank's tokens into records, one block per destination host, host order;
 *   fanout   the records of the column's blocks (NCCL brought the remote ones) into area D of
 *            every rank of this host that a token goes to, at its final row (CUDA IPC);
 *   finish   area D into the caller's outputs (or in place, for views);
 *   stage    combine input into the own area C (unless it is already there);
 *   partial  per entry of the column's blocks: the rows of this host, read from the peers'
 *            area C, added in rank order into one fp32 partial (and weights);
 *   reduce   per token: biases, then the partials of the hosts ascending, rounded once.
 *
 * A record of a network block: int32 header [token, entry, partial offset (2 words: low, high),
 * fan row of local index 0..L-1 (-1: not there)], padded to 16 bytes, then the payload row, fp8
 * scales, global expert ids, weights, each 16-byte aligned (a cached dispatch carries no ids and
 * no weights). The partial offset is where the token's combine partial for this host lies in its
 * block of partials: a partial of one row is that bf16 row (exact), of more an fp32 row, then the
 * combined weights (fp32, room for them always), so partials differ in size (epk_net_psize).
 */
#ifndef EP_CUDA_NET_KERNELS_H
#define EP_CUDA_NET_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "cuda/kernels/ep_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { EPK_NET_HDR = 4 }; /* header words before the fan rows */

/* Bytes of one partial: its row (bf16 when the host holds one row of the token, else fp32),
 * then topk fp32 weights (16-byte aligned). */
EPK_HD uint64_t epk_net_psize(int hidden, int topk, int one) {
  return (one ? 2ull : 4ull) * (uint64_t)hidden + epk_al(4ull * (uint64_t)topk, 16);
}

/* Where a record keeps what (bytes), the same on every rank for one call. */
typedef struct {
  int L, topk, ns, ids, w; /* ids, w: carried */
  uint64_t row, hdr, off_s, off_i, off_w, rec;
} epk_net_rec_t;

EPK_HD epk_net_rec_t epk_net_rec(int L, uint64_t row, int ns, int topk, int ids, int w) {
  epk_net_rec_t r;
  r.L = L, r.topk = topk, r.ns = ns, r.ids = ids, r.w = ids && w;
  r.row = row;
  r.hdr = epk_al(4ull * (EPK_NET_HDR + (uint64_t)L), 16);
  r.off_s = r.hdr + row;
  r.off_i = r.off_s + epk_al(4ull * (uint64_t)ns, 16);
  r.off_w = r.off_i + (ids ? epk_al(8ull * (uint64_t)topk, 16) : 0);
  r.rec = r.off_w + (r.w ? epk_al(4ull * (uint64_t)topk, 16) : 0);
  return r;
}

/* Area D of a receiver across hosts: the one-host arrays (views see the same shapes) plus, per
 * row, the source rank and the row's entry in that source's block to this host (for combine). */
typedef struct {
  epk_recv_layout_t a;
  uint64_t off_meta;
} epk_net_area_t;

EPK_HD epk_net_area_t epk_net_area(uint64_t area, uint64_t row, int ns, int topk, int w) {
  epk_net_area_t n;
  uint64_t wk = (uint64_t)(w ? topk : 0), nsu = (uint64_t)ns, tk = (uint64_t)topk;
  uint64_t per = row + 4 * nsu + 8 * tk + 4 * wk + 4 + 8;
  uint64_t W = area > 6 * 256 ? (area - 6 * 256) / per : 0;
  n.a.rows = (int64_t)W;
  n.a.off_x = 0;
  n.a.off_s = epk_al(W * row, 256);
  n.a.off_i = n.a.off_s + epk_al(W * 4 * nsu, 256);
  n.a.off_w = n.a.off_i + epk_al(W * 8 * tk, 256);
  n.a.off_src = n.a.off_w + epk_al(W * 4 * wk, 256);
  n.off_meta = n.a.off_src + epk_al(W * 4, 256);
  return n;
}

typedef struct {
  epk_net_rec_t r;
  int n;               /* records */
  const int32_t *hdr;  /* [n][EPK_NET_HDR + L] */
  const uint8_t *x;    /* [N][row] */
  const float *scales; /* fp8 */
  int64_t s_tok, s_hid;
  const int64_t *ids;
  const float *w;
  uint8_t *out; /* [n][rec] */
} epk_net_pack_t;

/* One block of records to fan out: where, how many, its source rank, its first entry, where its
 * partials start in the forwarder's buffer of partials and how many bytes they take. */
typedef struct {
  const uint8_t *rec;
  int64_t poff0, pbytes;
  int32_t n, src, entry0, pad;
} epk_net_blk_t;

typedef struct {
  epk_net_rec_t r;
  int nblk;
  const epk_net_blk_t *blk; /* device [nblk] */
  uint8_t *const *area;     /* device [L]: area D of local index l, as mapped here */
  epk_net_area_t lay;
  int32_t *fan;  /* [entries][L]: fan rows kept for combine, or NULL (cached) */
  int64_t *poff; /* [entries]: where each entry's partial goes, or NULL (cached) */
  /* A record from another host is checked before it is used: rows inside the receive area,
   * its partial inside its block (psize1 / psize: bytes of a one-row / fp32 partial). One that
   * is not is dropped (its partial offset -1) and its source + 1 goes to *bad. */
  int64_t psize1, psize;
  int32_t *bad;
} epk_net_fanout_t;

typedef struct {
  const uint8_t *area; /* own area D */
  epk_net_area_t lay;
  int nr, topk, ns, cached, has_w, first_expert, num_local;
  uint64_t row;
  uint8_t *recv_x;
  float *recv_scales, *recv_w;
  int64_t *recv_idx;
  int32_t *recv_src;
  int32_t *meta;   /* [nr][2] source rank, entry (NULL: cached) */
  int32_t *ecount; /* [num_local] selections per local expert, zeroed (NULL: not wanted) */
} epk_net_finish_t;

typedef struct {
  const uint8_t *x; /* [nr][hidden] bf16 */
  const float *w;   /* [nr][topk] or NULL */
  uint8_t *area;    /* own area C: x rows, then weight rows at off_w */
  uint64_t off_w, row;
  int nr, topk;
} epk_net_stage_t;

typedef struct {
  int entries, L, hidden, topk, has_w;
  const int32_t *fan;   /* [entries][L] */
  const int64_t *poff;  /* [entries]: byte offset of each partial in out */
  uint8_t *const *area; /* device [L]: area C of local index l, as mapped here */
  uint64_t off_w;       /* weights in area C */
  uint8_t *out;         /* the partials (epk_net_psize each) */
} epk_net_partial_t;

typedef struct {
  int n, H, hidden, topk, has_w;
  const int64_t *tok;        /* [n][H]: 2 x offset of token t's partial in host g's block, + 1
                                when it is one bf16 row; -1: the token did not go to host g */
  const uint8_t *const *blk; /* device [H]: the partials of host g for this rank's tokens */
  const void *bias0, *bias1;
  void *out;
  float *out_w;
} epk_net_reduce_t;

cudaError_t epk_net_launch_pack(const epk_net_pack_t *a, int blocks, cudaStream_t s);
cudaError_t epk_net_launch_fanout(const epk_net_fanout_t *a, int entries, int blocks,
                                  cudaStream_t s);
cudaError_t epk_net_launch_finish(const epk_net_finish_t *a, int blocks, cudaStream_t s);
/* out[l] = ecount[l] rounded up to a multiple of align (> 1). */
cudaError_t epk_net_launch_experts(const int32_t *ecount, int32_t *out, int n, int align,
                                   cudaStream_t s);
cudaError_t epk_net_launch_stage(const epk_net_stage_t *a, int blocks, cudaStream_t s);
cudaError_t epk_net_launch_partial(const epk_net_partial_t *a, int blocks, cudaStream_t s);
cudaError_t epk_net_launch_reduce(const epk_net_reduce_t *a, int blocks, cudaStream_t s);

/* ---- low-latency mode across hosts (src/cuda/cuda_net_ll.c, SEMANTICS.md §6)
 * One record per (token, selected expert), sent by NCCL straight to the expert's rank: int32
 * header [row at the destination (local expert * RT + position), token, k, 0], then the row:
 * bf16, or e4m3 followed by NS scale words (epk_ll::scale_word: float bits, or the exponent byte
 * with use_ue8m0), 16-byte aligned. The sender places every row (it knows every rank's counts
 * after the gate), so the receiver only scatters; a combine moves bf16 rows without headers. */
EPK_HD uint64_t epk_nll_rec(int H, int NS, int fp8) {
  return epk_al(16ull + (fp8 ? (uint64_t)H + 4ull * (uint64_t)NS : 2ull * (uint64_t)H), 16);
}

typedef struct {
  const void *x;     /* [N][H] bf16 */
  const int4 *items; /* [n]: token, destination row, k, 0 */
  uint8_t *out;      /* [n] records */
  int n, H, NS, fmt; /* fmt: EPK_LL_* bits (ll_kernels.h) */
} epk_nll_pack_t;

typedef struct {
  const uint8_t *in; /* [n] records */
  int n, H, NS, fmt, L, RT;
  uint8_t *slab; /* the slot's rows [L][RT], then the scales (SEMANTICS.md §6.4) */
  int32_t *src;  /* the slot's recv_src_info [L][RT] */
  int32_t *bad;  /* set to 1 by a record whose row lies outside [0, L * RT) (nothing written) */
} epk_nll_unpack_t;

typedef struct {
  const uint8_t *y;    /* [L * RT] rows of 2H bytes */
  const int32_t *rows; /* [n] rows of y, in send order */
  uint8_t *out;        /* [n] rows */
  int n, H;
} epk_nll_gather_t;

typedef struct {
  const uint8_t *in;  /* rows received back, 2H bytes each */
  const int32_t *map; /* [n][topk]: row in `in` of (t, k), -1: not reduced */
  const float *w;     /* [n][topk] */
  void *out;          /* [n][H] bf16 */
  int n, topk, H;
} epk_nll_reduce_t;

cudaError_t epk_nll_launch_pack(const epk_nll_pack_t *a, int blocks, cudaStream_t s);
cudaError_t epk_nll_launch_unpack(const epk_nll_unpack_t *a, int blocks, cudaStream_t s);
cudaError_t epk_nll_launch_gather(const epk_nll_gather_t *a, int blocks, cudaStream_t s);
cudaError_t epk_nll_launch_reduce(const epk_nll_reduce_t *a, int blocks, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
