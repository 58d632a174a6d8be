#include <ddp/reducer/model_sync.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <ddp/hash.h>
#include <ddp/reducer/bucket_copy.h>

namespace ddp::detail {
namespace {

/// Tensors grouped by (dtype, device) in first-appearance order: one flat buffer, so one collective, per group.
std::vector<std::vector<at::Tensor>> group_by_dtype_and_device(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<std::pair<c10::ScalarType, c10::Device>> keys;
  for (const at::Tensor& t : tensors) {
    const std::pair<c10::ScalarType, c10::Device> key{t.scalar_type(), t.device()};
    auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      groups.emplace_back();
      it = keys.end() - 1;
    }
    groups[static_cast<size_t>(it - keys.begin())].push_back(t);
  }
  return groups;
}

int64_t total_elements(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const at::Tensor& t : tensors) n += t.numel();
  return n;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

/// One line per parameter and buffer, then the options that shape the buckets: what must agree across ranks
/// (different bucket layouts would pair up unrelated allreduces).
std::vector<std::string> describe(const torch::nn::Module& module, const DistributedDataParallelOptions& o) {
  std::vector<std::string> lines;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    lines.push_back(c10::str("parameter ", p.key(), " ", p.value().sizes(), " ", p.value().scalar_type(),
                             p.value().requires_grad() ? "" : " (requires_grad=false)"));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    lines.push_back(c10::str("buffer ", b.key(), " ", b.value().sizes(), " ", b.value().scalar_type()));
  }
  lines.push_back(c10::str("option bucket_cap_mb=", o.bucket_cap_mb(), " first_bucket_mb=", o.first_bucket_mb(),
                           " allreduce_dtype=", o.allreduce_dtype() ? c10::toString(*o.allreduce_dtype()) : "grad",
                           " broadcast_buffers=", o.broadcast_buffers(), " delay_allreduce=", o.delay_allreduce(),
                           " find_unused_parameters=", o.find_unused_parameters(), " rebuild_buckets=",
                           o.rebuild_buckets(), " gradient_predivide_factor=", o.gradient_predivide_factor()));
  return lines;
}

}  // namespace

void broadcast_from_root(const ProcessGroup& pg, const std::vector<at::Tensor>& tensors) {
  if (pg.size() == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;  // parameters are leaves that require grad; writing them is not part of the graph
  for (const auto& group : group_by_dtype_and_device(tensors)) {
    at::Tensor flat = at::empty({total_elements(group)}, group.front().options());
    if (pg.rank() == kRoot) copy_into_bucket(flat, group, 1.0);
    pg.broadcast_(flat, kRoot);
    if (pg.rank() != kRoot) copy_from_bucket(flat, group, 1.0);
  }
}

void verify_same_model_on_all_ranks(const ProcessGroup& pg, const torch::nn::Module& module,
                                    const DistributedDataParallelOptions& options) {
  if (pg.size() == 1) return;
  std::string mine;
  for (const auto& line : describe(module, options)) mine += line + "\n";
  const at::Tensor summary =
      at::tensor({static_cast<int64_t>(fnv1a64(mine.data(), mine.size())), static_cast<int64_t>(mine.size())},
                 at::kLong)
          .to(pg.device());
  std::vector<at::Tensor> summaries = pg.allgather(summary);
  for (at::Tensor& s : summaries) s = s.cpu();
  int64_t longest = 0;
  bool all_equal = true;
  for (const at::Tensor& s : summaries) {
    all_equal = all_equal && s[0].item<int64_t>() == summaries[0][0].item<int64_t>();
    longest = std::max(longest, s[1].item<int64_t>());
  }
  if (all_equal) return;

  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  const std::vector<at::Tensor> all_bytes = pg.allgather(bytes.to(pg.device()));
  std::vector<std::vector<std::string>> lines;
  for (size_t r = 0; r < all_bytes.size(); ++r) {
    const at::Tensor host = all_bytes[r].cpu();
    const auto* data = reinterpret_cast<const char*>(host.data_ptr<uint8_t>());
    lines.push_back(split_lines(std::string(data, static_cast<size_t>(summaries[r][1].item<int64_t>()))));
  }
  // Everyone compares rank 0 with the first rank that differs from it, so every rank names the same entry.
  for (size_t r = 1; r < lines.size(); ++r) {
    if (lines[r] == lines[0]) continue;
    size_t i = 0;
    while (i < lines[0].size() && i < lines[r].size() && lines[0][i] == lines[r][i]) ++i;
    auto entry = [&](size_t rank) { return i < lines[rank].size() ? "'" + lines[rank][i] + "'" : "nothing"; };
    TORCH_CHECK(false, "DistributedDataParallel: the module or the options differ across ranks (checked on rank ",
                pg.rank(), "): entry #", i, " is ", entry(0), " on rank 0 but ", entry(r), " on rank ", r,
                ". Every rank must build the same model with the same options.");
  }
}

}  // namespace ddp::detail
