#include "common/peer_bundle.h"

#include <cstdint>
#include <fstream>
#include <iterator>
#include <set>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace bench {
namespace {

// Note [byte digest]
// Position weights cycle with the largest prime below 2^16 so that each product stays below 2^24 and a chunk's
// weighted sum below 2^53 (exact in int64, and in Python's ints); the fold is modulo the Mersenne prime 2^61 - 1.
constexpr int64_t kWeightPeriod = 65521;
constexpr int64_t kChunkBytes = int64_t{1} << 22;  // bytes widened to int64 at a time (32 MiB)
constexpr uint64_t kFoldMultiplier = 1000003;
constexpr uint64_t kFoldModulus = (uint64_t{1} << 61) - 1;

uint64_t fold(uint64_t h, uint64_t x) {
  const unsigned __int128 product = static_cast<unsigned __int128>(h) * kFoldMultiplier + (x % kFoldModulus);
  return static_cast<uint64_t>(product % kFoldModulus);
}

}  // namespace

void save_peer_bundle(const std::string& path, const NamedTensors& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(seen.insert(name).second, "peer bundle ", path, ": the name '", name, "' is given twice");
    TORCH_CHECK(tensor.defined(), "peer bundle ", path, ": tensor '", name, "' is undefined");
    dict.insert(name, tensor.detach().cpu().contiguous());
  }
  const std::vector<char> bytes = torch::pickle_save(dict);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "cannot write the peer bundle ", path);
}

NamedTensors load_peer_bundle(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot read the peer bundle ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue value = torch::pickle_load(bytes);
  TORCH_CHECK(value.isGenericDict(), "peer bundle ", path, " holds a ", value.tagKind(), ", not a dict of tensors");
  NamedTensors out;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString() && entry.value().isTensor(), "peer bundle ", path,
                " holds an entry that is not str -> Tensor");
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

NamedTensors module_state(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
  return out;
}

std::string byte_digest(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 0;
  for (const at::Tensor& tensor : tensors) {
    TORCH_CHECK(tensor.defined(), "byte_digest: undefined tensor");
    const at::Tensor bytes = tensor.detach().cpu().contiguous().flatten().view(at::kByte);
    const int64_t n = bytes.numel();
    uint64_t sum = 0, weighted = 0;
    for (int64_t begin = 0; begin < n; begin += kChunkBytes) {
      const int64_t end = std::min(n, begin + kChunkBytes);
      const at::Tensor wide = bytes.slice(0, begin, end).to(at::kLong);
      const at::Tensor weights = at::arange(begin, end, at::kLong).remainder_(kWeightPeriod).add_(1);
      sum = (sum + static_cast<uint64_t>(wide.sum().item<int64_t>())) % kFoldModulus;
      weighted = (weighted + static_cast<uint64_t>(wide.mul(weights).sum().item<int64_t>())) % kFoldModulus;
    }
    h = fold(h, static_cast<uint64_t>(tensor.numel()));
    for (const int64_t size : tensor.sizes()) h = fold(h, static_cast<uint64_t>(size));
    h = fold(h, static_cast<uint64_t>(tensor.element_size()));
    h = fold(h, sum);
    h = fold(h, weighted);
  }
  return fmt::format("{:016x}", h);
}

std::string byte_digest(const NamedTensors& named) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(named.size());
  for (const auto& entry : named) tensors.push_back(entry.second);
  return byte_digest(tensors);
}

}  // namespace bench
