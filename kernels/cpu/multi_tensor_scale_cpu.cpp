#include <kernels/cpu/multi_tensor_scale_cpu.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h): everything here lives in
// kernels::cpu::CPU_CAPABILITY, matching at::vec's own inline namespace.
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

template <typename T>
void scale_chunks(const PointerLists<1>& lists, const std::vector<CpuChunk>& chunks, float scale) {
  using Vec = at::vec::Vectorized<float>;
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const CpuChunk& chunk = chunks[c];
      T* data = static_cast<T*>(lists.addresses[chunk.entry][0]) + chunk.begin;
      at::vec::map([scale](Vec x) { return x * Vec(scale); }, data, data, chunk.num_elements);
    }
  });
}

}  // namespace

void multi_tensor_scale(const PointerLists<1>& lists, float scale) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  switch (lists.dtypes[0]) {
    case DType::kFloat32:
      scale_chunks<float>(lists, chunks, scale);
      break;
    case DType::kFloat16:
      scale_chunks<c10::Half>(lists, chunks, scale);
      break;
    case DType::kBFloat16:
      scale_chunks<c10::BFloat16>(lists, chunks, scale);
      break;
  }
}

}  // namespace kernels::cpu::CPU_CAPABILITY
