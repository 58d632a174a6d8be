#include <amp/state/model_cast.h>

#include <ddp/sync_batch_norm.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/normalization.h>

namespace amp {

bool is_batch_norm(const torch::nn::Module& module) {
  return module.as<torch::nn::BatchNorm1d>() != nullptr || module.as<torch::nn::BatchNorm2d>() != nullptr ||
         module.as<torch::nn::BatchNorm3d>() != nullptr || module.as<ddp::SyncBatchNorm>() != nullptr;
}

bool is_layer_or_group_norm(const torch::nn::Module& module) {
  return module.as<torch::nn::LayerNorm>() != nullptr || module.as<torch::nn::GroupNorm>() != nullptr;
}

std::vector<std::shared_ptr<torch::nn::Module>> layer_and_group_norms(torch::nn::Module& module) {
  std::vector<std::shared_ptr<torch::nn::Module>> norms;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (is_layer_or_group_norm(*m)) norms.push_back(m);
  }
  return norms;
}

KeptNormCast::KeptNormCast(const std::vector<std::shared_ptr<torch::nn::Module>>& norms, c10::ScalarType dtype) {
  auto replace = [&](at::Tensor& member) {
    if (!member.defined() || member.scalar_type() == dtype) return;
    saved_.push_back({&member, member});
    member = member.to(dtype);  // differentiable: backward hands the parameter an fp32 gradient
  };
  try {
    for (const auto& norm : norms) {
      if (auto* ln = norm->as<torch::nn::LayerNorm>()) {
        replace(ln->weight);
        replace(ln->bias);
      } else if (auto* gn = norm->as<torch::nn::GroupNorm>()) {
        replace(gn->weight);
        replace(gn->bias);
      }
    }
  } catch (...) {
    for (auto& s : saved_) *s.member = s.original;
    throw;
  }
}

KeptNormCast::~KeptNormCast() {
  for (auto& s : saved_) *s.member = std::move(s.original);
}

void cast_model_(torch::nn::Module& module, c10::ScalarType dtype, bool keep_batchnorm_fp32, bool keep_layernorm_fp32) {
  if ((keep_batchnorm_fp32 && is_batch_norm(module)) || (keep_layernorm_fp32 && is_layer_or_group_norm(module))) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(/*recurse=*/false)) {
    if (p.value().is_floating_point()) p.value().set_data(p.value().data().to(dtype));
  }
  for (auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().is_floating_point()) b.value().set_data(b.value().data().to(dtype));
  }
  for (auto& child : module.children()) cast_model_(*child, dtype, keep_batchnorm_fp32, keep_layernorm_fp32);
}

}  // namespace amp
