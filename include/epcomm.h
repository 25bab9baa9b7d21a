/*
 * epcomm — expert-parallel communication for mixture-of-experts models.
 *
 * One public header. Objects form an ownership tree:
 *
 *     ep_group_t  (the ranks of one job, bootstrap)
 *       └─ ep_buffer_t  (registered communication memory of this rank, mapped by peers)
 *            ├─ ep_mem_t        (caller memory registered with the buffer: ep_register_memory)
 *            ├─ ep_handle_t     (layout of one normal dispatch: combine, cached dispatch)
 *            └─ ep_ll_handle_t  (one low-latency result slot: its view, its combine)
 *
 * Create top-down, destroy bottom-up. Every create has exactly one destroy that frees what it
 * made. Handles are opaque identifiers, not addresses: using or destroying an object twice is
 * reported (EP_ERR_DESTROYED), never undefined behaviour.
 *
 * Collective calls must be made by every rank of the group, in the same order. Every exchange
 * carries the operation and its call number: ranks that make different calls fail with
 * EP_ERR_MISMATCH naming both; a call rejected on one rank (bad arguments) still takes part, so
 * the peers fail at once with EP_ERR_PEER_INVALID. Every wait inside a collective call has a
 * deadline (config timeout, default 100 s, EP_TIMEOUT_S overrides) and a peer that dies makes
 * the others fail within seconds (EP_ERR_PEER_FAILED); after such a failure the group is broken
 * and destroys are local.
 *
 * Processes: objects belong to the process that created them. After fork(), any use in the
 * child returns EP_ERR_FORKED (and the child's exit says nothing about them).
 *
 * Thread safety:
 *   - Different objects may be used concurrently from different threads (two buffers driven by two
 *     threads, two groups in one process).
 *   - Calls on one buffer must not overlap: a call that finds another call in flight on the same
 *     buffer returns EP_ERR_BUSY rather than corrupting state. Serialize per buffer.
 *   - Destroying an object while a call on it is in flight returns EP_ERR_BUSY.
 *   - ep_last_error() is per thread; ep_*_last_error() is per object (message with peer and phase).
 *   - All query functions (ep_status_string, ep_version, ep_group_rank, ...) are thread safe.
 *
 * Errors: every function returns an ep_status_t. On error, outputs are left untouched, the
 * calling thread's last-error message names the offending argument (and, for collective failures,
 * the operation, phase and peer rank), and the object's last error records the same.
 *
 * CUDA backend (buffer config backend EP_BACKEND_CUDA, or EP_BACKEND=cuda):
 *   - every tensor pointer is a device pointer, 16-byte aligned for x, recv_x, out and biases;
 *   - every call runs on the caller's `stream` (a cudaStream_t; NULL: the legacy default
 *     stream) and returns once its work is enqueued, so compute overlaps communication through
 *     the caller's own cudaEventRecord / cudaStreamWaitEvent on that stream. Calls on one buffer
 *     made on different streams still run in call order;
 *   - the synchronous dispatch waits on the host for the count exchange only; worst-case and
 *     cached dispatches and combine never wait on the host and can be captured in a CUDA graph
 *     (the synchronous path cannot: EP_ERR_INVALID_ARG during a capture);
 *   - kernels never trap: a kernel that gives up (deadline, peer gone, mismatch seen by its
 *     count exchange) records operation, phase and peer; a synchronous call returns it. A
 *     deadline or dead peer in an asynchronous call is returned by the next call on the buffer
 *     (which is then broken: destroy or release it); an asynchronous call that failed alike on
 *     every rank without moving data (rejected arguments, disagreement, outputs too small) is
 *     reported by a warning and in ep_buffer_last_error, and the buffer stays usable;
 *   - the kernels of all ranks sharing a GPU wait on each other, so their blocks must fit on the
 *     GPU at once: num_sms is capped at the GPU's SMs divided by the ranks on it.
 */
#ifndef EPCOMM_H
#define EPCOMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every public function carries EP_API: the library is built with hidden visibility, so these
 * are the only symbols it exports. */
#if defined(__GNUC__) || defined(__clang__)
#define EP_API __attribute__((visibility("default")))
#else
#define EP_API
#endif

/* ---------------------------------------------------------------- version */
#define EP_VERSION_MAJOR 0
#define EP_VERSION_MINOR 2
#define EP_VERSION_PATCH 0
#define EP_VERSION_CODE (EP_VERSION_MAJOR * 10000 + EP_VERSION_MINOR * 100 + EP_VERSION_PATCH)

/* Version of the library actually loaded (compare with EP_VERSION_CODE to detect mismatches). */
EP_API int ep_version(void);
EP_API const char *ep_version_string(void);

/* ---------------------------------------------------------------- status
 * X-macro: code, name, message. The one table of status codes. */
#define EP_STATUS_MAP(X)                                                                     \
  X(EP_OK, 0, "success")                                                                     \
  X(EP_ERR_INVALID_ARG, 1, "invalid argument")                                               \
  X(EP_ERR_NULL_ARG, 2, "required pointer argument is NULL")                                 \
  X(EP_ERR_OUT_OF_RANGE, 3, "value out of range")                                            \
  X(EP_ERR_SHAPE, 4, "shape not supported (divisibility or alignment)")                      \
  X(EP_ERR_TOO_LARGE, 5, "size exceeds what the buffer or config allows")                    \
  X(EP_ERR_MISMATCH, 6, "arguments disagree across ranks")                                   \
  X(EP_ERR_CONFIG, 7, "config struct has a wrong size or magic (ABI mismatch)")              \
  X(EP_ERR_NO_MEMORY, 8, "out of memory")                                                    \
  X(EP_ERR_SYSTEM, 9, "system call failed")                                                  \
  X(EP_ERR_BOOTSTRAP, 10, "bootstrap failed")                                                \
  X(EP_ERR_TIMEOUT, 11, "deadline passed while waiting for a peer")                          \
  X(EP_ERR_PEER_FAILED, 12, "a peer rank died or aborted")                                   \
  X(EP_ERR_PEER_INVALID, 13, "a peer rank rejected its arguments for this collective call")  \
  X(EP_ERR_DESTROYED, 14, "object was already destroyed")                                    \
  X(EP_ERR_BUSY, 15, "object is in use (call in flight, or live children)")                  \
  X(EP_ERR_BROKEN, 16, "object is unusable after an earlier collective failure; destroy it") \
  X(EP_ERR_UNSUPPORTED, 17, "not supported by this build or backend")                        \
  X(EP_ERR_CUDA, 18, "CUDA call failed")                                                     \
  X(EP_ERR_INTERNAL, 19, "internal error")                                                   \
  X(EP_ERR_FORKED, 20, "object used in a forked child")

typedef enum {
#define EP_STATUS_ENUM_(code, value, msg) code = value,
  EP_STATUS_MAP(EP_STATUS_ENUM_)
#undef EP_STATUS_ENUM_
      EP_STATUS_COUNT_
} ep_status_t;

EP_API const char *ep_status_name(ep_status_t s);   /* "EP_ERR_TIMEOUT" */
EP_API const char *ep_status_string(ep_status_t s); /* "deadline passed while waiting for a peer" */

/* Message of the last failing epcomm call on this thread ("" if none): successful calls leave it
 * alone (like errno). Valid until the next failing epcomm call on this thread. */
EP_API const char *ep_last_error(void);

/* ---------------------------------------------------------------- call arguments
 * Every call takes a versioned args struct: set `size` with the struct's _INIT macro, then the
 * fields you need; fields left at zero take their documented defaults. A size this library does
 * not know is EP_ERR_CONFIG. Args structs are inputs (const); results come back through a
 * separate output struct or out-parameter. */
#ifdef __cplusplus
#define EP_ARGS_INIT_(T) \
  { sizeof(T) }
#else
#define EP_ARGS_INIT_(T) \
  { .size = sizeof(T) }
#endif

/* ---------------------------------------------------------------- types */
typedef struct ep_group_s *ep_group_t;
typedef struct ep_buffer_s *ep_buffer_t;
typedef struct ep_handle_s *ep_handle_t;
typedef struct ep_mem_s *ep_mem_t;

typedef enum {
  EP_DTYPE_BF16 = 1,     /* 2 bytes */
  EP_DTYPE_FP8_E4M3 = 2, /* 1 byte, with float32 scales */
} ep_dtype_t;

typedef enum {
  EP_BACKEND_AUTO = 0, /* EP_BACKEND env, else cpu */
  EP_BACKEND_CPU = 1,
  EP_BACKEND_CUDA = 2,
} ep_backend_t;

#define EP_CONFIG_MAGIC 0x45504331u /* "EPC1" */

/* ---------------------------------------------------------------- group
 * A group is the set of ranks of one job on this host plus the means to exchange setup data. */
typedef struct {
  size_t size;        /* sizeof(ep_group_config_t) */
  uint32_t magic;     /* EP_CONFIG_MAGIC */
  double timeout_s;   /* deadline for every wait; <= 0: EP_TIMEOUT_S or 100 s */
  const char *job_id; /* rendezvous name shared by all ranks; NULL: from the environment */
} ep_group_config_t;
#define EP_GROUP_CONFIG_INIT \
  { sizeof(ep_group_config_t), EP_CONFIG_MAGIC, 0.0, NULL }

/* User-supplied bootstrap (MPI, torch.distributed, ...). Callbacks return 0 on success. Used only
 * during ep_group_create: epcomm then sets up its own local channel and never calls them again. */
typedef struct {
  int rank;
  int nranks;
  int (*allgather)(void *ctx, const void *send, void *recv, size_t bytes_per_rank);
  int (*barrier)(void *ctx);
  void *ctx;
} ep_bootstrap_t;

/* Collective. Ranks, job id and failure channel from the environment that `epcomm launch` sets
 * (EP_RANK, EP_NRANKS, EP_JOB_ID, EP_NOTIFY_FD), that torchrun sets (RANK, WORLD_SIZE; the job
 * named by MASTER_ADDR:MASTER_PORT, else TORCHELASTIC_RUN_ID), or that mpirun or srun set
 * (OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID, ...), tried in that order; EP_JOB_ID, when set,
 * names the job whatever the launcher.
 * cfg may be NULL for defaults. Every rank creates its groups in the same order. Thread safe.
 * Errors: EP_ERR_NULL_ARG (group), EP_ERR_CONFIG (cfg size/magic), EP_ERR_BOOTSTRAP (no rank or
 * job id in the environment, rendezvous taken), EP_ERR_OUT_OF_RANGE (rank >= size),
 * EP_ERR_MISMATCH (ranks disagree on the size), EP_ERR_TIMEOUT (a rank never arrived: named),
 * EP_ERR_PEER_FAILED (a rank died during creation: named), EP_ERR_INVALID_ARG (a set EP_*
 * variable has an invalid value: named with its accepted form, see ep_env_check). */
EP_API ep_status_t ep_group_create_from_env(const ep_group_config_t *cfg, ep_group_t *group);
/* Collective over the ranks the callbacks connect (the user's allgather carries a rendezvous name
 * chosen by rank 0; the callbacks are not kept). Errors as above, plus EP_ERR_NULL_ARG naming
 * boot or boot->allgather, EP_ERR_OUT_OF_RANGE naming boot->rank / boot->nranks,
 * EP_ERR_BOOTSTRAP when a callback returns non-zero. */
EP_API ep_status_t ep_group_create(const ep_bootstrap_t *boot, const ep_group_config_t *cfg,
                                   ep_group_t *group);
/* Collective, bounded by the deadline. EP_ERR_BUSY (and nothing destroyed) while buffers of this
 * group are alive (the peers' destroy then fails with EP_ERR_PEER_INVALID). After a failure broke
 * the group, local only. NULL is a no-op. */
EP_API ep_status_t ep_group_destroy(ep_group_t group);
/* Local: frees this rank's resources without talking to peers (crash paths). Live buffers of the
 * group are released too. NULL is a no-op. */
EP_API ep_status_t ep_group_release(ep_group_t group);
/* Local, thread safe. EP_ERR_NULL_ARG, EP_ERR_DESTROYED, EP_ERR_INVALID_ARG (not a group). */
EP_API ep_status_t ep_group_rank(ep_group_t group, int *rank);
EP_API ep_status_t ep_group_nranks(ep_group_t group, int *nranks);
/* Collective barrier with the group's deadline. EP_ERR_TIMEOUT / EP_ERR_PEER_FAILED name the rank
 * (and break the group: only destroy/release remain), EP_ERR_BROKEN after an earlier failure. */
EP_API ep_status_t ep_group_barrier(ep_group_t group);
/* Collective: recv[r * bytes ...] receives rank r's `bytes` bytes (small setup data, figures).
 * `bytes` must be the same on every rank (EP_ERR_MISMATCH); a NULL pointer is named and the
 * peers get EP_ERR_PEER_INVALID. */
EP_API ep_status_t ep_group_allgather(ep_group_t group, const void *send, void *recv, size_t bytes);
/* Last error recorded on this group (operation, phase, peer); "" if none. */
EP_API const char *ep_group_last_error(ep_group_t group);

/* Where the ranks of a group run. A group spans hosts when its ranks are on several machines
 * (under mpirun or srun), when EP_HOST_ID names hosts, or when EP_HOSTS=H splits the job into H
 * pretend hosts (tests). Ranks of one host share memory; between hosts a network engine (MPI
 * for cpu buffers, NCCL for cuda) carries the data, each token once per host
 * (docs/SEMANTICS.md §3.9). Hosts are numbered by their lowest rank, and a rank's local rank is
 * its index among the ranks of its host. */
typedef struct {
  size_t size; /* in: sizeof(ep_group_info_t): EP_GROUP_INFO_INIT */
  int rank, nranks;
  int nhosts, host;           /* hosts of the group; this rank's (0 .. nhosts-1) */
  int local_rank, local_size; /* every host holds local_size ranks */
} ep_group_info_t;
#define EP_GROUP_INFO_INIT EP_ARGS_INIT_(ep_group_info_t)
/* Local, thread safe. info->size must be set. */
EP_API ep_status_t ep_group_query(ep_group_t group, ep_group_info_t *info);

/* ---------------------------------------------------------------- buffer */
typedef struct {
  size_t size;    /* sizeof(ep_buffer_config_t) */
  uint32_t magic; /* EP_CONFIG_MAGIC */
  ep_backend_t backend;
  /* Normal mode: bytes of each per-(peer, channel) queue; 0: EP_QUEUE_BYTES or 1 MiB. Any number
   * of tokens fits: a larger dispatch takes more trips through the queue.
   * CUDA: the buffer holds a receive area and a combine area of R x num_channels x queue_bytes
   * each; a dispatch whose rows do not fit the receive area at once goes in windows (then it
   * needs caller outputs, not views), a combine whose rows do not fit goes in rounds. */
  size_t queue_bytes;
  /* Channels per rank: the token range is split into this many slices, each moved by its own
   * worker (threads on the CPU backend, thread blocks on CUDA). 0: EP_CHANNELS or 1. */
  int num_channels;
  /* Low-latency sizing (T, H, E all 0: low-latency mode disabled; otherwise all three >= 1,
   * H a multiple of 8, E divisible by the number of ranks R). The low-latency region of one
   * rank's buffer takes, with L = E/R and K = ll_max_topk (docs/LOW_LATENCY.md has the exact
   * layout; ep_buffer_size_hint gives the exact total), at most:
   *     2 x ( E*T*(4H + 8) + 2*T*K*H )  +  O(R*E) bytes of counters and flags
   * i.e. two result slots, each an expert-major slab [L][R*T] of bf16 rows, the zero-copy
   * combine input of the same shape (ep_ll_get_combine_buffer), 8 bytes of per-row metadata,
   * and (CPU) a combine receive area [T][K] of bf16 rows. On the CPU backend the pages are only
   * backed by memory once a row is written there. */
  int ll_max_tokens;  /* T: tokens per rank per call */
  int ll_hidden;      /* H */
  int ll_num_experts; /* E */
  int ll_max_topk;    /* K: largest topk of a call; 0: 16 */
  double timeout_s;   /* <= 0: inherit the group's */
  /* CUDA backend */
  int cuda_device; /* -1: EP_CUDA_DEVICE, else the local rank modulo the devices, else current */
  int num_sms;     /* thread blocks (one per SM) of the data kernels; 0: EP_CUDA_SMS, else 24
                      (normal mode) or the rank's share of its GPU's SMs (low-latency mode) */
} ep_buffer_config_t;
#define EP_BUFFER_CONFIG_INIT \
  { sizeof(ep_buffer_config_t), EP_CONFIG_MAGIC, EP_BACKEND_AUTO, 0, 0, 0, 0, 0, 0, 0.0, -1, 0 }

/* Bytes of shared memory (CUDA: device memory) one rank's buffer takes for this config and
 * group size. Local. */
EP_API ep_status_t ep_buffer_size_hint(const ep_buffer_config_t *cfg, int nranks, size_t *bytes);
/* Collective: allocate this rank's region, exchange it with peers, map theirs. Buffers of one
 * group may be created from different threads (their exchanges are serialised). Errors:
 * EP_ERR_NULL_ARG (buf), EP_ERR_CONFIG (cfg size/magic), EP_ERR_OUT_OF_RANGE / EP_ERR_INVALID_ARG
 * naming the cfg field, EP_ERR_UNSUPPORTED (backend not built, or no device), EP_ERR_MISMATCH
 * (configs differ across ranks: field and rank named), EP_ERR_NO_MEMORY, EP_ERR_PEER_INVALID (a
 * peer failed to create its part), EP_ERR_TIMEOUT / EP_ERR_PEER_FAILED (rank named),
 * EP_ERR_BROKEN (group broken), EP_ERR_INVALID_ARG (an invalid EP_* value, as at group
 * creation: the environment is read again here), EP_ERR_TOO_LARGE (a CPU segment larger than
 * the host's memory). A config rejected on one rank still takes part in the exchange: the peers
 * fail with EP_ERR_PEER_INVALID instead of pairing with a later create. */
EP_API ep_status_t ep_buffer_create(ep_group_t group, const ep_buffer_config_t *cfg,
                                    ep_buffer_t *buf);
/* Collective, bounded by the deadline: quiesce, unmap peers, free. Always frees: a broken buffer
 * skips the barrier (EP_OK); a barrier that fails still frees and returns the failure. Live
 * handles stay valid memory for ep_handle_destroy but can no longer be used with any buffer.
 * NULL is a no-op. EP_ERR_BUSY (nothing freed) while a call on the buffer is in flight;
 * EP_ERR_DESTROYED when already destroyed. */
EP_API ep_status_t ep_buffer_destroy(ep_buffer_t buf);
/* Local, never waits for peers (crash paths, after EP_ERR_PEER_FAILED). NULL is a no-op. */
EP_API ep_status_t ep_buffer_release(ep_buffer_t buf);
/* Last failure recorded on this buffer ("op: phase: message (peer rank r, STATUS)"); "" if none.
 * Thread safe; the string is a per-thread copy. */
EP_API const char *ep_buffer_last_error(ep_buffer_t buf);

/* Local, thread safe. 1 when the backend is built into this library and can create buffers
 * here (CUDA: a driver and a device); else 0, and ep_last_error() says why. EP_BACKEND_AUTO asks
 * about the backend AUTO resolves to (EP_BACKEND, else cpu). */
EP_API int ep_backend_available(ep_backend_t backend);

/* What a buffer can do, and how long the memory it hands out stays valid. */
typedef enum {
  EP_CAP_DISPATCH_VIEWS = 1u << 0,  /* ep_dispatch with EP_OUTPUT_VIEWS */
  EP_CAP_LOW_LATENCY = 1u << 1,     /* ep_ll_* (and the buffer was created with ll sizes) */
  EP_CAP_DEVICE_MEMORY = 1u << 2,   /* tensors are device pointers, calls are ordered on `stream` */
  EP_CAP_GRAPH_CAPTURE = 1u << 3,   /* calls that never wait on the host can be captured in a
                                       CUDA graph (worst-case and cached dispatch, combine, every
                                       low-latency call) */
  EP_CAP_COMBINE_BUFFER = 1u << 4,  /* ep_get_combine_buffer: a combine input inside the buffer */
  EP_CAP_REGISTER_MEMORY = 1u << 5, /* ep_register_memory makes caller memory readable by the
                                       peers in place (every backend accepts the call) */
} ep_cap_t;

typedef enum {
  EP_LIFETIME_NONE = 0,          /* the buffer hands out no such memory */
  EP_LIFETIME_NEXT_DISPATCH = 1, /* valid until the next ep_dispatch on the buffer */
  EP_LIFETIME_HANDLE = 2,        /* valid until the handle that carries it is destroyed */
} ep_lifetime_t;

typedef struct {
  size_t size;          /* in: sizeof(ep_buffer_info_t) */
  ep_backend_t backend; /* resolved: never EP_BACKEND_AUTO */
  unsigned caps;        /* EP_CAP_* */
  int rank, nranks;
  ep_lifetime_t dispatch_view_lifetime; /* views of EP_OUTPUT_VIEWS */
  ep_lifetime_t ll_view_lifetime;       /* ep_ll_get_recv_view */
  size_t bytes;                         /* what ep_buffer_size_hint says for this buffer */
  ep_buffer_config_t config;            /* resolved: defaults and environment applied */
  /* Added after API 0.2 (at the end: a 0.2-sized struct gets the fields it has): hosts, and the
   * bytes this rank has sent since the buffer was created, through the network engine (to other
   * hosts) and through memory shared with the ranks of its host. */
  int nhosts, host, local_rank, local_size;
  uint64_t net_bytes_sent;
  uint64_t local_bytes_sent;
  /* Normal-mode calls since the buffer was created that moved rows without a staging pass on a
   * backend that otherwise stages (CUDA): combines whose x the peers read where it lies (a view,
   * ep_get_combine_buffer's memory, registered memory), dispatches whose caller recv_x the
   * senders wrote straight into (registered memory). 0 on backends that always work in place
   * (CPU). So a program, or a test, can tell the fast path from a silent fallback. */
  uint64_t combines_in_place;
  uint64_t dispatches_in_place;
  /* Dispatches on the allocator path that moved their rows before the allocation
   * (EP_CUDA_EARLY_DATA=1 on CUDA; 0 elsewhere): so a test can tell that the path ran. */
  uint64_t dispatches_early;
  /* Dispatches whose receivers pulled their rows from the sources' staged tokens instead of
   * the senders pushing every row (EP_CUDA_PULL on CUDA, counted by the GPU; 0 elsewhere). */
  uint64_t dispatches_pulled;
  /* Combines whose x the peers could not read where it lies (not a view, the combine buffer or
   * registered memory) and that copied it into the combine buffer before the kernel
   * (EP_CUDA_COMBINE_COPY on CUDA, a cudaMemcpyAsync; 0 elsewhere) instead of staging it on the
   * rank's SMs. */
  uint64_t combines_copied;
} ep_buffer_info_t;
#define EP_BUFFER_INFO_INIT EP_ARGS_INIT_(ep_buffer_info_t)

/* Local, thread safe. info->size must be set (EP_BUFFER_INFO_INIT). */
EP_API ep_status_t ep_buffer_query(ep_buffer_t buf, ep_buffer_info_t *info);

/* ---------------------------------------------------------------- layout */
typedef struct {
  size_t size;             /* sizeof(ep_layout_args_t): EP_LAYOUT_ARGS_INIT */
  const int64_t *topk_idx; /* [num_tokens][topk] int64, -1 = unused slot */
  int num_tokens;
  int topk;
  int num_experts;
  void *stream; /* cudaStream_t on backends with EP_CAP_DEVICE_MEMORY */
  /* outputs, caller memory, each optional (NULL: not computed) */
  int32_t *tokens_per_rank;   /* [R] tokens that go to each rank (once per rank) */
  int32_t *tokens_per_expert; /* [E] selections of each expert */
  uint8_t *is_token_in_rank;  /* [num_tokens][R] 0/1 */
  /* Added after API 0.2, at the end (a 0.2-sized struct is still accepted): hosts of the group
   * (ep_group_query), as DeepEP's num_tokens_per_rdma_rank and is_token_in_rdma_rank; one host
   * when the group does not span hosts. */
  int32_t *tokens_per_host;  /* [nhosts] tokens that go to each host (once per host) */
  uint8_t *is_token_in_host; /* [num_tokens][nhosts] 0/1 */
  /* Added after API 0.2: non-zero on a device backend: the call returns once its kernel is
   * queued, without waiting for it (as DeepEP's). A bad id then leaves the outputs untouched and
   * is not reported here: a synchronous dispatch that takes these ids returns
   * EP_ERR_OUT_OF_RANGE naming the slot; a worst-case one, which does not wait, moves nothing
   * and the buffer's next call logs the error as a warning. The wait costs a whole drain of
   * the stream: ~60-200 us of host time per MoE layer step at small batches on the H200.
   * Ignored on the CPU (always checked). */
  int no_wait;
} ep_layout_args_t;
#define EP_LAYOUT_ARGS_INIT EP_ARGS_INIT_(ep_layout_args_t)

/* Local. Ids < -1 or >= num_experts: EP_ERR_OUT_OF_RANGE naming the first offending slot
 * ("topk_idx[3][1]"), outputs untouched. On the CUDA backend the call is ordered on `stream`
 * and waits for its (small) kernel so that it can report a bad id, except with `no_wait` or
 * during a graph capture, where a bad id leaves the outputs untouched and is not reported. */
EP_API ep_status_t ep_get_dispatch_layout(ep_buffer_t buf, const ep_layout_args_t *args);

/* ---------------------------------------------------------------- normal dispatch
 * Inputs: one tensor of tokens x [num_tokens][hidden] (bf16, or fp8 e4m3 with float32 scales),
 * each sent once to every rank that owns one of its topk experts (docs/SEMANTICS.md §3 has the
 * exact order of the rows). */
typedef struct {
  size_t size;      /* sizeof(ep_dispatch_args_t): EP_DISPATCH_ARGS_INIT */
  const void *x;    /* [num_tokens][hidden] of dtype */
  ep_dtype_t dtype; /* required: EP_DTYPE_BF16 or EP_DTYPE_FP8_E4M3 */
  int num_tokens;
  int hidden;
  const float *x_scales;       /* fp8 only: [num_tokens][num_scales], strides in elements */
  int num_scales;              /* 0: ceil(hidden / 128) */
  int64_t scale_token_stride;  /* 0: num_scales */
  int64_t scale_hidden_stride; /* 0: 1 */
  const int64_t *topk_idx;     /* [num_tokens][topk], -1 = unused; ignored in a cached dispatch */
  const float *topk_weights;   /* [num_tokens][topk] or NULL; ignored in a cached dispatch */
  int topk;
  int num_experts;
  int expert_alignment; /* recv_tokens_per_expert rounded up to a multiple; 0 or 1: none */
  /* Cached dispatch: resend new x (and scales) along the layout of an earlier dispatch of this
   * buffer (no count exchange). num_tokens, hidden, dtype and num_scales must be those of that
   * dispatch; routing and weights are taken from the handle and not returned again. */
  ep_handle_t cached;
  void *stream; /* cudaStream_t on backends with EP_CAP_DEVICE_MEMORY */
} ep_dispatch_args_t;
#define EP_DISPATCH_ARGS_INIT EP_ARGS_INIT_(ep_dispatch_args_t)

/* Where the received rows go. The mode is required (0 is an error). */
typedef enum {
  /* Caller arrays of `capacity` rows. The call learns the receive count before returning (on the
   * CUDA backend the host waits for the count exchange, unless worst_case is set); more rows
   * than `capacity`: EP_ERR_TOO_LARGE on this rank, rows drained, outputs untouched. */
  EP_OUTPUT_CALLER = 1,
  /* The `alloc` callback is called once the receive count is known, on the calling thread,
   * before any row is written; it sets the row arrays of `out` (they start NULL). `args` is the
   * call's resolved copy: num_scales and the scale strides defaulted; for a cached dispatch topk
   * and num_experts are the handle's and topk_idx / topk_weights are NULL. Non-zero from the
   * callback, or a NULL recv_x for a non-zero count: EP_ERR_NO_MEMORY, rows drained. */
  EP_OUTPUT_ALLOC = 2,
  /* The row arrays are set by the call to memory inside the buffer, where the senders wrote each
   * row at its final place (no copy); backends with EP_CAP_DISPATCH_VIEWS. Valid as the
   * buffer's dispatch_view_lifetime says (EP_LIFETIME_NEXT_DISPATCH), and writable: a bf16
   * recv_x overwritten in place by the experts is a combine input that is not copied again. */
  EP_OUTPUT_VIEWS = 3,
} ep_output_mode_t;

typedef struct ep_dispatch_out_s ep_dispatch_out_t;
typedef int (*ep_alloc_fn)(void *ctx, const ep_dispatch_args_t *args, int num_recv_tokens,
                           ep_dispatch_out_t *out);
/* ep_dispatch_out_t.on_wait: one step of the caller's own work; non-zero asks for the next. */
typedef int (*ep_wait_fn)(void *ctx, int step);

struct ep_dispatch_out_s {
  size_t size;           /* sizeof(ep_dispatch_out_t): EP_DISPATCH_OUT_INIT */
  ep_output_mode_t mode; /* required */
  /* Worst-case form (CALLER or VIEWS): the outputs always hold `capacity` rows and the call
   * never waits on the host (capturable in a CUDA graph); rows past the receive count have topk
   * ids -1, weights 0 and source index -1. On backends with device memory the count is then not
   * known on return: num_recv_tokens says -1 and rank_prefix[R-1][rank] has it. */
  int worst_case;
  int capacity;      /* rows of the caller's arrays (CALLER), or worst-case rows */
  ep_alloc_fn alloc; /* EP_OUTPUT_ALLOC */
  void *alloc_ctx;
  /* Row arrays: given by the caller (CALLER: recv_x required, the others optional, NULL = not
   * wanted), set by alloc (ALLOC), or set by the call (VIEWS: all of them, recv_x_scales for
   * fp8, recv_topk_idx and recv_topk_weights for a non-cached dispatch with weights). */
  void *recv_x;             /* [rows][hidden] of dtype */
  float *recv_x_scales;     /* [rows][num_scales], fp8 only */
  int64_t *recv_topk_idx;   /* [rows][topk]: local expert ids (0 .. E/R-1), -1 elsewhere */
  float *recv_topk_weights; /* [rows][topk] */
  int32_t *recv_src_idx;    /* [rows]: the row's token index in its source rank */
  /* Caller memory in every mode, optional; on a device backend device memory, or for
   * recv_tokens_per_expert also host memory the device writes (page-locked: cudaHostAlloc,
   * cudaMallocHost, a pinned tensor), which a synchronous call (num_recv_tokens >= 0 on return)
   * has written when it returns: no synchronisation needed to read it, as DeepEP's
   * num_recv_tokens_per_expert_list. */
  int32_t *rank_prefix;            /* [R][R]: [i][j] = tokens ranks 0..i send to rank j */
  int32_t *recv_tokens_per_expert; /* [E/R] (not for a cached dispatch) */
  /* Results, written on success only */
  int num_recv_tokens; /* rows received; -1 when not known on return (see worst_case) */
  ep_handle_t handle;  /* the dispatch's layout, for combine and cached dispatch. Every
                          non-cached dispatch makes one and the caller owns it: destroy it
                          (ep_handle_destroy) even when it is not used (on CUDA handles
                          hold device memory from a fixed arena). NULL after a cached
                          dispatch (the cached handle stays valid). */
  /* Added after API 0.2, at the end (a struct of the 0.2 size, which ends at `handle`, is still
   * accepted). Optional: the caller's own work for the time the host would otherwise spin.
   * Where a synchronous call's host waits for a device to publish the receive count (the CUDA
   * backend on one host), the call, once the count exchange is queued, calls
   * on_wait(on_wait_ctx, 0), (.., 1), ... on the calling thread while the count is not in yet,
   * until on_wait returns 0, 64 steps have run, or an error is posted; then it waits as usual.
   * So it may run no step at all. Each step should be short (one allocation, say): the count
   * is checked between steps, never during one, and the call's deadline and its check for dead
   * peers start after the steps. on_wait must not call into this buffer (such a call fails
   * with EP_ERR_BUSY) and must return normally; its steps run whether the call then succeeds
   * or not. Not called where the host has nothing to wait for (the CPU backend moves the rows
   * itself, a worst-case dispatch does not wait, a cached dispatch knows its count). The Python
   * package allocates its next calls' outputs there. */
  ep_wait_fn on_wait;
  void *on_wait_ctx;
};
#define EP_DISPATCH_OUT_INIT EP_ARGS_INIT_(ep_dispatch_out_t)

/* Collective. Rows arrive grouped by source rank, each source's rows in its token order, each at
 * its final row. Outputs and results are written only on success. Errors found on this rank
 * before any data moves (the peers' matching call then fails with EP_ERR_PEER_INVALID, the
 * buffer stays usable): EP_ERR_NULL_ARG / EP_ERR_INVALID_ARG / EP_ERR_OUT_OF_RANGE /
 * EP_ERR_SHAPE / EP_ERR_TOO_LARGE / EP_ERR_CONFIG, each naming the argument (an out-of-range
 * expert id by its slot, "topk_idx[3][1]"). Detected collectively, on every rank alike:
 * EP_ERR_MISMATCH (hidden, dtype, topk, num_experts, num_scales or weights differ across ranks:
 * field and rank named), EP_ERR_PEER_INVALID. After the count exchange: EP_ERR_TOO_LARGE when
 * the rows exceed `capacity` (drained, outputs untouched, the buffer stays usable).
 * EP_ERR_TIMEOUT / EP_ERR_PEER_FAILED name the rank and break the buffer. */
EP_API ep_status_t ep_dispatch(ep_buffer_t buf, const ep_dispatch_args_t *args,
                               ep_dispatch_out_t *out);

/* ---------------------------------------------------------------- normal combine */
typedef struct {
  size_t size;               /* sizeof(ep_combine_args_t): EP_COMBINE_ARGS_INIT */
  ep_handle_t handle;        /* from this rank's matching (non-cached) dispatch */
  const void *x;             /* bf16 [rows][hidden] in the row order of the dispatch output;
                                CUDA: when x lies in the buffer's receive area (a bf16 dispatch
                                view written in place) or is ep_get_combine_buffer's memory,
                                peers read it where it is; otherwise it is first copied into the
                                buffer (one more pass over the rows) */
  const float *topk_weights; /* [rows][topk] or NULL */
  const void *bias[2];       /* bf16 [num_tokens][hidden] each, or NULL */
  void *stream;
  /* outputs, caller memory */
  void *out;               /* bf16 [num_tokens][hidden] */
  float *out_topk_weights; /* [num_tokens][topk], required iff topk_weights given */
} ep_combine_args_t;
#define EP_COMBINE_ARGS_INIT EP_ARGS_INIT_(ep_combine_args_t)

/* Collective (docs/SEMANTICS.md §4.2). out[t] = bf16(bias0[t] + bias1[t] + sum over ranks r
 * (ascending) of the x rows of
 * token t), accumulated in fp32 and rounded once (nearest even); a token sent nowhere gets its
 * biases (or zeros). out_topk_weights[t] = the sum, in the same order, of the topk_weights rows
 * of t. Errors as for ep_dispatch; EP_ERR_INVALID_ARG / EP_ERR_DESTROYED for a handle that is
 * not a live handle of this buffer. */
EP_API ep_status_t ep_combine(ep_buffer_t buf, const ep_combine_args_t *args);

/* Local. Memory inside the buffer shaped like the combine input x of `handle` (bf16
 * [rows][hidden], rows = the handle's dispatch output rows, in their order): write the experts'
 * outputs there and pass *x as args->x of the combine along `handle`; the peers then read the
 * rows where they are (CUDA: no staging pass, the speed of x = a bf16 dispatch view, also after
 * an fp8 dispatch). Valid until the next ep_combine on the buffer (whatever its handle) or the
 * buffer's destroy; other dispatches leave it alone. Backends with EP_CAP_COMBINE_BUFFER.
 * EP_ERR_TOO_LARGE when the buffer's combine area cannot hold the rows (raise queue_bytes: the
 * area is R x num_channels x queue_bytes); EP_ERR_UNSUPPORTED on other backends (the CPU backend
 * reads any x where it is). */
EP_API ep_status_t ep_get_combine_buffer(ep_buffer_t buf, ep_handle_t handle, void **x);

/* ---------------------------------------------------------------- registered memory
 * Caller memory that the peers may read where it lies (NCCL's ncclCommRegister). A combine whose
 * x lies entirely inside a range this rank registered with the buffer is read by the peers in
 * place (CUDA: the speed of x = a dispatch view, with no staging pass), whatever tensor it is:
 * register the experts' output tensor once and combine from it call after call. Results are
 * the same bits with or without a registration: only where the rows are read changes.
 * Likewise a normal-mode dispatch into caller arrays (EP_OUTPUT_CALLER) whose recv_x lies, for
 * all `capacity` rows, inside a registration of the receiving rank has its rows written there by
 * the senders (CUDA: no copy-out pass for x; the other arrays are copied as before). With
 * EP_CUDA_LATE_HELLO=1 the same holds for the recv_x an allocator (EP_OUTPUT_ALLOC) returns: its
 * data kernel tells the senders where it lies before they write (off by default for now).
 *
 * Collective: every rank of the buffer's group registers (and deregisters) in the same order,
 * each its own range (sizes may differ). A rank whose call is rejected (bad arguments) still
 * takes part, so the peers fail with EP_ERR_PEER_INVALID; ranks in different calls (one
 * registers while another deregisters, or they deregister different registrations) fail with
 * EP_ERR_MISMATCH. A registration lives until ep_deregister_memory or the buffer's destroy
 * (which undoes every registration left, silently; the handle is then EP_ERR_DESTROYED). The
 * memory must stay allocated while registered; writing it between calls is the caller's
 * business (it is read by the combines that name it). At most 64 registrations per buffer.
 *
 * CUDA backend (EP_CAP_REGISTER_MEMORY): ptr is device memory of the buffer's device from
 * cudaMalloc (a PyTorch tensor from its caching allocator is such memory). The allocation that
 * holds it is exported with CUDA IPC and mapped by every peer (an allocation registered twice
 * is mapped once). Memory CUDA IPC cannot export (cudaMallocAsync pools, the virtual memory
 * API: PyTorch's expandable segments, managed or host memory) is EP_ERR_UNSUPPORTED on every
 * rank: combine from such memory keeps working through the staging path.
 * CPU backend: the call records the range and changes nothing else (the CPU backend already
 * reads any x where it is). */

/* Collective. Registers [ptr, ptr + bytes) of this rank and sets *mem. Errors: EP_ERR_NULL_ARG
 * (mem, ptr), EP_ERR_OUT_OF_RANGE (bytes 0, a range that wraps around, or one that runs past the
 * end of its CUDA allocation), EP_ERR_TOO_LARGE (64 registrations alive), EP_ERR_INVALID_ARG
 * (CUDA: not device memory of the buffer's device), EP_ERR_UNSUPPORTED (CUDA: memory that CUDA
 * IPC cannot export, named), EP_ERR_PEER_INVALID (a peer rejected or failed its part),
 * EP_ERR_MISMATCH (a peer is in another call), EP_ERR_CUDA (a peer's memory cannot be mapped),
 * EP_ERR_TIMEOUT / EP_ERR_PEER_FAILED (rank named), EP_ERR_BUSY (a call on the buffer in
 * flight). Nothing is registered on any rank unless every rank succeeds. */
EP_API ep_status_t ep_register_memory(ep_buffer_t buf, void *ptr, size_t bytes, ep_mem_t *mem);

/* Collective, bounded by the deadline: waits for this rank's work on the buffer (CUDA: the
 * combines that read the range), unmaps the peers' ranges, then a barrier, so that no rank
 * frees its memory while a peer may still read it. Errors: EP_ERR_NULL_ARG (mem),
 * EP_ERR_DESTROYED (deregistered already, or its buffer destroyed), EP_ERR_INVALID_ARG (mem of
 * another buffer, or not a registration), EP_ERR_MISMATCH (the ranks deregister different
 * registrations: both named), EP_ERR_TIMEOUT / EP_ERR_PEER_FAILED. A failure after the exchange
 * still undoes this rank's part. */
EP_API ep_status_t ep_deregister_memory(ep_buffer_t buf, ep_mem_t mem);

/* Handle queries and destroy (local, thread safe). Destroying a handle whose calls are still
 * queued on the GPU is safe: its device memory is reused only by later calls on the buffer,
 * which run after them (a call captured in a graph runs where the graph is launched: order
 * that launch yourself). A CUDA graph that captured a call with the handle must not be replayed
 * after the handle is destroyed (the graph would read memory another handle may hold). */
EP_API ep_status_t ep_handle_num_recv_tokens(ep_handle_t h, int *num_recv_tokens);
EP_API ep_status_t ep_handle_destroy(ep_handle_t h);

/* ---------------------------------------------------------------- low-latency mode
 * docs/LOW_LATENCY.md (with an example) and docs/SEMANTICS.md §6. Shapes are fixed at buffer
 * creation (T = ll_max_tokens, H = ll_hidden, E = ll_num_experts, K = ll_max_topk; L = E/R local
 * experts).
 *
 * Results live in the buffer (zero copy: senders write rows straight into the receiver's slab)
 * and are double-buffered: each ep_ll_dispatch takes one of two result slots and its handle
 * (an ep_ll_handle_t, distinct from normal mode's) keeps it until ep_ll_handle_destroy. With two
 * low-latency handles alive, the next ep_ll_dispatch returns EP_ERR_BUSY (and the peers'
 * matching call EP_ERR_PEER_INVALID); nothing is overwritten.
 *
 * Every ll call (ep_ll_dispatch, ep_ll_combine) is collective: all ranks make the same sequence
 * of them on a buffer. Normal-mode calls may be interleaved freely (separate memory and signals).
 * A call rejected on one rank (bad arguments, EP_ERR_BUSY) fails on every rank (the others get
 * EP_ERR_PEER_INVALID) and the buffer stays usable; destroy the handles of a failed call.
 *
 * Two-phase form (two_phase = 1): the call only sends (writes this rank's rows into the peers'
 * buffers and raises their flags) and returns; ep_ll_recv(buf, handle) later completes the
 * receive. In between epcomm does no work at all (no thread, no spinning), so the transfer
 * overlaps the caller's compute. The send phase of a dispatch waits for one thing: every rank
 * entering the same call (their counts fix where this rank's rows go; their entry says their
 * result slot is free). The send phase of a combine never waits. two_phase = 0 does both phases
 * in one call. Keep the send's inputs (x, topk_idx; y, topk_weights) unchanged until
 * ep_ll_recv: the CUDA backend's send runs beside the caller's later kernels and reads them.
 *
 * CUDA backend (docs/LOW_LATENCY.md): every call is queued on its stream (ep_ll_recv on the
 * stream of the call it completes) and never waits on the host for data. Outside a graph
 * capture the host waits for a call's verdict only (dispatch: the count exchange, so that a
 * peer's rejection or a bad id is returned by this call and the receive count is known;
 * combine: its own check and, when it receives, the peers' flags). In a capture, or with
 * EP_CUDA_LL_ASYNC=1, it never waits: ep_ll_handle_num_recv_tokens says -1 (recv_count on the
 * device has the counts) and the next call finds a failure: one that moved no data (a rejection,
 * a disagreement, a bad id) is logged as a warning naming that call and the next call goes on;
 * a deadline or a dead peer breaks the buffer and is returned. Dispatch and combine, one-
 * or two-phase, can be captured in a CUDA graph and replayed with new inputs of the same shapes
 * (counters advance on the device); the captured handle keeps its result slot while the graph
 * may be replayed. */
typedef struct ep_ll_handle_s *ep_ll_handle_t;

/* Layout of the fp8 scales of a low-latency dispatch's view (docs/SEMANTICS.md §6.4). */
typedef enum {
  EP_SCALES_ROW_MAJOR = 0, /* [L][R*T][H/128]: float, or with use_ue8m0 one exponent byte each */
  EP_SCALES_COL_MAJOR = 1, /* [L][H/128][R*T] float, or with use_ue8m0 [L][H/512][R*T] int32 of
                              four exponent bytes (block 4j+i in byte i; H % 512 == 0): what
                              masked grouped GEMMs read (DeepEP's layout) */
} ep_scale_layout_t;

typedef struct {
  size_t size;             /* sizeof(ep_ll_dispatch_args_t): EP_LL_DISPATCH_ARGS_INIT */
  const void *x;           /* bf16 [num_tokens][H] */
  int num_tokens;          /* 0 <= num_tokens <= T; may differ across ranks */
  const int64_t *topk_idx; /* [num_tokens][topk]: expert ids in [0, E), or -1 (slot unused);
                              an expert at most once per token */
  int topk;                /* 1 <= topk <= K, the same on all ranks */
  int use_fp8; /* cast rows to fp8 e4m3 with one float32 scale per 128 channels (H % 128 == 0) */
  int round_scale;  /* fp8 scales are powers of two (requires use_fp8) */
  int use_ue8m0;    /* store only the scales' exponent bytes (requires round_scale) */
  int two_phase;    /* 1: only send; complete with ep_ll_recv(buf, handle) */
  void *stream;     /* cudaStream_t on backends with EP_CAP_DEVICE_MEMORY; the receive of a
                       two-phase call (ep_ll_recv) runs on the same stream */
  int scale_layout; /* ep_scale_layout_t of the fp8 scales (use_fp8), the same on all ranks */
} ep_ll_dispatch_args_t;
#define EP_LL_DISPATCH_ARGS_INIT EP_ARGS_INIT_(ep_ll_dispatch_args_t)

/* What a dispatch delivered to this rank: pointers into the buffer, valid as the buffer's
 * ll_view_lifetime says (EP_LIFETIME_HANDLE: until the handle, or the buffer, is destroyed).
 * Rows of local expert l are ordered by source rank, then by the source's token order; rows
 * past recv_count[l] are unspecified. */
typedef struct {
  size_t size;           /* in: sizeof(ep_ll_recv_view_t): EP_LL_RECV_VIEW_INIT */
  int num_local_experts; /* L = E/R */
  int max_rows;          /* R*T row slots per local expert */
  int hidden;            /* H */
  int num_scales;        /* H/128 when use_fp8, else 0 */
  int use_fp8, round_scale, use_ue8m0;
  void *recv_x;                     /* [L][R*T][H] bf16, or fp8 e4m3 (1 byte) when use_fp8 */
  void *recv_x_scales;              /* use_fp8: float [L][R*T][H/128], or with use_ue8m0 uint8
                                       [L][R*T][H/128] biased exponents (e + 127); else NULL. With
                                       scale_layout EP_SCALES_COL_MAJOR: [L][H/128][R*T] float, or
                                       int32 [L][H/512][R*T] of four exponent bytes */
  const int32_t *recv_count;        /* [L] rows received per local expert: the count array of
                                       masked grouped GEMMs */
  const int32_t *recv_src_info;     /* [L][R*T] the row's token index in its source rank */
  const int64_t *recv_layout_range; /* [L][R]: (begin << 32) | count of the rows from rank r */
  int scale_layout;                 /* ep_scale_layout_t of recv_x_scales */
} ep_ll_recv_view_t;
#define EP_LL_RECV_VIEW_INIT EP_ARGS_INIT_(ep_ll_recv_view_t)

/* Collective. Sends one row per (token, selected expert) to the rank that owns the expert; with
 * two_phase = 0 also waits for this rank's rows. Sets *handle on success.
 * Errors (nothing written, peers fail with EP_ERR_PEER_INVALID): EP_ERR_NULL_ARG, EP_ERR_TOO_LARGE
 * (num_tokens > T, topk > K), EP_ERR_OUT_OF_RANGE (an expert id < -1 or >= E), EP_ERR_INVALID_ARG
 * (an expert twice in one token; flags; low-latency mode disabled), EP_ERR_SHAPE (fp8 with
 * H % 128 != 0), EP_ERR_BUSY (two ll handles alive), EP_ERR_MISMATCH (topk or fp8 flags differ
 * across ranks). Waits: EP_ERR_TIMEOUT, EP_ERR_PEER_FAILED (the buffer is then broken). */
EP_API ep_status_t ep_ll_dispatch(ep_buffer_t buf, const ep_ll_dispatch_args_t *args,
                                  ep_ll_handle_t *handle);

/* Completes the receive phase of the two-phase call last made with `handle` (dispatch: this
 * rank's rows have all arrived, the view is ready; combine: `out` is written). Waits, bounded by
 * the deadline, only for the peers' send phases of that call. EP_ERR_INVALID_ARG when the
 * handle has nothing to receive. */
EP_API ep_status_t ep_ll_recv(ep_buffer_t buf, ep_ll_handle_t handle);

/* Local. The receive side of a dispatch. view->size must be set. After a two-phase send and
 * before ep_ll_recv the view already names the arrays the rows will land in (their addresses
 * never change), but their contents, recv_count included, are defined only once the receive is
 * complete. EP_ERR_INVALID_ARG for a handle whose call failed; EP_ERR_DESTROYED when the buffer
 * is gone. */
EP_API ep_status_t ep_ll_get_recv_view(ep_ll_handle_t handle, ep_ll_recv_view_t *view);

typedef struct {
  size_t size;               /* sizeof(ep_ll_combine_args_t): EP_LL_COMBINE_ARGS_INIT */
  ep_ll_handle_t handle;     /* from ep_ll_dispatch, receive complete; one combine per handle */
  const void *y;             /* bf16 [L][R*T][H] expert outputs in the view's row order: caller
                                memory, the view's recv_x after a bf16 dispatch, or (zero copy)
                                exactly the pointer ep_ll_get_combine_buffer gave for this
                                handle, which the call recognises by its address */
  const int64_t *topk_idx;   /* [num_tokens][topk] of the dispatch; a slot may be set to -1 to
                                leave that expert out, no other change is allowed */
  const float *topk_weights; /* [num_tokens][topk] */
  int two_phase;             /* 1: only send; ep_ll_recv(buf, handle) reduces into out */
  void *stream;
  void *out; /* output, caller memory: bf16 [num_tokens][H]; with two_phase it
                must stay valid until ep_ll_recv (topk_idx and topk_weights are
                copied at the call) */
} ep_ll_combine_args_t;
#define EP_LL_COMBINE_ARGS_INIT EP_ARGS_INIT_(ep_ll_combine_args_t)

/* Collective (docs/SEMANTICS.md §6.5). out[t] = bf16(acc), acc = 0.0f then, for k ascending
 * with topk_idx[t][k] != -1, acc = fmaf(float(y row of (t, k)), topk_weights[t][k], acc): one
 * rounding per step, as the fused multiply-add of DeepEP's kernel, and one rounding to bf16
 * (nearest even) at the end. Each rank sends its y rows back to their source ranks; the source
 * reduces. */
EP_API ep_status_t ep_ll_combine(ep_buffer_t buf, const ep_ll_combine_args_t *args);

/* Local. Zero-copy combine: *y is where the experts of this handle's dispatch may write their bf16
 * outputs [L][R*T][H] (the view's row order) inside the buffer, so that ep_ll_combine with args->y
 * equal to *y moves no extra copy of them (DeepEP's get_next_low_latency_combine_buffer with
 * zero_copy). One area per result slot: it belongs to the handle until ep_ll_handle_destroy, and
 * is written by the caller only between the completed receive of the dispatch and the combine
 * (CUDA: a device pointer; write it on the stream of the calls, after the dispatch's receive).
 * EP_ERR_INVALID_ARG when the handle's dispatch is not received or it was already combined;
 * EP_ERR_NULL_ARG, EP_ERR_DESTROYED as for the other handle calls. */
EP_API ep_status_t ep_ll_get_combine_buffer(ep_buffer_t buf, ep_ll_handle_t handle, void **y);

/* Local, thread safe: the number of rows the dispatch delivered to this rank (sum of
 * recv_count), once its receive is complete; -1 on the CUDA backend when the dispatch did not
 * wait on the host (graph capture, EP_CUDA_LL_ASYNC=1). */
EP_API ep_status_t ep_ll_handle_num_recv_tokens(ep_ll_handle_t h, int *num_recv_tokens);
/* Local. Gives the handle's result slot back. EP_ERR_BUSY while a call on its buffer is in
 * flight (the handle survives; retry once the call has returned). NULL is a no-op. */
EP_API ep_status_t ep_ll_handle_destroy(ep_ll_handle_t h);

/* ================================================================ introspection
 * What this library was built with and which environment variables it reads, for tools
 * (`epcomm info`, `epcomm doctor env`) and for programs that check a job's setup before they
 * create a group. Local calls: no group needed, thread safe. */

/* "auto", "cpu" or "cuda"; NULL for a value that is not an ep_backend_t. (Whether a backend
 * can be used here: ep_backend_available, with the buffer calls.) */
EP_API const char *ep_backend_name(ep_backend_t backend);

/* One environment variable the library reads. Every string is static and non-NULL. */
typedef struct {
  const char *name;          /* "EP_QUEUE_BYTES" */
  const char *module;        /* the part of the library that reads it: "core", "cpu", "cuda" */
  const char *type;          /* "int", "float", "size", "enum", "string" or "path" */
  const char *default_value; /* what an unset (or empty) variable means; "" when derived */
  const char *accepted;      /* the values accepted: "N[K|M|G] bytes in [4K, 16G]" */
  const char *description;   /* one line */
} ep_env_var_t;

/* The registry: rows 0 .. ep_env_var_count() - 1, fixed for the life of the process.
 * ep_env_var returns NULL for an index out of range, ep_env_var_find for a name the library
 * does not read. */
EP_API int ep_env_var_count(void);
EP_API const ep_env_var_t *ep_env_var(int index);
EP_API const ep_env_var_t *ep_env_var_find(const char *name);

/* Would the library accept `value` for the variable `name`? EP_OK, or EP_ERR_INVALID_ARG with
 * ep_last_error() naming the variable, the value and the accepted form ("EP_QUEUE_BYTES=2X: not
 * a size; accepted: N[K|M|G] bytes in [4K, 16G]"), or naming a variable the library does not
 * read; EP_ERR_NULL_ARG for a NULL name or value. An empty value means unset: accepted. */
EP_API ep_status_t ep_env_check_value(const char *name, const char *value);

/* Checks every variable of the registry that is set in the environment, as group creation and
 * buffer creation do (an invalid value fails them): EP_OK, or EP_ERR_INVALID_ARG naming the
 * first invalid variable. EP_* names the library does not read are not errors here (the log
 * warns about them once). */
EP_API ep_status_t ep_env_check(void);
/* ================================================================ end of introspection */

#ifdef __cplusplus
}
#endif
#endif /* EPCOMM_H */
