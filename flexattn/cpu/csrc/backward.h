// The backward: one work item per (b, KV head), recomputing P from the saved lse (see
// engine.cpp).
#pragma once

#include "abi.h"
#include "dropout.h"
#include "memory.h"
#include "products.h"
#include "rows.h"
#include "spans.h"

#include <algorithm>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

template <typename A>
void add_grads(std::vector<A>& mine, A* shared, int64_t n) {
  for (int64_t j = 0; j < n; ++j) shared[j] += mine[j];
}

template <typename T, typename A>
void backward(const FaCallArgs* a) {
  const int64_t B = a->B, Hq = a->Hq, Hkv = a->Hkv, L = a->L, S = a->S, E = a->E, Ev = a->Ev;
  const int64_t group = Hq / Hkv;
  const int64_t QT = a->q_tile, KT = a->kv_tile;
  const int64_t nqb = (L + a->q_block - 1) / a->q_block;
  const int64_t subs = (a->q_block + QT - 1) / QT;
  const int64_t items = B * Hkv;
  const bool dropout = a->dropout_threshold > 0;
  const A dscale = static_cast<A>(a->dropout_scale);
  const auto joint = reinterpret_cast<FaJointFn>(a->joint_fn);
  const auto* base_ctx = static_cast<const FaModContext*>(a->ctx);
  const int64_t* grad_numels = static_cast<const int64_t*>(a->grad_numels);
  const int team = team_size(a, items);
  const int64_t QR = call_extent(QT, L), KC = call_extent(KT, S);
  // Captured tensors' gradients: one private accumulator per thread when they are
  // small or the call is deterministic (summed in thread order at the end), else
  // shared ones added to atomically. Deterministic calls also fix which thread takes
  // which item (a static schedule).
  int64_t grad_total = 0;
  for (int64_t g = 0; g < a->num_grads; ++g) grad_total += grad_numels[g];
  const bool private_grads =
      a->num_grads > 0 && team > 1 && (a->deterministic || grad_total * team <= (int64_t(1) << 24));
  void* const* shared_grads = static_cast<void* const*>(base_ctx->grads);
  std::vector<std::vector<std::vector<A>>> thread_grads(private_grads ? team : 0);

#pragma omp parallel num_threads(team)
  {
    Scratch<A> s((size_t)(2 * S * E + 2 * S * Ev + 4 * QR * KC + 2 * QR * E + 2 * QR * Ev + 2 * QR) + 64);
    std::vector<uint8_t> keep(KC), kept((size_t)QR * KC);
    std::vector<Span> spans;
    FaModContext ctx = *base_ctx;
    std::vector<void*> mine_ptrs;
    if (private_grads) {
#ifdef _OPENMP
      auto& mine = thread_grads[omp_get_thread_num()];
#else
      auto& mine = thread_grads[0];
#endif
      for (int64_t g = 0; g < a->num_grads; ++g) mine.emplace_back((size_t)grad_numels[g], A(0));
      for (auto& v : mine) mine_ptrs.push_back(v.data());
      ctx.grads = mine_ptrs.data();
      ctx.grads_atomic = 0;
    } else {
      ctx.grads_atomic = team > 1 ? 1 : 0;
    }
    auto item = [&](int64_t it) {
      const int64_t b = it / Hkv, hk = it % Hkv;
      size_t at = 0;
      A* dk = s.take(S * E, at);
      A* dv = s.take(S * Ev, at);
      std::fill(dk, dk + S * E, A(0));
      std::fill(dv, dv + S * Ev, A(0));
      A* kfull = s.take(S * E, at);
      A* vfull = s.take(S * Ev, at);
      A* sc = s.take(QR * KC, at);
      A* raw = s.take(QR * KC, at);
      A* dp = s.take(QR * KC, at);
      A* pd = s.take(QR * KC, at);
      A* qs = s.take(QR * E, at);
      A* dq = s.take(QR * E, at);
      A* dos = s.take(QR * Ev, at);
      A* os = s.take(QR * Ev, at);
      A* lse = s.take(QR, at);
      A* delta = s.take(QR, at);
      // K and V of this head in A, converted once (16-bit inputs, non-unit head
      // strides), else read in place.
      int64_t ldk, ldv;
      const A* kf = tile<T, A>(a->k, a->k_strides, b, hk, 0, S, E, kfull, &ldk);
      const A* vf = tile<T, A>(a->v, a->v_strides, b, hk, 0, S, Ev, vfull, &ldv);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        for (int64_t qb = 0; qb < nqb; ++qb) {
          block_spans(a, b, h, qb, spans);
          if (spans.empty()) {
            // No key: dQ of these rows is 0.
            for (int64_t r = qb * a->q_block; r < std::min((qb + 1) * a->q_block, L); ++r) {
              T* gq = static_cast<T*>(a->grad_q) + b * a->grad_q_strides[0] + h * a->grad_q_strides[1] +
                      r * a->grad_q_strides[2];
              for (int64_t j = 0; j < E; ++j) gq[j * a->grad_q_strides[3]] = static_cast<T>(0.0f);
            }
            continue;
          }
          for (int64_t sub = 0; sub < subs; ++sub) {
            const int64_t r0 = qb * a->q_block + sub * QT;
            const int64_t r1 = std::min({r0 + QT, (qb + 1) * a->q_block, L});
            if (r0 >= r1) continue;
            const int64_t qn = r1 - r0;
            int64_t ldq, lddo, ldo;
            const A* qt = tile<T, A>(a->q, a->q_strides, b, h, r0, qn, E, qs, &ldq);
            const A* dot = tile<T, A>(a->grad_out, a->grad_out_strides, b, h, r0, qn, Ev, dos, &lddo);
            const A* ot = tile<T, A>(a->out, a->out_strides, b, h, r0, qn, Ev, os, &ldo);
            // delta = rowsum(dO * O) - dlse: with a gradient of the log-sum-exp,
            // d lse_i / d s_ij = p_ij, so dS = P * (dP - delta) covers both.
            const A* dlse = static_cast<const A*>(a->grad_lse);
            for (int64_t i = 0; i < qn; ++i) {
              lse[i] = static_cast<const A*>(a->lse)[b * a->lse_strides[0] + h * a->lse_strides[1] +
                                                      (r0 + i) * a->lse_strides[2]];
              A d = 0;
              for (int64_t j = 0; j < Ev; ++j) d += dot[i * lddo + j] * ot[i * ldo + j];
              if (dlse != nullptr)
                d -= dlse[b * a->grad_lse_strides[0] + h * a->grad_lse_strides[1] + (r0 + i) * a->grad_lse_strides[2]];
              delta[i] = d;
            }
            std::fill(dq, dq + qn * E, A(0));
            for (const Span& sp : spans) {
              const int64_t kn = sp.kv1 - sp.kv0;
              const A* kt = kf + sp.kv0 * ldk;
              const A* vt = vf + sp.kv0 * ldv;
              gemm<A>(a, false, true, qn, kn, E, static_cast<A>(a->scale), qt, ldq, kt, ldk, A(0), sc, KC);
              modded_scores<A>(a, b, h, r0, qn, sp, sc, KC, joint != nullptr ? raw : nullptr, keep.data());
              // P = exp(s - lse) (0 on rows without keys); the dropped, scaled copy for dV.
              for (int64_t i = 0; i < qn; ++i) {
                A* row = sc + i * KC;
                A* drow = pd + i * KC;
                if (lse[i] == neg_inf<A>()) {
                  std::fill(row, row + kn, A(0));
                } else {
                  exp_shift_sum(row, kn, lse[i]);
                }
                if (dropout) {
                  uint8_t* kr = kept.data() + i * KC;
                  dropout_keep_row(a, b, h, r0 + i, sp.kv0, kn, kr);
                  for (int64_t j = 0; j < kn; ++j) drow[j] = kr[j] ? row[j] * dscale : A(0);
                } else {
                  std::memcpy(drow, row, sizeof(A) * kn);
                }
              }
              gemm<A>(a, true, false, kn, Ev, qn, A(1), pd, KC, dot, lddo, A(1), dv + sp.kv0 * Ev, Ev);
              gemm<A>(a, false, true, qn, kn, Ev, A(1), dot, lddo, vt, ldv, A(0), dp, KC);
              for (int64_t i = 0; i < qn; ++i) {
                A* prow = sc + i * KC;
                A* dprow = dp + i * KC;
                A* ds = pd + i * KC;
                const uint8_t* kr = kept.data() + i * KC;
                for (int64_t j = 0; j < kn; ++j) {
                  const A dpj = dropout ? (kr[j] ? dprow[j] * dscale : A(0)) : dprow[j];
                  ds[j] = prow[j] * (dpj - delta[i]);
                }
                if (joint != nullptr) {
                  joint(ds, raw + i * KC, kn, b, h, r0 + i, sp.kv0, &ctx);
                  for (int64_t j = 0; j < kn; ++j)
                    if (prow[j] == A(0)) ds[j] = A(0);
                }
              }
              // d(q.k) = scale * dS: the scale rides on the products.
              const A scale = static_cast<A>(a->scale);
              gemm<A>(a, false, false, qn, E, kn, scale, pd, KC, kt, ldk, A(1), dq, E);
              gemm<A>(a, true, false, kn, E, qn, scale, pd, KC, qt, ldq, A(1), dk + sp.kv0 * E, E);
            }
            for (int64_t i = 0; i < qn; ++i) {
              T* gq = static_cast<T*>(a->grad_q) + b * a->grad_q_strides[0] + h * a->grad_q_strides[1] +
                      (r0 + i) * a->grad_q_strides[2];
              for (int64_t j = 0; j < E; ++j) gq[j * a->grad_q_strides[3]] = static_cast<T>(dq[i * E + j]);
            }
          }
        }
      }
      for (int64_t r = 0; r < S; ++r) {
        T* gk = static_cast<T*>(a->grad_k) + b * a->grad_k_strides[0] + hk * a->grad_k_strides[1] +
                r * a->grad_k_strides[2];
        T* gv = static_cast<T*>(a->grad_v) + b * a->grad_v_strides[0] + hk * a->grad_v_strides[1] +
                r * a->grad_v_strides[2];
        for (int64_t j = 0; j < E; ++j) gk[j * a->grad_k_strides[3]] = static_cast<T>(dk[r * E + j]);
        for (int64_t j = 0; j < Ev; ++j) gv[j * a->grad_v_strides[3]] = static_cast<T>(dv[r * Ev + j]);
      }
    };
    if (a->deterministic) {
#pragma omp for schedule(static)
      for (int64_t it = 0; it < items; ++it) item(it);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < items; ++it) item(it);
    }
  }
  for (auto& mine : thread_grads)
    for (int64_t g = 0; g < (int64_t)mine.size(); ++g)
      add_grads(mine[g], static_cast<A*>(shared_grads[g]), grad_numels[g]);
}

}  // namespace
