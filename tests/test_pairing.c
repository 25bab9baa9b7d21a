/* Collectives pair with the right call (issue 16, item 4), under `epcomm launch -n 3`, with a
 * 10 s group deadline so that a rank left waiting would show:
 *   test_pairing reject-create   rank 1 passes a bad buffer config: it gets its own error at
 *                                once, the others EP_ERR_PEER_INVALID naming rank 1 at once;
 *                                the next create and a round of data still work (reference)
 *   test_pairing barrier-destroy rank 1 calls ep_buffer_destroy while the others call
 *                                ep_group_barrier: EP_ERR_MISMATCH on every rank, naming both
 *                                operations and their numbers; destroys then work locally
 *   test_pairing barrier-gdestroy rank 1 calls ep_group_destroy while the others call
 *                                ep_group_barrier: the same
 *   test_pairing allgather-size  rank 1's allgather has another size: EP_ERR_MISMATCH everywhere
 *   test_pairing bad-buffer      rank 1 calls ep_dispatch with a NULL buffer while the others
 *                                dispatch on their (only) buffer: they get EP_ERR_PEER_INVALID
 *                                instead of pairing with rank 1's next dispatch */
#include <time.h>

#include "round.h"
#include "tk_clock.h"

static void setup(ep_group_t *g, int *me, int *R) {
  ep_group_config_t gc = EP_GROUP_CONFIG_INIT;
  gc.timeout_s = 10.0;
  T_OK(ep_group_create_from_env(&gc, g));
  T_OK(ep_group_rank(*g, me));
  T_OK(ep_group_nranks(*g, R));
  t_rank = *me;
  T_CHECK(*R >= 2, "needs 2 ranks or more");
}

/* The status, the words the message must hold, and a bound on the time it took. */
static void expect(ep_status_t st, ep_status_t want, double dt, const char *const *words) {
  T_CHECK(st == want, "got %s, expected %s: %s", ep_status_name(st), ep_status_name(want),
          ep_last_error());
  for (; *words; words++)
    T_CHECK(strstr(ep_last_error(), *words), "the message lacks '%s': %s", *words, ep_last_error());
  T_CHECK(dt < 2.0, "took %.2f s: a rank waited for a deadline", dt);
  printf("rank %d: %s after %.3f s: %s\n", t_rank, ep_status_name(st), dt, ep_last_error());
}

static int reject_create(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b = NULL;
  setup(&g, &me, &R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  if (me == 1) cfg.num_channels = 1000; /* out of range: rejected before any exchange */
  double t0 = tk_now_s();
  ep_status_t st = ep_buffer_create(g, &cfg, &b);
  double dt = tk_now_s() - t0;
  if (me == 1)
    expect(st, EP_ERR_OUT_OF_RANGE, dt, (const char *[]){"num_channels", NULL});
  else
    expect(st, EP_ERR_PEER_INVALID, dt, (const char *[]){"ep_buffer_create", "rank 1", NULL});
  cfg.num_channels = 0;
  T_OK(ep_buffer_create(g, &cfg, &b));
  long wrong;
  T_OK(t_round(b, R, me, 7, &wrong));
  T_CHECK(wrong == 0, "%ld values differ from the reference", wrong);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  return T_PASS;
}

/* Rank 1 calls `odd` (a destroy) where the others call ep_group_barrier. */
static int barrier_vs(bool group_destroy) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b;
  setup(&g, &me, &R);
  T_OK(ep_buffer_create(g, NULL, &b));
  T_OK(ep_group_barrier(g));
  const char *odd = group_destroy ? "ep_group_destroy" : "ep_buffer_destroy";
  if (group_destroy) T_OK(ep_buffer_destroy(b));
  double t0 = tk_now_s();
  ep_status_t st = me != 1         ? ep_group_barrier(g)
                   : group_destroy ? ep_group_destroy(g)
                                   : ep_buffer_destroy(b);
  double dt = tk_now_s() - t0;
  /* Calls on the group so far: create (#0), buffer create (#1), barrier (#2)[, destroy (#3)]. */
  const char *n = group_destroy ? "(#4)" : "(#3)";
  if (me == 1)
    expect(st, EP_ERR_MISMATCH, dt,
           (const char *[]){"this rank calls", odd, "rank 0 calls ep_group_barrier", n, NULL});
  else
    expect(st, EP_ERR_MISMATCH, dt,
           (const char *[]){"this rank calls ep_group_barrier", n, "rank 1 calls", odd, NULL});
  /* The group is broken now: what is left is freed locally, without waiting. */
  if (me != 1 && !group_destroy) T_OK(ep_buffer_destroy(b));
  if (me == 1 && !group_destroy) T_STATUS(EP_ERR_DESTROYED, ep_buffer_destroy(b));
  if (me != 1 || !group_destroy) T_OK(ep_group_destroy(g));
  return T_PASS;
}

static int allgather_size(void) {
  int R, me;
  ep_group_t g;
  setup(&g, &me, &R);
  char send[64] = "x", *recv = calloc((size_t)R, 64);
  double t0 = tk_now_s();
  ep_status_t st = ep_group_allgather(g, send, recv, me == 1 ? 64 : 32);
  expect(st, EP_ERR_MISMATCH, tk_now_s() - t0, (const char *[]){"ep_group_allgather", NULL});
  free(recv);
  T_OK(ep_group_destroy(g));
  return T_PASS;
}

static int bad_buffer(void) {
  int R, me;
  ep_group_t g;
  ep_buffer_t b;
  setup(&g, &me, &R);
  ep_buffer_config_t cfg = EP_BUFFER_CONFIG_INIT;
  cfg.timeout_s = 10.0;
  T_OK(ep_buffer_create(g, &cfg, &b));
  long wrong;
  T_OK(t_round(b, R, me, 1, &wrong));
  double t0 = tk_now_s();
  ep_status_t st = t_round(me == 1 ? NULL : b, R, me, 2, &wrong);
  double dt = tk_now_s() - t0;
  if (me == 1)
    expect(st, EP_ERR_NULL_ARG, dt, (const char *[]){"ep_dispatch", NULL});
  else
    expect(st, EP_ERR_PEER_INVALID, dt, (const char *[]){"rank 1", NULL});
  T_OK(t_round(b, R, me, 3, &wrong)); /* in step again: the rejected call was counted */
  T_CHECK(wrong == 0, "%ld values differ from the reference", wrong);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  return T_PASS;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  if (!strcmp(mode, "reject-create")) return reject_create();
  if (!strcmp(mode, "barrier-destroy")) return barrier_vs(false);
  if (!strcmp(mode, "barrier-gdestroy")) return barrier_vs(true);
  if (!strcmp(mode, "allgather-size")) return allgather_size();
  if (!strcmp(mode, "bad-buffer")) return bad_buffer();
  fprintf(stderr,
          "usage: test_pairing reject-create|barrier-destroy|barrier-gdestroy|"
          "allgather-size|bad-buffer\n");
  return T_FAIL;
}
