/*
 * CUDA backend (private header). Host side in C; the kernels are behind cuda/kernels/ep_kernels.h.
 *
 * One buffer of one rank owns:
 *   - its pool (cudaMalloc, exported with cudaIpcGetMemHandle) and the peers' pools mapped here
 *     (cudaIpcOpenMemHandle), laid out as ep_kernels.h describes;
 *   - private device memory: kernel control words, the table of peer pool addresses, scratch;
 *   - a page-locked host block mapped into the device (error word, counts for the host, abort);
 *   - an arena from which handles take their device memory (plans), so that a dispatch never
 *     calls cudaMalloc and stays capturable in a CUDA graph;
 *   - a side stream (for reject) and an event that orders calls made on different streams;
 *   - registrations of caller memory (cuda_reg.c): the peers' allocations mapped through CUDA IPC
 *     (each opened once, shared by the registrations inside it) and a device table of every
 *     rank's registered ranges as mapped here.
 * Destroy quiesces (own work, then a barrier), closes every mapping, then frees in reverse.
 */
#ifndef EP_CUDA_H
#define EP_CUDA_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "cuda/kernels/ep_kernels.h"

typedef struct cuda_arena cuda_arena_t;
typedef struct cuda_reg cuda_reg_t; /* one registration (cuda_reg.c) */
typedef struct cuda_map cuda_map_t; /* one peer allocation opened for registrations */

/* Fast paths the host counts per buffer (ep_buffer_info_t; dispatches that pulled their rows are
 * counted by the GPU). */
typedef enum {
  CUDA_PATH_COMBINE_IN_PLACE,  /* combines whose x the peers read where it lies */
  CUDA_PATH_DISPATCH_IN_PLACE, /* dispatches whose senders wrote recv_x in place */
  CUDA_PATH_DISPATCH_EARLY,    /* allocator-path dispatches with early data */
  CUDA_PATH_COMBINE_COPIED,    /* combines whose x was copied into area C first */
  CUDA_PATHS
} cuda_path_t;

typedef struct {
  ep_ctx_t *ctx;
  int rank, nranks, device, channels;
  size_t queue_bytes;
  epk_buf_t kb;        /* what the kernels see */
  uint8_t *pool;       /* own pool (device) */
  uint8_t **peer_ptrs; /* [R] host copy of kb.peers; [rank] == pool */
  bool *opened;        /* [R] mapped through cudaIpcOpenMemHandle (to close) */
  void *priv_mem;      /* private device allocation: priv, peers, peer_blocks, ecount */
  epk_host_t *host;    /* page-locked, mapped; host address */
  cuda_arena_t *arena; /* shared with the handles it serves (reference counted) */
  cudaStream_t side;
  cudaEvent_t last; /* recorded after each call on its stream (not while capturing) */
  cudaStream_t last_stream;
  bool last_valid;
  uint32_t ticket;        /* synchronous calls made (host side) */
  int prev_device;        /* the caller's current device, restored on leaving */
  ep_call_key_t err_key;  /* key of the last call, to name a bad slot or field */
  struct cuda_ll *ll;     /* low-latency mode (cuda_ll.h), NULL when disabled */
  int fit_blocks;         /* this rank's share of its GPU's SMs (SMs / ranks on the GPU) */
  uint64_t off_ll;        /* its region in the pool */
  epk_trace_t *trace_mem; /* EP_CUDA_TRACE: device sums of the normal-mode phases, else NULL */
  cudaIpcMemHandle_t *pool_handles; /* [R] every rank's pool as exported */
  cuda_reg_t *regs;                 /* [EP_MAX_MEM_REGS] registrations of caller memory */
  cuda_map_t *maps;                 /* peers' allocations opened for them */
  int nmaps, capmaps;
  uint8_t **reg_table;        /* device: kb.regs, [EP_MAX_MEM_REGS][R] */
  uint64_t *reg_bytes;        /* device: kb.reg_bytes, [EP_MAX_MEM_REGS][R] */
  struct cuda_net *net;       /* across hosts (cuda_net.h), NULL on one host */
  uint64_t paths[CUDA_PATHS]; /* calls that took each path (cuda_path_t; one host) */
  bool late_hello;            /* EP_CUDA_LATE_HELLO: the allocator path may post a late hello */
  bool pull;                  /* EP_CUDA_PULL: copy-out dispatches may pull staged rows */
  bool early_data;   /* EP_CUDA_EARLY_DATA: the allocator path moves rows before allocating */
  bool combine_copy; /* EP_CUDA_COMBINE_COPY: an unmapped combine input is copied into area C */
  uint64_t l2_stream_bytes; /* EP_CUDA_L2_HINT: calls moving this many bytes and more stream
                               their rows through L2 evict-first (cuda_l2_stream) */
  ep_call_key_t prev_key;   /* err_key of the call before, for its error seen during this one */
} cuda_state_t;

/* Whether a call whose rows, over all ranks, come to about `bytes` streams them through L2
 * evict-first (epk_l2_policy in common.cuh). */
static inline int cuda_l2_stream(const cuda_state_t *s, uint64_t bytes) {
  return bytes >= s->l2_stream_bytes;
}

/* A call took path p (cuda_path_t), and how many have. */
static inline void cuda_path_took(cuda_state_t *s, cuda_path_t p) {
  __atomic_fetch_add(&s->paths[p], 1, __ATOMIC_RELAXED);
}
static inline uint64_t cuda_path_count(const cuda_state_t *s, cuda_path_t p) {
  return __atomic_load_n(&s->paths[p], __ATOMIC_RELAXED);
}

/* A dispatch's layout as a handle keeps it (the handle's priv). */
typedef struct {
  cuda_arena_t *arena;
  int32_t *plan; /* epk_plan_* layout, in the arena */
  size_t plan_bytes;
  int32_t *src; /* [src_cap] recv_src_idx of every received row, in the arena */
  int64_t src_cap;
  int N, R, nr; /* nr: -1 until known on the host (worst-case path) */
} cuda_plan_t;

/* ---- cuda_mem.c: create / destroy of the memory and the mappings */
ep_status_t cuda_mem_setup(cuda_state_t *s, const ep_buffer_config_t *cfg);
void cuda_mem_teardown(cuda_state_t *s, bool collective);
/* Pool bytes for the normal-mode parts and a low-latency region of ll_bytes (at *off_ll). */
size_t cuda_pool_layout(int nranks, int channels, size_t queue_bytes, uint64_t ll_bytes,
                        uint64_t *off_ll, epk_buf_t *kb);

/* ---- cuda_arena.c: device memory for handles (host-side bookkeeping only) */
ep_status_t cuda_arena_new(size_t bytes, cuda_arena_t **out);
void *cuda_arena_alloc(cuda_arena_t *a, size_t bytes);
void cuda_arena_free(cuda_arena_t *a, void *p, size_t bytes);
void cuda_arena_ref(cuda_arena_t *a);
void cuda_arena_unref(cuda_arena_t *a); /* frees the device memory with the last reference */
cuda_plan_t *cuda_plan_new(cuda_state_t *s, int N);
bool cuda_plan_src(cuda_plan_t *p, int64_t rows); /* the src array; false: arena full */
void cuda_plan_free(void *plan);

/* ---- cuda_sync.c: streams, host waits, errors */
/* Every entry point: selects the device, reports a failure a kernel of an earlier asynchronous
 * call recorded, and orders this call after the buffer's previous one. */
ep_status_t cuda_enter(cuda_state_t *s, void *stream, const char *op, cudaStream_t *out);
void cuda_leave(cuda_state_t *s, cudaStream_t st, bool record); /* record: it enqueued work */
bool cuda_capturing(cudaStream_t st);
ep_status_t cuda_check(cuda_state_t *s, cudaError_t e, const char *op, const char *what);
/* Waits for a word of the mapped host block that a kernel sets to `want` whether its call fails
 * or not (a ticket), with the deadline and liveness; `phase` names the wait in a failure. Ended
 * early only by an error word that breaks the buffer; returns EP_OK then too (cuda_take_error or
 * cuda_deferred report it). cuda_wait_ticket: the normal mode's ticket (notify or data kernel). */
ep_status_t cuda_wait_word(cuda_state_t *s, const uint32_t *word, uint32_t want, const char *op,
                           const char *phase);
/* cuda_wait_word until `want` came or the host word breaks the buffer: a breaking word that ended
 * the wait may be covered, for a moment, by the no-data word it replaced (epk_err_post posts it
 * again); such a word is handed to `earlier` (an earlier call's: logged, or a failure returned)
 * and the wait goes on. */
ep_status_t cuda_wait_settled(cuda_state_t *s, const uint32_t *word, uint32_t want, const char *op,
                              const char *phase,
                              ep_status_t (*earlier)(cuda_state_t *, const char *));
ep_status_t cuda_wait_ticket(cuda_state_t *s, uint32_t ticket, const char *op,
                             ep_status_t (*earlier)(cuda_state_t *, const char *));
/* Turns the host error word into a status and message (and clears it); EP_OK if none. */
ep_status_t cuda_take_error(cuda_state_t *s, const char *op);
/* The status and message of an error word that is not taken (a call's own, epk_host_t call_err). */
ep_status_t cuda_explain_word(cuda_state_t *s, uint64_t v, const char *op);
/* The same at a point where a no-data failure can only be an earlier asynchronous call's (a
 * call's entry, or after its own ticket): logged (EP_OK); any other breaks the buffer and is
 * returned (whichever call it was: a deadline or a dead peer ends this one too). */
ep_status_t cuda_deferred(cuda_state_t *s, const char *op);
/* Waits for this buffer's own work; false on deadline (then kernels were told to stop). */
bool cuda_quiesce(cuda_state_t *s, double seconds);
void cuda_reject(void *state);
int cuda_set_device(int dev, int *prev);

/* ---- cuda_reg.c: registrations of caller memory (ep_register_memory) */
ep_status_t cuda_mem_register(void *state, int slot, void *ptr, size_t bytes);
ep_status_t cuda_mem_deregister(void *state, int slot);
/* Buffer teardown: closes every mapping of the registrations left, in reverse order, silently. */
void cuda_reg_teardown(cuda_state_t *s);
/* The registration of this rank that holds [p, p + bytes): its slot (*off: the byte offset of p
 * in it), or -1. */
int cuda_reg_find(const cuda_state_t *s, const void *p, uint64_t bytes, int64_t *off);
/* Whether this rank has any registration (an allocator may hand out registered memory). */
bool cuda_reg_any(const cuda_state_t *s);

/* ---- operations */
ep_status_t cuda_layout(void *state, const ep_layout_args_t *a);
ep_status_t cuda_dispatch(void *state, ep_dispatch_call_t *c, ep_handle_info_t *out);
ep_status_t cuda_combine(void *state, const ep_combine_args_t *a, const ep_handle_info_t *h);
ep_status_t cuda_combine_buffer(void *state, const ep_handle_info_t *h, void **x);

#endif
