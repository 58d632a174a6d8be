#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/launch/health_watch.h>

namespace ddp::detail {

/// How often WorkerGroup::wait asks whether to stop from outside (a store call for ddp-launch: cheap, but not free).
constexpr std::chrono::milliseconds kStopPollInterval{100};

/// How one worker process ended.
struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  int wait_status = 0;    ///< as returned by waitpid
  std::string message;    ///< what the worker reported before dying (spawn: the exception), may be empty
  std::string last_line;  ///< the last non-empty line it wrote to its captured stderr, may be empty
  /// The group had signalled it (SIGTERM/SIGKILL after another worker failed) before it ended: a consequence.
  bool stopped_by_group = false;
  /// A signal given to wait() (the launcher's SIGINT/SIGTERM) had been forwarded to it before it ended.
  bool after_forwarded_signal = false;
  /// Hang detection stopped it: how it hung ("made no progress for 60 s ...; last seen ..."), else empty.
  std::string hang;
  /// When it failed: the time of its last stderr line when it has one (its error message: a process may take a
  /// while to tear down after it, while the peers it left fail at once), else when it ended: when its captured
  /// stderr closed if that was shortly before it was reaped, else when it was reaped.
  std::chrono::steady_clock::time_point observed;
};

/// Orders `failures` as WorkerGroup::wait returns them: those the group stopped last, the others by when they failed;
/// then, when the first is a collective that lost its peer ("a peer process probably exited", ddp::ProcessGroup's
/// error) and a worker killed by a signal (not the group's) ended within 2 s of it, that worker comes first: the peer
/// it lost. (Under CPU load the launcher sees a killed worker's end later than the survivor's error file says the
/// survivor failed; the survivor's message itself says it is the consequence.)
void order_failures(std::vector<WorkerExit>& failures);

/// "exited with code 3" / "was killed by signal 9 (Killed)".
std::string describe_status(int wait_status);

/// The shell's convention for a process's result: its exit code, or 128 + the signal that killed it.
int exit_code_of(int wait_status);

/// A torchrun-like failure summary, `prefix` before each line. Workers that failed alike (the same exit code or
/// signal, message and last stderr line) share one line ("ranks 0-1 (local ranks 0-1, pids P, Q) exited with code
/// C; their last stderr line: ..."). When every failed worker failed alike on its own, that line is all: no root
/// cause is named among equals. Otherwise the first failure's line is "root cause: rank R (local rank L, pid P)
/// exited with code C; its last stderr line: ...", the others follow as "consequence: ..." (those the group
/// stopped say so). Empty for no failures.
std::string describe_failures(const std::vector<WorkerExit>& failures, const std::string& prefix);

/// Why WaitHooks::stop_requested stops the workers from outside.
enum class StopRequest {
  kNone,
  /// Another node's workers failed. One here may be failing on its own at the same moment (its error written, its
  /// LibTorch teardown under way): the workers get the settle window to end before they are stopped, and one that
  /// ends in it is reported as the failure it is.
  kFailure,
  /// Node 0 restarts the job for a change of its nodes (--nnodes MIN:MAX): the workers are stopped at once, and one
  /// that happened to be failing at that moment is reported as stopped (the restart is not charged either way).
  kMembershipChange,
};

/// What WorkerGroup::wait tells, and asks, the world outside this host.
struct WaitHooks {
  /// Asked every kStopPollInterval whether to stop the workers from outside, and why: when it says so, they are
  /// stopped as after a failure (SIGTERM, then SIGKILL after the kill grace) and reported as stopped by the group.
  std::function<StopRequest()> stop_requested;
  /// Told of the first failure as soon as it is seen, before the others are given time to end (so that another
  /// node hears of it before its own workers fail as a consequence).
  std::function<void(const WorkerExit&)> first_failure;
  /// Asked every kStopPollInterval whether a worker hangs, given which workers still run (by local rank): the hung
  /// one (HealthWatch::check). It is the root cause (WorkerExit::hang, observed at its last progress), and all are
  /// stopped as after a failure.
  std::function<std::optional<HealthWatch::Hang>(const std::vector<bool>& running)> find_hang;
};

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

  /// Adopts a started worker; the group closes the descriptors it is given. `message_fd`, when >= 0, is the read
  /// end of a pipe the worker may write a failure message into. `output_fd`, when >= 0, is the read end of the
  /// worker's stderr: the group copies it, line by line as it comes, to `forward_fd` given to wait(), and keeps
  /// the last non-empty line for the failure summary. `error_file`, when not empty, is the worker's
  /// TORCHELASTIC_ERROR_FILE: its message is the failure's message (see ddp::record_error).
  void add(int rank, int local_rank, pid_t pid, int message_fd = -1, int output_fd = -1,
           const std::string& error_file = "");

  /// Waits until every worker has exited. When one fails (nonzero exit other than ddp::kExitResumable, or a signal),
  /// gives the others up to 2 s
  /// to end on their own (a peer that failed first may still be tearing down), then sends SIGTERM to those still
  /// running, SIGKILL after `kill_grace`, reaps them, and returns every failure in the order they failed (see
  /// WorkerExit::observed; those the group stopped last; the first is the root cause); returns an empty vector when all
  /// exited with 0. `pending_signal`, when given, is polled: a nonzero value is a signal to forward to every worker
  /// (the launcher's SIGINT/SIGTERM), after which it is reset to 0. Captured stderr goes to `forward_fd`.
  /// `hooks` connect the wait to other nodes (ddp-launch --max-restarts), see WaitHooks.
  std::vector<WorkerExit> wait(std::chrono::milliseconds kill_grace,
                               volatile std::sig_atomic_t* pending_signal = nullptr, int forward_fd = STDERR_FILENO,
                               const WaitHooks& hooks = {});

  /// Sends `signal` to every worker still running (to its process group).
  void signal_all(int signal);

  /// After wait() first forwards a signal, how long the workers get to end on their own (a preemption-aware worker
  /// saves its checkpoint then) before those still running are killed (SIGKILL). Unset (the default): no limit.
  void set_stop_grace(std::chrono::milliseconds grace) { stop_grace_ = grace; }
  /// Whether wait() killed workers that outlived the stop grace.
  bool killed_after_stop_grace() const { return killed_after_stop_grace_; }
  /// How many workers exited with ddp::kExitResumable ("stopped, resumable": ddp/launch/exit_codes.h). Such an exit
  /// is not a failure: it does not stop the others, who are saving too.
  int resumable_exits() const { return resumable_exits_; }

 private:
  struct Worker {
    int rank;
    int local_rank;
    pid_t pid;
    int message_fd;
    int output_fd;
    std::string error_file;
    std::string partial_line;  ///< captured stderr after its last newline
    std::string last_line;
    bool running;
    bool signalled;                                                      ///< by the group, after another worker failed
    bool forwarded;                                                      ///< a forwarded signal reached it
    std::optional<std::chrono::steady_clock::time_point> output_closed;  ///< when its stderr pipe reached its end
    std::optional<std::chrono::steady_clock::time_point> last_line_at;   ///< when its last non-empty line came
    std::string hang;                                                    ///< set when hang detection stopped it
    std::chrono::steady_clock::time_point hang_last_progress{};          ///< (hung) its last progress, for the order
    /// The message of an exception nothing caught (std::terminate's "  what():  <message>" line), else empty.
    std::string uncaught;
  };
  /// Takes one non-empty line of `w`'s stderr: its last line, unless the line is part of the backtrace that follows
  /// an uncaught exception's "what():" (c10::Error's "Exception raised from ...", "frame #N: ...").
  static void take_line(Worker& w, const std::string& line);
  /// Reaps `w` if it has exited (or blocks for it when `block`); returns its status when reaped.
  std::optional<int> reap(Worker& w, bool block);
  std::string read_message(Worker& w);
  /// When `w` wrote its error file (TORCHELASTIC_ERROR_FILE), on the steady clock; nullopt when it wrote none.
  static std::optional<std::chrono::steady_clock::time_point> error_file_written(const Worker& w);
  /// Copies whatever the workers' stderr pipes hold, waiting up to `timeout` for some to arrive.
  void pump_output(std::chrono::milliseconds timeout, int forward_fd);
  /// Copies one worker's pending stderr; closes the pipe at its end (or when `final`, at what is there now).
  void drain_output(Worker& w, int forward_fd, bool final);
  WorkerExit exit_of(Worker& w, int status, int forward_fd);
  /// Reaps every worker that has ended (or blocks for each when `block`), recording the failures; returns whether
  /// any is still running.
  bool reap_ended(bool block, int forward_fd, std::vector<WorkerExit>& failures);
  /// After the first failure: reaps the others as they end on their own, for up to the settle window.
  void settle(int forward_fd, std::vector<WorkerExit>& failures);
  void terminate_rest(std::chrono::milliseconds kill_grace, int forward_fd, std::vector<WorkerExit>& failures);

  /// Kills the workers still running once the stop grace after a forwarded signal has passed.
  void enforce_stop_grace(int forward_fd, std::vector<WorkerExit>& failures);

  std::vector<Worker> workers_;
  std::optional<std::chrono::milliseconds> stop_grace_;
  std::optional<std::chrono::steady_clock::time_point> stop_deadline_;  ///< set when a signal is first forwarded
  bool killed_after_stop_grace_ = false;
  int resumable_exits_ = 0;
};

/// A TCP port that was free on `host` a moment ago (the kernel's choice for port 0). Another process may still
/// take it before it is used; callers that can retry should.
int find_free_port(const std::string& host = "127.0.0.1");

}  // namespace ddp::detail
