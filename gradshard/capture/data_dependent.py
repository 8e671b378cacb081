"""Refuse a captured graph whose tensor sizes depend on tensor data.

A model that routes tokens with ``nonzero`` / boolean indexing (a mixture-of-experts
dispatch that gathers each expert's tokens) traces into a graph whose sizes are
*unbacked* symbols: known only when the data is. gradshard's analyses and plans read
sizes from the input's shape (which dims run along time, how a chunk or shard is
sliced, what a step costs), so such a graph is refused at capture, naming the first node
whose output tensor has a data-dependent size.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gradshard.errors import CaptureError, node_error

__all__ = ["refuse_data_dependent_sizes"]


def _unbacked(val: object) -> bool:
    """Has a tensor in ``val`` a data-dependent size? (A scalar read from data, ``x.item()`` used as
    a number, sizes nothing.)"""
    vals = val if isinstance(val, (list, tuple)) else (val,)
    return any(isinstance(v, torch.Tensor) and bool(free_unbacked_symbols(v)) for v in vals)


def refuse_data_dependent_sizes(gm: fx.GraphModule) -> None:
    """Raise :class:`CaptureError` at the first node whose output size depends on tensor data."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and _unbacked(node.meta.get("val")):
            raise node_error(
                node, "the size of its output depends on tensor values (data-dependent routing: sizes "
                "from `.tolist()` of the tokens per expert, `nonzero`, boolean indexing); gradshard's "
                "plans slice and price a graph by sizes known from the input's shape",
                "compute every expert on every token and weight by the routing (a dense or "
                "grouped-GEMM MoE), or train this model with plain autograd (no gs.compile)",
                cls=CaptureError)
