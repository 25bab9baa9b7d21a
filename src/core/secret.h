/* The little cryptography the bootstrap needs to authenticate its peers: SHA-256 (FIPS 180-4),
 * HMAC-SHA-256 (RFC 2104), a constant-time comparison, and the job key derived from a secret. */
#ifndef EP_CORE_SECRET_H
#define EP_CORE_SECRET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EP_KEY_BYTES 32

typedef struct {
  uint32_t h[8];
  uint64_t bytes; /* message length so far */
  uint8_t block[64];
  size_t fill;
} ep_sha256_t;

void ep_sha256_init(ep_sha256_t *s);
void ep_sha256_update(ep_sha256_t *s, const void *data, size_t n);
void ep_sha256_final(ep_sha256_t *s, uint8_t out[32]);
void ep_hmac_sha256(const uint8_t key[EP_KEY_BYTES], const void *msg, size_t n, uint8_t out[32]);
/* Compares in time that depends on n only, never on where the bytes differ. */
bool ep_ct_equal(const void *a, const void *b, size_t n);
/* The job key that every rank of a job derives from the job's secret (NULL: ""). */
void ep_secret_key(const char *secret, uint8_t key[EP_KEY_BYTES]);

#endif
