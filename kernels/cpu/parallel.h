#pragma once

// The one way the kernels spread a loop over CPU threads. Every at::parallel_for of the project is called here,
// and tests/kernels/check_parallel_for.cmake fails a test when one appears anywhere else.
//
// at::parallel_for is inline (ATen/Parallel-inl.h): where LibTorch was built for OpenMP (AT_PARALLEL_OPENMP), it
// spreads the work only in a translation unit compiled with OpenMP (_OPENMP defined) and silently runs the whole
// range on the calling thread otherwise. The build compiles the kernels library with OpenMP
// (cmake/LibtorchAmpThreads.cmake); the check below makes a translation unit that lost the flag fail to compile
// instead of running serially.

#include <atomic>
#include <cstdint>

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error \
    "kernels/cpu/parallel.h: LibTorch parallelizes with OpenMP (AT_PARALLEL_OPENMP), but this translation unit is not compiled with OpenMP, so at::parallel_for would run every loop on one thread. Compile it as part of amp_kernels (which adds the flag) or with lta_use_openmp (cmake/LibtorchAmpThreads.cmake)."
#endif

#include <kernels/cpu_threads.h>

namespace kernels::cpu {

/// at::parallel_for(begin, end, grain, fn), which also records how many threads ran a part of the range
/// (kernels::last_cpu_loop_threads). fn(first, last) is called once per part; every index is in exactly one part.
/// The parts' boundaries depend on the thread count, so a kernel's results must not: loop over fixed chunks
/// (kernels/cpu/chunks.h) and combine per-chunk results in chunk order afterwards.
template <typename Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  std::atomic<int> parts{0};
  at::parallel_for(begin, end, grain, [&](int64_t first, int64_t last) {
    parts.fetch_add(1, std::memory_order_relaxed);
    fn(first, last);
  });
  ::kernels::detail::record_cpu_loop_threads(parts.load(std::memory_order_relaxed));
}

}  // namespace kernels::cpu
