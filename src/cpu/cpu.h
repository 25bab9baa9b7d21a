/*
 * CPU backend (private header).
 *
 * Each rank owns one shared-memory segment (memfd, passed to peers over the group's socket and
 * mapped by all of them; no name ever exists in /dev/shm, so a SIGKILL leaves nothing behind):
 *
 *   [header][bells: C cache lines][abort word][hello slots: 2 x R][rings: R x C][low-latency]
 *
 * - bells[c]: futex word that channel c of this rank sleeps on; peers bump it after they move
 *   data for it (push into one of its rings, or free space in a ring it pushes to).
 * - hello[p][s]: written by source rank s for a call with sequence number q (p = q & 1): what the
 *   call is (for cross-rank checks) and, for dispatch, its counts. Two slots because a fast rank
 *   may post call q+1 before a slow one has read call q; it can never be two calls ahead.
 * - ring[s][c]: single-producer (rank s, channel c) single-consumer (this rank, channel c) byte
 *   queue of fixed size queue_bytes. Records never straddle its end; both sides skip to the
 *   start with the same rule, so record sizes may change from one call to the next.
 */
#ifndef EP_CPU_H
#define EP_CPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"

#define CPU_CL 64
#define CPU_SEG_MAGIC 0x4550434d53454731ull /* "EPCMSEG1" */

typedef struct {
  _Alignas(CPU_CL) _Atomic uint32_t bell;
  _Atomic uint32_t sleepers;
} cpu_bell_t;

/* What every rank says about its call (the core's call key: what it is, what must agree).
 * Followed in the slot by the variable counts. */
typedef struct {
  _Alignas(CPU_CL) _Atomic uint64_t seq; /* call number + 1 once written */
  ep_call_key_t key;
  /* then: int32 to_rank[R] (tokens the writer sends to every rank),
   *       int32 chan[C] (tokens it sends to the slot's owner on each channel),
   *       int32 experts[E/R] (selections of the owner's local experts) */
} cpu_hello_t;

typedef struct {
  _Alignas(CPU_CL) _Atomic uint64_t tail; /* bytes ever pushed (producer) */
  _Alignas(CPU_CL) _Atomic uint64_t head; /* bytes ever consumed (consumer) */
  _Alignas(CPU_CL) unsigned char data[];
} cpu_ring_t;

typedef struct {
  uint64_t magic;
  int32_t rank, nranks, channels, pad;
  uint64_t queue_bytes, total_bytes;
  uint64_t off_bells, off_abort, off_hello, hello_bytes, off_rings, ring_bytes, off_ll;
} cpu_seg_hdr_t;

/* Local view of one rank's segment. */
typedef struct {
  unsigned char *base;
  cpu_seg_hdr_t *hdr;
} cpu_seg_t;

struct cpu_state;

/* One worker per channel > 0; channel 0 runs on the calling thread. */
typedef struct {
  pthread_t thread;
  struct cpu_state *s;
  int channel;
} cpu_worker_t;

typedef struct cpu_state {
  ep_ctx_t *ctx;
  /* The ranks that share this segment world: every rank on one host; across hosts, the ranks of
   * this host (rank, nranks are then the local index and size; segs[] is indexed by them). */
  int rank, nranks, channels;
  int grank, gnranks; /* in the group (== rank, nranks on one host) */
  const ep_topo_t *topo;
  struct cpu_net *net; /* across hosts: engine endpoints and the hierarchical path */
  size_t queue_bytes;
  cpu_seg_hdr_t layout; /* offsets, identical in every segment */
  cpu_seg_t *segs;      /* [R]: mapped segments, segs[rank] is our own */
  uint64_t seq;         /* normal-mode calls made so far (including rejected ones) */
  double spin_s;
  /* worker pool */
  cpu_worker_t *workers;
  pthread_mutex_t pool_lock;
  pthread_cond_t pool_cond;
  uint64_t job_gen; /* bumped to hand work to the workers */
  int job_pending;  /* workers still busy with the current job */
  bool pool_stop;
  void *job; /* the current call's plan */
  ep_status_t (*job_fn)(struct cpu_state *s, void *job, int channel);
  ep_status_t job_status;
  bool job_err_set;
  char job_err[512];         /* message of the first failing channel (thread-local elsewhere) */
  _Atomic int local_abort;   /* a channel of this rank failed: the others stop */
  _Atomic int culprit;       /* group rank the first failing wait was about (-1: none) */
  _Atomic int lost_launcher; /* a wait saw this rank's launcher die (sticky) */
  struct cpu_ll *ll;         /* low-latency state, NULL when disabled */
} cpu_state_t;

/* The group rank of local index l (this host's ranks share the segments); -1 stays -1. Messages,
 * the abort word and the culprit speak in group ranks, as the core's liveness does. */
static inline int cpu_grank(const cpu_state_t *s, int l) {
  return l < 0 ? l : s->topo->rank_at[s->topo->host * s->topo->local_size + l];
}

/* ---- segments (cpu_seg.c) */
/* nranks: ranks sharing the segments (rings, hellos); ll_ranks: ranks of the group (the
 * low-latency slabs hold rows of every rank). */
size_t cpu_seg_size(int nranks, int ll_ranks, int channels, size_t queue_bytes,
                    const ep_buffer_config_t *cfg, cpu_seg_hdr_t *layout);
ep_status_t cpu_seg_setup(cpu_state_t *s, const ep_buffer_config_t *cfg);
void cpu_seg_teardown(cpu_state_t *s);

static inline cpu_bell_t *cpu_bell(cpu_state_t *s, int rank, int ch) {
  return (cpu_bell_t *)(s->segs[rank].base + s->layout.off_bells) + ch;
}
/* Abort word: set once by the first rank that gives up on a call; says who failed (the culprit:
 * the rank that died or did not answer), who noticed, and why. Bits 0-23: culprit + 1, 24-47:
 * reporter + 1, 48-55: the status, 56: the reporter lost its launcher (ranks: group ranks). That
 * flag lets the peers name the launcher even when their own notify socket's EOF has not shown yet:
 * a killed launcher's sockets close one by one, and a rank that looks between two closes saw only
 * the abort. */
static inline _Atomic uint64_t *cpu_abort_word(cpu_state_t *s, int rank) {
  return (_Atomic uint64_t *)(s->segs[rank].base + s->layout.off_abort);
}
#define CPU_ABORT_LAUNCHER (1ull << 56)
static inline uint64_t cpu_abort_pack(int culprit, int reporter, ep_status_t why) {
  return (uint64_t)(culprit + 1) | ((uint64_t)(reporter + 1) << 24) |
         ((uint64_t)(why & 0xff) << 48);
}
static inline ep_status_t cpu_abort_why(uint64_t ab) {
  return (ep_status_t)((ab >> 48) & 0xff);
}
static inline int cpu_abort_culprit(uint64_t ab) {
  return (int)(ab & 0xffffff) - 1;
}
static inline int cpu_abort_reporter(uint64_t ab) {
  return (int)((ab >> 24) & 0xffffff) - 1;
}
/* Slot in `owner`'s segment written by `writer` for parity p. */
static inline cpu_hello_t *cpu_hello(cpu_state_t *s, int owner, int parity, int writer) {
  return (cpu_hello_t *)(s->segs[owner].base + s->layout.off_hello +
                         ((size_t)parity * (size_t)s->nranks + (size_t)writer) *
                             s->layout.hello_bytes);
}
static inline int32_t *cpu_hello_to_rank(cpu_hello_t *h) {
  return (int32_t *)(h + 1);
}
static inline int32_t *cpu_hello_chan(cpu_state_t *s, cpu_hello_t *h) {
  return cpu_hello_to_rank(h) + s->nranks;
}
static inline int32_t *cpu_hello_experts(cpu_state_t *s, cpu_hello_t *h) {
  return cpu_hello_chan(s, h) + s->channels;
}
/* Ring in `owner`'s segment fed by `src` on channel ch. */
static inline cpu_ring_t *cpu_ring(cpu_state_t *s, int owner, int src, int ch) {
  return (cpu_ring_t *)(s->segs[owner].base + s->layout.off_rings +
                        ((size_t)src * (size_t)s->channels + (size_t)ch) * s->layout.ring_bytes);
}

/* ---- waiting (cpu_wait.c) */
typedef struct {
  cpu_state_t *s;
  int channel;
  double deadline, next_check;
  double sleep_cap; /* longest futex sleep; short while network transfers need polling */
  const char *op, *phase;
} cpu_waiter_t;

void cpu_waiter_init(cpu_waiter_t *w, cpu_state_t *s, int channel, const char *op,
                     const char *phase);
static inline uint32_t cpu_bell_read(cpu_state_t *s, int ch) {
  return atomic_load(&cpu_bell(s, s->rank, ch)->bell);
}
/* Sleep until our bell moves from `seen`, the deadline passes, a peer dies or aborts.
 * EP_OK to re-scan; otherwise the failure, already recorded (with `waiting_for`, a group rank or
 * -1, named). */
ep_status_t cpu_wait(cpu_waiter_t *w, uint32_t seen, int waiting_for, const char *what);
void cpu_ring_bell(cpu_state_t *s, int rank, int ch);
/* Tell every peer that this rank gave up on the current call (naming s->culprit). */
void cpu_abort_peers(cpu_state_t *s, ep_status_t why);
void cpu_call_begin(cpu_state_t *s); /* reset per-call failure state */

/* ---- byte queues (cpu_ring.c) */
typedef struct {
  cpu_ring_t *ring;
  uint64_t pos;   /* our side's position (tail for producer, head for consumer) */
  uint64_t other; /* last seen position of the other side */
  size_t cap;
} cpu_q_t;

void cpu_q_open_send(cpu_q_t *q, cpu_ring_t *r, size_t cap);
void cpu_q_open_recv(cpu_q_t *q, cpu_ring_t *r, size_t cap);
/* Producer: room for one record of `rec` bytes? Returns its address or NULL. */
unsigned char *cpu_q_reserve(cpu_q_t *q, size_t rec);
void cpu_q_commit(cpu_q_t *q, size_t rec); /* after writing what reserve returned */
void cpu_q_publish(cpu_q_t *q);            /* make committed records visible */
/* Consumer: next record or NULL if none has arrived. */
const unsigned char *cpu_q_peek(cpu_q_t *q, size_t rec);
void cpu_q_consume(cpu_q_t *q, size_t rec);
void cpu_q_release(cpu_q_t *q); /* make consumed space visible to the producer */

/* ---- hello phase (cpu_hello.c) */
/* Post this rank's hello to every peer (fill(hello, dest, arg) writes the variable part). */
void cpu_hello_post(cpu_state_t *s, const cpu_hello_t *mine,
                    void (*fill)(cpu_state_t *s, cpu_hello_t *slot, int dest, void *arg),
                    void *arg);
/* Wait for all peers' hellos of the current call and check they agree with `mine`. */
ep_status_t cpu_hello_gather(cpu_state_t *s, const cpu_hello_t *mine, const char *op);
cpu_hello_t *cpu_hello_from(cpu_state_t *s, int src); /* in our segment, current call */
void cpu_reject(void *state);

/* ---- workers (cpu_workers.c) */
ep_status_t cpu_workers_start(cpu_state_t *s);
void cpu_workers_stop(cpu_state_t *s);
/* Run fn(s, job, c) for every channel c (channel 0 on this thread) and return the first error. */
ep_status_t cpu_run_channels(cpu_state_t *s, ep_status_t (*fn)(cpu_state_t *, void *, int),
                             void *job);

/* ---- operations */
ep_status_t cpu_layout(void *state, const ep_layout_args_t *a);
ep_status_t cpu_dispatch(void *state, ep_dispatch_call_t *c, ep_handle_info_t *out);
ep_status_t cpu_combine(void *state, const ep_combine_args_t *a, const ep_handle_info_t *h);

/* Validates expert ids and computes the layout of one call; nothing written on error. */
ep_status_t cpu_route(cpu_state_t *s, const int64_t *topk_idx, int n, int topk, int E,
                      int32_t *per_rank, int32_t *per_expert, uint8_t *in_rank, int32_t *per_host,
                      uint8_t *in_host, const char *op);

/* bf16 helpers (round to nearest even, as the reference and DeepEP do). */
static inline float cpu_bf16_to_f32(uint16_t b) {
  union {
    uint32_t u;
    float f;
  } v = {(uint32_t)b << 16};
  return v.f;
}
static inline uint16_t cpu_f32_to_bf16(float f) {
  union {
    float f;
    uint32_t u;
  } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fff; /* the canonical NaN, as CUDA gives */
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
