# ctest driver: install the built tree into a scratch prefix, configure + build tests/consumer against it, run it,
# and (with -DLAUNCHER=ON) run the installed ddp-launch.
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
endif()
set(arch_args "")
if(CUDA_ARCHS)  # a CPU-only build has none, and CMake refuses an empty CMAKE_CUDA_ARCHITECTURES
  set(arch_args "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build" -G "${GENERATOR}"
                        "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;${TORCH_PREFIX}" ${arch_args}
                        -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer project failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer project failed (${rc})")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer program failed (${rc})")
endif()
# The installed launcher must start as installed: from the prefix, with no LD_LIBRARY_PATH to find LibTorch (its
# RUNPATH does), both for --help and for a launch of two workers.
if(LAUNCHER)
  set(launcher "${WORK_DIR}/prefix/bin/ddp-launch")
  if(NOT EXISTS "${launcher}")
    message(FATAL_ERROR "the install tree has no bin/ddp-launch")
  endif()
  foreach(args "--help" "--nproc-per-node;2;--master-port;0;${CMAKE_COMMAND};-E;true")
    execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH "${launcher}" ${args}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      list(JOIN args " " args)
      message(FATAL_ERROR "the installed ddp-launch ${args} failed (${rc}): ${err}")
    endif()
  endforeach()
  message("consumer: the installed ddp-launch started 2 workers")
endif()
