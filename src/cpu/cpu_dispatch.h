/* One dispatch call, as the channel loops see it. */
#ifndef EP_CPU_DISPATCH_H
#define EP_CPU_DISPATCH_H

#include "cpu_plan.h"

typedef struct {
  const ep_dispatch_args_t *a; /* inputs */
  const ep_dispatch_out_t *o;  /* where rows go */
  const cpu_plan_t *p;
  bool cached, has_w, drain; /* drain: receive and drop (outputs too small or not allocated) */
  bool stream;               /* outputs far larger than the caches: non-temporal row stores */
  int topk, num_local, first_expert;
  size_t row, scales, rec, off_x, off_s, off_i, off_w;
} cpu_dispatch_job_t;

ep_status_t cpu_dispatch_channel(cpu_state_t *s, void *job, int channel);

#endif
