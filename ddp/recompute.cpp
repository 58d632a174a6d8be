#include <ddp/recompute.h>

#include <utility>

#include <torch/csrc/autograd/engine.h>

namespace ddp {
namespace {

thread_local bool recomputing = false;
thread_local NestedBackwardScope* innermost = nullptr;

}  // namespace

bool in_recompute() { return recomputing; }

RecomputeScope::RecomputeScope() : previous_(recomputing) { recomputing = true; }
RecomputeScope::~RecomputeScope() { recomputing = previous_; }

NestedBackwardScope::NestedBackwardScope() : previous_(innermost) { innermost = this; }

NestedBackwardScope::~NestedBackwardScope() {
  if (!finished_) innermost = previous_;  // unwinding: the held work is dropped with the failed backward
}

void NestedBackwardScope::finish() {
  if (finished_) return;
  finished_ = true;
  innermost = previous_;
  for (auto& callback : held_) queue_end_of_backward(std::move(callback));
  held_.clear();
}

void queue_end_of_backward(std::function<void()> callback) {
  if (innermost != nullptr) {
    innermost->held_.push_back(std::move(callback));
    return;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace ddp
