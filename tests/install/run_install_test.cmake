# run_install_test.cmake — ctest driver: install gpipe to a temporary prefix, build tests/install against it, run it.
#
# cmake -DGPIPE_BINARY_DIR=... -DGPIPE_WORK_DIR=... -DCONSUMER_SOURCE_DIR=...
#       -DTORCH_PREFIX=... -DTORCH_VERSION=... -DGENERATOR=... -DCXX_COMPILER=...
#       -DBUILD_TYPE=... -DGLOO=yes|no -P run_install_test.cmake
#
# Checks, in order:
# 0. <gpipe/gpipe.h> includes every other installed header.
# 1. A consumer that sets CMAKE_CXX_STANDARD 20 (then 17) before
#    find_package(GPipe) configures (torch's CUDA setup runs no GPU probe),
#    builds, and runs, using gpipe through <gpipe/gpipe.h> alone, and says
#    whether the library makes Gloo groups (GLOO: yes or no, as configured).
# 2. Against a torch of another version, find_package(GPipe) stops with a
#    message naming both versions. The other torch is a stand-in: a
#    TorchConfig.cmake that reports version 0.0.1 and defines nothing else
#    (the check reads only the version, so a second real torch is not needed).
cmake_minimum_required(VERSION 3.22)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "install test: `${command}` failed (${result})")
  endif()
endfunction()

set(prefix "${GPIPE_WORK_DIR}/prefix")
set(build "${GPIPE_WORK_DIR}/consumer-build")
set(fake_torch "${GPIPE_WORK_DIR}/torch-0.0.1")
set(mismatch_build "${GPIPE_WORK_DIR}/consumer-other-torch")
file(REMOVE_RECURSE "${prefix}" "${build}" "${fake_torch}" "${mismatch_build}")

run("${CMAKE_COMMAND}" --install "${GPIPE_BINARY_DIR}" --prefix "${prefix}")
# As the README tells users: CMAKE_PREFIX_PATH holds gpipe's prefix and
# torch's (given through the environment here: a ';' in a -D argument would be
# split by execute_process). No TORCH_CUDA_ARCH_LIST: a user has none either.
set(ENV{CMAKE_PREFIX_PATH} "${prefix}:${TORCH_PREFIX}")
unset(ENV{TORCH_CUDA_ARCH_LIST})

# -- 0. the umbrella header names every installed header ------------------------------
file(READ "${prefix}/include/gpipe/gpipe.h" umbrella)
file(GLOB headers RELATIVE "${prefix}/include" "${prefix}/include/gpipe/*.h")
foreach(header IN LISTS headers)
  if(NOT header STREQUAL "gpipe/gpipe.h")
    string(FIND "${umbrella}" "#include <${header}>" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "install test: gpipe/gpipe.h does not include <${header}>; "
                          "README promises that it includes every public header")
    endif()
  endif()
endforeach()

# -- 1. the consumer, as C++20 and as C++17 ----------------------------------------
foreach(standard 20 17)
  set(consumer_build "${build}-${standard}")
  file(REMOVE_RECURSE "${consumer_build}")
  run("${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}" -G "${GENERATOR}"
      "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
      "-DCONSUMER_CXX_STANDARD=${standard}")
  run("${CMAKE_COMMAND}" --build "${consumer_build}")
  set(expected "always balance 1 2 c++${standard} gloo ${GLOO}")
  execute_process(COMMAND "${consumer_build}/consumer" RESULT_VARIABLE result
                  OUTPUT_VARIABLE output)
  string(STRIP "${output}" output)
  if(NOT result EQUAL 0 OR NOT output STREQUAL expected)
    message(FATAL_ERROR "install test: the C++${standard} consumer exited ${result} and printed "
                        "'${output}', expected '${expected}'")
  endif()
  message(STATUS "install test: consumer printed '${output}'")
endforeach()

# -- 2. another torch ---------------------------------------------------------------
file(WRITE "${fake_torch}/TorchConfigVersion.cmake"
     "set(PACKAGE_VERSION \"0.0.1\")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
file(WRITE "${fake_torch}/TorchConfig.cmake"
     "# a stand-in for a torch of another version: nothing but the version\n"
     "set(Torch_FOUND TRUE)\nset(TORCH_LIBRARIES \"\")\n")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${mismatch_build}" -G "${GENERATOR}"
          "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DTorch_DIR=${fake_torch}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
# CMake wraps long messages: search with the whitespace collapsed.
string(REGEX REPLACE "[ \t\r\n]+" " " flat "${output}")
set(want "GPipe was built against torch ${TORCH_VERSION}, but the torch found is 0.0.1")
string(FIND "${flat}" "${want}" at_versions)
string(FIND "${flat}" "rebuild and reinstall gpipe" at_fix)
if(result EQUAL 0 OR at_versions EQUAL -1 OR at_fix EQUAL -1)
  message(FATAL_ERROR "install test: configuring against torch 0.0.1 exited ${result}; expected a "
                      "failure saying '${want}' and how to fix it. Output:\n${output}")
endif()
message(STATUS "install test: another torch is refused: '${want}'")
