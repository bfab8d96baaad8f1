# GPipeStdlib.cmake — warns at configure when the C++ compiler links libstdc++ statically.
#
# torch links libstdc++ as a shared library. A compiler that links it
# statically (one GPU machine's image set CXX to such a GCC) gives libgpipe
# a private copy with its symbols exported; in a Python process, which has
# the shared one loaded, half of libgpipe's calls then reach one copy and
# half the other, and the first std::ostream formatting (any error message)
# segfaults in a locale facet. C++ programs of their own may not show it.
# So: build a tiny shared library with the compiler and look for libstdc++
# (or libc++) among what it needs. docs/gpu.md tells the story.

function(gpipe_check_shared_stdlib)
  find_program(GPIPE_READELF NAMES readelf "${CMAKE_READELF}")
  mark_as_advanced(GPIPE_READELF)
  if(NOT GPIPE_READELF OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  set(dir "${CMAKE_BINARY_DIR}/CMakeFiles/gpipe-stdlib-probe")
  file(WRITE "${dir}/probe.cpp"
       "#include <sstream>\n#include <string>\n"
       "std::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n")
  execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -shared -fPIC -o probe.so probe.cpp
                  WORKING_DIRECTORY "${dir}" RESULT_VARIABLE built OUTPUT_QUIET ERROR_QUIET)
  if(NOT built EQUAL 0)
    return()
  endif()
  execute_process(COMMAND "${GPIPE_READELF}" -d probe.so WORKING_DIRECTORY "${dir}"
                  OUTPUT_VARIABLE needed ERROR_QUIET)
  if(NOT needed MATCHES "libstdc\\+\\+\\.so|libc\\+\\+\\.so")
    message(WARNING "GPipe: ${CMAKE_CXX_COMPILER} links the C++ standard library statically, "
            "but torch uses it as a shared library: libgpipe would carry a second copy, and "
            "in Python (gpipe._C) its error paths would crash. Configure a fresh build with a "
            "compiler that links it dynamically, e.g. CXX=/usr/bin/g++ (docs/gpu.md).")
  endif()
endfunction()
