#include <ddp/process_group.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <utility>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef LIBTORCH_AMP_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef LIBTORCH_AMP_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddp {
namespace {

struct Endpoint {
  std::string host;
  int port = 0;
};

/// Where and who: the master's endpoint and this rank's place in the job, resolved from the options and, where
/// they leave something open, from the environment.
struct Rendezvous {
  Endpoint master;
  int rank = 0;
  int world_size = 1;
  std::optional<int> local_rank;
};

constexpr int kMaxPort = 65535;

int parse_port(const std::string& text, const std::string& init_method) {
  char* end = nullptr;
  const long port = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(!text.empty() && *end == '\0' && port >= 1 && port <= kMaxPort, "init_method '", init_method,
              "' has port '", text, "': expected an integer in [1, ", kMaxPort, "]");
  return static_cast<int>(port);
}

/// Parses "tcp://host:port" (an IPv6 host in brackets: tcp://[::1]:29500).
Endpoint parse_tcp_url(const std::string& init_method) {
  const std::string rest = init_method.substr(std::string("tcp://").size());
  const bool bracketed = !rest.empty() && rest.front() == '[';
  TORCH_CHECK(bracketed || rest.find(':') != std::string::npos, "init_method '", init_method,
              "' has no port: expected tcp://host:port");
  const size_t host_end = bracketed ? rest.find(']') : rest.rfind(':');
  TORCH_CHECK(host_end != std::string::npos && host_end > (bracketed ? 1u : 0u), "init_method '", init_method,
              "' is malformed: expected tcp://host:port");
  const size_t colon = bracketed ? host_end + 1 : host_end;
  TORCH_CHECK(colon < rest.size() && rest[colon] == ':', "init_method '", init_method,
              "' has no port: expected tcp://host:port");
  Endpoint endpoint;
  endpoint.host = bracketed ? rest.substr(1, host_end - 1) : rest.substr(0, host_end);
  endpoint.port = parse_port(rest.substr(colon + 1), init_method);
  return endpoint;
}

int env_int_or(const char* name, std::optional<int> explicit_value, const std::string& init_method) {
  if (explicit_value) return *explicit_value;
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr, "init_method '", init_method, "' needs ", name,
              ": pass it in InitOptions or set the environment variable");
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  TORCH_CHECK(*value != '\0' && *end == '\0', "environment variable ", name, " must be an integer, got '", value, "'");
  return static_cast<int>(parsed);
}

Rendezvous resolve(const InitOptions& options) {
  const std::string& method = options.init_method();
  Rendezvous rdzv;
  if (method == "env://") {
    // The environment supplies whatever the options leave open, so the launcher's contract is checked as a whole.
    const LaunchEnv env = launch_env_from_environment();
    rdzv.master = {env.master_addr, env.master_port};
    rdzv.rank = options.rank().value_or(env.rank);
    rdzv.world_size = options.world_size().value_or(env.world_size);
    rdzv.local_rank = env.local_rank;
  } else if (method.rfind("tcp://", 0) == 0) {
    rdzv.master = parse_tcp_url(method);
    rdzv.world_size = env_int_or("WORLD_SIZE", options.world_size(), method);
    rdzv.rank = env_int_or("RANK", options.rank(), method);
    if (const char* local_rank = std::getenv("LOCAL_RANK")) rdzv.local_rank = std::atoi(local_rank);
  } else {
    TORCH_CHECK(false, "init_method '", method, "' is not supported: use env:// or tcp://host:port");
  }
  TORCH_CHECK(rdzv.world_size >= 1, "world_size must be >= 1, got ", rdzv.world_size);
  TORCH_CHECK(rdzv.rank >= 0 && rdzv.rank < rdzv.world_size, "rank must be in [0, ", rdzv.world_size,
              ") for world_size ", rdzv.world_size, ", got ", rdzv.rank);
  TORCH_CHECK(!rdzv.master.host.empty(), "the master address is empty (init_method '", method, "')");
  return rdzv;
}

/// An exception's message; c10::Error's without its C++ backtrace, which would bury the sentence that matters.
std::string cause_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

bool contains_case_insensitive(std::string text, std::string fragment) {
  auto lower = [](std::string& s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  };
  lower(text);
  lower(fragment);
  return text.find(fragment) != std::string::npos;
}

std::string master_name(const Rendezvous& rdzv) {
  std::ostringstream out;
  out << "MASTER_ADDR=" << rdzv.master.host << " MASTER_PORT=" << rdzv.master.port;
  return out.str();
}

/// torchrun's agent hosts the store itself and says so in TORCHELASTIC_USE_AGENT_STORE; then every rank, rank 0
/// included, is a client (as torch.distributed's _create_c10d_store does).
bool agent_hosts_store() {
  const char* value = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return value != nullptr && std::string(value) == "True";
}

/// Our keys live under a prefix, so a store shared with torchrun's agent never sees them collide.
constexpr const char* kStorePrefix = "libtorch_amp";

/// Rank 0 listens and waits for all ranks to connect; the others connect. Every failure mode of TCPStore's
/// constructor is turned into a sentence that names the endpoint and what to do.
c10::intrusive_ptr<c10d::Store> connect_store(const Rendezvous& rdzv, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(rdzv.master.port);
  store_options.isServer = rdzv.rank == 0 && !agent_hosts_store();
  store_options.numWorkers = static_cast<std::size_t>(rdzv.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(rdzv.master.host, store_options);
    return c10::make_intrusive<c10d::PrefixStore>(kStorePrefix, std::move(store));
  } catch (const std::exception& e) {
    const std::string why = cause_of(e);
    if (store_options.isServer &&
        (contains_case_insensitive(why, "already in use") || why.find("EADDRINUSE") != std::string::npos)) {
      TORCH_CHECK(false, "rank 0 cannot host the rendezvous: port ", rdzv.master.port, " is already in use (",
                  master_name(rdzv), "); pick a free port. Cause: ", why);
    }
    if (store_options.isServer) {
      TORCH_CHECK(false, "rank 0 hosting the rendezvous at ", master_name(rdzv),
                  " did not see all WORLD_SIZE=", rdzv.world_size, " ranks join within ", timeout.count(),
                  " ms. Cause: ", why);
    }
    TORCH_CHECK(false, "rank ", rdzv.rank, " could not reach the master at ", master_name(rdzv), " within ",
                timeout.count(), " ms (is rank 0 running, and is the address reachable from this host?). Cause: ", why);
  }
}

#ifdef LIBTORCH_AMP_HAVE_GLOO
bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, const Rendezvous& rdzv,
                                            const InitOptions& options) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout());
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (!options.gloo_hostname().empty()) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.gloo_hostname()));
  } else if (ifname != nullptr && *ifname != '\0') {
    // torch.distributed's convention: a comma-separated list of interfaces, one Gloo device each.
    std::stringstream names(ifname);
    for (std::string name; std::getline(names, name, ',');) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
  } else if (is_loopback(rdzv.master.host)) {
    // Every rank is on this host: stay on loopback, which works in containers whose host name does not resolve.
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rdzv.rank, rdzv.world_size, gloo_options);
}
#endif

#ifdef LIBTORCH_AMP_HAVE_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, const Rendezvous& rdzv,
                                            const InitOptions& options) {
  const int device_count = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(device_count > 0, "backend 'nccl' needs a CUDA device, but none is visible on rank ", rdzv.rank);
  const int device = options.cuda_device().value_or(rdzv.local_rank.value_or(0));
  TORCH_CHECK(device >= 0 && device < device_count, "backend 'nccl': cuda_device (default LOCAL_RANK) must be in [0, ",
              device_count, ") on this host, got ", device);
  // NCCL binds the communicator to the current device; set it before the first collective, as torchrun users do.
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
  nccl_options->timeout = options.timeout();
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rdzv.rank, rdzv.world_size, nccl_options);
}
#endif

}  // namespace

bool backend_available(const std::string& backend) {
#ifdef LIBTORCH_AMP_HAVE_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef LIBTORCH_AMP_HAVE_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
                           std::string backend_name, std::chrono::milliseconds timeout, c10::Device device)
    : store_(std::move(store)),
      backend_(std::move(backend)),
      backend_name_(std::move(backend_name)),
      timeout_(timeout),
      device_(device) {
  TORCH_CHECK(backend_, "ProcessGroup needs a backend");
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::allreduce_sum_async(at::Tensor& tensor) const {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return backend_->allreduce(tensors, options);
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, what, " failed on rank ", rank(), " of ", size(), " (backend ", backend_name_,
                "): a peer process probably exited, or the timeout of ", timeout_.count(),
                " ms expired. Cause: ", cause_of(e));
  }
}

void ProcessGroup::broadcast_(at::Tensor& tensor, int root) const {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast root must be in [0, ", size(), "), got ", root);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait(backend_->broadcast(tensors, options), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor) const {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(tensor));
  std::vector<at::Tensor> inputs{tensor};
  wait(backend_->allgather(outputs, inputs), "allgather");
  return outputs[0];
}

void ProcessGroup::barrier() const { wait(backend_->barrier(), "barrier"); }

ProcessGroup init_process_group(const InitOptions& options) {
  const std::string& backend = options.backend();
  TORCH_CHECK(backend == "gloo" || backend == "nccl", "backend must be 'gloo' or 'nccl', got '", backend, "'");
  TORCH_CHECK(options.timeout().count() > 0, "timeout must be > 0 ms, got ", options.timeout().count());
  const Rendezvous rdzv = resolve(options);
  TORCH_CHECK(backend_available(backend), "backend '", backend, "' is not built into this libtorch_amp: ",
              backend == "gloo" ? "install gloo's headers (apt-get install libgloo-dev) and reconfigure"
                                : "configure with CUDA and NCCL found");
  auto store = connect_store(rdzv, options.timeout());
  c10::intrusive_ptr<c10d::Backend> pg;
  c10::Device device = c10::kCPU;
  try {
#ifdef LIBTORCH_AMP_HAVE_GLOO
    if (backend == "gloo") pg = make_gloo(store, rdzv, options);
#endif
#ifdef LIBTORCH_AMP_HAVE_NCCL
    if (backend == "nccl") {
      pg = make_nccl(store, rdzv, options);
      device = c10::Device(c10::kCUDA, c10::cuda::current_device());
    }
#endif
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rdzv.rank, " could not build the ", backend, " process group with the ",
                rdzv.world_size, " ranks met at ", master_name(rdzv), " within ", options.timeout().count(),
                " ms. Cause: ", cause_of(e));
  }
  return ProcessGroup(std::move(store), std::move(pg), backend, options.timeout(), device);
}

ProcessGroup init_process_group(const LaunchEnv& env, const std::string& backend, std::chrono::milliseconds timeout) {
  std::ostringstream url;
  const bool ipv6 = env.master_addr.find(':') != std::string::npos;
  url << "tcp://" << (ipv6 ? "[" : "") << env.master_addr << (ipv6 ? "]" : "") << ":" << env.master_port;
  return init_process_group(InitOptions()
                                .backend(backend)
                                .init_method(url.str())
                                .rank(env.rank)
                                .world_size(env.world_size)
                                .timeout(timeout)
                                .cuda_device(env.local_rank));
}

}  // namespace ddp
