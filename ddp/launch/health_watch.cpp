#include <ddp/launch/health_watch.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include <ddp/launch/progress_record.h>

namespace ddp::detail {
namespace {

/// A consistent copy of a record's fields, or nullopt while the worker is writing it.
struct Snapshot {
  int64_t steps = 0;
  HealthWatch::Clock::time_point at;
  bool paused = false;
  bool in_collective = false;
  std::string where;
};

std::optional<Snapshot> read(const ProgressRecord& r, uint32_t sequence) {
  if (sequence % 2 != 0) return std::nullopt;
  Snapshot s;
  s.steps = r.steps.load(std::memory_order_relaxed);
  s.at = HealthWatch::Clock::time_point(std::chrono::nanoseconds(r.at_ns.load(std::memory_order_relaxed)));
  s.paused = r.paused.load(std::memory_order_relaxed) > 0;
  s.in_collective = r.in_collective.load(std::memory_order_relaxed) != 0;
  char where[sizeof(r.where)];
  std::memcpy(where, r.where, sizeof(where));
  where[sizeof(where) - 1] = '\0';
  s.where = where;
  std::atomic_thread_fence(std::memory_order_acquire);
  if (r.sequence.load(std::memory_order_relaxed) != sequence) return std::nullopt;
  return s;
}

}  // namespace

HealthWatch::HealthWatch(const std::string& folder, int attempt, const std::vector<int>& ranks,
                         std::chrono::milliseconds timeout)
    : timeout_(timeout) {
  for (const int rank : ranks) {
    Watched w;
    w.rank = rank;
    w.path = folder + "/attempt" + std::to_string(attempt) + "-rank" + std::to_string(rank) + ".progress";
    const int fd = ::open(w.path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0 && ::ftruncate(fd, sizeof(ProgressRecord)) == 0) {  // zeros: no magic, nothing reported yet
      void* memory = ::mmap(nullptr, sizeof(ProgressRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (memory != MAP_FAILED) w.record = static_cast<ProgressRecord*>(memory);
    }
    if (fd >= 0) ::close(fd);
    if (w.record == nullptr) w.path.clear();  // this worker is not watched; the others are
    workers_.push_back(std::move(w));
  }
}

HealthWatch::~HealthWatch() {
  for (Watched& w : workers_) {
    if (w.record != nullptr) ::munmap(w.record, sizeof(ProgressRecord));
    if (!w.path.empty()) ::unlink(w.path.c_str());
  }
}

std::string HealthWatch::file(int local_rank) const { return workers_.at(static_cast<size_t>(local_rank)).path; }

std::string HealthWatch::describe(const Watched& w, Clock::time_point now, const std::string& waiting) const {
  std::ostringstream message;
  message.precision(3);
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  if (w.paused && w.paused_since) {
    message << "stayed in " << w.where << " for " << seconds(now - *w.paused_since) << " s (" << kPauseTimeoutFactor
            << " x --hang-timeout-s " << seconds(timeout_) << ")";
  } else {
    message << "made no progress for " << seconds(now - *w.last_progress) << " s (--hang-timeout-s "
            << seconds(timeout_) << ")";
  }
  if (!waiting.empty()) message << " while " << waiting << " waited for it";
  message << "; last seen "
          << (w.in_collective ? "waiting for "
              : w.paused      ? "in "
                              : "after ")
          << w.where << " in training step " << w.steps;
  return message.str();
}

std::optional<HealthWatch::Hang> HealthWatch::check(Clock::time_point now, const std::vector<bool>& running) {
  std::vector<size_t> watched;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Watched& w = workers_[i];
    if (w.record == nullptr || w.record->magic.load(std::memory_order_acquire) != ProgressRecord::kMagic) continue;
    if (i < running.size() && !running[i]) continue;
    const uint32_t sequence = w.record->sequence.load(std::memory_order_acquire);
    // The worker's own time of its last event orders the workers exactly; a record being written (or a worker
    // stopped in the middle of a write) keeps the last whole one.
    if (const std::optional<Snapshot> s = read(*w.record, sequence)) {
      w.steps = s->steps;
      w.in_collective = s->in_collective;
      if (s->paused && !w.paused) w.paused_since = s->at;
      w.paused = s->paused;
      w.where = s->where;
      w.last_progress = s->at;
    }
    if (!w.last_progress) w.last_progress = now;
    if (w.paused) last_pause_ = now;
    // Watched from the second training step on: the first one sets everything up (rendezvous, buckets).
    if (w.steps >= 2) watched.push_back(i);
  }
  // A pause past its limit: the paused worker hangs (a save that never returns holds everyone).
  for (const size_t i : watched) {
    const Watched& w = workers_[i];
    if (w.paused && w.paused_since && now - *w.paused_since >= kPauseTimeoutFactor * timeout_) {
      return Hang{static_cast<int>(i), describe(w, now, ""), *w.paused_since};
    }
  }
  // A hang: a worker waited in a collective for the timeout, since its last event and since the last pause.
  std::vector<int> waiting;
  for (const size_t i : watched) {
    const Watched& w = workers_[i];
    const Clock::time_point since = last_pause_ ? std::max(*w.last_progress, *last_pause_) : *w.last_progress;
    if (w.in_collective && !w.paused && now - since >= timeout_) waiting.push_back(w.rank);
  }
  if (waiting.empty()) return std::nullopt;
  // Named: the worker they wait for. Of those not waiting in a collective, the oldest last event; else the oldest.
  std::optional<size_t> named;
  for (const size_t i : watched) {
    const Watched& w = workers_[i];
    const auto better = [&](const Watched& other) {
      if (w.in_collective != other.in_collective) return !w.in_collective;
      return *w.last_progress < *other.last_progress;
    };
    if (!named || better(workers_[*named])) named = i;
  }
  const Watched& w = workers_[*named];
  std::vector<int> others;
  for (const int rank : waiting) {
    if (rank != w.rank) others.push_back(rank);
  }
  std::string who;
  for (size_t k = 0; k < others.size(); ++k) who += (k == 0 ? "rank " : ", ") + std::to_string(others[k]);
  if (others.size() > 1) who = "ranks" + who.substr(4);
  return Hang{static_cast<int>(*named), describe(w, now, who), *w.last_progress};
}

}  // namespace ddp::detail
