/* Fork safety (issue 16, item 3), under `epcomm launch -n R`: after a fork() the child holds
 * copies of the parent's group and buffer. Any use of them in the child must fail clearly
 * (EP_ERR_FORKED, naming both pids) without touching the peers; the child's exit prints nothing
 * (the exit report is about the parent's objects); the parents' later rounds still match the
 * reference bit for bit. */
#include <sys/wait.h>
#include <unistd.h>

#include "round.h"

static void expect_forked(ep_status_t st, const char *call, pid_t parent) {
  char want[64];
  snprintf(want, sizeof want, "created by pid %d", (int)parent);
  T_CHECK(st == EP_ERR_FORKED, "child: %s -> %s, expected EP_ERR_FORKED (%s)", call,
          ep_status_name(st), ep_last_error());
  T_CHECK(strstr(ep_last_error(), want) && strstr(ep_last_error(), "after fork"),
          "child: %s: the message does not say which pid created the object: %s", call,
          ep_last_error());
}

/* The child tries what a careless program would: a dispatch, a barrier, destroys; then exits
 * normally (atexit handlers and destructors run). */
static _Noreturn void child(ep_group_t g, ep_buffer_t b, pid_t parent) {
  uint16_t x[128] = {0}, rx[128 * 64];
  int64_t idx[1] = {0};
  ep_dispatch_args_t a = EP_DISPATCH_ARGS_INIT;
  a.x = x, a.dtype = EP_DTYPE_BF16, a.num_tokens = 1, a.hidden = 128, a.topk_idx = idx;
  a.topk = 1, a.num_experts = 2;
  ep_dispatch_out_t o = EP_DISPATCH_OUT_INIT;
  o.mode = EP_OUTPUT_CALLER, o.recv_x = rx, o.capacity = 64;
  expect_forked(ep_dispatch(b, &a, &o), "ep_dispatch", parent);
  printf("child: ep_dispatch -> EP_ERR_FORKED: %s\n", ep_last_error());
  expect_forked(ep_group_barrier(g), "ep_group_barrier", parent);
  expect_forked(ep_buffer_destroy(b), "ep_buffer_destroy", parent);
  expect_forked(ep_buffer_release(b), "ep_buffer_release", parent);
  expect_forked(ep_group_destroy(g), "ep_group_destroy", parent);
  int r;
  expect_forked(ep_group_rank(g, &r), "ep_group_rank", parent);
  fflush(stdout);
  exit(T_PASS);
}

int main(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b;
  t_init(&g, &me, &R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.timeout_s = 3.0; /* a child that did pair with a peer would fail in seconds, not minutes */
  T_OK(ep_buffer_create(g, &cfg, &b));
  long wrong;
  T_OK(t_round(b, R, me, 1, &wrong));
  T_CHECK(wrong == 0, "round before the fork: %ld values differ from the reference", wrong);
  pid_t parent = getpid(), pid = fork();
  T_CHECK(pid >= 0, "fork failed");
  if (pid == 0) child(g, b, parent);
  int ws;
  T_CHECK(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == T_PASS,
          "the forked child failed its checks (wait status %#x)", ws);
  T_OK(ep_group_barrier(g)); /* every rank's child is done */
  for (uint64_t round = 2; round < 6; round++) {
    T_OK(t_round(b, R, me, round, &wrong));
    T_CHECK(wrong == 0, "round %d after the fork: %ld values differ from the reference", (int)round,
            wrong);
  }
  printf(
      "rank %d: the child got EP_ERR_FORKED for every call; 4 later rounds match the "
      "reference\n",
      me);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  return T_PASS;
}
