/*
 * The CPU backend across hosts: the hierarchical data path (SEMANTICS.md §3.9, §4.6;
 * docs/ARCHITECTURE.md "Across hosts").
 *
 * H hosts of L ranks each; rank (g, l) is local index l of host g. The ranks of one host share
 * segments (cpu_seg.c, indexed by local index); between hosts only the network engine (MPI)
 * moves bytes. Rank (g, l) forwards for its *column*: the ranks of local index l on every host.
 *
 * Normal dispatch of rank s = (g, l):
 *   1. counts: every rank's call key, tokens per rank and tokens per host reach every rank
 *      (engine, point to point): rank_prefix, the receive count and every block's size follow;
 *   2. network: s sends each remote host g' one block: its tokens that go to g' (token order,
 *      one record each: payload, scales, global expert ids, weights), to rank (g', l);
 *   3. fan-out: rank (g', l) takes the blocks of its column (its own tokens for its host
 *      included, read from x), and for every token pushes one record to each rank of g' it goes
 *      to, carrying the final output row there (the forwarder knows it: it handles all of the
 *      source's tokens for its host, in order); its own rows it writes directly;
 *   4. receivers take records from their queues and write them at their rows.
 * A token crosses the network at most once per destination host. Blocks travel in chunks of
 * EP_NET_CHUNK bytes, so forwarding starts with the first chunk.
 *
 * Combine reverses it: every rank sends each row back to the forwarder that brought it (shared
 * memory); the forwarder adds, per token of its column, the rows of its host in rank order into
 * one fp32 partial (a single row travels as itself: exact); partials go back to their source
 * over the network, one per (token, host), in chunks as they complete; the source adds biases,
 * then the partials by host ascending, and rounds once. A forwarder takes its own tokens last and
 * never stores their partial: it reduces each such token at once from the other hosts' partials
 * and its host's rows, which it adds in place of the partial (the same bits).
 *
 * Low-latency mode sends every row straight to its expert's rank: shared memory on the host, a
 * message per (source, destination) pair through the engine between hosts (cpu_net_ll.c).
 */
#ifndef EP_CPU_NET_H
#define EP_CPU_NET_H

#include "cpu_plan.h"
#include "cpu_reduce.h"

/* Tags of the normal-mode endpoint (each kind of message is matched in order within its tag). */
enum { NET_TAG_COUNTS = 1, NET_TAG_DISPATCH = 2, NET_TAG_COMBINE = 3 };

/* A growable host buffer (staging of network blocks), kept across calls. */
typedef struct {
  unsigned char *p;
  size_t cap;
} cpu_stage_t;

typedef struct cpu_net {
  const struct ep_net_engine *e;
  ep_net_t *normal;       /* normal mode (its own communicator: calls of the two modes are
                             independent sequences) */
  ep_net_t *ll;           /* low-latency mode */
  size_t chunk;           /* EP_NET_CHUNK */
  cpu_stage_t send, recv; /* staging: blocks (partials) to send, blocks (partials) received */
  int32_t *counts;        /* [R][cw] gathered count words of the current call */
  int cw;                 /* int32 words of one rank's counts: key, to_rank[R], to_host[H] */
  _Atomic uint64_t net_bytes, local_bytes; /* sent so far (ep_buffer_query) */
  struct cpu_net_ll *llnet;                /* low-latency state across hosts (cpu_net_ll.c) */
} cpu_net_t;

/* The layout of one dispatch across hosts (the handle's priv). Blocks are those of this rank's
 * column, in the order of their source rank. */
typedef struct {
  cpu_plan_t *flat; /* in_rank [N][R], rank_prefix [R][R], N, Nr, R, C */
  int H, L;
  int32_t *cnt;       /* [R][R]: rows rank s sends to rank d */
  int32_t *hcnt;      /* [R][H]: tokens rank s sends to host g */
  int32_t *hsend_off; /* [H + 1]: this rank's tokens to host g: hsend_idx[off[g] .. off[g+1]] */
  int32_t *hsend_idx;
  int32_t *tok_j;    /* [N][H]: index of token t in its block to host g, -1: not sent there */
  int32_t *tok_nfan; /* [N][H]: ranks of host g that token t goes to */
  int *col;          /* [H]: the sources of this rank's column, ascending */
  int32_t *blk_base; /* [H + 1]: entries of block b are blk_base[b] .. blk_base[b+1] */
  int32_t *fan_off;  /* [entries + 1]: receivers of entry i: fan_off[i] .. fan_off[i+1] */
  uint16_t *fan_l;   /* receiver's local index, ascending */
  int32_t *fan_row;  /* its output row there */
  int32_t nfan;
  int32_t *row_src; /* [Nr]: source rank of each received row */
  int32_t *row_j;   /* [Nr]: its entry in the source's block to this host */
} cpu_nplan_t;

void cpu_nplan_free(void *plan);

/* ---- cpu_net.c */
ep_status_t cpu_net_create(cpu_state_t *s);
void cpu_net_destroy(cpu_state_t *s, bool clean);
void cpu_net_traffic(void *state, uint64_t *net, uint64_t *local);
void *cpu_stage(cpu_state_t *s, cpu_stage_t *st, size_t bytes); /* NULL: out of memory (named) */
/* The count exchange that opens every normal-mode call across hosts (the hello of the one-host
 * path): `mine` = key + to_rank[R] + to_host[H] (cw words); every rank's land in net->counts.
 * A rejection or disagreement fails the call on every rank alike. */
ep_status_t cpu_net_counts(cpu_state_t *s, const int32_t *mine, const char *op);
void cpu_net_reject(cpu_state_t *s);
/* Waits for transfers with the buffer's deadline and liveness; names the rank and its host. */
ep_status_t cpu_net_wait(cpu_state_t *s, ep_net_t *n, ep_net_xfer_t *x, int count, const char *op,
                         const char *phase);
/* Every rank's `bytes` into all[r * bytes] (own included), point to point over endpoint n. */
ep_status_t cpu_net_all_to_all(cpu_state_t *s, ep_net_t *n, int tag, const void *mine, void *all,
                               size_t bytes, const char *op, const char *phase);
/* "rank 3 (host 1)" */
const char *cpu_net_who(const cpu_state_t *s, int rank, char *buf, size_t n);

/* ---- cpu_net_ll.c: low-latency mode across hosts */
ep_status_t cpu_net_ll_create(cpu_state_t *s);
void cpu_net_ll_destroy(cpu_state_t *s, bool clean);

/* ---- cpu_net_dispatch.c, cpu_net_combine.c */
ep_status_t cpu_net_dispatch(cpu_state_t *s, ep_dispatch_call_t *c, ep_handle_info_t *out);
ep_status_t cpu_net_combine(cpu_state_t *s, const ep_combine_args_t *a, const ep_handle_info_t *h);

#endif
