"""Triton kernels of gradshard.kernels (CUDA, or CPU under TRITON_INTERPRET=1).

Import the submodules lazily (``gradshard.kernels`` does so on first use): Triton picks
interpreter or compiler mode when the ``@triton.jit`` functions are defined.

* :mod:`.scan`      -- forward/reverse diagonal linear scan, chunk-parallel over time.
* :mod:`.adjoint`   -- fused adjoint-shard kernel (recompute h, reverse adjoint scan).
* :mod:`.lightning` -- lightning attention forward and backward with state in/out.
"""
