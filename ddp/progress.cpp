#include <ddp/progress.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <ddp/launch/progress_record.h>

namespace ddp {
namespace {

/// This process's record, mapped at first use from DDP_PROGRESS_FILE; nullptr when there is none (not launched by
/// ddp-launch with hang detection, or the file cannot be mapped: then progress is not reported, nothing fails).
detail::ProgressRecord* record() noexcept {
  static detail::ProgressRecord* const mapped = []() -> detail::ProgressRecord* {
    const char* path = std::getenv(detail::kProgressFileEnv);
    if (path == nullptr || *path == '\0') return nullptr;
    const int fd = ::open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    void* memory = ::mmap(nullptr, sizeof(detail::ProgressRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (memory == MAP_FAILED) return nullptr;
    auto* r = static_cast<detail::ProgressRecord*>(memory);
    r->magic.store(detail::ProgressRecord::kMagic, std::memory_order_release);
    return r;
  }();
  return mapped;
}

/// One progress event: `change` updates the counters, `where` (when given) replaces the text, under the sequence lock.
template <typename Change>
void report(const char* where, size_t length, const Change& change) noexcept {
  detail::ProgressRecord* r = record();
  if (r == nullptr) return;
  // One writer at a time (a collective may be waited for on an autograd thread while the main thread reports).
  static std::mutex writing;
  const std::lock_guard<std::mutex> lock(writing);
  r->sequence.fetch_add(1, std::memory_order_relaxed);  // odd: being written
  std::atomic_thread_fence(std::memory_order_release);  // ... before any of the writes below is seen
  change(*r);
  r->at_ns.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(),
      std::memory_order_relaxed);
  if (where != nullptr) {
    const size_t n = std::min(length, sizeof(r->where) - 1);
    std::memcpy(r->where, where, n);
    r->where[n] = '\0';
  }
  r->sequence.fetch_add(1, std::memory_order_release);  // even: whole
}

void nothing(detail::ProgressRecord&) noexcept {}

}  // namespace

ProgressPause::ProgressPause(const char* what) noexcept {
  report(what, std::strlen(what), [](detail::ProgressRecord& r) { r.paused.fetch_add(1, std::memory_order_relaxed); });
}

ProgressPause::~ProgressPause() {
  report(nullptr, 0, [](detail::ProgressRecord& r) { r.paused.fetch_sub(1, std::memory_order_relaxed); });
}

void report_progress(const char* where) noexcept { report(where, std::strlen(where), nothing); }

namespace detail {

void report_step() noexcept {
  constexpr const char kForward[] = "the forward of a training step";
  report(kForward, sizeof(kForward) - 1, [](ProgressRecord& r) { r.steps.fetch_add(1, std::memory_order_relaxed); });
}

void report_collective_begin(const std::string& what) noexcept {
  report(what.data(), what.size(), [](ProgressRecord& r) { r.in_collective.store(1, std::memory_order_relaxed); });
}

void report_collective_end() noexcept {
  report(nullptr, 0, [](ProgressRecord& r) { r.in_collective.store(0, std::memory_order_relaxed); });
}

}  // namespace detail
}  // namespace ddp
