#include "common/training.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

std::string invalid_argument_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

TEST(OneLineTest, CutsANestedBacktraceJoinsLinesAndEscapesBytes) {
  EXPECT_EQ(examples::one_line("cannot read 'x': bad zip\nException raised from load at f.cpp:3 (most recent call "
                               "first):\nframe #0: c10::Error::Error()"),
            "cannot read 'x': bad zip");
  EXPECT_EQ(examples::one_line("first\nsecond\n"), "first; second");
  EXPECT_EQ(examples::one_line(std::string("bad \x01\xff\tend", 10)), "bad \\x01\\xff end");
}

TEST(OneLineTest, WhatOfALibTorchErrorIsCutToItsMessage) {
  try {
    TORCH_CHECK(false, "the message");
  } catch (const c10::Error& e) {
    EXPECT_EQ(examples::one_line(std::string("wrapped: ") + e.what()), "wrapped: the message");
  }
}

TEST(PickDeviceTest, NamesTheFlagForDevicesThatAreNotThere) {
  EXPECT_EQ(examples::pick_device("cpu"), torch::Device(torch::kCPU));
  EXPECT_EQ(invalid_argument_of([] { examples::pick_device("tpu"); }),
            "--device 'tpu' is not a device: use auto, cpu, cuda or cuda:N");
  if (torch::cuda::is_available()) {
    const auto visible = static_cast<int>(torch::cuda::device_count());
    EXPECT_EQ(examples::pick_device("cuda", visible - 1), torch::Device(torch::kCUDA, visible - 1));
    EXPECT_NE(invalid_argument_of([&] {
                examples::pick_device("cuda:" + std::to_string(visible));
              }).find("only " + std::to_string(visible) + " CUDA GPU(s) are visible"),
              std::string::npos);
  } else {
    EXPECT_EQ(invalid_argument_of([] { examples::pick_device("cuda"); }),
              "--device cuda: no CUDA GPU is visible (use --device cpu)");
    EXPECT_EQ(examples::pick_device("auto"), torch::Device(torch::kCPU));
  }
}

TEST(CheckCommonFlagsTest, NamesTheFlagAndTheValue) {
  examples::CommonFlags good;
  examples::check_common_flags(good);
  const auto error_with = [&](const std::function<void(examples::CommonFlags&)>& change) {
    examples::CommonFlags flags;
    change(flags);
    return invalid_argument_of([&] { examples::check_common_flags(flags); });
  };
  EXPECT_EQ(error_with([](auto& f) { f.batch_size = 0; }), "--batch-size must be a positive integer, got 0");
  EXPECT_EQ(error_with([](auto& f) { f.epochs = -3; }), "--epochs must be a positive integer, got -3");
  EXPECT_EQ(error_with([](auto& f) { f.lr = std::nan(""); }), "--lr must be a positive finite number, got nan");
  EXPECT_EQ(error_with([](auto& f) { f.lr = std::numeric_limits<double>::infinity(); }),
            "--lr must be a positive finite number, got inf");
  EXPECT_EQ(error_with([](auto& f) { f.limit_train = -1; }), "--limit-train must be 0 (all) or positive, got -1");
  EXPECT_EQ(error_with([](auto& f) { f.resume = "/nonexistent/model.pt"; }),
            "--resume '/nonexistent/model.pt': no such file");
  EXPECT_EQ(error_with([](auto& f) { f.resume = "/tmp"; }), "--resume '/tmp': not a file");
  EXPECT_EQ(error_with([](auto& f) { f.save = "/nonexistent/model.pt"; }),
            "--save '/nonexistent/model.pt': the folder '/nonexistent' does not exist");
  EXPECT_EQ(error_with([](auto& f) { f.save = "/tmp"; }), "--save '/tmp': it is a folder, not a file");
}

TEST(ParseFlagsTest, ABadCommandLineIsOneLineAndANonZeroStatus) {
  examples::CommonFlags flags;
  CLI::App app{"test"};
  examples::add_common_flags(app, flags);
  char program[] = "/path/to/example";
  char flag[] = "--no-such-flag";
  char* argv[] = {program, flag};
  testing::internal::CaptureStderr();
  const auto status = examples::parse_flags(app, 2, argv);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(status.has_value());
  EXPECT_NE(*status, 0);
  EXPECT_EQ(err, "example: The following argument was not expected: --no-such-flag (see --help)\n");
}

}  // namespace
