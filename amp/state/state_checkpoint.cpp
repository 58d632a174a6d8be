// amp::detail::State, checkpoints: amp's own state (options, scalers) and the model's fp32 values.

#include <amp/state/state.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <amp/fp8/fp8_state.h>

namespace amp::detail {

void State::save(torch::serialize::OutputArchive& archive) const {
  losses_.save(archive);
  const std::string text = options_.to_string();
  if (fp8_ != nullptr) fp8_->save(archive);
  archive.write(
      "options_text",
      at::tensor(c10::ArrayRef<uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()), at::kByte));
}

void State::validate_amp_state(torch::serialize::InputArchive& archive) {
  at::Tensor text;
  TORCH_CHECK(archive.try_read("options_text", text), "amp checkpoint is missing its options");
  const std::string saved(reinterpret_cast<const char*>(text.data_ptr<uint8_t>()), text.numel());
  const std::string current = options_.to_string();
  if (saved != current) {
    // Name the first setting that differs ("key=value" words), then both lines whole.
    std::istringstream saved_words(saved), current_words(current);
    std::string a, b, differs;
    while (saved_words >> a) {
      if (!(current_words >> b)) b.clear();
      if (a != b) {
        differs = a + " in the checkpoint, " + (b.empty() ? std::string("nothing") : b) + " here";
        break;
      }
    }
    if (differs.empty()) differs = "the current options have more settings";
    TORCH_CHECK(false, "amp checkpoint was saved with other options (", differs, "; saved: ", saved,
                "; current: ", current, "): restore with the same amp::Options");
  }
  losses_.validate(archive);
  if (fp8_ != nullptr) fp8_->validate(archive);
}

void State::load(torch::serialize::InputArchive& archive) {
  validate_amp_state(archive);
  losses_.load(archive);  // also restarts the overflow log's step bookkeeping from the loaded steps
  if (fp8_ != nullptr) fp8_->load(archive);
  // What this state derived from the old scaler state: the current step's overflow flag.
  progress_.found_inf.zero_();
  progress_.unscaled = false;
}

void State::save_model(torch::serialize::OutputArchive& archive) const {
  if (fsdp_ != nullptr) return save_fully_sharded_model(archive);
  owner_->wait_for_parameters();  // Note [deferred publish]: the model as step() left it
  // Every slot's fp32 value: its master (ZeRO: every rank's shard gathered, a collective) or its fp32 parameter.
  const std::vector<at::Tensor> masters = owner_->full_masters();
  for (const auto& p : module_->named_parameters(true)) {
    const int64_t slot = slots_.index_of(p.value());
    const at::Tensor& value = slot < 0 ? p.value() : masters[static_cast<size_t>(slot)];
    archive.write(p.key(), value.detach().to(at::kFloat).cpu());
  }
  for (const auto& b : module_->named_buffers(true)) {
    const at::Tensor& v = b.value();
    archive.write(b.key(), (v.is_floating_point() ? v.to(at::kFloat) : v).cpu(), /*is_buffer=*/true);
  }
}

void State::load_model(torch::serialize::InputArchive& archive) {
  auto assignments = prepare_model_load(archive);
  at::NoGradGuard no_grad;
  for (auto& [dest, value] : assignments) dest.copy_(value);
}

std::vector<std::pair<at::Tensor, at::Tensor>> State::prepare_model_load(torch::serialize::InputArchive& archive) {
  if (fsdp_ != nullptr) return prepare_fully_sharded_model_load(archive);
  // Note [deferred publish]: a pending all-gather reads the send buffers and would overwrite the loaded parameters.
  wait_for_parameters();
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (destination, fp32 value)
  auto read = [&](const std::string& key, const at::Tensor& dest, bool is_buffer) {
    at::Tensor value;
    TORCH_CHECK(archive.try_read(key, value, is_buffer), "model checkpoint has no '", key, "'");
    TORCH_CHECK(value.sizes() == dest.sizes(), "model checkpoint has '", key, "' with shape ", value.sizes(),
                " but the model's is ", dest.sizes());
    return value;
  };
  std::vector<at::Tensor> slot_values(slots_.size());  // each slot's value, for the masters the owner keeps
  for (const auto& p : module_->named_parameters(true)) {
    at::Tensor value = read(p.key(), p.value(), false);
    assignments.emplace_back(p.value(), value);
    const int64_t slot = slots_.index_of(p.value());
    if (slot >= 0) slot_values[static_cast<size_t>(slot)] = value.to(at::kFloat);
  }
  for (const auto& b : module_->named_buffers(true))
    assignments.emplace_back(b.value(), read(b.key(), b.value(), true));
  owner_->master_copies(slot_values, assignments);  // the masters (ZeRO: this rank's shard), from the same values
  return assignments;
}

}  // namespace amp::detail
