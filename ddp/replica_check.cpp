#include <ddp/replica_check.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>
#include <ddp/hash.h>

namespace ddp {
namespace {

uint64_t hash_text(const std::string& text, uint64_t hash) { return fnv1a64(text.data(), text.size() + 1, hash); }

uint64_t hash_tensor(const std::string& name, const at::Tensor& tensor, uint64_t hash) {
  hash = hash_text(name, hash);
  hash = hash_text(c10::toString(tensor.scalar_type()), hash);
  hash = hash_text(c10::str(tensor.sizes()), hash);
  const at::Tensor host = tensor.detach().cpu().contiguous();
  return fnv1a64(host.data_ptr(), host.nbytes(), hash);
}

}  // namespace

uint64_t replica_digest(const torch::nn::Module& module, bool include_buffers) {
  uint64_t hash = kFnv1aOffsetBasis;
  for (const auto& p : module.named_parameters()) hash = hash_tensor("parameter " + p.key(), p.value(), hash);
  if (include_buffers) {
    for (const auto& b : module.named_buffers()) hash = hash_tensor("buffer " + b.key(), b.value(), hash);
  }
  return hash;
}

std::string digest_hex(uint64_t digest) {
  char text[19];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(digest));
  return text;
}

uint64_t check_replicas(const torch::nn::Module& module, const ProcessGroup& group, bool include_buffers) {
  const uint64_t mine = replica_digest(module, include_buffers);
  int64_t as_signed = 0;
  std::memcpy(&as_signed, &mine, sizeof(as_signed));
  const std::vector<at::Tensor> all = group.allgather(at::tensor({as_signed}, at::kLong).to(group.device()));
  std::vector<uint64_t> digests;
  for (const at::Tensor& t : all) {
    const int64_t value = t.cpu().item<int64_t>();
    uint64_t digest = 0;
    std::memcpy(&digest, &value, sizeof(digest));
    digests.push_back(digest);
  }
  std::string differing;
  for (size_t r = 1; r < digests.size(); ++r) {
    if (digests[r] != digests[0]) {
      differing += (differing.empty() ? "" : ", ") + std::to_string(r) + " (" + digest_hex(digests[r]) + ")";
    }
  }
  TORCH_CHECK(differing.empty(), "ddp::check_replicas: the replicas differ: rank(s) ", differing, " of ",
              digests.size(), " hold ", include_buffers ? "parameters or buffers" : "parameters",
              " other than rank 0's (", digest_hex(digests[0]), ")");
  return mine;
}

}  // namespace ddp
