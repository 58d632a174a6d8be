// amp::save_checkpoint / amp::load_checkpoint and LossScaler::load: the scaler state after a load, atomic writes,
// checksums, and the error paths (one line, no backtrace, the file named, nothing changed).

#include <sys/stat.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/grad_scaler.h>
#include <amp/optim/fused_optimizers.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using amp::OptLevel;

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = 16) {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

amp::Options o2_bf16() { return amp::Options().opt_level(OptLevel::O2).half_dtype(torch::kBFloat16); }

torch::Tensor batch(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn({8, 8}, gen);
}

torch::Tensor with_inf(torch::Tensor x) {
  x[0][0] = std::numeric_limits<float>::infinity();
  return x;
}

void train_step(amp::Model<Net>& model, amp::Optimizer& optimizer, const torch::Tensor& x) {
  optimizer.zero_grad();
  auto loss = model(x).pow(2).mean();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
}

using test_util::read_file;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// The issue's reproduction: O2 bf16 with max_overflows_at_floor(3); 3 clean steps, save; 3 steps with an inf input
// (the third throws, as documented); load; clean steps must train, not throw (they threw for 3 more steps because
// the scaler kept its pre-load diagnostics), and the diagnostics must report the loaded state.
void expect_rollback_trains(const std::function<void(amp::Model<Net>&, amp::Optimizer&)>& save,
                            const std::function<void(amp::Model<Net>&, amp::Optimizer&)>& load) {
  torch::manual_seed(5);
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.05);
  auto [model, optimizer] = amp::initialize(net, sgd, o2_bf16().max_overflows_at_floor(3));
  for (int step = 0; step < 3; ++step) train_step(model, optimizer, batch(100 + step));
  save(model, optimizer);
  const auto saved = clones(net->parameters());
  EXPECT_NO_THROW(train_step(model, optimizer, with_inf(batch(200))));
  EXPECT_NO_THROW(train_step(model, optimizer, with_inf(batch(201))));
  EXPECT_THROW(train_step(model, optimizer, with_inf(batch(202))), c10::Error) << "the third overflow at the floor";
  EXPECT_EQ(optimizer.scaler().diagnostics_now().floor_overflows, 3);
  load(model, optimizer);
  EXPECT_TRUE(all_equal(clones(net->parameters()), saved));
  const amp::ScalerDiagnostics d = optimizer.scaler().diagnostics();
  EXPECT_EQ(d.step, 3) << "diagnostics() must report the loaded state at once";
  EXPECT_EQ(d.floor_overflows, 0);
  EXPECT_FALSE(d.found_inf);
  EXPECT_EQ(d.scale, 1.0);
  for (int step = 0; step < 4; ++step) {
    const auto before = clones(net->parameters());
    try {
      train_step(model, optimizer, batch(300 + step));
    } catch (const c10::Error& e) {
      ADD_FAILURE() << "clean step " << step << " after the load threw: " << e.what_without_backtrace();
    }
    EXPECT_FALSE(all_equal(clones(net->parameters()), before)) << "clean step " << step << " did not train";
  }
  EXPECT_EQ(optimizer.scaler().diagnostics_now().step, 7);
}

TEST(CheckpointTest, RollingBackPastAFloorStallTrainsOnCleanData) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  expect_rollback_trains([&](auto& model, auto& optimizer) { amp::save_checkpoint(path, model, optimizer); },
                         [&](auto& model, auto& optimizer) { amp::load_checkpoint(path, model, optimizer); });
}

TEST(CheckpointTest, RollingBackTheAmpStateAloneTrainsOnCleanData) {
  std::stringstream buffer;
  expect_rollback_trains(
      [&](amp::Model<Net>& model, amp::Optimizer& optimizer) {
        torch::serialize::OutputArchive out;
        model.save(out);
        torch::serialize::OutputArchive amp_state;
        optimizer.save_amp_state(amp_state);
        out.write("amp", amp_state);
        out.save_to(buffer);
      },
      [&](amp::Model<Net>& model, amp::Optimizer& optimizer) {
        buffer.seekg(0);
        torch::serialize::InputArchive in;
        in.load_from(buffer);
        model.load(in);
        torch::serialize::InputArchive amp_state;
        ASSERT_TRUE(in.try_read("amp", amp_state));
        optimizer.load_amp_state(amp_state);
      });
}

// A fresh process (a new scaler) reports the loaded step, scale and counters at once, not "step -1, scale 0".
TEST(CheckpointTest, LoadedScalerReportsTheLoadedState) {
  amp::LossScalerConfig config;
  config.init_scale = 1024;
  config.growth_interval = 2;
  amp::LossScaler a(config, torch::kCPU);
  for (int step = 0; step < 5; ++step) {
    a.begin_step();
    a.found_inf().fill_(step == 1 ? 1.0 : 0.0);
    a.update();
  }
  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  const amp::ScalerDiagnostics saved = a.diagnostics_now();

  amp::LossScaler b(config, torch::kCPU);
  b.begin_step();
  b.found_inf().fill_(1.0);
  b.unscale_and_check({torch::full({2}, std::numeric_limits<float>::quiet_NaN())});
  b.update();  // b's own history: one overflow, found_inf raised, a first non-finite index
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  b.load(in);
  const amp::ScalerDiagnostics d = b.diagnostics();
  EXPECT_EQ(d.step, 5);
  EXPECT_EQ(d.scale, saved.scale);
  EXPECT_EQ(d.scale, b.scale().item<double>());
  EXPECT_EQ(d.skipped_steps, 1);
  EXPECT_EQ(d.floor_overflows, 0);
  EXPECT_FALSE(d.found_inf);
  EXPECT_EQ(d.first_nonfinite_index, -1);
  EXPECT_EQ(b.found_inf().item<float>(), 0.0f) << "the overflow flag of b's unfinished step is cleared";
  EXPECT_EQ(b.diagnostics_step(), 5);
  b.begin_step();
  b.update();
  EXPECT_EQ(b.diagnostics_now().step, 6) << "the next snapshot follows the loaded step";
}

TEST(CheckpointTest, GradScalerLoadReportsTheLoadedState) {
  amp::GradScaler a(amp::GradScalerOptions().init_scale(256.0).growth_interval(2), torch::kCPU);
  auto w = torch::ones({1}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, 0.1);
  for (int i = 0; i < 3; ++i) {
    a.scale(torch::zeros({}));
    w.mutable_grad() = torch::ones({1});
    a.step(optimizer);
    a.update();
  }
  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  amp::GradScaler b(amp::GradScalerOptions().init_scale(256.0).growth_interval(2), torch::kCPU);
  b.scale(torch::zeros({}));
  w.mutable_grad() = torch::ones({1});
  b.unscale_(optimizer);  // an iteration in progress when the checkpoint is loaded
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  b.load(in);
  const amp::ScalerDiagnostics d = b.loss_scaler()->diagnostics();
  EXPECT_EQ(d.step, 3);
  EXPECT_EQ(d.scale, 512.0);
  EXPECT_NO_THROW(b.unscale_(optimizer)) << "a load starts a new iteration";
}

// Note [checkpoint envelope]: a writer stopped midway (a file-size limit in a child, as a full disk would stop it)
// leaves the previous checkpoint loadable.
TEST(CheckpointTest, AWriterStoppedMidSaveLeavesThePreviousCheckpointLoadable) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  torch::manual_seed(3);
  Net net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, sgd, o2_bf16());
  train_step(model, optimizer, batch(1));
  amp::save_checkpoint(path, model, optimizer);
  const std::string old_bytes = read_file(path);
  const auto saved = clones(net->parameters());
  train_step(model, optimizer, batch(2));
  for (const rlim_t limit : {rlim_t{1}, rlim_t{old_bytes.size() / 2}, rlim_t{old_bytes.size() - 64}}) {
    SCOPED_TRACE("file-size limit " + std::to_string(limit));
    const int status =
        test_util::run_with_file_size_limit(limit, [&] { amp::save_checkpoint(path, model, optimizer); });
    EXPECT_TRUE(test_util::stopped_by_file_size_limit(status))
        << "the writer was not stopped (status " << status << ")";
    EXPECT_EQ(read_file(path), old_bytes) << "the previous checkpoint was damaged";
  }
  amp::load_checkpoint(path, model, optimizer);
  EXPECT_TRUE(all_equal(clones(net->parameters()), saved));
}

// What a refused load must leave untouched: model tensors, masters, optimizer state, every scaler's state.
struct Target {
  Net net{nullptr};
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<amp::Initialized<Net>> amp;

  struct Fingerprint {
    std::vector<torch::Tensor> tensors;
    amp::ScalerDiagnostics diagnostics;
    int64_t steps;
  };
  Fingerprint fingerprint() {
    Fingerprint f;
    f.tensors = clones(net->parameters());
    for (const auto& b : net->buffers()) f.tensors.push_back(b.clone());
    for (const auto& group : inner->param_groups()) {
      for (const auto& p : group.params()) f.tensors.push_back(p.detach().clone());  // the fp32 masters
    }
    // The optimizer's state, through its own serialization: each saved tensor in order.
    torch::serialize::OutputArchive out;
    inner->save(out);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    for (const auto& key : in.keys()) {
      torch::Tensor t;
      if (in.try_read(key, t)) f.tensors.push_back(t);
    }
    if (auto* sgd = dynamic_cast<torch::optim::SGD*>(inner.get())) {
      for (const auto& [key, state] : sgd->state()) {
        f.tensors.push_back(static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer().clone());
      }
    }
    auto& scaler = amp->optimizer.scaler();
    f.tensors.push_back(scaler.scale().clone());
    f.tensors.push_back(scaler.inv_scale().clone());
    f.tensors.push_back(scaler.found_inf().clone());
    f.diagnostics = scaler.diagnostics_now();
    f.steps = scaler.diagnostics_step();
    return f;
  }
};

enum class Kind { kSgd, kFusedSgd, kAdamW, kFusedAdamW };

std::unique_ptr<Target> make_target(Kind kind, uint64_t seed, amp::Options options = o2_bf16().dynamic_loss_scale(),
                                    int64_t hidden = 16) {
  auto t = std::make_unique<Target>();
  torch::manual_seed(seed);
  t->net = Net(hidden);
  switch (kind) {
    case Kind::kSgd:
      t->inner =
          std::make_unique<torch::optim::SGD>(t->net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      break;
    case Kind::kFusedSgd:
      t->inner = std::make_unique<amp::FusedSGD>(t->net->parameters(), amp::FusedSgdOptions(0.05).momentum(0.9));
      break;
    case Kind::kAdamW:
      t->inner = std::make_unique<torch::optim::AdamW>(t->net->parameters(), torch::optim::AdamWOptions(1e-3));
      break;
    case Kind::kFusedAdamW:
      t->inner = std::make_unique<amp::FusedAdamW>(t->net->parameters());
      break;
  }
  t->amp = std::make_unique<amp::Initialized<Net>>(amp::initialize(t->net, *t->inner, options));
  for (int step = 0; step < 2; ++step) train_step(t->amp->model, t->amp->optimizer, batch(seed * 10 + step));
  return t;
}

void save(Target& t, const std::string& path) { amp::save_checkpoint(path, t.amp->model, t.amp->optimizer); }

/// Loading `path` into `target` must fail with one line, without a backtrace, naming the file and containing
/// `fragment`, and leave the target exactly as it was.
void expect_refused(Target& target, const std::string& path, const std::string& fragment) {
  const Target::Fingerprint before = target.fingerprint();
  try {
    amp::load_checkpoint(path, target.amp->model, target.amp->optimizer);
    ADD_FAILURE() << "loading '" << path << "' should fail with: " << fragment;
  } catch (const std::exception& e) {
    const std::string message = e.what();  // what(), not what_without_backtrace(): what a user's catch prints
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    EXPECT_EQ(message.find("frame #"), std::string::npos) << "carries a backtrace: " << message;
    EXPECT_EQ(message.find("INTERNAL ASSERT"), std::string::npos) << message;
    EXPECT_NE(message.find("'" + path + "'"), std::string::npos) << "does not name the file: " << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
    EXPECT_NE(dynamic_cast<const c10::Error*>(&e), nullptr) << "not a c10::Error: " << message;
  }
  const Target::Fingerprint after = target.fingerprint();
  EXPECT_TRUE(all_equal(before.tensors, after.tensors)) << "a refused load changed the model, optimizer or scaler";
  EXPECT_EQ(before.diagnostics.step, after.diagnostics.step);
  EXPECT_EQ(before.diagnostics.scale, after.diagnostics.scale);
  EXPECT_EQ(before.diagnostics.skipped_steps, after.diagnostics.skipped_steps);
  EXPECT_EQ(before.steps, after.steps);
}

/// Flips one bit in the middle of the first occurrence of `tensor`'s bytes in the file.
void flip_bit_inside(const std::string& path, const torch::Tensor& tensor) {
  const torch::Tensor t = tensor.detach().cpu().contiguous();
  const std::string needle(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  std::string bytes = read_file(path);
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos) << "the tensor's bytes are not stored verbatim in " << path;
  ASSERT_EQ(bytes.find(needle, at + 1), std::string::npos) << "the tensor's bytes are stored twice";
  bytes[at + needle.size() / 2] ^= 0x10;
  write_file(path, bytes);
}

/// What a file that is not a whole zip archive gets, after its size: miniz's reason in parentheses ("failed finding
/// central directory", "invalid header or archive is corrupted"), without LibTorch's paragraph of advice
/// (amp::short_archive_error).
constexpr const char* kDamagedArchive = "bytes): damaged or truncated zip archive (";

TEST(CheckpointTest, EveryErrorIsOneLineNamingTheFileAndChangesNothing) {
  ddp_test::ScratchDir dir;
  auto sgd = make_target(Kind::kSgd, 1);
  auto fused_sgd = make_target(Kind::kFusedSgd, 1);
  struct Case {
    std::string name;
    Target* target;
    std::function<std::string()> make_file;  // returns the path to load
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"missing file", sgd.get(), [&] { return dir.file("does-not-exist.pt"); }, "No such file or directory"},
      {"folder", sgd.get(), [&] { return dir.path(); }, "it is a folder"},
      {"truncated file", sgd.get(),
       [&] {
         const std::string path = dir.file("truncated.pt");
         save(*make_target(Kind::kSgd, 2), path);
         const std::string bytes = read_file(path);
         write_file(path, bytes.substr(0, bytes.size() / 2));
         return path;
       },
       kDamagedArchive},
      {"random bytes", sgd.get(),
       [&] {
         const std::string path = dir.file("random.pt");
         std::mt19937 rng(7);
         std::string bytes(4096, '\0');
         for (auto& b : bytes) b = static_cast<char>(rng());
         write_file(path, bytes);
         return path;
       },
       kDamagedArchive},
      {"wrong parts", sgd.get(),
       [&] {
         const std::string path = dir.file("other.pt");
         torch::serialize::OutputArchive archive;
         archive.write("weights", torch::ones({3}));
         archive.save_to(path);
         return path;
       },
       "is not an amp checkpoint"},
      {"mismatched model", sgd.get(),
       [&] {
         const std::string path = dir.file("wider.pt");
         save(*make_target(Kind::kSgd, 2, o2_bf16().dynamic_loss_scale(), 32), path);
         return path;
       },
       "'fc1.weight' with shape [32, 8] but the model's is [16, 8]"},
      {"mismatched scaler settings", sgd.get(),
       [&] {
         const std::string path = dir.file("hysteresis.pt");
         save(*make_target(Kind::kSgd, 2, o2_bf16().dynamic_loss_scale().hysteresis(2)), path);
         return path;
       },
       "hysteresis=2 in the checkpoint, hysteresis=1 here"},
      {"AdamW into SGD", sgd.get(),
       [&] {
         const std::string path = dir.file("adamw.pt");
         save(*make_target(Kind::kAdamW, 2), path);
         return path;
       },
       "holds the state of an optimizer of type torch::optim::AdamW but is being loaded into one of type "
       "torch::optim::SGD"},
      {"FusedAdamW into FusedSGD", fused_sgd.get(),
       [&] {
         const std::string path = dir.file("fused_adamw.pt");
         save(*make_target(Kind::kFusedAdamW, 2), path);
         return path;
       },
       "holds the state of an optimizer of type amp::FusedAdamW but is being loaded into one of type amp::FusedSGD"},
      {"flipped bit in a stored tensor", sgd.get(),
       [&] {
         const std::string path = dir.file("flipped.pt");
         auto source = make_target(Kind::kSgd, 2);
         save(*source, path);
         flip_bit_inside(path, source->inner->param_groups()[0].params()[0]);  // fc1.weight's fp32 master
         return path;
       },
       "its 'model' part fails its checksum"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = c.make_file();
    expect_refused(*c.target, path, c.fragment);
  }
  // The same target still loads a good checkpoint afterwards.
  const std::string good = dir.file("good.pt");
  auto source = make_target(Kind::kSgd, 9);
  save(*source, good);
  amp::load_checkpoint(good, sgd->amp->model, sgd->amp->optimizer);
  EXPECT_TRUE(all_equal(clones(sgd->net->parameters()), clones(source->net->parameters())));
}

// A flipped bit in the optimizer's part (a momentum buffer) is caught as well, and the file is named.
TEST(CheckpointTest, AFlippedBitInTheOptimizerStateIsAnError) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  auto source = make_target(Kind::kSgd, 4);
  save(*source, path);
  auto& state = *source->inner->state().begin()->second;
  flip_bit_inside(path, static_cast<torch::optim::SGDParamState&>(state).momentum_buffer());
  auto target = make_target(Kind::kSgd, 5);
  expect_refused(*target, path, "its 'optimizer' part fails its checksum");
}

// Note [checkpoint extras]: named byte strings travel in the same file, come back byte for byte (binary included),
// are checked like the parts, and a file saved without any loads with none.
TEST(CheckpointTest, ExtrasComeBackByteForByteAndAreChecksummed) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  auto source = make_target(Kind::kFusedSgd, 6);
  const std::string binary("a\0b\n\xff position", 14);
  const amp::CheckpointExtras saved = {{"training_position", binary}, {"empty-one", ""}, {"Rng_2", "rng bytes"}};
  amp::save_checkpoint(path, source->amp->model, source->amp->optimizer, saved);

  auto target = make_target(Kind::kFusedSgd, 7);
  amp::CheckpointExtras loaded = {{"stale", "must be replaced"}};
  amp::load_checkpoint(path, target->amp->model, target->amp->optimizer, loaded);
  EXPECT_EQ(loaded, saved);
  EXPECT_TRUE(all_equal(clones(target->net->parameters()), clones(source->net->parameters())));
  // The two-argument load reads the same file and ignores the extras.
  amp::load_checkpoint(path, target->amp->model, target->amp->optimizer);

  const std::string plain = dir.file("plain.pt");
  save(*source, plain);
  amp::load_checkpoint(plain, target->amp->model, target->amp->optimizer, loaded);
  EXPECT_TRUE(loaded.empty());

  // A flipped bit inside an extra fails its checksum, before anything changes.
  const std::string payload(64, 'x');
  const std::string flipped = dir.file("flipped.pt");
  amp::save_checkpoint(flipped, source->amp->model, source->amp->optimizer, {{"payload", payload}});
  std::string bytes = read_file(flipped);
  const size_t at = bytes.find(payload);
  ASSERT_NE(at, std::string::npos);
  bytes[at + payload.size() / 2] ^= 0x10;
  write_file(flipped, bytes);
  auto untouched = make_target(Kind::kFusedSgd, 8);
  expect_refused(*untouched, flipped, "its 'extra_payload' part fails its checksum");
}

TEST(CheckpointTest, AnExtraWithAnInvalidNameIsRefusedBeforeWriting) {
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  auto source = make_target(Kind::kSgd, 2);
  for (const std::string& name : {std::string(), std::string("has space"), std::string("new\nline"),
                                  std::string("dot.ted"), std::string(65, 'a')}) {
    SCOPED_TRACE("name '" + name + "'");
    try {
      amp::save_checkpoint(path, source->amp->model, source->amp->optimizer, {{name, "x"}});
      ADD_FAILURE() << "saved an extra named '" << name << "'";
    } catch (const c10::Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
      EXPECT_NE(message.find("is not a valid name"), std::string::npos) << message;
    }
    struct stat info {};
    EXPECT_NE(::stat(path.c_str(), &info), 0) << "a refused save wrote the file";
  }
}

}  // namespace
