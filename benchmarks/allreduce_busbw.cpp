// Questions: (1) what bus bandwidth does a Gloo allreduce reach against the bucket size, on 2 local ranks
// (busbw = bytes / time * 2(n-1)/n, the nccl-tests convention)? (2) how long is a DDP training step with the
// buckets' allreduce overlapped with backward, against the same step with all reduction after backward (Apex's
// delay_allreduce), and against the same step without any communication (DDP's overhead per sample)? (3) under
// amp (O2, bf16 model, fp32 masters), what does unscaling each reduced bucket as it arrives (optimizer.attach)
// save against DDP's write-back plus amp's pass over all gradients at the end of the scale_loss scope?
// All parts run 2 ranks forked by ddp::spawn in one run; rank 0 prints the tables.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>

#include "common/command_line.h"
#include "common/timing.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWorld = 2;
constexpr std::chrono::milliseconds kTimeout{120000};
constexpr double kSmallCapMb = 4.0;  // about one layer per bucket for the model below: the most overlap

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void allreduce_table(const ddp::ProcessGroup& pg, bool full, int rounds) {
  std::vector<int64_t> sizes_bytes = {4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 25 << 20};
  if (full) sizes_bytes.push_back(int64_t{64} << 20);
  const double bus_factor = 2.0 * (pg.size() - 1) / pg.size();
  if (pg.rank() == 0) {
    fmt::print("Gloo allreduce (SUM, fp32), {} ranks on this host, median of {} rounds\n", pg.size(), rounds);
    fmt::print("| bucket | time per allreduce | algbw GB/s | busbw GB/s |\n|---|---|---|---|\n");
  }
  for (const int64_t bytes : sizes_bytes) {
    at::Tensor t = torch::randn({bytes / static_cast<int64_t>(sizeof(float))});
    // Enough operations per sample that a sample lasts a few milliseconds even for the small buckets.
    const int ops = static_cast<int>(std::clamp<int64_t>((int64_t{8} << 20) / bytes, 2, 200));
    for (int i = 0; i < 2; ++i) pg.wait(pg.allreduce_sum_async(t), "warm-up allreduce");
    std::vector<double> per_op;
    for (int r = 0; r < rounds; ++r) {
      pg.barrier();
      const auto start = Clock::now();
      for (int i = 0; i < ops; ++i) pg.wait(pg.allreduce_sum_async(t), "allreduce");
      per_op.push_back(seconds_since(start) / ops);
    }
    const double s = bench::median(per_op);
    const double algbw = static_cast<double>(bytes) / s;
    if (pg.rank() == 0) {
      fmt::print("| {} | {:.3f} ms | {:.2f} | {:.2f} |\n",
                 bytes >= (1 << 20) ? fmt::format("{} MiB", bytes >> 20) : fmt::format("{} KiB", bytes >> 10), s * 1e3,
                 algbw / 1e9, algbw * bus_factor / 1e9);
    }
  }
}

struct Net : torch::nn::Module {
  Net(int64_t width, int depth) {
    for (int i = 0; i < depth; ++i) layers->push_back(torch::nn::Linear(width, width));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : *layers) x = torch::relu(layer->as<torch::nn::Linear>()->forward(x));
    return x;
  }
  torch::nn::ModuleList layers;
};

/// The same network as a ModuleHolder, for amp::initialize.
struct MlpImpl : Net {
  using Net::Net;
};
TORCH_MODULE(Mlp);

void step_table(const ddp::ProcessGroup& pg, bool full, int rounds) {
  const int64_t width = full ? 2048 : 1024;
  const int depth = 8;
  const int64_t batch = 64;  // per rank
  torch::manual_seed(0);
  auto overlap_model = std::make_shared<Net>(width, depth);
  auto small_model = std::make_shared<Net>(width, depth);
  auto delayed_model = std::make_shared<Net>(width, depth);
  auto local_model = std::make_shared<Net>(width, depth);
  ddp::DistributedDataParallel overlap(overlap_model, pg);  // PyTorch's defaults: 1 MB first bucket, then 25 MB
  ddp::DistributedDataParallel small(small_model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(kSmallCapMb));
  ddp::DistributedDataParallel delayed(delayed_model, pg, ddp::DistributedDataParallelOptions().delay_allreduce(true));
  const auto x = torch::randn({batch, width});
  const auto y = torch::randn({batch, width});
  int64_t params = 0;
  for (const auto& p : local_model->parameters()) params += p.numel();

  struct Variant {
    std::string name;
    std::function<void()> step;
    std::vector<double> seconds;
  };
  std::vector<Variant> variants = {
      {fmt::format("DDP, overlapped, default buckets ({} buckets)", overlap.buckets().size()),
       [&] {
         overlap_model->zero_grad();
         torch::mse_loss(overlap.forward(x), y).backward();
       },
       {}},
      {fmt::format("DDP, overlapped, {} MB buckets ({} buckets)", kSmallCapMb, small.buckets().size()),
       [&] {
         small_model->zero_grad();
         torch::mse_loss(small.forward(x), y).backward();
       },
       {}},
      {"DDP, allreduce after backward (delay_allreduce)",
       [&] {
         delayed_model->zero_grad();
         torch::mse_loss(delayed.forward(x), y).backward();
       },
       {}},
      {"no communication (one process's share)",
       [&] {
         local_model->zero_grad();
         torch::mse_loss(local_model->forward(x), y).backward();
       },
       {}}};
  for (auto& v : variants) v.step();  // warm-up
  for (int r = 0; r < rounds; ++r) {
    for (auto& v : variants) {
      pg.barrier();
      const auto start = Clock::now();
      v.step();
      v.seconds.push_back(seconds_since(start));
    }
  }
  if (pg.rank() != 0) return;
  const double local = bench::median(variants[3].seconds);
  fmt::print(
      "\nDDP step (forward + backward + gradient averaging), MLP {} x Linear({}, {}) = {:.1f} M params "
      "({:.0f} MB of fp32 gradients), batch {} per rank, {} ranks, median of {} rounds\n",
      depth, width, width, params / 1e6, params * 4.0 / 1e6, batch, pg.size(), rounds);
  fmt::print("| variant | step ms | us per sample | x no-communication |\n|---|---|---|---|\n");
  for (const auto& v : variants) {
    const double s = bench::median(v.seconds);
    fmt::print("| {} | {:.1f} | {:.1f} | {:.2f}x |\n", v.name, s * 1e3, s * 1e6 / batch, s / local);
  }
  fmt::print("delay_allreduce / overlapped: {:.2f}x (default buckets), {:.2f}x ({} MB buckets)\n",
             bench::median(variants[2].seconds) / bench::median(variants[0].seconds),
             bench::median(variants[2].seconds) / bench::median(variants[1].seconds), kSmallCapMb);
}

void amp_table(const ddp::ProcessGroup& pg, bool full, int rounds) {
  const int64_t width = full ? 2048 : 1024;
  const int depth = 8;
  const int64_t batch = 64;
  struct Variant {
    std::string name;
    Mlp net{nullptr};
    std::unique_ptr<torch::optim::SGD> sgd;
    std::unique_ptr<amp::Initialized<Mlp>> amp;
    std::unique_ptr<ddp::DistributedDataParallel> ddp;
    std::vector<double> seconds;
  };
  std::vector<Variant> variants(2);
  variants[0].name = "amp O2 + DDP, unscale after backward (scope end)";
  variants[1].name = "amp O2 + DDP, unscale per reduced bucket (attach)";
  for (size_t i = 0; i < variants.size(); ++i) {
    Variant& v = variants[i];
    torch::manual_seed(0);
    v.net = Mlp(width, depth);
    v.sgd = std::make_unique<torch::optim::SGD>(v.net->parameters(), torch::optim::SGDOptions(1e-3));
    v.amp = std::make_unique<amp::Initialized<Mlp>>(
        amp::initialize(v.net, *v.sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16)));
    v.ddp = std::make_unique<ddp::DistributedDataParallel>(
        v.net, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(kSmallCapMb));
    if (i == 1) v.amp->optimizer.attach(*v.ddp);
  }
  const auto x = torch::randn({batch, width});
  const auto y = torch::randn({batch, width});
  auto step = [&](Variant& v) {
    v.amp->optimizer.zero_grad();
    auto out = v.amp->model.call([&](const torch::Tensor& in) { return v.ddp->forward(in); }, x);
    {
      auto scaled = amp::scale_loss(torch::mse_loss(out, y), v.amp->optimizer);
      scaled.backward();
    }
    v.amp->optimizer.step();
  };
  for (auto& v : variants) step(v);  // warm-up (and the bucket rebuild)
  for (int r = 0; r < rounds; ++r) {
    for (auto& v : variants) {
      pg.barrier();
      const auto start = Clock::now();
      step(v);
      v.seconds.push_back(seconds_since(start));
    }
  }
  if (pg.rank() != 0) return;
  fmt::print(
      "\namp O2 (bf16 model, fp32 masters, SGD) + DDP ({} MB buckets), same MLP, batch {} per rank, median of {} "
      "rounds\n| variant | step ms | us per sample |\n|---|---|---|\n",
      kSmallCapMb, batch, rounds);
  for (const auto& v : variants) {
    const double s = bench::median(v.seconds);
    fmt::print("| {} | {:.1f} | {:.1f} |\n", v.name, s * 1e3, s * 1e6 / batch);
  }
  fmt::print("scope end / attach: {:.2f}x\n", bench::median(variants[0].seconds) / bench::median(variants[1].seconds));
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  int rounds = 10;
  int threads = 1;
  CLI::App app{"Gloo allreduce bus bandwidth vs bucket size; DDP step with and without overlap (2 local ranks)"};
  app.add_flag("--full", full, "Larger buckets (64 MiB) and a wider model");
  app.add_option("--rounds", rounds, "Timed rounds per measurement")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads per rank")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  ddp::spawn(kWorld, [&](int, int) {
    at::set_num_threads(threads);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    allreduce_table(pg, full, rounds);
    step_table(pg, full, rounds);
    amp_table(pg, full, rounds);
  });
  return 0;
}
