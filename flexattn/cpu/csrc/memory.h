// The engine's memory: large arrays on huge pages, the kept float copy of 16-bit keys
// and values, and a thread's tile scratch.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// A large array, not value-initialised (its writer fills every element). On Linux it
// is 2 MiB aligned and advised to transparent huge pages, so that its first touch
// faults a few huge pages instead of thousands of small ones
// (bench/DECISIONS.md#cpu-kv-copy-huge-pages).
template <typename A>
struct LargeArray {
  A* data = nullptr;
  size_t size = 0;
  explicit LargeArray(size_t n) : size(n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const size_t huge = size_t(2) << 20, bytes = (n * sizeof(A) + huge - 1) / huge * huge;
    void* p = nullptr;
    if (posix_memalign(&p, huge, bytes) != 0) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages stay small
    data = static_cast<A*>(p);
#else
    data = static_cast<A*>(::operator new[](n * sizeof(A)));
#endif
  }
  ~LargeArray() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    free(data);
#else
    ::operator delete[](data);
#endif
  }
  LargeArray(const LargeArray&) = delete;
  LargeArray& operator=(const LargeArray&) = delete;
};

// The forward's float copy of 16-bit keys and values: kept for the calling thread's next
// call up to KV_COPY_CACHE_BYTES, since a fresh buffer's first touch costs page faults,
// several times the conversion itself once other large allocations came and went
// (bench/DECISIONS.md#cpu-kv-copy-huge-pages).
constexpr size_t KV_COPY_CACHE_BYTES = size_t(512) << 20;

template <typename A>
A* kv_copy_buffer(size_t n, std::unique_ptr<LargeArray<A>>& own) {
  if (n * sizeof(A) > KV_COPY_CACHE_BYTES) {
    own.reset(new LargeArray<A>(n));  // too large to keep: the caller frees it
    return own->data;
  }
  thread_local std::unique_ptr<LargeArray<A>> kept;
  if (kept == nullptr || kept->size < n) {
    kept.reset();  // the old buffer goes before the new one is allocated
    kept.reset(new LargeArray<A>(n));
  }
  return kept->data;
}

// A thread's tile buffers, left uninitialised: every tile is written before it is read
// (copies, products with beta = 0, explicit fills), and a zero fill would cost a decode
// step more than its arithmetic.
template <typename A>
struct Scratch {
  std::unique_ptr<A[]> buf;
  explicit Scratch(size_t n) : buf(new A[n]) {}
  A* take(size_t n, size_t& at) {
    A* p = buf.get() + at;
    at += n;
    return p;
  }
};

}  // namespace
