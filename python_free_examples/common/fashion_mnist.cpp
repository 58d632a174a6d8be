#include "fashion_mnist.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#ifdef LIBTORCH_AMP_HAVE_ZLIB
#include <zlib.h>
#endif

namespace examples {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

std::vector<uint8_t> read_all_bytes(const std::string& path) {
  std::vector<uint8_t> bytes;
  if (ends_with(path, ".gz")) {
#ifdef LIBTORCH_AMP_HAVE_ZLIB
    gzFile file = gzopen(path.c_str(), "rb");
    TORCH_CHECK(file != nullptr, "cannot open ", path);
    std::array<uint8_t, 1 << 16> buffer{};
    int n = 0;
    while ((n = gzread(file, buffer.data(), buffer.size())) > 0)
      bytes.insert(bytes.end(), buffer.data(), buffer.data() + n);
    int err = Z_OK;
    const char* message = gzerror(file, &err);
    // gzerror's text belongs to the gzFile: copy it before gzclose frees it.
    std::string reason = message != nullptr && *message != '\0' ? message : "corrupt gzip data";
    if (reason.rfind(path + ": ", 0) == 0) reason.erase(0, path.size() + 2);  // zlib starts it with the path
    const int close_status = gzclose(file);
    TORCH_CHECK(n == 0 && (err == Z_OK || err == Z_STREAM_END), "cannot decompress Fashion-MNIST file ", path, ": ",
                reason);
    // Z_BUF_ERROR: the last read ended inside a gzip stream (the file is cut short).
    TORCH_CHECK(close_status == Z_OK, "cannot decompress Fashion-MNIST file ", path,
                close_status == Z_BUF_ERROR ? ": the gzip stream is cut short" : ": gzclose failed");
#else
    TORCH_CHECK(false, "cannot read ", path, ": this build has no zlib; gunzip the file or use --synthetic");
#endif
  } else {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.good(), "cannot open ", path);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return bytes;
}

uint32_t read_be32(const std::vector<uint8_t>& b, size_t offset) {
  return (uint32_t{b[offset]} << 24) | (uint32_t{b[offset + 1]} << 16) | (uint32_t{b[offset + 2]} << 8) |
         uint32_t{b[offset + 3]};
}

std::string find_split_file(const std::string& dir, const std::string& stem) {
  for (const std::string& candidate : {dir + "/" + stem + ".gz", dir + "/" + stem}) {
    if (file_exists(candidate)) return candidate;
  }
  TORCH_CHECK(false, "Fashion-MNIST file ", dir, "/", stem,
              "[.gz] not found. Install the data with "
              "`apt-get install dataset-fashion-mnist`, point --data at the folder, or run with --synthetic.");
}

}  // namespace

torch::Tensor read_idx_file(const std::string& path) {
  const std::vector<uint8_t> bytes = read_all_bytes(path);
  TORCH_CHECK(bytes.size() >= 4, path, " is not an IDX file: only ", bytes.size(), " bytes");
  TORCH_CHECK(bytes[0] == 0 && bytes[1] == 0 && bytes[2] == 0x08, path,
              " is not an unsigned-byte IDX file: bad magic number ", read_be32(bytes, 0));
  const int rank = bytes[3];
  TORCH_CHECK(rank >= 1 && rank <= 4, path, ": IDX rank must be 1..4, got ", rank);
  const size_t header = 4 + 4 * static_cast<size_t>(rank);
  TORCH_CHECK(bytes.size() >= header, path, " is truncated inside its header");
  std::vector<int64_t> sizes;
  int64_t count = 1;
  for (int d = 0; d < rank; ++d) {
    sizes.push_back(read_be32(bytes, 4 + 4 * d));
    count *= sizes.back();
  }
  TORCH_CHECK(static_cast<int64_t>(bytes.size() - header) == count, path, " holds ", bytes.size() - header,
              " data bytes but its header promises ", count);
  auto out = torch::empty(sizes, torch::kUInt8);
  std::memcpy(out.data_ptr<uint8_t>(), bytes.data() + header, static_cast<size_t>(count));
  return out;
}

ImageSplit load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto images = read_idx_file(find_split_file(dir, prefix + "-images-idx3-ubyte"));
  auto labels = read_idx_file(find_split_file(dir, prefix + "-labels-idx1-ubyte"));
  TORCH_CHECK(images.dim() == 3 && labels.dim() == 1 && images.size(0) == labels.size(0), dir, ": images ",
              images.sizes(), " and labels ", labels.sizes(), " do not match");
  // Fashion-MNIST's training-set statistics, used for both splits like the usual transforms.Normalize.
  constexpr double kMean = 0.2860;
  constexpr double kStd = 0.3530;
  auto x = images.to(torch::kFloat32).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(1);
  return {x.contiguous(), labels.to(torch::kInt64)};
}

ImageSplit synthetic_fashion_mnist(int64_t n, uint64_t seed, bool train) {
  TORCH_CHECK(n > 0, "synthetic data set size must be > 0, got ", n);
  constexpr int64_t kClasses = 10;
  constexpr int64_t kSide = 28;
  constexpr int64_t kCoarseSide = 7;  // patterns are 7x7 random grids upsampled: smooth shapes, not pixel noise
  // Note [synthetic difficulty]: the task is calibrated to be as hard for SmallCnn as the real data set (measured
  // side by side, docs/examples.md "--synthetic"). Classes come in Fashion-MNIST's groups: tops (T-shirt, pullover,
  // coat, shirt), footwear (sandal, sneaker, ankle boot), and trouser, dress, bag alone. A class's pattern is its
  // group's shape plus a class detail a quarter as strong (a lone class's detail at full strength): the groups are
  // learned within a few steps, telling a group's classes apart takes epochs. Each image is its class's pattern at a
  // random contrast, shifted by up to kMaxShift pixels, plus pixel noise; a few labels are drawn at random (as
  // ambiguous images are in the real data), which caps the reachable accuracy near 95.5%.
  constexpr double kDetail = 0.25;
  constexpr double kContrast = 0.5;  // each image's contrast factor is uniform in [1 - kContrast, 1 + kContrast]
  constexpr int64_t kMaxShift = 3;   // pixels, each direction
  constexpr double kNoiseStd = 1.0;  // per-pixel noise, as large as the patterns themselves
  constexpr double kRandomLabels = 0.05;
  static constexpr std::array<int64_t, kClasses> kGroupOf = {0, 2, 0, 3, 0, 1, 0, 1, 4, 1};
  constexpr int64_t kGroups = 5;
  // Separate streams for the patterns (shared by both splits) and for each split's samples.
  constexpr uint64_t kTrainStream = 0x9E3779B97F4A7C15ULL;
  constexpr uint64_t kTestStream = 0xC2B2AE3D27D4EB4FULL;
  auto pattern_gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto sample_gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ (train ? kTrainStream : kTestStream));
  namespace F = torch::nn::functional;
  const auto upsample = [](const torch::Tensor& coarse) {
    return F::interpolate(coarse, F::InterpolateFuncOptions()
                                      .size(std::vector<int64_t>{kSide, kSide})
                                      .mode(torch::kBilinear)
                                      .align_corners(false));
  };
  const auto group_shapes = upsample(torch::randn({kGroups, 1, kCoarseSide, kCoarseSide}, pattern_gen));
  const auto details = upsample(torch::randn({kClasses, 1, kCoarseSide, kCoarseSide}, pattern_gen));
  std::array<int64_t, kGroups> group_size{};
  for (const int64_t g : kGroupOf) ++group_size[static_cast<size_t>(g)];
  std::vector<torch::Tensor> class_patterns;
  for (int64_t c = 0; c < kClasses; ++c) {
    const int64_t g = kGroupOf[static_cast<size_t>(c)];
    const double weight = group_size[static_cast<size_t>(g)] > 1 ? kDetail : 1.0;
    class_patterns.push_back(group_shapes[g] + weight * details[c]);
  }
  const auto patterns = torch::stack(class_patterns);  // [classes, 1, side, side]

  auto labels = torch::randint(0, kClasses, {n}, sample_gen, torch::kInt64);
  const auto contrast = 1.0 + kContrast * (2.0 * torch::rand({n, 1, 1, 1}, sample_gen) - 1.0);
  const auto padded = F::pad(patterns.index_select(0, labels) * contrast,
                             F::PadFuncOptions({kMaxShift, kMaxShift, kMaxShift, kMaxShift}));
  // Each image's window of the padded picture: rows dy..dy+27 and columns dx..dx+27, dx and dy in [0, 2 kMaxShift].
  const auto dy = torch::randint(0, 2 * kMaxShift + 1, {n, 1}, sample_gen, torch::kInt64);
  const auto dx = torch::randint(0, 2 * kMaxShift + 1, {n, 1}, sample_gen, torch::kInt64);
  const auto offsets = torch::arange(kSide, torch::kInt64).unsqueeze(0);
  const auto shifted = padded.index(
      {torch::arange(n, torch::kInt64).view({n, 1, 1}), 0, (dy + offsets).unsqueeze(2), (dx + offsets).unsqueeze(1)});
  auto images = shifted.unsqueeze(1) + kNoiseStd * torch::randn({n, 1, kSide, kSide}, sample_gen);
  const auto relabel = torch::rand({n}, sample_gen) < kRandomLabels;
  labels = torch::where(relabel, torch::randint(0, kClasses, {n}, sample_gen, torch::kInt64), labels);
  return {images.contiguous(), labels};
}

}  // namespace examples
