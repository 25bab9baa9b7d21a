/* The EP_* variables the CPU backend reads; src/core/env.c lists them with everyone else's. */
#include "core/backend.h"

static const ep_env_row_t cpu_rows[] = {
    EP_ENV_ROW_INT("cpu", "EP_SPIN_US", "50", "0", "1000000",
                   "microseconds a waiter spins before it sleeps on a futex"),
    EP_ENV_ROW_SIZE("cpu", "EP_LL_WIDE_BYTES", "1M", "0", "16G",
                    "a low-latency call moving this many bytes splits its copies over the "
                    "buffer's channels"),
};

EP_ENV_MODULE(cpu, cpu_rows);
