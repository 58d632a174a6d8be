# ATen's at::parallel_for is inline in its headers: where LibTorch was built for OpenMP (AT_PARALLEL_OPENMP 1 in
# ATen/Config.h), it spreads work over threads only in translation units compiled with OpenMP (_OPENMP defined);
# elsewhere it runs f(begin, end) on the calling thread. Our CPU kernels are such translation units, so they are
# compiled with the compiler's OpenMP flag, as LibTorch's own sources are, and linked against the OpenMP runtime
# LibTorch itself loads: one runtime, one thread pool, governed by at::set_num_threads and OMP_NUM_THREADS.
#
# Included by the build (after LibTorch is found) and by the installed libtorch_ampConfig.cmake (after
# find_dependency(Torch)), which resolves the runtime of the consumer's LibTorch the same way.

# Sets `out_var` to 1 when the LibTorch whose headers are in `include_dirs` parallelizes with OpenMP, else 0.
function(lta_torch_uses_openmp include_dirs out_var)
  set(_uses 0)
  foreach(_dir IN LISTS include_dirs)
    if(EXISTS "${_dir}/ATen/Config.h")
      file(STRINGS "${_dir}/ATen/Config.h" _line REGEX "^#define AT_PARALLEL_OPENMP ")
      if(_line MATCHES "AT_PARALLEL_OPENMP 1")
        set(_uses 1)
      endif()
      break()
    endif()
  endforeach()
  set(${out_var} ${_uses} PARENT_SCOPE)
endfunction()

# Sets `out_var` to the OpenMP runtime file that libtorch_cpu.so under `torch_root` loads, when LibTorch ships it
# (the pip wheel's torch/lib/libgomp.so.1; a LibTorch archive may carry it renamed, libgomp-<hash>.so.1; auditwheel
# puts it in torch.libs/), or to "" when LibTorch uses the system's (then the system's libgomp is the one). The
# library libtorch_cpu.so names (its NEEDED entry, read with readelf) decides; without readelf, the first of
# libgomp*, libiomp5*, libomp* found in those folders.
function(lta_torch_openmp_runtime torch_root out_var)
  set(_dirs "${torch_root}/lib" "${torch_root}/../torch.libs")
  set(_needed "")
  find_program(_lta_readelf NAMES readelf)
  if(_lta_readelf AND EXISTS "${torch_root}/lib/libtorch_cpu.so")
    execute_process(COMMAND "${_lta_readelf}" -d "${torch_root}/lib/libtorch_cpu.so" OUTPUT_VARIABLE _dynamic
                    ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0)
      string(REGEX MATCHALL "Shared library: \\[lib(g|i)?omp[^]]*\\]" _needed "${_dynamic}")
      string(REGEX REPLACE "Shared library: \\[([^]]*)\\]" "\\1" _needed "${_needed}")
    endif()
  endif()
  set(_runtime "")
  if(_needed)
    foreach(_name IN LISTS _needed)
      foreach(_dir IN LISTS _dirs)
        if(NOT _runtime AND EXISTS "${_dir}/${_name}")
          get_filename_component(_runtime "${_dir}/${_name}" ABSOLUTE)
        endif()
      endforeach()
    endforeach()
  else()
    foreach(_pattern libgomp*.so* libiomp5*.so* libomp*.so*)
      foreach(_dir IN LISTS _dirs)
        file(GLOB _found LIST_DIRECTORIES false "${_dir}/${_pattern}")
        list(SORT _found)
        if(NOT _runtime AND _found)
          list(GET _found 0 _first)
          get_filename_component(_runtime "${_first}" ABSOLUTE)
        endif()
      endforeach()
    endforeach()
  endif()
  set(${out_var} "${_runtime}" PARENT_SCOPE)
endfunction()

# Defines the INTERFACE target `name` that links the OpenMP runtime LibTorch under `torch_root` uses: its own copy
# when it ships one (linked by path, so the process loads that one file: libtorch_cpu's NEEDED entry names the same
# soname), else the system's GNU libgomp (our kernels are compiled by GCC, whose OpenMP code calls libgomp). Sets
# `out_var` to what it links, or "" when there is nothing to link.
function(lta_add_openmp_runtime_target name torch_root out_var)
  lta_torch_openmp_runtime("${torch_root}" _runtime)
  if(NOT _runtime)
    find_library(_lta_system_gomp NAMES gomp libgomp.so.1)
    set(_runtime "${_lta_system_gomp}")
  endif()
  if(NOT _runtime)
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  add_library(${name} INTERFACE IMPORTED)
  set_property(TARGET ${name} PROPERTY INTERFACE_LINK_LIBRARIES "${_runtime}")
  set(${out_var} "${_runtime}" PARENT_SCOPE)
endfunction()
