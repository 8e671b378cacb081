"""gradshard's custom ops, each defined with everything that knows about it.

One module per op: the ``torch.library`` definition, its fake (shape) function, its VJP,
the kernels it binds (from :mod:`gradshard.kernels`) and its rules for the analyses (time
behaviour in :mod:`gradshard.analysis.locality`, dims in :mod:`gradshard.analysis.dims`, FLOPs in
``torch.utils.flop_counter``'s registry, so ``FlopCounterMode`` counts it). :mod:`aten_flops`
adds FLOP formulas torch lacks for aten ops the plans run.
Importing this package defines them all; ``gradshard/__init__`` does so first, so the
front doors in :mod:`gradshard.kernels` always find their ops under ``torch.ops.gradshard``.
"""

from __future__ import annotations

from gradshard.ops import adjoint_shard, aten_flops, carried_loop, dense_scan, lightning, linear_scan, rolled_body

__all__ = ["adjoint_shard", "aten_flops", "carried_loop", "dense_scan", "lightning", "linear_scan", "rolled_body"]
