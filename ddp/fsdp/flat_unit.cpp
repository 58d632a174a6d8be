#include <ddp/fsdp/flat_unit.h>

#include <algorithm>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace ddp::detail {
namespace {

/// Frees `t`'s storage in place: the StorageImpl stays (every view of it, autograd's saved ones included, keeps
/// pointing at it) and holds no memory until refilled.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

/// Gives `t`'s storage `nbytes` of fresh memory from its own allocator (the caching allocator on CUDA).
void allocate_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace

FlatUnit::FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params, ProcessGroup pg,
                   std::optional<c10::ScalarType> param_dtype, std::optional<c10::ScalarType> reduce_dtype)
    : name_(std::move(name)), pg_(std::move(pg)) {
  at::NoGradGuard no_grad;
  for (auto& [param_name, tensor] : params) {
    tensor.mutable_grad().reset();  // a gradient from before sharding would join the first reduction
    UnitParameter p;
    p.name = param_name;
    p.param = tensor;
    p.offset = (numel_ + kParameterAlignment - 1) / kParameterAlignment * kParameterAlignment;
    numel_ = p.offset + tensor.numel();
    params_.push_back(std::move(p));
  }
  // The shard keeps the parameters' dtype (the values the optimizer steps); the flat buffer, the gathered
  // parameters and their gradients take param_dtype.
  const at::TensorOptions shard_options =
      params_.empty() ? at::TensorOptions(at::kFloat) : params_.front().param.options().requires_grad(false);
  const at::TensorOptions options =
      shard_options.dtype(param_dtype.value_or(c10::typeMetaToScalarType(shard_options.dtype())));
  requires_grad_ = !params_.empty() && params_.front().param.requires_grad();
  reduce_dtype_ = reduce_dtype.value_or(c10::typeMetaToScalarType(options.dtype()));
  const int world = pg_.size();
  chunk_ = numel_ == 0 ? 0 : (numel_ + world - 1) / world;
  chunk_ = (chunk_ + kParameterAlignment - 1) / kParameterAlignment * kParameterAlignment;
  at::Tensor values = at::zeros({chunk_ * world}, shard_options);
  for (const UnitParameter& p : params_) values.narrow(0, p.offset, p.param.numel()).copy_(p.param.reshape({-1}));
  shard_ = values.narrow(0, pg_.rank() * chunk_, chunk_).clone().set_requires_grad(requires_grad_);
  full_ = values.to(options.dtype());  // the same storage when the dtypes agree
  for (UnitParameter& p : params_) {
    p.full_view = at::empty({0}, options).set_(full_.storage(), p.offset, p.param.sizes(), {});
    p.empty = at::empty({0}, options);
  }
  point_params_at(/*full=*/true);  // the old storages go: the flat buffer holds the values now
  state_ = State::kGathered;
}

FlatUnit::~FlatUnit() { reset_pass(); }

std::string FlatUnit::label() const { return name_.empty() ? "the root" : "unit '" + name_ + "'"; }

int64_t FlatUnit::gathered_bytes() const {
  return state_ == State::kSharded ? 0 : static_cast<int64_t>(full_.storage().nbytes());
}

void FlatUnit::point_params_at(bool full) {
  for (UnitParameter& p : params_) p.param.set_data(full ? p.full_view : p.empty);
}

void FlatUnit::start_gather() {
  if (state_ != State::kSharded) return;
  allocate_storage(full_, static_cast<size_t>(full_.numel()) * full_.element_size());
  state_ = State::kGathering;
  ++gathers_;
  if (chunk_ == 0) return;
  // Cast into a buffer of its own when param_dtype differs (kept until the gather ends), else the shard itself.
  gather_input_ = shard_.scalar_type() == full_.scalar_type() ? shard_.detach() : shard_.detach().to(full_.dtype());
  gather_ = pg_.allgather_into_async(full_, gather_input_);
  gather_issued_ = issued(gather_);
}

FlatUnit::Issued FlatUnit::issued(const c10::intrusive_ptr<c10d::Work>& work) const {
  Issued record;
  if (!recorder_ || !recorder_->recording()) return record;
  record.timeline = recorder_;
  record.at = Timeline::Clock::now();
  if (pg_.backend_name() == "gloo") record.completed = CompletionTime::watch(work);
  return record;
}

void FlatUnit::wait_for(c10::intrusive_ptr<c10d::Work>& slot, Issued& record, const char* collective,
                        const std::string& what, Timeline::Clock::time_point began) {
  auto work = std::move(slot);
  pg_.wait(work, what);
  const Issued issued = std::move(record);
  record = Issued{};
  if (!issued.timeline) return;
  const auto now = Timeline::Clock::now();
  // (It completed before the wait returned, whichever thread's clock read later.)
  const auto end = issued.completed ? std::min(issued.completed->at_or(now), now) : now;
  issued.timeline->add(c10::str(collective, " ", label()), "comm", issued.at, std::max(end, issued.at));
  issued.timeline->add(c10::str("wait ", collective, " ", label()), "wait", began, now);
}

void FlatUnit::wait_gathered() {
  if (state_ == State::kGathered) return;
  // The wait begins before a gather not yet started is issued: such a gather is waited for throughout.
  const auto began = Timeline::Clock::now();
  start_gather();
  if (gather_) wait_for(gather_, gather_issued_, "all-gather", "all-gather of " + label() + "'s parameters", began);
  gather_input_.reset();
  point_params_at(/*full=*/true);
  state_ = State::kGathered;
}

void FlatUnit::reshard() {
  if (state_ == State::kSharded) return;
  if (gather_) {  // the collective writes into the buffer: it must end first
    wait_for(gather_, gather_issued_, "all-gather", "all-gather of " + label() + "'s parameters",
             Timeline::Clock::now());
  }
  gather_input_.reset();
  point_params_at(/*full=*/false);
  free_storage(full_);
  state_ = State::kSharded;
}

bool FlatUnit::note_grad_ready(size_t i) {
  UnitParameter& p = params_[i];
  if (!p.grad_ready) {
    p.grad_ready = true;
    ++ready_;
  }
  return all_grads_ready();
}

void FlatUnit::launch_reduction() {
  TORCH_CHECK(!reduction_launched(), "FullyShardedDataParallel: ", label(), " reduced twice in one backward pass");
  at::NoGradGuard no_grad;
  const int world = pg_.size();
  reduction_ = at::zeros({chunk_ * world}, full_.options().dtype(reduce_dtype_));
  for (UnitParameter& p : params_) {
    at::Tensor& grad = p.param.mutable_grad();
    if (grad.defined()) {
      reduction_.narrow(0, p.offset, grad.numel()).copy_(grad.reshape({-1}));
      grad.reset();  // the full gradient goes as soon as it is in the buffer
    }
  }
  if (chunk_ == 0) return;
  if (pg_.backend_name() == "gloo") {
    // Gloo's reduce-scatter is an allreduce of the whole input and a slice of it (PyTorch #118911): the same bytes
    // on the wire, without the extra output buffer (ddp/reducer/gradient_sharding.h does the same).
    reduce_ = pg_.allreduce_sum_async(reduction_);
  } else {
    received_ = at::empty({chunk_}, reduction_.options());
    reduce_ = pg_.reduce_scatter_sum_async(received_, reduction_);
  }
  reduce_issued_ = issued(reduce_);
}

void FlatUnit::finish_reduction() {
  if (!reduction_launched()) return;
  at::NoGradGuard no_grad;
  if (reduce_) {
    wait_for(reduce_, reduce_issued_, "reduce-scatter", "reduce-scatter of " + label() + "'s gradients",
             Timeline::Clock::now());
  }
  const at::Tensor sum = received_.defined() ? received_ : reduction_.narrow(0, pg_.rank() * chunk_, chunk_);
  at::Tensor average = sum.mul(1.0 / static_cast<double>(pg_.size())).to(shard_.scalar_type());
  at::Tensor& grad = shard_.mutable_grad();
  if (grad.defined()) {
    grad.add_(average);
  } else {
    grad = average;
  }
  reduction_.reset();
  received_.reset();
}

void FlatUnit::reset_pass() noexcept {
  for (UnitParameter& p : params_) p.grad_ready = false;
  ready_ = 0;
  if (reduce_) {
    try {
      pg_.wait(reduce_, "reduce-scatter of " + label() + "'s gradients");  // bounded by the collective timeout
    } catch (...) {  // the pass failed already; its error is the one reported
    }
    reduce_.reset();
  }
  reduce_issued_ = Issued{};
  reduction_.reset();
  received_.reset();
}

void FlatUnit::drop_full_grads() noexcept {
  for (UnitParameter& p : params_) p.param.mutable_grad().reset();
}

int64_t FlatUnit::reduction_bytes() const {
  int64_t bytes = 0;
  if (reduction_.defined()) bytes += static_cast<int64_t>(reduction_.storage().nbytes());
  if (received_.defined()) bytes += static_cast<int64_t>(received_.storage().nbytes());
  return bytes;
}

at::Tensor FlatUnit::gather_flat() const {
  at::NoGradGuard no_grad;
  // The shards themselves, in their own dtype (not the gathered param_dtype copy): the values the optimizer stepped.
  at::Tensor flat = at::empty({chunk_ * pg_.size()}, shard_.options().requires_grad(false));
  if (chunk_ == 0) return flat;
  at::Tensor input = shard_.detach();
  auto work = pg_.allgather_into_async(flat, input);
  pg_.wait(work, "all-gather of " + label() + "'s shards");
  return flat;
}

}  // namespace ddp::detail
