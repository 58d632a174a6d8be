#include <amp/io/atomic_file.h>

#include <sys/stat.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

std::string pattern_bytes(size_t size, char seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(seed + i * 7);
  return bytes;
}

using test_util::folder_entries;
using test_util::read_file;
using test_util::run_with_file_size_limit;

TEST(AtomicFileTest, WritesAndReplacesWholeFilesKeepingPermissions) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("checkpoint.pt");
  amp::write_file_atomically(path, "first");
  EXPECT_EQ(read_file(path), "first");
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  amp::write_file_atomically(path, pattern_bytes(1 << 20, 'a'));
  EXPECT_EQ(read_file(path), pattern_bytes(1 << 20, 'a'));
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 07777, 0600u);
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"checkpoint.pt"}) << "a temporary file was left";
}

// The old checkpoint survives a writer stopped at any point of the write: before its first byte, after one byte,
// half way, one byte short. The control (a plain overwrite under the same limit) shows the limit does stop the
// write midway and would have destroyed the old file.
TEST(AtomicFileTest, AWriterStoppedMidWriteLeavesTheOldFileWhole) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("model.pt");
  const std::string old_bytes = pattern_bytes(4096, 'o');
  const std::string new_bytes = pattern_bytes(1 << 16, 'n');
  for (const rlim_t limit : {rlim_t{0}, rlim_t{1}, rlim_t{new_bytes.size() / 2}, rlim_t{new_bytes.size() - 1}}) {
    SCOPED_TRACE("file-size limit " + std::to_string(limit));
    amp::write_file_atomically(path, old_bytes);
    const int status = run_with_file_size_limit(limit, [&] { amp::write_file_atomically(path, new_bytes); });
    EXPECT_TRUE(test_util::stopped_by_file_size_limit(status))
        << "the writer was not stopped (status " << status << ")";
    EXPECT_EQ(read_file(path), old_bytes) << "the old file was damaged";

    const int control = run_with_file_size_limit(limit, [&] {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << new_bytes;
    });
    EXPECT_TRUE(WIFSIGNALED(control)) << "control: the plain write was not stopped";
    EXPECT_EQ(read_file(path).size(), limit) << "control: the plain write should leave a truncated file";
  }
}

TEST(AtomicFileTest, FailuresNameThePathAndLeaveNothingBehind) {
  ddp_test::ScratchDir dir;
  const auto expect_failure = [](const std::string& path, const std::string& fragment) {
    try {
      amp::write_file_atomically(path, "bytes");
      ADD_FAILURE() << "writing '" << path << "' should fail";
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("'" + path + "'"), std::string::npos) << message;
      EXPECT_NE(message.find(fragment), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    }
  };
  expect_failure(dir.file("no-such-folder/model.pt"), "No such file or directory");
  ASSERT_EQ(::mkdir(dir.file("folder").c_str(), 0755), 0);
  expect_failure(dir.file("folder"), "it is a folder");
  expect_failure(dir.path() + "/", "names a folder");
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"folder"});
  ::rmdir(dir.file("folder").c_str());
}

}  // namespace
