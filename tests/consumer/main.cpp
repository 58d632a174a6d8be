// Links libtorch_amp::amp from an install tree and uses one piece of each layer.
#include <cstdio>
#include <vector>

#include <torch/torch.h>

#include <amp/autocast.h>
// Headers of every layer and feature folder, as installed: each must compile from an install tree on its own.
#include <amp/fp8/fp8_recipe.h>
#include <amp/io/archive_error.h>
#include <amp/io/atomic_file.h>
#include <amp/nn/float8_linear.h>
#include <amp/nn/fused_dense.h>
#include <amp/optim/fused_optimizers.h>
#include <amp/zero/zero.h>
#include <ddp/launch/launch_env.h>
#include <ddp/launch/spawn.h>
#include <kernels/cpu_threads.h>
#include <kernels/gemm/path_autotune.h>
#include <kernels/multi_tensor/l2_norm.h>
#include <kernels/multi_tensor/multi_tensor_scale.h>
#include <kernels/multi_tensor/unscale.h>
#include <kernels/optim/fused_optimizers.h>

int main() {
  std::vector<torch::Tensor> tensors = {torch::ones({5}), torch::ones({3}, torch::kHalf), torch::ones({0})};
  kernels::multi_tensor_scale_(tensors, 2.0);
  if (tensors[0].sum().item<double>() != 10.0 || tensors[1].sum().item<double>() != 6.0) return 1;
  {
    amp::AutocastScope scope(torch::kCPU, torch::kBFloat16);
    if (torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type() != torch::kBFloat16) return 2;
  }
  if (ddp::launched_by_launcher()) return 3;
  if (amp::FusedAdamOptions(1e-3).lr() != 1e-3) return 4;
  // The kernels' CPU loops spread over LibTorch's threads in a consumer's program too (the package links the OpenMP
  // runtime LibTorch loads): 4 chunks of 64 Ki elements on 2 threads.
  at::set_num_threads(2);
  std::vector<torch::Tensor> large = {torch::ones({4 * 65536})};
  kernels::multi_tensor_scale_(large, 0.5);
  if (kernels::last_cpu_loop_threads() != 2) return 5;
  std::printf("consumer: scaled %zu tensors, autocast scope ok, kernels on %d threads\n", tensors.size(),
              kernels::last_cpu_loop_threads());
  return 0;
}
