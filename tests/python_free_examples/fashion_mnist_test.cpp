#include "common/fashion_mnist.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
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
  auto a = examples::synthetic_fashion_mnist(16, 3);
  auto b = examples::synthetic_fashion_mnist(16, 3);
  auto c = examples::synthetic_fashion_mnist(16, 4);
  EXPECT_TRUE(torch::equal(a.images, b.images));
  EXPECT_FALSE(torch::equal(a.images, c.images));
  EXPECT_EQ(a.images.sizes(), torch::IntArrayRef({16, 1, 28, 28}));
}

}  // namespace
