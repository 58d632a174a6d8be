#include <kernels/gemm/path_autotune.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <kernels/cuda/check.h>
#endif

namespace kernels {
namespace {

// Timed runs per path after one warm-up: enough to pick a winner once per shape without making the first step
// of training noticeably slower.
constexpr int kRounds = 3;

struct ChoiceCache {
  std::mutex mutex;
  std::map<PathKey, PathChoice> choices;
  int64_t measurements = 0;
};

ChoiceCache& choice_cache() {
  static ChoiceCache cache;
  return cache;
}

#ifdef LIBTORCH_AMP_WITH_CUDA
double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// RAII pair of CUDA events timing one run on a stream.
class EventTimer {
 public:
  EventTimer() {
    LTA_CUDA_CHECK(cudaEventCreate(&start_));
    LTA_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  double milliseconds(cudaStream_t stream, const std::function<void()>& work) {
    LTA_CUDA_CHECK(cudaEventRecord(start_, stream));
    work();
    LTA_CUDA_CHECK(cudaEventRecord(stop_, stream));
    LTA_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    LTA_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

PathChoice measure(const c10::Device& device, const std::function<void(GemmPath)>& run) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const GemmPath paths[] = {GemmPath::kCublasLt, GemmPath::kAten};
  for (GemmPath path : paths) run(path);
  std::vector<double> times[2];
  EventTimer timer;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < 2; ++i) times[i].push_back(timer.milliseconds(stream, [&] { run(paths[i]); }));
  }
  PathChoice choice;
  choice.cublaslt_ms = median(times[0]);
  choice.aten_ms = median(times[1]);
  choice.path = choice.cublaslt_ms <= choice.aten_ms ? GemmPath::kCublasLt : GemmPath::kAten;
  return choice;
}

bool capturing(const c10::Device& device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LTA_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}
#endif

}  // namespace

PathChoice autotuned_path(const PathKey& key, const c10::Device& device, const std::function<void(GemmPath)>& run) {
  if (!device.is_cuda()) return PathChoice{};
  if (auto cached = cached_path(key)) return *cached;
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (capturing(device)) return PathChoice{GemmPath::kCublasLt, 0.0, 0.0};
  // Measured outside the lock (it runs GEMMs); two threads meeting a new shape at once both measure, and the
  // first answer stays.
  const PathChoice choice = measure(device, run);
  ChoiceCache& cache = choice_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  ++cache.measurements;
  return cache.choices.emplace(key, choice).first->second;
#else
  (void)run;
  return PathChoice{};
#endif
}

std::optional<PathChoice> cached_path(const PathKey& key) {
  ChoiceCache& cache = choice_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  const auto it = cache.choices.find(key);
  if (it == cache.choices.end()) return std::nullopt;
  return it->second;
}

int64_t autotune_measurement_count() {
  ChoiceCache& cache = choice_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.measurements;
}

void clear_autotuned_paths() {
  ChoiceCache& cache = choice_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  cache.choices.clear();
}

}  // namespace kernels
