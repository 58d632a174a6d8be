#include <amp/io/archive_error.h>

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"

namespace {

/// What LibTorch itself says when it reads `bytes` as an archive from a file ("" when it reads them).
std::string load_error(const std::string& bytes) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("archive.pt");
  std::ofstream(path, std::ios::binary) << bytes;
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

std::string random_bytes(size_t n) {
  std::mt19937 rng(7);
  std::string bytes(n, '\0');
  for (auto& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

TEST(ShortArchiveErrorTest, LibTorchsMessageForRandomOrTruncatedBytesBecomesItsReason) {
  torch::serialize::OutputArchive good;
  good.write("weights", torch::ones({64}));
  std::ostringstream out;
  good.save_to(out);
  const std::string whole = out.str();
  const std::pair<std::string, std::string> cases[] = {
      {random_bytes(4096), "damaged or truncated zip archive (failed finding central directory)"},
      {whole.substr(0, whole.size() / 2), "damaged or truncated zip archive (failed finding central directory)"},
      {whole.substr(0, whole.size() - 1), "damaged or truncated zip archive (failed finding central directory)"},
      {"", "damaged or truncated zip archive (not a ZIP archive)"},
  };
  for (const auto& [bytes, expected] : cases) {
    const std::string message = load_error(bytes);
    // The premise: LibTorch's own message is a paragraph (over 300 characters in 2.11).
    ASSERT_NE(message.find("PytorchStreamReader failed"), std::string::npos) << message;
    EXPECT_EQ(amp::short_archive_error(message), expected) << message;
  }
}

TEST(ShortArchiveErrorTest, AFailureInsideTheArchiveKeepsWhatFailedAndTheTextBeforeIt) {
  EXPECT_EQ(amp::short_archive_error("while reading x: PytorchStreamReader failed locating file data/0: file not "
                                     "found. This is an internal miniz error. If you are seeing this error, there is "
                                     "a high likelihood that your checkpoint file is corrupted."),
            "while reading x: unreadable zip archive (locating file data/0: file not found)");
}

TEST(ShortArchiveErrorTest, AnyOtherMessageIsUnchanged) {
  EXPECT_EQ(amp::short_archive_error("its 'model' part fails its checksum"), "its 'model' part fails its checksum");
  EXPECT_EQ(amp::short_archive_error(""), "");
}

}  // namespace
