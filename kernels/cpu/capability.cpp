#include <kernels/cpu/capability.h>

#include <string>

#include <ATen/Version.h>

namespace kernels::cpu {

Capability capability() {
  static const Capability chosen = [] {
#ifdef LIBTORCH_AMP_CPU_X86_VARIANTS
    const std::string aten = at::get_cpu_capability();
    if (aten == "AVX512") return Capability::kAvx512;
    if (aten == "AVX2") return Capability::kAvx2;
#endif
    return Capability::kDefault;
  }();
  return chosen;
}

const char* capability_name(Capability capability) {
  switch (capability) {
    case Capability::kAvx512:
      return "AVX512";
    case Capability::kAvx2:
      return "AVX2";
    case Capability::kDefault:
      break;
  }
  return "DEFAULT";
}

}  // namespace kernels::cpu
