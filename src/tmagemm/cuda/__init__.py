"""Native CUDA kernels compiled at run time with NVRTC (see :mod:`tmagemm.jit`).

Kernel sources (``*.cu``) sit in this folder with a small Python launcher beside each; shared
device helpers are under ``include/tmagemm/`` (``ptx.cuh``: mbarriers, TMA, fences, clusters).
Importing this package loads nothing: sources are compiled on first use.
"""
