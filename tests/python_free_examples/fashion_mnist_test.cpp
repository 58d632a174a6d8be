#include "common/fashion_mnist.h"
#include "common/example_flags.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef LIBTORCH_AMP_HAVE_ZLIB
#include <zlib.h>
#endif

#include "test_util.h"

namespace {

// std::filesystem is avoided on purpose: libtorch.so exports a broken copy of std::filesystem::remove_all that
// the dynamic linker may bind to (a segfault seen with torch 2.11).
bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, uint8_t first_value) {
  std::vector<uint8_t> bytes = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  size_t count = 1;
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<uint8_t>(d >> shift));
    count *= d;
  }
  for (size_t i = 0; i < count; ++i) bytes.push_back(static_cast<uint8_t>(first_value + i));
  return bytes;
}

class IdxFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = "/tmp/lta_idx_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    for (const auto& path : written_) std::remove(path.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string path_of(const std::string& name) {
    written_.push_back(dir_ + "/" + name);
    return written_.back();
  }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = path_of(name);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
  }
  std::string dir_;
  std::vector<std::string> written_;
};

TEST_F(IdxFileTest, ReadsShapeAndValues) {
  auto t = examples::read_idx_file(write("x-idx3-ubyte", idx_bytes({2, 3, 4}, 10)));
  EXPECT_EQ(t.sizes(), torch::IntArrayRef({2, 3, 4}));
  EXPECT_EQ(t.flatten()[0].item<int>(), 10);
  EXPECT_EQ(t.flatten()[23].item<int>(), 33);
}

#ifdef LIBTORCH_AMP_HAVE_ZLIB
TEST_F(IdxFileTest, ReadsGzipCompressedFiles) {
  const auto bytes = idx_bytes({5}, 7);
  const std::string path = path_of("y-idx1-ubyte.gz");
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  auto t = examples::read_idx_file(path);
  EXPECT_TRUE(torch::equal(t, torch::arange(7, 12).to(torch::kUInt8)));
}
#endif

using test_util::expect_error;

#ifdef LIBTORCH_AMP_HAVE_ZLIB
// zlib's gzerror() text lives in the gzFile: it was read after gzclose() freed it (a use after free that printed
// bytes changing from run to run; AddressSanitizer reports it in this test).
TEST_F(IdxFileTest, TruncatedAndCorruptGzipAreNamedInPrintableText) {
  const auto bytes = idx_bytes({64, 28, 28}, 1);
  const std::string whole = path_of("whole.gz");
  gzFile f = gzopen(whole.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  std::ifstream in(whole, std::ios::binary);
  const std::string gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<uint8_t> cut(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2));
  std::vector<uint8_t> junk(gz.begin(), gz.begin() + 10);
  for (int i = 0; i < 4000; ++i) junk.push_back(static_cast<uint8_t>((i * 2654435761u) >> 13));
  for (const auto& [name, content] :
       {std::pair<std::string, std::vector<uint8_t>>{"cut-idx3-ubyte.gz", cut}, {"junk-idx3-ubyte.gz", junk}}) {
    const std::string path = write(name, content);
    try {
      examples::read_idx_file(path);
      ADD_FAILURE() << path << " was read without an error";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("cannot decompress Fashion-MNIST file " + path + ": "), std::string::npos) << message;
      const auto bad = std::find_if(message.begin(), message.end(), [](char c) { return c < 0x20 || c >= 0x7f; });
      EXPECT_EQ(bad, message.end()) << "a non-printable byte in: " << message;
    }
  }
}
#endif

TEST_F(IdxFileTest, TruncatedFileIsNamed) {
  auto bytes = idx_bytes({4, 4}, 0);
  bytes.resize(bytes.size() - 3);
  const std::string path = write("t-idx2-ubyte", bytes);
  expect_error([&] { examples::read_idx_file(path); }, path + " holds 13 data bytes but its header promises 16");
}

TEST_F(IdxFileTest, BadMagicIsNamed) {
  const std::string path = write("bad", {1, 2, 3, 4, 5, 6, 7, 8});
  expect_error([&] { examples::read_idx_file(path); }, path + " is not an unsigned-byte IDX file");
}

TEST_F(IdxFileTest, MissingSplitNamesPathAndRemedy) {
  expect_error([&] { examples::load_fashion_mnist(dir_, true); },
               dir_ + "/train-images-idx3-ubyte[.gz] not found. Install the data");
}

TEST_F(IdxFileTest, LoadsASplitNormalized) {
  write("t10k-images-idx3-ubyte", idx_bytes({3, 28, 28}, 0));
  write("t10k-labels-idx1-ubyte", idx_bytes({3}, 4));
  auto split = examples::load_fashion_mnist(dir_, false);
  EXPECT_EQ(split.images.sizes(), torch::IntArrayRef({3, 1, 28, 28}));
  EXPECT_EQ(split.images.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(split.labels, torch::tensor({4, 5, 6}, torch::kInt64)));
  EXPECT_NEAR(split.images.flatten()[0].item<double>(), -0.2860 / 0.3530, 1e-5);
}

TEST(FashionMnistTest, RealDataSetHasTheExpectedShapes) {
  if (!file_exists(std::string(examples::kDefaultFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST is not installed at " << examples::kDefaultFashionMnistDir
                 << " (apt-get install dataset-fashion-mnist)";
  }
  auto test = examples::load_fashion_mnist(examples::kDefaultFashionMnistDir, false);
  EXPECT_EQ(test.images.sizes(), torch::IntArrayRef({10000, 1, 28, 28}));
  EXPECT_EQ(test.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(test.labels.max().item<int64_t>(), 9);
}

TEST(FashionMnistTest, SyntheticDataIsDeterministicPerSeed) {
  auto a = examples::synthetic_fashion_mnist(16, 3, /*train=*/true);
  auto b = examples::synthetic_fashion_mnist(16, 3, /*train=*/true);
  auto c = examples::synthetic_fashion_mnist(16, 4, /*train=*/true);
  auto test = examples::synthetic_fashion_mnist(16, 3, /*train=*/false);
  EXPECT_TRUE(torch::equal(a.images, b.images));
  EXPECT_FALSE(torch::equal(a.images, c.images));
  EXPECT_FALSE(torch::equal(a.images, test.images)) << "the test split repeats the training samples";
  EXPECT_EQ(a.images.sizes(), torch::IntArrayRef({16, 1, 28, 28}));
}

// --synthetic must be a task that can be learned: what the training split teaches (here, each class's mean image)
// classifies the test split. Before, the two splits were drawn from unrelated class patterns: chance (~10%).
// It must also not be learned at once (issue 27: 100% after one epoch of 1000 samples, so a --synthetic run could
// show no regression): the class means name the group of similar classes (Note [synthetic difficulty]) but not the
// class within it. Measured by this test (LTA_TEST_SEED=0..7, the accuracies are recorded as properties in
// --gtest_output=xml): group 0.921-0.960, class 0.636-0.720; the generator before this one: class > 0.99.
TEST(FashionMnistTest, SyntheticTestSplitIsLearnableButNotAtOnce) {
  examples::CommonFlags flags;
  flags.synthetic = true;
  flags.seed = test_util::fresh_seed();
  const examples::Data data = examples::load_data(flags);
  constexpr int64_t kClasses = 10;
  const auto train_x = data.train.images.flatten(1);
  auto means = torch::zeros({kClasses, train_x.size(1)});
  for (int64_t c = 0; c < kClasses; ++c) means[c] = train_x.index({data.train.labels == c}).mean(0);
  const auto predicted = torch::cdist(data.test.images.flatten(1), means).argmin(1);
  const auto rate = [](const torch::Tensor& hits) { return hits.to(torch::kDouble).mean().item<double>(); };
  // Fashion-MNIST's groups: tops 0 2 4 6, footwear 5 7 9, and 1, 3, 8 alone.
  const auto group_of = torch::tensor({0, 2, 0, 3, 0, 1, 0, 1, 4, 1}, torch::kInt64);
  const double group_accuracy = rate(group_of.index({predicted}).eq(group_of.index({data.test.labels})));
  const double class_accuracy = rate(predicted.eq(data.test.labels));
  RecordProperty("group_accuracy", std::to_string(group_accuracy));
  RecordProperty("class_accuracy", std::to_string(class_accuracy));
  EXPECT_GT(group_accuracy, 0.85) << "seed " << flags.seed;
  EXPECT_GT(class_accuracy, 0.5) << "seed " << flags.seed;
  EXPECT_LT(class_accuracy, 0.85) << "seed " << flags.seed << ": the classes are told apart at a glance";
  // Every class appears in the test split.
  EXPECT_EQ(torch::bincount(data.test.labels, {}, kClasses).gt(0).sum().item<int64_t>(), kClasses);
}

}  // namespace
