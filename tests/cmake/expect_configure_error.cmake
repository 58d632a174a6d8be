# ctest driver: configure the project in a fresh scratch folder with the given arguments (and environment),
# expect it to fail, and print what CMake said so PASS_REGULAR_EXPRESSION can check the explanation.
# Usage: cmake -DSOURCE_DIR=... -DWORK_DIR=... "-DARGS=a;b" ["-DENV=K=V;K2=V2"] -P expect_configure_error.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} -E env ${ENV} ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}" ${ARGS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "configure unexpectedly succeeded")
endif()
string(REGEX MATCHALL "CMake Error" errors "${err}")
list(LENGTH errors n_errors)
if(NOT n_errors EQUAL 1)
  message(FATAL_ERROR "expected exactly one CMake error, got ${n_errors}")
endif()
