#include <ddp/fsdp/fully_sharded.h>

#include <map>
#include <set>
#include <unordered_map>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/sharded_run.h>
#include <ddp/progress.h>
#include <ddp/reducer/model_sync.h>

// The root of full sharding: finds the units and refuses what cannot work (here), shards them and runs them
// (ddp/fsdp/sharded_run.h), one unit's flat buffer and shard (ddp/fsdp/flat_unit.h).

namespace ddp {
namespace {

void check_options(const FullyShardOptions& o) {
  for (const auto& [name, dtype] : {std::pair{"param_dtype", o.param_dtype()}, {"reduce_dtype", o.reduce_dtype()}}) {
    if (!dtype) continue;
    const c10::ScalarType t = *dtype;
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble,
                "FullyShardedDataParallel: ", name, " must be Float, Half, BFloat16 or Double, got ", t);
  }
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

/// The units of `root`: the root's own parameters first (those in no ddp::ShardedUnit), then each unit in the
/// module's order, with their parameters in the module's order (a tensor named twice inside one unit once).
std::vector<detail::FoundUnit> find_units(torch::nn::Module& root) {
  TORCH_CHECK(dynamic_cast<ShardedUnitImpl*>(&root) == nullptr,
              "FullyShardedDataParallel: the model itself is a ddp::ShardedUnit; build FullyShardedDataParallel over "
              "the model and wrap its blocks");
  std::vector<detail::FoundUnit> units(1);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto wrapper = std::dynamic_pointer_cast<ShardedUnitImpl>(item.value());
    if (!wrapper) continue;
    for (size_t u = 1; u < units.size(); ++u) {
      TORCH_CHECK(!starts_with(item.key(), units[u].name + "."), "FullyShardedDataParallel: ddp::ShardedUnit '",
                  item.key(), "' is inside ddp::ShardedUnit '", units[u].name,
                  "': units do not nest; wrap the inner blocks or the outer one");
    }
    units.push_back({item.key(), {}, wrapper});
  }
  std::unordered_map<const c10::TensorImpl*, std::string> owner;  // parameter -> its unit's label
  auto claim = [&](detail::FoundUnit& unit, const std::string& label, const std::string& name, const at::Tensor& p) {
    const auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), label);
    if (!fresh) {
      TORCH_CHECK(it->second == label, "FullyShardedDataParallel: parameter '", name, "' is in ", it->second,
                  " and in ", label,
                  ": a parameter shared across units cannot be sharded; put the layers that share it in one unit");
      return;  // the same tensor under a second name in the same unit: sharded once
    }
    unit.params.emplace_back(name, p);
  };
  for (size_t u = 1; u < units.size(); ++u) {
    const std::string label = "unit '" + units[u].name + "'";
    for (const auto& p : units[u].wrapper->named_parameters(/*recurse=*/true)) {
      claim(units[u], label, units[u].name + "." + p.key(), p.value());
    }
  }
  for (const auto& p : root.named_parameters(/*recurse=*/true)) {
    if (owner.count(p.value().unsafeGetTensorImpl()) == 0) claim(units[0], "the root", p.key(), p.value());
  }
  for (const detail::FoundUnit& unit : units) {
    if (unit.params.empty()) continue;
    const auto& [first_name, first] = unit.params.front();
    for (const auto& [name, p] : unit.params) {
      TORCH_CHECK(
          p.scalar_type() == first.scalar_type() && p.device() == first.device() &&
              p.requires_grad() == first.requires_grad(),
          "FullyShardedDataParallel: ", unit.name.empty() ? std::string("the root") : "unit '" + unit.name + "'",
          " mixes parameters: '", first_name, "' is ", first.scalar_type(), " on ", first.device(),
          first.requires_grad() ? " requiring grad" : " frozen", ", '", name, "' ", p.scalar_type(), " on ", p.device(),
          p.requires_grad() ? " requiring grad" : " frozen",
          "; a unit's parameters share one dtype, device and requires_grad: wrap them in separate units");
    }
  }
  return units;
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   detail::ModuleForward forward, ProcessGroup process_group,
                                                   Options options)
    : module_(std::move(module)), forward_(std::move(forward)) {
  TORCH_CHECK(module_, "FullyShardedDataParallel: module is null");
  check_options(options);
  std::vector<detail::FoundUnit> found = find_units(*module_);  // the same model on every rank: refused alike
  detail::verify_same_model_on_all_ranks(process_group, *module_, DistributedDataParallelOptions());
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> state = module_->parameters(/*recurse=*/true);
    for (const at::Tensor& b : module_->buffers(/*recurse=*/true)) state.push_back(b);
    detail::broadcast_from_root(process_group, state);
  }
  run_ = std::make_shared<detail::ShardedRun>(std::move(process_group), std::move(options));
  run_->shard(std::move(found));
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::before_forward() {
  if (at::GradMode::is_enabled()) detail::report_step();  // for the launcher's hang detection (no sync)
  run_->begin_forward();
}

void FullyShardedDataParallel::after_forward() { run_->end_forward(/*completed=*/true); }

void FullyShardedDataParallel::abandon_forward() noexcept {
  try {
    run_->end_forward(/*completed=*/false);
  } catch (...) {  // the forward's own error is the one to report
  }
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<at::Tensor> shards;
  for (const auto& unit : run_->units()) {
    if (unit->chunk() > 0) shards.push_back(unit->shard());
  }
  return shards;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::full_parameters() const {
  at::NoGradGuard no_grad;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> values;
  for (const auto& unit : run_->units()) {
    if (unit->params().empty()) continue;
    const at::Tensor flat = unit->gather_flat();
    for (const detail::UnitParameter& p : unit->params()) {
      values[p.param.unsafeGetTensorImpl()] =
          flat.narrow(0, p.offset, p.full_view.numel()).view(p.full_view.sizes()).clone();
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
    out.emplace_back(p.key(), values.at(p.value().unsafeGetTensorImpl()));
  }
  return out;
}

std::vector<std::pair<at::Tensor, at::Tensor>> FullyShardedDataParallel::shard_copies(
    const std::vector<std::pair<std::string, at::Tensor>>& values) const {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> by_name(values.begin(), values.end());
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  const int world = run_->process_group().size();
  const int rank = run_->process_group().rank();
  for (const auto& unit : run_->units()) {  // everything checked before anything changes
    if (unit->chunk() == 0) continue;
    at::Tensor flat = at::zeros({unit->chunk() * world}, unit->shard().options().requires_grad(false));
    for (const detail::UnitParameter& p : unit->params()) {
      const auto it = by_name.find(p.name);
      TORCH_CHECK(it != by_name.end(), "FullyShardedDataParallel::load_full_parameters: no value for parameter '",
                  p.name, "'");
      TORCH_CHECK(it->second.sizes() == p.full_view.sizes(), "FullyShardedDataParallel::load_full_parameters: '",
                  p.name, "' has shape ", it->second.sizes(), ", the model's is ", p.full_view.sizes());
      flat.narrow(0, p.offset, p.full_view.numel()).copy_(it->second.reshape({-1}));
    }
    copies.emplace_back(unit->shard(), flat.narrow(0, rank * unit->chunk(), unit->chunk()));
  }
  return copies;
}

void FullyShardedDataParallel::load_full_parameters(const std::vector<std::pair<std::string, at::Tensor>>& values) {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies = shard_copies(values);
  at::NoGradGuard no_grad;
  for (auto& unit : run_->units()) unit->reshard();  // gathered values would be the old ones
  for (auto& [shard, value] : copies) shard.copy_(value);
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(FullyShardedDataParallel& fsdp) : fsdp_(fsdp) {
  fsdp_.run_->set_sync(false);
}

FullyShardedDataParallel::NoSyncGuard::~NoSyncGuard() { fsdp_.run_->set_sync(true); }

std::vector<ShardedUnitInfo> FullyShardedDataParallel::units() const {
  std::vector<ShardedUnitInfo> out;
  for (const auto& unit : run_->units()) {
    ShardedUnitInfo info;
    info.name = unit->name();
    for (const detail::UnitParameter& p : unit->params()) {
      info.parameter_names.push_back(p.name);
      info.parameter_shapes.push_back(p.full_view.sizes().vec());
      info.parameter_offsets.push_back(p.offset);
    }
    info.numel = unit->numel();
    info.shard_numel = unit->chunk();
    info.gathered = unit->state() != detail::FlatUnit::State::kSharded;
    info.gathers = unit->gathers();
    out.push_back(std::move(info));
  }
  return out;
}

int64_t FullyShardedDataParallel::held_bytes() const {
  int64_t bytes = run_->gathered_bytes();
  for (const auto& unit : run_->units()) {
    const at::Tensor& shard = unit->shard();
    bytes += static_cast<int64_t>(shard.storage().nbytes());
    if (shard.grad().defined()) bytes += static_cast<int64_t>(shard.grad().storage().nbytes());
    for (const detail::UnitParameter& p : unit->params()) {  // full gradients kept by no_sync
      if (p.param.grad().defined()) bytes += static_cast<int64_t>(p.param.grad().storage().nbytes());
    }
  }
  return bytes;
}

int64_t FullyShardedDataParallel::peak_gathered_bytes() const { return run_->peak_gathered_bytes(); }

int64_t FullyShardedDataParallel::peak_reduction_bytes() const { return run_->peak_reduction_bytes(); }

void FullyShardedDataParallel::track_root_output(const at::Tensor& output) { run_->track_output(0, output); }

void FullyShardedDataParallel::reset_peak_gathered_bytes() { run_->reset_peak(); }

void FullyShardedDataParallel::set_timeline(std::shared_ptr<Timeline> timeline) { run_->set_timeline(timeline); }

const ProcessGroup& FullyShardedDataParallel::process_group() const { return run_->process_group(); }

const FullyShardOptions& FullyShardedDataParallel::options() const { return run_->options(); }

}  // namespace ddp
