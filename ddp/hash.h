#pragma once

// 64-bit FNV-1a: the one byte hash of the library (checkpoint parts, model descriptions, replica digests).

#include <cstddef>
#include <cstdint>

namespace ddp {

constexpr uint64_t kFnv1aOffsetBasis = 14695981039346656037ull;

/// FNV-1a over `size` bytes at `data`, continuing from `hash` (kFnv1aOffsetBasis to start). Not cryptographic:
/// it catches accidental differences (a flipped bit, a diverged replica), not deliberate ones.
inline uint64_t fnv1a64(const void* data, size_t size, uint64_t hash = kFnv1aOffsetBasis) {
  constexpr uint64_t kPrime = 1099511628211ull;
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * kPrime;
  return hash;
}

}  // namespace ddp
