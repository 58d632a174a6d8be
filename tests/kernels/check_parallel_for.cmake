# ctest driver (issue 44): the serial fallback of at::parallel_for cannot come back silently.
#  1. No source of the project calls at::parallel_for / at::parallel_reduce (or brings them in unqualified) except
#     kernels/cpu/parallel.h, whose wrapper every CPU loop uses. LibTorch's own inline users (parallel_apply of
#     torch/nn/parallel/data_parallel.h) are not seen here: ddp::DataParallel uses its own.
#  2. kernels/cpu/parallel.h refuses to compile without OpenMP where LibTorch parallelizes with it (its #error),
#     and compiles with the flags the build gives the kernels library.
# Usage: cmake -DSOURCE_DIR=... -DWORK_DIR=... -DCOMPILE_COMMANDS=<build>/compile_commands.json
#              -DFLAGS_FROM=<a source of amp_kernels> -DOPENMP=<0|1> -P check_parallel_for.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(offenders "")
file(GLOB_RECURSE sources RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/amp/*" "${SOURCE_DIR}/ddp/*" "${SOURCE_DIR}/kernels/*"
     "${SOURCE_DIR}/python_free_examples/*" "${SOURCE_DIR}/benchmarks/*" "${SOURCE_DIR}/tests/*")
list(FILTER sources INCLUDE REGEX "\\.(h|hpp|cpp|cc|cu|cuh)$")
list(REMOVE_ITEM sources "kernels/cpu/parallel.h")
# A call (at::parallel_for(...), at::parallel_reduce<T>(...)), a using-declaration that would let one go unqualified,
# or ATen's internal entry point; text after // and comment lines (// /* *) do not count.
set(use "at::parallel_(for|reduce)[ \t]*[(<]|using[ \t]+(namespace[ \t]+)?at(::parallel_|[ \t]*;)|invoke_parallel")
foreach(source IN LISTS sources)
  file(STRINGS "${SOURCE_DIR}/${source}" lines REGEX "parallel_(for|reduce)|invoke_parallel|using[ \t]+namespace[ \t]+at")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "//.*$" "" code "${line}")
    if(NOT line MATCHES "^[ \t]*(/?\\*)" AND code MATCHES "${use}")
      list(APPEND offenders "${source}: ${line}")
    endif()
  endforeach()
endforeach()
if(offenders)
  list(JOIN offenders "\n  " offenders)
  message(FATAL_ERROR "at::parallel_for called outside kernels/cpu/parallel.h (use kernels::cpu::parallel_for, "
                      "compiled with OpenMP):\n  ${offenders}")
endif()
list(LENGTH sources n_sources)
message("parallel_for: no direct at::parallel_for / at::parallel_reduce call in ${n_sources} sources")

include("${CMAKE_CURRENT_LIST_DIR}/../cmake/compile_flags_of.cmake")
lta_compile_flags_of("${COMPILE_COMMANDS}" "${FLAGS_FROM}" with_openmp directory)
list(APPEND with_openmp -fsyntax-only)
set(without_openmp "${with_openmp}")
list(FILTER without_openmp EXCLUDE REGEX "^-f?openmp")
set(probe "${WORK_DIR}/includes_parallel_h.cpp")
file(WRITE "${probe}" "#include <kernels/cpu/parallel.h>\nvoid probe() {}\n")
execute_process(COMMAND ${with_openmp} "${probe}" WORKING_DIRECTORY "${directory}" RESULT_VARIABLE rc
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kernels/cpu/parallel.h does not compile with the kernels library's flags:\n${err}")
endif()
execute_process(COMMAND ${without_openmp} "${probe}" WORKING_DIRECTORY "${directory}" RESULT_VARIABLE rc
                ERROR_VARIABLE err)
if(OPENMP)
  if(rc EQUAL 0 OR NOT err MATCHES "not compiled with OpenMP")
    message(FATAL_ERROR "kernels/cpu/parallel.h compiled without OpenMP (rc ${rc}), although LibTorch parallelizes "
                        "with it: its #error is gone, and a loop could run serially again.\n${err}")
  endif()
  message("parallel_for: kernels/cpu/parallel.h compiles with the kernels' OpenMP flag and refuses to without it")
else()
  message("parallel_for: LibTorch does not parallelize with OpenMP here; kernels/cpu/parallel.h needs no flag")
endif()
