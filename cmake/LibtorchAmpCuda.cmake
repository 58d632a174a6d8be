# Settles the CUDA language before LibTorch is found. On error it sets LIBTORCH_AMP_CONFIG_ERROR and returns
# (see lta_stop_on_config_error in the top-level CMakeLists.txt).
set(LIBTORCH_AMP_WITH_CUDA OFF)
if(LIBTORCH_AMP_CUDA)
  if(DEFINED ENV{CUDACXX} AND NOT EXISTS "$ENV{CUDACXX}")
    set(LIBTORCH_AMP_CONFIG_ERROR
      "LIBTORCH_AMP_CUDA is ON but no CUDA compiler (nvcc) was found: CUDACXX=$ENV{CUDACXX} does not exist. "
      "Fix: set CUDACXX to your nvcc (e.g. /usr/local/cuda/bin/nvcc), or configure with -DLIBTORCH_AMP_CUDA=OFF.")
    return()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    set(LIBTORCH_AMP_CONFIG_ERROR
      "LIBTORCH_AMP_CUDA is ON but no CUDA compiler (nvcc) was found. Install the CUDA toolkit "
      "(matching LibTorch's CUDA version) and put nvcc on PATH or set CUDACXX=/path/to/nvcc, "
      "or configure with -DLIBTORCH_AMP_CUDA=OFF to build the CPU-only parts.")
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # Ampere and Hopper by default; `-DCMAKE_CUDA_ARCHITECTURES=native` or a list overrides it.
    set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures to build for")
  endif()
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  # Share the CUDA runtime LibTorch loads (same soname) rather than a static copy of our own.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  set(LIBTORCH_AMP_WITH_CUDA ON)
endif()
