#include <kernels/cpu/l2_norm_cpu.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h).
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;

/// Independent vector accumulators: they keep several FMAs in flight and shorten each lane's sequential fp32
/// sum (a 64 Ki chunk gives each lane at most 1 Ki terms on AVX512). Combined in a fixed order.
constexpr int kAccumulators = 4;

/// Sum of (x * inv_scale)^2 over data[0, n): fp32 squares and lane sums, combined in fp64 in a fixed order.
template <typename T>
double sum_of_squares(const T* data, int64_t n, float inv_scale) {
  const fVec inv(inv_scale);
  fVec acc[kAccumulators] = {fVec(0.0f), fVec(0.0f), fVec(0.0f), fVec(0.0f)};
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    constexpr int64_t kStep = kAccumulators * fVec::size();
    for (; d + kStep <= n; d += kStep) {
      for (int k = 0; k < kAccumulators; ++k) {
        const fVec x = fVec::loadu(data + d + k * fVec::size()) * inv;
        acc[k] = at::vec::fmadd(x, x, acc[k]);
      }
    }
  } else {
    // A reduced-precision vector widens into two float vectors: two loads fill the four accumulators.
    using bVec = at::vec::Vectorized<T>;
    static_assert(kAccumulators == 4, "two reduced-precision vectors per step");
    constexpr int64_t kStep = 2 * bVec::size();
    for (; d + kStep <= n; d += kStep) {
      auto [x0, x1] = at::vec::convert_to_float<T>(bVec::loadu(data + d));
      auto [x2, x3] = at::vec::convert_to_float<T>(bVec::loadu(data + d + bVec::size()));
      x0 = x0 * inv;
      x1 = x1 * inv;
      x2 = x2 * inv;
      x3 = x3 * inv;
      acc[0] = at::vec::fmadd(x0, x0, acc[0]);
      acc[1] = at::vec::fmadd(x1, x1, acc[1]);
      acc[2] = at::vec::fmadd(x2, x2, acc[2]);
      acc[3] = at::vec::fmadd(x3, x3, acc[3]);
    }
  }
  float tail = 0.0f;
  for (; d < n; ++d) {
    const float x = static_cast<float>(data[d]) * inv_scale;
    tail = std::fma(x, x, tail);
  }
  double sum = 0.0;
  float lanes[fVec::size()];
  for (const fVec& a : acc) {
    a.store(lanes);
    for (float lane : lanes) sum += lane;
  }
  return sum + tail;
}

template <typename T>
void partials_of(const PointerLists<1>& lists, const int64_t* slot_base, float inv_scale, double* partials) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const CpuChunk& chunk = chunks[c];
      const T* data = static_cast<const T*>(lists.addresses[chunk.entry][0]) + chunk.begin;
      const int64_t slot = slot_base[lists.original_index[chunk.entry]] + chunk.begin / kChunkElements;
      partials[slot] = sum_of_squares(data, chunk.num_elements, inv_scale);
    }
  });
}

}  // namespace

void l2_norm_partials(const PointerLists<1>& lists, const int64_t* slot_base, const float* inv_scale,
                      double* partials) {
  const float scale = inv_scale != nullptr ? *inv_scale : 1.0f;
  switch (lists.dtypes[0]) {
    case DType::kFloat32:
      return partials_of<float>(lists, slot_base, scale, partials);
    case DType::kFloat16:
      return partials_of<c10::Half>(lists, slot_base, scale, partials);
    case DType::kBFloat16:
      return partials_of<c10::BFloat16>(lists, slot_base, scale, partials);
  }
}

void l2_norm_reduce(const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                    float* total, float* per_tensor, float* found_inf) {
  double sum = 0.0;
  for (int64_t s = 0; s < num_slots; ++s) sum += partials[s];
  *total = static_cast<float>(std::sqrt(sum));
  if (found_inf != nullptr && !std::isfinite(*total)) *found_inf = 1.0f;
  if (per_tensor == nullptr) return;
  for (int64_t i = 0; i < num_tensors; ++i) {
    double tensor_sum = 0.0;
    for (int64_t s = slot_base[i]; s < slot_base[i + 1]; ++s) tensor_sum += partials[s];
    per_tensor[i] = static_cast<float>(std::sqrt(tensor_sum));
  }
}

}  // namespace kernels::cpu::CPU_CAPABILITY
