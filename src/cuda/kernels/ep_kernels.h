/*
 * The interface between the CUDA backend's host side (C) and its kernels (CUDA C): the layout of
 * the registered pool, the argument structs, and the extern "C" launchers. Plain C, included by
 * both; nothing here allocates.
 *
 * Pool of one rank (one cudaMalloc, exported with cudaIpcGetMemHandle, mapped by every peer):
 *
 *   [hello: 2 x R slots][arrive R][consumed R][staged R][cdone R][ctab R][area D][area C]
 *
 * - hello[p][s]: written by source s for a call whose sequence number has parity p (its counts
 *   and what the call is). A rank can be at most one call ahead of another, so two slots do.
 * - arrive[s]: blocks of source s that finished writing a dispatch window into area D.
 * - consumed[d]: dispatch windows receiver d has copied out (written by d into the sender's pool).
 * - staged[r], cdone[s], ctab[s]: combine rounds (rows ready on r / source s done reading);
 *   ctab[s] is 4 int64: where source s finds its x rows (byte offset), its weights (byte offset
 *   in the pool), and what the x offset is relative to (-1: the pool, else the slot of one of
 *   the holder's registrations of caller memory).
 * - area D: dispatch receive area; senders write every row at its final row index (views).
 *   A receiver whose recv_x (EP_OUTPUT_CALLER) lies in one of its registrations says so in its
 *   hello (slot, offset, rows); senders then write x rows straight there, the rest still here.
 *   When every rank copies out into unregistered arrays and everything fits at once (the
 *   hellos' `pull`), each source instead stages its own x rows once in its own area D (row t =
 *   token t) and the receivers read them from there: the metadata still goes to the receivers.
 * - area C: combine staging, used when a rank's combine input is not already in area D.
 * All counters go back to zero at the end of each call, by their owner, once every peer has
 * finished writing them for that call.
 *
 * Kernel names: epcomm::normal::{notify,layout,dispatch,combine} and epcomm::ll::{dispatch,
 * combine}, one kernel per call kind, as DeepEP names its own (deep_ep::intranode::dispatch).
 * Profilers show these names, and harnesses find a call's kernel by "::dispatch" or "::combine"
 * (DeepEP's bench_kineto counts one kernel per phase, the receive hook's launch being the same
 * kernel's second phase); no other kernel's name or signature contains those words.
 */
#ifndef EP_CUDA_KERNELS_H
#define EP_CUDA_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/call_key.h"
#include "epcomm.h" /* the status codes of the error word */

#ifdef __CUDACC__
#define EPK_HD __host__ __device__ __forceinline__
#else
#define EPK_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum {
  EPK_NOTIFY_DISPATCH = 1,
  EPK_NOTIFY_CACHED = 2,
  EPK_NOTIFY_COMBINE = 3,
  EPK_NOTIFY_REJECT = 4
};
enum { EPK_HELLO_OK = 0, EPK_HELLO_REJECTED = 1 };
enum { EPK_MODE_COPY = 0, EPK_MODE_VIEW = 1, EPK_MODE_DRAIN = 2 };
enum { EPK_LATE_NONE = 0, EPK_LATE_PROMISED = 1, EPK_LATE_POSTED = 2 };
/* Phases named in the error word (cuda_sync.c turns them into words). */
enum {
  EPK_PH_NONE = 0,
  EPK_PH_NOTIFY = 1,    /* waiting for a peer's hello */
  EPK_PH_ARRIVE = 2,    /* dispatch: waiting for a peer's rows */
  EPK_PH_WINDOW = 3,    /* dispatch: waiting for a peer to free its receive window */
  EPK_PH_STAGED = 4,    /* combine: waiting for a peer's rows to be readable */
  EPK_PH_CDONE = 5,     /* combine: waiting for a peer to finish reading our rows */
  EPK_PH_CHECK = 6,     /* argument checks inside a kernel */
  EPK_PH_LL_ENTER = 7,  /* low latency: waiting for a peer's entry into the previous dispatch */
  EPK_PH_LL_GATE = 8,   /* low latency: waiting for a peer's entry into this dispatch */
  EPK_PH_LL_DATA = 9,   /* low latency: waiting for a peer's rows of this dispatch */
  EPK_PH_LL_COMB = 10,  /* low latency: waiting for a peer's rows of this combine */
  EPK_PH_LL_ZDONE = 11, /* low latency: waiting for a peer to finish reading our zero-copy
                           combine input */
  EPK_PH_LL_CHECK = 12, /* low latency: the combine's topk_idx against the dispatch's */
  EPK_PH_LATE = 13,     /* dispatch: waiting for a peer's late hello (where its outputs are) */
};

/* Error word: status code (8 bits) | phase (8) | peer + 1 (16, 0 = none) | detail (32). */
EPK_HD uint64_t epk_err_pack(uint32_t code, uint32_t phase, int peer, uint32_t detail) {
  return ((uint64_t)code << 56) | ((uint64_t)(phase & 0xff) << 48) |
         ((uint64_t)(uint16_t)(peer + 1) << 32) | detail;
}

/* Failures that move no data and leave the buffer usable: every rank saw them alike (a rejected
 * argument, a disagreement, outputs too small). The others (a deadline, a dead peer) break it. */
EPK_HD bool epk_code_no_data(uint32_t code) {
  return code == EP_ERR_PEER_INVALID || code == EP_ERR_MISMATCH || code == EP_ERR_OUT_OF_RANGE ||
         code == EP_ERR_TOO_LARGE || code == EP_ERR_INVALID_ARG;
}

/* What a source rank tells every destination at the start of a call. */
typedef struct {
  uint32_t seq;      /* the call's sequence number; stored last, with release semantics */
  ep_call_key_t key; /* what the call is; compared field by field (detail of a mismatch) */
  int32_t num_tokens, direct, recv_rows;
  int32_t wgap256; /* combine: bytes of area C before its staged weights / 256 (x in area C) */
  int32_t xreg1;   /* dispatch: 1 + the slot of the writer's registration of caller memory that
                      holds its recv_x for xcap rows (senders write x rows there); 0: none.
                      combine, x read in place (direct): 1 + the registration holding x, 0: x
                      is in the writer's pool; xoff: x's byte offset there */
  int32_t xcap;    /* dispatch: rows of that recv_x (more arriving: drained, not written) */
  uint32_t late;   /* dispatch: EPK_LATE_*. An allocator's outputs exist only once the count
                      is known, after this hello: the writer's data kernel posts xreg1, xcap
                      and xoff again (its late hello), then late = POSTED; senders wait */
  int32_t pull;    /* dispatch: 1 if the writer may stage its x rows in its own area D and pull
                      its received rows from the peers' (its outputs are unregistered caller
                      arrays, its tokens fit area D); the call pulls only if every rank may */
  int64_t xoff;    /* dispatch: byte offset of recv_x in that registration */
  /* then int32 to_rank[R] (tokens this source sends to each rank) and
   *      int32 experts[E/R] (its selections of the slot owner's local experts) */
} epk_hello_t;

/* Private per-buffer device state (not exported). */
typedef struct {
  uint32_t seq;                /* calls made on this buffer (device side, so graph replays count) */
  uint32_t call_status;        /* 0, or why the current call stopped (every block checks it) */
  unsigned long long err;      /* the failure to report, packed (the first, or a breaking one that
                                  replaced a no-data one: epk_err_claim); mirrored to the host word */
  unsigned long long call_err; /* the current call's own first failure that stopped it (cleared
                                  with call_status): a synchronous call reports it even when an
                                  earlier call's failure holds `err` */
  uint32_t wdone, finished, cnt_a, cnt_b; /* block counters of the current call */
  int32_t comb_k, comb_tc;                /* combine rounds and tokens per round (from notify) */
  int32_t comb_hello; /* 1: every holder's x is read in place and nothing is staged: the
                         combine finds the rows from the hellos (xreg1, xoff), no "staged" round */
  int32_t pad;
  unsigned long long pulled; /* dispatches that pulled their rows; copied to the host's (a plain
                                store: a read-modify-write of host memory would stall the
                                kernel). 64 bits: 2^32 calls are days of a training job */
} epk_priv_t;

/* What a low-latency kernel tells a host that waits for it (a call outside a graph capture):
 * written in full, then `ticket` (the host's number for that wait) with a system fence. */
typedef struct {
  uint32_t ticket;
  int32_t status;       /* EP_OK, or why the call fails on this rank */
  int32_t peer;         /* the rank named, -1: none */
  int32_t nrecv;        /* dispatch: rows this rank receives */
  int32_t item, dup_k;  /* a bad topk_idx entry (t * topk + k) and, for a duplicate, the k of
                           its first occurrence */
  int32_t mine, theirs; /* a mismatch: rank 0's value and the peer's (field: 0 topk, 1 format) */
  int32_t field;
  int32_t topk;        /* a deferred report (ll_defer): its call's topk, which decodes item */
  int64_t value, want; /* the bad expert id; combine: the dispatch's id at that entry */
} epk_ll_report_t;

/* Page-locked host memory mapped into the device: what the host waits on. */
typedef struct {
  unsigned long long err; /* copy of the device word (common.cuh epk_err_post) */
  uint32_t ticket;        /* sequence number of the synchronous call whose count is in: from notify
                             (allocator path) or the dispatch kernel's start (every other path) */
  int32_t nr;             /* rows this rank receives; the host sets -1 before a synchronous call,
                             and -1 stays when its count exchange failed (whose error is it) */
  unsigned long long call_err; /* with the ticket: the call's own failure (priv call_err), 0 if
                                  none; the host sets 0 before a synchronous call */
  int64_t bad_value;           /* notify/layout: the offending expert id */
  int32_t layout_bad;          /* layout: first bad slot + 1, 0 if none */
  uint32_t abort;              /* written by the host: every kernel stops waiting */
  unsigned long long pulled;   /* dispatches that pulled their rows (epk_priv_t.pulled) */
  int32_t pad[6];
  epk_ll_report_t ll_send; /* low-latency send kernels: the gate's or the combine check's verdict */
  epk_ll_report_t ll_recv; /* low-latency combine receive: the peers' flags */
  epk_ll_report_t ll_defer; /* the verdict behind a deferred low-latency failure (err) */
} epk_host_t;

/* EP_CUDA_TRACE=1: %globaltimer at the phase boundaries of every normal-mode call, summed per
 * kind of call on the device, and each phase of the last EPK_TR_RING calls of a kind kept; the
 * means and the medians are printed when the buffer is destroyed (medians: a few slow calls, for
 * instance the first after a host-side pause of one rank, move a mean far). Points: the
 * notify kernel's start, plan done, hello posted, every peer's hello seen, end; the data
 * kernel's first and last block start, its own part done in the first block and in every block
 * (a dispatch: this rank's rows written; a combine: its tokens reduced), the peers' part (a
 * dispatch: every source's rows arrived; a combine: every source done reading this rank's rows),
 * and its last block's end (each point the latest block's, except the first start and the first
 * own part done; a point reached before the one it follows, as a dispatch whose own sends end
 * after its last arrival, folds to zero and its time into the next). A
 * call's points are folded into the sums by the next call's notify (or by the host at
 * destroy). Apart from the phases, each call's idle time before it: from the previous call's data
 * kernel end to this call's notify start (0 for a buffer's first call). It holds the kernel
 * boundary and the launch, a host that is behind, and whatever the stream ran between the calls
 * (the caller's kernels: an experts' write before a combine, a layout kernel); event-timed
 * figures hold the part after their start event, the phases none of it. */
/* Dispatch kinds split by outputs (views / arrays): their data kernels differ, and pooled they
 * made a median that matched neither. */
enum {
  EPK_TR_FULL,
  EPK_TR_CACHED,
  EPK_TR_COMBINE,
  EPK_TR_FULL_ARR,
  EPK_TR_CACHED_ARR,
  EPK_TR_FULL_NOWAIT, /* views, the host not waiting for the count (worst case) */
  EPK_TR_KINDS
};
enum {
  EPK_TR_N_START,
  EPK_TR_N_PLAN,
  EPK_TR_N_POST,
  EPK_TR_N_GATHER,
  EPK_TR_N_END,
  EPK_TR_D_START,
  EPK_TR_D_START_LAST, /* the last block's start (the spread of the blocks' starts) */
  EPK_TR_D_OWN_FIRST,  /* the first send pass done in any block (the first window's; a block
                          without tokens, at small sizes, ends its pass at once) */
  EPK_TR_D_OWN,
  EPK_TR_D_PEERS,
  EPK_TR_D_END,
  EPK_TR_POINTS
};
#define EPK_TR_RING 256
typedef struct {
  unsigned long long at[EPK_TR_POINTS]; /* the current call's points (0: not reached) */
  int32_t kind, pad;                    /* its kind, -1: none */
  unsigned long long sum[EPK_TR_KINDS][EPK_TR_POINTS]; /* [i]: at[i] - at[i - 1]; [0]: total */
  unsigned long long n[EPK_TR_KINDS];
  uint32_t ring[EPK_TR_KINDS][EPK_TR_RING][EPK_TR_POINTS]; /* call n % RING's phases, ns */
  unsigned long long last_end; /* the folded calls' last data kernel end (0: none yet) */
  uint32_t idle_ring[EPK_TR_KINDS][EPK_TR_RING]; /* call n % RING's idle time before it, ns */
} epk_trace_t;

/* The fold of one call's points into the sums (device: the next notify; host: at destroy). */
EPK_HD void epk_trace_fold(epk_trace_t *t) {
  if (t->kind >= 0 && t->kind < EPK_TR_KINDS && t->at[EPK_TR_N_START] && t->at[EPK_TR_D_END]) {
    unsigned long long prev = t->at[0];
    uint32_t *keep = t->ring[t->kind][t->n[t->kind] % EPK_TR_RING];
    for (int i = 1; i < EPK_TR_POINTS; i++) {
      unsigned long long v = t->at[i] && t->at[i] != ~0ull ? t->at[i] : prev;
      v = v < prev ? prev : v;
      t->sum[t->kind][i] += v - prev;
      keep[i] = (uint32_t)(v - prev < 0xffffffffull ? v - prev : 0xffffffffull);
      prev = v;
    }
    t->sum[t->kind][0] += prev - t->at[0];
    keep[0] = (uint32_t)(prev - t->at[0] < 0xffffffffull ? prev - t->at[0] : 0xffffffffull);
    const unsigned long long start = t->at[0], end = t->last_end,
                             idle = end && start > end ? start - end : 0;
    t->idle_ring[t->kind][t->n[t->kind] % EPK_TR_RING] =
        (uint32_t)(idle < 0xffffffffull ? idle : 0xffffffffull);
    t->n[t->kind]++;
  }
  if (t->at[EPK_TR_D_END]) t->last_end = t->at[EPK_TR_D_END];
  for (int i = 0; i < EPK_TR_POINTS; i++) t->at[i] = 0;
  t->at[EPK_TR_D_START] = t->at[EPK_TR_D_OWN_FIRST] = ~0ull; /* minima */
  t->kind = -1;
}

#define EPK_MAX_REGS 64 /* = EP_MAX_MEM_REGS (backend.h), checked in cuda_reg.c */

/* The full dispatch's plan is spread over the blocks of its notify launch: token tiles taken in
 * order from a counter, each tile's rows per destination published for the tiles after it (a
 * tile waits only for tiles taken before it, by blocks already running: no co-residency
 * needed). The launch has a block more than tiles: the block that first finds no tile left
 * waits for every tile's counts and goes on with the exchange. Private memory, zero between
 * calls (the last block to finish resets what the call used). */
#define EPK_PLAN_TILES 128 /* tiles of one plan at most */
#ifndef EPK_PLAN_GRID
#define EPK_PLAN_GRID 64 /* blocks of one notify launch at most */
#endif
#ifndef EPK_NOTIFY_NT     /* tools/kernel_variants.sh times others (nvcc -D; 64..1024) */
#define EPK_NOTIFY_NT 256 /* threads of a notify block = tokens of one pass over a tile */
#endif
typedef struct {
  uint32_t next_tile, done; /* tiles taken, blocks finished */
  unsigned long long bad;   /* ~0 - the first bad slot of topk_idx (atomicMax); 0: none */
  uint32_t stuck, pad;      /* 1: a tile gave up waiting for the tiles before it */
  /* (seq << 32) | rows of the tile's tokens to destination d (R <= 32): this call's count once
   * the high half is this call's seq, so a reader waits on the count itself (one load, not a flag
   * then the count) */
  unsigned long long agg[EPK_PLAN_TILES][32];
} epk_plan_scr_t;

/* Tokens per tile (whole passes) and tiles of an n-token plan; the same on host and device. */
EPK_HD int epk_plan_tile_tokens(int n) {
  int passes = (n + EPK_NOTIFY_NT - 1) / EPK_NOTIFY_NT;
  int per = (passes + EPK_PLAN_TILES - 1) / EPK_PLAN_TILES;
  return (per > 1 ? per : 1) * EPK_NOTIFY_NT;
}
EPK_HD int epk_plan_tiles(int n) {
  int tt = epk_plan_tile_tokens(n);
  return n > 0 ? (n + tt - 1) / tt : 1;
}

/* What every kernel knows about its buffer; constant from create to destroy. The normal-mode and
 * low-latency kernels take it as `const __grid_constant__` (layout's and the error-clearing one
 * have no stack frame either way): the error paths (epk_fail, epk_err_post: not inlined) take
 * it by reference, and without the qualifier every thread copied its 192 bytes from the
 * parameter bank to local memory at each launch and read its fields back from there (ptxas: a
 * 192-byte stack frame in each of those kernels; with it none, and the spills of combine and
 * notify went too). On an H100 under MPS at R = 8 and 4096 tokens that made the bf16 dispatch
 * 16% faster and the combine 9% (docs/PERFORMANCE.md, twenty-seventh session). EPK_GRID_CONST=0
 * builds the old form, for tools/kernel_variants.sh. */
#ifndef EPK_GRID_CONST
#define EPK_GRID_CONST 1
#endif
#if EPK_GRID_CONST
#define EPK_BUF_ARG const __grid_constant__ epk_buf_t
#else
#define EPK_BUF_ARG epk_buf_t
#endif
typedef struct {
  int rank, nranks, blocks;
  int one_gpu; /* every rank on this GPU (under MPS): normal-mode flags and fences between ranks
                  at .gpu scope, else .sys (common.cuh, epk_fence_peers) */
  uint8_t *const *peers;      /* device array [R]: each rank's pool as mapped here */
  const int32_t *peer_blocks; /* device array [R]: blocks of each rank's main kernels */
  epk_priv_t *priv;
  epk_host_t *host;     /* device address of the mapped host block */
  int32_t *ecount;      /* across hosts: selections per expert, [EP_MAX_LOCAL_EXPERTS * R] */
  epk_plan_scr_t *pscr; /* the notify plan's tiles (above) */
  int32_t *pec;         /* notify: selections per expert [E] of the current call, zero between */
  uint64_t timeout_ns;
  uint64_t slot_bytes, off_hello, off_arrive, off_consumed, off_staged, off_cdone, off_ctab;
  uint64_t off_area_d, off_area_c, area_bytes, pool_bytes;
  epk_trace_t *trace;        /* EP_CUDA_TRACE, else NULL */
  uint8_t *const *regs;      /* device array [EPK_MAX_REGS][R]: registration `slot` of rank r, as
                                mapped here, at [slot * R + r] (NULL: none) */
  const uint64_t *reg_bytes; /* [EPK_MAX_REGS][R]: its size in bytes (0: none), for the bounds
                                check of the offsets peers publish in ctab */
} epk_buf_t;

EPK_HD uint64_t epk_al(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

/* Plan of one dispatch (in the handle's device memory, int32): header, counts of every source
 * to every destination, tokens of every rank, and for each of this rank's tokens its row among
 * the rows it sends to each destination (-1: not sent). */
enum { EPK_PLAN_NR = 0, EPK_PLAN_HDR = 4 };
EPK_HD int32_t *epk_plan_cnt(int32_t *p) {
  return p + EPK_PLAN_HDR;
}
EPK_HD int32_t *epk_plan_ntok(int32_t *p, int R) {
  return p + EPK_PLAN_HDR + R * R;
}
EPK_HD int32_t *epk_plan_pos(int32_t *p, int R) {
  return p + epk_al((uint64_t)(EPK_PLAN_HDR + R * R + R), 4);
}
EPK_HD size_t epk_plan_bytes(int R, int N) {
  return 4 * (epk_al((uint64_t)(EPK_PLAN_HDR + R * R + R), 4) + (uint64_t)N * (uint64_t)R);
}

/* Arrays of area D for one call; identical on every rank (same call, same pool size). */
typedef struct {
  int64_t rows;                                 /* W: rows one window holds */
  uint64_t off_x, off_s, off_i, off_w, off_src; /* byte offsets inside area D */
} epk_recv_layout_t;

EPK_HD epk_recv_layout_t epk_recv_layout(uint64_t area, uint64_t row, int ns, int topk_sent,
                                         int w_sent) {
  epk_recv_layout_t l;
  uint64_t per = row + 4ull * (uint64_t)ns + 8ull * (uint64_t)topk_sent +
                 4ull * (uint64_t)(w_sent ? topk_sent : 0) + 4ull;
  uint64_t W = area > 5 * 256 ? (area - 5 * 256) / per : 0;
  l.rows = (int64_t)W;
  l.off_x = 0;
  l.off_s = epk_al(W * row, 256);
  l.off_i = l.off_s + epk_al(W * 4ull * (uint64_t)ns, 256);
  l.off_w = l.off_i + epk_al(W * 8ull * (uint64_t)topk_sent, 256);
  l.off_src = l.off_w + epk_al(W * 4ull * (uint64_t)(w_sent ? topk_sent : 0), 256);
  return l;
}

/* Rows of combine input one rank can stage in area C: x rows (unless the input already lies in
 * area D) and weight rows. 0 bytes per row: unlimited. */
EPK_HD int64_t epk_stage_rows(uint64_t area, uint64_t xrow, uint64_t wrow) {
  if (xrow + wrow == 0) return INT64_MAX;
  return area > 2 * 256 ? (int64_t)((area - 2 * 256) / (xrow + wrow)) : 0;
}

typedef struct {
  const int64_t *topk_idx;
  int num_tokens, topk, num_experts, nhosts;
  int32_t *per_rank, *per_expert;
  uint8_t *in_rank;
  const int32_t *host_of; /* [R] device, or NULL: every rank on host 0 */
  int32_t *per_host;      /* [nhosts] or NULL */
  uint8_t *in_host;       /* [num_tokens][nhosts] or NULL */
  int report;             /* a bad id goes to the host words (the host waits for them) */
} epk_layout_t;

typedef struct {
  ep_call_key_t key; /* the core's description of the call, posted as it is */
  int kind;          /* EPK_NOTIFY_*: what the kernel does */
  int hidden, dtype, topk, num_experts, num_scales, has_w, num_tokens, direct, recv_rows;
  int align, wgap256;      /* COMBINE: x lies in area C, its weights staged after it */
  const int64_t *topk_idx; /* DISPATCH */
  int32_t *plan;           /* DISPATCH writes it; CACHED and COMBINE read it */
  int32_t *rank_prefix, *recv_per_expert; /* optional outputs */
  uint32_t ticket;                        /* != 0: publish the receive count to the host */
  uint32_t out_arrays; /* DISPATCH, CACHED: rows go to arrays, not views (trace kind only) */
  uint32_t no_wait;    /* DISPATCH: the host does not wait for the count (trace kind only) */
  uint64_t xrow, wrow; /* COMBINE: staging bytes per row of this call */
  int64_t xoff;        /* DISPATCH, CACHED: recv_x in a registration (epk_hello_t.xreg1) */
  int32_t xreg1, xcap;
  uint32_t late; /* DISPATCH, CACHED: the data kernel posts a late hello (EPK_LATE_PROMISED) */
  int32_t pull;  /* DISPATCH, CACHED: epk_hello_t.pull */
} epk_notify_t;

typedef struct {
  int cached, num_tokens, num_scales, topk, has_w, local_experts, mode;
  int tail;        /* worst-case path: rows [Nr, cap) get ids -1, weights 0, source -1 */
  int quiet;       /* the host reports Nr > cap itself (synchronous path): just drain */
  uint32_t ticket; /* != 0: publish the receive count to the host (instead of notify, whose
                      grid end would wait for the system fence; the host learns ~1 us later) */
  int64_t cap;     /* rows the outputs hold; more arriving: drained, outputs untouched */
  uint64_t row;    /* bytes of one x row */
  const void *x;
  const float *x_scales;
  int64_t scale_tok, scale_hid;
  const int64_t *topk_idx;
  const float *topk_weights;
  const int32_t *plan;
  int32_t *hsrc; /* handle copy of recv_src_idx (combine rounds use it), or NULL */
  int64_t hsrc_cap;
  /* outputs: caller memory (COPY), area D (VIEW), or NULL (DRAIN / not wanted) */
  void *recv_x;
  float *recv_scales, *recv_w;
  int64_t *recv_idx;
  int32_t *recv_src;
  epk_recv_layout_t lay;
  /* late != 0: the hello promised a late one; it says recv_x lies in registration lreg1 - 1 at
   * byte offset loff for lcap rows (lreg1 = 0: not registered, send to area D) */
  int32_t late, lreg1, lcap;
  int32_t early; /* allocator path in two kernels (EPK_EARLY_*), else 0 */
  int64_t loff;
  int32_t stream; /* the rows through L2 evict-first (epk_l2_policy, EP_CUDA_L2_HINT) */
} epk_dispatch_t;

/* The allocator path's two data kernels (EP_CUDA_EARLY_DATA): SEND runs before the outputs exist,
 * while the host waits for the count and allocates; COPY after. When every destination's rows
 * fit its area D at once (every rank decides alike, from the plan), SEND moves them all and COPY
 * only copies this rank's rows out of area D into the outputs; otherwise SEND returns at once on
 * every rank and COPY is the whole exchange. */
enum { EPK_EARLY_NONE = 0, EPK_EARLY_SEND = 1, EPK_EARLY_COPY = 2 };

typedef struct {
  int num_tokens, hidden, topk, has_w, direct, wgap256;
  int64_t x_off, x_rows; /* direct: byte offset of x in this rank's pool; rows of x. x in area C
                            (ep_get_combine_buffer): direct, weights staged wgap256 * 256 bytes
                            into area C */
  const void *x;
  const float *w;
  const void *bias0, *bias1;
  void *out;
  float *out_w;
  const int32_t *plan;
  const int32_t *hsrc;
  int64_t hsrc_cap;
  int x_reg;  /* direct: -1, x_off is in the pool; else x_off is in this rank's registration
                 x_reg of caller memory */
  int stream; /* the rows through L2 evict-first (epk_l2_policy, EP_CUDA_L2_HINT) */
} epk_combine_t;

cudaError_t epk_launch_layout(const epk_buf_t *b, const epk_layout_t *a, cudaStream_t s);
cudaError_t epk_launch_notify(const epk_buf_t *b, const epk_notify_t *a, cudaStream_t s);
cudaError_t epk_launch_dispatch(const epk_buf_t *b, const epk_dispatch_t *a, cudaStream_t s);
cudaError_t epk_launch_combine(const epk_buf_t *b, const epk_combine_t *a, cudaStream_t s);
/* Clears the device error word if it still holds `taken` (error.cu). */
cudaError_t epk_launch_clear_err(const epk_buf_t *b, uint64_t taken, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
