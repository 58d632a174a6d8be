// The CPU kernels' threads (issue 44): every at::parallel_for of the kernels really spreads over LibTorch's
// threads (the kernels are compiled with OpenMP, as LibTorch is), at::set_num_threads and OMP_NUM_THREADS govern
// them, the process keeps one OpenMP runtime, and every kernel gives the same bits on 1, 2 and 3 threads.
#include <kernels/batch_norm.h>
#include <kernels/cpu_threads.h>
#include <kernels/gemm/fp8.h>
#include <kernels/multi_tensor/axpby.h>
#include <kernels/multi_tensor/l2_norm.h>
#include <kernels/multi_tensor/multi_tensor_scale.h>
#include <kernels/multi_tensor/scaled_copy.h>
#include <kernels/multi_tensor/unscale.h>
#include <kernels/optim/fused_optimizers.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using TensorVector = std::vector<torch::Tensor>;

// Several 64 Ki-element chunks per tensor (so loops split inside tensors as well as between them), vector-loop
// tails, and 16 chunks in all (6 + 1 + 3 + 1 + 5): at 2 and 3 threads every thread gets a part.
const std::vector<int64_t> kSizes = {5 * 65536 + 7, 17, 3 * 65536, 1000, 4 * 65536 + 1};

/// The 64 Ki-element chunks the kernels cut kSizes into (kernels/cpu/chunks.h): 16.
int64_t chunks_of_the_lists() {
  int64_t chunks = 0;
  for (int64_t n : kSizes) chunks += (n + 65535) / 65536;
  return chunks;
}

/// How many parts ATen's OpenMP at::parallel_for (ATen/ParallelOpenMP.h) makes of `n` items of grain 1 on `threads`
/// threads: parts of ceil(n / threads) items, a thread whose part would start past the end running none. So 16
/// chunks make 16 / ceil(16 / T) parts, rounded up: T for T <= 4, but 4 at T = 5 and 8 at T = 9 to 15.
int64_t parts_of(int64_t n, int64_t threads) {
  const int64_t per_part = (n + threads - 1) / threads;
  return (n + per_part - 1) / per_part;
}

/// The same values on every call: the cases below rebuild their inputs for each thread count.
TensorVector make_list(torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  TensorVector list;
  for (int64_t n : kSizes) list.push_back((torch::randn({n}, torch::kDouble) * 3).to(dtype));
  return list;
}

TensorVector clones(const TensorVector& list) {
  TensorVector out;
  for (const auto& t : list) out.push_back(t.clone());
  return out;
}

/// What a fused optimizer step keeps beside the parameters: fp32 masters (when asked for) and step counts.
struct StepState {
  TensorVector masters;
  TensorVector steps;
};

StepState step_state(const TensorVector& params, bool masters, float step) {
  StepState state;
  for (const auto& p : params) {
    if (masters) state.masters.push_back(p.to(torch::kFloat));
    state.steps.push_back(torch::full({1}, step));
  }
  return state;
}

/// params followed by every list of `lists`, in order: all a step wrote.
TensorVector concat(TensorVector params, std::initializer_list<const TensorVector*> lists) {
  for (const TensorVector* list : lists) params.insert(params.end(), list->begin(), list->end());
  return params;
}

/// One kernel run from fresh inputs: what it wrote and returned.
struct Case {
  std::string name;
  std::function<TensorVector()> run;
};

torch::Tensor scalar(float v) { return torch::full({1}, v, torch::kFloat); }

torch::Tensor batch_norm_input(torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  return (torch::randn({8, 6, 64, 64}, torch::kDouble) * 2 + 1).to(dtype);
}

/// With a NaN-free spread over several FP8 binades, and values past the largest E4M3 (saturated).
torch::Tensor fp8_input(torch::ScalarType dtype) {
  torch::manual_seed(17);
  return (torch::randn({1000, 300}, torch::kDouble) * 100).to(dtype);
}

std::vector<Case> every_kernel() {
  std::vector<Case> cases;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    const std::string d = c10::toString(dtype);
    cases.push_back({"multi_tensor_scale " + d, [dtype] {
                       TensorVector list = make_list(dtype, 1);
                       kernels::multi_tensor_scale_(list, 0.37);
                       return list;
                     }});
    cases.push_back({"unscale_and_check " + d, [dtype] {
                       TensorVector list = make_list(dtype, 2);
                       // Non-finite values in two tensors, chunks apart: found_inf and the first index are
                       // reductions over chunks.
                       list[4][3 * 65536 + 5] = std::numeric_limits<float>::infinity();
                       list[2][2 * 65536 + 1] = std::numeric_limits<float>::quiet_NaN();
                       torch::Tensor found_inf = torch::zeros({1}, torch::kFloat);
                       torch::Tensor first = torch::full({1}, std::numeric_limits<int32_t>::max(), torch::kInt);
                       kernels::unscale_and_check_(list, scalar(1.0f / 3.0f), found_inf, first);
                       list.push_back(found_inf);
                       list.push_back(first);
                       return list;
                     }});
    cases.push_back({"l2_norm " + d, [dtype] {
                       const TensorVector list = make_list(dtype, 3);
                       const kernels::L2NormResult norms = kernels::l2_norm(list, true, scalar(0.25f));
                       return TensorVector{norms.total, norms.per_tensor};
                     }});
    cases.push_back({"clip_grad_norm " + d, [dtype] {
                       TensorVector list = make_list(dtype, 4);
                       torch::Tensor total = kernels::clip_grad_norm_(list, 1.0);
                       list.push_back(total);
                       return list;
                     }});
    cases.push_back({"scaled_copy " + d + " to fp32, checked", [dtype] {
                       const TensorVector src = make_list(dtype, 5);
                       TensorVector dst;
                       for (const auto& s : src) dst.push_back(torch::empty(s.sizes(), torch::kFloat));
                       src[3][7] = -std::numeric_limits<float>::infinity();
                       torch::Tensor found_inf = torch::zeros({1}, torch::kFloat);
                       torch::Tensor first = torch::full({1}, std::numeric_limits<int32_t>::max(), torch::kInt);
                       kernels::scaled_copy_(src, dst, 1.0 / 1024, found_inf, first);
                       dst.push_back(found_inf);
                       dst.push_back(first);
                       return dst;
                     }});
    cases.push_back({"axpby " + d, [dtype] {
                       const TensorVector x = make_list(dtype, 6);
                       const TensorVector y = make_list(torch::kFloat, 7);
                       TensorVector out;
                       for (const auto& t : x) out.push_back(torch::empty(t.sizes(), dtype));
                       torch::Tensor found_inf = torch::zeros({1}, torch::kFloat);
                       kernels::axpby_(out, x, y, 0.3, 1.7, found_inf);
                       out.push_back(found_inf);
                       return out;
                     }});
    for (const bool masters : {false, true}) {
      if (masters && dtype == torch::kFloat) continue;
      const std::string m = masters ? ", fp32 masters" : "";
      // AdamW, and Adam (L2 weight decay) with amsgrad.
      for (const bool adamw : {true, false}) {
        const bool amsgrad = !adamw;
        cases.push_back(
            {std::string(adamw ? "fused AdamW " : "fused Adam amsgrad ") + d + m, [dtype, masters, adamw, amsgrad] {
               TensorVector params = make_list(dtype, 8);
               const TensorVector grads = make_list(dtype, 9);
               TensorVector exp_avgs = make_list(torch::kFloat, 10);
               TensorVector exp_avg_sqs;
               for (const auto& t : make_list(torch::kFloat, 11)) exp_avg_sqs.push_back(t.abs());
               TensorVector max_sqs = amsgrad ? clones(exp_avg_sqs) : TensorVector{};
               StepState state = step_state(params, masters, 3.0f);
               kernels::fused_adam_step_(
                   params, grads, exp_avgs, exp_avg_sqs, max_sqs, state.masters, state.steps, scalar(1e-2f),
                   kernels::AdamStepOptions().weight_decay(0.01).decoupled_weight_decay(adamw).amsgrad(amsgrad),
                   scalar(0.5f));
               return concat(params, {&exp_avgs, &exp_avg_sqs, &max_sqs, &state.masters, &state.steps});
             }});
      }
      cases.push_back({"fused SGD momentum nesterov " + d + m, [dtype, masters] {
                         TensorVector params = make_list(dtype, 12);
                         const TensorVector grads = make_list(dtype, 13);
                         TensorVector buffers = make_list(torch::kFloat, 14);
                         StepState state = step_state(params, masters, 2.0f);
                         kernels::fused_sgd_step_(
                             params, grads, buffers, state.masters, state.steps, scalar(0.05f),
                             kernels::SgdStepOptions().momentum(0.9).nesterov(true).weight_decay(1e-4));
                         return concat(params, {&buffers, &state.masters, &state.steps});
                       }});
    }
    // SyncBatchNorm's CPU passes, each a case of its own (the thread check sees a case's last loop): statistics
    // and gradient sums per channel, the elementwise passes per (sample, channel) run. 6 channels, 8 samples,
    // 64 x 64 inner: every pass splits at 2 and 3 threads.
    cases.push_back({"batch norm stats " + d, [dtype] {
                       auto [mean, var] = kernels::batch_norm_stats_cpu(batch_norm_input(dtype, 15));
                       return TensorVector{mean, var};
                     }});
    cases.push_back({"batch norm grad sums " + d, [dtype] {
                       const torch::Tensor mean = torch::linspace(0.5, 1.5, 6, torch::kFloat);
                       auto [sum_dy, sum_dy_xmu] = kernels::batch_norm_grad_sums_cpu(batch_norm_input(dtype, 16),
                                                                                     batch_norm_input(dtype, 15), mean);
                       return TensorVector{sum_dy, sum_dy_xmu};
                     }});
    cases.push_back({"batch norm normalize " + d, [dtype] {
                       const torch::Tensor mean = torch::linspace(0.5, 1.5, 6, torch::kFloat);
                       const torch::Tensor scale = torch::linspace(0.3, 0.7, 6, torch::kFloat);
                       const torch::Tensor shift = torch::linspace(-1, 1, 6, torch::kFloat);
                       return TensorVector{
                           kernels::batch_norm_normalize_cpu(batch_norm_input(dtype, 15), mean, scale, shift)};
                     }});
    cases.push_back({"batch norm input grad " + d, [dtype] {
                       const torch::Tensor mean = torch::linspace(0.5, 1.5, 6, torch::kFloat);
                       const torch::Tensor mean_dy = torch::linspace(-0.1, 0.1, 6, torch::kFloat);
                       const torch::Tensor k = torch::linspace(0.01, 0.02, 6, torch::kFloat);
                       const torch::Tensor scale = torch::linspace(0.3, 0.7, 6, torch::kFloat);
                       return TensorVector{kernels::batch_norm_input_grad_cpu(
                           batch_norm_input(dtype, 16), batch_norm_input(dtype, 15), mean, mean_dy, k, scale)};
                     }});
    // FP8 casts: the amax is a reduction over the threads' parts. 1000 x 300: both casts split at 2 and 3 threads.
    for (auto fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      const std::string f = c10::toString(fp8);
      cases.push_back({"fp8 quantize " + d + " to " + f, [dtype, fp8] {
                         torch::Tensor amax = torch::zeros({1}, torch::kFloat);
                         const torch::Tensor q = kernels::fp8_quantize(fp8_input(dtype), scalar(2.0f), fp8, amax);
                         return TensorVector{q, amax};
                       }});
      cases.push_back({"fp8 cast-transpose " + d + " to " + f, [dtype, fp8] {
                         torch::Tensor amax = torch::zeros({1}, torch::kFloat);
                         const kernels::Fp8Cast cast =
                             kernels::fp8_cast_transpose(fp8_input(dtype), scalar(0.5f), fp8, amax, 1008, true, true);
                         return TensorVector{cast.q, cast.qt, amax};
                       }});
    }
  }
  return cases;
}

/// Empty when a and b hold the same bits (NaNs compare by their bits), else where and how they differ.
std::string bit_difference(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return "shapes or dtypes differ";
  const auto bits = [](const torch::Tensor& t) {
    const torch::Tensor c = t.contiguous().flatten();
    switch (c.element_size()) {
      case 1:
        return c.view(torch::kUInt8).to(torch::kInt);
      case 2:
        return c.view(torch::kShort).to(torch::kInt);
      default:
        return c.view(torch::kInt);
    }
  };
  const torch::Tensor differs = bits(a).ne(bits(b));
  const int64_t count = differs.sum().item<int64_t>();
  if (count == 0) return "";
  const int64_t first = differs.nonzero()[0][0].item<int64_t>();
  return std::to_string(count) + " of " + std::to_string(a.numel()) + " elements differ, the first at " +
         std::to_string(first) + " (" + std::to_string(a.flatten()[first].item<double>()) + " vs " +
         std::to_string(b.flatten()[first].item<double>()) + ")";
}

/// Restores the calling thread's ATen thread count after each test.
class CpuThreadsTest : public ::testing::Test {
 protected:
  void TearDown() override { at::set_num_threads(threads_before_); }

 private:
  int threads_before_ = at::get_num_threads();
};

// Issue 44's fix: without OpenMP in the kernels' translation units, at::parallel_for ran every loop on the calling
// thread and this saw 1 thread for every kernel.
TEST_F(CpuThreadsTest, EveryKernelsChunksRunOnTwoThreadsWhenAtenHasTwo) {
  at::set_num_threads(2);
  for (const Case& c : every_kernel()) {
    c.run();
    EXPECT_EQ(kernels::last_cpu_loop_threads(), 2) << c.name;
  }
}

TEST_F(CpuThreadsTest, SetNumThreadsGovernsTheKernels) {
  const Case scale = every_kernel().front();
  for (int threads : {1, 3, 2}) {
    at::set_num_threads(threads);
    scale.run();
    EXPECT_EQ(kernels::last_cpu_loop_threads(), threads) << "at::set_num_threads(" << threads << ")";
    EXPECT_EQ(parts_of(chunks_of_the_lists(), threads), threads);  // 16 chunks: every thread gets a part
  }
}

// Also run as tests of their own with OMP_NUM_THREADS=1 and =2 (tests/CMakeLists.txt): the kernels start with the
// thread count ATen starts with, and OMP_NUM_THREADS sets that (ATen may use fewer: with MKL it caps the count at
// the cores MKL sees, so OMP_NUM_THREADS=3 gives 2 threads on a 2-core machine, for ATen's ops and ours alike).
// Before issue 44 the kernels ran 1 part whatever ATen's count.
TEST_F(CpuThreadsTest, TheKernelsStartWithAtensThreadCount) {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    EXPECT_LE(at::get_num_threads(), std::atoi(env)) << "OMP_NUM_THREADS=" << env;
  }
  every_kernel().front().run();
  EXPECT_EQ(kernels::last_cpu_loop_threads(), parts_of(chunks_of_the_lists(), at::get_num_threads()))
      << "at::get_num_threads() = " << at::get_num_threads();
}

TEST_F(CpuThreadsTest, EveryKernelGivesTheSameBitsOnOneTwoAndThreeThreads) {
  for (const Case& c : every_kernel()) {
    at::set_num_threads(1);
    const TensorVector one = c.run();
    for (int threads : {2, 3}) {
      at::set_num_threads(threads);
      const TensorVector many = c.run();
      ASSERT_EQ(many.size(), one.size()) << c.name;
      for (size_t i = 0; i < one.size(); ++i) {
        EXPECT_EQ(bit_difference(many[i], one[i]), "")
            << c.name << ": output " << i << " differs between 1 and " << threads << " threads";
      }
    }
  }
}

/// The distinct OpenMP runtime files mapped into this process (GNU libgomp, LLVM libomp, Intel libiomp5).
std::set<std::string> openmp_runtimes_mapped() {
  std::ifstream maps("/proc/self/maps");
  const std::regex runtime(R"(/lib(g|i)?omp[^/]*\.so[^/]*$)");
  std::set<std::string> found;
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    std::error_code error;
    const auto canonical = std::filesystem::canonical(path, error);  // a "(deleted)" mapping has no file
    if (std::regex_search(path, runtime)) found.insert(error ? path : canonical.string());
  }
  return found;
}

/// The folder of the mapped libtorch_cpu.so.
std::filesystem::path torch_lib_folder() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash != std::string::npos && line.find("/libtorch_cpu.so") != std::string::npos) {
      return std::filesystem::canonical(line.substr(slash)).parent_path();
    }
  }
  return {};
}

// Linking the compiler's runtime next to LibTorch's would give the process two thread pools that do not know of
// each other (oversubscription, and at::set_num_threads reaching only one).
TEST_F(CpuThreadsTest, TheProcessHasOneOpenMpRuntimeLibTorchsOwn) {
  at::set_num_threads(2);
  every_kernel().front().run();
  ASSERT_EQ(kernels::last_cpu_loop_threads(), 2);
  const std::set<std::string> runtimes = openmp_runtimes_mapped();
  ASSERT_EQ(runtimes.size(), 1u) << "OpenMP runtimes mapped: " << ::testing::PrintToString(runtimes);
  // Where LibTorch ships its runtime (the pip wheel's torch/lib/libgomp.so.1), it is that one.
  const std::filesystem::path torch_lib = torch_lib_folder();
  ASSERT_FALSE(torch_lib.empty()) << "libtorch_cpu.so is not mapped";
  bool ships_one = false;
  for (const auto& entry : std::filesystem::directory_iterator(torch_lib)) {
    ships_one |= std::regex_search(entry.path().string(), std::regex(R"(/lib(g|i)?omp[^/]*\.so)"));
  }
  if (ships_one) {
    EXPECT_EQ(std::filesystem::path(*runtimes.begin()).parent_path(), torch_lib);
  }
}

}  // namespace
