#include "common/torch_amp_peer.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <map>
#include <sstream>

#include <fmt/format.h>

namespace bench {
namespace {

/// The peer's exit status when its Python has no torch (a skip, not a failure).
constexpr int kExitNoTorch = 3;

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

/// "key=value key=value ... [error=free text]" -> map (error, always last, takes the rest of the line).
std::map<std::string, std::string> parse_fields(std::string line) {
  std::map<std::string, std::string> fields;
  const auto error_at = line.find("error=");
  if (error_at != std::string::npos) {
    fields["error"] = line.substr(error_at + std::string("error=").size());
    line.resize(error_at);
  }
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) fields[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return fields;
}

std::optional<double> number(const std::map<std::string, std::string>& fields, const std::string& key) {
  auto it = fields.find(key);
  if (it == fields.end()) return std::nullopt;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

std::string default_python(const std::string& source_dir) {
  const std::string venv = source_dir + "/.venv/bin/python";
  return access(venv.c_str(), X_OK) == 0 ? venv : std::string("python3");
}

std::vector<RunResult> run_torch_amp_peer(const TorchPeerRequest& request, std::string* skip_reason) {
  std::vector<std::string> args = {shell_quote(request.python),
                                   shell_quote(request.script),
                                   "--model",
                                   request.model,
                                   "--device",
                                   shell_quote(request.device),
                                   "--dtypes",
                                   join(request.dtypes, ","),
                                   "--steps",
                                   std::to_string(request.steps),
                                   "--warmup",
                                   std::to_string(request.warmup),
                                   "--rounds",
                                   std::to_string(request.rounds),
                                   "--batch-size",
                                   std::to_string(request.batch_size),
                                   "--seed",
                                   std::to_string(request.seed),
                                   "--lr",
                                   fmt::format("{}", request.lr)};
  if (request.threads > 0) {
    args.push_back("--threads");
    args.push_back(std::to_string(request.threads));
  }
  for (const auto& a : request.model_args) args.push_back(shell_quote(a));
  const std::string command = join(args, " ") + " 2>" + shell_quote(request.log_path);

  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    *skip_reason = "cannot start " + request.python;
    return {};
  }
  std::string output;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == kExitNoTorch) {
    *skip_reason = request.python + " has no torch";
    return {};
  }
  if (code != 0) {
    *skip_reason = fmt::format("{} {} exited with status {} (stderr in {})", request.python, request.script, code,
                               request.log_path);
    return {};
  }

  // One line per dtype: "dtype=bf16 samples_per_s=123.4 step_ms=8.1 final_loss=2.3 [peak_mib=...] [error=...]".
  std::vector<RunResult> rows;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    const auto fields = parse_fields(line);
    if (!fields.count("dtype")) continue;
    RunResult r;
    r.model = request.model;
    r.kind = "torch.amp";
    r.dtype = fields.at("dtype");
    r.config = "torch.amp " + r.dtype;
    if (fields.count("error")) {
      r.error = "torch.amp peer: " + fields.at("error");
    } else if (auto sps = number(fields, "samples_per_s")) {
      r.samples_per_s = *sps;
      r.step_ms = number(fields, "step_ms").value_or(0.0);
      // Its final_loss is left out: the peer trains on random inputs, so its loss is not comparable to ours.
      r.peak_mib = number(fields, "peak_mib");
    } else {
      r.error = "torch.amp peer printed no samples_per_s: " + line;
    }
    rows.push_back(r);
  }
  if (rows.empty()) *skip_reason = "the peer printed no result line (stderr in " + request.log_path + ")";
  return rows;
}

}  // namespace bench
