/*
 * Low-latency mode of the CUDA backend (SEMANTICS.md §5, §6): the layout of its region in each
 * rank's pool and of its private device state, the kernels' arguments and launchers. Plain C,
 * included by the host side (src/cuda/cuda_ll*.c) and the kernels (ll_*.cu).
 *
 * Region of every rank's pool (at lay.off; L = E/R local experts, RT = R*T rows each):
 *
 *   [entry[2]: this rank's entry record of its dispatch calls of parity 0 and 1]
 *   [creject: ticket of the last combine this rank rejected]
 *   [control of slot 0][control of slot 1]        zeroed at creation
 *       data[R]   u32  source s stores q + 1 once its rows of dispatch q are in this slot
 *       comb[R]   u32  expert rank r stores c (| EPK_LL_ZC for zero copy) once its rows of
 *                      combine c are readable: pushed into our area, or in its combine input
 *       zdone[R]  u32  source s stores c once it has read our combine input for combine c
 *       count[L], range[L][R]                     the public view
 *       src[L][RT], route[L][RT]                  written by the senders with each row:
 *                                                 token, and source rank * 256 + slot k
 *   [data of slot 0][data of slot 1]
 *       slab [L][RT][2H bytes]   rows (bf16, or e4m3 [L][RT][H] then the scales)
 *       cin  [L][RT][H] bf16     combine input: the zero-copy area (ep_ll_get_combine_buffer)
 *       area [T][K][H] bf16      rows pushed back to this rank by a combine, by (token, k)
 *
 * Private device state (not exported): counters (dispatch calls q, combine tickets c, the gate
 * word), then per slot the call's facts, the slot of every peer for that call, and for each of
 * this rank's (token, k) its row at the destination, its expert id, the combine weight and
 * whether the combine reduces it. Counters live on the device so that graph replays count.
 *
 * Dispatch call q (every rank numbers its calls alike, rejected ones included):
 *   send kernel, block 0 (the gate): validate the ids (range, duplicates) and number this rank's
 *     selections per expert in token order; wait until every rank entered call q-1 (only then
 *     is the record of q-2, same parity, read by nobody); post the record of q (status, slot,
 *     topk, format, N, selections per expert; seq = q + 1, release); wait for every rank's record
 *     of q (acquire) and reach the verdict every rank reaches (rejected, disagreement); compute
 *     each row's place (the lower ranks' selections of its expert + its number) and this rank's
 *     receive layout; publish the verdict to the other blocks (gate word) and to a waiting host.
 *   every block: one warp per (token, k) writes the row (bf16, or the sender's fp8 cast) with its
 *     token and route straight into the destination's slab; the last block out raises data[me]
 *     = q + 1 in every destination's slot (system fence, release).
 *   receive (a one-block recv_only launch of the send kernel, or the last block of a one-phase
 *     send): wait for data[*] == q + 1, and, when the slot's previous combine was zero copy, for
 *     zdone[*] >= its ticket.
 * Combine with ticket c: the expert rank pushes every received row into its source's area at
 *   (token, k), or (zero copy: y is its combine input) moves nothing; the last block raises
 *   comb[me] = c (| EPK_LL_ZC) in every source's slot, or, when its topk_idx differs from the
 *   dispatch's, stores creject = c instead. The source's receive waits for comb[*] (a creject
 *   >= c without the flag: that rank rejected), reduces in k order with one fmaf per step
 *   (pushed rows from its area, zero-copy rows from the expert's combine input) and stores
 *   zdone = c into every expert's slot. Flags carry sequence numbers and are never reset.
 */
#ifndef EP_CUDA_LL_KERNELS_H
#define EP_CUDA_LL_KERNELS_H

#include "cuda/kernels/ep_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { EPK_LL_ENTERED = 1, EPK_LL_REJECTED = 2 };
/* Format bits of a dispatch (every rank must agree on all of them). */
enum { EPK_LL_FP8 = 1, EPK_LL_ROUND = 2, EPK_LL_UE8M0 = 4, EPK_LL_COLS = 8 };
#define EPK_LL_ZC 0x80000000u /* comb flag: the rows are in the expert's combine input */
#define EPK_LL_SLOTS 2

/* A rank's record of one dispatch call, in its own pool; followed by int32 sel[E]. */
typedef struct {
  uint32_t seq; /* q + 1 once the record of call q is complete (stored last, release) */
  int32_t status, slot, topk, fmt, num_tokens;
  int32_t pad[2];
} epk_ll_entry_t;

/* Private counters (device memory of this rank). */
typedef struct {
  uint32_t q;      /* dispatch calls finished (the last block of a call's kernel adds one) */
  uint32_t c;      /* combine calls finished, likewise: the next ticket is c + 1 */
  uint32_t gate;   /* q of the last call whose gate block 0 finished */
  int32_t gate_ok; /* its verdict: 1 the rows go */
  int32_t comb_ok; /* the current combine's check (block 0 -> the last block) */
  uint32_t done_send, done_comb, done_recv; /* blocks finished in the current kernel */
  int32_t pad[8];
} epk_ll_priv_t;

/* Private state of one result slot. */
typedef struct {
  uint32_t q;  /* dispatch call that filled the slot */
  uint32_t zc; /* ticket of the slot's last combine when it was zero copy, else 0: the next
                  dispatch into the slot waits for every source to have read it */
  uint32_t c;  /* ticket of the slot's combine as a source (its receive waits for it); 0 when
                  this rank rejected it */
  int32_t n, topk, fmt;
  int32_t pad[2];
} epk_ll_slot_t;

typedef struct {
  int32_t T, H, E, K, R, L, RT, NS;
  uint64_t off;              /* region start in the pool */
  uint64_t entry_bytes;      /* one entry record with its sel[E] */
  uint64_t creject;          /* from off */
  uint64_t ctrl, ctrl_bytes; /* control of slot i at off + ctrl + i * ctrl_bytes */
  uint64_t c_data, c_comb, c_zdone, c_count, c_range, c_src, c_route;
  uint64_t data, data_bytes; /* data of slot i at off + data + i * data_bytes */
  uint64_t d_slab, d_cin, d_area;
  uint64_t zero_bytes; /* [off, off + zero_bytes) is zeroed at creation */
  uint64_t total;
  /* private device memory */
  uint64_t p_slot, p_slot_bytes; /* slot i's state at p_slot + i * p_slot_bytes */
  uint64_t ps_peer, ps_rowpos, ps_idx, ps_w, ps_use;
  uint64_t ps_prefix;           /* [L + 1] exclusive prefix of this slot's count[] (combine push) */
  uint64_t ps_rec;              /* [T][K] int4 per (token, k) of a combine: expert rank (-1: not
                                   reduced), row at the expert (l * RT + row), weight bits */
  uint64_t p_stage, p_stage_sc; /* fp8 cast once per token: [T][H] e4m3, [T][NS] u32 scales */
  uint64_t p_ready;             /* [T] u32: the dispatch call whose cast of token t is staged */
  uint64_t p_trace;             /* epk_ll_trace_t */
  uint64_t p_total;
} epk_ll_layout_t;

/* Variants of the kernels (EP_CUDA_LL_OPT, a bit mask; all on by default), so that one GPU run
 * times them side by side. Every variant gives the same bits. */
enum {
  EPK_LL_OPT_GATE = 1,    /* the gate numbers the rows with every thread of its block (warp ballots
                             per expert) instead of warp 0 alone, ids checked in the same pass */
  EPK_LL_OPT_PRECAST = 2, /* fp8: the other blocks cast each token once while block 0 runs the
                             gate; the rows are then copied from that stage (not cast per (t, k)) */
  EPK_LL_OPT_CMETA = 4,   /* combine: the push reads a prefix of the counts written by the gate
                             (not a serial sum in every block); the receive reads one 16-byte
                             record per (t, k) prepared by the send's check */
  EPK_LL_OPT_FLAGS = 8,   /* flags to the R ranks raised by R threads at once, not one by one */
  EPK_LL_OPT_FUSE = 16,   /* a one-phase combine is one kernel (send, then receive) instead of
                             two launches */
  EPK_LL_OPT_ALL = 31
};

/* EP_CUDA_LL_TRACE=1: %globaltimer at the phase boundaries of every low-latency kernel, summed
 * per kind of kernel; the means are printed when the buffer is destroyed (cuda_ll.c). */
enum {
  EPK_LL_TR_D16,
  EPK_LL_TR_D16_SEND,
  EPK_LL_TR_D8,
  EPK_LL_TR_D8_SEND,
  EPK_LL_TR_DRECV,
  EPK_LL_TR_CPUSH,
  EPK_LL_TR_CZC,
  EPK_LL_TR_CRECV,
  EPK_LL_TR_C1,
  /* The same kinds of combine when y lay in the buffer (the dispatch view, or zero copy), apart
   * from those of y in caller memory, so that a trace tells the two paths' waits apart. */
  EPK_LL_TR_CRECV_BUF,
  EPK_LL_TR_C1_VIEW,
  EPK_LL_TR_C1_ZC,
  EPK_LL_TR_KINDS
};
#define EPK_LL_TR_POINTS 8
typedef struct {
  unsigned long long at[EPK_LL_TR_POINTS]; /* the current kernel's points (0: first block start,
                                              a min; others: set once or a max over blocks) */
  unsigned long long sum[EPK_LL_TR_KINDS][EPK_LL_TR_POINTS]; /* sum of at[i] - at[i - 1]; [0]:
                                              of at[last] - at[0] */
  unsigned long long n[EPK_LL_TR_KINDS];
} epk_ll_trace_t;

EPK_HD uint64_t epk_ll_al(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

/* One function lays out the region for the size hint, the pool and every access. */
EPK_HD void epk_ll_layout(int T, int H, int E, int K, int R, epk_ll_layout_t *l) {
  const uint64_t L = (uint64_t)(E / R), RT = (uint64_t)R * (uint64_t)T, r = (uint64_t)R;
  const uint64_t TK = (uint64_t)T * (uint64_t)K;
  uint64_t o = 0;
  l->T = T, l->H = H, l->E = E, l->K = K, l->R = R, l->L = (int32_t)L, l->RT = (int32_t)RT;
  l->NS = H / 128;
  l->off = 0;
  l->entry_bytes = epk_ll_al(sizeof(epk_ll_entry_t) + 4 * (uint64_t)E, 128);
  l->creject = 2 * l->entry_bytes;
  l->ctrl = epk_ll_al(l->creject + 128, 256);
  l->c_data = o, o += epk_ll_al(4 * r, 128);
  l->c_comb = o, o += epk_ll_al(4 * r, 128);
  l->c_zdone = o, o += epk_ll_al(4 * r, 128);
  l->c_count = o, o += epk_ll_al(4 * L, 128);
  l->c_range = o, o += epk_ll_al(8 * L * r, 128);
  l->c_src = o, o += epk_ll_al(4 * L * RT, 128);
  l->c_route = o, o += epk_ll_al(4 * L * RT, 128);
  l->ctrl_bytes = epk_ll_al(o, 256);
  l->zero_bytes = l->ctrl + EPK_LL_SLOTS * l->ctrl_bytes;
  l->data = epk_ll_al(l->zero_bytes, 4096);
  o = 0;
  l->d_slab = o, o += epk_ll_al(L * RT * 2 * (uint64_t)H, 4096);
  l->d_cin = o, o += epk_ll_al(L * RT * 2 * (uint64_t)H, 4096);
  l->d_area = o, o += epk_ll_al(TK * 2 * (uint64_t)H, 4096);
  l->data_bytes = o;
  l->total = l->data + EPK_LL_SLOTS * l->data_bytes;
  o = epk_ll_al(sizeof(epk_ll_priv_t), 256);
  l->p_slot = o;
  uint64_t so = epk_ll_al(sizeof(epk_ll_slot_t), 64);
  l->ps_peer = so, so += epk_ll_al(4 * r, 64);
  l->ps_rowpos = so, so += epk_ll_al(4 * TK, 64);
  l->ps_idx = so, so += epk_ll_al(8 * TK, 64);
  l->ps_w = so, so += epk_ll_al(4 * TK, 64);
  l->ps_use = so, so += epk_ll_al(TK, 64);
  l->ps_prefix = so, so += epk_ll_al(4 * (L + 1), 64);
  l->ps_rec = so, so += epk_ll_al(16 * TK, 64);
  l->p_slot_bytes = epk_ll_al(so, 256);
  o = l->p_slot + EPK_LL_SLOTS * l->p_slot_bytes;
  l->p_stage = o, o += epk_ll_al((uint64_t)T * (uint64_t)H, 256);
  l->p_stage_sc = o, o += epk_ll_al((uint64_t)T * 4 * (uint64_t)(H / 128), 256);
  l->p_ready = o, o += epk_ll_al(4 * (uint64_t)T, 256);
  l->p_trace = o, o += epk_ll_al(sizeof(epk_ll_trace_t), 256);
  l->p_total = o;
}

/* What every low-latency kernel knows about its buffer; constant from create to destroy. */
typedef struct {
  epk_ll_layout_t lay;
  uint8_t *priv; /* private device memory: epk_ll_priv_t, then the slots' states */
  int blocks;    /* blocks of the data kernels (the buffer's, see epk_buf_t) */
  int smem;      /* dynamic shared memory of the dispatch send kernel */
  int opt;       /* EPK_LL_OPT_* */
  int trace;     /* EP_CUDA_LL_TRACE */
} epk_ll_t;

typedef struct {
  const void *x;           /* bf16 [n][H] */
  const int64_t *topk_idx; /* [n][topk] */
  int n, topk, fmt, slot;
  int recv_too;    /* one phase: the last block also waits for this rank's rows */
  int recv_only;   /* the receive phase alone (set by epk_ll_launch_dispatch_recv) */
  uint32_t ticket; /* != 0: publish the gate's verdict to the waiting host */
} epk_ll_dispatch_t;

typedef struct {
  const void *y;             /* bf16 [L][RT][H] */
  const int64_t *topk_idx;   /* [n][topk] of the combine */
  const float *topk_weights; /* [n][topk] */
  void *out;                 /* bf16 [n][H] (receive) */
  int n, topk, slot, zero_copy;
  uint32_t ticket;  /* != 0: publish the verdict (check / flags) to the host */
  uint32_t rticket; /* recv_too: the receive's ticket (the flags' verdict) */
  int recv_too;     /* the send kernel also receives (one phase, EPK_LL_OPT_FUSE) */
  int recv_only;    /* the receive phase alone (set by epk_ll_launch_combine_recv) */
  int ybuf;         /* y lies in this buffer (a view, or zero copy): the trace's kinds only */
} epk_ll_combine_t;

/* Once per buffer: kernel attributes (dynamic shared memory beyond the default). */
cudaError_t epk_ll_setup(const epk_ll_t *ll);
/* Send phase of a dispatch (with recv_too: both phases). */
cudaError_t epk_ll_launch_dispatch(const epk_buf_t *b, const epk_ll_t *ll,
                                   const epk_ll_dispatch_t *a, cudaStream_t s);
/* Receive phase of the dispatch in `slot`. */
cudaError_t epk_ll_launch_dispatch_recv(const epk_buf_t *b, const epk_ll_t *ll, int slot,
                                        cudaStream_t s);
/* Send phase of a combine (push, check, flags). */
cudaError_t epk_ll_launch_combine(const epk_buf_t *b, const epk_ll_t *ll, const epk_ll_combine_t *a,
                                  cudaStream_t s);
/* Receive phase of the combine of `slot` into a->out (a->n tokens, a->topk, a->ticket). */
cudaError_t epk_ll_launch_combine_recv(const epk_buf_t *b, const epk_ll_t *ll,
                                       const epk_ll_combine_t *a, cudaStream_t s);
/* This rank rejected its next dispatch (combine = 0) or combine (1): it takes the call's number
 * and tells the peers, whose matching call then fails at once. */
cudaError_t epk_ll_launch_reject(const epk_buf_t *b, const epk_ll_t *ll, int combine,
                                 cudaStream_t s);
/* A handle whose combine was not received goes: its slot tells every expert rank that it will
 * not read their combine input (zdone), so that their next dispatch into that slot need not
 * wait for it. */
cudaError_t epk_ll_launch_release(const epk_buf_t *b, const epk_ll_t *ll, int slot, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
