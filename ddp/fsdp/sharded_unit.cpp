#include <ddp/fsdp/sharded_unit.h>

#include <utility>

#include <c10/util/Exception.h>

#include <ddp/fsdp/sharded_run.h>
#include <ddp/wrapped_module.h>

namespace ddp {

ShardedUnitImpl::ShardedUnitImpl(std::shared_ptr<torch::nn::Module> module,
                                 std::function<torch::Tensor(const torch::Tensor&)> fn)
    : torch::nn::Module("ddp::ShardedUnit"), module_(std::move(module)), forward_(std::move(fn)) {
  TORCH_CHECK(module_, "ddp::ShardedUnit: no module given (an empty holder)");
  register_members_of(*this, *module_);  // the wrapper adds no level to the names
}

torch::Tensor ShardedUnitImpl::forward(const torch::Tensor& input) {
  if (!attached_) {  // no FullyShardedDataParallel over it: the block's own forward
    TORCH_CHECK(!detail::ShardedRun::forward_running(),
                "ddp::ShardedUnit: a unit ran in FullyShardedDataParallel::forward, but the FullyShardedDataParallel "
                "did not find it in the model (a wrapper that registers the members of what it wraps, not the module "
                "itself, hides it: amp::Checkpointed around a unit?); put such wrappers inside the unit, "
                "ddp::ShardedUnit(amp::Checkpointed(block))");
    return forward_(input);
  }
  const std::shared_ptr<detail::ShardedRun> run = run_.lock();
  TORCH_CHECK(run,
              "ddp::ShardedUnit: its FullyShardedDataParallel was destroyed and left its parameters sharded; "
              "keep it alive while the model runs");
  return run->run_unit(index_, forward_, input);
}

void ShardedUnitImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void ShardedUnitImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::ShardedUnit(";
  module_->pretty_print(stream);
  stream << ")";
}

}  // namespace ddp
