#include <ddp/launch/cluster_env.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <limits>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace ddp {
namespace {

using detail::env_value;
using detail::parse_env_int;

constexpr long kMaxInt = std::numeric_limits<int>::max();
constexpr int kMpiDefaultPort = 29500;  // torchrun's
constexpr int kSlurmPortBase = 15000;   // Lightning's: 15000 + the job id's last 4 digits
constexpr int kSlurmPortWithoutJob = 12910;

/// A variable's value in error messages: NAME='value'.
std::string named(const std::string& name, const std::string& value) { return c10::str(name, "='", value, "'"); }

/// The first of `names` that is set: (name, value).
std::optional<std::pair<std::string, std::string>> first_set(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto value = env_value(name)) return std::make_pair(std::string(name), *value);
  }
  return std::nullopt;
}

int required_int(std::initializer_list<const char*> names, long min_value, long max_value, const std::string& who) {
  const auto found = first_set(names);
  TORCH_CHECK(found.has_value(), who, ": ", *names.begin(), " is not set");
  return parse_env_int(found->second, found->first, min_value, max_value);
}

/// "01-03" or "07" inside brackets: the names' numbers with their zero padding.
void expand_range(const std::string& prefix, const std::string& range, const std::string& suffix,
                  std::vector<std::string>& out, const std::string& what, const std::string& text) {
  const auto bad = [&](const std::string& why) {
    return c10::str(named(what, text), " does not parse as a Slurm hostlist: ", why);
  };
  const size_t dash = range.find('-');
  const std::string first = range.substr(0, dash);
  const std::string last = dash == std::string::npos ? first : range.substr(dash + 1);
  const auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 9 &&
           std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
  };
  TORCH_CHECK(digits(first) && digits(last), bad("'" + range + "' is not a number or a range of numbers"));
  const long lo = std::stol(first), hi = std::stol(last);
  TORCH_CHECK(lo <= hi, bad("the range '" + range + "' runs backwards"));
  TORCH_CHECK(hi - lo < 100000, bad("the range '" + range + "' is too long"));
  for (long n = lo; n <= hi; ++n) {
    std::string number = std::to_string(n);
    if (number.size() < first.size()) number.insert(0, first.size() - number.size(), '0');
    out.push_back(prefix + number + suffix);
  }
}

/// One comma-free (outside brackets) host expression: "node[01-03]x[1,2]" -> its names, left to right.
void expand_host(const std::string& host, std::vector<std::string>& out, const std::string& what,
                 const std::string& text) {
  const size_t open = host.find('[');
  if (open == std::string::npos) {
    TORCH_CHECK(host.find(']') == std::string::npos,
                c10::str(named(what, text), " does not parse as a Slurm hostlist: ']' without '['"));
    out.push_back(host);
    return;
  }
  const size_t close = host.find(']', open);
  TORCH_CHECK(close != std::string::npos,
              c10::str(named(what, text), " does not parse as a Slurm hostlist: '[' without ']'"));
  const std::string prefix = host.substr(0, open);
  const std::string inside = host.substr(open + 1, close - open - 1);
  TORCH_CHECK(!inside.empty(), c10::str(named(what, text), " does not parse as a Slurm hostlist: empty '[]'"));
  std::vector<std::string> tails;
  expand_host(host.substr(close + 1), tails, what, text);  // the rest may hold more brackets
  size_t begin = 0;
  while (begin <= inside.size()) {
    const size_t comma = std::min(inside.find(',', begin), inside.size());
    std::vector<std::string> heads;
    expand_range(prefix, inside.substr(begin, comma - begin), "", heads, what, text);
    for (const auto& head : heads) {
      for (const auto& tail : tails) out.push_back(head + tail);
    }
    begin = comma + 1;
  }
}

/// This node's index among the step's nodes: SLURMD_NODENAME's place in the node list, else SLURM_NODEID.
int slurm_node_index(const std::vector<std::string>& nodes, int node_count) {
  if (const auto name = env_value("SLURMD_NODENAME")) {
    const auto it = std::find(nodes.begin(), nodes.end(), *name);
    if (it != nodes.end()) return static_cast<int>(it - nodes.begin());
  }
  return required_int({"SLURM_NODEID"}, 0, node_count - 1, "a Slurm job step");
}

/// Whether SLURM_STEP_ID names a job step that srun started: a number below Slurm's special step ids (0xFFFFFFF0 and
/// up: the batch script's step, salloc's interactive and extern steps, which srun passes on as "%u", and newer
/// Slurm as negative numbers).
bool srun_step(const std::optional<std::string>& step) {
  if (!step || step->empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long id = std::strtoll(step->c_str(), &end, 10);
  return errno == 0 && *end == '\0' && id >= 0 && id < 0xFFFFFFF0LL;
}

std::optional<ClusterEnv> slurm() {
  const auto step = env_value("SLURM_STEP_ID");
  if (!env_value("SLURM_PROCID") || !srun_step(step)) return std::nullopt;
  const std::string who = "a Slurm job step";
  ClusterEnv c;
  c.launcher = Launcher::kSlurm;
  LaunchEnv& env = c.env;
  env.world_size = required_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, 1, kMaxInt, who);
  env.rank = parse_env_int(*env_value("SLURM_PROCID"), "SLURM_PROCID", 0, env.world_size - 1);
  const auto nodelist = first_set({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  TORCH_CHECK(nodelist.has_value(), who, ": SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) is not set");
  const std::vector<std::string> nodes = expand_slurm_hostlist(nodelist->second, nodelist->first);
  const int node_count = static_cast<int>(nodes.size());
  const int node = slurm_node_index(nodes, node_count);
  const auto per_node = first_set({"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  TORCH_CHECK(per_node.has_value(), who, ": SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE) is not set");
  const std::vector<int> tasks = expand_slurm_tasks_per_node(per_node->second, per_node->first);
  TORCH_CHECK(static_cast<int>(tasks.size()) == node_count, who, ": ", named(per_node->first, per_node->second),
              " lists ", tasks.size(), " node(s), ", named(nodelist->first, nodelist->second), " ", node_count);
  env.local_world_size = tasks[static_cast<size_t>(node)];
  c.nnodes = node_count;
  c.node_rank = node;
  env.local_rank = required_int({"SLURM_LOCALID"}, 0, env.local_world_size - 1, who);
  const auto job = env_value("SLURM_JOB_ID");
  if (const auto addr = env_value("MASTER_ADDR"); addr && !addr->empty()) {
    env.master_addr = *addr;
  } else {
    env.master_addr = nodes.front();
  }
  if (const auto port = env_value("MASTER_PORT")) {
    env.master_port = parse_env_int(*port, "MASTER_PORT", 1, 65535);
  } else if (job) {
    const std::string id = job->substr(job->size() > 4 ? job->size() - 4 : 0);
    env.master_port = kSlurmPortBase + parse_env_int(id, "the last digits of SLURM_JOB_ID", 0, 9999);
  } else {
    env.master_port = kSlurmPortWithoutJob;
  }
  const bool even = std::all_of(tasks.begin(), tasks.end(), [&](int n) { return n == tasks.front(); });
  c.origin = c10::str("launched by slurm: job ", job.value_or("?"), ", step ", *step, ", ", node_count, " node",
                      node_count == 1 ? "" : "s", " x ", even ? std::to_string(tasks.front()) : "(uneven)", " task",
                      even && tasks.front() == 1 ? "" : "s", even ? "" : " " + per_node->second);
  return c;
}

/// `hydra_only`: MPICH / Intel MPI only when their launcher's local variables are there too (srun --mpi=pmi2 sets
/// PMI_RANK and PMI_SIZE alone, and the Slurm step then says the rest).
std::optional<ClusterEnv> mpi(bool hydra_only) {
  const bool open_mpi = env_value("OMPI_COMM_WORLD_RANK").has_value();
  if (!open_mpi && !env_value("PMI_RANK")) return std::nullopt;
  if (!open_mpi && hydra_only && !env_value("MPI_LOCALRANKID")) return std::nullopt;
  ClusterEnv c;
  c.launcher = open_mpi ? Launcher::kOpenMpi : Launcher::kPmi;
  const std::string who = open_mpi ? "Open MPI (mpirun)" : "MPICH / Intel MPI (PMI)";
  LaunchEnv& env = c.env;
  const char* rank_var = open_mpi ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK";
  env.world_size = required_int({open_mpi ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE"}, 1, kMaxInt, who);
  env.rank = parse_env_int(*env_value(rank_var), rank_var, 0, env.world_size - 1);
  env.local_world_size =
      required_int({open_mpi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS"}, 1, env.world_size, who);
  env.local_rank =
      required_int({open_mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "MPI_LOCALRANKID"}, 0, env.local_world_size - 1, who);
  const auto addr = env_value("MASTER_ADDR");
  TORCH_CHECK(addr && !addr->empty(), "launched by ", who, " (", named(rank_var, *env_value(rank_var)),
              "), but MASTER_ADDR is not set: MPI does not say which host rank 0 is on; pass it to every rank, e.g. ",
              open_mpi ? "mpirun -x MASTER_ADDR=<rank 0's host>" : "mpiexec -genv MASTER_ADDR <rank 0's host>");
  env.master_addr = *addr;
  const auto port = env_value("MASTER_PORT");
  env.master_port = port ? parse_env_int(*port, "MASTER_PORT", 1, 65535) : kMpiDefaultPort;
  const int nodes = env.world_size / env.local_world_size;
  c.nnodes = std::max(1, nodes);
  c.node_rank = env.rank / env.local_world_size;
  const std::string node_text =
      env.world_size % env.local_world_size == 0 ? c10::str(" (", nodes, " node", nodes == 1 ? "" : "s", ")") : "";
  c.origin = c10::str("launched by ", who, ": ", env.world_size, " process", env.world_size == 1 ? "" : "es", ", ",
                      env.local_world_size, " per node", node_text);
  return c;
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& text, const std::string& what) {
  TORCH_CHECK(!text.empty(), c10::str(named(what, text), " is empty: no host to take rank 0's address from"));
  std::vector<std::string> hosts;
  int depth = 0;
  size_t begin = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    const char ch = i < text.size() ? text[i] : ',';
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    TORCH_CHECK(depth == 0 || depth == 1,
                c10::str(named(what, text), " does not parse as a Slurm hostlist: brackets do not pair up"));
    if (ch == ',' && depth == 0) {
      const std::string host = text.substr(begin, i - begin);
      TORCH_CHECK(!host.empty(), c10::str(named(what, text), " does not parse as a Slurm hostlist: an empty name"));
      expand_host(host, hosts, what, text);
      begin = i + 1;
    }
  }
  TORCH_CHECK(depth == 0, c10::str(named(what, text), " does not parse as a Slurm hostlist: '[' without ']'"));
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what) {
  std::vector<int> out;
  size_t begin = 0;
  const auto bad = [&] {
    return c10::str(named(what, text), " does not parse as Slurm's tasks per node (e.g. 4(x2),3)");
  };
  TORCH_CHECK(!text.empty(), bad());
  while (begin <= text.size()) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, comma - begin);
    const size_t paren = item.find("(x");
    int count = 0, repeat = 1;
    try {
      count = parse_env_int(item.substr(0, paren), what, 1, kMaxInt);
      if (paren != std::string::npos) {
        TORCH_CHECK(item.back() == ')', bad());
        repeat = parse_env_int(item.substr(paren + 2, item.size() - paren - 3), what, 1, 1000000);
      }
    } catch (const c10::Error&) {
      TORCH_CHECK(false, bad());
    }
    out.insert(out.end(), static_cast<size_t>(repeat), count);
    begin = comma + 1;
  }
  return out;
}

std::optional<ClusterEnv> cluster_env_from_environment() {
  if (env_value("RANK") && env_value("WORLD_SIZE")) return std::nullopt;  // torchrun's variables win
  // MPI before Slurm: mpirun inside an allocation starts its daemons with srun, and the ranks on other nodes inherit
  // the daemons' step (its SLURM_PROCID is the daemon's index).
  if (auto c = mpi(/*hydra_only=*/true)) return c;
  if (auto c = slurm()) return c;
  return mpi(/*hydra_only=*/false);
}

std::optional<ClusterEnv> slurm_step_for_launcher() {
  auto c = slurm();
  if (!c) return std::nullopt;
  TORCH_CHECK(c->env.local_world_size == 1, "ddp-launch in a Slurm job step of ", c->env.local_world_size,
              " tasks on this node (SLURM_STEP_TASKS_PER_NODE='", env_value("SLURM_STEP_TASKS_PER_NODE").value_or("?"),
              "'): each task would start its own workers; start one ddp-launch per node (srun --ntasks-per-node=1 "
              "ddp-launch --nproc-per-node N ...), or let srun start the workers themselves (srun --ntasks-per-node=N "
              "program ...)");
  return c;
}

std::optional<int> cluster_intra_op_threads() {
  if (env_value("OMP_NUM_THREADS")) return std::nullopt;
  const auto c = cluster_env_from_environment();
  if (!c || c->env.local_world_size <= 1) return std::nullopt;
  if (c->launcher == Launcher::kSlurm) {
    if (const auto cpus = env_value("SLURM_CPUS_PER_TASK"))
      return parse_env_int(*cpus, "SLURM_CPUS_PER_TASK", 1, 1 << 20);
  }
  return 1;
}

}  // namespace ddp
