/* Peer failure and timeouts (SEMANTICS.md §8.1-8.2), run by tests/test_failure.sh under
 * `epcomm launch`.
 *   test_failure kill-dispatch FILE   the last rank SIGKILLs itself in the middle of a dispatch
 *   test_failure kill-combine FILE    ... of a combine
 *   test_failure kill-alloc FILE      ... inside its dispatch's allocator callback
 * (EP_OUTPUT_ALLOC): its count went out, its rows never do; on CUDA with EP_CUDA_LATE_HELLO=1 (a
 * registration on every rank) its hello promised a late one, which the others' kernels wait for
 *   test_failure slow-alloc           the last rank sleeps 3 s in its first allocator callback
 *                                     (deadline 1 s): the others time out naming it (on CUDA
 *                                     with EP_CUDA_LATE_HELLO=1: waiting for its late hello)
 *   test_failure kill-create FILE     ... while the others create a buffer (it never arrives)
 *   test_failure kill-root FILE       rank 0 dies while the others create a buffer
 *   test_failure timeout              the last rank arrives late; the others time out
 *   test_failure timeout-gone         the same, rank 0 stopped (SIGSTOP) from 0.3 s to 2 s: rank 1
 *                                     gives up first, tells it and exits; rank 0 still names the
 *                                     late rank (the verdict, not rank 1's exit, explains it)
 *   test_failure stop                 the last rank SIGSTOPs itself between a dispatch and its
 *                                     combine and is resumed 4 s later (EP_TIMEOUT_S ~1.5 s):
 *                                     the others fail within one deadline, naming it
 *   test_failure stop-barrier         the same in an ep_group_barrier, rank 0 entering it 0.3 s
 *                                     after rank 1 (rank 1 must still name rank 2, not rank 0)
 *   test_failure stop-barrier-gone    the same, rank 1 stopped from 0.3 s to 2 s: rank 0 gives up,
 *                                     tells it and exits; rank 1 still names rank 2 (the verdict,
 *                                     not rank 0's exit, explains it)
 *   test_failure early-exit1 FILE     the last rank exits 1 before creating its group
 *   test_failure early-kill FILE      ... is SIGKILLed before creating its group
 *   test_failure early-exit0 FILE     ... exits 0 before creating its group
 *   test_failure early-during FILE    rank 1 is SIGKILLed inside ep_group_create_from_env
 *   test_failure loop DIR             dispatch/combine until a call fails, then write the error
 *                                     to DIR/result.RANK (the launcher may be gone: no stdout)
 * The victim writes the CLOCK_MONOTONIC time of its death to FILE; survivors read it after their
 * error and print how long detection took. Survivors must get EP_ERR_PEER_FAILED (or a timeout
 * naming the rank) within 5 s, destroy their objects and exit 0. */
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "tk_clock.h"

static const char *death_file;

static void die_now(void) {
  FILE *f = fopen(death_file, "w");
  if (f) fprintf(f, "%.9f\n", tk_now_s()), fclose(f);
  raise(SIGKILL);
}

static void *killer(void *arg) {
  nanosleep(&(struct timespec){0, (long)(uintptr_t)arg * 1000000L}, NULL);
  die_now();
  return NULL;
}

static double detection_s(void) {
  for (int i = 0; i < 100; i++) {
    FILE *f = fopen(death_file, "r");
    double t = 0;
    if (f && fscanf(f, "%lf", &t) == 1) {
      fclose(f);
      return tk_now_s() - t;
    }
    if (f) fclose(f);
    nanosleep(&(struct timespec){0, 10000000}, NULL);
  }
  return -1;
}

typedef struct {
  int n, H, K, E;
  uint16_t *x, *rx, *out;
  int64_t *idx;
  int nr;
  ep_handle_t h;
} big_t;

/* A call that timed out with a 1 s deadline took dt s: at least the deadline for the rank that
 * gave up first; a rank that entered later and learns it from that rank's verdict ("reported by
 * rank N") waits less, by the skew. */
static void check_timeout_s(double dt) {
  T_CHECK((dt > 0.9 || strstr(ep_last_error(), "reported by rank")) && dt < 3.0,
          "timed out after %.2f s with a 1 s deadline: %s", dt, ep_last_error());
}

/* A dispatch long enough to be killed in the middle of: many tokens through small queues. The
 * tensors live where the backend reads them (device memory with EP_BACKEND=cuda). */
static void big_init(big_t *b, int R, int me) {
  b->n = 3000, b->H = 2048, b->K = 4, b->E = 4 * R;
  uint16_t *x = t_xmalloc((size_t)b->n * b->H * 2);
  int64_t *idx = t_xmalloc((size_t)b->n * b->K * 8);
  for (int i = 0; i < b->n * b->K; i++) idx[i] = (i * 5 + me + i / b->K) % b->E;
  memset(x, 0x3f, (size_t)b->n * b->H * 2);
  b->x = t_to_dev(x, (size_t)b->n * b->H * 2);
  b->idx = t_to_dev(idx, (size_t)b->n * b->K * 8);
  b->rx = t_dalloc((size_t)b->n * R * b->H * 2);
  b->out = t_dalloc((size_t)b->n * b->H * 2);
  free(x), free(idx);
}

static void big_free(big_t *b) {
  t_dfree(b->x), t_dfree(b->rx), t_dfree(b->out), t_dfree(b->idx);
}

static ep_status_t big_dispatch(ep_buffer_t buf, big_t *b, int R) {
  ep_dispatch_args_t a = {.size = sizeof a,
                          .x = b->x,
                          .dtype = EP_DTYPE_BF16,
                          .num_tokens = b->n,
                          .hidden = b->H,
                          .topk_idx = b->idx,
                          .topk = b->K,
                          .num_experts = b->E};
  ep_dispatch_out_t o = {
      .size = sizeof o, .mode = EP_OUTPUT_CALLER, .recv_x = b->rx, .capacity = b->n * R};
  ep_status_t st = ep_dispatch(buf, &a, &o);
  if (!st) b->nr = o.num_recv_tokens, b->h = o.handle;
  return st;
}

static ep_status_t big_combine(ep_buffer_t buf, big_t *b) {
  ep_combine_args_t c = {.size = sizeof c, .handle = b->h, .x = b->rx, .out = b->out};
  return ep_combine(buf, &c);
}

static void survivor_report(ep_status_t st, const char *what, int victim) {
  double dt = detection_s();
  T_CHECK(st == EP_ERR_PEER_FAILED || st == EP_ERR_TIMEOUT,
          "%s returned %s after rank %d died, expected EP_ERR_PEER_FAILED", what,
          ep_status_name(st), victim);
  char want[32];
  snprintf(want, sizeof want, "rank %d", victim);
  T_CHECK(strstr(ep_last_error(), want), "the error does not name %s: %s", want, ep_last_error());
  T_CHECK(dt >= 0 && dt < 5.0, "detection took %.3f s (limit 5 s)", dt);
  printf("detected %s death of rank %d in %.3f s: %s\n", what, victim, dt, ep_last_error());
}

static int kill_in_op(const char *op) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  /* Small queues: the dispatch takes many trips; EP_QUEUE_BYTES set: its size instead (on CUDA,
   * 1M holds every row at once, so the dispatch pulls them: tests/test_failure.sh cuda). */
  if (!getenv("EP_QUEUE_BYTES")) cfg.queue_bytes = 64 << 10;
  T_OK(ep_buffer_create(g, &cfg, &buf));
  big_t b;
  big_init(&b, R, me);
  int victim = R - 1;
  bool in_combine = !strcmp(op, "combine");
  if (in_combine) T_OK(big_dispatch(buf, &b, R));
  if (in_combine) T_OK(ep_group_barrier(g)); /* the victim dies only after everyone's dispatch */
  pthread_t th;
  if (me == victim) pthread_create(&th, NULL, killer, (void *)(uintptr_t)30);
  ep_status_t st = EP_OK;
  /* Keep calling until the victim's death shows (a fast machine may finish one call first). */
  for (int i = 0; i < 200 && st == EP_OK; i++) {
    st = in_combine ? big_combine(buf, &b) : big_dispatch(buf, &b, R);
    if (!in_combine && st == EP_OK) T_OK(ep_handle_destroy(b.h));
  }
  if (me == victim) pause(); /* the killer thread ends us */
  survivor_report(st, op, victim);
  if (in_combine) T_OK(ep_handle_destroy(b.h));
  T_STATUS(EP_ERR_BROKEN, big_dispatch(buf, &b, R)); /* the buffer is now unusable, and says so */
  T_OK(ep_buffer_destroy(buf)); /* still destroyable, without waiting for the dead */
  T_OK(ep_group_destroy(g));
  big_free(&b);
  return T_PASS;
}

/* Outputs of the allocator path: rows from the start of the registered region (on CUDA with
 * EP_CUDA_LATE_HELLO=1 the senders then write recv_x there); the victim dies instead, a slow
 * rank sleeps in its first callback. */
typedef struct {
  void *rx, *idx, *w, *src;
  bool victim;
  int stall_s;
} alloc_ctx_t;

static int alloc_or_die(void *ctx, const ep_dispatch_args_t *a, int nr, ep_dispatch_out_t *o) {
  alloc_ctx_t *c = ctx;
  (void)a, (void)nr;
  if (c->victim) die_now(); /* its count is out, its data kernel never comes */
  if (c->stall_s) nanosleep(&(struct timespec){c->stall_s, 0}, NULL), c->stall_s = 0;
  o->recv_x = c->rx, o->recv_topk_idx = c->idx, o->recv_topk_weights = c->w;
  o->recv_src_idx = c->src;
  return 0;
}

/* Ranks dispatching through the allocator callback into a registered region. */
typedef struct {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  void *x, *idx;
  alloc_ctx_t c;
  ep_mem_t mem;
} alloc_world_t;

enum { AN = 64, AH = 1024, AK = 4 };

static void alloc_world_init(alloc_world_t *w, double timeout_s) {
  t_init(&w->g, &w->me, &w->R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.timeout_s = timeout_s;
  T_OK(ep_buffer_create(w->g, &cfg, &w->buf));
  int64_t hidx[AN * AK];
  for (int i = 0; i < AN * AK; i++) hidx[i] = (i / AK * 3 + i % AK + w->me) % (4 * w->R);
  w->x = t_dalloc((size_t)AN * AH * 2), w->idx = t_to_dev(hidx, sizeof hidx);
  const size_t rows = (size_t)AN * w->R;
  w->c = (alloc_ctx_t){t_dalloc(rows * AH * 2),
                       t_dalloc(rows * AK * 8),
                       t_dalloc(rows * AK * 4),
                       t_dalloc(rows * 4),
                       false,
                       0};
  T_OK(ep_register_memory(w->buf, w->c.rx, rows * AH * 2, &w->mem));
}

/* Dispatches until one fails (at most n): on CUDA a call returns once its data kernel is queued,
 * so a failure shows in a later call. */
static ep_status_t alloc_until_failure(alloc_world_t *w, int n) {
  ep_status_t st = EP_OK;
  for (int i = 0; i < n && st == EP_OK; i++) {
    ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
    a.x = w->x, a.dtype = EP_DTYPE_BF16, a.num_tokens = AN, a.hidden = AH, a.topk_idx = w->idx;
    a.topk = AK, a.num_experts = 4 * w->R;
    ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
    o.mode = EP_OUTPUT_ALLOC, o.alloc = alloc_or_die, o.alloc_ctx = &w->c;
    st = ep_dispatch(w->buf, &a, &o);
    if (!st) T_OK(ep_handle_destroy(o.handle));
  }
  return st;
}

static void alloc_world_fini(alloc_world_t *w) {
  T_OK(ep_buffer_destroy(w->buf)); /* undoes the registration, without waiting for the dead */
  T_OK(ep_group_destroy(w->g));
  t_dfree(w->x), t_dfree(w->idx), t_dfree(w->c.rx), t_dfree(w->c.idx), t_dfree(w->c.w);
  t_dfree(w->c.src);
}

static int kill_in_alloc(void) {
  alloc_world_t w;
  alloc_world_init(&w, 0);
  w.c.victim = w.me == w.R - 1;
  ep_status_t st = alloc_until_failure(&w, 50); /* the dispatch after the death fails */
  if (w.me == w.R - 1) pause();                 /* not reached: it died in its first callback */
  survivor_report(st, "dispatch (allocator)", w.R - 1);
  alloc_world_fini(&w);
  return T_PASS;
}

/* The last rank sleeps 3 s in its first allocator callback (deadline 1 s): its count went out,
 * its rows (with EP_CUDA_LATE_HELLO=1 on CUDA: first its late hello) come too late. The others
 * fail after about one deadline naming it, on CUDA with the late hello as waiting for that.
 * With EP_CUDA_EARLY_DATA=1 (and no late hello) its rows move before its allocation: the others'
 * first call completes and their second one fails the same way, in its count exchange. */
static int slow_alloc(void) {
  alloc_world_t w;
  alloc_world_init(&w, 1.0);
  const int late = w.R - 1;
  w.c.stall_s = w.me == late ? 3 : 0;
  const double t0 = tk_now_s();
  ep_status_t st = alloc_until_failure(&w, 3);
  const double dt = tk_now_s() - t0;
  if (w.me == late) {
    T_CHECK(st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED, "late rank got %s: %s",
            ep_status_name(st), ep_last_error());
    T_CHECK(dt < 8.0, "the late rank failed only after %.2f s", dt);
  } else {
    char want[32];
    snprintf(want, sizeof want, "rank %d", late);
    const bool late_hello = t_late_hello();
    T_CHECK(st == EP_ERR_TIMEOUT, "got %s, expected EP_ERR_TIMEOUT: %s", ep_status_name(st),
            ep_last_error());
    T_CHECK(strstr(ep_last_error(), want) && (!late_hello || strstr(ep_last_error(), "late hello")),
            "the timeout does not name %s%s: %s", want, late_hello ? " and its late hello" : "",
            ep_last_error());
    check_timeout_s(dt);
  }
  printf("rank %d: %s after %.2f s: %s\n", w.me, ep_status_name(st), dt, ep_last_error());
  /* On CUDA the late rank's data kernel writes into the peers' pools once it runs: every rank's
   * kernels end (each has a deadline) before any rank frees its pool (a fresh group meets). */
  ep_group_t g2;
  int me2, R2;
  t_init(&g2, &me2, &R2);
  t_dsync();
  T_OK(ep_group_barrier(g2));
  alloc_world_fini(&w);
  t_fini(g2);
  return T_PASS;
}

/* Low-latency calls in a loop until the victim's death shows. */
static int kill_in_ll(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  enum { T = 64, H = 1024, K = 4 };
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.ll_max_tokens = T, cfg.ll_hidden = H, cfg.ll_num_experts = 4 * R, cfg.ll_max_topk = K;
  T_OK(ep_buffer_create(g, &cfg, &buf));
  /* Tensors where the backend reads them (device memory with EP_BACKEND=cuda). */
  uint16_t *hx = t_xmalloc((size_t)T * H * 2);
  int64_t hidx[T * K];
  float hw[T * K];
  for (int i = 0; i < T * H; i++) hx[i] = 0x3f80;
  for (int i = 0; i < T * K; i++) hidx[i] = (i / K * 5 + i % K) % (4 * R), hw[i] = 1.0f;
  void *x = t_to_dev(hx, (size_t)T * H * 2), *out = t_dalloc((size_t)T * H * 2);
  void *idx = t_to_dev(hidx, sizeof hidx), *w = t_to_dev(hw, sizeof hw);
  free(hx);
  int victim = R - 1;
  pthread_t th;
  if (me == victim) pthread_create(&th, NULL, killer, (void *)(uintptr_t)30);
  ep_status_t st = EP_OK;
  for (int i = 0; i < 100000 && st == EP_OK; i++) {
    ep_ll_handle_t h = NULL;
    ep_ll_dispatch_args_t a = {
        .size = sizeof a, .x = x, .num_tokens = T, .topk_idx = idx, .topk = K};
    st = ep_ll_dispatch(buf, &a, &h);
    ep_ll_recv_view_t v = {.size = sizeof v};
    if (!st) st = ep_ll_get_recv_view(h, &v);
    ep_ll_combine_args_t c = {.size = sizeof c,
                              .handle = h,
                              .y = v.recv_x,
                              .topk_idx = idx,
                              .topk_weights = w,
                              .out = out};
    if (!st) st = ep_ll_combine(buf, &c);
    if (h) T_OK(ep_ll_handle_destroy(h));
  }
  if (me == victim) pause();
  survivor_report(st, "low-latency", victim);
  T_OK(ep_buffer_destroy(buf));
  T_OK(ep_group_destroy(g));
  t_dfree(x), t_dfree(out), t_dfree(idx), t_dfree(w);
  return T_PASS;
}

static int kill_in_create(int victim) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  if (me == victim) {
    nanosleep(&(struct timespec){0, 200 * 1000 * 1000}, NULL); /* let the others enter create */
    die_now();
  }
  ep_status_t st = ep_buffer_create(g, NULL, &buf);
  survivor_report(st, "buffer creation", victim);
  T_OK(ep_group_destroy(g));
  return T_PASS;
}

/* This rank stopped from 0.3 s to 2 s by a forked helper (which touches nothing of epcomm's). */
static void pause_me(void) {
  pid_t self = getpid();
  if (fork() == 0) {
    nanosleep(&(struct timespec){0, 300 * 1000 * 1000}, NULL);
    kill(self, SIGSTOP);
    nanosleep(&(struct timespec){1, 700 * 1000 * 1000}, NULL);
    kill(self, SIGCONT);
    _exit(0);
  }
}

/* The last rank enters the dispatch 3 s late; with a 1 s deadline the others give up, naming it,
 * the phase and the operation; the late rank then finds the call abandoned. gone: rank 0 is
 * stopped meanwhile, so that rank 1 gives up first and has exited when rank 0 looks again. */
static int timeout(bool gone) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.timeout_s = 1.0; /* the buffer's calls; the group's own deadline stays at its default */
  T_OK(ep_buffer_create(g, &cfg, &buf));
  big_t b;
  big_init(&b, R, me);
  b.n = 8;
  int late = R - 1;
  if (me == late) nanosleep(&(struct timespec){3, 0}, NULL);
  if (gone && me == 0) pause_me();
  double t0 = tk_now_s();
  ep_status_t st = big_dispatch(buf, &b, R);
  double dt = tk_now_s() - t0;
  if (me == late) {
    T_CHECK(
        (st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED) && strstr(ep_last_error(), "too late"),
        "late rank got %s: %s", ep_status_name(st), ep_last_error());
  } else {
    char want[48];
    snprintf(want, sizeof want, "rank %d", late);
    T_CHECK(st == EP_ERR_TIMEOUT, "got %s, expected EP_ERR_TIMEOUT", ep_status_name(st));
    T_CHECK(strstr(ep_last_error(), "ep_dispatch") && strstr(ep_last_error(), "hello") &&
                (strstr(ep_last_error(), want) || strstr(ep_last_error(), "rank(s) 2")),
            "timeout message lacks operation, phase or missing rank: %s", ep_last_error());
    check_timeout_s(dt);
  }
  printf("rank %d: %s after %.2f s: %s\n", me, ep_status_name(st), dt, ep_last_error());
  T_OK(ep_buffer_destroy(buf));
  T_OK(ep_group_destroy(g));
  big_free(&b);
  return T_PASS;
}

/* The last rank stops itself after the dispatch; a forked helper resumes it 4 s later. The
 * survivors' combine fails after one deadline naming it, and their destroys skip the collective
 * work: no second deadline. The resumed rank learns that it came too late. */
static void stop_self(void) {
  pid_t self = getpid();
  if (fork() == 0) { /* touches nothing of epcomm's, and leaves through _exit */
    nanosleep(&(struct timespec){4, 0}, NULL);
    kill(self, SIGCONT);
    _exit(0);
  }
  raise(SIGSTOP);
}

/* timed: whether this rank's time is checked (not when it was stopped itself meanwhile). */
static void stopped_report(int me, int victim, ep_status_t st, const char *msg, double t_fail,
                           double total, double T, const char *what, bool timed) {
  char want[32];
  snprintf(want, sizeof want, "rank %d", victim);
  if (me == victim) {
    T_CHECK(st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED, "resumed rank: %s",
            ep_status_name(st));
    T_CHECK(strstr(msg, "too late"), "the resumed rank does not say it came too late: %s", msg);
    printf("rank %d (resumed): %s: %s\n", me, ep_status_name(st), msg);
    return;
  }
  T_CHECK(st == EP_ERR_TIMEOUT, "survivor: %s, expected EP_ERR_TIMEOUT (%s)", ep_status_name(st),
          msg);
  T_CHECK(strstr(msg, want), "survivor's error does not name the stopped %s: %s", want, msg);
  T_CHECK(!timed || total < 2 * T, "survivor took %.2f s for %s + destroys, deadline %.1f s", total,
          what, T);
  printf("rank %d: %s failed after %.2f s, destroys done at %.2f s (deadline %.1f s): %s\n", me,
         what, t_fail, total, T, msg);
}

static int stopped_rank(bool in_barrier, bool gone) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  double T = atof(getenv("EP_TIMEOUT_S") ? getenv("EP_TIMEOUT_S") : "100");
  T_OK(ep_buffer_create(g, NULL, &buf));
  big_t b;
  big_init(&b, R, me);
  b.n = 64;
  T_OK(big_dispatch(buf, &b, R));
  T_OK(big_combine(buf, &b));
  int victim = R - 1;
  if (in_barrier) T_OK(ep_buffer_destroy(buf)); /* the barrier is then the group's next call */
  if (me == victim) stop_self();
  if (in_barrier && me == 0 && !gone) nanosleep(&(struct timespec){0, 300 * 1000 * 1000}, NULL);
  if (gone && me == 1) pause_me();
  double t0 = tk_now_s();
  ep_status_t st = in_barrier ? ep_group_barrier(g) : big_combine(buf, &b);
  double t_fail = tk_now_s() - t0;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ep_last_error());
  T_OK(ep_handle_destroy(b.h));
  if (!in_barrier) T_OK(ep_buffer_destroy(buf)); /* broken: local, EP_OK */
  T_OK(ep_group_destroy(g));                     /* broken by the timeout too: local, EP_OK */
  stopped_report(me, victim, st, msg, t_fail, tk_now_s() - t0, T,
                 in_barrier ? "barrier" : "combine", !(gone && me == 1));
  big_free(&b);
  return T_PASS;
}

/* A rank that dies before (or while) creating its group: the others' ep_group_create_from_env
 * fails within seconds naming it, instead of waiting for the deadline or the launcher's SIGTERM. */
static int early_death(const char *how) {
  int me = atoi(getenv("EP_RANK") ? getenv("EP_RANK") : "0");
  int R = atoi(getenv("EP_NRANKS") ? getenv("EP_NRANKS") : "1");
  t_rank = me;
  bool during = !strcmp(how, "during");
  int victim = during ? 1 : R - 1;
  if (me == victim && !during) {
    FILE *f = fopen(death_file, "w");
    if (f) fprintf(f, "%.9f\n", tk_now_s()), fclose(f);
    if (!strcmp(how, "kill")) raise(SIGKILL);
    exit(!strcmp(how, "exit1") ? 1 : 0);
  }
  pthread_t th;
  if (me == victim) pthread_create(&th, NULL, killer, (void *)(uintptr_t)300);
  if (during && me == R - 1) nanosleep(&(struct timespec){1, 0}, NULL); /* group incomplete */
  ep_group_t g;
  ep_status_t st = ep_group_create_from_env(NULL, &g);
  if (me == victim) pause();
  if (st == EP_OK) T_FAILF("ep_group_create_from_env succeeded without rank %d", victim);
  survivor_report(st, "group creation", victim);
  return T_PASS;
}

/* Rounds until one fails; the result goes to a file since the launcher (our stdout) may be dead. */
static int loop(const char *dir) {
  int R, me;
  ep_group_t g;
  ep_buffer_t buf;
  t_init(&g, &me, &R);
  T_OK(ep_buffer_create(g, NULL, &buf));
  big_t b;
  big_init(&b, R, me);
  b.n = 256;
  char path[512];
  snprintf(path, sizeof path, "%s/pid.%d", dir, me);
  FILE *f = fopen(path, "w");
  T_CHECK(f, "cannot write %s", path);
  fprintf(f, "%d %s\n", (int)getpid(), getenv("EP_JOB_ID") ? getenv("EP_JOB_ID") : "-");
  fclose(f);
  ep_status_t st = EP_OK;
  double t0 = tk_now_s(), t_fail = 0;
  while (st == EP_OK && tk_now_s() - t0 < 30) {
    st = big_dispatch(buf, &b, R);
    if (!st) st = big_combine(buf, &b);
    if (!st) T_OK(ep_handle_destroy(b.h));
    t_fail = tk_now_s();
  }
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ep_last_error());
  ep_buffer_destroy(buf);
  ep_group_destroy(g);
  big_free(&b);
  snprintf(path, sizeof path, "%s/result.%d", dir, me);
  f = fopen(path, "w");
  T_CHECK(f, "cannot write %s", path);
  fprintf(f, "%.9f %s %s\n", t_fail, ep_status_name(st), msg);
  fclose(f);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  death_file = argc > 2 ? argv[2] : "/dev/null";
  t_require_backend(); /* EP_BACKEND=cuda (kill-ll) without a GPU: "skipped: no GPU" */
  if (!strcmp(mode, "probe")) return T_PASS; /* tests/test_failure.sh: can this backend run? */
  if (!strcmp(mode, "kill-dispatch")) return kill_in_op("dispatch");
  if (!strcmp(mode, "kill-combine")) return kill_in_op("combine");
  if (!strcmp(mode, "kill-alloc")) return kill_in_alloc();
  if (!strcmp(mode, "slow-alloc")) return slow_alloc();
  if (!strcmp(mode, "kill-create")) {
    const char *n = getenv("EP_NRANKS");
    return kill_in_create(n ? atoi(n) - 1 : 0);
  }
  if (!strcmp(mode, "kill-root")) return kill_in_create(0);
  if (!strcmp(mode, "kill-ll")) return kill_in_ll();
  if (!strcmp(mode, "timeout")) return timeout(false);
  if (!strcmp(mode, "timeout-gone")) return timeout(true);
  if (!strcmp(mode, "stop")) return stopped_rank(false, false);
  if (!strcmp(mode, "stop-barrier")) return stopped_rank(true, false);
  if (!strcmp(mode, "stop-barrier-gone")) return stopped_rank(true, true);
  if (!strncmp(mode, "early-", 6)) return early_death(mode + 6);
  if (!strcmp(mode, "loop")) return loop(death_file);
  fprintf(stderr,
          "usage: test_failure kill-dispatch|kill-combine|kill-alloc|kill-create|kill-root FILE | "
          "slow-alloc | timeout | timeout-gone | stop | stop-barrier | stop-barrier-gone | "
          "early-exit1|early-kill|early-exit0|early-during FILE | "
          "loop DIR\n");
  return T_FAIL;
}
