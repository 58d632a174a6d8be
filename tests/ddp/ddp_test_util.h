#pragma once

// Helpers for the ddp tests: errors that must name something, scratch directories shared by worker processes,
// and short timeouts so that a broken collective fails the test instead of hanging it.

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/core/AutogradState.h>
#include <c10/util/Exception.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "test_util.h"

/// Skips the current test, with the reason, when this build has no Gloo backend (gloo's headers were missing).
#define LTA_REQUIRE_GLOO()                                                                                         \
  do {                                                                                                             \
    if (!::ddp::backend_available("gloo")) GTEST_SKIP() << "needs the Gloo backend (apt-get install libgloo-dev)"; \
  } while (0)

/// Skips the current test, with the reason, unless this build has NCCL and the machine at least `gpus` GPUs.
#define LTA_REQUIRE_NCCL_GPUS(gpus)                                                               \
  do {                                                                                            \
    LTA_REQUIRE_CUDA();                                                                           \
    if (!ddp::backend_available("nccl")) GTEST_SKIP() << "needs the NCCL backend (not built in)"; \
    if (static_cast<int64_t>(torch::cuda::device_count()) < (gpus))                               \
      GTEST_SKIP() << "needs " << (gpus) << " CUDA GPUs (one per rank)";                          \
  } while (0)

namespace ddp_test {

/// Collectives in tests: long enough for a loaded 2-core machine, short enough to end a broken test quickly.
constexpr std::chrono::milliseconds kTestTimeout{20000};

/// Runs fn(rank, process group) on `world` forked ranks with Gloo on loopback, one thread each (the ranks share two
/// cores); a rank reports failure by throwing, and ddp::spawn rethrows naming that rank.
inline void run_ranks(const std::function<void(int, const ddp::ProcessGroup&)>& fn, int world,
                      std::chrono::milliseconds timeout = kTestTimeout) {
  ddp::spawn(world, [&](int rank, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(timeout));
    fn(rank, pg);
  });
}

/// Throws (from a rank) unless actual and expected agree within rtol * |expected| + atol, elementwise.
inline void check_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, double atol,
                        const std::string& what) {
  TORCH_CHECK(actual.defined() == expected.defined(), what, ": one of the tensors is undefined");
  if (!actual.defined()) return;
  TORCH_CHECK(actual.sizes() == expected.sizes(), what, ": shape ", actual.sizes(), " vs ", expected.sizes());
  const auto a = actual.to(torch::kDouble);
  const auto e = expected.to(torch::kDouble);
  const auto excess = (a - e).abs() - (e.abs() * rtol + atol);
  TORCH_CHECK(a.numel() == 0 || excess.max().item<double>() <= 0, what, ": max abs diff ",
              (a - e).abs().max().item<double>(), " beyond rtol ", rtol, " atol ", atol);
}

/// While alive, backward passes started on this thread run on this thread, CUDA work included. Autograd otherwise
/// hands a CUDA device's backward work to one engine thread per device, shared by every thread of the process; with
/// ranks as threads on one GPU, a rank whose backward waits in a collective (SyncBatchNorm's allreduce) holds that
/// engine thread, so the other ranks' backward, which would issue the collective it waits for, never runs: a
/// deadlock until the collective times out. The switch is thread-local autograd state (what
/// torch.autograd.graph.set_multithreading_enabled(False) sets); with it off, the engine queues every node on the
/// calling thread's ready queue (Engine::ready_queue in torch/csrc/autograd/engine.cpp). CPU work always runs on the
/// calling thread.
class BackwardOnThisThread {
 public:
  BackwardOnThisThread() : previous_(c10::AutogradState::get_tls_state().get_multithreading_enabled()) {
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
  }
  ~BackwardOnThisThread() { c10::AutogradState::get_tls_state().set_multithreading_enabled(previous_); }
  BackwardOnThisThread(const BackwardOnThisThread&) = delete;
  BackwardOnThisThread& operator=(const BackwardOnThisThread&) = delete;

 private:
  bool previous_;
};

/// The process group of thread rank `rank` of `world`, meeting on 127.0.0.1:`port` over `backend` (with `cuda`, on
/// GPU `rank`), with the tests' collective timeout.
inline ddp::ProcessGroup thread_rank_group(const std::string& backend, int rank, int world, int port, bool cuda) {
  ddp::InitOptions init;
  if (cuda) init.cuda_device(rank);
  return ddp::init_process_group(init.backend(backend)
                                     .init_method("tcp://127.0.0.1:" + std::to_string(port))
                                     .rank(rank)
                                     .world_size(world)
                                     .timeout(kTestTimeout));
}

/// Runs fn(rank) for ranks 0 .. world - 1, each on a thread of this process under BackwardOnThisThread (ranks that
/// must share a process: CUDA does not survive a fork). Returns each rank's error message, "" for a rank
/// that returned normally.
inline std::vector<std::string> run_thread_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      const BackwardOnThisThread backward_here;
      try {
        fn(rank);
      } catch (const c10::Error& e) {
        errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(rank)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// conv -> BatchNorm2d -> ReLU -> conv -> BatchNorm2d -> ReLU -> mean over space -> linear to 3 classes, all in one
/// Sequential (so that convert_sync_batch_norm replaces what forward runs), initialized from `seed`.
inline torch::nn::Sequential make_bn_cnn(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)), torch::nn::BatchNorm2d(4), torch::nn::ReLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 6, 3).padding(1)), torch::nn::BatchNorm2d(6), torch::nn::ReLU(),
      torch::nn::Functional([](const torch::Tensor& x) {
        return x.mean({2, 3});
      }),
      torch::nn::Linear(6, 3));
}

/// Runs `fn`, which must throw; returns the message (without backtrace), or "" after recording a failure.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

/// Copies of the parameters' gradients, in registration order.
inline std::vector<torch::Tensor> grads_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

/// True when `text` contains every fragment; for use inside EXPECT_TRUE with the text printed on failure.
inline ::testing::AssertionResult contains_all(const std::string& text, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) {
    if (text.find(f) == std::string::npos) {
      return ::testing::AssertionFailure() << "'" << f << "' not found in: " << text;
    }
  }
  return ::testing::AssertionSuccess();
}

/// A fresh directory under /tmp (or TMPDIR), removed with its files (one level) with the object. POSIX calls
/// rather than std::filesystem: libtorch.so exports its own std::filesystem symbols, and remove_all crashes.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lta_ddp_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~ScratchDir() {
    if (DIR* dir = ::opendir(path_.c_str())) {
      while (dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name != "." && name != "..") ::unlink(file(name).c_str());
      }
      ::closedir(dir);
    }
    ::rmdir(path_.c_str());
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Sets environment variables for one scope and restores the previous values afterwards.
class EnvGuard {
 public:
  explicit EnvGuard(std::vector<std::string> names) : names_(std::move(names)) {
    for (const auto& n : names_) {
      const char* v = std::getenv(n.c_str());
      saved_.push_back(v ? std::optional<std::string>(v) : std::nullopt);
    }
  }
  ~EnvGuard() {
    for (size_t i = 0; i < names_.size(); ++i) {
      if (saved_[i]) {
        ::setenv(names_[i].c_str(), saved_[i]->c_str(), 1);
      } else {
        ::unsetenv(names_[i].c_str());
      }
    }
  }

 private:
  std::vector<std::string> names_;
  std::vector<std::optional<std::string>> saved_;
};

}  // namespace ddp_test
