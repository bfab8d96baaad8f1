"""Builds the Python package gpipe: gpipe._C against the installed torch, linked to libgpipe.

    pip install --no-build-isolation .      (torch from requirements.txt installed first)

The engine is compiled once, by CMake, as libgpipe (the same library C++
users link); the extension compiles only the thin bindings in csrc/python/
(a CppExtension with torch's bundled pybind11, so one build serves the CPU
and the CUDA builds of torch) and ships libgpipe beside itself. Set
GPIPE_CMAKE_BUILD_DIR to reuse an existing CMake build (scripts/test.sh does).
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


class BuildWithEngine(BuildExtension):
    """Builds libgpipe with CMake first, links gpipe._C to it, ships it in the package."""

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
        # libgpipe.so.<major> is what _C's DT_NEEDED names; $ORIGIN finds it.
        package_dir = os.path.join(self.build_lib, "gpipe")
        os.makedirs(package_dir, exist_ok=True)
        for lib in glob.glob(os.path.join(build, "libgpipe.so.*")):
            if lib.count(".so.") == 1 and lib.rsplit(".so.", 1)[1].isdigit():
                shutil.copy2(lib, package_dir)
        if self.inplace:
            for lib in glob.glob(os.path.join(build, "libgpipe.so.*")):
                if lib.rsplit(".so.", 1)[1].isdigit():
                    shutil.copy2(lib, os.path.join(ROOT, "python", "gpipe"))


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
            extra_link_args=["-Wl,-rpath,$ORIGIN"],
        )
    ],
    cmdclass={"build_ext": BuildWithEngine},
    python_requires=">=3.9",
    zip_safe=False,
)
