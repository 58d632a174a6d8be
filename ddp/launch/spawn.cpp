#include <ddp/launch/spawn.h>

#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <utility>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <ddp/launch/exit_codes.h>
#include <ddp/launch/signal_forwarding.h>
#include <ddp/launch/text.h>
#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>

namespace ddp {
namespace {

/// Exit code of a worker whose fn threw (the message travels through the pipe).
constexpr int kExitException = 1;

void set_env(const char* name, const std::string& value) { ::setenv(name, value.c_str(), /*overwrite=*/1); }

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

/// The child's side: never returns to the caller's stack (no destructors of the parent's objects, no test
/// framework teardown run twice), it leaves through _exit.
[[noreturn]] void run_worker(int local_rank, int nprocs, const SpawnOptions& options, int master_port, int message_fd,
                             pid_t parent, const std::function<void(int, int)>& fn) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(kExitException);  // the parent died before the line above took effect
  set_env("MASTER_ADDR", options.master_addr());
  set_env("MASTER_PORT", std::to_string(master_port));
  set_env("RANK", std::to_string(local_rank));
  set_env("WORLD_SIZE", std::to_string(nprocs));
  set_env("LOCAL_RANK", std::to_string(local_rank));
  set_env("LOCAL_WORLD_SIZE", std::to_string(nprocs));
  set_env("GROUP_RANK", "0");
  if (options.rendezvous_timeout())
    set_env(kRendezvousTimeoutEnv, detail::seconds_value(*options.rendezvous_timeout()));
  if (options.collective_timeout())
    set_env(kCollectiveTimeoutEnv, detail::seconds_value(*options.collective_timeout()));
  // Like torchrun: each worker runs CPU ops on one thread unless OMP_NUM_THREADS says otherwise. One thread also
  // keeps the child clear of the parent's OpenMP thread pool, which does not survive fork (GNU libgomp): a child
  // opening a multi-threaded region with it would hang.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    set_env("OMP_NUM_THREADS", "1");
    at::set_num_threads(1);
  }
  int code = 0;
  try {
    fn(local_rank, nprocs);
  } catch (const ResumableStop& e) {  // it saved on its stop signal: not a failure
    write_all(message_fd, e.what());
    code = kExitResumable;
  } catch (const c10::Error& e) {
    write_all(message_fd, e.what_without_backtrace());
    code = kExitException;
  } catch (const std::exception& e) {
    write_all(message_fd, e.what());
    code = kExitException;
  } catch (...) {
    write_all(message_fd, "an exception that is not a std::exception");
    code = kExitException;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace

SpawnOutcome spawn(int nprocs, const std::function<void(int local_rank, int nprocs)>& fn, const SpawnOptions& options) {
  TORCH_CHECK(nprocs >= 1, "spawn: nprocs must be >= 1, got ", nprocs);
  TORCH_CHECK(fn, "spawn: fn is empty");
  TORCH_CHECK(options.master_port() >= 0 && options.master_port() <= 65535,
              "spawn: master_port must be in [0, 65535], got ", options.master_port());
  for (const auto& [name, timeout] : {std::pair{"rendezvous_timeout", options.rendezvous_timeout()},
                                      std::pair{"collective_timeout", options.collective_timeout()}}) {
    TORCH_CHECK(!timeout || timeout->count() > 0, "spawn: ", name, " must be > 0 ms, got ", timeout->count());
  }
  const int port = options.master_port() != 0 ? options.master_port() : detail::find_free_port(options.master_addr());
  // Buffered output would otherwise be written once by the parent and once more by every child.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  const pid_t parent = ::getpid();
  detail::WorkerGroup group;
  for (int local_rank = 0; local_rank < nprocs; ++local_rank) {
    int fds[2];
    TORCH_CHECK(::pipe(fds) == 0, "spawn: pipe() failed");
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "spawn: fork() failed for rank ", local_rank);
    if (pid == 0) {
      ::close(fds[0]);
      run_worker(local_rank, nprocs, options, port, fds[1], parent, fn);
    }
    ::close(fds[1]);
    group.add(local_rank, local_rank, pid, fds[0]);
  }
  // Forwarded while the workers run (they are in process groups of their own: a terminal's SIGINT reaches only us).
  const detail::SignalForwarding forwarding;
  group.set_stop_grace(options.stop_grace());
  const auto failures = group.wait(options.kill_grace(), detail::SignalForwarding::pending());
  if (failures.empty()) return group.resumable_exits() > 0 ? SpawnOutcome::kStoppedResumable : SpawnOutcome::kFinished;
  const detail::WorkerExit& root = failures.front();
  // Every rank failed alike on its own (a bad flag or file each rank reads): one mention of the error, every rank
  // named, no root cause picked among equals.
  const bool alike = failures.size() > 1 && std::all_of(failures.begin(), failures.end(), [&](const auto& f) {
                       return !f.stopped_by_group && f.wait_status == root.wait_status && f.message == root.message;
                     });
  if (alike) {
    std::vector<const detail::WorkerExit*> by_rank;
    for (const auto& f : failures) by_rank.push_back(&f);
    std::sort(by_rank.begin(), by_rank.end(), [](const auto* a, const auto* b) { return a->rank < b->rank; });
    std::string ranks, pids;
    for (const auto* f : by_rank) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(f->rank);
      pids += (pids.empty() ? "" : ", ") + std::to_string(f->pid);
    }
    TORCH_CHECK(false, "ddp::spawn: ranks ", ranks, " of ", nprocs, " (pids ", pids, ") ",
                detail::describe_status(root.wait_status), root.message.empty() ? std::string() : ": " + root.message);
  }
  std::string consequences;
  for (size_t i = 1; i < failures.size(); ++i) {
    const detail::WorkerExit& f = failures[i];
    consequences += (i == 1 ? " (the root cause; then " : "; ") + std::string("rank ") + std::to_string(f.rank) +
                    " (pid " + std::to_string(f.pid) + ") " + detail::describe_status(f.wait_status) +
                    (f.stopped_by_group  ? ", stopped by spawn"
                     : f.message.empty() ? ""
                                         : ": " + f.message);
  }
  if (!consequences.empty()) consequences += ")";
  TORCH_CHECK(false, "ddp::spawn: rank ", root.rank, " of ", nprocs, " (pid ", root.pid, ") ",
              detail::describe_status(root.wait_status), root.message.empty() ? std::string() : ": " + root.message,
              consequences);
}

}  // namespace ddp
