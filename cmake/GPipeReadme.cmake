# GPipeReadme.cmake — README.md's complete C++ programs, built and run as ctest tests readme_<n>.
#
# Included from CMakeLists.txt where the examples are added (it uses
# gpipe_reuse_pch and gpipe_pch_only_with_torch). At configure time every
# ```cpp block of README.md holding `int main(` is written, verbatim, to
# <build>/readme/readme_<n>.cpp (n counts from 1 in README order; a file is
# rewritten only when its block changed, so an unrelated README edit rebuilds
# nothing), built as the executable readme_<n> and registered as the ctest
# test readme_<n> (label readme): the program must return 0. README.md is a
# configure dependency, so editing it re-extracts. ```cpp blocks without main
# are fragments and not built. tests/python/test_readme.py runs the ```python
# blocks, refuses tags neither runner knows, and checks that this file found
# the same programs as its own rule.

set(_gpipe_readme "${PROJECT_SOURCE_DIR}/README.md")
set(_gpipe_readme_dir "${PROJECT_BINARY_DIR}/readme")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_gpipe_readme}")
file(READ "${_gpipe_readme}" _gpipe_text)
# The text is searched with string(FIND), never as a list: C++ is full of
# semicolons, which CMake lists would split on. A leading newline lets a
# fence on the first line match "\n```cpp\n" too.
string(PREPEND _gpipe_text "\n")
set(_gpipe_fence "\n```cpp\n")
string(LENGTH "${_gpipe_fence}" _gpipe_fence_length)
set(_gpipe_readme_count 0)
set(_gpipe_readme_sources)
while(TRUE)
  string(FIND "${_gpipe_text}" "${_gpipe_fence}" _gpipe_at)
  if(_gpipe_at EQUAL -1)
    break()
  endif()
  math(EXPR _gpipe_body_at "${_gpipe_at} + ${_gpipe_fence_length}")
  string(SUBSTRING "${_gpipe_text}" ${_gpipe_body_at} -1 _gpipe_text)
  # The closing fence: the block ends with the newline before it.
  string(FIND "${_gpipe_text}" "\n```" _gpipe_end)
  if(_gpipe_end EQUAL -1)
    message(FATAL_ERROR "GPipe: README.md has a ```cpp block that is never closed")
  endif()
  math(EXPR _gpipe_end "${_gpipe_end} + 1")
  string(SUBSTRING "${_gpipe_text}" 0 ${_gpipe_end} _gpipe_block)
  string(SUBSTRING "${_gpipe_text}" ${_gpipe_end} -1 _gpipe_text)
  # The same rule as tests/python/test_readme.py's _MAIN.
  if(_gpipe_block MATCHES "int[ \t]+main[ \t]*\\(")
    math(EXPR _gpipe_readme_count "${_gpipe_readme_count} + 1")
    set(_gpipe_source "${_gpipe_readme_dir}/readme_${_gpipe_readme_count}.cpp")
    # Written beside, then copied only when different: an unchanged program
    # keeps its timestamp and is not rebuilt.
    file(WRITE "${_gpipe_readme_dir}/new/readme_${_gpipe_readme_count}.cpp" "${_gpipe_block}")
    configure_file("${_gpipe_readme_dir}/new/readme_${_gpipe_readme_count}.cpp" "${_gpipe_source}"
                   COPYONLY)
    file(REMOVE "${_gpipe_readme_dir}/new/readme_${_gpipe_readme_count}.cpp")
    list(APPEND _gpipe_readme_sources "${_gpipe_source}")
  endif()
endwhile()

# Programs removed from README.md leave no stale sources behind.
file(GLOB _gpipe_readme_old "${_gpipe_readme_dir}/readme_*.cpp")
foreach(_gpipe_old IN LISTS _gpipe_readme_old)
  if(NOT _gpipe_old IN_LIST _gpipe_readme_sources)
    file(REMOVE "${_gpipe_old}")
  endif()
endforeach()

foreach(_gpipe_source IN LISTS _gpipe_readme_sources)
  get_filename_component(_gpipe_name "${_gpipe_source}" NAME_WE)
  add_executable(${_gpipe_name} "${_gpipe_source}")
  target_link_libraries(${_gpipe_name} PRIVATE GPipe::gpipe)
  gpipe_reuse_pch(${_gpipe_name})
  gpipe_pch_only_with_torch("${_gpipe_source}")
  add_test(NAME ${_gpipe_name} COMMAND ${_gpipe_name})
  set_tests_properties(${_gpipe_name} PROPERTIES TIMEOUT ${GPIPE_TEST_TIMEOUT} LABELS readme)
endforeach()
