"""gpipe: GPipe pipeline parallelism on a C++ engine, for LibTorch and PyTorch.

Wrap an ``nn.Sequential`` in :class:`gpipe.Pipe` (also exported as
``gpipe.GPipe``, with torchgpipe's arguments) to run it as a pipeline of
stages over devices and micro-batches, with the same outputs and gradients
as the plain model.
"""
import os as _os

import torch  # noqa: F401  (loads libtorch before the extension)

from gpipe import balance, skip
from gpipe.pipe import GPipe, Pipe, is_checkpointing, is_recomputing
from gpipe.schedule import Schedule
from gpipe import distributed
from gpipe.pipeline import pipeline
from gpipe.torchgpipe_compat import convert_torchgpipe_state_dict, load_torchgpipe_state_dict
from gpipe.trace import Trace, TraceEvent, TraceSummary, plot_timeline, tracing

__all__ = [
    "Pipe", "GPipe", "Schedule", "Trace", "TraceEvent", "TraceSummary", "balance", "is_checkpointing",
    "is_recomputing", "plot_timeline", "tracing", "convert_torchgpipe_state_dict",
    "load_torchgpipe_state_dict", "skip", "distributed", "pipeline",
]
__version__ = "0.1.0"

#: The directory to put in CMAKE_PREFIX_PATH for ``find_package(GPipe)``, as
#: ``torch.utils.cmake_prefix_path`` is for torch: the package is gpipe's C++ install prefix
#: (headers, libgpipe and the CMake package; see README, "C++ from pip").
cmake_prefix_path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "lib", "cmake")
