"""Concrete per-node costs at the captured shapes: output bytes and forward/backward FLOPs.

FLOPs come from ``torch.utils.flop_counter`` by replaying each node (and its VJP) on the
fake tensors stored in ``meta['val']``: nothing is computed for real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["NodeCost", "node_cost", "tensor_bytes"]


@dataclass(frozen=True)
class NodeCost:
    out_bytes: int
    fwd_flops: int
    bwd_flops: int


def tensor_bytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def _meta(v: object) -> object:
    """A data-free stand-in on the meta device (fake tensors of different modes can't mix)."""
    if isinstance(v, torch.Tensor):
        t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
        return t
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def _on_meta(kwargs: dict) -> dict:
    """A factory's keywords with its ``device`` on meta: a node with no tensor input (a causal
    mask's ``ones(n, n)``) would otherwise allocate its full size for real at every length."""
    if "device" not in kwargs:
        return kwargs
    return {**kwargs, "device": torch.device("meta"), **({"pin_memory": False} if "pin_memory" in kwargs else {})}


def node_cost(node: fx.Node) -> NodeCost:
    """Bytes of the node's output and its forward/backward FLOPs (0 when unknown)."""
    val = node.meta.get("val")
    out_bytes = tensor_bytes(val)
    if node.op != "call_function" or not callable(node.target):
        return NodeCost(out_bytes, 0, 0)
    return NodeCost(out_bytes, *_flops(node))


def _flops(node: fx.Node) -> tuple[int, int]:
    try:
        env = {a: _meta(a.meta.get("val")) for a in node.all_input_nodes}
        args = fx.node.map_arg(node.args, lambda a: env[a])
        kwargs = _on_meta(fx.node.map_arg(node.kwargs, lambda a: env[a]))
        with FlopCounterMode(display=False) as fwd:
            out = node.target(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        ins = [t for t in env.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        bwd_total = 0
        if outs and ins:
            with FlopCounterMode(display=False) as bwd:
                torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=True)
            bwd_total = bwd.get_total_flops()
        return fwd.get_total_flops(), bwd_total
    except Exception:  # an op without a meta kernel: its cost is unknown, reported as 0
        return 0, 0
