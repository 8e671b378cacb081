"""gradshard's custom ops, each defined with everything that knows about it.

One module per op: the ``torch.library`` definition, its fake (shape) function, its VJP,
the kernels it binds (from :mod:`gradshard.kernels`) and its rules for the analyses (time
behaviour in :mod:`gradshard.analysis.locality`, dims in :mod:`gradshard.analysis.dims`).
Importing this package defines them all; ``gradshard/__init__`` does so first, so the
front doors in :mod:`gradshard.kernels` always find their ops under ``torch.ops.gradshard``.
"""

from __future__ import annotations

from gradshard.ops import adjoint_shard, dense_scan, lightning, linear_scan, rolled_body

__all__ = ["adjoint_shard", "dense_scan", "lightning", "linear_scan", "rolled_body"]
