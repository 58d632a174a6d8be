# `cmake --install` puts headers, the four libraries and libtorch_ampConfig.cmake under the prefix, so another
# project can `find_package(libtorch_amp)` and link libtorch_amp::amp (and libtorch_amp::run, above it).
include(CMakePackageConfigHelpers)
install(TARGETS amp_kernels ddp amp run EXPORT libtorch_ampTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(layer kernels ddp amp run)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${layer}
          FILES_MATCHING PATTERN "*.h" PATTERN "cuda" EXCLUDE PATTERN "cpu" EXCLUDE
          PATTERN "json.h" EXCLUDE)  # ddp/json.h: the .cpp files' nlohmann-json, not API
endforeach()
install(EXPORT libtorch_ampTargets NAMESPACE libtorch_amp:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libtorch_amp)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/libtorch_ampConfig.cmake.in
  ${PROJECT_BINARY_DIR}/libtorch_ampConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libtorch_amp)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/libtorch_ampConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/libtorch_ampConfig.cmake ${PROJECT_BINARY_DIR}/libtorch_ampConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/LibtorchAmpOpenMP.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libtorch_amp)
