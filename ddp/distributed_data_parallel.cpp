#include <ddp/distributed_data_parallel.h>

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <ddp/progress.h>
#include <ddp/reducer/model_sync.h>
#include <ddp/reducer/reducer.h>

// The module wrapper: checks and broadcasts the model at construction and its buffers before each forward
// (ddp/reducer/model_sync.h), and hands every gradient to the reducer (ddp/reducer/reducer.h: buckets, hooks,
// launching, the end of backward; gradient sharding in ddp/reducer/gradient_sharding.h).

namespace ddp {
namespace {

void check_options(const DistributedDataParallelOptions& o) {
  TORCH_CHECK(o.bucket_cap_mb() > 0, "bucket_cap_mb must be > 0, got ", o.bucket_cap_mb());
  TORCH_CHECK(o.first_bucket_mb() > 0, "first_bucket_mb must be > 0, got ", o.first_bucket_mb());
  TORCH_CHECK(o.gradient_predivide_factor() > 0, "gradient_predivide_factor must be > 0, got ",
              o.gradient_predivide_factor());
  if (o.allreduce_dtype()) {
    const c10::ScalarType t = *o.allreduce_dtype();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble,
                "allreduce_dtype must be Float, Half, BFloat16 or Double, got ", t);
  }
}

}  // namespace

class DistributedDataParallel::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, ProcessGroup pg, Options options)
      : module_(checked(std::move(module), pg, options)),
        pg_(std::move(pg)),
        options_(std::move(options)),
        reducer_(trainable_parameters(*module_), pg_, options_) {}

  void before_forward() {
    if (at::GradMode::is_enabled()) ddp::detail::report_step();  // for the launcher's hang detection (no sync)
    reducer_.prepare_forward();
    if (options_.broadcast_buffers()) detail::broadcast_from_root(pg_, module_->buffers(/*recurse=*/true));
  }

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup pg_;
  Options options_;
  detail::Reducer reducer_;

 private:
  /// Checks the options and that every rank holds the same model, then starts every rank from rank 0's parameters
  /// and buffers: before the reducer registers its hooks.
  static std::shared_ptr<torch::nn::Module> checked(std::shared_ptr<torch::nn::Module> module, const ProcessGroup& pg,
                                                    const Options& options) {
    TORCH_CHECK(module, "DistributedDataParallel: module is null");
    check_options(options);
    detail::verify_same_model_on_all_ranks(pg, *module, options);
    detail::broadcast_from_root(pg, module->parameters(/*recurse=*/true));
    detail::broadcast_from_root(pg, module->buffers(/*recurse=*/true));
    return module;
  }

  static std::vector<std::pair<std::string, at::Tensor>> trainable_parameters(const torch::nn::Module& module) {
    std::vector<std::pair<std::string, at::Tensor>> params;
    for (const auto& p : module.named_parameters(/*recurse=*/true)) {
      if (p.value().requires_grad()) params.emplace_back(p.key(), p.value());
    }
    return params;
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 detail::ModuleForward forward, ProcessGroup process_group,
                                                 Options options)
    : forward_(std::move(forward)),
      impl_(std::make_unique<Impl>(std::move(module), std::move(process_group), std::move(options))) {}

DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::before_forward() { impl_->before_forward(); }

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp) {
  ddp_.impl_->reducer_.set_sync(false);
}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.impl_->reducer_.set_sync(true); }

void DistributedDataParallel::set_bucket_reduced_hook(std::function<void(const ReducedBucket&)> hook) {
  impl_->reducer_.bucket_reduced_hook = std::move(hook);
}

void DistributedDataParallel::set_bucket_consumer(std::function<bool(const ReducedBucket&)> consumer) {
  impl_->reducer_.bucket_consumer = std::move(consumer);
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return impl_->module_; }
const ProcessGroup& DistributedDataParallel::process_group() const { return impl_->pg_; }
const DistributedDataParallel::Options& DistributedDataParallel::options() const { return impl_->options_; }
std::vector<BucketInfo> DistributedDataParallel::buckets() const { return impl_->reducer_.bucket_infos(); }
std::vector<int64_t> DistributedDataParallel::gradient_order() const { return impl_->reducer_.gradient_order(); }
void DistributedDataParallel::restore_gradient_order(const std::vector<int64_t>& order) {
  impl_->reducer_.restore_gradient_order(order);
}
void DistributedDataParallel::freeze_bucket_layout() { impl_->reducer_.freeze_bucket_layout(); }
void DistributedDataParallel::set_gradient_sharding(bool enabled) { impl_->reducer_.set_gradient_sharding(enabled); }
bool DistributedDataParallel::gradient_sharding() const { return impl_->reducer_.gradient_sharding(); }
const BackwardTimeline& DistributedDataParallel::last_backward_timeline() const { return impl_->reducer_.timeline(); }
void DistributedDataParallel::set_timeline(std::shared_ptr<Timeline> timeline) {
  impl_->reducer_.set_recorder(std::move(timeline));
}
void DistributedDataParallel::set_bucket_consumer_label(std::string label) {
  impl_->reducer_.bucket_consumer_label = std::move(label);
}

}  // namespace ddp
