#include <ddp/process_group.h>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ddp/launch/cluster_env.h>
#include <ddp/launch/store_socket.h>
#include <ddp/launch/text.h>
#include <ddp/progress.h>

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
  bool one_node = false;  ///< every rank on this node (LOCAL_WORLD_SIZE == WORLD_SIZE); false when unknown
  std::chrono::milliseconds rendezvous_timeout = kDefaultRendezvousTimeout;
  std::chrono::milliseconds collective_timeout = kDefaultTimeout;
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

/// A timeout: the option when set, else the environment variable (seconds, > 0), else the default.
std::chrono::milliseconds timeout_from(const std::optional<std::chrono::milliseconds>& option, const char* env_name,
                                       std::chrono::milliseconds fallback) {
  if (option) return *option;
  const char* value = std::getenv(env_name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  TORCH_CHECK(*end == '\0' && std::isfinite(seconds) && seconds > 0 && seconds < 1e9, "environment variable ", env_name,
              " must be a positive number of seconds, got '", value, "'");
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(seconds * 1000)));
}

Rendezvous resolve(const InitOptions& options) {
  const std::string& method = options.init_method();
  Rendezvous rdzv;
  if (method == "env://") {
    // The environment supplies whatever the options leave open, so the launcher's contract is checked as a whole.
    const LaunchEnv env = launch_env_from_environment();
    // srun / mpirun start ranks without OMP_NUM_THREADS: as many threads as torchrun would give them (1 when
    // several share the node), so that the job computes as under ddp-launch.
    if (const auto threads = cluster_intra_op_threads(); threads && at::get_num_threads() != *threads) {
      if (env.local_rank == 0) {
        std::cerr << "ddp: " << env.local_world_size << " ranks share this node and OMP_NUM_THREADS is not set: "
                  << "each uses " << *threads << " intra-op thread(s), as torchrun gives its workers (set "
                  << "OMP_NUM_THREADS to choose)\n";
      }
      at::set_num_threads(*threads);
    }
    rdzv.master = {env.master_addr, env.master_port};
    rdzv.rank = options.rank().value_or(env.rank);
    rdzv.world_size = options.world_size().value_or(env.world_size);
    rdzv.local_rank = env.local_rank;
    rdzv.one_node = env.local_world_size == env.world_size && rdzv.world_size == env.world_size;
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
  rdzv.collective_timeout = timeout_from(options.timeout(), kCollectiveTimeoutEnv, kDefaultTimeout);
  rdzv.rendezvous_timeout =
      timeout_from(options.rendezvous_timeout(), kRendezvousTimeoutEnv, kDefaultRendezvousTimeout);
  TORCH_CHECK(rdzv.collective_timeout.count() > 0, "timeout (the collective timeout) must be > 0 ms, got ",
              rdzv.collective_timeout.count());
  TORCH_CHECK(rdzv.rendezvous_timeout.count() > 0, "rendezvous_timeout must be > 0 ms, got ",
              rdzv.rendezvous_timeout.count());
  return rdzv;
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

using Clock = std::chrono::steady_clock;

/// How often a waiting rank says who it is waiting for, at most (a quarter of a shorter rendezvous timeout).
constexpr std::chrono::milliseconds kRendezvousLogInterval{5000};
constexpr std::chrono::milliseconds kMinRendezvousLogInterval{100};
/// How often a waiting rank looks at the store (or the master's port): cheap for the store, quick to notice.
constexpr std::chrono::milliseconds kRendezvousPollInterval{50};
/// Where rank 0 leaves why it gave up, and how long it then waits for the other ranks to read it (two polls).
constexpr const char* kGaveUpKey = "gave_up";
constexpr std::chrono::milliseconds kServerGoodbye{2 * 50};
/// The most groups of missing ranks named in one line; the count says how many there are in all.
constexpr size_t kMaxRankGroupsNamed = 16;

std::string endpoint_name(const Endpoint& endpoint) {
  const bool ipv6 = endpoint.host.find(':') != std::string::npos;
  std::ostringstream out;
  out << (ipv6 ? "[" : "") << endpoint.host << (ipv6 ? "]" : "") << ":" << endpoint.port;
  return out.str();
}

std::string seconds_text(std::chrono::milliseconds duration) {
  std::ostringstream out;
  out << static_cast<double>(duration.count()) / 1000.0 << " s";
  return out.str();
}

/// "rank 3", "ranks 1, 4-7": ascending ranks, runs collapsed.
std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  size_t groups = 0;
  for (size_t i = 0; i < ranks.size(); ++groups) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (groups == kMaxRankGroupsNamed) {
      out << ", ...";
      break;
    }
    out << (groups > 0 ? ", " : "") << ranks[i];
    if (j > i) out << "-" << ranks[j];
    i = j + 1;
  }
  return out.str();
}

/// Tries once, for up to `timeout`, to open a TCP connection to host:port. Returns "" when something accepted
/// it, else why not ("Connection refused", "cannot resolve 'host': ...").
std::string try_connect(const Endpoint& endpoint, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  const int resolved = ::getaddrinfo(endpoint.host.c_str(), std::to_string(endpoint.port).c_str(), &hints, &addresses);
  if (resolved != 0) return "cannot resolve '" + endpoint.host + "': " + ::gai_strerror(resolved);
  std::string why = "no address for '" + endpoint.host + "'";
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int error = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      pollfd waiting{fd, POLLOUT, 0};
      if (::poll(&waiting, 1, static_cast<int>(timeout.count())) == 1) {
        socklen_t length = sizeof(error);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      } else {
        error = ETIMEDOUT;
      }
    }
    ::close(fd);
    if (error == 0) {
      ::freeaddrinfo(addresses);
      return "";
    }
    why = std::strerror(error);
  }
  ::freeaddrinfo(addresses);
  return why;
}

/// The keys of one job, apart from those of an earlier attempt in a store shared with torchrun's agent (which
/// keeps its store across restarts and says which attempt this is in TORCHELASTIC_RESTART_COUNT).
std::string store_prefix() {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return std::string(kStorePrefix) + (restart != nullptr && *restart != '\0' ? std::string("/") + restart : "");
}

/// Where this process's world size came from, for an error: the variable that set it, or the program's option.
std::string world_size_source() {
  // launch_env_from_environment's order: torchrun's, Open MPI's, a Slurm step's, PMI's.
  for (const char* variable :
       {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "PMI_SIZE"}) {
    if (const char* value = std::getenv(variable); value != nullptr && *value != '\0') {
      return std::string(variable) + "=" + value;
    }
  }
  return "InitOptions::world_size";
}

/// Note [rendezvous that gives up]
/// TCPStore's own wait for the workers is silent and counts connections, not ranks: rank 0 alone with
/// WORLD_SIZE=2 waited the full timeout without a word, and its error could not say who was missing. So the
/// store is opened without that wait, every rank registers "rank/<r>" and bumps "joined", and every rank polls
/// "joined" until all WORLD_SIZE ranks are in, logging the missing ranks every few seconds and naming them when
/// the rendezvous timeout expires. A rank other than 0 first probes the master's port itself, so that it can say
/// it is waiting for the master instead of sitting inside TCPStore's connect retries.
class RendezvousWait {
 public:
  explicit RendezvousWait(const Rendezvous& rdzv)
      : rdzv_(rdzv),
        where_(endpoint_name(rdzv.master)),
        start_(Clock::now()),
        deadline_(start_ + rdzv.rendezvous_timeout),
        log_every_(std::clamp(rdzv.rendezvous_timeout / 4, kMinRendezvousLogInterval, kRendezvousLogInterval)),
        next_log_(start_ + log_every_) {}

  c10::intrusive_ptr<c10d::Store> run() {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(rdzv_.master.port);
    options.isServer = rdzv_.rank == 0 && !agent_hosts_store();
    options.waitWorkers = false;  // see the note: we wait for ranks ourselves
    if (!options.isServer) wait_for_master();
    options.timeout = remaining();
    auto store = open_store(options);
    const std::string rank_key = "rank/" + std::to_string(rdzv_.rank);
    const int64_t claims = store_call([&] { return store->add(rank_key, 1); });
    TORCH_CHECK(claims == 1, "rank ", rdzv_.rank, " arrived at the rendezvous at ", where_,
                " twice: two processes were given RANK=", rdzv_.rank, " (check RANK, or --node-rank on every node)");
    // Every rank must be given the same world size: the first rank's is in the store, and the others compare (else
    // a rank told a larger one would wait out the whole timeout for a rank that never comes).
    const std::string mine = std::to_string(rdzv_.world_size);
    const std::vector<uint8_t> first_bytes = store_call([&] {
      return store->compareSet("world_size", std::vector<uint8_t>{}, std::vector<uint8_t>(mine.begin(), mine.end()));
    });
    const std::string first(first_bytes.begin(), first_bytes.end());
    TORCH_CHECK(first == mine, "rank ", rdzv_.rank, " was given world size ", mine, " (", world_size_source(),
                "), but a rank that came to the rendezvous at ", where_, " before it was given ", first,
                ": every rank of a job needs the same");
    int64_t joined = store_call([&] { return store->add("joined", 1); });
    while (joined < rdzv_.world_size) {
      const auto now = Clock::now();
      if (now >= deadline_ || now >= next_log_) {
        const std::vector<int> missing = missing_ranks(*store);
        if (now >= deadline_) {
          const std::string why = rank_list(missing) + " never came (" + std::to_string(joined) + " of " +
                                  std::to_string(rdzv_.world_size) + " ranks joined)";
          if (options.isServer) {
            // Tell the ranks that did come, and give them a moment to read it before the store goes away with
            // this process (else their next poll meets a closed socket, and LibTorch logs a backtrace).
            store_call([&] { store->set(kGaveUpKey, why); });
            std::this_thread::sleep_for(kServerGoodbye);
          }
          give_up(why);
        }
        log("waiting for " + std::to_string(rdzv_.world_size - joined) + " more rank" +
            (rdzv_.world_size - joined == 1 ? "" : "s") + " at " + where_ + " (missing: " + rank_list(missing) + ")");
      }
      sleep_a_little();
      if (store_call([&] { return store->check({kGaveUpKey}); })) {
        const std::vector<uint8_t> why = store_call([&] { return store->get(kGaveUpKey); });
        give_up("rank 0, which hosts it, gave up: " + std::string(why.begin(), why.end()));
      }
      joined = store_call([&] { return store->add("joined", 0); });
    }
    store->setTimeout(rdzv_.collective_timeout);  // from here on, store waits are part of building the backend
    return store;
  }

 private:
  std::chrono::milliseconds remaining() const {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  void sleep_a_little() const { std::this_thread::sleep_for(std::min(kRendezvousPollInterval, remaining())); }

  void log(const std::string& what) {
    std::cerr << "ddp: rank " << rdzv_.rank << ": " << what << " ["
              << seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_)) << " of "
              << seconds_text(rdzv_.rendezvous_timeout) << "]" << std::endl;
    while (next_log_ <= Clock::now()) next_log_ += log_every_;
  }

  void give_up(const std::string& what) const {
    TORCH_CHECK(false, "rank ", rdzv_.rank, " gave up on the rendezvous at ", where_, " after ",
                seconds_text(rdzv_.rendezvous_timeout), ": ", what, " (the rendezvous timeout is set by ",
                kRendezvousTimeoutEnv, ", ddp-launch --rendezvous-timeout-s or InitOptions::rendezvous_timeout)");
  }

  void wait_for_master() {
    for (;;) {
      const std::string why = try_connect(rdzv_.master, std::min(remaining(), log_every_));
      if (why.empty()) return;
      const std::string master = agent_hosts_store() ? "the launcher's store" : "the master (rank 0)";
      if (Clock::now() >= deadline_) give_up(master + " never came: " + why);
      if (Clock::now() >= next_log_) log("waiting for " + master + " at " + where_ + ": " + why);
      sleep_a_little();
    }
  }

  c10::intrusive_ptr<c10d::Store> open_store(c10d::TCPStoreOptions options) const {
    try {
      // Rank 0's store answers on MASTER_ADDR's address only (the loopback address for a one-node job), not on
      // every interface (ddp/launch/store_socket.h).
      if (options.isServer) {
        if (const int fd = detail::store_listen_socket(rdzv_.master.host, rdzv_.master.port, rdzv_.one_node); fd >= 0) {
          options.masterListenFd = fd;
        }
      }
      auto store = c10::make_intrusive<c10d::TCPStore>(rdzv_.master.host, options);
      return c10::make_intrusive<c10d::PrefixStore>(store_prefix(), std::move(store));
    } catch (const std::exception& e) {
      const std::string why = detail::message_of(e);
      if (options.isServer &&
          (contains_case_insensitive(why, "already in use") || why.find("EADDRINUSE") != std::string::npos)) {
        TORCH_CHECK(false, "rank 0 cannot host the rendezvous: port ", rdzv_.master.port, " is already in use (",
                    master_name(rdzv_), "); pick a free port. Cause: ", why);
      }
      if (options.isServer) {
        TORCH_CHECK(false, "rank 0 cannot host the rendezvous at ", master_name(rdzv_), ". Cause: ", why);
      }
      TORCH_CHECK(false, "rank ", rdzv_.rank, " could not reach the master at ", master_name(rdzv_), " within ",
                  seconds_text(rdzv_.rendezvous_timeout),
                  " (is rank 0 running, and is the address reachable from this host?). Cause: ", why);
    }
  }

  /// A store operation; a failure means the master went away (rank 0 gave up or died) while we waited.
  template <typename Fn>
  auto store_call(const Fn& fn) const -> decltype(fn()) {
    try {
      return fn();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", rdzv_.rank, " lost the rendezvous at ", where_,
                  " while waiting for the other ranks (rank 0, which hosts it, probably exited). Cause: ",
                  detail::message_of(e));
    }
  }

  std::vector<int> missing_ranks(c10d::Store& store) const {
    std::vector<int> missing;
    for (int r = 0; r < rdzv_.world_size; ++r) {
      const bool arrived = store_call([&] { return store.check({"rank/" + std::to_string(r)}); });
      if (!arrived) missing.push_back(r);
    }
    return missing;
  }

  const Rendezvous& rdzv_;
  const std::string where_;
  const Clock::time_point start_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds log_every_;
  Clock::time_point next_log_;
};

#ifdef LIBTORCH_AMP_HAVE_GLOO
bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, const Rendezvous& rdzv,
                                            const InitOptions& options) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(rdzv.collective_timeout);
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
  nccl_options->timeout = rdzv.collective_timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rdzv.rank, rdzv.world_size, nccl_options);
}
#endif

// PyTorch 2.11's flight recorder (c10d::FlightRecorder, on by default) adds a group to a process-wide std::map on the
// group's first collective without taking its own lock (recordWithResetEnabled, all_pg_status_), and looks the group
// up there on every later one. Several groups in one process (ranks as threads: the GPU check and its CPU twins)
// that issue collectives at once corrupt that map: a rare SIGSEGV in std::_Rb_tree_insert_and_rebalance. So every
// collective of a group that is not NCCL's is issued holding this lock. Issuing only enqueues (Gloo runs collectives
// on its own threads, and builds its connections in its constructor): the lock is never held while waiting for a
// peer, and one process per rank pays an uncontended lock per collective. NCCL is left out: its first collective
// builds the communicator, which waits for every rank (holding a lock there would deadlock ranks that are threads).
// Its recorder is another instance (FlightRecorder<at::cuda::CUDAEvent>) with the same unlocked insert, so NCCL
// groups that are threads of one process (the GPU check's 2-GPU tests) can still meet the race.
std::mutex& flight_recorder_mutex() {
  static std::mutex mutex;
  return mutex;
}

bool is_nccl(const c10d::Backend& backend) {
#ifdef LIBTORCH_AMP_HAVE_NCCL
  return dynamic_cast<const c10d::ProcessGroupNCCL*>(&backend) != nullptr;
#else
  (void)backend;
  return false;
#endif
}

/// Runs `issue_collective` (a call that enqueues a collective on `backend`) under flight_recorder_mutex unless the
/// backend is NCCL's.
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(const c10d::Backend& backend, Issue&& issue_collective) {
  if (is_nccl(backend)) return issue_collective();
  const std::lock_guard<std::mutex> lock(flight_recorder_mutex());
  return issue_collective();
}

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
  return issue(*backend_, [&] { return backend_->allreduce(tensors, options); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_scatter_sum_async(at::Tensor& output, at::Tensor& input) const {
  TORCH_CHECK(input.numel() == output.numel() * size(), "reduce_scatter: input has ", input.numel(),
              " elements, expected ", size(), " x ", output.numel());
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return issue(*backend_, [&] { return backend_->_reduce_scatter_base(output, input, options); });
}

void ProcessGroup::allgather_into(at::Tensor& output, at::Tensor& input) const {
  wait(allgather_into_async(output, input), "allgather");
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::allgather_into_async(at::Tensor& output, at::Tensor& input) const {
  TORCH_CHECK(output.numel() == input.numel() * size(), "allgather: output has ", output.numel(),
              " elements, expected ", size(), " x ", input.numel());
  return issue(*backend_, [&] { return backend_->_allgather_base(output, input); });
}

void ProcessGroup::allreduce_sum_(at::Tensor& tensor, const std::string& what) const {
  if (size() == 1) return;
  wait(allreduce_sum_async(tensor), what);
}

void ProcessGroup::allreduce_max_(at::Tensor& tensor, const std::string& what) const {
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  wait(issue(*backend_, [&] { return backend_->allreduce(tensors, options); }), what);
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
  try {
    detail::report_collective_begin(what);  // for the launcher's hang detection: a store to memory
    work->wait();
    detail::report_collective_end();
  } catch (const std::exception& e) {
    detail::report_collective_end();
    TORCH_CHECK(false, what, " failed on rank ", rank(), " of ", size(), " (backend ", backend_name_,
                "): a peer process probably exited, or the timeout of ", timeout_.count(),
                " ms expired. Cause: ", detail::message_of(e));
  }
}

void ProcessGroup::broadcast_(at::Tensor& tensor, int root) const {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast root must be in [0, ", size(), "), got ", root);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait(issue(*backend_, [&] { return backend_->broadcast(tensors, options); }), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor) const {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(tensor));
  std::vector<at::Tensor> inputs{tensor};
  wait(issue(*backend_, [&] { return backend_->allgather(outputs, inputs); }), "allgather");
  return outputs[0];
}

void ProcessGroup::barrier() const {
  wait(issue(*backend_, [&] { return backend_->barrier(); }), "barrier");
}

ProcessGroup init_process_group(const InitOptions& options) {
  const std::string& backend = options.backend();
  TORCH_CHECK(backend == "gloo" || backend == "nccl", "backend must be 'gloo' or 'nccl', got '", backend, "'");
  const Rendezvous rdzv = resolve(options);
  TORCH_CHECK(backend_available(backend), "backend '", backend, "' is not built into this libtorch_amp: ",
              backend == "gloo" ? "install gloo's headers (apt-get install libgloo-dev) and reconfigure"
                                : "configure with CUDA and NCCL found");
  auto store = RendezvousWait(rdzv).run();
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
                rdzv.world_size, " ranks met at ", master_name(rdzv), " within ", rdzv.collective_timeout.count(),
                " ms. Cause: ", detail::message_of(e));
  }
  return ProcessGroup(std::move(store), std::move(pg), backend, rdzv.collective_timeout, device);
}

ProcessGroup init_process_group(const LaunchEnv& env, const std::string& backend,
                                std::optional<std::chrono::milliseconds> timeout) {
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
