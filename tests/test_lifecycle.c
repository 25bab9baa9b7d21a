/* Lifecycle (SEMANTICS.md §7): create/use/destroy cycles leave fds, threads and RSS flat; misuse
 * gets a specific status (double destroy, use after destroy, destroy with live children or with a
 * call in flight); the last epcomm call is the last thing the program does (the runner checks
 * stderr).
 *   test_lifecycle cycles N     N cycles of group + buffer + dispatch/combine + destroy
 *   test_lifecycle misuse       misuse statuses (any number of ranks)
 *   test_lifecycle inflight     destroy while a dispatch is in flight (2+ ranks)
 *   test_lifecycle silent       a clean run that prints LAST after its final epcomm call */
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

static int count_fds(void) {
  int n = 0;
  char path[64];
  for (int fd = 0; fd < 4096; fd++) {
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n += access(path, F_OK) == 0;
  }
  return n;
}

static long status_field(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long v = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, key, strlen(key))) v = atol(line + strlen(key));
  if (f) fclose(f);
  return v;
}

/* One small dispatch + combine, so that each cycle really uses the buffer. */
static void use_buffer(ep_buffer_t b, int R, int me) {
  enum { N = 16, H = 64, K = 2 };
  int E = 2 * R;
  uint16_t x[N * H], out[N * H], *rx = t_xmalloc((size_t)N * R * H * 2);
  int64_t idx[N * K];
  for (int i = 0; i < N * H; i++) x[i] = (uint16_t)(0x3f80 + (i + me) % 64);
  for (int i = 0; i < N * K; i++) idx[i] = (i * 7 + me) % E;
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = N,
                          .hidden = H,
                          .topk_idx = idx,
                          .topk = K,
                          .num_experts = E};
  ep_dispatch_out_t o = {
      .size = sizeof o, .mode = EP_OUTPUT_CALLER, .recv_x = rx, .capacity = N * R};
  T_OK(ep_dispatch(b, &a, &o));
  ep_handle_t h = o.handle;
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = rx, .out = out};
  T_OK(ep_combine(b, &c));
  T_OK(ep_handle_destroy(h));
  free(rx);
}

static void one_cycle(int *R, int *me) {
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, me, R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.num_channels = 2; /* a worker thread per buffer: thread leaks would show */
  cfg.queue_bytes = 64 << 10;
  T_OK(ep_buffer_create(g, &cfg, &b));
  use_buffer(b, *R, *me);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
}

static int cycles(int n) {
  int R, me;
  for (int i = 0; i < 20; i++) one_cycle(&R, &me); /* warm up: allocator arenas, caches */
  int fd0 = count_fds();
  long th0 = status_field("Threads:"), rss0 = status_field("VmRSS:");
  for (int i = 0; i < n; i++) one_cycle(&R, &me);
  int fd1 = count_fds();
  long th1 = status_field("Threads:"), rss1 = status_field("VmRSS:");
  printf("rank %d: %d cycles: fds %d -> %d, threads %ld -> %ld, rss %ld -> %ld KiB\n", me, n, fd0,
         fd1, th0, th1, rss0, rss1);
  T_CHECK(fd1 == fd0, "fd count grew from %d to %d over %d cycles", fd0, fd1, n);
  T_CHECK(th1 == th0, "thread count grew from %ld to %ld", th0, th1);
#if defined(__SANITIZE_ADDRESS__)
  /* ASan keeps freed memory in quarantine: RSS says nothing here (the plain build checks it). */
  (void)rss1;
#else
  /* RSS: allow allocator noise (1 MiB), not growth per cycle. */
  T_CHECK(rss1 - rss0 < 1024, "RSS grew by %ld KiB over %d cycles", rss1 - rss0, n);
#endif
  return T_PASS;
}

static int misuse(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b, b2;
  t_init(&g, &me, &R);
  T_STATUS(EP_OK, ep_group_destroy(NULL)); /* NULL is a no-op */
  T_STATUS(EP_OK, ep_buffer_destroy(NULL));
  T_STATUS(EP_OK, ep_handle_destroy(NULL));
  T_OK(ep_buffer_create(g, NULL, &b));
  T_OK(ep_buffer_create(g, NULL, &b2));
  /* A group with live buffers refuses to go, and says so. */
  T_STATUS(EP_ERR_BUSY, ep_group_destroy(g));
  T_CHECK(strstr(ep_last_error(), "buffer"), "BUSY message does not name the buffers: %s",
          ep_last_error());
  use_buffer(b, R, me);
  /* A handle of one buffer cannot be used with another. */
  uint16_t x[64] = {0}, rx[64 * 64], out[64];
  int64_t idx[1] = {0};
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = 1,
                          .hidden = 64,
                          .topk_idx = idx,
                          .topk = 1,
                          .num_experts = R};
  ep_dispatch_out_t o = {.size = sizeof o, .mode = EP_OUTPUT_CALLER, .recv_x = rx, .capacity = 64};
  T_OK(ep_dispatch(b, &a, &o));
  ep_handle_t h = o.handle;
  ep_combine_args_t c = {.size = sizeof c, .handle = h, .x = rx, .out = out};
  T_STATUS(EP_ERR_INVALID_ARG, ep_combine(b2, &c));
  T_OK(ep_combine(b, &c)); /* the rejected call did not desynchronise the peers */
  T_OK(ep_buffer_destroy(b2));
  /* Use after destroy, double destroy: reported, not undefined. */
  T_STATUS(EP_ERR_DESTROYED, ep_buffer_destroy(b2));
  T_STATUS(EP_ERR_DESTROYED, ep_dispatch(b2, &a, &o));
  T_STATUS(EP_ERR_DESTROYED, ep_buffer_release(b2));
  T_OK(ep_handle_destroy(h));
  T_STATUS(EP_ERR_DESTROYED, ep_handle_destroy(h));
  T_STATUS(EP_ERR_DESTROYED, ep_combine(b, &c));
  /* An id that was never an epcomm object. */
  T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_destroy((ep_buffer_t)(uintptr_t)0xdead0000beefull));
  T_STATUS(EP_ERR_INVALID_ARG, ep_group_destroy((ep_group_t)b)); /* a buffer is not a group */
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  T_STATUS(EP_ERR_DESTROYED, ep_group_destroy(g));
  int r;
  T_STATUS(EP_ERR_DESTROYED, ep_group_rank(g, &r));
  printf("rank %d: misuse statuses as specified\n", me);
  return T_PASS;
}

/* Rank 0 starts a dispatch that waits for rank 1 (which arrives late); meanwhile a second thread
 * tries to destroy the buffer: EP_ERR_BUSY, and the dispatch completes normally. */
typedef struct {
  ep_buffer_t b;
  ep_status_t st;
} inflight_t;

static void *late_destroy(void *arg) {
  inflight_t *f = arg;
  nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  f->st = ep_buffer_destroy(f->b);
  return NULL;
}

static int inflight(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, &me, &R);
  if (R < 2) {
    printf("skipped: needs 2 ranks\n");
    t_fini(g);
    return T_SKIP;
  }
  T_OK(ep_buffer_create(g, NULL, &b));
  inflight_t f = {b, EP_OK};
  pthread_t th;
  if (me == 0)
    pthread_create(&th, NULL, late_destroy, &f);
  else
    nanosleep(&(struct timespec){0, 400 * 1000 * 1000}, NULL);
  use_buffer(b, R, me);
  if (me == 0) {
    pthread_join(th, NULL);
    T_CHECK(f.st == EP_ERR_BUSY, "destroy during a dispatch returned %s, expected EP_ERR_BUSY",
            ep_status_name(f.st));
  }
  T_OK(ep_buffer_destroy(b));
  t_fini(g);
  return T_PASS;
}

static int silent(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, &me, &R);
  T_OK(ep_buffer_create(g, NULL, &b));
  use_buffer(b, R, me);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  printf("LAST\n"); /* the test script checks that nothing at all follows this line */
  fflush(stdout);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "misuse";
  if (!strcmp(mode, "cycles")) return cycles(argc > 2 ? atoi(argv[2]) : 1000);
  if (!strcmp(mode, "misuse")) return misuse();
  if (!strcmp(mode, "inflight")) return inflight();
  if (!strcmp(mode, "silent")) return silent();
  fprintf(stderr, "unknown mode %s\n", mode);
  return T_FAIL;
}
