/* Groups across hosts, beyond the data matrices (tests/test_normal.c, tests/test_ll.c run those):
 *
 *   test_net maps            a group, a buffer, a dispatch and a combine; then /proc/self/maps must
 *                            show libmpi exactly when the group spans hosts, and never libnccl
 *                            (a one-host job never loads the engines)
 *   test_net hostid W0 W1 .. rank r sets EP_HOST_ID=Wr ("-": unset) and creates a group; every
 *                            rank must fail with the same status (printed as "status NAME: msg")
 *                            when the split is bad, or succeed ("hosts N")
 *   test_net kill V[,V..] DIR [host|beat]
 *                            ranks dispatch and combine in rounds; the victims SIGKILL
 *                            themselves before round 2. Every survivor must fail promptly with
 *                            EP_ERR_PEER_FAILED naming a victim and its host; it writes
 *                            "detected death of rank V (host H) in T ms: message" to DIR/rank.R
 *                            (a file: mpirun may drop the output of a job it is ending).
 *                            "host": the victims are every rank of a host, and no rank is left
 *                            there to see them die: the survivors fail at the group's deadline
 *                            (3 s here) with EP_ERR_TIMEOUT naming a victim and its host (or
 *                            EP_ERR_PEER_FAILED, a notice of the deaths having come first).
 *                            "beat": the same with heartbeats (EP_HEARTBEAT_S) and a deadline
 *                            of 60 s: EP_ERR_PEER_FAILED within 3 x EP_HEARTBEAT_S, by them.
 *                            "ll": the rounds are low-latency dispatches and combines.
 *   test_net mismatch        ranks that combine the handles of different dispatches (of different
 *                            routings) fail alike with EP_ERR_MISMATCH (normal mode: one host or
 *                            several, except a CUDA combine on one host, which does not wait for
 *                            the verdict; low-latency mode: the CPU backend, and cuda across
 *                            hosts), and a misaligned combine output on one rank (cuda across
 *                            hosts) is EP_ERR_SHAPE there, EP_ERR_PEER_INVALID on the others; a
 *                            checked round follows each.
 * Run under `epcomm launch -n R [--hosts H]` or mpirun (tests/test_net.sh). */
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "round.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Which engine libraries this process has mapped. */
static void mapped(bool *mpi, bool *nccl) {
  *mpi = *nccl = false;
  FILE *f = fopen("/proc/self/maps", "re");
  char line[4096];
  while (f && fgets(line, sizeof line, f)) {
    if (strstr(line, "libmpi.so") || strstr(line, "libopen-pal")) *mpi = true;
    if (strstr(line, "libnccl")) *nccl = true;
  }
  if (f) fclose(f);
}

static int maps(void) {
  ep_group_t g;
  int me, R, H, *host_of;
  t_init(&g, &me, &R);
  t_hosts(g, &H, &host_of);
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, NULL, &b));
  long wrong;
  T_OK(t_round(b, R, me, 3, &wrong));
  T_CHECK(wrong == 0, "%ld values differ from the reference", wrong);
  bool mpi, nccl;
  mapped(&mpi, &nccl);
  T_CHECK(!nccl, "libnccl is mapped in a cpu job");
  T_CHECK(mpi == (H > 1), "libmpi is %smapped with %d host(s)", mpi ? "" : "not ", H);
  T_OK(ep_buffer_destroy(b));
  t_fini(g);
  free(host_of);
  if (me == 0)
    printf("test_net maps: %d host(s): libmpi %s, libnccl not mapped\n", H,
           mpi ? "mapped" : "not mapped");
  return T_PASS;
}

static int hostid(int argc, char **argv) {
  int r = -1;
  const char *v = getenv("OMPI_COMM_WORLD_RANK");
  if (!v) v = getenv("EP_RANK");
  if (v) r = atoi(v);
  T_CHECK(r >= 0 && r + 2 < argc, "no word for rank %d", r);
  if (strcmp(argv[2 + r], "-")) setenv("EP_HOST_ID", argv[2 + r], 1);
  ep_group_t g;
  ep_status_t st = ep_group_create_from_env(NULL, &g);
  if (st) {
    printf("rank %d: status %s: %s\n", r, ep_status_name(st), ep_last_error());
    return T_PASS;
  }
  ep_group_info_t i = EP_GROUP_INFO_INIT;
  T_OK(ep_group_query(g, &i));
  printf("rank %d: hosts %d (host %d, local rank %d of %d)\n", r, i.nhosts, i.host, i.local_rank,
         i.local_size);
  t_fini(g);
  return T_PASS;
}

/* Detection must be prompt, but "prompt" is measured on a machine that may be oversubscribed or
 * busy with other jobs: the bound is generous against the timeout (30 s), not a race. */
#define KILL_PROMPT_MS 5000

static bool in_list(const char *list, int r) {
  char buf[256], *save = NULL;
  snprintf(buf, sizeof buf, "%s", list);
  for (char *v = strtok_r(buf, ",", &save); v; v = strtok_r(NULL, ",", &save))
    if (atoi(v) == r) return true;
  return false;
}

/* host: a whole host dies with the heartbeats off, the survivors fail at the deadline (3 s).
 * beat: a whole host stops (SIGSTOP: its processes live on, so no rank of it can die visibly or
 * tell anyone, as when a host hangs or is cut off), the heartbeats on (EP_HEARTBEAT_S, set by the
 * caller) and a deadline of 60 s, which the survivors must beat: the ranks watching that host
 * find it silent and tell the rest. Then the first survivor kills the stopped ranks. */
static void stop_self(const char *dir, int me) {
  char path[4200];
  snprintf(path, sizeof path, "%s/pid.%d", dir, me);
  FILE *f = fopen(path, "we");
  if (f) fprintf(f, "%d\n", (int)getpid()), fclose(f);
  raise(SIGSTOP);
}

static void kill_stopped(const char *victims, const char *dir, int R) {
  for (int r = 0; r < R; r++) {
    char path[4200];
    snprintf(path, sizeof path, "%s/pid.%d", dir, r);
    FILE *f = in_list(victims, r) ? fopen(path, "re") : NULL;
    int pid = 0;
    if (f && fscanf(f, "%d", &pid) == 1 && pid > 0) kill(pid, SIGKILL);
    if (f) fclose(f);
  }
}

/* One low-latency dispatch + combine of T tokens (H 128, topk 2 of 4 experts per rank), its
 * status; the data is test_ll's business. */
enum { LL_T = 8, LL_H = 128, LL_K = 2 };
static ep_status_t ll_round(ep_buffer_t b, int R, int me, int i) {
  int64_t idx[LL_T * LL_K];
  float w[LL_T * LL_K];
  uint16_t x[LL_T * LL_H];
  for (int t = 0; t < LL_T * LL_H; t++) x[t] = 0x3f80;
  for (int t = 0; t < LL_T; t++)
    for (int k = 0; k < LL_K; k++)
      idx[t * LL_K + k] = ((me + t + i) % R) * 4 + k, w[t * LL_K + k] = 0.5f;
  void *dx = t_to_dev(x, sizeof x), *di = t_to_dev(idx, sizeof idx), *dw = t_to_dev(w, sizeof w);
  void *out = t_dalloc(sizeof x);
  ep_ll_dispatch_args_t a = {
      .size = sizeof a, .x = dx, .topk_idx = di, .num_tokens = LL_T, .topk = LL_K};
  ep_ll_handle_t h = NULL;
  ep_status_t st = ep_ll_dispatch(b, &a, &h);
  void *y = NULL;
  if (!st) st = ep_ll_get_combine_buffer(b, h, &y);
  ep_ll_combine_args_t c = {
      .size = sizeof c, .handle = h, .y = y, .topk_idx = di, .topk_weights = dw, .out = out};
  if (!st) st = ep_ll_combine(b, &c);
  t_dsync();
  if (h) ep_ll_handle_destroy(h);
  t_dfree(dx), t_dfree(di), t_dfree(dw), t_dfree(out);
  return st;
}

/* A normal-mode dispatch of LL_T tokens into caller memory (the handle is what matters). */
static ep_handle_t dispatch_some(ep_buffer_t b, int R, void **x, void **idx, void **rx) {
  int64_t id[LL_T * LL_K];
  uint16_t h[LL_T * LL_H];
  for (int i = 0; i < LL_T * LL_H; i++) h[i] = 0x3f80;
  static int calls;
  calls++; /* each dispatch its own routing: a combine along the other's layout would misroute */
  for (int i = 0; i < LL_T * LL_K; i++) id[i] = (i * 3 * calls + i / LL_K) % (4 * R);
  for (int t = 0; t < LL_T; t++)
    if (id[t * LL_K] == id[t * LL_K + 1]) id[t * LL_K + 1] = -1;
  *x = t_to_dev(h, sizeof h), *idx = t_to_dev(id, sizeof id);
  *rx = t_dalloc((size_t)R * LL_T * LL_H * 2 + 64);
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = *x, a.dtype = EP_DTYPE_BF16, a.num_tokens = LL_T, a.hidden = LL_H;
  a.topk_idx = *idx, a.topk = LL_K, a.num_experts = 4 * R;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = *rx, o.capacity = R * LL_T;
  T_OK(ep_dispatch(b, &a, &o));
  return o.handle;
}

static int mismatch(void) {
  ep_group_t g;
  int me, R;
  long wrong;
  t_init(&g, &me, &R);
  int H, *host_of;
  t_hosts(g, &H, &host_of);
  free(host_of);
  ep_buffer_config_t bc = EP_BUFFER_CONFIG_INIT;
  bc.ll_max_tokens = LL_T, bc.ll_hidden = LL_H, bc.ll_num_experts = 4 * R;
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, &bc, &b));
  void *x[2], *idx[2], *rx[2];
  ep_handle_t h[2];
  for (int i = 0; i < 2; i++) h[i] = dispatch_some(b, R, &x[i], &idx[i], &rx[i]);
  uint16_t *out = t_dalloc(LL_T * LL_H * 2 + 64);
  ep_combine_args_t c = EP_COMBINE_ARGS_INIT;
  c.handle = h[me == 0 ? 0 : 1], c.x = rx[me == 0 ? 0 : 1], c.out = out;
  /* On one host a CUDA combine never waits on the host: its kernel finds the mismatch, moves
   * nothing, and the next call logs it (cuda_sync.c, deferred): nothing to assert here. */
  const bool waits = R > 1 && (!t_cuda() || H > 1); /* (one rank: nobody to disagree with) */
  ep_status_t st = ep_combine(b, &c);
  T_CHECK(!waits || (st == EP_ERR_MISMATCH && strstr(ep_last_error(), "handle the call uses")),
          "handles of different dispatches: %s (%s)", ep_status_name(st), ep_last_error());
  t_dsync();
  T_OK(t_round(b, R, me, 11, &wrong));
  T_CHECK(wrong == 0, "%ld values wrong after the mismatch", wrong);
  if (t_cuda() && H > 1) { /* the CPU backend takes any alignment; on one host the CUDA
                             combine's peers do not wait for this rank's verdict */
    c.handle = h[1], c.x = rx[1], c.out = me == 0 ? (void *)((char *)out + 2) : out;
    T_STATUS(me == 0 ? EP_ERR_SHAPE
             : R > 1 ? EP_ERR_PEER_INVALID
                     : EP_ERR_SHAPE,
             ep_combine(b, &c));
    T_OK(t_round(b, R, me, 12, &wrong));
    T_CHECK(wrong == 0, "%ld values wrong after the misaligned combine", wrong);
  }
  for (int i = 0; i < 2; i++) {
    T_OK(ep_handle_destroy(h[i]));
    t_dfree(x[i]), t_dfree(idx[i]), t_dfree(rx[i]);
  }
  /* Low-latency, two results alive, each rank combines another: cuda across hosts agrees on
   * every combine; the CPU backend's headers between hosts carry the dispatch's number, and
   * inside a host a peer's flag of this combine in the other result slot shows it. (A CUDA
   * combine on one host: a timeout, not checked here.) */
  if (R > 1 && (!t_cuda() || H > 1)) {
    int64_t id[LL_T * LL_K];
    float w[LL_T * LL_K];
    uint16_t hx[LL_T * LL_H];
    for (int i = 0; i < LL_T * LL_H; i++) hx[i] = 0x3f80;
    for (int t = 0; t < LL_T * LL_K; t++) id[t] = (t % LL_K) * 4 + (t / LL_K) % 4, w[t] = 1.0f;
    void *dx = t_to_dev(hx, sizeof hx), *di = t_to_dev(id, sizeof id), *dw = t_to_dev(w, sizeof w);
    ep_ll_dispatch_args_t a = {
        .size = sizeof a, .x = dx, .topk_idx = di, .num_tokens = LL_T, .topk = LL_K};
    ep_ll_handle_t lh[2];
    for (int i = 0; i < 2; i++) T_OK(ep_ll_dispatch(b, &a, &lh[i]));
    void *y;
    T_OK(ep_ll_get_combine_buffer(b, lh[me == 0 ? 0 : 1], &y));
    ep_ll_combine_args_t lc = {.size = sizeof lc,
                               .handle = lh[me == 0 ? 0 : 1],
                               .y = y,
                               .topk_idx = di,
                               .topk_weights = dw,
                               .out = out};
    T_STATUS(EP_ERR_MISMATCH, ep_ll_combine(b, &lc));
    for (int i = 0; i < 2; i++) T_OK(ep_ll_handle_destroy(lh[i]));
    T_OK(ll_round(b, R, me, 1));
    t_dfree(dx), t_dfree(di), t_dfree(dw);
  }
  t_dfree(out);
  T_OK(ep_buffer_destroy(b));
  t_fini(g);
  if (me == 0) printf("test_net mismatch: R=%d passed\n", R);
  return T_PASS;
}

static int kill_some(const char *victims, const char *dir, bool host, bool beat, bool ll) {
  const int rounds = 5;
  ep_group_t g;
  ep_group_config_t gc = EP_GROUP_CONFIG_INIT;
  gc.timeout_s = beat ? 60 : host ? 3 : 30;
  T_OK(ep_group_create_from_env(&gc, &g));
  int me, R, H, *host_of;
  T_OK(ep_group_rank(g, &me));
  T_OK(ep_group_nranks(g, &R));
  t_rank = me;
  t_hosts(g, &H, &host_of);
  ep_buffer_t b;
  ep_buffer_config_t bc = EP_BUFFER_CONFIG_INIT;
  if (ll) bc.ll_max_tokens = LL_T, bc.ll_hidden = LL_H, bc.ll_num_experts = 4 * R;
  T_OK(ep_buffer_create(g, &bc, &b));
  long wrong;
  ep_status_t st = EP_OK;
  double t0 = 0;
  for (int i = 0; i < rounds && !st; i++) {
    if (i == 2 && in_list(victims, me) && beat) stop_self(dir, me);
    if (i == 2 && in_list(victims, me)) kill(getpid(), SIGKILL);
    t0 = now_s();
    st = ll ? ll_round(b, R, me, i) : t_round(b, R, me, (uint64_t)i, &wrong);
  }
  /* A victim still in an earlier round may see another victim die first: it dies all the same
   * (a host going down takes all of its ranks). */
  if (in_list(victims, me)) kill(getpid(), SIGKILL);
  double ms = (now_s() - t0) * 1e3;
  T_CHECK(st == EP_ERR_PEER_FAILED || (host && !beat && st == EP_ERR_TIMEOUT),
          "round ended with %s (%s), expected EP_ERR_PEER_FAILED%s", ep_status_name(st),
          ep_last_error(), host ? " or EP_ERR_TIMEOUT" : "");
  int victim = -1;
  char want[64];
  for (int r = 0; r < R && victim < 0; r++) {
    snprintf(want, sizeof want, "rank %d (host %d", r, host_of[r]);
    if (in_list(victims, r) && strstr(ep_last_error(), want)) victim = r;
  }
  T_CHECK(victim >= 0, "the message names no victim (%s) with its host: %s", victims,
          ep_last_error());
  if (beat) {
    const char *hb = getenv("EP_HEARTBEAT_S");
    double limit = hb ? atof(hb) : 5.0;
    T_CHECK(strstr(ep_last_error(), "heartbeat"), "not found by the heartbeats: %s",
            ep_last_error());
    T_CHECK(ms < KILL_PROMPT_MS + 3e3 * limit, "detected after %.0f ms (EP_HEARTBEAT_S=%g): %s", ms,
            limit, ep_last_error());
  }
  T_CHECK(ms < KILL_PROMPT_MS + (host ? 1e3 * gc.timeout_s : 0) + (beat ? 3e3 * 60 : 0),
          "detected after %.0f ms: %s", ms, ep_last_error());
  char path[4200];
  snprintf(path, sizeof path, "%s/rank.%d", dir, me);
  FILE *f = fopen(path, "we");
  T_CHECK(f, "cannot write %s", path);
  fprintf(f, "detected death of rank %d (host %d) in %.0f ms: %s\n", victim, host_of[victim], ms,
          ep_last_error());
  fclose(f);
  /* The launcher ends the job at the first survivor's exit (a rank that leaves MPI without
   * finalizing it): stay until every survivor has written its verdict (bounded, generously: a
   * survivor may be slow to be scheduled). */
  for (int r = 0; r < R; r++) {
    snprintf(path, sizeof path, "%s/rank.%d", dir, r);
    for (double end = now_s() + 20;
         !in_list(victims, r) && access(path, F_OK) != 0 && now_s() < end;)
      usleep(10000);
  }
  int first = 0;
  while (in_list(victims, first)) first++;
  if (beat && me == first) kill_stopped(victims, dir, R);
  T_OK(ep_buffer_destroy(b)); /* broken: local, at once */
  T_OK(ep_group_destroy(g));
  free(host_of);
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *what = argc > 1 ? argv[1] : "";
  if (!strcmp(what, "maps")) return maps();
  if (!strcmp(what, "hostid")) return hostid(argc, argv);
  if (!strcmp(what, "mismatch")) {
    t_require_backend();
    return mismatch();
  }
  if (!strcmp(what, "gpu")) { /* EP_BACKEND=cuda without a GPU: exits 77 ("skipped: no GPU") */
    t_require_backend();
    return T_PASS;
  }
  if (!strcmp(what, "kill") && argc > 3)
    return kill_some(argv[2], argv[3], argc > 4 && strcmp(argv[4], "host") == 0,
                     argc > 4 && strcmp(argv[4], "beat") == 0,
                     argc > 4 && strcmp(argv[4], "ll") == 0);
  fprintf(stderr,
          "usage: test_net maps | hostid W0 W1 ... | kill VICTIM[,VICTIM...] DIR [host|beat|ll] | "
          "mismatch | gpu\n");
  return T_FAIL;
}
