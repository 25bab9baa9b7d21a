/* Low-latency mode of the CPU backend (SPEC §4). */
#ifndef EP_CPU_LL_H
#define EP_CPU_LL_H

#include "cpu.h"

/* Bytes of the low-latency region of one segment (0 when the config disables the mode). */
size_t cpu_ll_region_bytes(const ep_buffer_config_t *cfg, int nranks);

#endif
