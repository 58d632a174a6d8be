#include <amp/io/atomic_file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <torch/serialize/archive.h>

namespace amp {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int error) {
  throw std::runtime_error("cannot write '" + path + "': " + what + ": " + std::strerror(error));
}

/// Closes the descriptor and removes the temporary file unless released (the rename succeeded).
class TemporaryFile {
 public:
  TemporaryFile(std::string name, int fd) : name_(std::move(name)), fd_(fd) {}
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!name_.empty()) ::unlink(name_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }
  /// Closes the descriptor, reporting the error close() gives (a delayed write error on some file systems).
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }
  void release() { name_.clear(); }

 private:
  std::string name_;
  int fd_;
};

void write_all(const TemporaryFile& file, const std::string& path, const std::string& bytes) {
  const char* data = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(file.fd(), data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "writing the temporary file '" + file.name() + "' failed", errno);
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  // POSIX calls and plain strings rather than std::filesystem: libtorch.so exports std::filesystem symbols of its
  // own (see tests/ddp/ddp_test_util.h's ScratchDir).
  if (path.empty()) throw std::runtime_error("cannot write a file with an empty path");
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string filename = slash == std::string::npos ? path : path.substr(slash + 1);
  if (filename.empty() || filename == "." || filename == "..") {
    throw std::runtime_error("cannot write '" + path + "': it names a folder, not a file");
  }

  mode_t mode = 0644;
  struct stat existing {};
  if (::stat(path.c_str(), &existing) == 0) {
    if (S_ISDIR(existing.st_mode)) throw std::runtime_error("cannot write '" + path + "': it is a folder");
    mode = existing.st_mode & 07777;
  }
  const std::string name_template = (folder == "/" ? "" : folder) + "/." + filename + ".tmp.XXXXXX";
  std::vector<char> name(name_template.begin(), name_template.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0) fail(path, "cannot create a temporary file in '" + folder + "'", errno);
  TemporaryFile file(name.data(), fd);

  write_all(file, path, bytes);
  if (::fchmod(file.fd(), mode) != 0) fail(path, "setting the permissions of '" + file.name() + "' failed", errno);
  if (::fsync(file.fd()) != 0) fail(path, "flushing '" + file.name() + "' to disk failed", errno);
  if (file.close() != 0) fail(path, "closing '" + file.name() + "' failed", errno);
  if (::rename(file.name().c_str(), path.c_str()) != 0)
    fail(path, "renaming '" + file.name() + "' over it failed", errno);
  file.release();

  // The rename is durable only once the folder's entry is on disk.
  const int dir_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail(path, "opening its folder to flush it failed", errno);
  const int rc = ::fsync(dir_fd);
  const int sync_error = errno;
  ::close(dir_fd);
  // Some file systems cannot fsync a folder (EINVAL); the file itself is then as durable as they allow.
  if (rc != 0 && sync_error != EINVAL) fail(path, "flushing its folder to disk failed", sync_error);
}

void save_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  write_file_atomically(path, bytes.str());
}

}  // namespace amp
