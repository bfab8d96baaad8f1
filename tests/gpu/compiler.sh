# compiler.sh — sourced by run.sh: picks a C++ compiler that links libstdc++ as a shared library.
#
# Why: a GPU machine's image may set CXX to a compiler of its own that links
# libstdc++ statically (one such, /opt/gcc/bin/g++ 13.3, did). libgpipe then
# carries a private copy of libstdc++ with its symbols exported, while torch
# and Python load the shared one: a process ends up with half of each, and
# the first std::ostream formatting inside libgpipe (every TORCH_CHECK
# message, the trace summary) jumps through the wrong locale facet and
# segfaults. The C++ tests, a program of their own, do not show it; every
# error path in Python does. So the kit uses the first compiler of $CXX, c++,
# g++, /usr/bin/c++, /usr/bin/g++ whose shared library needs libstdc++.so,
# and says which (in the log and the report's env).

# gpu_kit_pick_cxx DIR: exports CXX (and prints why) when $CXX would not do.
gpu_kit_pick_cxx() {
  local dir="$1" candidate path first=""
  mkdir -p "$dir"
  printf '#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n' \
    >"$dir/probe.cpp"
  for candidate in "${CXX:-}" c++ g++ /usr/bin/c++ /usr/bin/g++; do
    [[ -z $candidate ]] && continue
    path="$(command -v "$candidate" 2>/dev/null)" || continue
    [[ -z $first ]] && first="$path"
    rm -f "$dir/probe.so"
    if "$path" -shared -fPIC -O1 -o "$dir/probe.so" "$dir/probe.cpp" 2>/dev/null \
      && readelf -d "$dir/probe.so" 2>/dev/null | grep -q 'NEEDED.*libstdc++\.so'; then
      if [[ -n ${CXX:-} && $path != "$first" ]]; then
        echo "gpu kit: CXX=$CXX links libstdc++ statically (libgpipe would carry a second" \
          "copy and crash in Python); using $path"
      fi
      export CXX="$path"
      echo "gpu kit: C++ compiler $CXX ($("$CXX" --version 2>/dev/null | head -n 1))"
      return 0
    fi
  done
  echo "gpu kit: no C++ compiler found that links libstdc++ as a shared library;" \
    "keeping CXX=${CXX:-unset} (Python may crash in the error paths of libgpipe)"
  return 0
}
