/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), self-contained, for the
 * frames' simulation key: the library needs nothing but libzmq and MPI. */
#ifndef MELISSA_DL_SHA256_H
#define MELISSA_DL_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define SHA256_BYTES 32

void mdl_sha256(const uint8_t *data, size_t size, uint8_t digest[SHA256_BYTES]);
void mdl_hmac_sha256(const uint8_t *key, size_t key_size, const uint8_t *message, size_t message_size,
                     uint8_t mac[SHA256_BYTES]);

#endif
