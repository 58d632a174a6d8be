#include <kernels/cpu_threads.h>

namespace kernels {
namespace {
thread_local int last_loop_threads = 0;
}  // namespace

int last_cpu_loop_threads() { return last_loop_threads; }

namespace detail {
void record_cpu_loop_threads(int threads) { last_loop_threads = threads; }
}  // namespace detail

}  // namespace kernels
