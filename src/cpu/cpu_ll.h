/*
 * Low-latency mode of the CPU backend (SEMANTICS.md §6).
 *
 * Region of every rank's segment (at layout.off_ll; L = E/R local experts, RT = R*T rows each):
 *
 *   [arrive[2]: this rank's entry record of its dispatch calls of parity 0 and 1]
 *   [creject: ticket of the last combine this rank rejected]
 *   [slot 0][slot 1]: one low-latency result each:
 *       data[R]      source s stores q + 1 once its rows of dispatch q are in this slot
 *       comb[R]      expert rank r stores the combine ticket once its rows are back
 *       recv_count[L], layout_range[L][R]            the public view
 *       src_info[L][RT], route[L][RT]                written by the senders with each row
 *       slab [L][RT][2H bytes]                       the rows (bf16, or fp8 + scales)
 *       area [T][K][H] bf16                          combine: rows coming back, by (token, k)
 *       cin [L][RT][H] bf16                          zero-copy combine input (the experts'
 *                                                    outputs, ep_ll_get_combine_buffer)
 *
 * Dispatch call q of rank s (the calls of all ranks are numbered alike):
 *   1. check the arguments; a rejection is posted as the entry record of q (status REJECTED);
 *   2. wait until every rank has entered call q-1: only then is the record of q-2 (same parity)
 *      read by nobody, so this rank may overwrite it. This bounds every rank to at most one
 *      call ahead of any other, rejected calls included;
 *   3. take a free result slot, post the record of q: slot, shape, selections per expert;
 *   4. gate: wait for every rank's record of q. Every rank sees the same records, so a rejection
 *      or a disagreement fails the call on every rank alike, before a byte is written;
 *   5. write each row straight into its receiver's slab at begin + j, where begin is the sum of
 *      the lower ranks' selections of that expert (deterministic order: source rank, then
 *      token); raise data[s] = q + 1 in every receiver's slot and ring its bell;
 *   6. receive (ep_ll_recv, or at once without two_phase): wait for data[*] == q + 1.
 * Flags carry sequence numbers and are never reset, so consecutive calls cannot race on them.
 *
 * Combine with ticket c (combine calls numbered alike on all ranks): expert rank r copies every
 * row it holds back to its source's area, in the slot that source used for the dispatch, at
 * (token, k); raises comb[r] = c + 1 there. It never waits: nobody else writes that area while
 * the handle lives, and the next writer into it is fenced by a dispatch gate. The source waits
 * for comb[*] == c + 1 and reduces. A combine rejected on one rank is posted in its creject.
 */
#ifndef EP_CPU_LL_H
#define EP_CPU_LL_H

#include "cpu.h"

#define CPU_LL_SLOTS 2

/* Offsets of the low-latency region (from its start) and of the parts of one slot (from the
 * slot's start). Identical in every rank's segment. */
typedef struct {
  size_t arrive, arrive_bytes, creject, slots, slot_bytes, total;
  size_t data, comb, count, range, src, route, slab, area, cin;
} cpu_ll_layout_t;

/* A rank's record of one dispatch call, in its own segment; peers read it. */
enum { LL_ENTERED = 1, LL_REJECTED = 2 };
typedef struct {
  _Alignas(CPU_CL) _Atomic uint64_t seq; /* q + 1 once the record of call q is complete */
  int32_t status, slot, topk, fmt, num_tokens, pad;
  /* then int32 sel[E]: this rank's selections of every expert in call q */
} cpu_ll_arrive_t;

/* Life of a result slot (and of the handle that holds it): core/backend.h. */
enum {
  LL_FREE = EP_LLS_FREE,
  LL_SENT = EP_LLS_SENT,
  LL_RECEIVED = EP_LLS_RECEIVED,
  LL_COMB_SENT = EP_LLS_COMB_SENT,
  LL_COMBINED = EP_LLS_COMBINED,
  LL_FAILED = EP_LLS_FAILED
};

/* Process-local state of one slot: what the receive phases and the combine need later. */
typedef struct {
  int index, state;
  uint64_t q;      /* dispatch call that filled it */
  uint64_t ticket; /* combine ticket (c + 1) of the pending combine receive */
  int N, topk, fp8, round_scale, ue8m0, scale_layout;
  int32_t *src_slot;   /* [R] slot of every source rank for call q (combine writes there) */
  int64_t *idx;        /* [T][K] topk_idx of the dispatch (to check the combine's) */
  float *w;            /* [T][K] combine weights, 0 where the combine's id is -1 */
  uint8_t *use;        /* [T][K] the combine reduces slot (t, k) */
  void *out;           /* combine output of a pending two-phase receive */
  unsigned char *base; /* this slot in our own segment */
  const struct cpu_ll *ll;
} cpu_ll_slot_t;

/* Row kernels (cpu_ll_kernels.c), chosen once per buffer by what the processor supports. */
typedef struct {
  /* fp8 cast of one bf16 row (SEMANTICS.md §5): q[H], scales[H/128] float or ue8m0[H/128] bytes. */
  void (*cast_row)(const uint16_t *x, int H, int round_scale, int ue8m0, uint8_t *q, void *sc);
  /* out[h] = bf16(fma chain over n rows): acc = 0; acc = fmaf(rows[i][h], w[i], acc). */
  void (*reduce)(const uint16_t *const *rows, const float *w, int n, int H, uint16_t *out);
} cpu_ll_kernels_t;

struct cpu_ll {
  int T, H, E, K, L, R, RT, NS;
  cpu_ll_layout_t lay;
  uint64_t q;        /* dispatch calls made (rejected ones included) */
  uint64_t c;        /* combine calls made (rejected ones included) */
  size_t wide_bytes; /* from this many bytes a call's copies use every channel */
  cpu_ll_slot_t slot[CPU_LL_SLOTS];
  cpu_ll_kernels_t k;
  /* scratch of one call */
  unsigned char *cast;   /* [T][H + 4 * NS]: fp8 rows and scales of this rank's tokens */
  int32_t *sel;          /* [E]: this rank's selections of every expert */
  int32_t *pos;          /* [channels][E]: next row of each expert a part of the send writes */
  const uint16_t **rows; /* [channels][K]: rows a part of the reduction adds up */
};
typedef struct cpu_ll cpu_ll_t;

/* ---- region and state (cpu_ll.c) */
/* Bytes of the low-latency region of one segment (0 when the config disables the mode). */
size_t cpu_ll_region_bytes(const ep_buffer_config_t *cfg, int nranks);
ep_status_t cpu_ll_create(cpu_state_t *s, const ep_buffer_config_t *cfg);
void cpu_ll_destroy(cpu_state_t *s);

static inline unsigned char *cpu_ll_base(cpu_state_t *s, int rank) {
  return s->segs[rank].base + s->layout.off_ll;
}
static inline cpu_ll_arrive_t *cpu_ll_arrive(cpu_state_t *s, int rank, uint64_t q) {
  return (cpu_ll_arrive_t *)(cpu_ll_base(s, rank) + s->ll->lay.arrive +
                             (size_t)(q & 1) * s->ll->lay.arrive_bytes);
}
static inline int32_t *cpu_ll_sel(cpu_ll_arrive_t *a) {
  return (int32_t *)(a + 1);
}
static inline _Atomic uint64_t *cpu_ll_creject(cpu_state_t *s, int rank) {
  return (_Atomic uint64_t *)(cpu_ll_base(s, rank) + s->ll->lay.creject);
}
/* Slot `slot` of `rank`'s segment. */
static inline unsigned char *cpu_ll_slot_base(cpu_state_t *s, int rank, int slot) {
  return cpu_ll_base(s, rank) + s->ll->lay.slots + (size_t)slot * s->ll->lay.slot_bytes;
}
/* Flag arrays of a slot: one cache line per writer. */
static inline _Atomic uint64_t *cpu_ll_flag(unsigned char *slot, size_t off, int writer) {
  return (_Atomic uint64_t *)(slot + off + (size_t)writer * CPU_CL);
}

/* Run fn(s, job, part) for parts 0..*parts-1: over the buffer's channel workers when the call
 * moves at least ll->wide_bytes (EP_LL_WIDE_BYTES; waking them costs microseconds), else on
 * this thread with *parts = 1. fn never fails. */
void cpu_ll_run(cpu_state_t *s, size_t bytes, int *parts,
                ep_status_t (*fn)(cpu_state_t *, void *, int), void *job);
static inline void cpu_ll_part(int n, int parts, int p, int *begin, int *end) {
  *begin = (int)((int64_t)n * p / parts);
  *end = (int)((int64_t)n * (p + 1) / parts);
}

/* Segment (local index) of `rank`, or -1 when it is on another host: its rows then travel
 * through the network engine (cpu_net_ll.c). On one host, the rank itself. */
static inline int cpu_ll_seg(const cpu_state_t *s, int rank) {
  return s->topo->host_of[rank] == s->topo->host ? s->topo->local_of[rank] : -1;
}

/* ---- signals and waits (cpu_ll_sync.c) */
/* Rank r's entry record of the current dispatch call: in its segment on one host, as exchanged
 * through the engine across hosts. */
const cpu_ll_arrive_t *cpu_ll_record(cpu_state_t *s, int r);
/* The gate's verdict from every rank's record (the same on every rank). */
ep_status_t cpu_ll_verdict(cpu_state_t *s, const char *op);
/* Steps 2-3: post this rank's record of dispatch call ll->q (sel: selections per expert, or
 * NULL), once nobody can still read the record it overwrites. */
ep_status_t cpu_ll_enter(cpu_state_t *s, const cpu_ll_arrive_t *mine, const int32_t *sel,
                         const char *op);
/* Step 4: wait for every rank's record of call ll->q and agree on the verdict. */
ep_status_t cpu_ll_gate(cpu_state_t *s, const char *op);
/* Wait until flag `off` of every writer in our slot `slot` holds `want`; `combine` selects the
 * rejection word that says a writer gave up. */
ep_status_t cpu_ll_wait_flags(cpu_state_t *s, int slot, size_t off, uint64_t want, bool combine,
                              const char *op, const char *what);
void cpu_ll_post(cpu_state_t *s, int dest, _Atomic uint64_t *flag, uint64_t v);
void cpu_ll_reject(void *state, bool combine);

/* ---- operations (cpu_ll_dispatch.c, cpu_ll_combine.c, cpu_ll.c) */
ep_status_t cpu_ll_dispatch(void *state, const ep_ll_dispatch_args_t *a, ep_handle_info_t *out);
ep_status_t cpu_ll_recv(void *state, ep_handle_info_t *h);
ep_status_t cpu_ll_recv_dispatch(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op);
ep_status_t cpu_ll_combine(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h);
ep_status_t cpu_ll_recv_combine(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op);
ep_status_t cpu_ll_view(const ep_handle_info_t *h, ep_ll_recv_view_t *v);
ep_status_t cpu_ll_combine_buffer(const ep_handle_info_t *h, void **y);
void cpu_ll_release(void *state, ep_handle_info_t *h);

/* The scales of slab row `row` of local expert le in the column-major layout (cpu_ll_dispatch.c).
 */
void cpu_ll_put_cols(const cpu_ll_t *ll, unsigned char *scales, size_t le, size_t row,
                     const unsigned char *sc, int ue8m0);

/* ---- across hosts (cpu_net_ll.c): the network part of each phase; local ranks as above */
/* The gate: every rank's record through the engine, then the verdict. */
ep_status_t cpu_net_ll_gate(cpu_state_t *s, const cpu_ll_arrive_t *mine, const int32_t *sel,
                            const char *op);
const cpu_ll_arrive_t *cpu_net_ll_record(cpu_state_t *s, int r);
/* Dispatch send phase for the ranks of other hosts: rows packed per destination, receives of
 * this rank's rows posted. row, sbytes: payload and scale bytes of a row; stride: bytes of one
 * token in ll->cast (fp8). */
ep_status_t cpu_net_ll_send(cpu_state_t *s, cpu_ll_slot_t *sl, const ep_ll_dispatch_args_t *a,
                            size_t row, size_t sbytes, size_t stride);
/* Dispatch receive phase: waits for the rows of other hosts, writes them into the slab. */
ep_status_t cpu_net_ll_recv(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op);
/* Combine send phase for the sources on other hosts (never waits), and its receive phase. */
ep_status_t cpu_net_ll_csend(cpu_state_t *s, cpu_ll_slot_t *sl, const void *y);
ep_status_t cpu_net_ll_crecv(cpu_state_t *s, cpu_ll_slot_t *sl, const char *op);
/* A combine this rank rejected: tell the other hosts, take in what they send it. */
void cpu_net_ll_creject(cpu_state_t *s);
/* A slot given back with transfers still in flight: they complete (bounded) before reuse. */
void cpu_net_ll_settle(cpu_state_t *s, cpu_ll_slot_t *sl);

/* ---- kernels (cpu_ll_kernels.c) */
void cpu_ll_kernels_pick(cpu_ll_kernels_t *k);
void cpu_ll_kernels_scalar(cpu_ll_kernels_t *k);
uint8_t cpu_ll_f32_to_e4m3(float f); /* the scalar conversion, for tests */

#endif
