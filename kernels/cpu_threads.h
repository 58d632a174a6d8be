#pragma once

// How the CPU kernels use threads. They spread their loops with at::parallel_for, compiled with OpenMP like
// LibTorch's own kernels, so the same settings govern both: at::set_num_threads (per calling thread, as for ATen)
// and OMP_NUM_THREADS. One OpenMP runtime serves both: the one LibTorch loads. A kernel's results are the same,
// bit for bit, for any number of threads: work is split into chunks fixed by the data (64 Ki elements, or one
// channel), and partial results are combined in chunk order.

namespace kernels {

/// How many threads ran a part of the calling thread's most recent CPU kernel loop: 1 when it ran serially (one
/// thread configured, too little work to split, or called from inside another parallel region); 0 before any loop
/// and after an empty one. A loop whose body threw leaves the value of the loop before it.
/// A diagnostic for tests and for checking a deployment's threading (for example that OMP_NUM_THREADS reaches the
/// kernels); it costs one relaxed atomic add per thread per loop.
int last_cpu_loop_threads();

namespace detail {
void record_cpu_loop_threads(int threads);
}  // namespace detail

}  // namespace kernels
