/*
 * The contract between the core and a backend. This is the only core header a backend includes.
 *
 * Layer rule (see docs/ARCHITECTURE.md):  include/epcomm.h  <-  core  <-  backends (cpu, cuda)
 *   - the core validates every argument that can be checked without touching tensor contents,
 *     resolves handles, owns objects and their lifetimes, and never tests which backend it holds;
 *   - a backend implements one `struct ep_backend_ops`, filled by field name, and uses only the
 *     services declared here (bootstrap exchange, liveness, deadlines, errors, logging).
 */
#ifndef EP_CORE_BACKEND_H
#define EP_CORE_BACKEND_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "epcomm.h"
#include "net/net.h"

/* ------------------------------------------------------------------ services of the core */

/* What a buffer's backend sees of its group and of the buffer object itself. */
typedef struct ep_ctx ep_ctx_t;

int ep_ctx_rank(const ep_ctx_t *ctx);
int ep_ctx_nranks(const ep_ctx_t *ctx);
double ep_ctx_timeout(const ep_ctx_t *ctx); /* seconds, > 0 */

/* Hosts of the group. One host (nhosts 1, local == global) unless the group spans hosts; then
 * ranks of one host share memory (the intranode path) and every host holds local_size ranks.
 * Hosts are numbered by their lowest rank, local indices by rank within a host. */
typedef struct {
  int nhosts, host;           /* hosts of the group; this rank's */
  int local_rank, local_size; /* this rank's index among the ranks of its host; their number */
  int *host_of;               /* [R] host of every rank */
  int *local_of;              /* [R] local index of every rank */
  int *rank_at;               /* [nhosts][local_size] rank of (host, local index) */
  void *mem;                  /* the group's */
} ep_topo_t;
const ep_topo_t *ep_ctx_topo(const ep_ctx_t *ctx);

/* Bootstrap exchanges of the group, bounded by the deadline: every rank of the group (across
 * hosts through the world engine). */
ep_status_t ep_ctx_allgather(ep_ctx_t *ctx, const void *send, void *recv, size_t bytes);
/* The ranks of this host only: each passes one fd; fds[l] receives a duplicate of the fd of
 * local index l (fds[local_rank] = own dup). */
ep_status_t ep_ctx_allgather_fd(ep_ctx_t *ctx, int fd, int *fds);
ep_status_t ep_ctx_barrier(ep_ctx_t *ctx);

/* Collective, during buffer creation of a group that spans hosts: an endpoint of the named
 * network engine ("mpi", "nccl") over every rank of the group, for this buffer (device: the
 * CUDA device of a device engine, else -1). The backend owns it and closes it at destroy
 * (e->close(n, clean)). */
ep_status_t ep_ctx_net_open(ep_ctx_t *ctx, const char *engine, int device,
                            const struct ep_net_engine **e, ep_net_t **n);
/* "rank 3 (host 1)" ("no rank" for -1). */
const char *ep_ctx_who(const ep_ctx_t *ctx, int rank, char *buf, size_t n);
/* Waits for posted transfers of a network endpoint with the buffer's deadline and liveness
 * checks. On failure the transfers are let go (cancel) and the error names the peer still
 * pending with its host, or the dead rank the liveness check saw. */
ep_status_t ep_ctx_net_wait(ep_ctx_t *ctx, const struct ep_net_engine *e, ep_net_t *n,
                            ep_net_xfer_t *x, int count, const char *op, const char *phase);
/* Every rank's `bytes` into all[r * bytes] (own included), point to point with `tag`, then the
 * wait above; a message of another size fails with EP_ERR_MISMATCH (ranks out of step). */
ep_status_t ep_ctx_net_allgather(ep_ctx_t *ctx, const struct ep_net_engine *e, ep_net_t *n, int tag,
                                 const void *mine, void *all, size_t bytes, const char *op,
                                 const char *phase);
/* Liveness as an ep_net_check_fn (ctx is the ep_ctx_t): EP_OK, or EP_ERR_PEER_FAILED with a
 * message naming the rank, its host and what happened. */
ep_status_t ep_ctx_liveness(void *ctx);

/* Non-blocking: EP_OK, or EP_ERR_PEER_FAILED with *dead set to a dead peer (and *how a static
 * description such as "killed by signal 9" when the launcher said so). */
ep_status_t ep_ctx_check_peers(ep_ctx_t *ctx, int *dead, const char **how);
/* True once a check saw this rank's own launcher die (EOF on its notify socket). The dead rank
 * such a check names is this rank, which a remote notice could also name: this tells them apart. */
bool ep_ctx_lost_launcher(ep_ctx_t *ctx);

/* Record a failure on the buffer and the calling thread: "<op>: <phase>: <message>", peer may be
 * -1. Returns `status` so that callers can `return ep_ctx_fail(...)`. */
ep_status_t ep_ctx_fail(ep_ctx_t *ctx, ep_status_t status, int peer, const char *op,
                        const char *phase, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* Mark the buffer unusable (collective state may be inconsistent after this failure). */
void ep_ctx_mark_broken(ep_ctx_t *ctx);
/* A rank of the group died or did not answer: closing engine endpoints must not wait for it. */
bool ep_ctx_peer_lost(const ep_ctx_t *ctx);

/* Integer from the environment registry (src/core/env.c), e.g. EP_SPIN_US; a size row's
 * N[K|M|G] is in bytes. Group and buffer creation have checked every set variable. An unset or
 * empty one means its row's default_value (written there only): ep_env_int; ep_env_long's
 * `unset` is for rows whose default is derived (default_value ""), such as EP_CUDA_DEVICE. */
long ep_env_int(const char *name);
long ep_env_long(const char *name, long unset);
/* Text of a registered variable, NULL when unset or empty. */
const char *ep_env_text(const char *name);

/* The EP_* variables a module reads: one table of rows per module (core, cpu, cuda), each
 * defined with EP_ENV_MODULE in the module's own sources and compiled whether or not its backend
 * is built. The build lists the modules (src/core/env_modules.c.in), so that the core's registry
 * holds them all without naming any. The row macros write the accepted form from the same
 * literals the checks use. */
typedef enum { EP_ENV_INT, EP_ENV_FLOAT, EP_ENV_SIZE, EP_ENV_ENUM, EP_ENV_TEXT } ep_env_kind_t;
typedef struct {
  ep_env_var_t pub; /* what ep_env_var() shows */
  ep_env_kind_t kind;
  const char *lo, *hi; /* INT, SIZE: bounds, inclusive; FLOAT: lo exclusive, hi inclusive */
  const char *choices; /* ENUM: "a|b|c", matched without regard to case */
} ep_env_row_t;
typedef struct {
  const ep_env_row_t *rows;
  int count;
} ep_env_module_t;
#define EP_ENV_MODULE(mod, table) \
  const ep_env_module_t ep_env_module_##mod = {table, (int)(sizeof table / sizeof table[0])}
#define EP_ENV_ROW_INT(mod, name, dflt, lo, hi, help) \
  { {name, mod, "int", dflt, "an integer in [" lo ", " hi "]", help}, EP_ENV_INT, lo, hi, NULL }
#define EP_ENV_ROW_SIZE(mod, name, dflt, lo, hi, help)                                          \
  {                                                                                             \
    {name, mod, "size", dflt, "N[K|M|G] bytes in [" lo ", " hi "]", help}, EP_ENV_SIZE, lo, hi, \
        NULL                                                                                    \
  }
#define EP_ENV_ROW_FLOAT(mod, name, dflt, lo, hi, help) \
  { {name, mod, "float", dflt, "a number > " lo " and <= " hi, help}, EP_ENV_FLOAT, lo, hi, NULL }
#define EP_ENV_ROW_ENUM(mod, name, dflt, choices, help) \
  { {name, mod, "enum", dflt, "one of " choices, help}, EP_ENV_ENUM, NULL, NULL, choices }
/* type: "string" or "path"; any non-empty value is accepted. */
#define EP_ENV_ROW_TEXT(mod, name, type, what, help) \
  { {name, mod, type, "", what, help}, EP_ENV_TEXT, NULL, NULL, NULL }

/* The calling thread's last error message, and a way to put a saved one back (a backend that
 * must do collective work after a local failure keeps the first, more precise, message). */
const char *ep_ctx_last_error(void);
void ep_ctx_restore_error(const char *msg);

/* Set the calling thread's last error (no object, no peer) and return `s`. */
ep_status_t ep_err(ep_status_t s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Monotonic clock and deadlines. */
double ep_now(void);

/* Logging (src/core/log.h has the levels). */
enum { EP_LOG_WARN = 1, EP_LOG_INFO = 2, EP_LOG_DEBUG = 3, EP_LOG_TRACE = 4 };
bool ep_log_enabled(int level);
void ep_log_at(int level, int rank, const char *phase, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define EP_LOG(ctx, lvl, phase, ...)                                                   \
  do {                                                                                 \
    if (ep_log_enabled(lvl)) ep_log_at((lvl), ep_ctx_rank(ctx), (phase), __VA_ARGS__); \
  } while (0)

/* Limits the core enforces before a backend sees a call. */
#define EP_MAX_TOKENS (1 << 24) /* per rank and call: plans are int32-indexed [N][R] */
#define EP_MAX_TOPK 128
#define EP_MAX_LOCAL_EXPERTS 4096
#define EP_MAX_SCALES 4096
#define EP_MAX_MEM_REGS 64 /* registrations of caller memory alive on one buffer */

static inline size_t ep_dtype_size(ep_dtype_t t) {
  return t == EP_DTYPE_BF16 ? 2 : 1;
}

/* ------------------------------------------------------------------ what a handle carries */

enum ep_handle_kind { EP_HANDLE_NORMAL = 1, EP_HANDLE_LL = 2 };

/* Backend-neutral facts about one dispatch; the backend keeps its own layout in `priv`. */
typedef struct {
  enum ep_handle_kind kind;
  int num_tokens;      /* N of this rank */
  int num_recv_tokens; /* Nr */
  int recv_rows;       /* rows of the dispatch outputs (Nr, or the worst-case rows) */
  int hidden;
  int topk;
  int num_experts;
  ep_dtype_t dtype;
  int num_scales;
  int32_t number; /* normal mode: the dispatch call's number on its buffer (1, 2, ...; the same on
                     every rank), which the calls along the handle carry in their key */
  void *priv;
  void (*free_priv)(void *priv);
} ep_handle_info_t;

/* ------------------------------------------------------------------ low-latency handles
 * The states of a low-latency result slot and of the handle that holds it (SEMANTICS.md §6.6);
 * each backend keeps them with its slot, the core says why a state refuses a call. */
enum ep_ll_state {
  EP_LLS_FREE = 0,
  EP_LLS_SENT,      /* dispatch sent, its receive pending (two-phase) */
  EP_LLS_RECEIVED,  /* view ready, combine allowed */
  EP_LLS_COMB_SENT, /* combine sent, its receive pending (two-phase) */
  EP_LLS_COMBINED,  /* done */
  EP_LLS_FAILED     /* a phase failed: only destroy remains */
};
/* Why a handle in `state` cannot do something: "it was already combined (...)". */
const char *ep_ll_state_why(int state);

/* ------------------------------------------------------------------ one normal-mode call
 * The core turns the caller's arguments into this description; backends move the data. */

#include "core/call_key.h"

/* First field in which `theirs` differs from `mine` (EP_CF_REJECTED when the peer rejected its
 * arguments), or -1. */
int ep_call_key_diff(const ep_call_key_t *mine, const ep_call_key_t *theirs);
/* Records the failure for field `f` (from ep_call_key_diff, or a kernel) against `peer` and
 * returns its status: EP_ERR_PEER_INVALID or EP_ERR_MISMATCH. `theirs` may be NULL when only the
 * field is known. */
ep_status_t ep_call_key_fail(ep_ctx_t *ctx, const char *op, const char *phase, int f,
                             const ep_call_key_t *mine, const ep_call_key_t *theirs, int peer);

/* Every rank's words gathered by a count exchange (words[r * stride] starts with rank r's call
 * key): EP_OK when all agree with `mine`, else the failure for the lowest rank that differs.
 * Compared once all have arrived, so that every rank fails the call the same way. */
ep_status_t ep_call_keys_check(ep_ctx_t *ctx, const char *op, const ep_call_key_t *mine,
                               const int32_t *words, size_t stride, int nranks, int rank);

/* The key of a combine along handle `h`. */
void ep_call_combine_key(const ep_combine_args_t *a, const ep_handle_info_t *h, ep_call_key_t *key);

/* An expert id out of range, named by its slot (every backend and every check says it so). */
ep_status_t ep_call_bad_expert(ep_ctx_t *ctx, const char *op, int64_t token, int k, int64_t value,
                               int num_experts);

typedef struct {
  ep_dispatch_args_t in;          /* the caller's arguments, defaults applied */
  ep_dispatch_out_t out;          /* the caller's output description; the call sets its row arrays
                                     (ALLOC: through the callback, VIEWS: the backend) and results */
  const ep_handle_info_t *cached; /* a cached dispatch: the layout it follows */
  ep_call_key_t key;
  int topk, num_experts, num_local; /* of the layout (the cached handle's for a cached call) */
  bool has_w;                       /* topk weights travel with the rows */
  bool sync;  /* the count is learnt before returning (not the worst-case form) */
  bool views; /* EP_OUTPUT_VIEWS */
  size_t row_bytes, scale_bytes;
} ep_dispatch_call_t;

/* Rows the outputs hold before the count is known: the capacity (caller arrays, worst case),
 * `view_rows` (views: what the backend's receive memory holds), -1 (allocator: no bound). */
int64_t ep_call_out_rows(const ep_dispatch_call_t *c, int64_t view_rows);
/* Once this rank's receive count is known: EP_OK when the outputs take `nr` rows (the allocator
 * is called here), else the recorded error; the backend then drains the rows and keeps the
 * queues consistent. */
ep_status_t ep_call_outputs_ready(ep_ctx_t *ctx, ep_dispatch_call_t *c, int nr, int64_t view_rows);
/* The handle a successful non-cached dispatch leaves. */
ep_handle_info_t ep_call_handle_info(const ep_dispatch_call_t *c, int nr, void *priv,
                                     void (*free_priv)(void *));

/* ------------------------------------------------------------------ the ops table */

struct ep_backend_ops {
  const char *name; /* as EP_BACKEND spells it */
  ep_backend_t id;
  unsigned caps;          /* EP_CAP_* of epcomm.h that every buffer of this backend has */
  unsigned caps_one_host; /* those of caps a buffer has only when its group is on one host */
  ep_lifetime_t dispatch_view_lifetime, ll_view_lifetime;
  /* Local: can this backend create buffers here (a device exists...)? EP_OK, or the reason. */
  ep_status_t (*available)(void);
  /* Local: bytes of memory one rank's buffer takes for `cfg` (already resolved) and R ranks. */
  ep_status_t (*size_hint)(const ep_buffer_config_t *cfg, int nranks, size_t *bytes);
  /* Local, optional: can this host hold a buffer of this config (memory)? Called on every rank
   * after the configs agree, so all ranks fail alike before anything is allocated. */
  ep_status_t (*check_config)(const ep_buffer_config_t *cfg, int nranks);
  /* Collective. Builds the backend state of one buffer. */
  ep_status_t (*create)(ep_ctx_t *ctx, const ep_buffer_config_t *cfg, void **state);
  /* collective=true: quiesce with peers first (bounded); false: local release. Always frees. */
  ep_status_t (*destroy)(void *state, bool collective);
  ep_status_t (*layout)(void *state, const ep_layout_args_t *a);
  /* Collective. On success fills `out` (a non-cached call: kind, counts, priv) and c->out's
   * results. On failure `out` is left for the core to discard. */
  ep_status_t (*dispatch)(void *state, ep_dispatch_call_t *c, ep_handle_info_t *out);
  ep_status_t (*combine)(void *state, const ep_combine_args_t *a, const ep_handle_info_t *h);
  /* Local, optional: memory of the buffer for the combine input of handle h
   * (ep_get_combine_buffer); NULL: the backend has none. */
  ep_status_t (*combine_buffer)(void *state, const ep_handle_info_t *h, void **x);
  /* This rank rejected its arguments for the next normal-mode collective call: tell the peers so
   * that their matching call fails at once (EP_ERR_PEER_INVALID) instead of timing out. */
  void (*reject)(void *state);
  /* Registered caller memory (ep_register_memory); both optional: NULL means a registration
   * only records the range. Collective, inside the group's call, after every rank agreed on
   * `slot` (the same on every rank, < EP_MAX_MEM_REGS): make [ptr, ptr + bytes) of this rank
   * readable by the peers; fail alike on every rank (agree through ep_ctx_allgather), leaving
   * nothing behind. The backend's destroy undoes the registrations still alive. */
  ep_status_t (*mem_register)(void *state, int slot, void *ptr, size_t bytes);
  /* Collective: undo `slot` (wait for this rank's work that may read it first, bounded); always
   * frees this rank's part. */
  ep_status_t (*mem_deregister)(void *state, int slot);
  /* Low-latency mode (NULL when the backend has none). */
  ep_status_t (*ll_dispatch)(void *state, const ep_ll_dispatch_args_t *a, ep_handle_info_t *out);
  ep_status_t (*ll_recv)(void *state, ep_handle_info_t *h);
  ep_status_t (*ll_combine)(void *state, const ep_ll_combine_args_t *a, ep_handle_info_t *h);
  ep_status_t (*ll_view)(const ep_handle_info_t *h, ep_ll_recv_view_t *view);
  /* The zero-copy combine input of the handle's result slot (ep_ll_get_combine_buffer). */
  ep_status_t (*ll_combine_buffer)(const ep_handle_info_t *h, void **y);
  void (*ll_release)(void *state, ep_handle_info_t *h); /* handle destroyed: free its slot */
  /* This rank rejected its arguments for its next ll_dispatch (combine = false) or ll_combine
   * (combine = true): tell the peers so that their matching call fails at once
   * (EP_ERR_PEER_INVALID) instead of timing out. */
  void (*ll_reject)(void *state, bool combine);
  /* Optional, local: bytes sent so far through the network engine and to ranks of this host. */
  void (*traffic)(void *state, uint64_t *net, uint64_t *local);
  /* Optional, local: which paths normal-mode calls took, into info's counters
   * (ep_buffer_info_t: combines_in_place ... combines_copied). */
  void (*path_counts)(void *state, ep_buffer_info_t *info);
};

/* Every backend module defines one `const struct ep_backend_ops *ep_backend_<name>(void)`; the
 * build lists those it compiled in a generated table (src/core/backends.c.in), which is how the
 * core finds them without naming any. */
typedef const struct ep_backend_ops *(*ep_backend_getter_t)(void);
extern const ep_backend_getter_t ep_backend_table[];

#endif
