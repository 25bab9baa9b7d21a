/*
 * The CUDA backend across hosts (SEMANTICS.md §3.9, §4.6; docs/ARCHITECTURE.md "Across hosts").
 *
 * H hosts of L ranks; rank (g, l) forwards for its column, the ranks of local index l on every
 * host, as the CPU backend does (src/cpu/cpu_net.h). Between hosts only NCCL moves bytes
 * (grouped ncclSend/ncclRecv of device memory, through the network layer's "nccl" engine);
 * inside a host the ranks write into each other's pools through CUDA IPC.
 *
 * The host plans every call, so it waits for the counts, unlike the one-host path whose plan is
 * made by a kernel:
 *   dispatch  1. the ids come to the host; every rank's call key, tokens per rank and per host
 *                reach every rank (MPI, the engine every job across hosts has); row positions
 *                follow;
 *             2. this rank packs its tokens into one block of records per host, each record with
 *                its final row on every rank of that host (the sender knows them all now);
 *             3. NCCL carries each block to the rank of that host with this rank's local index;
 *             4. the forwarder writes every record of its column into area D of each rank of its
 *                host it goes to (CUDA IPC); a barrier; every rank takes its rows out of area D.
 *   combine   1. every rank puts its rows (and weights) into its own area C; a barrier;
 *             2. the forwarder adds, per entry of its column, the rows of its host's ranks read
 *                from their area C into one fp32 partial; NCCL carries the partials back;
 *             3. the source adds biases and the partials by host ascending and rounds once.
 * A call is not capturable in a CUDA graph (the host waits inside it). Low-latency mode across
 * hosts: cuda_net_ll.c (every row straight to its expert's rank through NCCL).
 */
#ifndef EP_CUDA_NET_H
#define EP_CUDA_NET_H

#include "cuda/cuda.h"
#include "cuda/kernels/net_kernels.h"

/* Device memory that grows (staging of network blocks and partials), kept across calls. */
typedef struct {
  uint8_t *p;
  size_t cap;
} cuda_dstage_t;

typedef struct cuda_net {
  const struct ep_net_engine *e, *me;
  ep_net_t *ep;  /* NCCL endpoint over the group: the rows */
  ep_net_t *ctl; /* MPI endpoint over the group: the host's exchanges of a call (counts,
                    agreements, barriers; the group's own channel belongs to group calls) */
  int H, L, host, lrank;
  const int *rank_at, *host_of, *local_of;
  cuda_dstage_t send, recv, part, pin; /* pin: partials received */
  cuda_dstage_t desc;                  /* block descriptors and pointer tables of a call */
  uint8_t **area_d, **area_c;          /* device [L]: local ranks' areas as mapped here */
  int32_t *host_of_dev;                /* device [R]: for the layout kernel */
  int32_t *bad;                        /* device: a source whose records the fan-out dropped */
  int64_t *ids_host;                   /* page-locked: the ids of a dispatch */
  size_t ids_cap;
  int32_t *counts; /* [R][cw] gathered count words of the current call */
  int cw;          /* key, to_rank[R], to_host[H], one_host[H] (tokens meeting one rank there) */
  uint64_t net_bytes, local_bytes;
  struct cuda_net_ll *ll; /* low-latency mode (cuda_net_ll.c), NULL when the buffer has none */
} cuda_net_t;

/* The layout of one dispatch across hosts (the handle's priv). */
typedef struct {
  cuda_arena_t *arena;
  int N, R, H, L, nr, entries, own; /* own: this rank's block in its column */
  int hidden, topk;                 /* of the dispatch: the sizes of the partials */
  int32_t *cnt;                     /* host [R][R] */
  int32_t *hcnt;                    /* host [R][H] */
  int32_t *ocnt;                    /* host [R][H]: of those, tokens meeting one rank there */
  int32_t *hsend_off;               /* host [H + 1]: this rank's records per host */
  int *col;                         /* host [H]: its column's sources, ascending */
  int32_t *blk_base;                /* host [H + 1]: entries of block b */
  int32_t *hdr;                     /* host [sent][EPK_NET_HDR + L]: this rank's headers */
  int32_t *d_hdr, *d_fan, *d_meta;  /* arena: headers, [entries][L], [nr][2] */
  int64_t *d_tok, *d_poff;          /* arena: [N][H] (epk_net_reduce_t.tok), [entries] */
  size_t b_hdr, b_tok, b_fan, b_meta, b_poff;
} cuda_nplan_t;

void cuda_nplan_free(void *plan);

/* ---- cuda_net.c */
ep_status_t cuda_net_create(cuda_state_t *s, const ep_buffer_config_t *cfg);
void cuda_net_destroy(cuda_state_t *s, bool clean);
void cuda_net_traffic(void *state, uint64_t *net, uint64_t *local);
/* Device memory of at least `bytes` (contents not kept). NULL: recorded error. */
void *cuda_dstage(cuda_state_t *s, cuda_dstage_t *d, size_t bytes, const char *op);
/* Every rank's `bytes` into all[r * bytes] (own included), point to point over the MPI
 * endpoint, with the deadline and the liveness checks; a failure breaks the buffer. */
enum { CUDA_NET_TAG_NORMAL = 1, CUDA_NET_TAG_LL_GATE = 2, CUDA_NET_TAG_LL_COMBINE = 3 };
ep_status_t cuda_net_allgather(cuda_state_t *s, int tag, const void *mine, void *all, size_t bytes,
                               const char *op, const char *phase);
/* The count exchange of a call: every rank's cw words in net->counts; keys compared. */
ep_status_t cuda_net_counts(cuda_state_t *s, const int32_t *mine, const char *op);
/* A rejected call still takes part in the exchange (the peers fail at once). */
void cuda_net_reject(cuda_state_t *s, const char *op);
/* Waits for the stream's work, with the buffer's deadline. */
ep_status_t cuda_net_sync(cuda_state_t *s, cudaStream_t st, const char *op, const char *phase);
/* Every rank learns whether every rank's local step succeeded; the call fails alike. */
ep_status_t cuda_net_agree(cuda_state_t *s, ep_status_t mine, const char *op, const char *phase);
/* Posts the transfers on `st` (NCCL, stream-ordered); then waits for them (deadline, liveness;
 * a failure names the rank and its host and breaks the buffer). */
ep_status_t cuda_net_post(cuda_state_t *s, ep_net_xfer_t *x, int count, cudaStream_t st,
                          const char *op, const char *phase);
ep_status_t cuda_net_complete(cuda_state_t *s, ep_net_xfer_t *x, int count, const char *op,
                              const char *phase);
/* ep_buffer_info_t.local_bytes_sent: the rows of this forwarder's column that the other ranks
 * of its host receive (dispatch: written there) or hold (combine: read from there), `row` bytes
 * each. */
void cuda_net_count_local(cuda_state_t *s, const cuda_nplan_t *p, uint64_t row);
/* A failure after cuda_net_post: the posted transfers are let go and the buffer is broken. */
void cuda_net_abandon(cuda_state_t *s, ep_net_xfer_t *x, int count);
/* Waits for this rank's stream, then for every rank of the group (phases touching a peer); a
 * local failure (`mine`) still takes part, so that every rank fails the call alike. */
ep_status_t cuda_net_fence(cuda_state_t *s, cudaStream_t st, ep_status_t mine, const char *op,
                           const char *phase);
/* "rank 3 (host 1)" */
const char *cuda_net_who(const cuda_state_t *s, int rank, char *buf, size_t n);

/* ---- cuda_net_dispatch.c, cuda_net_combine.c */
ep_status_t cuda_net_dispatch(cuda_state_t *s, ep_dispatch_call_t *c, ep_handle_info_t *out);
ep_status_t cuda_net_combine(cuda_state_t *s, const ep_combine_args_t *a,
                             const ep_handle_info_t *h);
ep_status_t cuda_net_combine_buffer(cuda_state_t *s, const ep_handle_info_t *h, void **x);

/* ---- cuda_net_ll.c: low-latency mode across hosts (the one-host entry points hand over) */
struct cuda_ll_slot;
ep_status_t cuda_net_ll_create(cuda_state_t *s);
/* Destroy, before the engines close: completes the transfers in flight (calm) or lets them go;
 * returns whether the teardown may stay calm. Then, after the close, the memory is freed. */
bool cuda_net_ll_settle_all(cuda_state_t *s, bool calm);
void cuda_net_ll_destroy(cuda_state_t *s);
ep_status_t cuda_net_ll_dispatch(cuda_state_t *s, const ep_ll_dispatch_args_t *a,
                                 ep_handle_info_t *out);
ep_status_t cuda_net_ll_recv_dispatch(cuda_state_t *s, struct cuda_ll_slot *sl, const char *op);
ep_status_t cuda_net_ll_combine(cuda_state_t *s, const ep_ll_combine_args_t *a,
                                ep_handle_info_t *h);
ep_status_t cuda_net_ll_recv_combine(cuda_state_t *s, struct cuda_ll_slot *sl, const char *op);
/* A handle given back while its transfers are in flight: they complete first. */
void cuda_net_ll_settle(cuda_state_t *s, struct cuda_ll_slot *sl);
/* A call rejected on this rank still takes part in the gate or the combine's agreement. */
void cuda_net_ll_reject(cuda_state_t *s, bool combine);

#endif
