# The C ABI as a shared library (latentmoe/c_api.h, src/capi/) and what `cmake --install` puts where:
#  - a C++ consumer's install: the public headers, the static library, the C ABI library and a package
#    config (find_package(latentmoe): targets latentmoe::latentmoe and latentmoe::capi, with a version);
#  - the Python package's build (scikit-build-core sets SKBUILD): only the C ABI library, next to the
#    package's Python sources (component "python"; pyproject.toml installs that component alone).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

file(GLOB LATENTMOE_CAPI_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/capi/*.cpp)
add_library(latentmoe_capi SHARED ${LATENTMOE_CAPI_SOURCES})
# Only the lmoe_* functions are exported: the library's own C++ symbols (from the static archive) stay
# local, so that the .so cannot clash with another copy of latentmoe, or anything else, in the process.
set_target_properties(latentmoe_capi PROPERTIES OUTPUT_NAME latentmoe_capi EXPORT_NAME capi
                      CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
target_include_directories(latentmoe_capi
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(latentmoe_capi PRIVATE latentmoe_lib nlohmann_json::nlohmann_json)
target_link_options(latentmoe_capi PRIVATE -Wl,--exclude-libs,ALL -Wl,--no-undefined)
target_compile_options(latentmoe_capi PRIVATE -Wall -Wextra -Wno-unused-parameter)

set_target_properties(latentmoe_lib PROPERTIES EXPORT_NAME latentmoe)

if(SKBUILD)
  # The wheel: the C ABI library beside python/latentmoe/*.py, found there by the package at import.
  install(TARGETS latentmoe_capi LIBRARY DESTINATION latentmoe COMPONENT python)
else()
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/latentmoe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
  install(TARGETS latentmoe_lib latentmoe_capi EXPORT latentmoeTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  set(LATENTMOE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/latentmoe)
  install(EXPORT latentmoeTargets NAMESPACE latentmoe:: DESTINATION ${LATENTMOE_CMAKE_DIR} COMPONENT dev)
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/latentmoeConfig.cmake.in
                                ${PROJECT_BINARY_DIR}/latentmoeConfig.cmake INSTALL_DESTINATION ${LATENTMOE_CMAKE_DIR})
  # 0.x: a minor release may change the API, so only the same major.minor is compatible.
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/latentmoeConfigVersion.cmake
                                   COMPATIBILITY SameMinorVersion)
  install(FILES ${PROJECT_BINARY_DIR}/latentmoeConfig.cmake ${PROJECT_BINARY_DIR}/latentmoeConfigVersion.cmake
          DESTINATION ${LATENTMOE_CMAKE_DIR} COMPONENT dev)
endif()
