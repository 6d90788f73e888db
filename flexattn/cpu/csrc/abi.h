// The interface between flexattn's Python side and its two CPU libraries (the engine,
// engine.cpp, and a call's mod library, mods.cpp.jinja), which both start with it.
//
// abi_generated.h is written by flexattn/cpu/abi.py when the sources are assembled
// (flexattn/cpu/sources.py): FA_MAX_ROW, the structs FaModContext, FaCallArgs and FaMath
// generated from the Python field lists (so the two sides cannot drift apart), and the
// X-macros listing the math table's functions.
//
// A mod function works on one row segment of a score tile: n <= FA_MAX_ROW consecutive
// keys kv0, kv0 + 1, ... of query row q_idx of (b, h). Scores are float (double in
// float64 calls; float16 and bfloat16 calls compute in float).
//
//   score_fn(s, n, b, h, q_idx, kv0, ctx)   s[j] <- score_mod(s[j], b, h, q_idx, kv0 + j)
//   mask_fn(keep, n, b, h, q_idx, kv0, ctx) keep[j] <- mask_mod(b, h, q_idx, kv0 + j) != 0
//   joint_fn(g, s, n, b, h, q_idx, kv0, ctx)
//       g[j] <- d loss / d s[j] given g[j] = d loss / d score_mod(s[j]) (the joint graph),
//       and the captured tensors' gradients accumulated into ctx->grads.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>

#include "abi_generated.h"

typedef void (*FaScoreFn)(void* s, int64_t n, int64_t b, int64_t h, int64_t q_idx, int64_t kv0,
                          const FaModContext* ctx);
typedef void (*FaMaskFn)(uint8_t* keep, int64_t n, int64_t b, int64_t h, int64_t q_idx, int64_t kv0,
                         const FaModContext* ctx);
typedef void (*FaJointFn)(void* g, const void* s, int64_t n, int64_t b, int64_t h, int64_t q_idx, int64_t kv0,
                          const FaModContext* ctx);
typedef void (*FaUnaryF32)(float* out, const float* x, int64_t n);
typedef void (*FaUnaryF64)(double* out, const double* x, int64_t n);
typedef void (*FaBinaryF32)(float* out, const float* x, const float* y, int64_t n);
typedef void (*FaBinaryF64)(double* out, const double* x, const double* y, int64_t n);
