#pragma once

// Helpers shared by the test binaries: dtype tolerances, GPU presence, fresh random inputs.

#include <dirent.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace test_util {

/// True when a CUDA device can run kernels (the CUDA build of LibTorch is loaded and a GPU is present).
inline bool cuda_available() { return torch::cuda::is_available(); }

/// Skips the current test, with the reason, when no GPU is present.
#define LTA_REQUIRE_CUDA()                                                                   \
  do {                                                                                       \
    if (!::test_util::cuda_available()) GTEST_SKIP() << "needs a CUDA GPU; none is present"; \
  } while (0)

// Note [bounds on every CPU kernel path]
// Which CPU kernels run depends on the machine and on ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA: ATen's at::vec width
// (DEFAULT and AVX2: 8 fp32 lanes, AVX512: 16; our twins add 16 or 32 per step), FMA or not, and oneDNN's GEMMs and
// convolutions (native AVX512-BF16 / AMX where the CPU has them, bf16 emulated on AVX512, or AVX2 code). A bound must
// hold on all of them, so it rests only on what they share:
// - a bf16 / fp16 GEMM or convolution multiplies exactly, sums in fp32 and rounds once: within
//   2^-8 |exact| + K 2^-24 sum |a b| (bf16; 2^-11 for fp16) of the fp64 product of its operands. Paths differ only in
//   the order of the fp32 sum, which moves a result by at most one ulp of the dtype (2^-7 relative for bf16), and
//   only where the fp32 sum lies near a rounding boundary: another path is another draw of a rounding already
//   allowed for, never a larger error. One exception: ATen's own bf16 conv2d backward, which runs where oneDNN has no
//   bf16 (an AVX2-only CPU, or oneDNN capped at AVX2), rounds more than once (about 2 u normwise, not 0.5-0.9): the
//   bf16 CNN training tests are measured on that path too (docs/testing.md);
// - an fp32 GEMM stays fp32 (nothing here asks for TF32 or bf16 down-conversion): within K 2^-24 sum |a b|;
// - an elementwise kernel computes in fp32 and rounds once to the dtype: within rtol_for(dtype) whatever the width
//   (an FMA changes the fp32 value by at most an fp32 ulp);
// - a reduction (norm, sum, batch-norm statistics) adds in fp32 lanes whose number depends on the width: at most
//   (terms per lane) 2^-24 sum |terms| off, and in practice about the square root of that.
// tests/numerics/check_kernel_paths.py checks the first two and the batch-norm lane model under three settings:
// native, ATen default + oneDNN AVX2, ATen avx2 + oneDNN AVX512_CORE (the last two without native bf16).
// (Under ATEN_CPU_CAPABILITY=default, fp32 torch::randn itself differs in the last bits for the same seed: a scalar
// path instead of the vectorized one every AVX2 machine takes. Replay a failure there under the same setting.)
// Hence three kinds of bound (docs/testing.md lists every test's): one op against fp64 is bounded by the derivation
// above; two runs of the same kernels on the same machine differ only by what the two sides do differently (often
// nothing: bit-for-bit); and a training outcome (a loss, an accuracy, parameters after N steps) is a trajectory that
// any change of rounding (path, thread count, seed) moves, so its bound is one-sided or covers the measured spread
// over seeds and kernel settings with a margin.

/// Relative tolerance for results stored in `dtype` after fp32 arithmetic: a couple of ulps of the type (bf16: 4
/// units of rounding 2^-8, fp16: 4 of 2^-11; Note [bounds on every CPU kernel path]).
inline double rtol_for(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return 2e-3;
    case torch::kBFloat16:
      return 1.6e-2;
    default:
      return 2e-6;
  }
}

/// A seed that differs on every run (inputs are fresh random data), printed so a failure can be replayed.
inline uint64_t fresh_seed() {
  // LTA_TEST_SEED replays a seed a failure printed.
  const char* replay = std::getenv("LTA_TEST_SEED");
  const uint64_t seed = replay != nullptr && *replay != '\0' ? std::stoull(replay) : std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

/// Runs `call`, which must throw a c10::Error whose message contains `fragment`; records a failure otherwise.
inline void expect_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

/// The whole content of a file ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The child process of `launcher` (ddp-launch) whose environment has RANK=`rank`; -1 when there is none (not
/// started yet, or gone). Read from /proc: the launcher's children and their environments.
inline pid_t worker_with_rank(pid_t launcher, int rank) {
  const std::string tid = std::to_string(launcher);
  std::istringstream children(read_file("/proc/" + tid + "/task/" + tid + "/children"));
  const std::string entry = "RANK=" + std::to_string(rank) + std::string(1, '\0');
  pid_t child = 0;
  while (children >> child) {
    const std::string env = read_file("/proc/" + std::to_string(child) + "/environ");
    if (env.rfind(entry, 0) == 0 || env.find(std::string(1, '\0') + entry) != std::string::npos) return child;
  }
  return -1;
}

/// The names in `folder` (without . and ..), sorted.
inline std::vector<std::string> folder_entries(const std::string& folder) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());
  return names;
}

/// Runs `write` in a forked child whose file-size limit is `limit_bytes` (no core file), so that a write stops
/// there as a full disk or `ulimit -f` would stop it; the child exits 0, or 3 when `write` throws. Returns the
/// child's wait status (see stopped_by_file_size_limit).
inline int run_with_file_size_limit(rlim_t limit_bytes, const std::function<void()>& write) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    rlimit limit{limit_bytes, limit_bytes};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      write();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

/// True when a child of run_with_file_size_limit was stopped by the limit (SIGXFSZ) or threw (exit 3).
inline bool stopped_by_file_size_limit(int status) {
  return (WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ) || (WIFEXITED(status) && WEXITSTATUS(status) == 3);
}

}  // namespace test_util
