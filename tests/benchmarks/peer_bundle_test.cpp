// The fair torch.amp peer (benchmarks/common/peer_bundle.h): the bundle carries our weights, data and batch order
// byte for byte, and the digest the peers print is the one Python computes (golden values from
// tests/golden/generate_peer_digest_golden.py, run with .venv's PyTorch).
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/peer_bundle.h"
#include "common/training_tasks.h"

namespace {

std::map<std::string, std::string> read_golden(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::map<std::string, std::string> rows;
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    const auto comma = line.find(',');
    if (comma != std::string::npos) rows[line.substr(0, comma)] = line.substr(comma + 1);
  }
  return rows;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("lta_peer_bundle_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

/// Equal dtype, shape and bytes.
void expect_same_bytes(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(
      torch::equal(a.cpu().contiguous().flatten().view(at::kByte), b.cpu().contiguous().flatten().view(at::kByte)))
      << what;
}

/// What the Python peer does with the bundle: its batches (CNN: index_select by the order; transformer: row
/// slices) and a model whose tensors are loaded by name (load_state_dict).
bench::NamedTensors entries_with_prefix(const bench::NamedTensors& bundle, const std::string& prefix) {
  bench::NamedTensors out;
  for (const auto& [name, tensor] : bundle) {
    if (name.rfind(prefix, 0) == 0) out.emplace_back(name.substr(prefix.size()), tensor);
  }
  return out;
}

at::Tensor entry(const bench::NamedTensors& bundle, const std::string& name) {
  for (const auto& [n, t] : bundle) {
    if (n == name) return t;
  }
  ADD_FAILURE() << "the bundle has no " << name;
  return at::Tensor();
}

template <typename Task>
void load_by_name(typename Task::Net& net, const bench::NamedTensors& weights) {
  torch::NoGradGuard no_grad;
  auto mine = bench::module_state(*net);
  ASSERT_EQ(mine.size(), weights.size());
  for (auto& [name, tensor] : mine) tensor.copy_(entry(weights, name));
}

/// Writes the task's bundle as bench_amp_vs_fp32 does and reads it back.
template <typename Task>
bench::NamedTensors round_trip(const Task& task, const bench::NamedTensors& weights, const std::string& path) {
  bench::NamedTensors bundle = task.peer_data();
  for (const auto& [name, tensor] : weights) bundle.emplace_back("weights/" + name, tensor);
  bench::save_peer_bundle(path, bundle);
  auto loaded = bench::load_peer_bundle(path);
  std::filesystem::remove(path);
  return loaded;
}

bench::CnnTask small_cnn_task() {
  bench::CnnTask::Settings s;
  s.synthetic = true;
  s.train_samples = 640;
  s.test_samples = 100;
  s.batch_size = 64;
  s.seed = 7;
  return bench::CnnTask(s, torch::kCPU);
}

}  // namespace

TEST(PeerDigestTest, MatchesPythonGolden) {
  const auto golden = read_golden(std::string(LTA_GOLDEN_DIR) + "/peer_digest.csv");
  const auto images = torch::arange(0, 1000, torch::kFloat32).reshape({10, 1, 10, 10}).mul(0.37);
  const auto labels = torch::arange(0, 777, torch::kInt64).remainder(10);
  const auto half = torch::linspace(-3.0, 3.0, 301).to(torch::kBFloat16);
  const auto large = torch::arange(0, 5000000, torch::kInt32);
  const std::map<std::string, std::vector<at::Tensor>> cases = {{"images_f32", {images}},
                                                                {"labels_i64", {labels}},
                                                                {"bf16", {half}},
                                                                {"scalar_f64", {torch::tensor(2.5, torch::kFloat64)}},
                                                                {"large_i32", {large}},
                                                                {"list", {images, labels, half}},
                                                                {"list_reordered", {labels, images, half}},
                                                                {"reshaped", {images.reshape({100, 10})}}};
  ASSERT_EQ(golden.size(), cases.size());
  for (const auto& [name, tensors] : cases) {
    ASSERT_TRUE(golden.count(name)) << name;
    EXPECT_EQ(bench::byte_digest(tensors), golden.at(name)) << name;
  }
}

TEST(PeerDigestTest, OneFlippedBitOrTwoSwappedBytesChangeIt) {
  const auto original = torch::randn({3, 1000});
  const std::string digest = bench::byte_digest({original});
  auto flipped = original.clone();
  auto bytes = flipped.view({-1}).view(at::kByte);
  bytes[1234].bitwise_xor_(1);
  EXPECT_NE(bench::byte_digest({flipped}), digest);
  auto swapped = original.clone();
  auto swapped_bytes = swapped.view({-1}).view(at::kByte);
  const auto first = swapped_bytes[40].clone();
  swapped_bytes[40].copy_(swapped_bytes[4000]);
  swapped_bytes[4000].copy_(first);
  ASSERT_FALSE(torch::equal(swapped, original));
  EXPECT_NE(bench::byte_digest({swapped}), digest);
  EXPECT_NE(bench::byte_digest({original.reshape({1000, 3})}), digest);  // same bytes, another shape
  EXPECT_EQ(bench::byte_digest({original.clone()}), digest);
}

TEST(PeerBundleTest, RoundTripKeepsNamesOrderDtypesAndBytes) {
  const bench::NamedTensors tensors = {{"z_first", torch::randn({4, 5})},
                                       {"a_second", torch::randint(0, 10, {7}, torch::kInt64)},
                                       {"half", torch::randn({3, 3}).to(torch::kBFloat16)},
                                       {"strided", torch::randn({6, 4}).t()}};  // saved contiguous
  const std::string path = temp_path("round_trip.pt");
  bench::save_peer_bundle(path, tensors);
  const auto loaded = bench::load_peer_bundle(path);
  std::filesystem::remove(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(loaded[i].first, tensors[i].first);
    expect_same_bytes(loaded[i].second, tensors[i].second.contiguous(), tensors[i].first);
  }
  EXPECT_EQ(bench::byte_digest(loaded), bench::byte_digest(tensors));
}

TEST(PeerBundleTest, BadInputIsOneClearError) {
  const std::string path = temp_path("duplicate.pt");
  try {
    bench::save_peer_bundle(path, {{"w", torch::ones({1})}, {"w", torch::zeros({1})}});
    FAIL() << "a repeated name was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("the name 'w' is given twice"), std::string::npos)
        << e.what_without_backtrace();
  }
  try {
    bench::load_peer_bundle("/nonexistent/bundle.pt");
    FAIL() << "a missing bundle was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("/nonexistent/bundle.pt"), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(PeerBundleTest, CnnPeerSeesOurBatchesAndWeightsByteForByte) {
  const bench::CnnTask task = small_cnn_task();
  auto ours = task.make_model();
  const auto weights = bench::module_state(*ours);
  const auto bundle = round_trip(task, weights, temp_path("cnn.pt"));

  const auto images = entry(bundle, "train_images"), labels = entry(bundle, "train_labels");
  const auto order = entry(bundle, "order");
  ASSERT_EQ(order.numel(), task.num_steps() * task.samples_per_step());
  for (int64_t step = 0; step < task.num_steps(); ++step) {
    const auto idx = order.slice(0, step * task.samples_per_step(), (step + 1) * task.samples_per_step());
    const bench::Batch b = task.batch(step);
    expect_same_bytes(images.index_select(0, idx), b.input, "input of step " + std::to_string(step));
    expect_same_bytes(labels.index_select(0, idx), b.target, "target of step " + std::to_string(step));
  }
  // The peer's model: another module (its own random init), every tensor loaded from the bundle by name.
  torch::manual_seed(12345);
  bench::CnnTask::Net peer_model;
  ASSERT_NE(bench::byte_digest(bench::module_state(*peer_model)), bench::byte_digest(weights));
  load_by_name<bench::CnnTask>(peer_model, entries_with_prefix(bundle, "weights/"));
  EXPECT_EQ(bench::byte_digest(bench::module_state(*peer_model)), bench::byte_digest(weights));
  // Every contender of ours starts from these same weights.
  EXPECT_EQ(bench::byte_digest(bench::module_state(*task.make_model())), bench::byte_digest(weights));
}

TEST(PeerBundleTest, TransformerPeerSeesOurTokenSequences) {
  bench::TransformerTask::Settings s;
  s.model.vocab_size(64).seq_len(16).d_model(32).num_heads(2);
  s.steps = 5;
  s.batch_size = 4;
  s.eval_sequences = 8;
  const bench::TransformerTask task(s, torch::kCPU);
  auto ours = task.make_model();
  const auto weights = bench::module_state(*ours);
  const auto bundle = round_trip(task, weights, temp_path("transformer.pt"));
  const auto tokens = entry(bundle, "train_tokens");
  ASSERT_EQ(tokens.size(0), s.steps * s.batch_size);
  for (int64_t step = 0; step < task.num_steps(); ++step) {
    const auto rows = tokens.slice(0, step * s.batch_size, (step + 1) * s.batch_size);
    const bench::Batch b = task.batch(step);
    expect_same_bytes(rows.slice(1, 0, 16), b.input.contiguous(), "input of step " + std::to_string(step));
    expect_same_bytes(rows.slice(1, 1, 17), b.target.contiguous(), "target of step " + std::to_string(step));
  }
  EXPECT_EQ(entry(bundle, "eval_tokens").size(0), s.eval_sequences);
  EXPECT_EQ(bench::byte_digest(entries_with_prefix(bundle, "weights/")), bench::byte_digest(weights));
}
