/* One checked round of dispatch + combine, for the tests that must show that data still move
 * correctly after something went wrong elsewhere (a forked child, a rejected call). Every rank
 * builds every rank's inputs from (seed, rank), runs the reference (tools/ref/ref.c) for the whole
 * group and compares its own outputs with it bit for bit. */
#ifndef EP_TESTS_ROUND_H
#define EP_TESTS_ROUND_H

#include "common.h"

/* Returns the first failing epcomm status (EP_OK when both calls succeeded); *wrong receives the
 * number of received rows plus output values that differ from the reference (0 on a failure). */
ep_status_t t_round(ep_buffer_t buf, int R, int me, uint64_t seed, long *wrong);

#endif
