# The CPU kernels' threads (cmake/LibtorchAmpOpenMP.cmake says why): when LibTorch parallelizes with OpenMP, the
# compiler's OpenMP flag (LIBTORCH_AMP_OPENMP_FLAGS, for the translation units that call at::parallel_for: the
# kernels library, see lta_use_openmp) and the runtime LibTorch loads (lta_openmp_runtime). The installed package
# records LIBTORCH_AMP_OPENMP, and its config finds the runtime of the consumer's LibTorch again.
include(LibtorchAmpOpenMP)

lta_torch_uses_openmp("${TORCH_INCLUDE_DIRS}" LIBTORCH_AMP_OPENMP)
set(LIBTORCH_AMP_OPENMP_FLAGS "")
set(LIBTORCH_AMP_OPENMP_RUNTIME "")
if(LIBTORCH_AMP_OPENMP)
  # GCC: LibTorch's runtime (the wheel's) is GNU libgomp, and only GCC's OpenMP code calls it; clang's calls LLVM's
  # libomp, which would be a second runtime beside LibTorch's.
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set(LIBTORCH_AMP_CONFIG_ERROR
      "LibTorch at ${LIBTORCH_AMP_TORCH_ROOT} parallelizes with OpenMP (AT_PARALLEL_OPENMP in ATen/Config.h), and "
      "the CPU kernels must be compiled by GCC to use LibTorch's GNU OpenMP runtime (${CMAKE_CXX_COMPILER_ID}'s "
      "OpenMP code would call another runtime, a second thread pool). Fix: configure with CXX=g++.")
    return()
  endif()
  find_package(OpenMP QUIET COMPONENTS CXX)
  if(NOT OpenMP_CXX_FOUND)
    set(LIBTORCH_AMP_CONFIG_ERROR
      "LibTorch at ${LIBTORCH_AMP_TORCH_ROOT} parallelizes with OpenMP (AT_PARALLEL_OPENMP in ATen/Config.h), but "
      "CMake's FindOpenMP found no OpenMP support in ${CMAKE_CXX_COMPILER}, and without it every CPU kernel would run "
      "on one thread. Fix: install GCC's OpenMP support (Debian: libgcc-12-dev, which GCC itself depends on).")
    return()
  endif()
  separate_arguments(LIBTORCH_AMP_OPENMP_FLAGS UNIX_COMMAND "${OpenMP_CXX_FLAGS}")
  lta_add_openmp_runtime_target(lta_openmp_runtime "${LIBTORCH_AMP_TORCH_ROOT}" LIBTORCH_AMP_OPENMP_RUNTIME)
  if(NOT LIBTORCH_AMP_OPENMP_RUNTIME)
    set(LIBTORCH_AMP_CONFIG_ERROR
      "LibTorch at ${LIBTORCH_AMP_TORCH_ROOT} parallelizes with OpenMP, but neither LibTorch nor the system has the "
      "OpenMP runtime to link (no libgomp). Fix: install GCC's OpenMP runtime (Debian: libgomp1).")
    return()
  endif()
endif()

# Compiles `target`'s C++ sources with OpenMP and links the runtime LibTorch loads (one runtime, one thread pool).
# For targets whose sources call at::parallel_for (through kernels/cpu/parallel.h, which refuses to compile
# without it). The installed package links libtorch_amp::openmp_runtime instead, defined by its config.
function(lta_use_openmp target)
  if(NOT LIBTORCH_AMP_OPENMP)
    return()
  endif()
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${LIBTORCH_AMP_OPENMP_FLAGS}>")
  target_link_libraries(${target} PUBLIC $<BUILD_INTERFACE:lta_openmp_runtime>
                                         $<INSTALL_INTERFACE:libtorch_amp::openmp_runtime>)
endfunction()
