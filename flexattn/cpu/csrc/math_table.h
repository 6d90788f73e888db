// The math table the engine lends to mod libraries (FaMath): each elementwise function
// of a mod over a whole row, float and double, vectorised with at::vec where it has the
// method (abi_generated.h's FA_*_VEC_MATH lists), else a loop of the std:: function.
#pragma once

#include "abi.h"

#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>

namespace {

template <typename A, typename Op>
void vec_unary(A* out, const A* x, int64_t n, Op op) {
  using V = at::vec::Vectorized<A>;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) op(V::loadu(x + j)).store(out + j);
  if (j < n) op(V::loadu(x + j, n - j)).store(out + j, n - j);
}

template <typename A, typename Op>
void vec_binary(A* out, const A* x, const A* y, int64_t n, Op op) {
  using V = at::vec::Vectorized<A>;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) op(V::loadu(x + j), V::loadu(y + j)).store(out + j);
  if (j < n) op(V::loadu(x + j, n - j), V::loadu(y + j, n - j)).store(out + j, n - j);
}

// One math_<name><A> template per function of the lists.
#define FA_UNARY_VEC(name, method)                                                   \
  template <typename A>                                                              \
  void math_##name(A* out, const A* x, int64_t n) {                                  \
    using V = at::vec::Vectorized<A>;                                                \
    vec_unary<A>(out, x, n, [](const V& v) { return v.method(); });                  \
  }
#define FA_UNARY_STD(name)                                                           \
  template <typename A>                                                              \
  void math_##name(A* out, const A* x, int64_t n) {                                  \
    for (int64_t j = 0; j < n; ++j) out[j] = std::name(x[j]);                        \
  }
#define FA_BINARY_VEC(name, method)                                                  \
  template <typename A>                                                              \
  void math_##name(A* out, const A* x, const A* y, int64_t n) {                      \
    using V = at::vec::Vectorized<A>;                                                \
    vec_binary<A>(out, x, y, n, [](const V& v, const V& w) { return v.method(w); }); \
  }
#define FA_BINARY_STD(name)                                                          \
  template <typename A>                                                              \
  void math_##name(A* out, const A* x, const A* y, int64_t n) {                      \
    for (int64_t j = 0; j < n; ++j) out[j] = std::name(x[j], y[j]);                  \
  }

FA_UNARY_VEC_MATH(FA_UNARY_VEC)
FA_UNARY_STD_MATH(FA_UNARY_STD)
FA_BINARY_VEC_MATH(FA_BINARY_VEC)
FA_BINARY_STD_MATH(FA_BINARY_STD)

#undef FA_UNARY_VEC
#undef FA_UNARY_STD
#undef FA_BINARY_VEC
#undef FA_BINARY_STD

// float32 tanh: Sleef's vectorised tanhf costs about ten times its expf on AVX2, and a
// soft-cap spends its time there. Odd Taylor series to x^17 below |x| = 1/2 (relative
// error under 1e-9), 1 - 2 / (1 + exp(2|x|)) above it (a few ulp), the sign restored
// (bench/DECISIONS.md#cpu-fast-tanh). float64 keeps Sleef's.
template <>
void math_tanh<float>(float* out, const float* x, int64_t n) {
  using V = at::vec::Vectorized<float>;
  vec_unary<float>(out, x, n, [](const V& v) {
    const V a = v.abs();
    const V a2 = a * a;
    V p(0.000590027440f);
    p = p * a2 + V(-0.001455834387f);
    p = p * a2 + V(0.003592128037f);
    p = p * a2 + V(-0.008863235530f);
    p = p * a2 + V(0.021869488536f);
    p = p * a2 + V(-0.053968253968f);
    p = p * a2 + V(0.133333333333f);
    p = p * a2 + V(-0.333333333333f);
    p = p * a2 + V(1.0f);
    const V small = a * p;
    const V large = V(1.0f) - V(2.0f) / ((a + a).exp() + V(1.0f));
    const V r = V::blendv(large, small, a < V(0.5f));
    return V::blendv(r, V(0.0f) - r, v < V(0.0f));
  });
}

FaMath make_math() {
  FaMath t;
#define FA_SET_MATH(name)                                         \
  t.name##_f32 = reinterpret_cast<void*>(&math_##name<float>);    \
  t.name##_f64 = reinterpret_cast<void*>(&math_##name<double>);
  FA_MATH(FA_SET_MATH)
#undef FA_SET_MATH
  return t;
}

const FaMath kMath = make_math();

}  // namespace
