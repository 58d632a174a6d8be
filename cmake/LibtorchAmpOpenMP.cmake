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

# Sets `out_var` to the OpenMP runtime library that LibTorch under `torch_root` ships and libtorch_cpu loads (the
# pip wheel's torch/lib/libgomp.so.1; a LibTorch archive may carry it renamed, libgomp-<hash>.so.1), or to "" when
# it ships none (a LibTorch built against the system's runtime: then the compiler's own is the same one).
function(lta_torch_openmp_runtime torch_root out_var)
  file(GLOB _found LIST_DIRECTORIES false "${torch_root}/lib/libgomp*.so*" "${torch_root}/lib/libiomp5*.so*"
       "${torch_root}/lib/libomp*.so*")
  list(SORT _found)
  set(_runtime "")
  foreach(_lib IN LISTS _found)
    if(NOT IS_SYMLINK "${_lib}" OR NOT _runtime)  # a real file wins over a link to it
      set(_runtime "${_lib}")
    endif()
  endforeach()
  set(${out_var} "${_runtime}" PARENT_SCOPE)
endfunction()

# Defines the INTERFACE target `name` that links the OpenMP runtime LibTorch under `torch_root` uses: its own copy
# when it ships one (linked by path, so the process loads that one file: libtorch_cpu's NEEDED entry names the same
# soname), else the compiler's (OpenMP::OpenMP_CXX's libraries, without its compile flag). Sets `out_var` to what
# it links, for the configure summary.
function(lta_add_openmp_runtime_target name torch_root out_var)
  lta_torch_openmp_runtime("${torch_root}" _runtime)
  if(_runtime)
    set(_link "${_runtime}")
  else()
    find_package(OpenMP QUIET COMPONENTS CXX)
    if(NOT OpenMP_CXX_FOUND)
      set(${out_var} "" PARENT_SCOPE)
      return()
    endif()
    set(_link ${OpenMP_CXX_LIBRARIES})
  endif()
  add_library(${name} INTERFACE IMPORTED)
  set_property(TARGET ${name} PROPERTY INTERFACE_LINK_LIBRARIES "${_link}")
  set(${out_var} "${_link}" PARENT_SCOPE)
endfunction()
