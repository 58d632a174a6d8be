// ddp-launch: a python-free torchrun. See ddp/launch/launcher.h.
#include <cstdlib>
#include <iostream>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <ddp/launch/launcher.h>

int main(int argc, char** argv) {
  // LibTorch's TCPStore logs a warning with a C++ backtrace when the store it calls is gone (node 0's launcher
  // lost); the launcher says what happened in its own one line. Its log is kept as it is when the user asks for it.
  constexpr int kErrorsOnly = 2;  // c10's levels: 0 info, 1 warning, 2 error
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) FLAGS_caffe2_log_level = kErrorsOnly;
  const ddp::ParsedLaunchArgs parsed = ddp::parse_launch_args(argc, argv);
  if (!parsed.config) {
    (parsed.exit_code == 0 ? std::cout : std::cerr) << parsed.output;
    return parsed.exit_code;
  }
  try {
    return ddp::run_launch(*parsed.config, std::cerr);
  } catch (const c10::Error& e) {
    std::cerr << "ddp-launch: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
