# GPipeTorch.cmake — prepares and tidies find_package(Torch) for a pip-installed torch.
#
# Used by this project's CMakeLists.txt and by the installed GPipeConfig.cmake,
# so a consumer of GPipe finds torch the same way we do:
#
#   gpipe_torch_prepare()           # hints; sets nothing the user already set
#   cmake_policy(SET CMP0104 OLD)   # in a policy scope of your own, see below
#   find_package(Torch REQUIRED)    # or find_dependency(Torch)
#   gpipe_torch_finish()
#
# Why each step (all of them are about torch's own CMake package, not gpipe):
#
# * Where torch is. A pip wheel keeps its CMake package in
#   site-packages/torch/share/cmake. When neither Torch_DIR nor any
#   CMAKE_PREFIX_PATH entry holds TorchConfig.cmake, ask the Python
#   interpreter (GPIPE_PYTHON_EXECUTABLE, default `python3` on PATH) for
#   `torch.utils.cmake_prefix_path` and append it, so a prefix the user gave
#   always wins.
# * CUDA. The PyPI wheel is a CUDA build, and its CMake package insists on a
#   CUDA toolkit (nvcc, headers, libcudart) even for code that never touches
#   CUDA. Point FindCUDA and enable_language(CUDA) at ONE toolkit
#   (CUDA_TOOLKIT_ROOT_DIR, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda), so nvcc
#   and the headers it checks agree even when nvcc is not on PATH.
# * CMP0104. enable_language(CUDA) under CMP0104 NEW defines
#   CMAKE_CUDA_ARCHITECTURES, and torch then warns that it ignores it (it
#   reads TORCH_CUDA_ARCH_LIST). Policies cannot be set from inside a macro for
#   the caller, so the caller sets CMP0104 to OLD around find_package(Torch).
# * kineto. TorchConfig.cmake looks for a separate libkineto that the wheels
#   never ship (kineto is linked into libtorch_cpu), and warns "library kineto
#   not found" (pytorch/pytorch#62588, #169182). Pre-seeding the lookup with
#   the `torch` target itself (already linked) silences it without changing
#   the link line; the variable is removed again afterwards.
# * MKL link directories. Torch's mkl.cmake adds ${MKL_ROOT}/lib/intel64 and
#   friends even when MKL_ROOT is empty (pytorch/pytorch#73008), which puts
#   -L/lib/intel64 and a bogus RPATH on every link line. gpipe_torch_finish
#   keeps only link directories that exist.

macro(gpipe_torch_prepare)
  # -- where torch is --------------------------------------------------------
  set(_gpipe_torch_known FALSE)
  if(Torch_DIR AND EXISTS "${Torch_DIR}/TorchConfig.cmake")
    set(_gpipe_torch_known TRUE)
  else()
    set(_gpipe_prefixes ${CMAKE_PREFIX_PATH})
    if(DEFINED ENV{CMAKE_PREFIX_PATH})
      string(REPLACE ":" ";" _gpipe_env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
      list(APPEND _gpipe_prefixes ${_gpipe_env_prefixes})
    endif()
    foreach(_gpipe_prefix IN LISTS _gpipe_prefixes)
      if(EXISTS "${_gpipe_prefix}/Torch/TorchConfig.cmake"
         OR EXISTS "${_gpipe_prefix}/share/cmake/Torch/TorchConfig.cmake"
         OR EXISTS "${_gpipe_prefix}/TorchConfig.cmake")
        set(_gpipe_torch_known TRUE)
      endif()
    endforeach()
  endif()
  if(NOT _gpipe_torch_known)
    if(NOT GPIPE_PYTHON_EXECUTABLE)
      find_program(GPIPE_PYTHON_EXECUTABLE NAMES python3 python
                   DOC "Python interpreter whose torch gpipe builds against")
    endif()
    if(GPIPE_PYTHON_EXECUTABLE)
      execute_process(
        COMMAND "${GPIPE_PYTHON_EXECUTABLE}" -c
                "import torch.utils; print(torch.utils.cmake_prefix_path, end='')"
        OUTPUT_VARIABLE _gpipe_torch_prefix
        ERROR_VARIABLE _gpipe_torch_error
        RESULT_VARIABLE _gpipe_torch_result)
      if(_gpipe_torch_result EQUAL 0 AND EXISTS "${_gpipe_torch_prefix}")
        list(APPEND CMAKE_PREFIX_PATH "${_gpipe_torch_prefix}")
        message(STATUS "GPipe: torch from ${GPIPE_PYTHON_EXECUTABLE}: ${_gpipe_torch_prefix}")
      else()
        string(STRIP "${_gpipe_torch_error}" _gpipe_torch_error)
        message(STATUS "GPipe: `${GPIPE_PYTHON_EXECUTABLE} -c 'import torch'` failed "
                       "(${_gpipe_torch_error}); point Torch_DIR or CMAKE_PREFIX_PATH at "
                       "torch's CMake package, or install torch for that Python "
                       "(in gpipe's tree: scripts/setup.sh)")
      endif()
    endif()
  endif()

  # -- one CUDA toolkit --------------------------------------------------------
  if(NOT CUDA_TOOLKIT_ROOT_DIR)
    foreach(_gpipe_cuda IN ITEMS "$ENV{CUDA_HOME}" "$ENV{CUDA_PATH}" "/usr/local/cuda")
      if(_gpipe_cuda AND EXISTS "${_gpipe_cuda}/bin/nvcc")
        set(CUDA_TOOLKIT_ROOT_DIR "${_gpipe_cuda}" CACHE PATH
            "CUDA toolkit that torch's CMake package checks")
        break()
      endif()
    endforeach()
  endif()
  if(CUDA_TOOLKIT_ROOT_DIR AND NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc" CACHE FILEPATH
        "nvcc of CUDA_TOOLKIT_ROOT_DIR")
  endif()

  # -- silence the kineto lookup ---------------------------------------------
  set(_gpipe_unset_kineto FALSE)
  if(NOT DEFINED kineto_LIBRARY)
    set(kineto_LIBRARY torch)
    set(_gpipe_unset_kineto TRUE)
  endif()
endmacro()

macro(gpipe_torch_finish)
  if(_gpipe_unset_kineto)
    unset(kineto_LIBRARY)
    # The `torch` placeholder went into TORCH_LIBRARIES twice; once is enough.
    list(REMOVE_DUPLICATES TORCH_LIBRARIES)
  endif()
  if(TARGET caffe2::mkl)
    get_target_property(_gpipe_dirs caffe2::mkl INTERFACE_LINK_DIRECTORIES)
    if(_gpipe_dirs)
      set(_gpipe_existing_dirs)
      foreach(_gpipe_dir IN LISTS _gpipe_dirs)
        if(IS_DIRECTORY "${_gpipe_dir}")
          list(APPEND _gpipe_existing_dirs "${_gpipe_dir}")
        endif()
      endforeach()
      set_property(TARGET caffe2::mkl PROPERTY INTERFACE_LINK_DIRECTORIES ${_gpipe_existing_dirs})
    endif()
  endif()
endmacro()
