# Third-party dependencies, all from the ecosystem. A machine without apt or network (the GPU machine) can
# hand CMake a source or header directory for each: -DGTEST_SOURCE_DIR, -DCLI11_INCLUDE_DIR,
# -DFMT_INCLUDE_DIR, -DBENCHMARK_SOURCE_DIR, -DNLOHMANN_JSON_INCLUDE_DIR.

# GoogleTest: an installed package, else built from source (GTEST_SOURCE_DIR, default /usr/src/googletest).
set(GTEST_SOURCE_DIR "" CACHE PATH "GoogleTest source tree to build when no installed GTest is found")
if(LIBTORCH_AMP_TESTS)
  if(NOT GTEST_SOURCE_DIR)
    find_package(GTest CONFIG QUIET)
  endif()
  if(NOT TARGET GTest::gtest_main)
    if(NOT GTEST_SOURCE_DIR AND EXISTS /usr/src/googletest/CMakeLists.txt)
      set(GTEST_SOURCE_DIR /usr/src/googletest)
    endif()
    if(NOT EXISTS "${GTEST_SOURCE_DIR}/CMakeLists.txt")
      message(FATAL_ERROR "libtorch_amp: GoogleTest not found. Fix: apt-get install libgtest-dev, or pass "
                          "-DGTEST_SOURCE_DIR=<googletest source>, or -DLIBTORCH_AMP_TESTS=OFF.")
    endif()
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory("${GTEST_SOURCE_DIR}" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL SYSTEM)
    set(LIBTORCH_AMP_GTEST_FROM "source ${GTEST_SOURCE_DIR}")
  else()
    set(LIBTORCH_AMP_GTEST_FROM "installed package")
  endif()
  include(GoogleTest)
endif()

# Google Benchmark (optional): programs that need it are skipped with a message when it is absent.
set(BENCHMARK_SOURCE_DIR "" CACHE PATH "Google Benchmark source tree to build when no installed one is found")
set(LIBTORCH_AMP_GBENCH_FROM "not found (micro-benchmarks skipped)")
if(LIBTORCH_AMP_BENCHMARKS)
  if(BENCHMARK_SOURCE_DIR)
    set(BENCHMARK_ENABLE_TESTING OFF CACHE BOOL "" FORCE)
    set(BENCHMARK_ENABLE_INSTALL OFF CACHE BOOL "" FORCE)
    add_subdirectory("${BENCHMARK_SOURCE_DIR}" "${CMAKE_BINARY_DIR}/_deps/benchmark" EXCLUDE_FROM_ALL SYSTEM)
    set(LIBTORCH_AMP_GBENCH_FROM "source ${BENCHMARK_SOURCE_DIR}")
  else()
    find_package(benchmark CONFIG QUIET)
    if(TARGET benchmark::benchmark)
      set(LIBTORCH_AMP_GBENCH_FROM "installed package")
    endif()
  endif()
endif()

# fmt, header-only. LibTorch ships fmt's headers; using them (rather than a second, system fmt of another
# version) keeps one fmt in every translation unit. FMT_INCLUDE_DIR overrides.
set(FMT_INCLUDE_DIR "" CACHE PATH "Directory holding fmt/format.h (default: the one LibTorch ships)")
if(NOT FMT_INCLUDE_DIR AND EXISTS "${LIBTORCH_AMP_TORCH_ROOT}/include/fmt/format.h")
  set(FMT_INCLUDE_DIR "${LIBTORCH_AMP_TORCH_ROOT}/include")
endif()
if(NOT EXISTS "${FMT_INCLUDE_DIR}/fmt/format.h")
  find_path(FMT_INCLUDE_DIR fmt/format.h)
endif()
if(NOT EXISTS "${FMT_INCLUDE_DIR}/fmt/format.h")
  message(FATAL_ERROR "libtorch_amp: fmt headers not found. Fix: apt-get install libfmt-dev or pass -DFMT_INCLUDE_DIR=<dir with fmt/format.h>.")
endif()
add_library(lta_fmt INTERFACE)
target_include_directories(lta_fmt SYSTEM INTERFACE "${FMT_INCLUDE_DIR}")
target_compile_definitions(lta_fmt INTERFACE FMT_HEADER_ONLY=1)

# nlohmann-json (header-only), for the JSON the libraries and programs write and read (metrics lines, Chrome traces,
# benchmark results, the launcher's error files). Private to the .cpp files: no installed header includes it, so a
# project that links libtorch_amp needs none.
set(NLOHMANN_JSON_INCLUDE_DIR "" CACHE PATH "Directory holding nlohmann/json.hpp (default: the installed package)")
if(NOT NLOHMANN_JSON_INCLUDE_DIR)
  find_package(nlohmann_json 3.10 CONFIG QUIET)
endif()
add_library(lta_json INTERFACE)
if(TARGET nlohmann_json::nlohmann_json AND NOT NLOHMANN_JSON_INCLUDE_DIR)
  target_link_libraries(lta_json INTERFACE nlohmann_json::nlohmann_json)
else()
  if(NOT EXISTS "${NLOHMANN_JSON_INCLUDE_DIR}/nlohmann/json.hpp")
    find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp)
  endif()
  if(NOT EXISTS "${NLOHMANN_JSON_INCLUDE_DIR}/nlohmann/json.hpp")
    message(FATAL_ERROR "libtorch_amp: nlohmann-json not found. Fix: apt-get install nlohmann-json3-dev, or pass "
                        "-DNLOHMANN_JSON_INCLUDE_DIR=<dir with nlohmann/json.hpp>.")
  endif()
  target_include_directories(lta_json SYSTEM INTERFACE "${NLOHMANN_JSON_INCLUDE_DIR}")
endif()

# CLI11 (header-only), for the examples' and benchmarks' command lines.
find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp DOC "Directory holding CLI/CLI.hpp")
set(LIBTORCH_AMP_HAVE_CLI11 OFF)
if(EXISTS "${CLI11_INCLUDE_DIR}/CLI/CLI.hpp")
  set(LIBTORCH_AMP_HAVE_CLI11 ON)
  add_library(lta_cli11 INTERFACE)
  target_include_directories(lta_cli11 SYSTEM INTERFACE "${CLI11_INCLUDE_DIR}")
elseif(LIBTORCH_AMP_EXAMPLES OR LIBTORCH_AMP_BENCHMARKS)
  message(FATAL_ERROR "libtorch_amp: CLI11 not found (examples and benchmarks need it). Fix: apt-get install "
                      "libcli11-dev, pass -DCLI11_INCLUDE_DIR=<dir with CLI/CLI.hpp>, or turn examples and benchmarks off.")
endif()

# zlib (optional): reading the .gz IDX files of Fashion-MNIST directly.
find_package(ZLIB QUIET)

# NCCL and cuBLASLt: headers from the toolkit or the pip wheels' nvidia/*/include; libraries preferably the
# very ones LibTorch loads (the wheel's nvidia/*/lib, or LibTorch's own lib/), so one copy is in the process.
set(LIBTORCH_AMP_NCCL "not found")
set(LIBTORCH_AMP_CUBLASLT "not found")
if(LIBTORCH_AMP_WITH_CUDA)
  get_filename_component(_lta_site "${LIBTORCH_AMP_TORCH_ROOT}/.." ABSOLUTE)
  set(_lta_wheel_dirs "${_lta_site}/nvidia/nccl" "${_lta_site}/nvidia/cu${CUDAToolkit_VERSION_MAJOR}"
                      "${_lta_site}/nvidia/cublas")
  set(_lta_lib_hints "${LIBTORCH_AMP_TORCH_ROOT}/lib")
  set(_lta_inc_hints "")
  foreach(d IN LISTS _lta_wheel_dirs)
    list(APPEND _lta_lib_hints "${d}/lib")
    list(APPEND _lta_inc_hints "${d}/include")
  endforeach()
  list(APPEND _lta_inc_hints ${CUDAToolkit_INCLUDE_DIRS})
  list(APPEND _lta_lib_hints ${CUDAToolkit_LIBRARY_DIR})

  find_path(LIBTORCH_AMP_NCCL_INCLUDE_DIR nccl.h HINTS ${_lta_inc_hints})
  find_library(LIBTORCH_AMP_NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR HINTS ${_lta_lib_hints} NO_DEFAULT_PATH)
  if(LIBTORCH_AMP_NCCL_INCLUDE_DIR AND LIBTORCH_AMP_NCCL_LIBRARY)
    add_library(lta_nccl INTERFACE)
    target_include_directories(lta_nccl SYSTEM INTERFACE "${LIBTORCH_AMP_NCCL_INCLUDE_DIR}")
    target_link_libraries(lta_nccl INTERFACE "${LIBTORCH_AMP_NCCL_LIBRARY}")
    set(LIBTORCH_AMP_NCCL "${LIBTORCH_AMP_NCCL_LIBRARY}")
  endif()

  find_path(LIBTORCH_AMP_CUBLASLT_INCLUDE_DIR cublasLt.h HINTS ${_lta_inc_hints})
  find_library(LIBTORCH_AMP_CUBLASLT_LIBRARY NAMES "libcublasLt.so.${CUDAToolkit_VERSION_MAJOR}" cublasLt NAMES_PER_DIR
               HINTS ${_lta_lib_hints} NO_DEFAULT_PATH)
  if(LIBTORCH_AMP_CUBLASLT_INCLUDE_DIR AND LIBTORCH_AMP_CUBLASLT_LIBRARY)
    add_library(lta_cublaslt INTERFACE)
    target_include_directories(lta_cublaslt SYSTEM INTERFACE "${LIBTORCH_AMP_CUBLASLT_INCLUDE_DIR}")
    target_link_libraries(lta_cublaslt INTERFACE "${LIBTORCH_AMP_CUBLASLT_LIBRARY}")
    set(LIBTORCH_AMP_CUBLASLT "${LIBTORCH_AMP_CUBLASLT_LIBRARY}")
  endif()
endif()

# Gloo: LibTorch's pip wheel does not ship gloo's headers, which ProcessGroupGloo.hpp includes.
find_path(LIBTORCH_AMP_GLOO_INCLUDE_DIR gloo/config.h HINTS "${LIBTORCH_AMP_TORCH_ROOT}/include")
