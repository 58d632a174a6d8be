// amp::detail::State over a fully sharded model: the constructor amp::initialize(fsdp, ...) runs, and what it refuses.

#include <amp/state/state.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/lbfgs.h>
#include <torch/serialize/archive.h>

#include <amp/fp8/fp8_state.h>
#include <amp/fsdp/sharded_gradients.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/model_cast.h>
#include <ddp/fsdp/fully_sharded.h>

namespace amp::detail {
namespace {

constexpr const char* kWhat = "amp::initialize over a FullyShardedDataParallel: ";

/// The shards, named after their units ("(root)" for the root's own parameters).
std::vector<std::pair<std::string, at::Tensor>> named_shards(const ddp::FullyShardedDataParallel& fsdp) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  const std::vector<at::Tensor> shards = fsdp.parameters();
  size_t next = 0;
  for (const ddp::ShardedUnitInfo& unit : fsdp.units()) {
    if (unit.shard_numel == 0) continue;  // parameters() holds the units that have parameters, in this order
    named.emplace_back(unit.name.empty() ? std::string("(root)") : unit.name, shards.at(next++));
  }
  return named;
}

/// What full sharding cannot take, refused before anything changes. Each unit gathers its parameters in one dtype
/// (FullyShardOptions::param_dtype) from fp32 shards that are the master weights.
void check_fully_shardable(const ddp::FullyShardedDataParallel& fsdp, const Options::Resolved& policy,
                           const torch::optim::Optimizer& optimizer) {
  const std::optional<c10::ScalarType> param_dtype = fsdp.options().param_dtype();
  const std::string level = opt_level_name(policy.opt_level);
  TORCH_CHECK(policy.cast_model_type == at::kFloat || policy.master_weights, kWhat, level,
              " keeps no fp32 weights, but the shards are fp32 (they are the master weights, 4/N bytes per "
              "parameter): use O2");
  if (policy.cast_model_type == at::kFloat) {
    TORCH_CHECK(!param_dtype || *param_dtype == at::kFloat, kWhat, level,
                " keeps the parameters fp32 (autocast casts per operation), but FullyShardOptions::param_dtype is ",
                *param_dtype, ": leave param_dtype unset, or use O2");
  } else {
    TORCH_CHECK(param_dtype == policy.cast_model_type, kWhat, level, " computes in ", policy.cast_model_type,
                ": construct the FullyShardedDataParallel with FullyShardOptions().param_dtype(",
                policy.cast_model_type, ") (the fp32 shards stay the master weights), not ",
                param_dtype ? c10::toString(*param_dtype) : "without param_dtype");
    TORCH_CHECK(!policy.keep_layernorm_fp32, kWhat,
                "keep_layernorm_fp32 is not supported: a unit gathers its parameters in one dtype (param_dtype); "
                "leave keep_layernorm_fp32 off");
    if (policy.keep_batchnorm_fp32) {
      for (const auto& m : fsdp.module()->named_modules("", /*include_self=*/true)) {
        TORCH_CHECK(!is_batch_norm(*m.value()), kWhat, level, " keeps BatchNorm '", m.key(),
                    "' in fp32, but a unit gathers its parameters in one dtype (param_dtype ", policy.cast_model_type,
                    "): pass keep_batchnorm_fp32(false), or use O1");
      }
    }
  }
  TORCH_CHECK(dynamic_cast<const torch::optim::LBFGS*>(&optimizer) == nullptr, kWhat,
              "LBFGS reduces over all its parameters (dot products, a line search) and each rank holds only its "
              "shard; use an elementwise optimizer (SGD, Adam, AdamW, amp's fused ones)");
}

}  // namespace

State::State(ddp::FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer, const Options& options)
    : options_(options),
      policy_(options.resolve()),
      module_(fsdp.module().get()),
      optimizer_(&optimizer),
      fused_(dynamic_cast<FusedOptimizer*>(&optimizer)),
      slots_(named_shards(fsdp), optimizer,
             "a shard of the FullyShardedDataParallel: build the optimizer over fsdp.parameters()"),
      losses_(policy_, slots_.device()),
      progress_(slots_.device()),
      fsdp_(&fsdp),
      logger_(default_overflow_logger) {
  check_fully_shardable(fsdp, policy_, optimizer);
  register_optimizer();
  // The parameters already compute in param_dtype (checked above): what is left to cast are the buffers.
  if (policy_.cast_model_type != at::kFloat) {
    cast_model_(*module_, policy_.cast_model_type, policy_.keep_batchnorm_fp32, policy_.keep_layernorm_fp32);
  }
  set_forward_policy();
  auto owner = std::make_unique<ShardedGradients>(OwnerContext{slots_, optimizer, fused_, policy_, true}, fsdp);
  sharded_owner_ = owner.get();
  owner_ = std::move(owner);
  // FP8 layers inside units: each reads its weight gathered (the same on every rank) and casts it per forward, as
  // unsharded; the amaxes of inputs and output gradients are max-reduced over the ranks with the overflow flag.
  if (policy_.fp8) {
    fp8_ = std::make_unique<Fp8State>(*module_, *policy_.fp8, slots_.device());
    fp8_->set_process_group(&fsdp.process_group());
    for (const auto& line : fp8_->report()) logger_(line);
  }
}

void State::save_fully_sharded_model(torch::serialize::OutputArchive& archive) const {
  // The parameters in the module's order and names, as an unsharded model's save_model writes them: loads into
  // one process, plain DDP, or full sharding at any world size.
  for (const auto& [name, value] : fsdp_->full_parameters()) archive.write(name, value.to(at::kFloat).cpu());
  for (const auto& b : module_->named_buffers(true)) {
    const at::Tensor& v = b.value();
    archive.write(b.key(), (v.is_floating_point() ? v.to(at::kFloat) : v).cpu(), /*is_buffer=*/true);
  }
}

std::vector<std::pair<at::Tensor, at::Tensor>> State::prepare_fully_sharded_model_load(
    torch::serialize::InputArchive& archive) {
  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const ddp::ShardedUnitInfo& unit : fsdp_->units()) {
    for (const std::string& name : unit.parameter_names) {
      at::Tensor value;
      TORCH_CHECK(archive.try_read(name, value), "model checkpoint has no '", name, "'");
      values.emplace_back(name, value.to(at::kFloat));
    }
  }
  // Each unit's shard and this rank's slice of the values; every shape checked first.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies = fsdp_->shard_copies(values);
  for (const auto& b : module_->named_buffers(true)) {
    at::Tensor value;
    TORCH_CHECK(archive.try_read(b.key(), value, /*is_buffer=*/true), "model checkpoint has no '", b.key(), "'");
    TORCH_CHECK(value.sizes() == b.value().sizes(), "model checkpoint has '", b.key(), "' with shape ", value.sizes(),
                " but the model's is ", b.value().sizes());
    copies.emplace_back(b.value(), value);
  }
  return copies;
}

}  // namespace amp::detail
