// A query block's walk over its keys: the spans its row lists, the scores of a span
// (score_mod and mask_mod applied), and the extents and team a call's work takes.
#pragma once

#include "abi.h"
#include "rows.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

// The spans of keys one query block's row lists: [kv0, kv1) pieces of at most
// kv_tile keys, partial ones (mask_mod applies) first.
struct Span {
  int64_t kv0, kv1;
  bool partial;
};

void block_spans(const FaCallArgs* a, int64_t b, int64_t h, int64_t qb, std::vector<Span>& spans) {
  spans.clear();
  const int64_t nblocks = (a->S + a->kv_block - 1) / a->kv_block;
  for (int list = 0; list < 2; ++list) {
    const bool partial = list == 0;
    const int32_t* num = static_cast<const int32_t*>(partial ? a->kv_num : a->full_num);
    const int32_t* idx = static_cast<const int32_t*>(partial ? a->kv_idx : a->full_idx);
    if (num == nullptr || idx == nullptr) continue;
    const int64_t* ns = partial ? a->kv_num_strides : a->full_num_strides;
    const int64_t* is = partial ? a->kv_idx_strides : a->full_idx_strides;
    const int64_t width = partial ? a->kv_idx_width : a->full_idx_width;
    const int64_t count = std::min<int64_t>(num[b * ns[0] + h * ns[1] + qb * ns[2]], width);
    const int32_t* row = idx + b * is[0] + h * is[1] + qb * is[2];
    int64_t run0 = -1, run1 = -1;
    auto flush = [&]() {
      if (run0 < 0) return;
      const int64_t lo = run0 * a->kv_block, hi = std::min(run1 * a->kv_block, a->S);
      for (int64_t s = lo; s < hi; s += a->kv_tile) spans.push_back({s, std::min(s + a->kv_tile, hi), partial});
      run0 = run1 = -1;
    };
    for (int64_t e = 0; e < count; ++e) {
      const int64_t blk = row[e * is[3]];
      if (blk < 0 || blk >= nblocks) continue;
      if (run0 >= 0 && blk == run1 && (run1 + 1 - run0) * a->kv_block <= a->kv_tile) {
        run1 = blk + 1;
        continue;
      }
      flush();
      run0 = blk;
      run1 = blk + 1;
    }
    flush();
  }
}

int64_t listed_blocks(const FaCallArgs* a, int64_t b, int64_t h, int64_t qb) {
  int64_t total = 0;
  if (a->kv_num != nullptr) {
    const int64_t* ns = a->kv_num_strides;
    total += std::min<int64_t>(static_cast<const int32_t*>(a->kv_num)[b * ns[0] + h * ns[1] + qb * ns[2]],
                               a->kv_idx_width);
  }
  if (a->full_num != nullptr) {
    const int64_t* ns = a->full_num_strides;
    total += std::min<int64_t>(static_cast<const int32_t*>(a->full_num)[b * ns[0] + h * ns[1] + qb * ns[2]],
                               a->full_idx_width);
  }
  return total;
}

// How many rows (or keys) a tile of the plan's `tile` can hold in a call of `length`:
// scratch is sized by the call, not by the plan (a decode step's one row would
// otherwise fill q_tile rows of it).
int64_t call_extent(int64_t tile, int64_t length) { return std::max<int64_t>(1, std::min(tile, length)); }

int team_size(const FaCallArgs* a, int64_t items) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(a->threads, items));
}

// Scores of one span for rows [r0, r0 + qn), given the scaled products in `sc`: a copy
// of them in `raw` when given, then the score_mod and, on partial spans, the mask
// (masked entries become -inf).
template <typename A>
void modded_scores(const FaCallArgs* a, int64_t b, int64_t h, int64_t r0, int64_t qn, const Span& sp, A* sc,
                   int64_t ld, A* raw, uint8_t* keep) {
  const int64_t kn = sp.kv1 - sp.kv0;
  const auto* ctx = static_cast<const FaModContext*>(a->ctx);
  const auto score = reinterpret_cast<FaScoreFn>(a->score_fn);
  const auto mask = reinterpret_cast<FaMaskFn>(a->mask_fn);
  for (int64_t i = 0; i < qn; ++i) {
    A* row = sc + i * ld;
    if (raw != nullptr) std::memcpy(raw + i * ld, row, sizeof(A) * kn);
    if (score != nullptr) score(row, kn, b, h, r0 + i, sp.kv0, ctx);
    if (sp.partial && mask != nullptr) {
      mask(keep, kn, b, h, r0 + i, sp.kv0, ctx);
      for (int64_t j = 0; j < kn; ++j)
        if (!keep[j]) row[j] = neg_inf<A>();
    }
  }
}

}  // namespace
