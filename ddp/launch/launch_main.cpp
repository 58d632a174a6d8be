// ddp-launch: a python-free torchrun. See ddp/launch/launcher.h.
#include <iostream>

#include <c10/util/Exception.h>

#include <ddp/launch/launcher.h>

int main(int argc, char** argv) {
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
