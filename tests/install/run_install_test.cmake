# run_install_test.cmake — ctest driver: install gpipe to a temporary prefix, build tests/install against it, run it.
#
# cmake -DGPIPE_BINARY_DIR=... -DGPIPE_WORK_DIR=... -DCONSUMER_SOURCE_DIR=...
#       -DTORCH_PREFIX=... -DGENERATOR=... -DCXX_COMPILER=... -DBUILD_TYPE=...
#       -P run_install_test.cmake
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
file(REMOVE_RECURSE "${prefix}" "${build}")

run("${CMAKE_COMMAND}" --install "${GPIPE_BINARY_DIR}" --prefix "${prefix}")
# As the README tells users: CMAKE_PREFIX_PATH holds gpipe's prefix and
# torch's (given through the environment here: a ';' in a -D argument would be
# split by execute_process).
set(ENV{CMAKE_PREFIX_PATH} "${prefix}:${TORCH_PREFIX}")
run("${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
run("${CMAKE_COMMAND}" --build "${build}")

execute_process(COMMAND "${build}/consumer" RESULT_VARIABLE result OUTPUT_VARIABLE output)
string(STRIP "${output}" output)
if(NOT result EQUAL 0 OR NOT output STREQUAL "always")
  message(FATAL_ERROR "install test: consumer exited ${result} and printed '${output}', expected 'always'")
endif()
message(STATUS "install test: consumer printed '${output}'")
