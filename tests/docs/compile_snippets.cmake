# ctest driver: every ```cpp block of README.md and docs/*.md must compile against the public headers, so that what the
# documentation shows is what the library keeps. A block is compiled unless the line before its fence is
# `<!-- snippet: no-compile: <why> -->`, or `<!-- snippet: program: <file> -->` (a whole program: tests/CMakeLists.txt
# builds and runs it). Each Markdown file becomes one translation unit (docs_<name>.cpp under
# WORK_DIR): the #include lines of its blocks at the top, then each block as the body of a function of its own
# namespace, with #line pointing errors at the Markdown file. Names a block takes as given (net, x, batches, ...) are
# declared in tests/docs/snippet_context.h. Compile only (-fsyntax-only), with the flags ninja gives FLAGS_FROM (a test
# source of the amp layer: the project's and LibTorch's include folders, its definitions and precompiled LibTorch).
# Usage: cmake -DSOURCE_DIR=... -DWORK_DIR=... -DCOMPILE_COMMANDS=<build>/compile_commands.json
#              -DFLAGS_FROM=<source file> -P compile_snippets.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# The compiler command line of FLAGS_FROM, minus its source, object and dependency-file arguments.
include("${CMAKE_CURRENT_LIST_DIR}/../cmake/compile_flags_of.cmake")
lta_compile_flags_of("${COMPILE_COMMANDS}" "${FLAGS_FROM}" compiler_args directory)
# A block is a fragment: a value it computes and does not use is fine.
list(APPEND compiler_args -fsyntax-only -Wno-unused-variable -Wno-unused-but-set-variable -Wno-unused-parameter)

file(GLOB docs RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/docs/*.md")
set(failed "")
set(n_blocks 0)
foreach(doc README.md ${docs})
  file(READ "${SOURCE_DIR}/${doc}" text)
  set(includes "")
  set(bodies "")
  set(in_block OFF)
  set(skip_block OFF)
  set(previous "")
  set(line_number 0)
  set(doc_blocks 0)
  while(NOT text STREQUAL "")
    string(FIND "${text}" "\n" newline)
    if(newline EQUAL -1)
      set(line "${text}")
      set(text "")
    else()
      string(SUBSTRING "${text}" 0 ${newline} line)
      math(EXPR after "${newline} + 1")
      string(SUBSTRING "${text}" ${after} -1 text)
    endif()
    math(EXPR line_number "${line_number} + 1")
    if(NOT in_block AND line MATCHES "^```cpp")
      set(in_block ON)
      set(skip_block OFF)
      if(previous MATCHES "^<!-- snippet: (no-compile: .+|program: .+) -->")
        set(skip_block ON)
      else()
        math(EXPR doc_blocks "${doc_blocks} + 1")
        math(EXPR first_line "${line_number} + 1")
        string(APPEND bodies "namespace snippet_${first_line} {\nvoid block() {\n#line ${first_line} \"${doc}\"\n")
      endif()
    elseif(in_block AND line MATCHES "^```")
      set(in_block OFF)
      if(NOT skip_block)
        string(APPEND bodies "}\n}  // namespace snippet_${first_line}\n")
      endif()
    elseif(in_block AND NOT skip_block)
      if(line MATCHES "^#include ")
        string(APPEND includes "${line}\n")
        string(APPEND bodies "\n")  # keeps the lines in step with #line
      else()
        string(APPEND bodies "${line}\n")
      endif()
    endif()
    set(previous "${line}")
  endwhile()
  if(doc_blocks EQUAL 0)
    continue()
  endif()
  math(EXPR n_blocks "${n_blocks} + ${doc_blocks}")
  string(MAKE_C_IDENTIFIER "${doc}" name)
  set(source "${WORK_DIR}/${name}.cpp")
  file(WRITE "${source}" "// Generated from ${doc} by tests/docs/compile_snippets.cmake.\n${includes}"
                         "#include \"${SOURCE_DIR}/tests/docs/snippet_context.h\"\n\nnamespace docs {\n${bodies}}  // namespace docs\n")
  execute_process(COMMAND ${compiler_args} "${source}" WORKING_DIRECTORY "${directory}" RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message("${err}")
    list(APPEND failed "${doc}")
  endif()
endforeach()
if(failed)
  list(JOIN failed ", " failed)
  message(FATAL_ERROR "snippets that do not compile in: ${failed} (errors above, generated sources in ${WORK_DIR})")
endif()
message("docs: all ${n_blocks} compiled C++ snippets of README.md and docs/*.md compile")
