/* Helpers shared by the test programs: exit codes, checks that name the rank and case, and a
 * deterministic generator so that every rank can rebuild every other rank's inputs. */
#ifndef EP_TESTS_COMMON_H
#define EP_TESTS_COMMON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"
#include "tk_rng.h"

#define T_PASS 0
#define T_FAIL 1
#define T_SKIP 77

extern int t_rank;         /* this process's rank, for messages */
extern const char *t_case; /* current case description, for messages */

#define T_FAILF(...)                                                                      \
  do {                                                                                    \
    fprintf(stderr, "FAIL rank %d [%s] %s:%d: ", t_rank, t_case ? t_case : "-", __FILE__, \
            __LINE__);                                                                    \
    fprintf(stderr, __VA_ARGS__);                                                         \
    fputc('\n', stderr);                                                                  \
    exit(T_FAIL);                                                                         \
  } while (0)

#define T_CHECK(cond, ...)             \
  do {                                 \
    if (!(cond)) T_FAILF(__VA_ARGS__); \
  } while (0)

/* An epcomm call that must succeed. */
#define T_OK(call)                                                                          \
  do {                                                                                      \
    ep_status_t st_ = (call);                                                               \
    if (st_ != EP_OK) T_FAILF("%s -> %s: %s", #call, ep_status_name(st_), ep_last_error()); \
  } while (0)

/* An epcomm call that must fail with `want`. */
#define T_STATUS(want, call)                                                                  \
  do {                                                                                        \
    ep_status_t st_ = (call);                                                                 \
    if (st_ != (want))                                                                        \
      T_FAILF("%s -> %s, expected %s (%s)", #call, ep_status_name(st_), ep_status_name(want), \
              ep_last_error());                                                               \
  } while (0)

/* splitmix64 (tools/lib/tk_rng.h): tiny, seedable, identical everywhere. */
typedef struct {
  uint64_t s;
} t_rng;
static inline uint64_t t_next(t_rng *r) {
  return tk_splitmix(&r->s);
}
static inline t_rng t_seed(uint64_t a, uint64_t b) {
  t_rng r = {a * 0x100000001b3ull ^ (b + 0x51ed27ull)};
  t_next(&r);
  return r;
}
static inline int t_below(t_rng *r, int n) {
  return n > 0 ? (int)(t_next(r) % (uint64_t)n) : 0;
}
static inline float t_unit(t_rng *r) {
  return (float)(t_next(r) >> 40) / (float)(1 << 24);
}

/* Random bf16 in about [-4, 4), never NaN. */
uint16_t t_rand_bf16(t_rng *r);
void *t_xmalloc(size_t n); /* never NULL; fills with a poison byte */
#define T_POISON 0xA5

/* A CUDA runtime call in a test that must succeed (files that include cuda_runtime_api.h). */
#ifdef EP_HAVE_CUDA
#include <cuda_runtime_api.h>
#define T_CUDA(call)                                                         \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) T_FAILF("%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)
#endif

/* Backend under test. EP_BACKEND=cuda selects the CUDA backend: tensors then live in device
 * memory, and the helpers below move them (on the CPU backend they are host memory and memcpy,
 * so one test body runs on both; tools/lib/tk_dev.h does the work). */
bool t_cuda(void);
/* The CUDA backend with its late hello on: EP_CUDA_LATE_HELLO unset or not 0 (the library's
 * default, src/cuda/cuda_backend.c). */
bool t_late_hello(void);
/* Whether this run's CUDA buffers move an allocator's rows before the allocation (off unless
 * EP_CUDA_EARLY_DATA is set and not 0; CUDA backend only). */
bool t_early_data(void);
/* EP_CUDA_PULL unset or not 0 (CUDA backend): copy-out dispatches may pull their rows. */
bool t_pull(void);
/* EP_CUDA_COMBINE_COPY unset or not 0 (CUDA backend): an unmapped combine input may be copied
 * into the combine buffer. */
bool t_combine_copy(void);
/* For the CUDA backend: exit 77 with a visible "skipped: ..." line when it cannot run here (not
 * built, or no GPU). Call first, before the group. */
void t_require_backend(void);
void *t_dalloc(size_t n);                   /* device memory (host on cpu), filled with T_POISON */
void *t_to_dev(const void *host, size_t n); /* new device copy of host bytes (NULL -> NULL) */
void *t_to_host(const void *dev, size_t n); /* new malloc'd host copy of device bytes */
void t_copy_to_dev(void *dev, const void *host, size_t n);
void t_dfree(void *dev);        /* NULL-safe */
void *t_pinned_alloc(size_t n); /* host memory the device writes (page-locked on cuda) */
void t_pinned_free(void *p);    /* NULL-safe */
void t_dsync(void);             /* wait for the device (no-op on cpu) */

/* ep_dispatch_out_t.on_wait of the tests (ctx: a t_steps_t): counts the steps, and those whose
 * number was not the count so far, and asks for `want` of them at most. */
typedef struct {
  int steps, want, out_of_order;
} t_steps_t;
int t_wait_step(void *ctx, int step);

/* The library's warnings of this process, for tests that expect one: t_log_to_file sets
 * EP_LOG_FILE (call before anything logs); t_logged says whether the file has `needle` (its
 * other lines go to stderr, so that an unexpected warning shows), then empties it. */
void t_log_to_file(void);
bool t_logged(const char *needle);
void t_log_remove(void);

/* Group from `epcomm launch`, and a buffer on it (cfg NULL: defaults). */
void t_init(ep_group_t *g, int *rank, int *nranks);
void t_fini(ep_group_t g);
/* Hosts of the group: their number and, for every rank, its host (malloc'd; collective). */
void t_hosts(ep_group_t g, int *nhosts, int **host_of);

#endif
