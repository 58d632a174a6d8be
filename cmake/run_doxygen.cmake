# Runs doxygen on DOXYFILE; on a warning (the Doxyfile makes each one an error) prints them from WARNINGS and fails.
# Used by the `docs` target and the ctest docs.api_reference_builds_without_warnings.
file(REMOVE "${WARNINGS}")
execute_process(COMMAND "${DOXYGEN}" "${DOXYFILE}" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
set(warnings "")
if(EXISTS "${WARNINGS}")
  file(READ "${WARNINGS}" warnings)
endif()
if(NOT rc EQUAL 0 OR NOT warnings STREQUAL "")
  message(FATAL_ERROR "the API reference has warnings (each an error: document the public declaration, or move it "
                      "into a detail namespace):\n${warnings}${err}")
endif()
get_filename_component(out "${WARNINGS}" DIRECTORY)
message("API reference: ${out}/html/index.html, no warnings")
