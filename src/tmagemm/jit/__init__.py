"""Run-time compilation and launch of tmagemm's native CUDA kernels.

``compile("file.cu", defines=...)`` builds a source under ``tmagemm/cuda`` with NVRTC (from the
``nvidia-cuda-nvrtc`` wheel) for sm_90a and caches the cubin; ``Module.function(name)`` loads a
kernel into torch's current CUDA context and ``Kernel.launch`` runs it on torch's current stream.
"""

from tmagemm.jit.compiler import CompileError, Module, clear_memory_cache, compile, compile_string, nvrtc_version
from tmagemm.jit.runtime import Kernel, LaunchError, ensure_context
from tmagemm.jit.tools import ResourceUsage, resource_usage, sass

__all__ = [
    "CompileError",
    "Kernel",
    "LaunchError",
    "Module",
    "ResourceUsage",
    "clear_memory_cache",
    "compile",
    "compile_string",
    "ensure_context",
    "nvrtc_version",
    "resource_usage",
    "sass",
]
