/* Building the layout of a dispatch across hosts (cpu_net_plan.c). */
#ifndef EP_CPU_NET_PLAN_H
#define EP_CPU_NET_PLAN_H

#include "cpu_net.h"

cpu_nplan_t *cpu_nplan_new(const cpu_state_t *s, int N);
/* After flat->in_rank is routed: per-host token lists, tok_j, tok_nfan; this rank's counts. */
void cpu_nplan_send_side(const cpu_state_t *s, cpu_nplan_t *p, int32_t *to_rank, int32_t *to_host);
/* From every rank's counts; false: out of memory. */
bool cpu_nplan_recv_side(const cpu_state_t *s, cpu_nplan_t *p, const int32_t *counts, int cw);
/* Fan-out list of entry j of block b from the token's global expert ids; next[L]: rows handed
 * out so far per receiver for this block's source (blocks are listed in entry order). */
void cpu_nplan_fan(const cpu_state_t *s, cpu_nplan_t *p, int b, int j, const int64_t *ids, int topk,
                   int num_local, int32_t *next);

#endif
