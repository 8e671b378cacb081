"""Halo exchange for short causal windows under LASP (token shift, causal convolutions).

A token shift ``F.pad(x, (0, 0, 1, 0))[:, :-1]`` or a causal ``conv1d(x, w, padding=K-1)``
reads ``L`` steps before the current one. On a rank's first ``L`` steps those live on the
previous rank, so the zero padding is replaced by the previous rank's last ``L`` steps::

    before:  pad = constant_pad_nd(x, [0, 0, 1, 0])                 (zeros before step 0)
    after:   halo = self.lasp_halo_0(x);  pad = cat([halo, x], 1)   (rank r-1's last step)

    before:  conv = conv1d(x, w, b, [1], [3], [1], 1)
    after:   conv = conv1d(cat([self.lasp_halo_1(x), constant_pad_nd(x, [0, 3])], -1), w, b, [1], [0], [1], 1)

Rank 0 gets the original padding value. The exchange is ``L`` steps of ``x`` (B·L·C
elements) per window and direction, independent of the sequence length; the backward
returns the halo's gradient to the rank it came from. Every rank but the last must hold at
least ``L`` steps (checked at compile time). Anything else in the window (slices, pointwise
ops on the shifted tensor) runs unchanged: indices keep their meaning, only the padded
values change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from gradshard.analysis.locality import TimeLocality
from gradshard.errors import node_error
from gradshard.ir import Stage

from gradshard.plans.lasp.group import LaspGroup
from gradshard.passes.linear_attention_graph import NORMAL, Component

aten = torch.ops.aten

__all__ = ["HaloRoot", "plan_halo", "apply_halo", "LaspHalo"]

HALO_TAG_BASE = 1 << 20  # message tags of halos: HALO_TAG_BASE + 2 * halo_id + phase
_PADS = {aten.constant_pad_nd.default, aten.pad.default}
_CONVS = {aten.conv1d.default, aten.convolution.default}
_PASS_THROUGH = {aten.slice.Tensor, aten.narrow.default, aten.transpose.int, aten.permute.default,
                 aten.unsqueeze.default, aten.squeeze.dim, aten.view.default, aten.reshape.default,
                 aten.clone.default, aten.alias.default, aten.expand.default, aten.cat.default}


@dataclass(frozen=True)
class HaloRoot:
    """A node whose left padding along time becomes a halo of ``width`` steps."""

    node: str
    source: str  # the full-length input whose last steps are exchanged
    width: int
    time_dim: int
    fill: float


def plan_halo(comp: Component, by_name: dict[str, fx.Node], tl: TimeLocality, classes: dict[str, str]
              ) -> Optional[list[HaloRoot]]:
    """The halo roots of a window component, or ``None`` if it is not a causal window."""
    roots: list[HaloRoot] = []
    names = set(comp.nodes)
    for m in comp.nodes:
        n = by_name[m]
        if n.target in _PADS or n.target in _CONVS:
            root = _root(n, tl)  # its input must be full-length (a layout member is fine)
            if root is None or classes.get(root.source) != NORMAL:
                return None
            roots.append(root)
        elif n.target in _PASS_THROUGH or _pointwise(n):
            continue
        else:
            return None
    for out in comp.outputs:  # what the window feeds must not read the future
        for u in by_name[out].users:
            if u.name not in names and u.op != "output":
                info = tl.info.get(u.name)
                if info is None or info.reach is None or info.reach.hi > 0:
                    return None
    return roots or None


def _pointwise(n: fx.Node) -> bool:
    return n.op == "call_function" and torch.Tag.pointwise in getattr(n.target, "tags", ())


def _root(n: fx.Node, tl: TimeLocality) -> Optional[HaloRoot]:
    x = n.args[0]
    td = tl.time_dim(x) if isinstance(x, fx.Node) else None
    if td is None:
        return None
    nd = len(x.meta["val"].shape)
    if n.target in _PADS:
        if n.target is aten.pad.default and (len(n.args) > 2 and n.args[2] != "constant"):
            return None
        pads = list(n.args[1])
        k = nd - 1 - td
        left = pads[2 * k] if 2 * k < len(pads) else 0
        right = pads[2 * k + 1] if 2 * k + 1 < len(pads) else 0
        value = n.args[2] if n.target is aten.constant_pad_nd.default and len(n.args) > 2 else (
            n.args[3] if len(n.args) > 3 and n.args[3] is not None else 0.0)
        if left <= 0 or right > 0:  # right padding would read (zeros) past the slice's end
            return None
        return HaloRoot(n.name, x.name, int(left), td, float(value))
    if td != nd - 1:
        return None
    if n.target is aten.conv1d.default:
        stride, padding = _arg(n, 3, 1), _arg(n, 4, 0)
    else:
        stride, padding = n.args[3], n.args[4]
        if n.args[6]:  # transposed
            return None
    pick = lambda v: v[-1] if isinstance(v, (list, tuple)) else v  # noqa: E731
    stride, padding = pick(stride), pick(padding)
    if isinstance(padding, str) or stride != 1 or padding <= 0:
        return None
    return HaloRoot(n.name, x.name, int(padding), td, 0.0)


def _arg(n: fx.Node, pos: int, default: Any) -> Any:
    return n.args[pos] if len(n.args) > pos else default


def _meta(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device="meta")


def apply_halo(gm: fx.GraphModule, nodes: dict[str, fx.Node], root: HaloRoot, halo_id: int,
               group: LaspGroup) -> str:
    """Rewrite one halo root in ``gm`` (see the module doc); returns a note."""
    if group.world_size > 1 and min(group.lengths[:-1]) < root.width:
        raise node_error(nodes[root.node], f"it needs the previous {root.width} step(s) but a rank holds only "
                         f"{min(group.lengths[:-1])} (local lengths {group.lengths})",
                         "use fewer ranks or a longer sequence")
    graph = gm.graph
    n, x = nodes[root.node], nodes[root.source]
    xv = x.meta["val"]
    site = f"lasp_halo_{halo_id}"
    mod = LaspHalo(site, halo_id, group, root.width, root.time_dim, root.fill)
    gm.add_submodule(site, mod)
    halo_shape = list(xv.shape)
    halo_shape[root.time_dim] = root.width
    with graph.inserting_before(n):
        halo = graph.call_module(site, (x,))
        halo.meta["val"] = _meta(tuple(halo_shape), xv)
    if n.target in _PADS:
        nd = len(xv.shape)
        pads = list(n.args[1])
        pads[2 * (nd - 1 - root.time_dim)] = 0
        with graph.inserting_before(n):
            body = x
            if any(pads):
                body = graph.call_function(aten.constant_pad_nd.default, (x, pads, root.fill))
                shape = list(xv.shape)
                for i in range(len(pads) // 2):
                    shape[nd - 1 - i] += pads[2 * i] + pads[2 * i + 1]
                body.meta["val"] = _meta(tuple(shape), xv)
            new = graph.call_function(aten.cat.default, ([halo, body], root.time_dim))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        return f"{root.node}: pad of {root.width} step(s) along time -> halo from the previous rank ({site})"
    p = root.width
    with graph.inserting_before(n):
        right = graph.call_function(aten.constant_pad_nd.default, (x, [0, p], 0.0))
        right.meta["val"] = _meta((*xv.shape[:-1], xv.shape[-1] + p), xv)
        ext = graph.call_function(aten.cat.default, ([halo, right], -1))
        ext.meta["val"] = _meta((*xv.shape[:-1], xv.shape[-1] + 2 * p), xv)
    args = list(n.args)
    args[0] = ext
    if n.target is aten.conv1d.default:
        while len(args) < 5:
            args.append(None if len(args) == 2 else [1])
        args[4] = [0]
    else:
        args[4] = [0]
    n.args = tuple(args)
    return f"{root.node}: causal convolution reading {p} earlier step(s) -> halo from the previous rank ({site})"


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mod: "LaspHalo") -> torch.Tensor:  # type: ignore[override]
        g, w, td = mod.group, mod.width, mod.time_dim
        comm, tag = g.comm, HALO_TAG_BASE + 2 * mod.halo_id
        t = x.shape[td]
        shape = list(x.shape)
        shape[td] = w
        recv = send = None
        if g.rank > 0:
            buf = torch.empty(shape, dtype=x.dtype, device=x.device)
            recv = comm.irecv(buf, g.rank - 1, tag=tag, label=f"{mod.site}.halo",
                              description=f"the halo of {mod.site}")
        if g.rank < g.world_size - 1:
            send = comm.isend(x.detach().narrow(td, t - w, w).contiguous(), g.rank + 1, tag=tag,
                              label=f"{mod.site}.halo", description=f"the halo of {mod.site}")
        out = recv.wait() if recv is not None else torch.full(shape, mod.fill, dtype=x.dtype, device=x.device)
        if send is not None:
            send.wait()
        ctx.mod, ctx.shape = mod, tuple(x.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        mod = ctx.mod
        g, w, td = mod.group, mod.width, mod.time_dim
        comm, tag = g.comm, HALO_TAG_BASE + 2 * mod.halo_id + 1
        t = ctx.shape[td]
        recv = send = None
        if g.rank < g.world_size - 1:
            shape = list(ctx.shape)
            shape[td] = w
            buf = torch.empty(shape, dtype=grad.dtype, device=grad.device)
            recv = comm.irecv(buf, g.rank + 1, tag=tag, label=f"{mod.site}.dhalo",
                              description=f"the halo gradient of {mod.site}")
        if g.rank > 0:
            send = comm.isend(grad.contiguous(), g.rank - 1, tag=tag, label=f"{mod.site}.dhalo",
                              description=f"the halo gradient of {mod.site}")
        dx = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        if recv is not None:
            dx.narrow(td, t - w, w).copy_(recv.wait())
        if send is not None:
            send.wait()
        return dx, None


class LaspHalo(nn.Module):
    """The last ``width`` steps of the previous rank's ``x`` (rank 0: ``fill``)."""

    def __init__(self, site: str, halo_id: int, group: LaspGroup, width: int, time_dim: int, fill: float) -> None:
        super().__init__()
        self.site, self.halo_id, self.group = site, halo_id, group
        self.width, self.time_dim, self.fill = width, time_dim, fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Halo.apply(x, self)

    def extra_repr(self) -> str:
        return f"width={self.width}, time_dim={self.time_dim}"

    def stages(self) -> list[Stage]:
        g = self.group
        note_prev = "from rank " + str(g.rank - 1) if g.rank > 0 else "none on rank 0 (padding value)"
        note_next = "to rank " + str(g.rank + 1) if g.rank < g.world_size - 1 else "none on the last rank"
        s = self.site
        return [
            Stage(f"{s}:exchange", "recv", "forward", s, kernel="p2p:isend+irecv",
                  note=f"last {self.width} step(s) of the input {note_prev}; own last steps {note_next}"),
            Stage(f"{s}:exchange_backward", "send", "backward", s, kernel="p2p:isend+irecv",
                  note=f"halo gradient back to the rank it came from (tag {HALO_TAG_BASE + 2 * self.halo_id + 1})"),
        ]
