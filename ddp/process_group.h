#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/launch/launch_env.h>

namespace ddp {

/// torch.distributed's default collective timeout (30 minutes): long enough for a slow first step, short enough
/// that a lost peer ends the job instead of holding its machines forever. Tests pass seconds.
constexpr std::chrono::milliseconds kDefaultTimeout{30 * 60 * 1000};

/// How long the rendezvous waits for every rank to arrive (10 minutes, torchrun's join timeout): a node that
/// never comes ends the job with an error naming the missing ranks instead of a silent half-hour wait.
constexpr std::chrono::milliseconds kDefaultRendezvousTimeout{10 * 60 * 1000};

/// Environment variables through which a launcher (ddp-launch --collective-timeout-s / --rendezvous-timeout-s,
/// ddp::spawn's options) sets the two timeouts of workers that leave them unset in InitOptions. Seconds, > 0.
constexpr const char* kCollectiveTimeoutEnv = "DDP_COLLECTIVE_TIMEOUT_S";
constexpr const char* kRendezvousTimeoutEnv = "DDP_RENDEZVOUS_TIMEOUT_S";

/// How to meet the other processes and which backend to talk through.
struct InitOptions {
  /// "gloo" (CPU tensors, and CUDA tensors staged through the host) or "nccl" (CUDA tensors).
  TORCH_ARG(std::string, backend) = "gloo";
  /// "env://": MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and LOCAL_*) from the environment (ddp-launch,
  /// torchrun, ddp::spawn); "tcp://host:port": rank 0 listens on host:port, rank and world_size come from the
  /// options below or, when unset there, from RANK / WORLD_SIZE.
  TORCH_ARG(std::string, init_method) = "env://";
  /// Overrides RANK; required with tcp:// when RANK is not set.
  TORCH_ARG(std::optional<int>, rank) = std::nullopt;
  /// Overrides WORLD_SIZE; required with tcp:// when WORLD_SIZE is not set.
  TORCH_ARG(std::optional<int>, world_size) = std::nullopt;
  /// The collective timeout: bounds every collective (and building the backend once all ranks have met); past
  /// it, the call throws instead of waiting. Unset: DDP_COLLECTIVE_TIMEOUT_S (seconds) when set, else
  /// kDefaultTimeout (30 minutes).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
  /// The rendezvous timeout: bounds reaching the master and waiting for all ranks to join. While waiting, each
  /// rank logs "rank R: waiting for N more ranks at HOST:PORT" to stderr every few seconds (5 s, or a quarter of
  /// the timeout when that is shorter); past it, the call throws an error naming the ranks that never came.
  /// Unset: DDP_RENDEZVOUS_TIMEOUT_S (seconds) when set, else kDefaultRendezvousTimeout (10 minutes).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, rendezvous_timeout) = std::nullopt;
  /// Gloo only: the address this rank's Gloo device binds to. Empty: GLOO_SOCKET_IFNAME when set, else the
  /// loopback address when the master is local (127.x, localhost), else the address the host name resolves to.
  TORCH_ARG(std::string, gloo_hostname) = "";
  /// NCCL only: the CUDA device index this rank uses (default: LOCAL_RANK from the environment, else 0).
  TORCH_ARG(std::optional<int>, cuda_device) = std::nullopt;
};

/// A process group: this rank's view of the job's communicator, and the store it met the others through.
/// Cheap to copy (shared handles). Collectives of the group must be issued in the same order on every rank.
class ProcessGroup {
 public:
  /// Wraps a backend that is already built, the store its ranks met through, the backend's name ("gloo", "nccl")
  /// and the collective timeout it was built with. `device`: where this group's collectives take tensors (CPU for
  /// Gloo, which also takes CUDA tensors; the rank's CUDA device for NCCL). Throws c10::Error when `backend` is null.
  /// init_process_group() is the usual way to get one.
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
               std::string backend_name, std::chrono::milliseconds timeout, c10::Device device = c10::kCPU);

  /// This process's rank in the group, 0 <= rank() < size().
  int rank() const { return backend_->getRank(); }
  /// The number of ranks in the group (the world size).
  int size() const { return backend_->getSize(); }
  /// The backend's name, "gloo" or "nccl".
  const std::string& backend_name() const { return backend_name_; }
  /// The collective timeout the backend was built with.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Where bookkeeping tensors for this group's collectives must live (see the constructor).
  c10::Device device() const { return device_; }
  /// The c10d backend, for collectives this class does not wrap.
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  /// The store the ranks met through (from init_process_group(): the TCPStore rank 0 hosts).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  /// Starts an in-place SUM allreduce of `tensor` (dense, contiguous, same shape and dtype on every rank) and
  /// returns its work; wait on it with wait(). Host syncs: none (Gloo runs it on its own threads).
  c10::intrusive_ptr<c10d::Work> allreduce_sum_async(at::Tensor& tensor) const;

  /// Starts a SUM reduce-scatter: `input` (contiguous 1-D, size() * output.numel() elements, same on every rank) is
  /// summed over the ranks and this rank receives elements [rank * n, (rank + 1) * n) of the sum in `output` (n =
  /// output.numel()). Wait on it with wait(). Host syncs: none.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_sum_async(at::Tensor& output, at::Tensor& input) const;

  /// Blocking all-gather into one flat tensor: `output` (contiguous 1-D, size() * input.numel() elements) receives
  /// rank q's `input` at [q * n, (q + 1) * n). Same dtype on every rank.
  void allgather_into(at::Tensor& output, at::Tensor& input) const;
  /// Starts the all-gather of allgather_into and returns its work; wait on it with wait(). `output` and `input` must
  /// stay alive and untouched until then. Host syncs: none.
  c10::intrusive_ptr<c10d::Work> allgather_into_async(at::Tensor& output, at::Tensor& input) const;

  /// Blocking in-place SUM allreduce of a small tensor (flags, norms).
  void allreduce_sum_(at::Tensor& tensor, const std::string& what) const;
  /// In-place MAX allreduce of a small tensor (FP8 amaxes; a NaN on any rank wins), waited on as wait() does.
  void allreduce_max_(at::Tensor& tensor, const std::string& what) const;

  /// Waits for `work`; a failure (peer gone, timeout) is rethrown as a c10::Error that says which operation
  /// (`what`) failed on which rank and why. Blocks the host for Gloo; for NCCL it only orders the current stream.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const;

  /// Blocking broadcast of `tensor` from rank `root` into every rank's `tensor` (same shape and dtype everywhere).
  void broadcast_(at::Tensor& tensor, int root) const;

  /// Blocking allgather: returns one tensor per rank, in rank order, each shaped like `tensor` (which must have
  /// the same shape and dtype on every rank).
  std::vector<at::Tensor> allgather(const at::Tensor& tensor) const;

  /// Blocking barrier over all ranks.
  void barrier() const;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string backend_name_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
};

/// Meets the other ranks as `options` says and returns the process group. Rank 0 hosts the rendezvous store
/// (a TCPStore) on the master's port; every rank then builds the backend over it.
///
/// Every rank registers its rank in the store and waits until all WORLD_SIZE ranks have, logging who is missing
/// every few seconds (see InitOptions::rendezvous_timeout).
///
/// Throws c10::Error naming the offending variable or value when: a launcher variable (or a timeout variable) is
/// missing or malformed; the init method is not env:// or tcp://host:port; the backend is unknown or not built
/// in; the master's port is already in use (rank 0); two processes claim the same rank; the master cannot be
/// reached, or not all WORLD_SIZE ranks join, within the rendezvous timeout (the error lists the ranks that
/// never came); the backend cannot be built within the collective timeout.
ProcessGroup init_process_group(const InitOptions& options = {});

/// Shorthand: the environment contract already read (ddp::launch_env_from_environment()), a backend name, and
/// a collective timeout (unset: as InitOptions::timeout). The rendezvous timeout is InitOptions' default.
ProcessGroup init_process_group(const LaunchEnv& env, const std::string& backend = "gloo",
                                std::optional<std::chrono::milliseconds> timeout = std::nullopt);

/// Whether a backend ("gloo", "nccl") was compiled into this build of libtorch_amp.
bool backend_available(const std::string& backend);

}  // namespace ddp
