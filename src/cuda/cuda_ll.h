/*
 * Low-latency mode of the CUDA backend, host side (SEMANTICS.md §6). The protocol, the region of
 * the pool and the private device state are described in cuda/kernels/ll_kernels.h; this side
 * chooses result slots, launches the kernels on the caller's stream and keeps the handles'
 * states (core/backend.h).
 *
 * Host waits: outside a graph capture (and unless EP_CUDA_LL_ASYNC=1), a call waits, through
 * the mapped host block, for the one verdict it must return: a dispatch for its gate (a peer
 * that rejected, ranks that disagree, a bad expert id; the receive count), a combine for its
 * check and, when it receives, for the peers' flags (a peer that rejected). Never for data. In
 * a capture, or with EP_CUDA_LL_ASYNC=1, nothing waits on the host: the receive count is not
 * known on return (-1; recv_count on the device has it), and a failure is recorded by the
 * kernel and returned by the next call on the buffer (cuda_sync.c).
 */
#ifndef EP_CUDA_LL_H
#define EP_CUDA_LL_H

#include "cuda/cuda.h"
#include "cuda/kernels/ll_kernels.h"

typedef struct cuda_ll cuda_ll_t;

/* One result slot as the host sees it (the handle's priv). */
typedef struct cuda_ll_slot {
  int index, state; /* enum ep_ll_state */
  uint64_t stamp;   /* when it was last given back: the least recently used free slot is
                       taken, so that readers of its combine input have the most time */
  int n, topk, fmt;
  void *out;            /* combine output of a pending two-phase receive */
  bool ybuf;            /* its combine's y lay in this buffer (trace kinds only) */
  cudaStream_t stream;  /* stream of the send call: ep_ll_recv runs there */
  uint8_t *ctrl, *data; /* this slot's parts in our own pool (device addresses) */
  cuda_ll_t *ll;
} cuda_ll_slot_t;

struct cuda_ll {
  epk_ll_t k;     /* what the kernels see */
  void *priv_mem; /* private device memory (k.priv) */
  cuda_ll_slot_t slot[EPK_LL_SLOTS];
  uint64_t clock;
  uint32_t ticket; /* host waits made */
  bool async;      /* EP_CUDA_LL_ASYNC: never wait on the host */
  /* Receive hooks (EP_CUDA_LL_HOOK_STREAM): the send part of a two-phase call runs on `hook`, a
   * stream of the buffer's own at the highest priority, forked from the caller's stream by
   * `fork`. The caller's kernels queued after the send then run beside it instead of after it;
   * the receive (on the caller's stream) waits for it through the call-order event. NULL: sends
   * run on the caller's stream. */
  cudaStream_t hook;
  cudaEvent_t fork;
};

/* ---- cuda_ll.c */
/* Bytes of the low-latency region of one pool (0 when the config disables the mode). */
uint64_t cuda_ll_region_bytes(const ep_buffer_config_t *cfg, int nranks, epk_ll_layout_t *lay);
/* Bytes of the private device memory of the mode. */
uint64_t cuda_ll_private_bytes(const ep_buffer_config_t *cfg, int nranks);
/* After the pool exists: private memory, kernel attributes, slots. */
ep_status_t cuda_ll_create(cuda_state_t *s, const ep_buffer_config_t *cfg);
void cuda_ll_destroy(cuda_state_t *s);
ep_status_t cuda_ll_view(const ep_handle_info_t *h, ep_ll_recv_view_t *v);
ep_status_t cuda_ll_combine_buffer(const ep_handle_info_t *h, void **y);
void cuda_ll_release(void *state, ep_handle_info_t *h);
void cuda_ll_reject(void *state, bool combine);
ep_status_t cuda_ll_recv(void *state, ep_handle_info_t *h);
/* Whether the call on `st` waits on the host for its verdict; if so, the ticket to wait for. */
bool cuda_ll_eager(cuda_state_t *s, cudaStream_t st, uint32_t *ticket);
/* Waits for a low-latency report, then turns it into a status and message. */
ep_status_t cuda_ll_wait(cuda_state_t *s, const epk_ll_report_t *r, uint32_t ticket, const char *op,
                         bool comb, const char *phase);
/* The message of a report that failed (also for a failure deferred from a graph); `comb`: the
 * report is a combine's. */
ep_status_t cuda_ll_explain(cuda_state_t *s, const epk_ll_report_t *r, const char *op, bool comb,
                            const char *phase);

/* The stream the send part of a call runs on: the hook stream for a two-phase call outside a
 * capture (forked from st, so that it starts after what the caller queued before), else st. */
ep_status_t cuda_ll_send_stream(cuda_state_t *s, cudaStream_t st, bool two_phase, const char *op,
                                cudaStream_t *run);

/* ---- cuda_ll_dispatch.c, cuda_ll_combine.c */
/* The free slot given back longest ago (NULL: none). */
cuda_ll_slot_t *cuda_ll_take_slot(cuda_ll_t *ll);
void cuda_ll_fill_info(const cuda_ll_t *ll, const ep_ll_dispatch_args_t *a, cuda_ll_slot_t *sl,
                       int nrecv, ep_handle_info_t *out);
/* The host's checks of a call's arguments (one host and across hosts alike): alignment of the
 * tensors; for a combine, the handle's state first. */
ep_status_t cuda_ll_dispatch_aligned(cuda_state_t *s, const ep_ll_dispatch_args_t *a);
ep_status_t cuda_ll_combine_check(cuda_state_t *s, const ep_ll_combine_args_t *a,
                                  const cuda_ll_slot_t *sl);
ep_status_t cuda_ll_dispatch(void *state, const ep_ll_dispatch_args_t *a, ep_handle_info_t *out);
ep_status_t cuda_ll_recv_dispatch(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op);
ep_status_t cuda_ll_combine(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h);
ep_status_t cuda_ll_recv_combine(cuda_state_t *s, cuda_ll_slot_t *sl, const char *op);

#endif
