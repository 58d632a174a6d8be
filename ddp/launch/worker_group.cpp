#include <ddp/launch/worker_group.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

#include <ddp/launch/error_file.h>
#include <ddp/launch/exit_codes.h>
#include <ddp/launch/store_socket.h>

namespace ddp::detail {
namespace {

/// How often the supervisor looks at its workers: short next to any training step, long enough to cost nothing.
constexpr std::chrono::milliseconds kPollInterval{5};

/// The most of a worker's failure message that is kept; a message is a sentence or a stack trace, not a log.
constexpr size_t kMaxMessageBytes = 16 * 1024;

/// How close to a worker's reaping its stderr must have closed to count as the moment it exited.
constexpr std::chrono::milliseconds kExitCloseWindow{500};

/// After the first failure, how long the other workers may take to end on their own before they are stopped: a
/// peer that failed at about the same moment may still be tearing LibTorch down (seen: longer than its peers took
/// to fail after it), and stopping it then would report it as a consequence instead of the root cause.
constexpr std::chrono::milliseconds kSettleWindow{2000};

/// A worker's line longer than this is passed on in pieces (a line is a message, not a data dump).
constexpr size_t kMaxLineBytes = 64 * 1024;

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to write to: the output is lost, the supervision goes on
    data += n;
    size -= static_cast<size_t>(n);
  }
}

/// The line without its trailing carriage return and blanks; empty when nothing else is on it.
std::string trimmed(std::string line) {
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
  return line;
}

void signal_worker(pid_t pid, int signal) {
  // The whole process group first (the worker and anything it started), the pid itself as a fallback for a
  // worker that has not reached its setpgid yet.
  if (::kill(-pid, signal) != 0) ::kill(pid, signal);
}

/// Workers that failed alike: the same way (exit code or signal; stopped by the group or not), with the same message
/// and last stderr line. One line tells all of them.
struct FailureGroup {
  std::vector<const WorkerExit*> members;  // in the order they failed
  bool alike(const WorkerExit& f) const {
    const WorkerExit& first = *members.front();
    return f.wait_status == first.wait_status && f.stopped_by_group == first.stopped_by_group &&
           f.message == first.message && f.last_line == first.last_line && f.hang == first.hang;
  }
};

/// "0-2, 5": ascending numbers, runs of consecutive ones as ranges.
std::string number_ranges(std::vector<int> numbers) {
  std::sort(numbers.begin(), numbers.end());
  std::ostringstream out;
  for (size_t i = 0; i < numbers.size();) {
    size_t last = i;
    while (last + 1 < numbers.size() && numbers[last + 1] == numbers[last] + 1) ++last;
    out << (i == 0 ? "" : ", ") << numbers[i];
    if (last > i) out << "-" << numbers[last];
    i = last + 1;
  }
  return out.str();
}

/// "rank 1" or "ranks 0-1".
std::string ranks_of(const FailureGroup& group) {
  std::vector<int> ranks;
  for (const WorkerExit* f : group.members) ranks.push_back(f->rank);
  return (group.members.size() == 1 ? "rank " : "ranks ") + number_ranges(ranks);
}

/// "rank 1 (local rank 1, pid 42)" or "ranks 0-1 (local ranks 0-1, pids 41, 42)".
std::string who(const FailureGroup& group) {
  std::vector<int> local_ranks;
  std::ostringstream pids;
  for (const WorkerExit* f : group.members) {
    local_ranks.push_back(f->local_rank);
    pids << (pids.tellp() == 0 ? "" : ", ") << f->pid;
  }
  const bool one = group.members.size() == 1;
  return ranks_of(group) + (one ? " (local rank " : " (local ranks ") + number_ranges(local_ranks) +
         (one ? ", pid " : ", pids ") + pids.str() + ")";
}

}  // namespace

std::string describe_status(int wait_status) {
  std::ostringstream out;
  if (WIFEXITED(wait_status)) {
    out << "exited with code " << WEXITSTATUS(wait_status);
  } else if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    out << "was killed by signal " << sig << " (" << ::strsignal(sig) << ")";
  } else {
    out << "ended with wait status " << wait_status;
  }
  return out.str();
}

int exit_code_of(int wait_status) {
  constexpr int kSignalExitBase = 128;  // what shells report for a process killed by a signal
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return kSignalExitBase + WTERMSIG(wait_status);
  return 1;
}

WorkerGroup::~WorkerGroup() {
  for (Worker& w : workers_) {
    if (w.running) {
      signal_worker(w.pid, SIGKILL);
      reap(w, /*block=*/true);
    }
    if (w.message_fd >= 0) ::close(w.message_fd);
    if (w.output_fd >= 0) ::close(w.output_fd);
  }
}

std::string describe_failures(const std::vector<WorkerExit>& failures, const std::string& prefix) {
  std::vector<FailureGroup> groups;
  for (const WorkerExit& f : failures) {
    auto same = std::find_if(groups.begin(), groups.end(), [&](const FailureGroup& g) { return g.alike(f); });
    if (same == groups.end()) {
      groups.push_back({{&f}});
    } else {
      same->members.push_back(&f);
    }
  }
  // Ranks that all failed alike on their own (an error every rank hits, such as a rejected --resume) are one line
  // with no root cause: naming one of them would pick among equals by a few milliseconds.
  const bool one_error_for_all =
      groups.size() == 1 && groups.front().members.size() > 1 && !groups.front().members.front()->stopped_by_group;
  std::ostringstream out;
  for (size_t i = 0; i < groups.size(); ++i) {
    const WorkerExit& f = *groups[i].members.front();
    const bool plural = groups[i].members.size() > 1;
    std::string status = f.hang.empty() ? describe_status(f.wait_status) : f.hang + ", and was stopped";
    if (plural && status.rfind("was ", 0) == 0) status.replace(0, 3, "were");
    const char* role = one_error_for_all ? "" : i == 0 ? "root cause: " : "consequence: ";
    out << prefix << role << who(groups[i]) << " " << status;
    if (f.stopped_by_group) {
      out << ", stopped after " << ranks_of(groups[0]) << " failed";
    } else if (i > 0) {
      const double later_s = std::chrono::duration<double>(f.observed - failures[0].observed).count();
      out << " " << std::fixed << std::setprecision(2) << later_s << " s after " << ranks_of(groups[0]);
      out.unsetf(std::ios::floatfield);
    }
    if (!f.message.empty()) out << ": " << f.message;
    // A last line that says the message again ("amp_ddp: <message>") is not repeated.
    if (!f.last_line.empty() && (f.message.empty() || f.last_line.find(f.message) == std::string::npos)) {
      out << (plural ? "; their last stderr line: " : "; its last stderr line: ") << f.last_line;
    }
    out << "\n";
  }
  return out.str();
}

void WorkerGroup::add(int rank, int local_rank, pid_t pid, int message_fd, int output_fd,
                      const std::string& error_file) {
  // Also set from the parent, so that signals reach the worker's group even before the child ran setpgid.
  ::setpgid(pid, pid);
  for (const int fd : {message_fd, output_fd}) {
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  Worker w{rank, local_rank, pid,   message_fd,   output_fd,    error_file, "", "",
           true, false,      false, std::nullopt, std::nullopt, "",         {}, ""};
  workers_.push_back(std::move(w));
}

std::optional<int> WorkerGroup::reap(Worker& w, bool block) {
  int status = 0;
  pid_t got;
  do {
    got = ::waitpid(w.pid, &status, block ? 0 : WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == w.pid) {
    w.running = false;
    return status;
  }
  if (got < 0) {  // not our child any more (reaped elsewhere): nothing to wait for
    w.running = false;
    return std::nullopt;
  }
  return std::nullopt;
}

std::optional<std::chrono::steady_clock::time_point> WorkerGroup::error_file_written(const Worker& w) {
  struct stat info {};
  if (w.error_file.empty() || ::stat(w.error_file.c_str(), &info) != 0) return std::nullopt;
  // Its modification time is on the wall clock; the failure times here are on the steady clock: the same distance
  // back from now on both.
  const auto modified =
      std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::seconds(info.st_mtim.tv_sec) + std::chrono::nanoseconds(info.st_mtim.tv_nsec)));
  const auto ago = std::chrono::system_clock::now() - modified;
  return std::chrono::steady_clock::now() - std::chrono::duration_cast<std::chrono::steady_clock::duration>(ago);
}

std::string WorkerGroup::read_message(Worker& w) {
  std::string message;
  if (w.message_fd < 0) return w.error_file.empty() ? "" : read_error_message(w.error_file).value_or("");
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(w.message_fd, buffer, sizeof(buffer));
    if (n > 0 && message.size() < kMaxMessageBytes) message.append(buffer, static_cast<size_t>(n));
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  ::close(w.message_fd);
  w.message_fd = -1;
  return message;
}

void WorkerGroup::take_line(Worker& w, const std::string& line) {
  // An exception nothing caught ends in std::terminate, which prints "terminate called after throwing an instance of
  // 'T'" and "  what():  <message>"; c10::Error's message goes on with its backtrace. The message is the error, not
  // the backtrace's last frame.
  const size_t start = line.find_first_not_of(" \t");
  const std::string what = "what():";
  if (line.compare(start, what.size(), what) == 0) {
    const size_t text = line.find_first_not_of(" \t", start + what.size());
    w.uncaught = text == std::string::npos ? std::string() : line.substr(text);
  } else if (!w.uncaught.empty() &&
             (line.rfind("frame #", start) == start || line.rfind("Exception raised from ", start) == start ||
              line.rfind("<omitting python frames>", start) == start)) {
    return;
  }
  w.last_line = line;
  w.last_line_at = std::chrono::steady_clock::now();
}

void WorkerGroup::drain_output(Worker& w, int forward_fd, bool final) {
  if (w.output_fd < 0) return;
  char buffer[4096];
  bool ended = false;
  for (;;) {
    const ssize_t n = ::read(w.output_fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ended = n == 0 || errno != EAGAIN;
      break;
    }
    w.partial_line.append(buffer, static_cast<size_t>(n));
    // Whole lines go out at once, so that lines of different workers never interleave mid-line.
    const size_t end = w.partial_line.rfind('\n');
    if (end != std::string::npos) {
      write_all(forward_fd, w.partial_line.data(), end + 1);
      for (size_t from = 0; from <= end;) {
        const size_t newline = w.partial_line.find('\n', from);
        const std::string line = trimmed(w.partial_line.substr(from, newline - from));
        if (!line.empty()) take_line(w, line);
        from = newline + 1;
      }
      w.partial_line.erase(0, end + 1);
    }
    if (w.partial_line.size() > kMaxLineBytes) {
      write_all(forward_fd, w.partial_line.data(), w.partial_line.size());
      w.partial_line.clear();
    }
  }
  if (!ended && !final) return;
  if (ended) w.output_closed = std::chrono::steady_clock::now();
  if (!w.partial_line.empty()) {  // a last line without its newline
    const std::string line = trimmed(w.partial_line);
    if (!line.empty()) take_line(w, line);
    w.partial_line += '\n';
    write_all(forward_fd, w.partial_line.data(), w.partial_line.size());
    w.partial_line.clear();
  }
  ::close(w.output_fd);
  w.output_fd = -1;
}

void WorkerGroup::pump_output(std::chrono::milliseconds timeout, int forward_fd) {
  std::vector<pollfd> fds;
  std::vector<Worker*> owners;
  for (Worker& w : workers_) {
    if (w.output_fd < 0) continue;
    fds.push_back({w.output_fd, POLLIN, 0});
    owners.push_back(&w);
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(timeout);
    return;
  }
  if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents != 0) drain_output(*owners[i], forward_fd, /*final=*/false);
  }
}

WorkerExit WorkerGroup::exit_of(Worker& w, int status, int forward_fd) {
  // The worker is gone, so everything it wrote is in the pipe: read it all before naming its last line. (A
  // process it started may still hold the pipe; what that one writes later is not waited for.)
  drain_output(w, forward_fd, /*final=*/true);
  WorkerExit exit;
  exit.rank = w.rank;
  exit.local_rank = w.local_rank;
  exit.pid = w.pid;
  exit.wait_status = status;
  exit.message = read_message(w);
  while (!exit.message.empty() && (exit.message.back() == '\n' || exit.message.back() == '\r')) exit.message.pop_back();
  if (exit.message.empty()) exit.message = w.uncaught;  // the uncaught exception's message is the error
  exit.last_line = w.last_line;
  // Ended by the group's signal; one that failed on its own meanwhile (its error came first) is not "stopped".
  // (A worker that saves on SIGTERM, --stop-signal, ends with kExitResumable instead.)
  const bool saved_and_stopped = WIFEXITED(status) && WEXITSTATUS(status) == kExitResumable;
  exit.stopped_by_group = w.signalled && (WIFSIGNALED(status) || saved_and_stopped) && w.hang.empty();
  exit.hang = w.hang;
  exit.after_forwarded_signal = w.forwarded;
  const auto now = std::chrono::steady_clock::now();
  // A pipe that closed long before the worker was reaped was closed by the worker itself, not by its exit.
  const bool closed_at_exit = w.output_closed && now - *w.output_closed < kExitCloseWindow;
  exit.observed = closed_at_exit ? *w.output_closed : now;
  // When it failed comes first: tearing a LibTorch process down can take longer than its peers take to fail after it
  // (seen: 0.03 s the wrong way round). A worker that wrote an error file failed when it wrote it (it prints nothing
  // more: the launcher says it); else a failed worker's last line is its error, written when it failed.
  if (const auto written = error_file_written(w)) {
    exit.observed = std::min(exit.observed, *written);
  } else if (w.last_line_at) {
    exit.observed = std::min(exit.observed, *w.last_line_at);
  }
  if (!w.hang.empty()) exit.observed = w.hang_last_progress;
  return exit;
}

void WorkerGroup::signal_all(int signal) {
  for (const Worker& w : workers_) {
    if (w.running) signal_worker(w.pid, signal);
  }
}

bool WorkerGroup::reap_ended(bool block, int forward_fd, std::vector<WorkerExit>& failures) {
  bool any_running = false;
  for (Worker& w : workers_) {
    if (!w.running) continue;
    const std::optional<int> status = reap(w, block);
    // A worker that stopped resumable (it saved on its stop signal) is no failure: the others are saving too. Not
    // one the group itself stopped (after another's failure, for a membership change): that one was stopped.
    const bool resumable = status && WIFEXITED(*status) && WEXITSTATUS(*status) == kExitResumable && !w.signalled;
    // A hung worker is a failure however it ends (one that saves and exits 0 on SIGTERM too).
    const bool clean = status && (*status == 0 || resumable) && w.hang.empty();
    if (status && !clean) failures.push_back(exit_of(w, *status, forward_fd));
    if (clean) {
      resumable_exits_ += resumable ? 1 : 0;
      drain_output(w, forward_fd, /*final=*/true);
    }
    any_running = any_running || w.running;
  }
  return any_running;
}

void WorkerGroup::settle(int forward_fd, std::vector<WorkerExit>& failures) {
  const auto deadline = std::chrono::steady_clock::now() + kSettleWindow;
  while (reap_ended(/*block=*/false, forward_fd, failures) && std::chrono::steady_clock::now() < deadline) {
    pump_output(kPollInterval, forward_fd);
  }
}

void WorkerGroup::enforce_stop_grace(int forward_fd, std::vector<WorkerExit>& failures) {
  if (!stop_deadline_ || std::chrono::steady_clock::now() < *stop_deadline_) return;
  bool any_running = false;
  for (const Worker& w : workers_) any_running = any_running || w.running;
  if (!any_running) return;
  killed_after_stop_grace_ = true;
  signal_all(SIGKILL);
  reap_ended(/*block=*/true, forward_fd, failures);
}

void WorkerGroup::terminate_rest(std::chrono::milliseconds kill_grace, int forward_fd,
                                 std::vector<WorkerExit>& failures) {
  for (Worker& w : workers_) w.signalled = w.running;
  signal_all(SIGTERM);
  signal_all(SIGCONT);  // a stopped worker (SIGSTOP, a debugger's) takes its SIGTERM only once it runs
  const auto deadline = std::chrono::steady_clock::now() + kill_grace;
  while (reap_ended(/*block=*/false, forward_fd, failures)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      signal_all(SIGKILL);
      reap_ended(/*block=*/true, forward_fd, failures);
      break;
    }
    pump_output(kPollInterval, forward_fd);
  }
}

std::vector<WorkerExit> WorkerGroup::wait(std::chrono::milliseconds kill_grace,
                                          volatile std::sig_atomic_t* pending_signal, int forward_fd,
                                          const WaitHooks& hooks) {
  std::vector<WorkerExit> failures;
  auto next_stop_poll = std::chrono::steady_clock::now() + kStopPollInterval;
  auto next_hang_check = next_stop_poll;
  for (;;) {
    if (pending_signal != nullptr && *pending_signal != 0) {
      const int signal = *pending_signal;
      *pending_signal = 0;
      for (Worker& w : workers_) w.forwarded = w.forwarded || w.running;
      signal_all(signal);
      if (stop_grace_ && !stop_deadline_) stop_deadline_ = std::chrono::steady_clock::now() + *stop_grace_;
    }
    enforce_stop_grace(forward_fd, failures);
    // Every worker found ended in this pass is recorded before the rest are stopped, so that a worker that failed
    // on its own is not reported as stopped; they are ordered by when they ended at the end.
    const bool any_running = reap_ended(/*block=*/false, forward_fd, failures);
    if (!failures.empty()) {
      if (hooks.first_failure) {
        hooks.first_failure(*std::min_element(failures.begin(), failures.end(),
                                              [](const auto& a, const auto& b) { return a.observed < b.observed; }));
      }
      settle(forward_fd, failures);
      terminate_rest(kill_grace, forward_fd, failures);
      break;
    }
    if (!any_running) break;
    if (hooks.stop_requested && std::chrono::steady_clock::now() >= next_stop_poll) {
      next_stop_poll = std::chrono::steady_clock::now() + kStopPollInterval;
      if (const StopRequest stop = hooks.stop_requested(); stop != StopRequest::kNone) {
        // After another node's failure, a worker here failing on its own at the same moment (its LibTorch teardown
        // can take longer than a peer on the other node takes to fail after it) is reported as the failure it is,
        // with the time of its error. Healthy workers stopped for a membership change are not kept waiting.
        if (stop == StopRequest::kFailure) settle(forward_fd, failures);
        if (!failures.empty() && hooks.first_failure) {
          hooks.first_failure(*std::min_element(failures.begin(), failures.end(),
                                                [](const auto& a, const auto& b) { return a.observed < b.observed; }));
        }
        terminate_rest(kill_grace, forward_fd, failures);
        break;
      }
    }
    if (hooks.find_hang && std::chrono::steady_clock::now() >= next_hang_check) {
      next_hang_check = std::chrono::steady_clock::now() + kStopPollInterval;
      std::vector<bool> running;
      for (const Worker& w : workers_) running.push_back(w.running);
      if (const auto hang = hooks.find_hang(running)) {
        Worker& hung = workers_.at(static_cast<size_t>(hang->local_rank));
        hung.hang = hang->message;
        hung.hang_last_progress = hang->last_progress;
        if (hooks.first_failure) {
          WorkerExit first;
          first.rank = hung.rank;
          first.local_rank = hung.local_rank;
          first.pid = hung.pid;
          first.hang = hung.hang;
          first.observed = hung.hang_last_progress;
          hooks.first_failure(first);
        }
        terminate_rest(kill_grace, forward_fd, failures);
        break;
      }
    }
    pump_output(kPollInterval, forward_fd);
  }
  for (Worker& w : workers_) drain_output(w, forward_fd, /*final=*/true);
  order_failures(failures);
  return failures;
}

void order_failures(std::vector<WorkerExit>& failures) {
  std::stable_sort(failures.begin(), failures.end(), [](const WorkerExit& a, const WorkerExit& b) {
    if (a.stopped_by_group != b.stopped_by_group) return b.stopped_by_group;
    return a.observed < b.observed;
  });
  if (failures.size() < 2) return;
  const WorkerExit& first = failures.front();
  const bool lost_its_peer = first.message.find("a peer process probably exited") != std::string::npos ||
                             first.last_line.find("a peer process probably exited") != std::string::npos;
  if (!lost_its_peer || first.stopped_by_group) return;
  constexpr std::chrono::seconds kPeerLossWindow{2};
  for (size_t i = 1; i < failures.size(); ++i) {
    const WorkerExit& other = failures[i];
    if (!other.stopped_by_group && WIFSIGNALED(other.wait_status) &&
        other.observed - first.observed < kPeerLossWindow) {
      std::rotate(failures.begin(), failures.begin() + static_cast<std::ptrdiff_t>(i),
                  failures.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      return;
    }
  }
}

int find_free_port(const std::string& host) {
  const std::optional<in_addr> address = ipv4_address_of(host);
  TORCH_CHECK(address.has_value(), "find_free_port: cannot resolve '", host, "' to an IPv4 address");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr = *address;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "find_free_port: socket() failed: ", std::strerror(errno));
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(ok, "find_free_port: could not bind a port on ", host, ": ", std::strerror(error));
  return ntohs(addr.sin_port);
}

}  // namespace ddp::detail
