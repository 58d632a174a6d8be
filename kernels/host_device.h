#pragma once

// LTA_HOST_DEVICE marks the plain-C++ rules (loss-scale state machine, clip coefficient, optimizer updates) that
// are compiled both into CPU code and into CUDA kernels from one definition.
#if defined(__CUDACC__)
#define LTA_HOST_DEVICE __host__ __device__
#else
#define LTA_HOST_DEVICE
#endif
