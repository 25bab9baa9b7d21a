/* Rendezvous of jobs started by SLURM (issue 16, item 2), run by tests/test_jobid.sh without
 * `epcomm launch`: SLURM_* variables only. Creates a group from the environment and checks that
 * every member comes from the same job (SLURM_JOB_ID) and holds the same EP_JOB_SECRET (when
 * set): groups never mix jobs. Exit 0: group formed and pure; 2: creation failed (the error is
 * printed); 1: a mixed group. */
#include "common.h"

typedef struct {
  char job[32], secret[32];
} who_t;

int main(void) {
  who_t me = {{0}, {0}};
  snprintf(me.job, sizeof me.job, "%s", getenv("SLURM_JOB_ID") ? getenv("SLURM_JOB_ID") : "");
  snprintf(me.secret, sizeof me.secret, "%s",
           getenv("EP_JOB_SECRET") ? getenv("EP_JOB_SECRET") : "");
  const char *rank = getenv("SLURM_PROCID");
  ep_group_t g;
  ep_status_t st = ep_group_create_from_env(NULL, &g);
  if (st) {
    printf("job %s rank %s: ep_group_create_from_env: %s: %s\n", me.job, rank, ep_status_name(st),
           ep_last_error());
    return 2;
  }
  int R, r;
  T_OK(ep_group_nranks(g, &R));
  T_OK(ep_group_rank(g, &r));
  who_t *all = calloc((size_t)R, sizeof *all);
  T_OK(ep_group_allgather(g, &me, all, sizeof me));
  for (int i = 0; i < R; i++)
    T_CHECK(!strcmp(all[i].job, me.job) && !strcmp(all[i].secret, me.secret),
            "job %s rank %d: group member %d comes from job %s (secret '%s', mine '%s')", me.job, r,
            i, all[i].job, all[i].secret, me.secret);
  T_OK(ep_group_barrier(g));
  T_OK(ep_group_destroy(g));
  printf("job %s rank %d: a group of %d ranks, all of job %s\n", me.job, r, R, me.job);
  free(all);
  return 0;
}
