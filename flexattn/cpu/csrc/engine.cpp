// flexattn's CPU attention engine: block-sparse flash attention, forward and backward, for
// float32, float64, bfloat16 and float16 (the last two computed in float32), with the
// score_mod and mask_mod of a call reached through the function pointers of its mod
// library (abi.h). Compiled once per machine; every call passes a FaCallArgs.
//
// Forward (fa_forward): one work item is a query tile of one (b, h): rows
// [r0, r1) of sparse query block qb, at most q_tile rows (a sparse block taller than
// q_tile is split), or of several consecutive blocks whose KV lists are the same, up to
// q_tile rows. Items run on an OpenMP team, the ones with the most listed KV blocks
// first (longest-processing-time order: a causal mask's last rows start first), taken
// dynamically. An item walks the KV blocks its block's row lists, partial blocks first
// (mask_mod applied), then full ones, merging consecutive block ids into spans of at most
// kv_tile keys, and for each span
//     S = Q K^T (BLAS), then per row: scale, score_mod, mask_mod, the online softmax
//     (running max m_i, running sum l_i, accumulator acc rescaled by exp(m_old - m_new);
//     FlashAttention-2, Dao 2023), dropout on the probabilities, acc += P V (BLAS).
// At the end a sink joins each row's sum, out = acc / l_i, lse = m_i + log(l_i); rows
// that saw no key get out 0 and lse -inf (lse = sink with a sink).
//
// Backward (fa_backward): one work item is one (b, KV head): it owns that head's dK and dV
// (float accumulators of the whole sequence) and walks, for every query head of its GQA
// group and every query tile, the same spans as the forward, recomputing P from the saved
// lse: dV += P_dropped^T dO, dP = dO V^T, dS = P * (dP_dropped - delta), dS through the
// joint graph of score_mod (which also adds the captured tensors' gradients), then
// dQ += dS K and dK += dS^T Q, all scaled by the softmax scale. Five matrix products per
// span, no atomics on dQ/dK/dV; the parallelism is B * Hkv.
//
// Per-thread scratch: a few q_tile x kv_tile float tiles, the converted Q/dO tiles and,
// for 16-bit inputs or non-unit head strides, K and V converted to float32 (forward: per
// span; backward: once per item). Memory never grows with L * S.
//
// Matrix products: the Fortran BLAS sgemm_/dgemm_ torch links (function pointers in the
// call), row-major through the transposition identity C^T = B^T A^T; products of at most
// FEW_ROWS rows (decode steps) in the engine's own vector loops instead.
//
// The engine's parts: products.h (matrix products), rows.h (vector maths on rows and
// tiles), dropout.h (Philox keep decisions), spans.h (a query block's spans and their
// modded scores), memory.h (scratch and the float copy of 16-bit keys and values),
// forward.h, backward.h, math_table.h (the functions lent to mod libraries). Python
// assembles them into one translation unit (flexattn/cpu/sources.py).

#include "abi.h"
#include "backward.h"
#include "forward.h"
#include "math_table.h"

#include <new>

namespace {

template <template <typename, typename> class Kernel>
int run(const FaCallArgs* a) {
  try {
    switch (a->dtype) {
      case 0: Kernel<float, float>::run(a); break;
      case 1: Kernel<double, double>::run(a); break;
      case 2: Kernel<c10::BFloat16, float>::run(a); break;
      case 3: Kernel<c10::Half, float>::run(a); break;
      default: return 2;
    }
  } catch (const std::bad_alloc&) {
    return 3;
  } catch (...) {
    return 1;
  }
  return 0;
}

template <typename T, typename A>
struct Forward {
  static void run(const FaCallArgs* a) { forward<T, A>(a); }
};

template <typename T, typename A>
struct Backward {
  static void run(const FaCallArgs* a) { backward<T, A>(a); }
};

}  // namespace

extern "C" int fa_forward(const FaCallArgs* a) { return run<Forward>(a); }
extern "C" int fa_backward(const FaCallArgs* a) { return run<Backward>(a); }
extern "C" const FaMath* fa_math() { return &kMath; }
