#pragma once

namespace kernels::cpu {

/// The instruction sets the CPU twins are compiled for. Each twin's source is compiled once per capability
/// (in namespace kernels::cpu::DEFAULT / AVX2 / AVX512, like ATen's own CPU kernels) and the dispatcher calls
/// the one ATen itself uses on this machine (at::get_cpu_capability, which honours ATEN_CPU_CAPABILITY).
enum class Capability { kDefault, kAvx2, kAvx512 };

/// The capability to run, decided once per process.
Capability capability();

/// "DEFAULT", "AVX2" or "AVX512".
const char* capability_name(Capability capability);

}  // namespace kernels::cpu

/// Declares `void name params` in each capability namespace and defines kernels::cpu::name as the dispatcher
/// that forwards to the variant chosen by capability(). Use once per twin, inside namespace kernels::cpu of
/// the op's ATen-facing .cpp (compiled once).
#ifdef LIBTORCH_AMP_CPU_X86_VARIANTS
#define LTA_CPU_DISPATCH(name, params, args) \
  namespace DEFAULT {                        \
  void name params;                          \
  }                                          \
  namespace AVX2 {                           \
  void name params;                          \
  }                                          \
  namespace AVX512 {                         \
  void name params;                          \
  }                                          \
  void name params {                         \
    switch (capability()) {                  \
      case Capability::kAvx512:              \
        return AVX512::name args;            \
      case Capability::kAvx2:                \
        return AVX2::name args;              \
      case Capability::kDefault:             \
        break;                               \
    }                                        \
    return DEFAULT::name args;               \
  }
#else
#define LTA_CPU_DISPATCH(name, params, args) \
  namespace DEFAULT {                        \
  void name params;                          \
  }                                          \
  void name params { return DEFAULT::name args; }
#endif
