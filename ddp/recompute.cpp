#include <ddp/recompute.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include <torch/csrc/autograd/engine.h>

namespace ddp {
namespace {

thread_local bool recomputing = false;

/// The live NestedBackwardScopes, innermost last. Process-wide, not per thread: autograd runs a nested backward on
/// another thread when the reentrant depth passes its limit, and a multi-GPU module's nodes (DDP's hooks included)
/// on each device's own thread. DDP runs one backward at a time.
std::mutex scopes_mutex;
std::vector<NestedBackwardScope*>& scopes() {
  static std::vector<NestedBackwardScope*> live;
  return live;
}

}  // namespace

bool in_recompute() { return recomputing; }

RecomputeScope::RecomputeScope() : previous_(recomputing) { recomputing = true; }
RecomputeScope::~RecomputeScope() { recomputing = previous_; }

NestedBackwardScope::NestedBackwardScope() {
  std::lock_guard<std::mutex> lock(scopes_mutex);
  scopes().push_back(this);
}

NestedBackwardScope::~NestedBackwardScope() {
  if (finished_) return;
  std::lock_guard<std::mutex> lock(scopes_mutex);  // unwinding: the held work is dropped with the failed backward
  auto& live = scopes();
  live.erase(std::remove(live.begin(), live.end(), this), live.end());
}

void NestedBackwardScope::finish() {
  std::vector<std::function<void()>> held;
  {
    std::lock_guard<std::mutex> lock(scopes_mutex);
    if (finished_) return;
    finished_ = true;
    auto& live = scopes();
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
    held.swap(held_);
  }
  for (auto& callback : held) queue_end_of_backward(std::move(callback));
}

void queue_end_of_backward(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(scopes_mutex);
    if (!scopes().empty()) {
      scopes().back()->held_.push_back(std::move(callback));
      return;
    }
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace ddp
