/* SHA-256 as FIPS 180-4 specifies it, and HMAC over it as RFC 2104 does. Small and slow is fine:
 * it hashes a few hundred bytes per group creation. */
#include "secret.h"

#include <string.h>

/* First 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static inline uint32_t ror(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

static void compress(uint32_t h[8], const uint8_t *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
           p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = k + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

void ep_sha256_init(ep_sha256_t *s) {
  /* First 32 bits of the fractional parts of the square roots of the first 8 primes. */
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, h0, sizeof h0);
  s->bytes = 0;
  s->fill = 0;
}

void ep_sha256_update(ep_sha256_t *s, const void *data, size_t n) {
  const uint8_t *p = data;
  s->bytes += n;
  while (n > 0) {
    size_t k = 64 - s->fill < n ? 64 - s->fill : n;
    memcpy(s->block + s->fill, p, k);
    s->fill += k, p += k, n -= k;
    if (s->fill == 64) compress(s->h, s->block), s->fill = 0;
  }
}

void ep_sha256_final(ep_sha256_t *s, uint8_t out[32]) {
  uint64_t bits = s->bytes * 8;
  uint8_t pad[72] = {0x80};
  size_t padlen = (s->fill < 56 ? 56 : 120) - s->fill;
  for (int i = 0; i < 8; i++) pad[padlen + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
  ep_sha256_update(s, pad, padlen + 8);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 4; j++) out[4 * i + j] = (uint8_t)(s->h[i] >> (24 - 8 * j));
}

void ep_hmac_sha256(const uint8_t key[EP_KEY_BYTES], const void *msg, size_t n, uint8_t out[32]) {
  uint8_t pad[64], inner[32];
  ep_sha256_t s;
  for (int pass = 0; pass < 2; pass++) {
    memset(pad, pass ? 0x5c : 0x36, sizeof pad);
    for (int i = 0; i < EP_KEY_BYTES; i++) pad[i] ^= key[i];
    ep_sha256_init(&s);
    ep_sha256_update(&s, pad, sizeof pad);
    if (pass == 0) {
      ep_sha256_update(&s, msg, n);
      ep_sha256_final(&s, inner);
    } else {
      ep_sha256_update(&s, inner, sizeof inner);
      ep_sha256_final(&s, out);
    }
  }
}

bool ep_ct_equal(const void *a, const void *b, size_t n) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t d = 0;
  for (size_t i = 0; i < n; i++) d |= (uint8_t)(x[i] ^ y[i]);
  return d == 0;
}

void ep_secret_key(const char *secret, uint8_t key[EP_KEY_BYTES]) {
  static const char domain[] = "epcomm job key v1"; /* its NUL separates it from the secret */
  ep_sha256_t s;
  ep_sha256_init(&s);
  ep_sha256_update(&s, domain, sizeof domain);
  if (secret) ep_sha256_update(&s, secret, strlen(secret));
  ep_sha256_final(&s, key);
}
