"""Small fx helpers shared by the recurrence passes (copying graphs, shape metadata)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

__all__ = ["copy_graph_module", "fake_run", "set_val", "topo_index", "tensor_args"]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``gm``'s graph (same node names and meta)."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    new = fx.GraphModule(gm, g, gm.__class__.__name__)
    for k, v in getattr(gm, "meta", {}).items():
        new.meta[k] = v
    return new


def _fake_mode(vals: Iterable[Any]):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(vals))


def fake_run(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``fn`` on the ``meta['val']`` of the fx nodes in ``args`` (fake tensors)."""
    kwargs = kwargs or {}
    vals: list[Any] = []

    def val_of(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            vals.append(v)
            return v
        return a

    fargs = fx.node.map_aggregate(args, val_of)
    fkwargs = fx.node.map_aggregate(kwargs, val_of)
    mode = _fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return fn(*fargs, **fkwargs)


def set_val(node: fx.Node, fn: Callable[..., Any] | None = None) -> None:
    """Fill ``node.meta['val']`` by running its target (or ``fn``) on fake inputs."""
    if node.op == "get_attr":
        return
    target = fn or node.target
    if node.op == "call_function" and not callable(target):
        return
    node.meta["val"] = fake_run(target, tuple(node.args), dict(node.kwargs))


def topo_index(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)
