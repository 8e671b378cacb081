"""Concrete per-node costs at the captured shapes: output bytes and forward/backward FLOPs.

FLOPs come from ``torch.utils.flop_counter`` by replaying each node (and its VJP) on
meta-device stand-ins of the values stored in ``meta['val']``: nothing is computed for real.
Given a memo, :func:`node_cost` replays each distinct signature once (a layer repeated ``L``
times, or an unrolled loop, replays its ops once, not ``L`` times).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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


def node_cost(node: fx.Node, memo: Optional[dict] = None) -> NodeCost:
    """Bytes of the node's output and its forward/backward FLOPs (0 when unknown).

    ``memo``: FLOPs already replayed, by :func:`_flops_key` (filled here); nodes with the same
    key replay the same ops on the same stand-ins, so they have the same FLOPs."""
    val = node.meta.get("val")
    out_bytes = tensor_bytes(val)
    if node.op != "call_function" or not callable(node.target):
        return NodeCost(out_bytes, 0, 0)
    key = _flops_key(node) if memo is not None else None
    if key is None:
        return NodeCost(out_bytes, *_flops(node))
    flops = memo.get(key)
    if flops is None:
        flops = memo[key] = _flops(node)
    return NodeCost(out_bytes, *flops)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _flops_key(node: fx.Node) -> Optional[tuple]:
    """Everything :func:`_flops` reads, hashable: the target, the arguments with each input node
    as its position among ``all_input_nodes`` (so ``x * x`` and ``x * y`` differ), and each
    input's value as :func:`_meta` rebuilds it (shape, strides, dtype; plain values as they
    are). None when an argument or value is of another kind (a symbolic size, an object):
    such a node is replayed, not looked up."""
    inputs = node.all_input_nodes
    position = {a: i for i, a in enumerate(inputs)}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", position[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", *((k, arg(v)) for k, v in a.items()))
        if isinstance(a, float):
            return ("float", repr(a))  # -0.0 and 0.0 compare equal
        if isinstance(a, _PLAIN):
            return (type(a).__name__, a)
        raise _Unkeyed

    def ints(xs: Any) -> tuple[int, ...]:
        out = tuple(xs)
        if not all(type(x) is int for x in out):  # a SymInt: reading it as an int would add a guard
            raise _Unkeyed
        return out

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                raise _Unkeyed
            return ("tensor", ints(v.shape), ints(v.stride()), v.dtype)
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, *(value(x) for x in v))
        return arg(v)

    try:
        key = (node.target, arg(node.args), arg(node.kwargs), tuple(value(a.meta.get("val")) for a in inputs))
        hash(key)
    except Exception:  # noqa: BLE001 - anything unkeyed is replayed (_flops reports its own failures)
        return None
    return key


class _Unkeyed(Exception):
    """A value :func:`_flops_key` does not key."""


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
