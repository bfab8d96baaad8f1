"""C++ from pip: the installed Python package is gpipe's C++ install prefix. A CMake project
with find_package(GPipe) configures, builds and runs a LibTorch program using gpipe::Pipe
against the package alone (CMAKE_PREFIX_PATH: gpipe.cmake_prefix_path and torch's), without
compiling any of gpipe's sources and without reading anything of the source checkout.

The consumer is tests/install's (also built by ctest against `cmake --install`), copied out
of the checkout first.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gpipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.dirname(os.path.abspath(gpipe.__file__))


def test_the_package_holds_headers_library_and_cmake_package():
    assert gpipe.cmake_prefix_path == os.path.join(PACKAGE, "lib", "cmake")
    assert os.path.isfile(os.path.join(gpipe.cmake_prefix_path, "GPipe", "GPipeConfig.cmake"))
    assert os.path.isfile(os.path.join(PACKAGE, "include", "gpipe", "gpipe.h"))
    assert os.path.isfile(os.path.join(PACKAGE, "include", "gpipe", "pipe.h"))
    # One library file, the one gpipe._C loads (a wheel keeps no symlinks).
    libraries = sorted(n for n in os.listdir(os.path.join(PACKAGE, "lib")) if "libgpipe" in n)
    assert libraries == ["libgpipe.so.0"], libraries
    loaded = open(f"/proc/{os.getpid()}/maps").read()
    assert os.path.join(PACKAGE, "lib", "libgpipe.so.0") in loaded


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")
def test_a_cmake_project_builds_and_runs_against_the_package(tmp_path):
    source = tmp_path / "app"
    source.mkdir()
    for name in ("CMakeLists.txt", "consumer.cpp"):
        shutil.copy(os.path.join(ROOT, "tests", "install", name), source / name)
    build = tmp_path / "build"
    env = dict(os.environ, CMAKE_PREFIX_PATH=os.pathsep.join(
        [gpipe.cmake_prefix_path, torch.utils.cmake_prefix_path]))
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
         f"-DGPIPE_PYTHON_EXECUTABLE={sys.executable}"],
        env=env, capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    cache = (build / "CMakeCache.txt").read_text()
    assert f"GPipe_DIR:PATH={os.path.join(gpipe.cmake_prefix_path, 'GPipe')}" in cache, cache
    built = subprocess.run(["cmake", "--build", str(build)], env=env, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    # Nothing of the checkout: no include/ or csrc/ of it, none of its build trees.
    rules = "".join(p.read_text() for p in build.rglob("*")
                    if p.is_file() and p.name in ("build.ninja", "flags.make", "link.txt"))
    assert rules, "no build rules found"
    for inside in ("include", "csrc", "build"):
        assert os.path.join(ROOT, inside) not in rules, inside
    assert os.path.join(PACKAGE, "include") in rules
    ran = subprocess.run([str(build / "consumer")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    # setup.sh installs Debian's libgloo-dev, so the package's library makes Gloo groups.
    assert ran.stdout.strip() == "always balance 1 2 c++20 gloo yes"
