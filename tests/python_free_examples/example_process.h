#pragma once

// Helpers for the tests that run the example programs as a user would: a child process with its own environment
// and file-size limit, stdout and stderr captured, and scratch folders with the files a test plants.

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

namespace example_test {

/// What a finished child left: its wait status and everything it wrote to stdout and stderr.
struct ProcessResult {
  int wait_status = 0;
  std::string out;
  std::string err;
  bool exited() const { return WIFEXITED(wait_status); }
  int exit_code() const { return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1; }
  int signal() const { return WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0; }
  /// For failure messages: how it ended and what it printed.
  std::string describe() const {
    return (exited() ? "exit code " + std::to_string(exit_code()) : "signal " + std::to_string(signal())) +
           "\n--- stdout:\n" + out + "\n--- stderr:\n" + err;
  }
};

/// Runs `argv` (argv[0] a path) with `env` ("NAME=value") added to this process's environment, a file-size limit
/// of `file_size_limit_bytes` (RLIM_INFINITY: none; the write that crosses it gets SIGXFSZ, as `ulimit -f` does)
/// and no core files. Kills it (SIGKILL, its process group) after `timeout_seconds`. `while_running`, when given,
/// is called with the child's pid at least every 20 ms while it runs (a test that acts on what the child has done).
inline ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                                 rlim_t file_size_limit_bytes = RLIM_INFINITY, int timeout_seconds = 120,
                                 const std::function<void(pid_t)>& while_running = {}) {
  int out_pipe[2];
  int err_pipe[2];
  ProcessResult result;
  if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) {
    ADD_FAILURE() << "pipe() failed";
    return result;
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    rlimit size{file_size_limit_bytes, file_size_limit_bytes};
    ::setrlimit(RLIMIT_FSIZE, &size);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  int open_pipes = 2;
  bool killed = false;
  while (open_pipes > 0) {
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      killed = true;
      ADD_FAILURE() << argv[0] << " ran past " << timeout_seconds << " s and was killed";
    }
    if (while_running) while_running(pid);
    if (::poll(fds, 2, while_running ? 20 : 200) < 0) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_pipes;
      }
    }
  }
  ::waitpid(pid, &result.wait_status, 0);
  return result;
}

using test_util::read_file;

/// The lines of `text` (without their newlines); the last one must end in a newline too.
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  for (size_t end = text.find('\n'); end != std::string::npos; end = text.find('\n', begin)) {
    lines.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  EXPECT_EQ(begin, text.size()) << "the last line has no newline: " << text;
  return lines;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

using test_util::folder_entries;

/// A fresh folder under TMPDIR (or /tmp), removed with its files and subfolders (two levels) with the object.
/// POSIX calls rather than std::filesystem: libtorch.so exports its own std::filesystem symbols.
class Scratch {
 public:
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lta_examples_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { remove_tree(path_, 2); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  /// Makes the subfolder `name` and returns its path.
  std::string folder(const std::string& name) const {
    ::mkdir(file(name).c_str(), 0755);
    return file(name);
  }
  const std::string& path() const { return path_; }

 private:
  static void remove_tree(const std::string& folder, int depth) {
    for (const auto& name : folder_entries(folder)) {
      const std::string path = folder + "/" + name;
      struct stat info {};
      if (depth > 0 && ::lstat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
        remove_tree(path, depth - 1);
      } else {
        ::unlink(path.c_str());
      }
    }
    ::rmdir(folder.c_str());
  }
  std::string path_;
};

}  // namespace example_test
