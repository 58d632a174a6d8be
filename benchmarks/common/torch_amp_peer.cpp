#include "common/torch_amp_peer.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

namespace bench {
namespace {

/// The peer's exit status when its Python has no torch (a skip, not a failure).
constexpr int kExitNoTorch = 3;
/// The child's exit status when exec itself failed.
constexpr int kExitExecFailed = 127;

/// "ok key=value key=value ..." or "ready ..." -> map; the first word is stored under "" .
std::map<std::string, std::string> parse_reply(const std::string& line) {
  std::map<std::string, std::string> fields;
  std::istringstream words(line);
  std::string word;
  words >> fields[""];
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) fields[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return fields;
}

int wait_for_exit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

std::string default_python(const std::string& source_dir) {
  const std::string venv = source_dir + "/.venv/bin/python";
  return access(venv.c_str(), X_OK) == 0 ? venv : std::string("python3");
}

double number_field(const std::map<std::string, std::string>& fields, const std::string& key) {
  const auto it = fields.find(key);
  if (it != fields.end()) {
    try {
      return std::stod(it->second);
    } catch (const std::exception&) {
    }
  }
  throw std::runtime_error(fmt::format("the torch.amp peer's reply has no number '{}'", key));
}

std::unique_ptr<TorchAmpPeer> TorchAmpPeer::start(const TorchPeerRequest& request, std::string* skip_reason) {
  std::vector<std::string> args = {request.python, request.script,
                                   "--bundle",     request.bundle,
                                   "--model",      request.model,
                                   "--device",     request.device,
                                   "--batch-size", std::to_string(request.batch_size),
                                   "--lr",         fmt::format("{}", request.lr)};
  if (request.threads > 0) {
    args.push_back("--threads");
    args.push_back(std::to_string(request.threads));
  }
  args.insert(args.end(), request.model_args.begin(), request.model_args.end());

  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) {
    *skip_reason = "cannot create pipes for the peer";
    return nullptr;
  }
  std::signal(SIGPIPE, SIG_IGN);  // a peer that dies makes our next write fail, not kill us
  const pid_t pid = fork();
  if (pid < 0) {
    *skip_reason = "cannot fork the peer";
    return nullptr;
  }
  if (pid == 0) {
    dup2(to_child[0], STDIN_FILENO);
    dup2(from_child[1], STDOUT_FILENO);
    const int log = open(request.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) dup2(log, STDERR_FILENO);
    for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1], log}) {
      if (fd > STDERR_FILENO) close(fd);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(kExitExecFailed);
  }
  close(to_child[0]);
  close(from_child[1]);
  std::unique_ptr<TorchAmpPeer> peer(new TorchAmpPeer());
  peer->pid_ = pid;
  peer->to_peer_ = fdopen(to_child[1], "w");
  peer->from_peer_ = fdopen(from_child[0], "r");
  peer->log_path_ = request.log_path;
  const std::string line = peer->read_line();
  const auto fields = parse_reply(line);
  if (fields.at("") == "ready" && fields.count("batches") && fields.count("steps")) {
    peer->batch_digest_ = fields.at("batches");
    peer->num_steps_ = std::stoll(fields.at("steps"));
    return peer;
  }
  fclose(peer->to_peer_);
  peer->to_peer_ = nullptr;
  const int code = wait_for_exit(pid);
  peer->pid_ = -1;
  if (code == kExitNoTorch) {
    *skip_reason = request.python + " has no torch";
  } else if (code == kExitExecFailed) {
    *skip_reason = "cannot run " + request.python;
  } else {
    *skip_reason = fmt::format("{} {} did not start ({}; exit status {}, stderr in {})", request.python, request.script,
                               line.empty() ? "no output" : line, code, request.log_path);
  }
  return nullptr;
}

TorchAmpPeer::~TorchAmpPeer() {
  if (to_peer_ != nullptr) {
    std::fputs("quit\n", to_peer_);
    fclose(to_peer_);
  }
  if (from_peer_ != nullptr) fclose(from_peer_);
  if (pid_ > 0) wait_for_exit(pid_);
}

std::string TorchAmpPeer::read_line() {
  std::string line;
  int c = 0;
  while ((c = std::fgetc(from_peer_)) != EOF && c != '\n') line += static_cast<char>(c);
  return line;
}

std::map<std::string, std::string> TorchAmpPeer::call(const std::string& command) {
  if (to_peer_ == nullptr || std::fprintf(to_peer_, "%s\n", command.c_str()) < 0 || std::fflush(to_peer_) != 0) {
    throw std::runtime_error("the torch.amp peer is gone (stderr in " + log_path_ + ")");
  }
  const std::string line = read_line();
  if (line.rfind("ok", 0) == 0) return parse_reply(line);
  if (line.rfind("error ", 0) == 0) throw std::runtime_error(line.substr(6));
  throw std::runtime_error(
      fmt::format("the torch.amp peer answered '{}' to '{}' (stderr in {})", line, command, log_path_));
}

}  // namespace bench
