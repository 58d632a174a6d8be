#include <kernels/capture.h>

#include <c10/util/Exception.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <kernels/cuda/check.h>
#endif

namespace kernels {
namespace {
thread_local bool t_simulated_capture = false;
}  // namespace

bool is_capturing(const c10::Device& device) {
  if (t_simulated_capture) return true;
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LTA_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

void check_not_capturing(const c10::Device& device, const std::string& what, const std::string& why) {
  TORCH_CHECK(!is_capturing(device), what, " cannot run while a CUDA graph is being captured on ", device, ": ", why);
}

namespace testing {
SimulatedCapture::SimulatedCapture() {
  TORCH_CHECK(!t_simulated_capture, "SimulatedCapture is already active on this thread");
  t_simulated_capture = true;
}
SimulatedCapture::~SimulatedCapture() { t_simulated_capture = false; }
}  // namespace testing

}  // namespace kernels
