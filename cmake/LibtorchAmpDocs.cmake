# The API reference (`make docs`; docs/api.md says what is public): Doxygen over the installed headers into
# build/docs/html, an undocumented public declaration being an error. Without doxygen the target says how to get it,
# and the ctest that builds the reference (tests/CMakeLists.txt) is skipped with that reason.
find_package(Doxygen QUIET OPTIONAL_COMPONENTS dot)
set(LTA_DOCS_OUT "${PROJECT_BINARY_DIR}/docs")
if(DOXYGEN_FOUND)
  set(LTA_DOCS_HAVE_DOT NO)
  if(TARGET Doxygen::dot)
    set(LTA_DOCS_HAVE_DOT YES)
  endif()
  configure_file(${PROJECT_SOURCE_DIR}/docs/Doxyfile.in ${LTA_DOCS_OUT}/Doxyfile @ONLY)
  add_custom_target(docs
    COMMAND ${CMAKE_COMMAND} -DDOXYGEN=$<TARGET_FILE:Doxygen::doxygen> -DDOXYFILE=${LTA_DOCS_OUT}/Doxyfile
            -DWARNINGS=${LTA_DOCS_OUT}/warnings.txt -P ${PROJECT_SOURCE_DIR}/cmake/run_doxygen.cmake
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR} VERBATIM)
  set(LIBTORCH_AMP_DOCS "doxygen ${DOXYGEN_VERSION} (make docs)")
else()
  add_custom_target(docs
    COMMAND ${CMAKE_COMMAND} -E echo "make docs needs doxygen: apt-get install doxygen graphviz (make deps installs them)"
    COMMAND ${CMAKE_COMMAND} -E false VERBATIM)
  set(LIBTORCH_AMP_DOCS "no doxygen (make docs unavailable)")
endif()
