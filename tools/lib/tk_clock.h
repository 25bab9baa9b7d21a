/* Monotonic time for the tools, tests and benchmarks (the library keeps its own, src/core/clock.c,
 * because it exports nothing but ep_*). */
#ifndef EP_TK_CLOCK_H
#define EP_TK_CLOCK_H

/* Seconds on CLOCK_MONOTONIC: only differences mean anything. */
double tk_now_s(void);

#endif
