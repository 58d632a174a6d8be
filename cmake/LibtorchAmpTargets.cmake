# Helpers shared by every target of ours: warnings, the include root, precompiled LibTorch headers.

# Warnings on for our own code (LibTorch and third-party headers come in as SYSTEM), errors in CI.
function(lta_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(LIBTORCH_AMP_WERROR)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Werror>
      $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
  endif()
endfunction()

# One library of the three layers: libtorch_amp::<alias>, headers under the repository root.
function(lta_add_layer_library name alias)
  add_library(${name} STATIC ${ARGN})
  add_library(libtorch_amp::${alias} ALIAS ${name})
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${alias})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_features(${name} PUBLIC cxx_std_17)
  lta_set_warnings(${name})
endfunction()

# An executable that `cmake --install` puts into bin/: it must start from there as it does from the build tree,
# with no LD_LIBRARY_PATH. Its RUNPATH names our own lib/ relative to the binary ($ORIGIN), the lib/ of the LibTorch
# it was built against (absolute: LibTorch is linked by full path, which INSTALL_RPATH_USE_LINK_PATH does not
# cover), and the other folders it was linked from (the CUDA toolkit's).
function(lta_install_executable target)
  file(RELATIVE_PATH _lib_from_bin "/${CMAKE_INSTALL_BINDIR}" "/${CMAKE_INSTALL_LIBDIR}")
  set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/${_lib_from_bin};${LIBTORCH_AMP_TORCH_ROOT}/lib"
                                             INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS ${target} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()

# A sanitizer build (`make asan-test`): -DLIBTORCH_AMP_SANITIZE=address instruments the frontend targets (tests,
# examples, their shared precompiled header) and the libraries passed to lta_sanitize. The lower layers keep the
# normal flags, so in a second build folder they come from ccache and only the instrumented code is compiled.
set(LIBTORCH_AMP_SANITIZE "" CACHE STRING "Sanitizer for frontend targets and lta_sanitize'd libraries (address)")
function(lta_sanitize target)
  if(LIBTORCH_AMP_SANITIZE)
    # -O1 -g1: ASan's usual setting (quicker to compile than -O3, line numbers in its reports).
    target_compile_options(${target} PRIVATE -fsanitize=${LIBTORCH_AMP_SANITIZE} -fno-omit-frame-pointer -O1 -g1)
    # GCC's manual (Instrumentation Options): sanitizers raise the rate of false -Wmaybe-uninitialized warnings.
    # One such came from libstdc++'s own <regex> (GCC 12, -O1 with ASan) and failed CI under -Werror; the normal
    # build keeps the warning for our code.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>)
    endif()
    target_link_options(${target} PRIVATE -fsanitize=${LIBTORCH_AMP_SANITIZE})
  endif()
endfunction()

# Frontend translation units (tests, examples, benchmarks) include <torch/torch.h>; it is parsed once into
# a precompiled header that every such target reuses. All of them get the same flags through this function,
# which is what makes the reuse valid.
function(lta_frontend_target target)
  target_link_libraries(${target} PRIVATE torch lta_fmt)
  lta_set_warnings(${target})
  lta_sanitize(${target})
  if(NOT LIBTORCH_AMP_PCH)
    return()
  endif()
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "EXECUTABLE")
    # Executables would get -fPIE and libraries -fPIC, and a PCH is valid for one only: compile both as PIC
    # (valid in a PIE executable) so they can share it.
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIC)
  endif()
  if(NOT TARGET lta_torch_pch)
    add_library(lta_torch_pch OBJECT "${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp")
    target_link_libraries(lta_torch_pch PRIVATE torch lta_fmt)
    lta_set_warnings(lta_torch_pch)
    lta_sanitize(lta_torch_pch)
    target_precompile_headers(lta_torch_pch PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>")
  endif()
  target_precompile_headers(${target} REUSE_FROM lta_torch_pch)
endfunction()

# CPU twins are compiled once per instruction set, like ATen's CPU kernels: a generated wrapper per capability
# includes the source with CPU_CAPABILITY set (at::vec picks its implementation from it) and the matching
# compiler flags; kernels/cpu/capability.cpp dispatches to ATen's own choice at run time.
set(LIBTORCH_AMP_CPU_X86_VARIANTS OFF)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(LIBTORCH_AMP_CPU_X86_VARIANTS ON)
endif()
function(lta_add_cpu_twins target)
  set(_caps DEFAULT)
  if(LIBTORCH_AMP_CPU_X86_VARIANTS)
    list(APPEND _caps AVX2 AVX512)
    target_compile_definitions(${target} PRIVATE LIBTORCH_AMP_CPU_X86_VARIANTS)
  endif()
  set(_flags_DEFAULT "")
  set(_flags_AVX2 -mavx2 -mfma -mf16c -mbmi2)
  # -Wno-maybe-uninitialized: GCC 12 reports false positives inside its own avx512fintrin.h when at::vec's
  # AVX512 code is inlined (the same warning ATen silences for its kernels).
  set(_flags_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -Wno-maybe-uninitialized)
  foreach(src IN LISTS ARGN)
    get_filename_component(_abs "${src}" ABSOLUTE)
    get_filename_component(_name "${src}" NAME_WE)
    foreach(cap IN LISTS _caps)
      set(_wrapper "${CMAKE_CURRENT_BINARY_DIR}/cpu_twins/${_name}.${cap}.cpp")
      file(CONFIGURE OUTPUT "${_wrapper}" CONTENT "#include \"${_abs}\"\n")
      target_sources(${target} PRIVATE "${_wrapper}")
      set(_defs CPU_CAPABILITY=${cap})
      if(NOT cap STREQUAL "DEFAULT")
        list(APPEND _defs CPU_CAPABILITY_${cap})
      endif()
      set_source_files_properties("${_wrapper}" PROPERTIES COMPILE_DEFINITIONS "${_defs}"
                                  COMPILE_OPTIONS "${_flags_${cap}}")
    endforeach()
  endforeach()
endfunction()
