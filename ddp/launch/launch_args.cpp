// ddp-launch's command line: parse_launch_args and the checks of a LaunchConfig (docs/launcher.md, "Options").
#include <ddp/launch/launcher.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <CLI/CLI.hpp>

#include <ddp/launch/cluster_env.h>
#include <ddp/launch/text.h>
#include <ddp/process_group.h>

namespace ddp {
namespace {

constexpr int kExitUsage = 2;  // CLI11's and most tools' code for a bad command line
constexpr int kMaxPort = 65535;
constexpr int kMaxRestarts = 1000000;  // more is a typo

/// The whole of `text` as an integer in [min_value, max_value]; else an error "<flag> must be <what>, got <text>".
int int_flag(const std::string& flag, const std::string& text, long min_value, long max_value, const char* what) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  const bool whole = !text.empty() && *end == '\0' && errno == 0;
  TORCH_CHECK(whole && value >= min_value && value <= max_value, flag, " must be ", what, ", got ",
              whole ? text : "'" + text + "'");
  return static_cast<int>(value);
}

/// The whole of `text` as seconds (a finite number, > 0 or >= 0 as `positive` says), in milliseconds.
std::chrono::milliseconds seconds_flag(const std::string& flag, const std::string& text, bool positive) {
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  constexpr double kMaxSeconds = 1e9;  // ~30 years: more is a typo, and would overflow the milliseconds
  const bool whole = !text.empty() && *end == '\0' && std::isfinite(seconds);
  TORCH_CHECK(whole && (positive ? seconds > 0 : seconds >= 0) && seconds <= kMaxSeconds, flag, " must be a ",
              positive ? "positive" : "non-negative", " number of seconds, got ", whole ? text : "'" + text + "'");
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

constexpr const char* kUsage = "Usage: ddp-launch [options] [--] program [args...]";

/// CLI11's help with our usage line (its own would read "ddp-launch [OPTIONS]", and a second one in the
/// description made two).
class LaunchHelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override { return std::string(kUsage) + "\n"; }
};

ParsedLaunchArgs usage_error(const std::string& message) {
  ParsedLaunchArgs result;
  result.exit_code = kExitUsage;
  result.output = "ddp-launch: " + message + " (run ddp-launch --help for usage)\n";
  return result;
}

/// torchrun's --nproc-per-node words: gpu, one worker per visible GPU (there must be one); cpu, one per CPU the
/// process may run on; auto, gpu when there is a GPU, else cpu.
int local_world_size(const std::string& word) {
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (word == "gpu" || (word == "auto" && gpus > 0)) {
    TORCH_CHECK(gpus > 0, "--nproc-per-node gpu: no CUDA GPU is visible (use a number, cpu or auto)");
    return gpus;
  }
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  return std::max(1, usable > 0 ? usable : static_cast<int>(std::thread::hardware_concurrency()));
}

/// The launcher option nearest to a misspelled `unknown` ("--nprocs-per-node" -> "--nproc-per-node"): at most 2
/// letters inserted, removed or changed; empty when none is that near.
std::string nearest_option(const CLI::App& app, const std::string& unknown) {
  const auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diagonal = above;
      }
    }
    return row[b.size()];
  };
  std::string best;
  size_t best_distance = 3;
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& name : option->get_lnames()) {
      const size_t d = distance(unknown, "--" + name);
      if (d < best_distance) {
        best_distance = d;
        best = "--" + name;
      }
    }
  }
  return best;
}

}  // namespace

namespace detail {

void validate_launch_config(const LaunchConfig& c) {
  TORCH_CHECK(c.nproc_per_node >= 1, "--nproc-per-node must be a positive integer, got ", c.nproc_per_node);
  TORCH_CHECK(c.nnodes >= 1, "--nnodes must be a positive integer, got ", c.nnodes);
  TORCH_CHECK(!c.min_nodes || (*c.min_nodes >= 1 && *c.min_nodes <= c.nnodes),
              "--nnodes MIN:MAX needs 1 <= MIN <= MAX, got ", c.min_nodes.value_or(0), ":", c.nnodes);
  TORCH_CHECK(c.rejoin_wait.count() >= 0, "--rejoin-wait-s must be a non-negative number of seconds");
  TORCH_CHECK(c.node_rank >= 0 && c.node_rank < c.nnodes, "--node-rank must be in [0, ", c.nnodes, ") for --nnodes ",
              c.nnodes, ", got ", c.node_rank);
  TORCH_CHECK(c.master_port >= 0 && c.master_port <= kMaxPort, "--master-port must be in [0, ", kMaxPort, "], got ",
              c.master_port);
  TORCH_CHECK(c.master_port != 0 || c.nnodes == 1,
              "--master-port 0 (pick a free port) works only with --nnodes 1: the other nodes must know the port");
  TORCH_CHECK(!c.master_addr.empty(), "--master-addr is empty");
  TORCH_CHECK(c.kill_grace.count() >= 0, "--kill-grace-s must be a non-negative number of seconds, got ",
              c.kill_grace.count() / 1000.0);
  TORCH_CHECK(c.stop_grace.count() > 0, "--stop-grace-s must be a positive number of seconds, got ",
              c.stop_grace.count() / 1000.0);
  TORCH_CHECK(!c.rendezvous_timeout || c.rendezvous_timeout->count() > 0,
              "--rendezvous-timeout-s must be a positive number of seconds");
  TORCH_CHECK(!c.collective_timeout || c.collective_timeout->count() > 0,
              "--collective-timeout-s must be a positive number of seconds");
  TORCH_CHECK(c.max_restarts >= 0, "--max-restarts must be a non-negative integer, got ", c.max_restarts);
  TORCH_CHECK(c.hang_timeout.count() >= 0, "--hang-timeout-s must be a non-negative number of seconds, got ",
              c.hang_timeout.count() / 1000.0);
  TORCH_CHECK(!c.command.empty(), "no program given: ddp-launch [options] program [args...]");
}

}  // namespace detail

ParsedLaunchArgs parse_launch_args(int argc, const char* const* argv) {
  LaunchConfig c;
  // Numbers are taken as text and checked here, so that errors read "--nnodes must be a positive integer, got 0"
  // rather than CLI11's "Value 0 not in range 0.000000 to 1797693134862315708145...".
  std::string nproc_per_node, nnodes = "1", node_rank = "0", master_port = std::to_string(c.master_port);
  std::string kill_grace_s = detail::seconds_value(c.kill_grace), rendezvous_timeout_s, collective_timeout_s;
  std::string stop_grace_s = detail::seconds_value(c.stop_grace);
  bool standalone = false;
  std::string max_restarts = std::to_string(c.max_restarts), hang_timeout_s = detail::seconds_value(c.hang_timeout);
  std::string rejoin_wait_s = detail::seconds_value(c.rejoin_wait);
  CLI::App app{
      "ddp-launch: starts a data-parallel job's worker processes on this node with the torchrun environment "
      "contract (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK). Options "
      "come before the program; -- ends them.",
      "ddp-launch"};
  app.formatter(std::make_shared<LaunchHelpFormatter>());
  app.option_defaults()->always_capture_default();  // --help shows each default: "--master-port TEXT=29500"
  // The numbers are read as text (above) but typed in --help as what they are.
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_per_node,
                 "Worker processes on this node (required): a number, or as torchrun: gpu (one per visible GPU), cpu "
                 "(one per CPU), auto (gpu when there is a GPU, else cpu)")
      ->type_name("INT|auto|gpu|cpu");
  app.add_flag("--standalone", standalone,
               "One node on its own, as torchrun's --standalone: its rendezvous on 127.0.0.1 at any free port");
  app.add_option("--nnodes", nnodes,
                 "Nodes in the job; MIN:MAX (elastic): each start of the workers takes the nodes present, at least "
                 "MIN, and a node that joins later is admitted by a restart")
      ->type_name("INT|MIN:MAX");
  app.add_option("--node-rank,--node_rank", node_rank, "This node's rank; node 0 hosts the rendezvous")
      ->type_name("INT");
  app.add_option("--master-addr,--master_addr", c.master_addr, "Address of node 0");
  app.add_option("--master-port,--master_port", master_port,
                 "Rendezvous port on node 0 (0: any free port, one node only)")
      ->type_name("INT");
  app.add_flag("--local-rank-arg", c.local_rank_arg, "Also pass --local-rank=N to each worker");
  app.add_option("--kill-grace-s", kill_grace_s, "After a failure, seconds between SIGTERM and SIGKILL")
      ->type_name("FLOAT");
  app.add_option("--stop-grace-s", stop_grace_s,
                 "After a signal it forwards to the workers (SIGINT, SIGTERM, SIGUSR1, SIGUSR2), seconds they get to "
                 "stop on their own before SIGKILL (a worker that saves on its stop signal and exits 75 ends the job "
                 "as resumable: no restart)")
      ->type_name("FLOAT");
  app.add_option("--rendezvous-timeout-s,--rdzv-timeout-s", rendezvous_timeout_s,
                 "Seconds the workers wait for all ranks to join before giving up (DDP_RENDEZVOUS_TIMEOUT_S; unset: "
                 "the workers' own default)")
      ->type_name("FLOAT")
      ->default_str(detail::seconds_value(kDefaultRendezvousTimeout));
  app.add_option("--collective-timeout-s", collective_timeout_s,
                 "Seconds a collective may take before the workers give up (DDP_COLLECTIVE_TIMEOUT_S; unset: the "
                 "workers' own default)")
      ->type_name("FLOAT")
      ->default_str(detail::seconds_value(kDefaultTimeout));
  app.add_option("--max-restarts,--max_restarts", max_restarts,
                 "After a worker fails, start all workers again up to this many times (TORCHELASTIC_RESTART_COUNT "
                 "tells them which start it is; a program with --checkpoint-dir continues from its newest save)")
      ->type_name("INT");
  app.add_option("--hang-timeout-s", hang_timeout_s,
                 "Seconds a worker may wait in a collective without progress before the worker it waits for is named "
                 "as hung and the workers are stopped (restarted with --max-restarts); the first step and waits for a "
                 "ddp::ProgressPause are not timed; 0: off")
      ->type_name("FLOAT");
  app.add_option("--rejoin-wait-s", rejoin_wait_s,
                 "Elastic (--nnodes MIN:MAX): seconds node 0 waits for missing nodes before the workers start with "
                 "fewer")
      ->type_name("FLOAT");
  app.prefix_command();  // everything from the program on belongs to the program

  ParsedLaunchArgs result;
  try {
    app.parse(argc, argv);
    std::vector<std::string> rest = app.remaining();
    // CLI11 moves an unknown option into the remaining arguments and parses on; "--" stays in them as a marker.
    if (!rest.empty() && rest.front() == "--") {
      rest.erase(rest.begin());
    } else if (!rest.empty() && rest.front().size() > 1 && rest.front().front() == '-') {
      const std::string unknown = rest.front().substr(0, rest.front().find('='));
      const std::string near = nearest_option(app, unknown);
      return usage_error("unknown option '" + unknown + "'" + (near.empty() ? "" : " (did you mean " + near + "?)") +
                         ": launcher options come before the program (put -- before a program whose name starts "
                         "with '-')");
    }
    c.command = std::move(rest);
    TORCH_CHECK(!nproc_per_node.empty(), "--nproc-per-node is required");
    c.nproc_per_node =
        nproc_per_node == "auto" || nproc_per_node == "gpu" || nproc_per_node == "cpu"
            ? local_world_size(nproc_per_node)
            : int_flag("--nproc-per-node", nproc_per_node, 1, INT_MAX, "a positive integer, auto, gpu or cpu");
    if (standalone) {  // torchrun's --standalone: a node of its own, its rendezvous on a free local port
      TORCH_CHECK(nnodes == "1", "--standalone is one node: it cannot go with --nnodes ", nnodes);
      TORCH_CHECK(
          app.count("--master-addr") == 0 && app.count("--master-port") == 0,
          "--standalone picks the rendezvous address and port itself: leave out --master-addr and --master-port");
      c.master_addr = "127.0.0.1";
      master_port = "0";
    }
    if (const size_t colon = nnodes.find(':'); colon != std::string::npos) {
      c.min_nodes = int_flag("--nnodes", nnodes.substr(0, colon), 1, INT_MAX, "N or MIN:MAX with positive integers");
      c.nnodes = int_flag("--nnodes", nnodes.substr(colon + 1), 1, INT_MAX, "N or MIN:MAX with positive integers");
      TORCH_CHECK(*c.min_nodes <= c.nnodes, "--nnodes MIN:MAX needs MIN <= MAX, got ", nnodes);
    } else {
      c.nnodes = int_flag("--nnodes", nnodes, 1, INT_MAX, "a positive integer");
    }
    c.rejoin_wait = seconds_flag("--rejoin-wait-s", rejoin_wait_s, /*positive=*/false);
    c.node_rank = int_flag("--node-rank", node_rank, 0, INT_MAX, "a non-negative integer");
    // Started by srun, one task per node: the nodes, this node's rank and (several nodes) node 0's host come from
    // Slurm, each unless given (with --nnodes MIN:MAX given, the node rank still comes from Slurm). One node keeps
    // the loopback address: its store is then reachable from this machine only.
    if (!standalone) {
      if (const auto slurm = slurm_step_for_launcher()) {
        if (app.count("--nnodes") == 0) c.nnodes = slurm->nnodes;
        if (app.count("--node-rank") == 0) c.node_rank = slurm->node_rank;
        if (app.count("--master-addr") == 0 && c.nnodes > 1) c.master_addr = slurm->env.master_addr;
      }
    }
    c.master_port = int_flag("--master-port", master_port, 0, kMaxPort, "an integer in [0, 65535]");
    c.kill_grace = seconds_flag("--kill-grace-s", kill_grace_s, /*positive=*/false);
    c.stop_grace = seconds_flag("--stop-grace-s", stop_grace_s, /*positive=*/true);
    c.max_restarts = int_flag("--max-restarts", max_restarts, 0, kMaxRestarts, "an integer in [0, 1000000]");
    c.hang_timeout = seconds_flag("--hang-timeout-s", hang_timeout_s, /*positive=*/false);
    if (!rendezvous_timeout_s.empty()) {
      c.rendezvous_timeout = seconds_flag("--rendezvous-timeout-s", rendezvous_timeout_s, /*positive=*/true);
    }
    if (!collective_timeout_s.empty()) {
      c.collective_timeout = seconds_flag("--collective-timeout-s", collective_timeout_s, /*positive=*/true);
    }
    detail::validate_launch_config(c);
  } catch (const CLI::CallForHelp&) {
    result.output = app.help();
    return result;
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  } catch (const c10::Error& e) {
    return usage_error(e.what_without_backtrace());
  }
  result.config = std::move(c);
  return result;
}

}  // namespace ddp
