#include <ddp/launch/launch_env.h>

#include <ddp/launch/cluster_env.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <c10/util/Exception.h>

namespace ddp {
namespace detail {

int parse_env_int(const std::string& text, const std::string& what, long min_value, long max_value) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(!text.empty() && end != nullptr && *end == '\0' && errno == 0, what, " must be an integer, got '", text,
              "'");
  TORCH_CHECK(value >= min_value && value <= max_value, what, " must be in [", min_value, ", ", max_value, "], got ",
              value);
  return static_cast<int>(value);
}

std::optional<std::string> env_value(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace detail
namespace {

using detail::env_value;
using detail::parse_env_int;

std::string require_env(const char* name) {
  auto value = env_value(name);
  TORCH_CHECK(value.has_value(), "environment variable ", name,
              " is not set: start the program with ddp-launch or torchrun, or set MASTER_ADDR, MASTER_PORT, RANK "
              "and WORLD_SIZE yourself");
  TORCH_CHECK(!value->empty(), "environment variable ", name, " is set but empty");
  return *value;
}

constexpr long kMaxInt = std::numeric_limits<int>::max();
constexpr long kMaxPort = 65535;

bool torchrun_contract() { return env_value("RANK").has_value() && env_value("WORLD_SIZE").has_value(); }

}  // namespace

bool launched_by_launcher() { return torchrun_contract() || cluster_env_from_environment().has_value(); }

LaunchEnv launch_env_from_environment() {
  if (!torchrun_contract()) {
    if (auto cluster = cluster_env_from_environment()) return cluster->env;
  }
  LaunchEnv env;
  env.master_addr = require_env("MASTER_ADDR");
  env.master_port = parse_env_int(require_env("MASTER_PORT"), "MASTER_PORT", 1, kMaxPort);
  env.world_size = parse_env_int(require_env("WORLD_SIZE"), "WORLD_SIZE", 1, kMaxInt);
  env.rank = parse_env_int(require_env("RANK"), "RANK", 0, env.world_size - 1);
  const auto local_world_size = env_value("LOCAL_WORLD_SIZE");
  env.local_world_size =
      local_world_size ? parse_env_int(*local_world_size, "LOCAL_WORLD_SIZE", 1, env.world_size) : env.world_size;
  const auto local_rank = env_value("LOCAL_RANK");
  env.local_rank = local_rank ? parse_env_int(*local_rank, "LOCAL_RANK", 0, env.local_world_size - 1)
                              : env.rank % env.local_world_size;
  return env;
}

std::optional<int> parse_local_rank_arg(int argc, const char* const* argv) {
  static constexpr const char* kSpellings[] = {"--local_rank", "--local-rank"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    for (const char* spelling : kSpellings) {
      const std::string prefix = std::string(spelling) + "=";
      if (arg.compare(0, prefix.size(), prefix) == 0) {
        return parse_env_int(arg.substr(prefix.size()), spelling, 0, kMaxInt);
      }
      if (arg == spelling) {
        TORCH_CHECK(i + 1 < argc, spelling, " needs a value");
        return parse_env_int(argv[i + 1], spelling, 0, kMaxInt);
      }
    }
  }
  return std::nullopt;
}

}  // namespace ddp
