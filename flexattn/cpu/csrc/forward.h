// The forward: block-sparse flash attention over query tiles (see engine.cpp).
#pragma once

#include "abi.h"
#include "dropout.h"
#include "memory.h"
#include "products.h"
#include "rows.h"
#include "spans.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// The tile loop; queries and outputs of type T, keys and values of type TKV.
template <typename T, typename TKV, typename A>
void forward_tiles(const FaCallArgs* a) {
  const int64_t B = a->B, Hq = a->Hq, L = a->L, E = a->E, Ev = a->Ev;
  const int64_t group = Hq / a->Hkv;
  const int64_t QT = a->q_tile, KT = a->kv_tile;
  const int64_t nqb = (L + a->q_block - 1) / a->q_block;
  const int64_t subs = (a->q_block + QT - 1) / QT;
  // Consecutive sparse query blocks whose KV lists are the same (the inside of a
  // document, say) share one tile of up to QT rows: fewer, taller products.
  const int64_t per_tile = a->q_block <= QT ? QT / a->q_block : 1;
  struct Item {
    int64_t b, h, qb, blocks, sub, cost;
  };
  std::vector<Item> work;
  {
    std::vector<Span> first, next;
    auto same = [](const std::vector<Span>& x, const std::vector<Span>& y) {
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (x[i].kv0 != y[i].kv0 || x[i].kv1 != y[i].kv1 || x[i].partial != y[i].partial) return false;
      return true;
    };
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t qb = 0; qb < nqb;) {
          const int64_t listed = listed_blocks(a, b, h, qb);
          int64_t blocks = 1;
          if (per_tile > 1) {
            block_spans(a, b, h, qb, first);
            while (blocks < per_tile && qb + blocks < nqb && listed_blocks(a, b, h, qb + blocks) == listed) {
              block_spans(a, b, h, qb + blocks, next);
              if (!same(first, next)) break;
              ++blocks;
            }
          }
          for (int64_t sub = 0; sub < subs; ++sub) work.push_back({b, h, qb, blocks, sub, listed * blocks});
          qb += blocks;
        }
    std::stable_sort(work.begin(), work.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  }
  const int64_t items = static_cast<int64_t>(work.size());
  const bool dropout = a->dropout_threshold > 0;
  const A dscale = static_cast<A>(a->dropout_scale);
  const A* sinks = static_cast<const A*>(a->sinks);

  const int64_t QR = call_extent(QT, L), KC = call_extent(KT, a->S);

#pragma omp parallel num_threads(team_size(a, items))
  {
    Scratch<A> s((size_t)(QR * KC + QR * E + KC * E + KC * Ev + QR * Ev + 2 * QR) + 64);
    std::vector<uint8_t> keep(KC), kept(KC);
    std::vector<Span> spans;
#pragma omp for schedule(dynamic, 1)
    for (int64_t o = 0; o < items; ++o) {
      const Item& w = work[o];
      const int64_t b = w.b, h = w.h, qb = w.qb;
      const int64_t r0 = qb * a->q_block + w.sub * QT;
      const int64_t r1 = std::min({r0 + QT, (qb + w.blocks) * a->q_block, L});
      if (r0 >= r1) continue;
      const int64_t qn = r1 - r0, hk = h / group;
      size_t at = 0;
      A* sc = s.take(QR * KC, at);
      A* qs = s.take(QR * E, at);
      A* ks = s.take(KC * E, at);
      A* vs = s.take(KC * Ev, at);
      A* acc = s.take(QR * Ev, at);
      A* m = s.take(QR, at);
      A* l = s.take(QR, at);
      std::fill(acc, acc + qn * Ev, A(0));
      std::fill(m, m + qn, neg_inf<A>());
      std::fill(l, l + qn, A(0));
      int64_t ldq;
      const A* qt = tile<T, A>(a->q, a->q_strides, b, h, r0, qn, E, qs, &ldq);
      block_spans(a, b, h, qb, spans);
      for (const Span& sp : spans) {
        const int64_t kn = sp.kv1 - sp.kv0;
        int64_t ldk, ldv;
        const A* kt = tile<TKV, A>(a->k, a->k_strides, b, hk, sp.kv0, kn, E, ks, &ldk);
        gemm<A>(a, false, true, qn, kn, E, static_cast<A>(a->scale), qt, ldq, kt, ldk, A(0), sc, KC);
        modded_scores<A>(a, b, h, r0, qn, sp, sc, KC, nullptr, keep.data());
        for (int64_t i = 0; i < qn; ++i) {
          A* row = sc + i * KC;
          const A m_new = std::max(m[i], row_max(row, kn));
          if (m_new == neg_inf<A>()) {
            std::fill(row, row + kn, A(0));
            continue;
          }
          const A alpha = std::exp(m[i] - m_new);
          l[i] = l[i] * alpha + exp_shift_sum(row, kn, m_new);
          m[i] = m_new;
          if (alpha != A(1)) scale_row(acc + i * Ev, Ev, alpha);
          if (dropout) {
            dropout_keep_row(a, b, h, r0 + i, sp.kv0, kn, kept.data());
            for (int64_t j = 0; j < kn; ++j) row[j] = kept[j] ? row[j] * dscale : A(0);
          }
        }
        const A* vt = tile<TKV, A>(a->v, a->v_strides, b, hk, sp.kv0, kn, Ev, vs, &ldv);
        gemm<A>(a, false, false, qn, Ev, kn, A(1), sc, KC, vt, ldv, A(1), acc, Ev);
      }
      for (int64_t i = 0; i < qn; ++i) {
        const int64_t row_i = r0 + i;
        A mi = m[i], li = l[i];
        A* max_out = static_cast<A*>(a->max_scores);
        max_out[b * a->max_strides[0] + h * a->max_strides[1] + row_i * a->max_strides[2]] = mi;
        A* acc_row = acc + i * Ev;
        if (sinks != nullptr) {
          const A sink = sinks[b * a->sinks_strides[0] + h * a->sinks_strides[1]];
          const A top = std::max(mi, sink);
          const A alpha = std::exp(mi - top);
          li = li * alpha + std::exp(sink - top);
          scale_row(acc_row, Ev, alpha);
          mi = top;
        }
        T* out = static_cast<T*>(a->out) + b * a->out_strides[0] + h * a->out_strides[1] + row_i * a->out_strides[2];
        A* lse = static_cast<A*>(a->lse) + b * a->lse_strides[0] + h * a->lse_strides[1] + row_i * a->lse_strides[2];
        if (li == A(0)) {
          for (int64_t j = 0; j < Ev; ++j) out[j * a->out_strides[3]] = static_cast<T>(0.0f);
          *lse = neg_inf<A>();
          continue;
        }
        const A inv = A(1) / li;
        for (int64_t j = 0; j < Ev; ++j) out[j * a->out_strides[3]] = static_cast<T>(acc_row[j] * inv);
        *lse = mi + std::log(li);
      }
    }
  }
}

// 16-bit inputs: keys and values converted to A once, when several query tiles read
// them (a prefill, not a decode step, whose tiles each read their keys once); the
// copy is the size of K and V in A, never L x S.
template <typename T, typename A>
void forward(const FaCallArgs* a) {
  if constexpr (std::is_same<T, A>::value) {
    forward_tiles<T, T, A>(a);
  } else {
    if (a->L <= a->q_tile) {
      forward_tiles<T, T, A>(a);
      return;
    }
    const int64_t B = a->B, Hkv = a->Hkv, S = a->S, E = a->E, Ev = a->Ev;
    const size_t nk = (size_t)(B * Hkv * S * E), n = nk + (size_t)(B * Hkv * S * Ev);
    std::unique_ptr<LargeArray<A>> own;
    A* kf = kv_copy_buffer<A>(n, own);
    A* vf = kf + nk;
#pragma omp parallel for num_threads(team_size(a, B * Hkv)) schedule(static)
    for (int64_t it = 0; it < B * Hkv; ++it) {
      const int64_t b = it / Hkv, hk = it % Hkv;
      int64_t ld;
      tile<T, A>(a->k, a->k_strides, b, hk, 0, S, E, kf + it * S * E, &ld);
      tile<T, A>(a->v, a->v_strides, b, hk, 0, S, Ev, vf + it * S * Ev, &ld);
    }
    FaCallArgs c = *a;
    c.k = kf;
    c.v = vf;
    const int64_t ks[4] = {Hkv * S * E, S * E, E, 1}, vs[4] = {Hkv * S * Ev, S * Ev, Ev, 1};
    std::copy(ks, ks + 4, c.k_strides);
    std::copy(vs, vs + 4, c.v_strides);
    forward_tiles<T, A, A>(&c);
  }
}

}  // namespace
