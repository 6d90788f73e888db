// Vector maths on rows and tiles: conversion to the accumulation type, reading a tile
// of a (B, H, N, D) tensor, a row's max, exp and sum, scaling.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

namespace {

template <typename A>
inline A neg_inf() { return -std::numeric_limits<A>::infinity(); }

template <typename T, typename A>
inline A to_acc(T x) { return static_cast<A>(static_cast<float>(x)); }
template <>
inline double to_acc<double, double>(double x) { return x; }
template <>
inline float to_acc<float, float>(float x) { return x; }

// n values of T as A: 16-bit floats to float a vector at a time; an element loop here
// dominated a 16-bit decode step (bench/DECISIONS.md#cpu-few-row-products).
template <typename T, typename A>
void convert_row(const T* r, A* o, int64_t n) {
  int64_t j = 0;
  if constexpr (std::is_same<A, float>::value &&
                (std::is_same<T, c10::BFloat16>::value || std::is_same<T, c10::Half>::value)) {
    using VT = at::vec::Vectorized<T>;
    for (; j + VT::size() <= n; j += VT::size()) {
      const auto halves = at::vec::convert_to_float<T>(VT::loadu(r + j));
      std::get<0>(halves).store(o + j);
      std::get<1>(halves).store(o + j + VT::size() / 2);
    }
  }
  for (; j < n; ++j) o[j] = to_acc<T, A>(r[j]);
}

// A rows x cols tile of a (B, H, N, D) tensor at (b, h, row0) in A, row stride `ld`:
// the tensor's own memory when it already is A with unit column stride, else a copy
// into `scratch` (rows x cols, ld = cols).
template <typename T, typename A>
const A* tile(const void* base, const int64_t* st, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t cols,
              A* scratch, int64_t* ld) {
  const T* p = static_cast<const T*>(base) + b * st[0] + h * st[1] + row0 * st[2];
  if (std::is_same<T, A>::value && (st[3] == 1 || cols == 1) && (st[2] >= cols || rows == 1)) {
    *ld = rows == 1 ? cols : st[2];
    return reinterpret_cast<const A*>(p);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const T* r = p + i * st[2];
    A* o = scratch + i * cols;
    if (st[3] == 1) {
      convert_row<T, A>(r, o, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) o[j] = to_acc<T, A>(r[j * st[3]]);
    }
  }
  *ld = cols;
  return scratch;
}

template <typename A>
A row_max(const A* x, int64_t n) {
  using V = at::vec::Vectorized<A>;
  int64_t j = 0;
  A m = neg_inf<A>();
  if (n >= V::size()) {
    V vm(neg_inf<A>());
    for (; j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(x + j));
    A lanes[V::size()];
    vm.store(lanes);
    for (int64_t l = 0; l < V::size(); ++l) m = std::max(m, lanes[l]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// x[j] <- exp(x[j] - shift); returns the sum.
template <typename A>
A exp_shift_sum(A* x, int64_t n, A shift) {
  using V = at::vec::Vectorized<A>;
  const V vs(shift);
  V acc(A(0));
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V e = (V::loadu(x + j) - vs).exp();
    e.store(x + j);
    acc = acc + e;
  }
  A lanes[V::size()];
  acc.store(lanes);
  A total = 0;
  for (int64_t l = 0; l < V::size(); ++l) total += lanes[l];
  if (j < n) {
    const int64_t rest = n - j;
    (V::loadu(x + j, rest) - vs).exp().store(lanes);
    for (int64_t l = 0; l < rest; ++l) {
      x[j + l] = lanes[l];
      total += lanes[l];
    }
  }
  return total;
}

template <typename A>
void scale_row(A* x, int64_t n, A f) {
  using V = at::vec::Vectorized<A>;
  const V vf(f);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (V::loadu(x + j) * vf).store(x + j);
  for (; j < n; ++j) x[j] *= f;
}

}  // namespace
