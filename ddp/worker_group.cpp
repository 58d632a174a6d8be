#include <ddp/worker_group.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

namespace ddp::detail {
namespace {

/// How often the supervisor looks at its workers: short next to any training step, long enough to cost nothing.
constexpr std::chrono::milliseconds kPollInterval{5};

/// The most of a worker's failure message that is kept; a message is a sentence or a stack trace, not a log.
constexpr size_t kMaxMessageBytes = 16 * 1024;

void signal_worker(pid_t pid, int signal) {
  // The whole process group first (the worker and anything it started), the pid itself as a fallback for a
  // worker that has not reached its setpgid yet.
  if (::kill(-pid, signal) != 0) ::kill(pid, signal);
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
  }
}

void WorkerGroup::add(int rank, int local_rank, pid_t pid, int message_fd) {
  // Also set from the parent, so that signals reach the worker's group even before the child ran setpgid.
  ::setpgid(pid, pid);
  if (message_fd >= 0) ::fcntl(message_fd, F_SETFL, ::fcntl(message_fd, F_GETFL) | O_NONBLOCK);
  workers_.push_back({rank, local_rank, pid, message_fd, true});
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

std::string WorkerGroup::read_message(Worker& w) {
  std::string message;
  if (w.message_fd < 0) return message;
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

void WorkerGroup::signal_all(int signal) {
  for (const Worker& w : workers_) {
    if (w.running) signal_worker(w.pid, signal);
  }
}

void WorkerGroup::terminate_rest(std::chrono::milliseconds kill_grace) {
  signal_all(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + kill_grace;
  for (;;) {
    bool any_running = false;
    for (Worker& w : workers_) {
      if (w.running) reap(w, /*block=*/false);
      any_running = any_running || w.running;
    }
    if (!any_running) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(kPollInterval);
  }
  signal_all(SIGKILL);
  for (Worker& w : workers_) {
    if (w.running) reap(w, /*block=*/true);
  }
}

std::optional<WorkerExit> WorkerGroup::wait(std::chrono::milliseconds kill_grace,
                                            volatile std::sig_atomic_t* pending_signal) {
  for (;;) {
    if (pending_signal != nullptr && *pending_signal != 0) {
      const int signal = *pending_signal;
      *pending_signal = 0;
      signal_all(signal);
    }
    bool any_running = false;
    for (Worker& w : workers_) {
      if (!w.running) continue;
      const std::optional<int> status = reap(w, /*block=*/false);
      if (status && *status != 0) {
        WorkerExit failure{w.rank, w.local_rank, w.pid, *status, read_message(w)};
        terminate_rest(kill_grace);
        return failure;
      }
      any_running = any_running || w.running;
    }
    if (!any_running) return std::nullopt;
    std::this_thread::sleep_for(kPollInterval);
  }
}

int find_free_port(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "find_free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  const bool parsed = ::inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) == 1;
  socklen_t len = sizeof(addr);
  const bool ok = parsed && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(parsed, "find_free_port: host must be an IPv4 address or localhost, got '", host, "'");
  TORCH_CHECK(ok, "find_free_port: could not bind a port on ", host, ": ", std::strerror(error));
  return ntohs(addr.sin_port);
}

}  // namespace ddp::detail
