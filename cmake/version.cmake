# The version is written once, in include/epcomm.h (EP_VERSION_MAJOR/MINOR/PATCH); CMake reads it
# from there for project(VERSION), the SONAME, epcomm.pc and the CMake package version.
# Sets EP_VERSION ("MAJOR.MINOR.PATCH"). Included before project(), so it uses no project variable.
function(ep_read_version header)
  file(STRINGS ${header} defs REGEX "^#define EP_VERSION_(MAJOR|MINOR|PATCH) +[0-9]+")
  set(parts "")
  foreach(part MAJOR MINOR PATCH)
    if(NOT defs MATCHES "EP_VERSION_${part} +([0-9]+)")
      message(FATAL_ERROR "${header}: no '#define EP_VERSION_${part} <number>'")
    endif()
    list(APPEND parts ${CMAKE_MATCH_1})
  endforeach()
  list(JOIN parts "." version)
  set(EP_VERSION ${version} PARENT_SCOPE)
  # A version bump in the header re-runs the configure step.
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${header})
endfunction()

ep_read_version(${CMAKE_CURRENT_LIST_DIR}/../include/epcomm.h)
