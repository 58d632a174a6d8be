#pragma once

// For the tests that run ddp-launch as a user does: a command in the background with its output in a file, and
// what its output says.

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "ddp/ddp_test_util.h"

namespace ddp_test {

using Clock = std::chrono::steady_clock;

/// A command started in the background with its output in a file.
class Process {
 public:
  explicit Process(const std::string& command) : log_(dir_.file("log")) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string line = "exec " + command + " > " + log_ + " 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  /// Waits up to `limit`; returns the exit status (or nullopt after killing it when it ran too long).
  std::optional<int> wait(std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
        return status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::nullopt;
  }
  std::string output() const {
    std::ifstream in(log_);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  pid_t pid() const { return pid_; }

 private:
  ddp_test::ScratchDir dir_;
  std::string log_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

#ifdef LTA_DDP_LAUNCH
inline const std::string kLaunch = LTA_DDP_LAUNCH;
inline const std::string kWorker = LTA_DDP_TEST_WORKER;
#endif
constexpr std::chrono::seconds kLimit{60};

inline int exit_code(const std::optional<int>& status) {
  return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

inline std::string last_line(const std::string& text) {
  std::string line, last;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

/// The line of `text` that contains `fragment`, or "".
inline std::string line_with(const std::string& text, const std::string& fragment) {
  std::string line;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    if (line.find(fragment) != std::string::npos) return line;
  }
  return "";
}

}  // namespace ddp_test
