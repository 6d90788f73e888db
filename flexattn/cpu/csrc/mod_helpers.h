// The helpers a generated mod library calls (flexattn/cpu/mod_ops.py writes the calls):
// float16/bfloat16 rounding and bit reads, Python's integer and float division and
// remainder, NaN-propagating min/max, integer powers, index clamping, and the adds into
// the captured tensors' gradient accumulators.
#pragma once

#include "abi.h"

namespace {

// float16 / bfloat16 values are carried in float; these round a float to them and
// read their bits (round to nearest even, as torch's conversions).
inline float fa_bf16_bits_to_float(uint16_t bits) {
  uint32_t u = (uint32_t)bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float fa_round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

inline float fa_half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t u;
  if (exponent == 0) {
    const float f = std::ldexp((float)mantissa, -24);
    return sign ? -f : f;
  }
  if (exponent == 31) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t fa_float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    float v;
    std::memcpy(&v, &a, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(v * 16777216.0f));
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | (a >> 13));
}

inline float fa_round_half(float x) { return fa_half_bits_to_float(fa_float_to_half_bits(x)); }

template <typename I>
inline I fa_floordiv(I a, I b) {
  const I q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

template <typename I>
inline I fa_int_remainder(I a, I b) {
  const I r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

template <typename F>
inline F fa_float_remainder(F a, F b) {
  const F r = std::fmod(a, b);
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

template <typename F>
inline F fa_minimum(F a, F b) {
  return a != a ? a : (b != b ? b : (a < b ? a : b));
}

template <typename F>
inline F fa_maximum(F a, F b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}

template <typename I>
inline I fa_int_pow(I base, I exponent) {
  if (exponent < 0) return base == 1 ? 1 : (base == -1 ? (exponent % 2 ? -1 : 1) : 0);
  I result = 1;
  while (exponent) {
    if (exponent & 1) result *= base;
    base *= base;
    exponent >>= 1;
  }
  return result;
}

inline int64_t fa_clamp_index(int64_t i, int64_t size, bool wrap) {
  if (wrap && i < 0) i += size;
  return i < 0 ? 0 : (i >= size ? size - 1 : i);
}

template <typename A>
inline void fa_grad_add(const FaModContext* ctx, int64_t slot, int64_t index, A value) {
  A* g = static_cast<A*>(static_cast<void* const*>(ctx->grads)[slot]) + index;
  if (ctx->grads_atomic) {
    A old;
    __atomic_load(g, &old, __ATOMIC_RELAXED);
    A next = old + value;
    while (!__atomic_compare_exchange(g, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) next = old + value;
  } else {
    *g += value;
  }
}

}  // namespace
