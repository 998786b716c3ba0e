/* SHA-256 and HMAC-SHA256; see sha256.h. Short inputs only (keys and 4-byte
 * messages): simplicity over speed, but correct for any length. */
#include "sha256.h"

#include <string.h>

typedef struct {
    uint32_t state[8];
    uint8_t block[64];
    size_t used;     /* bytes in block */
    uint64_t total;  /* bytes hashed so far */
} sha256_ctx;

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress(uint32_t state[8], const uint8_t block[64]) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 | (uint32_t)block[4 * i + 2] << 8 |
               block[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    state[0] += a; state[1] += b; state[2] += c; state[3] += d;
    state[4] += e; state[5] += f; state[6] += g; state[7] += h;
}

static void sha256_init(sha256_ctx *ctx) {
    static const uint32_t initial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(ctx->state, initial, sizeof initial);
    ctx->used = 0;
    ctx->total = 0;
}

static void sha256_update(sha256_ctx *ctx, const uint8_t *data, size_t size) {
    ctx->total += size;
    while (size > 0) {
        size_t take = 64 - ctx->used < size ? 64 - ctx->used : size;
        memcpy(ctx->block + ctx->used, data, take);
        ctx->used += take;
        data += take;
        size -= take;
        if (ctx->used == 64) {
            compress(ctx->state, ctx->block);
            ctx->used = 0;
        }
    }
}

static void sha256_final(sha256_ctx *ctx, uint8_t digest[SHA256_BYTES]) {
    uint64_t bits = ctx->total * 8;
    uint8_t pad[72] = {0x80};
    size_t pad_size = (ctx->used < 56 ? 56 : 120) - ctx->used;  /* up to 8 bytes short of a block */
    for (int i = 0; i < 8; i++)
        pad[pad_size + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(ctx, pad, pad_size + 8);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++)
            digest[4 * i + j] = (uint8_t)(ctx->state[i] >> (24 - 8 * j));
}

void mdl_sha256(const uint8_t *data, size_t size, uint8_t digest[SHA256_BYTES]) {
    sha256_ctx ctx;
    sha256_init(&ctx);
    sha256_update(&ctx, data, size);
    sha256_final(&ctx, digest);
}

/* SHA-256 of the key block XOR ``pad`` followed by the message: one half of HMAC. */
static void padded_hash(const uint8_t block_key[64], uint8_t pad, const uint8_t *message, size_t size,
                        uint8_t digest[SHA256_BYTES]) {
    uint8_t padded[64];
    for (int i = 0; i < 64; i++)
        padded[i] = block_key[i] ^ pad;
    sha256_ctx ctx;
    sha256_init(&ctx);
    sha256_update(&ctx, padded, sizeof padded);
    sha256_update(&ctx, message, size);
    sha256_final(&ctx, digest);
}

void mdl_hmac_sha256(const uint8_t *key, size_t key_size, const uint8_t *message, size_t message_size,
                     uint8_t mac[SHA256_BYTES]) {
    uint8_t block_key[64] = {0}, inner[SHA256_BYTES];
    if (key_size > 64)
        mdl_sha256(key, key_size, block_key);
    else
        memcpy(block_key, key, key_size);
    padded_hash(block_key, 0x36, message, message_size, inner);
    padded_hash(block_key, 0x5c, inner, sizeof inner, mac);
}
