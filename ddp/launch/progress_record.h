#pragma once

#include <atomic>
#include <cstdint>

namespace ddp::detail {

/// Note [progress records]
/// Hang detection (ddp-launch --hang-timeout-s) needs to know whether each worker still makes progress, without a
/// host sync or a system call added to a training step. The launcher gives each worker a small file
/// (DDP_PROGRESS_FILE), both map it, and the worker's library code writes one of these records into it at each step
/// and each collective: a few stores to memory. The launcher reads it every kStopPollInterval; a record whose
/// last event (`at_ns`, a clock read through the vDSO: no system call either) is older than the hang timeout, while
/// not paused and after the first step, is a hang; its time also orders the workers' last events. The
/// sequence is also a lock for the text: the writer makes it odd while it writes and even after, and a reader that
/// saw it odd or changed keeps the copy it had (a worker stopped in the middle of a write is still seen to hang).
struct ProgressRecord {
  static constexpr uint32_t kMagic = 0x4c544150;  ///< "PATL": a file of this layout
  std::atomic<uint32_t> magic;
  std::atomic<uint32_t> sequence;      ///< bumped twice by every progress event
  std::atomic<int64_t> steps;          ///< training forwards begun (DistributedDataParallel::forward with grad)
  std::atomic<int64_t> at_ns;          ///< when the last event happened: steady_clock (CLOCK_MONOTONIC, host-wide)
  std::atomic<int32_t> paused;         ///< ProgressPause depth: > 0 while the rank is busy with untimed work
  std::atomic<int32_t> in_collective;  ///< 1 while waiting for a collective to complete
  char where[176];                     ///< the last event: "the allreduce of gradient bucket 3 of 5 (...)"
};

constexpr const char* kProgressFileEnv = "DDP_PROGRESS_FILE";

}  // namespace ddp::detail
