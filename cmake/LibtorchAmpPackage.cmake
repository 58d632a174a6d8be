# `make package`: a Debian package and a tarball of what `cmake --install` installs (the four libraries, their
# headers, the CMake package, ddp-launch) plus the license, the changelog and the prose docs. LibTorch and CUDA are
# not Debian packages here, so the package cannot depend on them by name: its description says which LibTorch and
# CUDA it needs, and the installed CMake package refuses any other LibTorch version.
set(_lta_docdir "${CMAKE_INSTALL_DATAROOTDIR}/doc/libtorch-amp")  # Debian's place: /usr/share/doc/<package>
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/CHANGELOG.md
              ${PROJECT_SOURCE_DIR}/THIRD_PARTY.md
        DESTINATION ${_lta_docdir})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${_lta_docdir}/docs FILES_MATCHING PATTERN "*.md")
install(DIRECTORY ${PROJECT_BINARY_DIR}/docs/html/ DESTINATION ${_lta_docdir}/api OPTIONAL)  # make docs first

string(CONCAT _lta_needs "LibTorch ${LIBTORCH_AMP_TORCH_VERSION} (the torch==${LIBTORCH_AMP_TORCH_VERSION} pip wheel or its "
               "LibTorch archive; found by itself at ${LIBTORCH_AMP_TORCH_ROOT}, else named by CMAKE_PREFIX_PATH)")
if(LIBTORCH_AMP_WITH_CUDA)
  string(APPEND _lta_needs " and the CUDA ${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR} toolkit "
                           "(cudart, cuBLASLt)")
endif()
set(CPACK_PACKAGE_NAME "libtorch-amp")
set(CPACK_PACKAGE_VENDOR "the libtorch-amp authors")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Mixed precision and data parallel training for LibTorch C++ programs")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
    "Apex-style mixed precision (opt levels, FP32 master weights, a sync-free dynamic loss scaler, fused optimizers, "
    "FP8 layers, ZeRO 1-2), data parallel training over c10d (DDP, SyncBatchNorm, the ddp-launch launcher) and a run "
    "layer (progress, metrics, report, exact resume) for LibTorch C++ programs, with no Python. Needs ${_lta_needs}.")
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/LICENSE")
set(CPACK_GENERATOR "DEB;TGZ")
set(CPACK_SOURCE_GENERATOR "")
set(CPACK_PACKAGE_FILE_NAME "libtorch-amp-${PROJECT_VERSION}-${CMAKE_SYSTEM_PROCESSOR}")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # libtorch-amp_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "the libtorch-amp authors")
set(CPACK_DEBIAN_PACKAGE_SECTION "libdevel")
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1, cmake (>= 3.25)")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS OFF)  # ddp-launch links LibTorch, which no Debian package provides
set(CPACK_PACKAGE_INSTALL_DIRECTORY "libtorch-amp")
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
include(CPack)
