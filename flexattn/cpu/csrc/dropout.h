// Dropout: Philox-4x32-7 keep decisions, bit for bit numerics.dropout_keep's.
// Entry (b, h, i, j), i = 16 qb + 8 r + u, j = 16 kb + 8 jj + 2 t + e, takes the 16-bit
// half e (low first) of word 2 r + jj of the draw with counter (4 kb + t, 8 qb + u,
// b * Hq + h, stream) under the key (low, high word of seed_key); kept when >= threshold.
#pragma once

#include "abi.h"

namespace {

inline void philox(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 7; ++r) {
    const uint64_t pb = (uint64_t)c[2] * 0xCD9E8D57ull;
    const uint64_t pa = (uint64_t)c[0] * 0xD2511F53ull;
    const uint32_t n0 = (uint32_t)(pb >> 32) ^ c[1] ^ k0;
    const uint32_t n1 = (uint32_t)pb;
    const uint32_t n2 = (uint32_t)(pa >> 32) ^ c[3] ^ k1;
    const uint32_t n3 = (uint32_t)pa;
    c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Keys [kv0, kv0 + n) of query row i: the draws of the 16-key chunks they touch, four
// per chunk (t), each giving the row's 4 keys 8 jj + 2 t + e of its chunk.
void dropout_keep_row(const FaCallArgs* a, int64_t b, int64_t h, int64_t i, int64_t kv0, int64_t n, uint8_t* keep) {
  const uint32_t k0 = (uint32_t)(a->seed_key & 0xFFFFFFFFull), k1 = (uint32_t)(a->seed_key >> 32);
  const uint32_t stream = (uint32_t)(a->seed_stream & 0xFFFFFFFFull);
  const uint32_t thr = (uint32_t)a->dropout_threshold;
  const uint32_t c1 = (uint32_t)((i / 16) * 8 + i % 8), c2 = (uint32_t)(b * a->Hq + h);
  const int64_t r = (i / 8) % 2;
  for (int64_t kb = kv0 / 16; kb * 16 < kv0 + n; ++kb)
    for (int64_t t = 0; t < 4; ++t) {
      uint32_t c[4] = {(uint32_t)(kb * 4 + t), c1, c2, stream};
      philox(c, k0, k1);
      for (int64_t jj = 0; jj < 2; ++jj) {
        const uint32_t w = c[2 * r + jj];
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t at = kb * 16 + jj * 8 + t * 2 + e - kv0;
          if (at >= 0 && at < n) keep[at] = (e == 0 ? (w & 0xFFFFu) : (w >> 16)) >= thr;
        }
      }
    }
}

}  // namespace
