#pragma once

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

/// How one worker process ended.
struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  int wait_status = 0;  // as returned by waitpid
  std::string message;  // what the worker reported before dying (spawn: the exception), may be empty
};

/// "exited with code 3" / "was killed by signal 9 (Killed)".
std::string describe_status(int wait_status);

/// The shell's convention for a process's result: its exit code, or 128 + the signal that killed it.
int exit_code_of(int wait_status);

/// The worker processes of one job on this host, supervised together: the first one that fails takes the others
/// down, so a job never waits on a peer that is gone. Each worker runs in its own process group (set by the
/// caller in the child, and again here) so that signals reach the worker and whatever it started.
class WorkerGroup {
 public:
  WorkerGroup() = default;
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;
  /// Kills (SIGKILL) and reaps the workers still running: a group never leaves orphans behind.
  ~WorkerGroup();

  /// Adopts a started worker. `message_fd`, when >= 0, is the read end of a pipe the worker may write a failure
  /// message into; the group closes it.
  void add(int rank, int local_rank, pid_t pid, int message_fd = -1);

  /// Waits until every worker has exited. When one fails (nonzero exit or a signal), sends SIGTERM to the
  /// others, SIGKILL after `kill_grace`, reaps them, and returns the first failure; returns nullopt when all
  /// exited with 0. `pending_signal`, when given, is polled: a nonzero value is a signal to forward to every
  /// worker (the launcher's SIGINT/SIGTERM), after which it is reset to 0.
  std::optional<WorkerExit> wait(std::chrono::milliseconds kill_grace,
                                 volatile std::sig_atomic_t* pending_signal = nullptr);

  /// Sends `signal` to every worker still running (to its process group).
  void signal_all(int signal);

 private:
  struct Worker {
    int rank;
    int local_rank;
    pid_t pid;
    int message_fd;
    bool running;
  };
  /// Reaps `w` if it has exited (or blocks for it when `block`); returns its status when reaped.
  std::optional<int> reap(Worker& w, bool block);
  std::string read_message(Worker& w);
  void terminate_rest(std::chrono::milliseconds kill_grace);

  std::vector<Worker> workers_;
};

/// A TCP port that was free on `host` a moment ago (the kernel's choice for port 0). Another process may still
/// take it before it is used; callers that can retry should.
int find_free_port(const std::string& host = "127.0.0.1");

}  // namespace ddp::detail
