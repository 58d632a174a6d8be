#include <run/stop_signal.h>

#include <pthread.h>
#include <sched.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

extern char** environ;

namespace run {
namespace {

struct NamedSignal {
  const char* name;
  int number;
};
constexpr NamedSignal kStopSignals[] = {{"TERM", SIGTERM}, {"INT", SIGINT},   {"HUP", SIGHUP},
                                        {"QUIT", SIGQUIT}, {"USR1", SIGUSR1}, {"USR2", SIGUSR2}};

/// The key a signalled rank writes "<w> <rank>" into (under the process group's own prefix).
constexpr const char* kStopKey = "run/stop_signal";

// The handler's state: a lock-free atomic and lines prepared beforehand (write(2) is all a handler may call), per
// signal number.
constexpr int kSignals = 65;     // signal numbers are below this (NSIG on Linux)
std::atomic<int> g_received{0};  // the first stop signal that came (0: none), set by the handler
static_assert(std::atomic<int>::is_always_lock_free, "the handler may only touch a lock-free atomic");
std::atomic<bool> g_installed{false};
struct HandlerLine {
  char text[160];
  size_t size = 0;
};
HandlerLine g_first_line[kSignals];
HandlerLine g_again_line[kSignals];
struct sigaction g_previous[kSignals] {};

extern "C" void on_stop_signal(int signal) {
  const int saved_errno = errno;
  int none = 0;
  const HandlerLine& line =
      g_received.compare_exchange_strong(none, signal) ? g_first_line[signal] : g_again_line[signal];
  (void)!::write(STDERR_FILENO, line.text, line.size);
  errno = saved_errno;
}

void prepare_line(HandlerLine& line, const std::string& text) {
  line.size = std::min(text.size(), sizeof line.text);
  std::memcpy(line.text, text.data(), line.size);
}

std::string upper(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

}  // namespace

int parse_stop_signal(const std::string& name, const std::string& flag) {
  std::string key = upper(name);
  if (key.rfind("SIG", 0) == 0) key.erase(0, 3);
  for (const NamedSignal& s : kStopSignals) {
    if (key == s.name || key == std::to_string(s.number)) return s.number;
  }
  throw std::invalid_argument(
      fmt::format("{} '{}' is not a stop signal: use TERM, INT, HUP, QUIT, USR1 or USR2", flag, name));
}

std::vector<int> parse_stop_signals(const std::string& names, const std::string& flag) {
  std::vector<int> signals;
  for (size_t from = 0;;) {
    const size_t comma = names.find(',', from);
    const int signal = parse_stop_signal(names.substr(from, comma == std::string::npos ? comma : comma - from), flag);
    if (std::find(signals.begin(), signals.end(), signal) == signals.end()) signals.push_back(signal);
    if (comma == std::string::npos) return signals;
    from = comma + 1;
  }
}

std::string stop_signal_name(int signal) {
  for (const NamedSignal& s : kStopSignals) {
    if (s.number == signal) return std::string("SIG") + s.name;
  }
  return "signal " + std::to_string(signal);
}

/// Asks the job's store for the stop key on a thread of its own: the main thread posts a boundary and, at the next
/// one, takes the answer (waiting only when it has not come back yet).
class StopSignal::StoreReader {
 public:
  explicit StoreReader(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~StoreReader() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  StoreReader(const StoreReader&) = delete;
  StoreReader& operator=(const StoreReader&) = delete;

  c10d::Store& store() { return *store_; }

  /// Starts the read of boundary `steps`.
  void post(int64_t steps) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      posted_ = steps;
      answered_ = false;
      value_.clear();
    }
    wake_.notify_all();
  }

  /// The answer of the read posted last: the boundary it was posted at and the key's value ("" when absent);
  /// nullopt when none was posted. Throws what the read threw.
  std::optional<std::pair<int64_t, std::string>> take() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!posted_) return std::nullopt;
    done_.wait(lock, [&] { return answered_; });
    if (!error_.empty()) throw std::runtime_error(error_);
    std::pair<int64_t, std::string> answer{*posted_, value_};
    posted_.reset();
    return answer;
  }

 private:
  void loop() {
    // SCHED_BATCH: woken by post(), this thread does not preempt the training thread that woke it (that cost about
    // 80 us per step on a busy 2-core machine, bench_stop_signal_overhead); it runs when a core is free, as during the
    // step's collectives.
    sched_param normal{};
    ::pthread_setschedparam(::pthread_self(), SCHED_BATCH, &normal);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return quit_ || (posted_ && !answered_); });
      if (quit_) return;
      lock.unlock();
      std::string value;
      std::string error;
      try {
        if (store_->check({kStopKey})) {
          const std::vector<uint8_t> bytes = store_->get(kStopKey);
          value.assign(bytes.begin(), bytes.end());
        }
      } catch (const std::exception& e) {
        error = fmt::format("stop signal: cannot read the job's store: {}", e.what());
        error = error.substr(0, error.find('\n'));
      }
      lock.lock();
      value_ = std::move(value);
      error_ = std::move(error);
      answered_ = true;
      done_.notify_all();
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::optional<int64_t> posted_;
  bool answered_ = false;
  bool quit_ = false;
  std::string value_;
  std::string error_;
  std::thread thread_;  // last: it starts once the members above exist
};

StopSignal::StopSignal(int signal) : StopSignal(std::vector<int>{signal}) {}

StopSignal::StopSignal(std::vector<int> signals) : signals_(std::move(signals)) {
  for (const int signal : signals_) {
    if (signal <= 0 || signal >= kSignals) throw std::invalid_argument("run::StopSignal: no such signal");
  }
  if (signals_.empty()) throw std::invalid_argument("run::StopSignal: no signal to watch");
  if (g_installed.exchange(true)) throw std::logic_error("run::StopSignal: another one is watching already");
  g_received = 0;
  // The rank as the launcher set it (the handler cannot ask the process group, which may not exist yet).
  std::string who = fmt::format("pid {}", ::getpid());
  for (const char* variable : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    const char* rank = std::getenv(variable);
    if (rank != nullptr && *rank != '\0') {
      who = fmt::format("rank {} (pid {})", rank, ::getpid());
      break;
    }
  }
  for (const int signal : signals_) {
    const std::string name = stop_signal_name(signal);
    prepare_line(
        g_first_line[signal],
        fmt::format("{}: got {}: stopping at the next step boundary the ranks agree on, to save it\n", who, name));
    prepare_line(g_again_line[signal],
                 fmt::format("{}: got {}: already stopping (a save under way is not interrupted)\n", who, name));
  }
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // a read or write in progress goes on
  sigemptyset(&action.sa_mask);
  for (const int signal : signals_) sigaddset(&action.sa_mask, signal);  // one handler at a time
  for (const int signal : signals_) ::sigaction(signal, &action, &g_previous[signal]);
}

StopSignal::~StopSignal() {
  reader_.reset();
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  for (const int signal : signals_) {
    // After a stop the process is on its way out: one more signal must not kill it in its teardown.
    ::sigaction(signal, g_received != 0 ? &ignore : &g_previous[signal], nullptr);
  }
  g_installed = false;
}

int StopSignal::signal() const {
  const int received = g_received;
  return received != 0 ? received : signals_.front();
}

bool StopSignal::received() const { return g_received != 0; }

void StopSignal::join(const ddp::ProcessGroup& group) {
  rank_ = group.rank();
  if (group.size() > 1) reader_ = std::make_unique<StoreReader>(group.store());
}

bool StopSignal::stop_after(int64_t steps) {
  if (decision_) return true;
  if (!reader_) {  // one process: no one to agree with
    if (received()) decision_ = StopDecision{steps, steps, rank_};
    return decision_.has_value();
  }
  if (received() && !published_) {  // once; the first writer of the job wins
    const std::string mine = fmt::format("{} {}", steps, rank_);
    try {
      reader_->store().compareSet(kStopKey, std::vector<uint8_t>{}, std::vector<uint8_t>(mine.begin(), mine.end()));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw std::runtime_error("stop signal: cannot write to the job's store: " + what.substr(0, what.find('\n')));
    }
    published_ = true;
  }
  if (const auto answer = reader_->take(); answer && !answer->second.empty()) {
    long long written = 0;
    int rank = 0;
    if (std::sscanf(answer->second.c_str(), "%lld %d", &written, &rank) != 2) {
      throw std::runtime_error(fmt::format("stop signal: the job's store holds '{}' under {}, not '<step> <rank>'",
                                           answer->second, kStopKey));
    }
    if (written < answer->first) decision_ = StopDecision{steps, written, rank};
  }
  if (!decision_) reader_->post(steps);
  return decision_.has_value();
}

std::string StopSignal::describe() const {
  if (!decision_) return "";
  return fmt::format("{} (rank {} got it in step {}): every rank stopped after step {}", stop_signal_name(signal()),
                     decision_->rank, decision_->signalled_at, decision_->step);
}

void requeue_slurm_job() {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job == nullptr || *job == '\0') {
    throw std::runtime_error("--requeue: SLURM_JOB_ID is not set: this is not a Slurm job");
  }
  // An array job's task is "<array job id>_<task id>" (Lightning's requeue does the same).
  std::string id = job;
  const char* array_job = std::getenv("SLURM_ARRAY_JOB_ID");
  const char* array_task = std::getenv("SLURM_ARRAY_TASK_ID");
  if (array_job != nullptr && *array_job != '\0' && array_task != nullptr && *array_task != '\0') {
    id = std::string(array_job) + "_" + array_task;
  }
  int err_pipe[2];
  if (::pipe(err_pipe) != 0) throw std::runtime_error("--requeue: pipe() failed: " + std::string(std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, err_pipe[0]);
  // Note [scontrol outlives the requeue it asks for]: slurmctld requeues the job by cancelling it, and slurmstepd
  // sends SIGCONT and SIGTERM to every process of the step, scontrol included, maybe before scontrol has read the
  // answer (a loaded CI machine saw scontrol killed by SIGTERM after the job was requeued). scontrol runs with the
  // signals a job gets blocked: they stay pending and vanish when it exits; SIGKILL after KillWait still ends it.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t blocked;
  sigemptyset(&blocked);
  for (const NamedSignal& s : kStopSignals) sigaddset(&blocked, s.number);
  posix_spawnattr_setsigmask(&attributes, &blocked);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  std::string program = "scontrol", verb = "requeue";
  char* argv[] = {program.data(), verb.data(), id.data(), nullptr};
  pid_t pid = 0;
  const int spawned = ::posix_spawnp(&pid, "scontrol", &actions, &attributes, argv, environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  ::close(err_pipe[1]);
  std::string err;
  char buffer[512];
  for (ssize_t n; spawned == 0 && (n = ::read(err_pipe[0], buffer, sizeof buffer)) > 0;) {
    err.append(buffer, static_cast<size_t>(n));
  }
  ::close(err_pipe[0]);
  if (spawned != 0) {
    throw std::runtime_error(fmt::format("--requeue: cannot run scontrol: {}", std::strerror(spawned)));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
    const size_t last = err.rfind('\n');
    throw std::runtime_error(
        fmt::format("--requeue: scontrol requeue {} failed ({}){}", id,
                    WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                      : "killed by " + stop_signal_name(WTERMSIG(status)),
                    err.empty() ? "" : ": " + err.substr(last == std::string::npos ? 0 : last + 1)));
  }
}

}  // namespace run
