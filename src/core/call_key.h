/* What every rank must agree on before any payload of a normal-mode call moves. Plain C with no
 * other include, because the CUDA kernels exchange and compare it too. Backends exchange the key
 * as it is (int32 fields, in this order) and report the first field that differs; the core names
 * it (src/core/call.c). */
#ifndef EP_CORE_CALL_KEY_H
#define EP_CORE_CALL_KEY_H

#include <stdint.h>

enum ep_call_kind { EP_CALL_DISPATCH = 1, EP_CALL_CACHED = 2, EP_CALL_COMBINE = 3 };
enum {
  EP_CF_KIND,
  EP_CF_HIDDEN,
  EP_CF_DTYPE,
  EP_CF_TOPK,
  EP_CF_EXPERTS,
  EP_CF_SCALES,
  EP_CF_WEIGHTS,
  EP_CF_LAYOUT, /* the number of the dispatch whose handle the call uses (0: a new dispatch) */
  EP_CF_COUNT,
  EP_CF_REJECTED = EP_CF_COUNT /* not a field: the peer refused its arguments */
};
typedef struct {
  int32_t f[EP_CF_COUNT];
  int32_t rejected; /* this rank refused its arguments: the call fails on every rank */
} ep_call_key_t;

#endif
