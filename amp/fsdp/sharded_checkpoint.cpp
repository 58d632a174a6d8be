// ShardedGradients' consolidated checkpoints (docs/fsdp.md, "Checkpoints"): the optimizer's state gathered from
// every rank's shards into the unsharded layout, and this rank's slices taken from it.

#include <amp/fsdp/sharded_gradients.h>

#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/saved_optimizer.h>

namespace amp::detail {
namespace {

std::string key_of(int64_t group, const std::string& field, int64_t index) {
  return "group" + std::to_string(group) + "." + field + "." + std::to_string(index);
}

}  // namespace

void ShardedGradients::check_fused(const char* what) const {
  TORCH_CHECK(fused_ != nullptr, what,
              " of a fully sharded model needs one of amp's fused optimizers (FusedAdam, FusedAdamW, FusedSGD), whose "
              "state is per element and named by field; this optimizer's state cannot be split into parameters");
}

void ShardedGradients::save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const {
  check_fused("a checkpoint");
  torch::serialize::InputArchive in;  // this rank's shards' state as the optimizer saves them
  read_back_saved_state(optimizer_, in);
  const int world = pg_.size();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(slots_.device());
  for (const std::string& field : fused_->state_fields()) {
    const bool scalar = field == "step";
    for (const ShardLayout& shard : layout_) {
      // Every rank's entry (or zeros) and a flag, 1 where the rank has the entry, in one all-gather.
      const int64_t n = scalar ? 1 : shard.chunk;
      at::Tensor mine = at::zeros({n + 1}, fp32);
      at::Tensor value;
      if (in.try_read(key_of(shard.group, field, shard.index), value)) {
        TORCH_CHECK(value.numel() == n, "full sharding: the optimizer's ", field, " of a shard has ", value.numel(),
                    " elements, the shard ", n);
        mine.narrow(0, 0, n).copy_(value.reshape({-1}));
        mine[n].fill_(1.0);
      }
      at::Tensor all = at::empty({(n + 1) * world}, fp32);
      auto work = pg_.allgather_into_async(all, mine);
      pg_.wait(work, "full sharding checkpoint all-gather");
      const at::Tensor per_rank = all.view({world, n + 1});
      const at::Tensor flags = per_rank.select(1, n);
      const double lo = flags.min().item<double>(), hi = flags.max().item<double>();
      TORCH_CHECK(lo == hi, "full sharding: the ranks disagree on whether a shard has optimizer state '", field,
                  "' (a corrupt state?)");
      if (lo == 0.0) continue;  // a unit that never stepped
      const at::Tensor values = per_rank.narrow(1, 0, n);
      for (const LaidOut& p : shard.params) {
        const std::string key = key_of(shard.group, field, p.index);
        if (scalar) {
          TORCH_CHECK(values.min().item<double>() == values.max().item<double>(),
                      "full sharding: the ranks' step counts of a unit differ");
          archive.write(key, values[0].reshape({1}).to(value.dtype()).cpu().clone());  // one storage per entry
          continue;
        }
        int64_t numel = 1;
        for (const int64_t d : p.shape) numel *= d;
        archive.write(key,
                      values.reshape({-1}).narrow(0, p.offset, numel).view(p.shape).to(value.dtype()).cpu().clone());
      }
    }
  }
}

std::string ShardedGradients::shard_optimizer_archive(torch::serialize::InputArchive& full) const {
  check_fused("loading a checkpoint");
  torch::serialize::OutputArchive out;
  const int world = pg_.size();
  const int64_t me = pg_.rank();
  for (const std::string& field : fused_->state_fields()) {
    const bool scalar = field == "step";
    for (const ShardLayout& shard : layout_) {
      std::vector<at::Tensor> values;
      for (const LaidOut& p : shard.params) {
        at::Tensor value;
        if (full.try_read(key_of(shard.group, field, p.index), value)) values.push_back(value);
      }
      if (values.empty()) continue;  // the unit had not stepped
      TORCH_CHECK(values.size() == shard.params.size(), "optimizer checkpoint: ", values.size(), " of the ",
                  shard.params.size(), " parameters of the unit holding '", shard.params.front().name, "' have ", field,
                  ": a fully sharded unit steps as one");
      const std::string key = key_of(shard.group, field, shard.index);
      if (scalar) {
        for (size_t q = 0; q < values.size(); ++q) {
          TORCH_CHECK(values[q].numel() == 1,
                      "optimizer checkpoint: ", key_of(shard.group, field, shard.params[q].index), " has ",
                      values[q].numel(), " elements but a step count has 1");
          TORCH_CHECK(at::equal(values[q], values[0]), "optimizer checkpoint: the step counts of '",
                      shard.params[q].name, "' and '", shard.params[0].name,
                      "' differ, but a fully sharded unit steps as one");
        }
        out.write(key, values[0].reshape({1}).clone());
        continue;
      }
      at::Tensor flat = at::zeros({shard.chunk * world}, values[0].options());
      for (size_t q = 0; q < values.size(); ++q) {
        const LaidOut& p = shard.params[q];
        int64_t numel = 1;
        for (const int64_t d : p.shape) numel *= d;
        TORCH_CHECK(values[q].numel() == numel, "optimizer checkpoint: ", key_of(shard.group, field, p.index), " has ",
                    values[q].numel(), " elements but '", p.name, "' has ", numel);
        flat.narrow(0, p.offset, numel).copy_(values[q].reshape({-1}));
      }
      out.write(key, flat.narrow(0, me * shard.chunk, shard.chunk).clone());
    }
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

int64_t ShardedGradients::count_failures(bool ok) const {
  at::Tensor flag = at::full({1}, ok ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(slots_.device()));
  pg_.allreduce_sum_(flag, "full sharding checkpoint agreement allreduce");
  return static_cast<int64_t>(flag.item<float>());
}

}  // namespace amp::detail
