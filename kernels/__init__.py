"""gradshard.kernels: the hot loops of gradshard's backward plans, as traceable custom ops.

* :func:`linear_scan` -- diagonal linear recurrence ``h_t = a_t h_{t-1} + u_t`` (op
  ``gradshard::linear_scan``), backward = one reverse scan (the adjoint).
* :func:`lightning_attention` -- block-wise causal linear attention with decay, with incoming
  and outgoing states (op ``gradshard::lightning_attention``), as needed by LASP.
* :func:`adjoint_shard` -- gradients of one time shard of a diagonal recurrence from ``h0``
  and the carry of the next shard (op ``gradshard::adjoint_shard``).

Every kernel has a torch reference backend (any device) and Triton kernels
(:mod:`gradshard.kernels.triton`; CUDA, or CPU under ``TRITON_INTERPRET=1``), chosen by
:func:`select_backend`. On CPU the torch backend's diagonal scan is one compiled C++ loop
(:mod:`gradshard.kernels.scan_cpu`) where Inductor's C++ toolchain builds it. The front doors here validate their arguments and call the custom
ops under ``torch.ops.gradshard``; the ops themselves (fake, VJP, analysis rules) are defined
in :mod:`gradshard.ops`, which binds them to the implementations here. ``import gradshard``
defines them before anything can call a front door.
"""

from .adjoint import adjoint_shard, adjoint_shard_torch
from .backend import available_backends, select_backend
from .lightning import lightning_attention
from .lightning_torch import lightning_naive
from .linear_scan import linear_scan
from .scan_torch import scan_naive, scan_torch

__all__ = [
    "adjoint_shard",
    "adjoint_shard_torch",
    "available_backends",
    "lightning_attention",
    "lightning_naive",
    "linear_scan",
    "scan_naive",
    "scan_torch",
    "select_backend",
]
