# GPipePch.cmake — gives the torch PCH only to sources that include torch themselves.
#
# A precompiled header is force-included (-include) into every source of a
# target. For a source that never includes torch that is not just slower
# (loading the ~700 MB PCH costs ~6 s; schedule.cpp compiles in 2 s without
# it) but changes its meaning: c10's logging header declares
# `std::operator<<(std::ostream&, const std::vector<T>&)`, so Catch2 then
# believes every vector is printable and fails to compile CHECK(a == b) on
# vectors of a type without operator<< (seen in tests/cpp/test_schedule.cpp).
#
# gpipe_pch_only_with_torch(<sources...>) marks each source that reaches no
# <torch/...>, <ATen/...> or <c10/...> include, directly or through gpipe's
# own headers (<gpipe/...> and quoted includes found next to the file, in
# csrc/ or in include/), with SKIP_PRECOMPILE_HEADERS. The scan runs at
# configure time: after adding the first torch include to a torch-free file,
# re-run cmake (or touch CMakeLists.txt) to give it the PCH back; until then
# it only compiles slower.

# Sets <out> to TRUE when <file> includes torch, directly or transitively
# through project headers.
function(gpipe_includes_torch file out)
  set(queue "${file}")
  set(seen "")
  while(queue)
    list(POP_FRONT queue current)
    if(current IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${current}")
    get_filename_component(dir "${current}" DIRECTORY)
    file(STRINGS "${current}" lines REGEX "^[ \t]*#[ \t]*include")
    foreach(line IN LISTS lines)
      if(line MATCHES "include[ \t]*<(torch|ATen|c10)/")
        set(${out} TRUE PARENT_SCOPE)
        return()
      elseif(line MATCHES "include[ \t]*<(gpipe/[^>]+)>")
        list(APPEND queue "${PROJECT_SOURCE_DIR}/include/${CMAKE_MATCH_1}")
      elseif(line MATCHES "include[ \t]*\"([^\"]+)\"")
        set(name "${CMAKE_MATCH_1}")
        foreach(base IN ITEMS "${dir}" "${PROJECT_SOURCE_DIR}/csrc" "${PROJECT_SOURCE_DIR}/include")
          if(EXISTS "${base}/${name}")
            get_filename_component(header "${base}/${name}" ABSOLUTE)
            list(APPEND queue "${header}")
            break()
          endif()
        endforeach()
      endif()
    endforeach()
  endwhile()
  set(${out} FALSE PARENT_SCOPE)
endfunction()

function(gpipe_pch_only_with_torch)
  foreach(source IN LISTS ARGN)
    gpipe_includes_torch("${source}" uses_torch)
    if(NOT uses_torch)
      set_source_files_properties("${source}" PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endforeach()
endfunction()
