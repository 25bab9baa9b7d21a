/* splitmix64: tiny, seedable and identical on every machine, so that any process can regenerate
 * any rank's data from a seed (tests, demo, benchmark and its baselines). */
#ifndef EP_TK_RNG_H
#define EP_TK_RNG_H

#include <stdint.h>

#define TK_GOLDEN64 0x9e3779b97f4a7c15ull /* the sequence's increment: 2^64 / phi, odd */

/* The finaliser: a bijection of 64-bit values that mixes every input bit into every output bit. */
static inline uint64_t tk_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The next value of the stream whose state is *s. */
static inline uint64_t tk_splitmix(uint64_t *s) {
  return tk_mix64(*s += TK_GOLDEN64);
}

#endif
