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

std::optional<HealthWatch::Hang> HealthWatch::check(Clock::time_point now) {
  std::optional<size_t> oldest;
  std::vector<size_t> watched;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Watched& w = workers_[i];
    if (w.record == nullptr || w.record->magic.load(std::memory_order_acquire) != ProgressRecord::kMagic) continue;
    const uint32_t sequence = w.record->sequence.load(std::memory_order_acquire);
    const std::optional<Snapshot> s = read(*w.record, sequence);
    if (s) {
      w.steps = s->steps;
      w.in_collective = s->in_collective;
      w.where = s->where;
    }
    // The worker's own time of its last event orders the workers exactly; a record being written (or a worker
    // stopped in the middle of a write) keeps the time of the last whole one.
    if (s) w.last_progress = s->at;
    if (!w.last_progress) w.last_progress = now;
    // A paused worker holds the others too: they wait for it in their next collective.
    if (s && s->paused) last_pause_ = now;
    // Watched from the second training step on: the first one sets everything up (rendezvous, buckets).
    if (w.steps < 2) continue;
    watched.push_back(i);
    if (!oldest || *w.last_progress < *workers_[*oldest].last_progress) oldest = i;
  }
  bool any_stuck = false;
  for (const size_t i : watched) {
    const Clock::time_point since =
        last_pause_ ? std::max(*workers_[i].last_progress, *last_pause_) : *workers_[i].last_progress;
    any_stuck = any_stuck || now - since >= timeout_;
  }
  if (!any_stuck) return std::nullopt;
  const Watched& w = workers_[*oldest];
  std::ostringstream message;
  message.precision(3);
  message << "made no progress for " << std::chrono::duration<double>(now - *w.last_progress).count()
          << " s (--hang-timeout-s " << std::chrono::duration<double>(timeout_).count() << "); last seen "
          << (w.in_collective ? "waiting for " : "after ") << w.where << " in training step " << w.steps;
  return Hang{static_cast<int>(*oldest), message.str()};
}

}  // namespace ddp::detail
