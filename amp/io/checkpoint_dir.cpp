#include <amp/io/checkpoint_dir.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <torch/serialize/archive.h>

#include <amp/io/archive_error.h>

namespace amp {
namespace {

// POSIX calls rather than std::filesystem, as in atomic_file.cpp: libtorch.so exports std::filesystem symbols of its
// own (tests/ddp/ddp_test_util.h's ScratchDir).

bool is_folder(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

/// mkdir -p: creates `path` and its missing parents. Throws naming the folder that could not be made.
void make_folders(const std::string& path) {
  if (is_folder(path)) return;
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) make_folders(path.substr(0, slash));
  if (::mkdir(path.c_str(), 0755) != 0 && !(errno == EEXIST && is_folder(path))) {
    throw std::runtime_error("amp::CheckpointDir: cannot create the folder '" + path + "': " + std::strerror(errno));
  }
}

constexpr const char* kPrefix = "step-";
constexpr const char* kSuffix = ".pt";
constexpr size_t kStepDigits = 12;

/// The step a file name of path_for's form holds; nullopt for any other name.
std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = kPrefix;
  const std::string suffix = kSuffix;
  if (name.size() != prefix.size() + kStepDigits + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  int64_t step = 0;
  for (size_t i = prefix.size(); i < prefix.size() + kStepDigits; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

}  // namespace

CheckpointDir::CheckpointDir(std::string folder, int64_t keep_last)
    : folder_(std::move(folder)), keep_last_(keep_last) {
  if (folder_.empty()) throw std::invalid_argument("amp::CheckpointDir: the folder name is empty");
  if (keep_last_ < 1) {
    throw std::invalid_argument("amp::CheckpointDir: keep_last must be at least 1, got " + std::to_string(keep_last_));
  }
  struct stat info {};
  if (::stat(folder_.c_str(), &info) == 0 && !S_ISDIR(info.st_mode)) {
    throw std::invalid_argument("amp::CheckpointDir: '" + folder_ + "' exists and is not a folder");
  }
}

std::string CheckpointDir::in_folder(const std::string& name) const {
  return (folder_.back() == '/' ? folder_ : folder_ + "/") + name;
}

std::string CheckpointDir::path_for(int64_t step) const {
  if (step < 0) throw std::invalid_argument("amp::CheckpointDir: step must be >= 0, got " + std::to_string(step));
  char name[32];
  std::snprintf(name, sizeof name, "%s%0*lld%s", kPrefix, static_cast<int>(kStepDigits), static_cast<long long>(step),
                kSuffix);
  return in_folder(name);
}

std::vector<CheckpointDir::Entry> CheckpointDir::list() const {
  std::vector<Entry> entries;
  DIR* dir = ::opendir(folder_.c_str());
  if (dir == nullptr) {
    if (errno == ENOENT) return entries;  // no folder yet: no checkpoints
    throw std::runtime_error("amp::CheckpointDir: cannot list '" + folder_ + "': " + std::strerror(errno));
  }
  while (const dirent* item = ::readdir(dir)) {
    const std::string name = item->d_name;
    const auto step = step_of(name);
    if (!step) continue;
    const std::string path = path_for(*step);
    if (is_file(path)) entries.push_back({*step, path});
  }
  ::closedir(dir);
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.step > b.step; });
  return entries;
}

std::string CheckpointDir::save(int64_t step, const std::function<void(const std::string& path)>& write) const {
  make_folders(folder_);
  const std::string path = path_for(step);
  write(path);
  prune();
  return path;
}

void CheckpointDir::prune() const {
  const std::vector<Entry> entries = list();
  if (entries.size() <= static_cast<size_t>(keep_last_)) return;
  std::vector<std::string> pruned;  // file names
  for (size_t i = static_cast<size_t>(keep_last_); i < entries.size(); ++i) {
    ::unlink(entries[i].path.c_str());  // one already gone (another process pruned it) is no error
    pruned.push_back(entries[i].path.substr(entries[i].path.find_last_of('/') + 1));
  }
  // A sharded ZeRO checkpoint's shard files ("<checkpoint>.zero-<generation>-<rank>-of-<N>") go with it.
  DIR* dir = ::opendir(folder_.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> companions;
  while (const dirent* item = ::readdir(dir)) {
    const std::string name = item->d_name;
    for (const std::string& checkpoint : pruned) {
      if (name.size() > checkpoint.size() + 6 && name.compare(0, checkpoint.size() + 6, checkpoint + ".zero-") == 0) {
        companions.push_back(name);
      }
    }
  }
  ::closedir(dir);
  for (const std::string& name : companions) ::unlink(in_folder(name).c_str());
}

std::optional<CheckpointDir::Entry> CheckpointDir::load_newest(
    const std::function<void(const std::string& path)>& load,
    const std::function<void(const std::string& line)>& warn) const {
  const std::vector<Entry> entries = list();
  for (const Entry& entry : entries) {
    try {
      load(entry.path);
      return entry;
    } catch (const std::exception& e) {
      const std::string line = "skipping " + entry.path + ": " + exception_line(e);
      if (warn) {
        warn(line);
      } else {
        std::fprintf(stderr, "warning: %s\n", line.c_str());
      }
    }
  }
  if (!entries.empty()) {
    throw std::runtime_error("amp::CheckpointDir: none of the " + std::to_string(entries.size()) +
                             " checkpoint(s) in '" + folder_ + "' could be loaded (each was named above)");
  }
  return std::nullopt;
}

void check_archive_readable(const std::string& path) {
  try {
    // load_from parses the archive's data.pkl, which reads every tensor record it names: a truncated, cut or
    // overwritten file fails here.
    torch::serialize::InputArchive archive;
    archive.load_from(path);
  } catch (const std::exception& e) {
    throw std::runtime_error("cannot read '" + path + "' as a checkpoint: " + exception_line(e));
  }
}

}  // namespace amp
