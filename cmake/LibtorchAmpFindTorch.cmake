# Finds LibTorch. Order: Torch_DIR / CMAKE_PREFIX_PATH when the user gave them; else the project's
# .venv python's torch.utils.cmake_prefix_path; else the system python3's. Fails with one line that says
# what is missing and how to fix it (LIBTORCH_AMP_CONFIG_ERROR, see lta_stop_on_config_error).
function(_lta_python_torch_prefix python out_var)
  if(NOT EXISTS "${python}" AND NOT python STREQUAL "python3")
    return()
  endif()
  execute_process(
    COMMAND "${python}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND EXISTS "${prefix}/Torch/TorchConfig.cmake")
    set(${out_var} "${prefix}" PARENT_SCOPE)
  endif()
endfunction()

set(_lta_user_torch_dir "${Torch_DIR}")
set(_lta_user_gave_torch OFF)
if(DEFINED Torch_DIR OR DEFINED ENV{Torch_DIR} OR CMAKE_PREFIX_PATH OR DEFINED ENV{CMAKE_PREFIX_PATH})
  set(_lta_user_gave_torch ON)
endif()
set(LIBTORCH_AMP_TORCH_FROM "Torch_DIR / CMAKE_PREFIX_PATH")
if(NOT _lta_user_gave_torch)
  set(_lta_prefix "")
  _lta_python_torch_prefix("${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python" _lta_prefix)
  set(LIBTORCH_AMP_TORCH_FROM "the project's .venv")
  if(NOT _lta_prefix)
    _lta_python_torch_prefix("python3" _lta_prefix)
    set(LIBTORCH_AMP_TORCH_FROM "python3's torch")
  endif()
  if(_lta_prefix)
    list(APPEND CMAKE_PREFIX_PATH "${_lta_prefix}")
  endif()
endif()

# Caffe2's config overwrites CMAKE_CUDA_ARCHITECTURES and appends -gencode flags for a dozen architectures to
# CMAKE_CUDA_FLAGS. Our CUDA code is ours to configure: keep the user's choice and restore both afterwards.
set(_lta_saved_cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
set(_lta_saved_cuda_flags "${CMAKE_CUDA_FLAGS}")
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "")
  foreach(_lta_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    string(REGEX REPLACE "^([0-9]+)([0-9])[a-z-]*$" "\\1.\\2" _lta_arch "${_lta_arch}")
    if(_lta_arch MATCHES "^[0-9]+\\.[0-9]$")
      list(APPEND TORCH_CUDA_ARCH_LIST "${_lta_arch}")
    endif()
  endforeach()
  # Without a list (a CPU-only build of ours, or "native") Caffe2 probes for GPUs with a CUDA try_run, which
  # fails on a machine without one; our own CUDA flags do not come from this list anyway.
  if(NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
  endif()
endif()
unset(CMAKE_CUDA_ARCHITECTURES)
unset(CMAKE_CUDA_ARCHITECTURES CACHE)
find_package(Torch QUIET)
if(LIBTORCH_AMP_WITH_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES "${_lta_saved_cuda_archs}" CACHE STRING "CUDA architectures to build for" FORCE)
endif()
set(CMAKE_CUDA_FLAGS "${_lta_saved_cuda_flags}")
if(NOT Torch_FOUND)
  set(_lta_where "no Torch_DIR or CMAKE_PREFIX_PATH was given, and neither .venv/bin/python nor python3 has torch")
  if(_lta_user_torch_dir)
    set(_lta_where "Torch_DIR=${_lta_user_torch_dir} holds no usable TorchConfig.cmake")
  elseif(CMAKE_PREFIX_PATH)
    set(_lta_where "no TorchConfig.cmake under CMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH}")
  endif()
  set(LIBTORCH_AMP_CONFIG_ERROR
    "LibTorch not found: ${_lta_where}. Fix: run `make build` (it installs torch==2.11.0 "
    "into .venv), or pass -DTorch_DIR=<libtorch>/share/cmake/Torch (or -DCMAKE_PREFIX_PATH=<libtorch>).")
  return()
endif()

get_filename_component(LIBTORCH_AMP_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)
set(LIBTORCH_AMP_TORCH_VERSION "${Torch_VERSION}")
if(EXISTS "${LIBTORCH_AMP_TORCH_ROOT}/include/torch/version.h")
  file(STRINGS "${LIBTORCH_AMP_TORCH_ROOT}/include/torch/version.h" _lta_ver REGEX "define TORCH_VERSION \"")
  string(REGEX REPLACE ".*TORCH_VERSION \"([^\"]+)\".*" "\\1" LIBTORCH_AMP_TORCH_VERSION "${_lta_ver}")
endif()

set(LIBTORCH_AMP_TORCH_HAS_CUDA OFF)
if(TARGET torch_cuda)
  set(LIBTORCH_AMP_TORCH_HAS_CUDA ON)
endif()
if(LIBTORCH_AMP_WITH_CUDA AND NOT LIBTORCH_AMP_TORCH_HAS_CUDA)
  set(LIBTORCH_AMP_CONFIG_ERROR
    "the LibTorch at ${LIBTORCH_AMP_TORCH_ROOT} is a CPU-only build, but LIBTORCH_AMP_CUDA is ON. "
    "Fix: point Torch_DIR at a CUDA build of LibTorch, or configure with -DLIBTORCH_AMP_CUDA=OFF.")
  return()
endif()
if(LIBTORCH_AMP_WITH_CUDA AND CUDAToolkit_VERSION_MAJOR AND CAFFE2_USE_CUDA AND CUDA_VERSION)
  string(REGEX MATCH "^[0-9]+" _lta_torch_cuda_major "${CUDA_VERSION}")
  if(NOT _lta_torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
    set(LIBTORCH_AMP_CONFIG_ERROR
      "CUDA toolkit ${CUDAToolkit_VERSION} does not match LibTorch's CUDA ${CUDA_VERSION}. "
      "Fix: set CUDACXX to the matching nvcc, or use the LibTorch built for CUDA ${CUDAToolkit_VERSION_MAJOR}.")
  endif()
endif()
