# GPipeBackends.cmake — decides which c10d backends gpipe::distributed::init_process_group can make (csrc/process_group.cpp).
#
# torch's wheel ships ProcessGroupGloo.hpp but not the Gloo headers it
# includes, so making a Gloo group from C++ needs Gloo's headers at build time:
# Debian's libgloo-dev (scripts/setup.sh installs it). They are older than the
# gloo inside torch, so "found" is not enough: the check compiles and links a
# program that builds a ProcessGroupGloo with them against this torch, and only
# then compiles process_group.cpp with GPIPE_WITH_GLOO. NCCL likewise needs a
# CUDA torch and nccl.h (torch's nvidia-nccl wheel, beside torch).
#
#   -DGPIPE_GLOO=AUTO (default): Gloo where the check passes, else a note.
#   -DGPIPE_GLOO=ON: the check must pass.   -DGPIPE_GLOO=OFF: no Gloo.
#   -DGPIPE_NCCL=AUTO|ON|OFF: the same for NCCL.
# A passed check is cached; a failed one runs again at the next configure.

include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

set(GPIPE_GLOO AUTO CACHE STRING "Gloo groups from C++: AUTO, ON or OFF")
set(GPIPE_NCCL AUTO CACHE STRING "NCCL groups from C++: AUTO, ON or OFF")

# Compiles and links `code` against torch (and the torch libraries named
# after `includes`) with `defines` and `includes`; sets <result> (cached).
function(_gpipe_check_backend result code defines includes)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_DEFINITIONS ${defines})
  set(CMAKE_REQUIRED_INCLUDES ${TORCH_INCLUDE_DIRS} ${includes})
  # torch's libraries by path: its imported targets name others (protobuf::)
  # that try_compile's project does not have.
  set(libraries "")
  foreach(name torch torch_cpu c10 ${ARGN})
    list(APPEND libraries "${TORCH_INSTALL_PREFIX}/lib/lib${name}.so")
  endforeach()
  set(CMAKE_REQUIRED_LIBRARIES ${libraries})
  set(CMAKE_REQUIRED_FLAGS "${TORCH_CXX_FLAGS}")
  set(CMAKE_REQUIRED_QUIET ON)
  check_cxx_source_compiles("${code}" ${result})
  cmake_pop_check_state()
  if(NOT ${result})
    # A failure is checked again at the next configure (after installing
    # what was missing); a success stays cached.
    set(failed "${${result}}")
    unset(${result} CACHE)
    set(${result} "${failed}" PARENT_SCOPE)
  endif()
endfunction()

# Adds GPIPE_WITH_<backend> definitions to `source` of `target`; sets
# GPIPE_HAS_GLOO and GPIPE_HAS_NCCL (true or false) in the caller.
function(gpipe_find_backends target source)
  set(defines "")
  set(includes "")
  if(NOT GPIPE_GLOO STREQUAL "OFF")
    find_path(GPIPE_GLOO_INCLUDE_DIR gloo/algorithm.h)
    if(GPIPE_GLOO_INCLUDE_DIR)
      _gpipe_check_backend(GPIPE_GLOO_MATCHES_TORCH [=[
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
int main() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto options = c10d::ProcessGroupGloo::Options::create_default();
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options);
  return group->getSize() == 1 ? 0 : 1;
}]=] "-DUSE_C10D_GLOO" "${GPIPE_GLOO_INCLUDE_DIR}")
    endif()
    if(GPIPE_GLOO_MATCHES_TORCH)
      message(STATUS "GPipe: Gloo groups from C++: on (Gloo headers at ${GPIPE_GLOO_INCLUDE_DIR})")
      list(APPEND defines GPIPE_WITH_GLOO USE_C10D_GLOO)
      list(APPEND includes "${GPIPE_GLOO_INCLUDE_DIR}")
    else()
      if(GPIPE_GLOO_INCLUDE_DIR)
        set(why "the Gloo headers at ${GPIPE_GLOO_INCLUDE_DIR} do not build torch's ProcessGroupGloo")
      else()
        set(why "no Gloo headers (install Debian's libgloo-dev)")
      endif()
      if(GPIPE_GLOO STREQUAL "ON")
        message(FATAL_ERROR "GPipe: GPIPE_GLOO=ON but ${why}")
      endif()
      message(STATUS "GPipe: Gloo groups from C++: off, ${why}; init_process_group(\"gloo\") "
                     "will say so (see docs/distributed.md)")
    endif()
  endif()
  if(NOT GPIPE_NCCL STREQUAL "OFF")
    find_path(GPIPE_NCCL_INCLUDE_DIR nccl.h
              HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" NO_DEFAULT_PATH)
    find_path(GPIPE_CUDA_INCLUDE_DIR cuda_runtime_api.h
              HINTS "$ENV{CUDA_HOME}/include" /usr/local/cuda/include)
    if(GPIPE_NCCL_INCLUDE_DIR AND GPIPE_CUDA_INCLUDE_DIR AND TORCH_CUDA_LIBRARIES)
      _gpipe_check_backend(GPIPE_NCCL_MATCHES_TORCH [=[
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
int main() {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  return options->timeout.count() > 0 ? 0 : 1;
}]=] "-DUSE_C10D_NCCL" "${GPIPE_NCCL_INCLUDE_DIR};${GPIPE_CUDA_INCLUDE_DIR}"
        torch_cuda c10_cuda)
    endif()
    if(GPIPE_NCCL_MATCHES_TORCH)
      message(STATUS "GPipe: NCCL groups from C++: on (nccl.h at ${GPIPE_NCCL_INCLUDE_DIR})")
      list(APPEND defines GPIPE_WITH_NCCL USE_C10D_NCCL)
      list(APPEND includes "${GPIPE_NCCL_INCLUDE_DIR}" "${GPIPE_CUDA_INCLUDE_DIR}")
    elseif(GPIPE_NCCL STREQUAL "ON")
      message(FATAL_ERROR "GPipe: GPIPE_NCCL=ON but torch's ProcessGroupNCCL.hpp does not build "
                          "here (a CUDA torch, nccl.h beside it and the CUDA headers are needed)")
    else()
      message(STATUS "GPipe: NCCL groups from C++: off (no CUDA torch with nccl.h here)")
    endif()
  endif()
  set(GPIPE_HAS_GLOO ${GPIPE_GLOO_MATCHES_TORCH} PARENT_SCOPE)
  set(GPIPE_HAS_NCCL ${GPIPE_NCCL_MATCHES_TORCH} PARENT_SCOPE)
  # Only this source sees the backends' headers and macros; it skips the
  # PCH, whose macros must match.
  set_source_files_properties("${source}" TARGET_DIRECTORY ${target} PROPERTIES
    COMPILE_DEFINITIONS "${defines}" INCLUDE_DIRECTORIES "${includes}"
    SKIP_PRECOMPILE_HEADERS ON)
endfunction()
