# `cmake --install BUILD --prefix P` (and `make install PREFIX=P`): the shared library (SONAME
# libepcomm.so.<major>) and the archive, epcomm.h, the CLI and the helper it runs, the doctor's
# rulebook, epcomm.pc and a CMake package: find_package(epcomm) gives epcomm::epcomm (shared) and
# epcomm::epcomm_static. Every installed file refers to the others relative to its own place, so
# the prefix can be chosen at install time and the tree moved afterwards.
include(CMakePackageConfigHelpers)
set(EP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/epcomm)

# Two export sets: the shared library needs nothing at link time, the archive needs its
# dependencies (and CUDA's static runtime when built with CUDA), which a user may not have.
install(TARGETS epcomm EXPORT epcommTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS epcomm_static EXPORT epcommStaticTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/epcomm.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(set epcommTargets epcommStaticTargets)
  install(EXPORT ${set} NAMESPACE epcomm:: DESTINATION ${EP_INSTALL_CMAKEDIR})
endforeach()

# The CLI links the archive, so it runs from any prefix without an RPATH. `epcomm bench` runs its
# MPI baseline from its own directory, so the baseline goes next to it.
install(TARGETS epcomm_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET epcomm_bench_mpi)
  install(TARGETS epcomm_bench_mpi RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# The doctor's rulebook: the CLI looks for it at a path relative to its own executable (compiled
# in as EP_RULES_FROM_BIN, tools/doctor_rules.c). The build tree gets the same layout, through a
# link to the source file, so edits to the rulebook need no rebuild there.
function(ep_install_rulebook)
  set(src ${PROJECT_SOURCE_DIR}/share/doctor-rules.txt)
  set(dest ${CMAKE_INSTALL_DATADIR}/epcomm)
  file(RELATIVE_PATH rel ${CMAKE_INSTALL_FULL_BINDIR} ${CMAKE_INSTALL_FULL_DATADIR}/epcomm/doctor-rules.txt)
  target_compile_definitions(epcomm_cli PRIVATE EP_RULES_FROM_BIN="${rel}")
  get_target_property(bin epcomm_cli RUNTIME_OUTPUT_DIRECTORY)
  get_filename_component(link ${bin}/${rel} ABSOLUTE)
  get_filename_component(link_dir ${link} DIRECTORY)
  file(MAKE_DIRECTORY ${link_dir})
  file(CREATE_LINK ${src} ${link} SYMBOLIC)
  install(FILES ${src} DESTINATION ${dest})
endfunction()
ep_install_rulebook()

# epcomm.pc. `prefix` is found from the .pc file's own directory (pkg-config's ${pcfiledir}).
function(ep_pc_dir var dir) # an install dir as the .pc writes it: under ${prefix} when relative
  if(IS_ABSOLUTE ${dir})
    set(${var} ${dir} PARENT_SCOPE)
  else()
    set(${var} "\${prefix}/${dir}" PARENT_SCOPE)
  endif()
endfunction()

function(ep_install_pkgconfig)
  set(pcdir ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
  file(RELATIVE_PATH up /p/${pcdir} /p)
  string(REGEX REPLACE "/$" "" up ${up})
  set(EP_PC_PREFIX "\${pcfiledir}/${up}")
  ep_pc_dir(EP_PC_LIBDIR ${CMAKE_INSTALL_LIBDIR})
  ep_pc_dir(EP_PC_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR})
  # What a static link (`pkg-config --static`) needs besides libepcomm.a; with CUDA, the kernels'
  # host stubs are C++ (nvcc's host compiler, g++), hence -lstdc++.
  set(EP_PC_LIBS_PRIVATE "-lpthread -lm")
  if(EP_HAVE_CUDA)
    string(APPEND EP_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt -lstdc++")
  endif()
  configure_file(${PROJECT_SOURCE_DIR}/cmake/epcomm.pc.in ${PROJECT_BINARY_DIR}/epcomm.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/epcomm.pc DESTINATION ${pcdir})
endfunction()
ep_install_pkgconfig()

# The CMake package. While the major version is 0, a minor release may change the API and the ABI,
# so a request for 0.2 accepts 0.2.x only.
function(ep_install_cmake_package)
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(compat SameMinorVersion)
  else()
    set(compat SameMajorVersion)
  endif()
  set(dir ${PROJECT_BINARY_DIR}/cmake-package)
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/epcommConfig.cmake.in
                                ${dir}/epcommConfig.cmake INSTALL_DESTINATION ${EP_INSTALL_CMAKEDIR})
  write_basic_package_version_file(${dir}/epcommConfigVersion.cmake COMPATIBILITY ${compat})
  install(FILES ${dir}/epcommConfig.cmake ${dir}/epcommConfigVersion.cmake
          DESTINATION ${EP_INSTALL_CMAKEDIR})
endfunction()
ep_install_cmake_package()
