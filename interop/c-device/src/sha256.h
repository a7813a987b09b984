/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written out: the model digest (rule
 * P-7.6) and signed frames (P-6.1) need nothing else. */
#ifndef FCL_SHA256_H
#define FCL_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t buf[64];
    size_t used;
} sha256;

void sha256_init(sha256 *s);
void sha256_update(sha256 *s, const void *data, size_t n);
void sha256_final(sha256 *s, uint8_t out[32]);
void hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t n, uint8_t out[32]);

#endif
