// Matrix products of the engine's tiles: the Fortran BLAS sgemm_/dgemm_ torch links
// (function pointers in the call), row-major through the transposition identity
// C^T = B^T A^T; products of at most FEW_ROWS rows (decode steps) in the engine's own
// vector loops instead.
#pragma once

#include "abi.h"

#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <algorithm>
#include <type_traits>

namespace {

typedef void (*SgemmFn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                        const int*, const float*, const int*, const float*, float*, const int*);
typedef void (*DgemmFn)(const char*, const char*, const int*, const int*, const int*, const double*,
                        const double*, const int*, const double*, const int*, const double*, double*, const int*);
typedef int (*BlasThreadsLocalFn)(int);

// Products of at most FEW_ROWS rows (a decode step, a short query tile) run in the
// loops below: BLAS treats them as matrix-vector products, which stream op(B) from
// memory once per row and, in the MKL torch links on AMD, take a generic code path
// (bench/DECISIONS.md#cpu-few-row-products).
constexpr int64_t FEW_ROWS = 4;
// Output columns a few-row product keeps in registers at once, in vectors per row.
constexpr int64_t FEW_ROWS_VECTORS = 4;

// The lane sums of the V::size() vectors d[g], in order, as one vector (lane g: the sum
// of d[g]'s lanes): log2(V::size()) rounds of pairwise de-interleaving adds instead of one
// horizontal reduction per vector. Overwrites d.
template <typename V>
V transposed_sums(V* d) {
  static_assert((V::size() & (V::size() - 1)) == 0, "halving rounds need a power-of-two lane count");
  for (int64_t n = V::size(); n > 1; n /= 2) {
    for (int64_t p = 0; p < n / 2; ++p) {
      const auto halves = at::vec::deinterleave2(d[2 * p], d[2 * p + 1]);
      d[p] = halves.first + halves.second;
    }
  }
  return d[0];
}

// C[i, j] = alpha * <x_i, y_j> + beta * C[i, j] for M rows x_i (row stride ldx) and N
// rows y_j (row stride ldy) of length K. Each y row is read once, in address order, for
// all M rows; a group of V::size() y rows' products ends as one vector per x row
// (transposed_sums).
template <typename A, int64_t M>
void few_rows_xyt(int64_t N, int64_t K, A alpha, const A* x, int64_t ldx, const A* y, int64_t ldy, A beta, A* c,
                  int64_t ldc) {
  using V = at::vec::Vectorized<A>;
  constexpr int64_t G = V::size();
  const int64_t full = K - K % V::size(), rest = K - full;
  for (int64_t j0 = 0; j0 < N; j0 += G) {
    const int64_t n = std::min(G, N - j0);
    V dot[M][G];
    for (int64_t g = 0; g < G; ++g) {
      V sum[M];
      for (int64_t i = 0; i < M; ++i) sum[i] = V(A(0));
      if (g < n) {
        const A* yr = y + (j0 + g) * ldy;
        for (int64_t k = 0; k < full; k += V::size()) {
          const V yv = V::loadu(yr + k);
          for (int64_t i = 0; i < M; ++i) sum[i] = at::vec::fmadd(V::loadu(x + i * ldx + k), yv, sum[i]);
        }
        if (rest) {  // the missing lanes read as zero
          const V yv = V::loadu(yr + full, rest);
          for (int64_t i = 0; i < M; ++i) sum[i] = at::vec::fmadd(V::loadu(x + i * ldx + full, rest), yv, sum[i]);
        }
      }
      for (int64_t i = 0; i < M; ++i) dot[i][g] = sum[i];
    }
    for (int64_t i = 0; i < M; ++i) {
      A* ci = c + i * ldc + j0;
      V out = transposed_sums(dot[i]) * V(alpha);
      if (beta != A(0)) out = out + V::loadu(ci, n) * V(beta);
      out.store(ci, n);
    }
  }
}

// Columns [n0, n0 + cols) of C = alpha * X Y + beta * C for M rows (see few_rows_xy),
// cols <= FEW_ROWS_VECTORS vectors; FULL (cols is exactly that many) makes every
// loop bound a constant, so the block's sums stay in registers.
template <typename A, int64_t M, bool FULL>
void few_rows_xy_block(int64_t n0, int64_t cols, int64_t K, A alpha, const A* x, int64_t ldx, const A* y,
                       int64_t ldy, A beta, A* c, int64_t ldc) {
  using V = at::vec::Vectorized<A>;
  const int64_t vecs = FULL ? FEW_ROWS_VECTORS : (cols + V::size() - 1) / V::size();
  auto width = [&](int64_t v) { return FULL ? V::size() : std::min<int64_t>(V::size(), cols - v * V::size()); };
  V acc[M][FEW_ROWS_VECTORS];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t v = 0; v < vecs; ++v)
      acc[i][v] = beta == A(0) ? V(A(0)) : V::loadu(c + i * ldc + n0 + v * V::size(), width(v)) * V(beta);
  for (int64_t k = 0; k < K; ++k) {
    const A* yk = y + k * ldy + n0;
    V xs[M];
    for (int64_t i = 0; i < M; ++i) xs[i] = V(alpha * x[i * ldx + k]);
    for (int64_t v = 0; v < vecs; ++v) {
      const V yv = FULL ? V::loadu(yk + v * V::size()) : V::loadu(yk + v * V::size(), width(v));
      for (int64_t i = 0; i < M; ++i) acc[i][v] = at::vec::fmadd(xs[i], yv, acc[i][v]);
    }
  }
  for (int64_t i = 0; i < M; ++i)
    for (int64_t v = 0; v < vecs; ++v) acc[i][v].store(c + i * ldc + n0 + v * V::size(), width(v));
}

// C = alpha * X Y + beta * C for M rows of X (M x K, row stride ldx) and Y (K x N, row
// stride ldy): a block of columns of every C row stays in registers while the K rows of
// Y stream past once.
template <typename A, int64_t M>
void few_rows_xy(int64_t N, int64_t K, A alpha, const A* x, int64_t ldx, const A* y, int64_t ldy,
                 A beta, A* c, int64_t ldc) {
  constexpr int64_t W = FEW_ROWS_VECTORS * at::vec::Vectorized<A>::size();
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    if (N - n0 >= W) {
      few_rows_xy_block<A, M, true>(n0, W, K, alpha, x, ldx, y, ldy, beta, c, ldc);
    } else {
      few_rows_xy_block<A, M, false>(n0, N - n0, K, alpha, x, ldx, y, ldy, beta, c, ldc);
    }
  }
}

// f(std::integral_constant<int64_t, M>) for 1 <= M <= FEW_ROWS: the few-row products
// take the row count as a template argument, so their per-row sums live in registers.
template <typename F>
void with_row_count(int64_t M, F&& f) {
  static_assert(FEW_ROWS == 4, "one case per row count");
  switch (M) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    default: f(std::integral_constant<int64_t, 4>{}); break;
  }
}

// C (M x N, row stride ldc) = alpha * op(A) op(B) + beta * C, row-major; op(A) is M x K
// (A stored K x M when trans_a), op(B) K x N (B stored N x K when trans_b).
template <typename A>
void gemm(const FaCallArgs* a, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, A alpha,
          const A* x, int64_t ldx, const A* y, int64_t ldy, A beta, A* c, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = beta == A(0) ? A(0) : beta * c[i * ldc + j];
    return;
  }
  if (M <= FEW_ROWS && !trans_a) {
    with_row_count(M, [&](auto rows) {
      constexpr int64_t R = decltype(rows)::value;
      if (trans_b) {
        few_rows_xyt<A, R>(N, K, alpha, x, ldx, y, ldy, beta, c, ldc);
      } else {
        few_rows_xy<A, R>(N, K, alpha, x, ldx, y, ldy, beta, c, ldc);
      }
    });
    return;
  }
  // Column-major: C^T (N x M) = op(B)^T (N x K) * op(A)^T (K x M).
  const int m = (int)N, n = (int)M, k = (int)K;
  const int lda = (int)std::max<int64_t>(ldy, trans_b ? K : N);
  const int ldb = (int)std::max<int64_t>(ldx, trans_a ? M : K);
  const int ld = (int)std::max<int64_t>(ldc, N);
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  // One thread per product: the engine's threads each take whole tiles, and MKL called
  // from the calling thread with torch's thread count > 1 splits a product by its own
  // blocking, which follows that count (1 and 2 threads differed in the last bits).
  const auto threads_local = reinterpret_cast<BlasThreadsLocalFn>(a->blas_threads_local);
  const int before = threads_local ? threads_local(1) : 0;
  if constexpr (std::is_same<A, float>::value) {
    reinterpret_cast<SgemmFn>(a->sgemm)(&ta, &tb, &m, &n, &k, &alpha, y, &lda, x, &ldb, &beta, c, &ld);
  } else {
    reinterpret_cast<DgemmFn>(a->dgemm)(&ta, &tb, &m, &n, &k, &alpha, y, &lda, x, &ldb, &beta, c, &ld);
  }
  if (threads_local) threads_local(before);
}

}  // namespace
