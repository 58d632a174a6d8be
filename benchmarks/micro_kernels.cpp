// Question: what does one call of each kernel cost, per size, on this machine? Google Benchmark micro
// timings of kernels::multi_tensor_scale_ against at::_foreach_mul_, for regression tracking between commits
// (the side-by-side ratio programs are bench_multi_tensor_scale and friends).
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <kernels/multi_tensor/multi_tensor_scale.h>

namespace {

std::vector<torch::Tensor> make_list(int64_t n_tensors, int64_t elements, torch::ScalarType dtype) {
  std::vector<torch::Tensor> list;
  for (int64_t i = 0; i < n_tensors; ++i) list.push_back(torch::randn({elements}).to(dtype));
  return list;
}

void BM_MultiTensorScale(benchmark::State& state) {
  auto list = make_list(state.range(0), state.range(1), torch::kFloat32);
  for (auto _ : state) kernels::multi_tensor_scale_(list, 1.0);
  state.SetBytesProcessed(state.iterations() * state.range(0) * state.range(1) * 2 * 4);
}

void BM_ForeachMul(benchmark::State& state) {
  auto list = make_list(state.range(0), state.range(1), torch::kFloat32);
  for (auto _ : state) at::_foreach_mul_(list, 1.0);
  state.SetBytesProcessed(state.iterations() * state.range(0) * state.range(1) * 2 * 4);
}

// {tensors, elements per tensor}: many tiny, a transformer-like middle, a few large.
#define LTA_SHAPES ->Args({1000, 256})->Args({200, 16384})->Args({4, 1 << 20})
BENCHMARK(BM_MultiTensorScale) LTA_SHAPES;
BENCHMARK(BM_ForeachMul) LTA_SHAPES;

}  // namespace

BENCHMARK_MAIN();
