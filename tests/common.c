#include "common.h"

int t_rank = -1;
const char *t_case = NULL;

uint16_t t_rand_bf16(t_rng *r) {
  float f = (t_unit(r) - 0.5f) * 8.0f;
  union {
    float f;
    uint32_t u;
  } v = {f};
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

void *t_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) T_FAILF("out of memory (%zu bytes)", n);
  memset(p, T_POISON, n ? n : 1);
  return p;
}

void t_init(ep_group_t *g, int *rank, int *nranks) {
  T_OK(ep_group_create_from_env(NULL, g));
  T_OK(ep_group_rank(*g, rank));
  T_OK(ep_group_nranks(*g, nranks));
  t_rank = *rank;
}

void t_fini(ep_group_t g) { T_OK(ep_group_destroy(g)); }
