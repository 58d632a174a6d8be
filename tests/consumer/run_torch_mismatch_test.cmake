# ctest driver: an install tree that records another LibTorch version than the one a consumer finds must stop the
# consumer's configure with one line naming both (not fail later at link or run time). Installs the built tree into a
# scratch prefix, rewrites the version its libtorch_ampConfig.cmake records, and configures tests/consumer against it
# through expect_configure_error.cmake.
# Usage: cmake -DSOURCE_DIR=... -DBUILD_DIR=... -DWORK_DIR=... -DTORCH_PREFIX=<libtorch>/share/cmake
#              [-DCUDA_ARCHS=...] -P run_torch_mismatch_test.cmake
set(fake_version "0.0.1+mismatch")
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix" OUTPUT_QUIET
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
endif()
file(GLOB config "${WORK_DIR}/prefix/*/cmake/libtorch_amp/libtorch_ampConfig.cmake")
file(READ "${config}" text)
string(REGEX REPLACE "set\\(libtorch_amp_TORCH_VERSION \"[^\"]*\"\\)" "set(libtorch_amp_TORCH_VERSION \"${fake_version}\")"
       faked "${text}")
if(faked STREQUAL text)
  message(FATAL_ERROR "${config} records no libtorch_amp_TORCH_VERSION to fake")
endif()
file(WRITE "${config}" "${faked}")

set(ARGS "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DTorch_DIR=${TORCH_PREFIX}/Torch")
if(CUDA_ARCHS)
  list(APPEND ARGS "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}")
endif()
set(SOURCE_DIR "${SOURCE_DIR}/tests/consumer")
set(WORK_DIR "${WORK_DIR}/build")
include("${CMAKE_CURRENT_LIST_DIR}/../cmake/expect_configure_error.cmake")
