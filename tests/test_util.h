#pragma once

// Helpers shared by the test binaries: dtype tolerances, GPU presence, fresh random inputs.

#include <dirent.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
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

/// Relative tolerance for results stored in `dtype` after fp32 arithmetic: a couple of ulps of the type.
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
  const uint64_t seed = std::random_device{}();
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
