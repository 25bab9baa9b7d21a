# CUDA backend: host side in C (src/cuda/*.c), kernels in CUDA C (src/cuda/kernels/*.cu).
# The core never knows whether it was built: the generated backend table lists it or not.
#
# Linking: only the CUDA runtime, statically (CUDA::cudart_static). It loads the driver
# (libcuda.so.1) when first used, so a CPU-only machine links and runs everything, and a CUDA
# call there fails cleanly ("no device") instead of the program failing to start. The driver
# library itself (CUDA::cuda_driver) is never linked.
set(EP_HAVE_CUDA OFF)
if(NOT EP_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(EP_HAVE_CUDA ON)
  elseif(EP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "EP_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

# Without CUDA the backend table (src/core/backends.c.in) simply does not list it.
set(EP_CUDA_HOST_SRC "")
if(EP_HAVE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  file(GLOB EP_CUDA_HOST_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/cuda/*.c)
  file(GLOB EP_CUDA_KERNEL_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/cuda/kernels/*.cu)
endif()
message(STATUS "epcomm: CUDA backend ${EP_HAVE_CUDA}")

function(ep_cuda_configure target)
  if(EP_HAVE_CUDA AND EP_CUDA_KERNEL_SRC)
    add_library(epcomm_kernels OBJECT ${EP_CUDA_KERNEL_SRC})
    target_include_directories(epcomm_kernels PRIVATE ${CMAKE_SOURCE_DIR}/include ${CMAKE_SOURCE_DIR}/src)
    set_target_properties(epcomm_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON
                          CUDA_VISIBILITY_PRESET hidden
                          CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
    target_compile_options(epcomm_kernels PRIVATE
                           $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter,-Werror -Werror=all-warnings>)
  endif()
  if(EP_HAVE_CUDA)
    target_compile_definitions(${target} PRIVATE EP_HAVE_CUDA=1)
    # SYSTEM: the toolkit's headers are not ours to warn about (-Werror stays on for our code).
    target_include_directories(${target} SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  endif()
endfunction()

# The shared library keeps its runtime private; the static archive passes it on to whoever links
# it (tests, tools, benchmarks), so that one process has one runtime.
function(ep_cuda_link target)
  if(EP_HAVE_CUDA AND EP_CUDA_KERNEL_SRC)
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:epcomm_kernels>)
  endif()
  if(EP_HAVE_CUDA)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "SHARED_LIBRARY")
      target_link_libraries(${target} PRIVATE CUDA::cudart_static)
    else()
      # Its users may link with a C linker: the kernels' host stubs (compiled by nvcc's host
      # compiler, g++) also need the C++ runtime.
      target_link_libraries(${target} PUBLIC CUDA::cudart_static stdc++)
    endif()
  endif()
endfunction()

# Test programs and benchmarks that call the CUDA runtime themselves (device buffers, graphs).
function(ep_cuda_client target)
  if(EP_HAVE_CUDA)
    target_compile_definitions(${target} PRIVATE EP_HAVE_CUDA=1)
    target_include_directories(${target} SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  endif()
endfunction()
