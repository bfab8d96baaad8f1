"""Builds the Python package gpipe: gpipe._C against the installed torch, linked to libgpipe.

    pip install --no-build-isolation .      (torch from requirements.txt installed first)

The engine is compiled once, by CMake, as libgpipe (the same library C++
users link); the extension compiles only the thin bindings in csrc/python/
(a CppExtension with torch's bundled pybind11, so one build serves the CPU
and the CUDA builds of torch). Set GPIPE_CMAKE_BUILD_DIR to reuse an existing
CMake build (scripts/test.sh does).

The package is also gpipe's C++ install prefix (CMake's own `cmake --install`
of that build), so C++ users need no source build:

    gpipe/include/gpipe/*.h          the public headers
    gpipe/lib/libgpipe.so.0          the library, which gpipe._C links ($ORIGIN/lib)
    gpipe/lib/cmake/GPipe/           find_package(GPipe); gpipe.cmake_prefix_path
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def cmake_build_dir() -> str:
    return os.environ.get("GPIPE_CMAKE_BUILD_DIR") or os.path.join(ROOT, "build", "python")


def install_prefix(build: str, prefix: str) -> None:
    """Installs the CMake build into ``prefix`` (the package directory) as gpipe's C++ prefix,
    with one file for the library: a wheel keeps no symlinks, so libgpipe.so.0 (the name
    gpipe._C and every consumer load, its SONAME) is the file, and the CMake package imports
    that name instead of libgpipe.so.<version>."""
    for stale in ("include", "lib"):
        shutil.rmtree(os.path.join(prefix, stale), ignore_errors=True)
    # Where the library lay before the package became a C++ prefix (a reused build tree).
    for stale in glob.glob(os.path.join(prefix, "libgpipe.so*")):
        os.remove(stale)
    subprocess.check_call(["cmake", "--install", build, "--prefix", prefix])
    lib = os.path.join(prefix, "lib")
    versioned = [n for n in os.listdir(lib) if n.startswith("libgpipe.so.") and n.count(".") > 2]
    if len(versioned) != 1:
        raise RuntimeError(f"cmake --install put {sorted(os.listdir(lib))} in {lib}; expected "
                           f"one libgpipe.so.<major>.<minor>.<patch>")
    soname = os.path.join(lib, "libgpipe.so.0")
    for name in ("libgpipe.so", "libgpipe.so.0"):
        if os.path.lexists(os.path.join(lib, name)):
            os.remove(os.path.join(lib, name))
    os.rename(os.path.join(lib, versioned[0]), soname)
    targets = glob.glob(os.path.join(lib, "cmake", "GPipe", "GPipeTargets-*.cmake"))
    for path in targets:
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace(versioned[0], "libgpipe.so.0"))
    if not targets or any(versioned[0] in open(p).read() for p in targets):
        raise RuntimeError(f"could not point {targets} at libgpipe.so.0")


class BuildWithEngine(BuildExtension):
    """Builds libgpipe with CMake first, links gpipe._C to it, ships it and gpipe's C++ prefix
    (headers, library, CMake package) in the package."""

    def run(self) -> None:
        build = cmake_build_dir()
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            # libgpipe must link the torch this Python (pip's) compiles _C against,
            # not that of whichever python3 is first on PATH.
            subprocess.check_call(["cmake", "-S", ROOT, "-B", build, *generator,
                                   "-DCMAKE_BUILD_TYPE=Release", "-DGPIPE_BUILD_TESTS=OFF",
                                   "-DGPIPE_BUILD_EXAMPLES=OFF",
                                   f"-DGPIPE_PYTHON_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", build, "--target", "gpipe",
                               "--parallel", str(os.cpu_count() or 1)])
        for ext in self.extensions:
            ext.library_dirs.append(build)
        super().run()
        # libgpipe.so.<major> is what _C's DT_NEEDED names; $ORIGIN/lib finds it.
        install_prefix(build, os.path.join(self.build_lib, "gpipe"))
        if self.inplace:
            install_prefix(build, os.path.join(ROOT, "python", "gpipe"))


setup(
    name="gpipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for LibTorch and PyTorch, on a C++ engine",
    packages=["gpipe", "gpipe.skip"],
    package_dir={"": "python"},
    package_data={"gpipe": ["_C.pyi", "py.typed"]},
    ext_modules=[
        CppExtension(
            name="gpipe._C",
            sources=sorted(glob.glob(os.path.join("csrc", "python", "*.cpp"))),
            include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "csrc")],
            libraries=["gpipe"],
            extra_compile_args=["-std=c++20", "-O2"],
            extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
        )
    ],
    cmdclass={"build_ext": BuildWithEngine},
    python_requires=">=3.9",
    zip_safe=False,
)
