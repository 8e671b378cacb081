"""Rewrite a chunked state-space-duality scan (Mamba-2's SSD) as ``gradshard::linear_scan``.

SSD computes ``h_t = exp(a_t) h_{t-1} + x_t B_t^T`` (a scalar log-decay ``a`` per head, state
``(head_dim, d_state)``) and ``y_t = h_t C_t`` blockwise: time is padded and reshaped into
``(chunks, chunk_len)``; inside a chunk a ``segsum`` decay matrix acts like a causal mask,
across chunks a second ``segsum`` carries the chunk states. Written out in a model (the
``torch_forward`` of Hugging Face's Mamba-2 and of every SSD hybrid) no analysis can follow
time through the blocks, so plans refuse the layer. This pass finds such a block region
from its shape alone and proves what it computes::

    region:  x, a, B, C   (batch, T', ...)  --reshape-->  (batch, chunks, chunk_len, ...)
             ... segsum, einsums, cumsums over both block axes ...
             --reshape-->  y (batch, T', heads, head_dim)
    after:   y = einsum("blhpn,blhn->blhp", linear_scan(exp(a)[..., None, None],
                                                          x[..., None] * B[..., None, :]), C)

A region is the set of nodes between reshapes that split a time axis into blocks and the one
reshape that merges the blocks back; its only other inputs must be constants. Which input
plays which role is found by shape (the log-decay has one dim less) and confirmed
numerically: the region is evaluated on random inputs and compared with the scan for each
candidate assignment. Nothing is rewritten unless one assignment matches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from gradshard.analysis.consts import evaluate_constant
from gradshard.analysis.dims import shape_of
from gradshard.pipeline import ancestors

from gradshard.passes.recurrence_graph import emit_node
from gradshard.passes.region_proof import exact_arithmetic, region_subgraph

aten = torch.ops.aten

__all__ = ["SsdRegion", "match_ssd_regions", "rewrite_ssd_regions"]

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


@dataclass(frozen=True)
class SsdRegion:
    """A proven SSD block region: its inputs by role, its exit and its nodes."""

    x: fx.Node  # (batch, T', heads, head_dim)
    log_a: fx.Node  # (batch, T', heads)
    B: fx.Node  # (batch, T', heads, d_state)
    C: fx.Node  # (batch, T', heads, d_state)
    exit: fx.Node  # (batch, T', heads, head_dim) or a reshape of it
    nodes: frozenset[fx.Node]


def _splits_time(node: fx.Node, time_dims: dict[str, tuple[int, ...]]) -> Optional[tuple[int, int]]:
    """``(chunks, chunk_len)`` if ``node`` reshapes a time dim 1 into two block dims."""
    if node.op != "call_function" or node.target not in _RESHAPES or not isinstance(node.args[0], fx.Node):
        return None
    src, out = shape_of(node.args[0]), shape_of(node)
    if src is None or out is None or len(src) < 2 or len(out) != len(src) + 1:
        return None
    if 1 not in time_dims.get(node.args[0].name, ()):
        return None
    c, l = out[1], out[2]
    if c * l != src[1] or l < 2 or out[0] != src[0] or out[3:] != src[2:]:
        return None
    return c, l


def _merges_blocks(node: fx.Node, blocks: tuple[int, int]) -> bool:
    """``node`` reshapes ``(batch, chunks, chunk_len, ...)`` back to ``(batch, T', ...)``."""
    if node.op != "call_function" or node.target not in _RESHAPES:
        return False
    src, out = shape_of(node.args[0]), shape_of(node)
    c, l = blocks
    return (src is not None and out is not None and len(src) >= 3 and src[1:3] == (c, l)
            and len(out) >= 2 and out[0] == src[0] and out[1] == c * l)


def _downstream(entries: list[fx.Node], blocks: tuple[int, int]) -> tuple[set[fx.Node], set[fx.Node]]:
    """Nodes reachable from ``entries`` without passing a merge back to time, and those merges."""
    down: set[fx.Node] = set()
    exits: set[fx.Node] = set()
    stack = list(entries)
    while stack:
        n = stack.pop()
        if n in down:
            continue
        down.add(n)
        if n not in entries and _merges_blocks(n, blocks):
            exits.add(n)
            continue
        stack.extend(u for u in n.users if u.op == "call_function")
    return down, exits


def _exit_of(split: fx.Node, blocks: tuple[int, int]) -> Optional[fx.Node]:
    """The one merge back to time downstream of ``split`` (None if zero or several)."""
    exits = _downstream([split], blocks)[1]
    return next(iter(exits)) if len(exits) == 1 else None


def _region(entries: list[fx.Node], blocks: tuple[int, int]) -> Optional[tuple[set[fx.Node], fx.Node]]:
    """Nodes downstream of ``entries`` up to the one merge back to time, or None."""
    down, exits = _downstream(entries, blocks)
    if len(exits) != 1:
        return None
    exit_node = next(iter(exits))
    # keep what the exit needs (drops side branches such as a final state nobody reads)
    need: set[fx.Node] = set()
    stack = [exit_node]
    while stack:
        n = stack.pop()
        if n in need or n not in down:
            continue
        need.add(n)
        stack.extend(n.all_input_nodes)
    for n in need - {exit_node}:
        if any(u not in need for u in n.users):
            return None  # a block value leaves the region another way (e.g. the final state)
    return need, exit_node


def _external_inputs(nodes: set[fx.Node], entries: list[fx.Node]) -> Optional[list[fx.Node]]:
    """The pre-reshape inputs of the entries; None if anything else non-constant flows in."""
    sources: list[fx.Node] = []
    for e in entries:
        src = e.args[0]
        if src not in sources:
            sources.append(src)
    for n in nodes:
        for a in n.all_input_nodes:
            if a in nodes or a in sources:
                continue
            if evaluate_constant(a) is None:
                return None
    return sources


def _reference(x: torch.Tensor, log_a: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    from gradshard.kernels import linear_scan

    states = linear_scan(torch.exp(log_a)[..., None, None], x[..., :, None] * B[..., None, :])
    return torch.einsum("blhpn,blhn->blhp", states, C)


def _assign_roles(gm: fx.GraphModule, exit_node: fx.Node,
                  sources: list[fx.Node]) -> Optional[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """``(x, log_a, B, C)`` among ``sources`` such that the region computes the SSD scan."""
    shapes = [shape_of(s) for s in sources]
    if len(sources) != 4 or any(s is None for s in shapes):
        return None
    decay = [s for s, sh in zip(sources, shapes) if len(sh) == 3]
    rest = [s for s, sh in zip(sources, shapes) if len(sh) == 4]
    if len(decay) != 1 or len(rest) != 3:
        return None
    log_a = decay[0]
    out_shape = shape_of(exit_node)
    # the region as a callable of its sources, constants recomputed inside; in float64, through
    # any cast (autocast's around the einsums)
    src = set(sources)
    sub = region_subgraph(gm, sources, ancestors([exit_node], within=lambda n: n not in src), exit_node)
    gen = torch.Generator().manual_seed(0)
    vals = {s: torch.randn(shape_of(s), generator=gen, dtype=torch.float64) for s in rest}
    vals[log_a] = -0.5 * torch.rand(shape_of(log_a), generator=gen, dtype=torch.float64)
    try:
        with exact_arithmetic():
            got = sub(*[vals[s] for s in sources])
    except Exception:  # noqa: BLE001 - a region that does not run on its own is not an SSD region
        return None
    tol = 1e-9
    for x, Bn, Cn in itertools.permutations(rest):
        sx, sb, sc, sa = shape_of(x), shape_of(Bn), shape_of(Cn), shape_of(log_a)
        if sb != sc or sx[:3] != sa or sb[:3] != sa:
            continue
        with exact_arithmetic():
            want = _reference(vals[x], vals[log_a], vals[Bn], vals[Cn])
        if want.numel() != got.numel():
            continue
        want = want.reshape(out_shape)
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))
        if err <= tol:
            return x, log_a, Bn, Cn
    return None


_PADS = (aten.constant_pad_nd.default, aten.pad.default)


def _right_zero_pad(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """``(x, n)`` if ``node`` pads ``x`` with ``n`` zeros after the end of dim 1 only."""
    if node.op != "call_function" or node.target not in _PADS or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
        if mode != "constant":
            return None
    else:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
    spec, rank = list(node.args[1]), len(shape_of(node) or ())
    k = rank - 2  # pads are given from the last dim backwards; dim 1 is pair k
    if value not in (None, 0, 0.0) or len(spec) < 2 * k + 2 or spec[2 * k] != 0:
        return None
    if any(v != 0 for i, v in enumerate(spec) if i not in (2 * k, 2 * k + 1)):
        return None
    return node.args[0], int(spec[2 * k + 1])


def _unpad(r: SsdRegion) -> Optional[tuple[tuple[fx.Node, fx.Node, fx.Node, fx.Node], int]]:
    """The unpadded sources and the pad length, if every source is the same right zero-pad of
    dim 1 (the block alignment): the scan then runs over the real steps only."""
    pads = [_right_zero_pad(s) for s in (r.x, r.log_a, r.B, r.C)]
    if any(p is None for p in pads) or len({p[1] for p in pads}) != 1 or pads[0][1] == 0:
        return None
    return tuple(p[0] for p in pads), pads[0][1]


def match_ssd_regions(gm: fx.GraphModule, time_dims: dict[str, tuple[int, ...]]) -> list[SsdRegion]:
    """Every SSD block region of ``gm`` (see the module doc), proven numerically."""
    by_blocks: dict[tuple[int, int, int], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        blocks = _splits_time(node, time_dims)
        if blocks is not None:
            by_blocks.setdefault((blocks[0], blocks[1], shape_of(node)[0]), []).append(node)
    found: list[SsdRegion] = []
    for (c, l, _b), splits in by_blocks.items():
        by_exit: dict[fx.Node, list[fx.Node]] = {}
        for split in splits:  # the splits feeding one merge back to time form one region
            exit_node = _exit_of(split, (c, l))
            if exit_node is not None:
                by_exit.setdefault(exit_node, []).append(split)
        for exit_node, entries in by_exit.items():
            region = _region(entries, (c, l))
            if region is None or region[1] is not exit_node:
                continue
            nodes = region[0]
            sources = _external_inputs(nodes, entries)
            roles = _assign_roles(gm, exit_node, sources) if sources is not None else None
            if roles is not None:
                found.append(SsdRegion(*roles, exit=exit_node, nodes=frozenset(nodes)))
    return found


def rewrite_ssd_regions(gm: fx.GraphModule, time_dims: dict[str, tuple[int, ...]]) -> list[str]:
    """Replace every proven SSD region by one scan and its readout; one note per region."""
    notes = []
    for r in match_ssd_regions(gm, time_dims):
        graph, trace = gm.graph, r.exit.meta.get("stack_trace")
        unpadded = _unpad(r)
        x, log_a, B, C = unpadded[0] if unpadded else (r.x, r.log_a, r.B, r.C)
        with graph.inserting_before(r.exit):
            a = emit_node(graph, aten.exp.default, (log_a,), trace)
            a = emit_node(graph, aten.unsqueeze.default, (emit_node(graph, aten.unsqueeze.default, (a, -1), trace), -1),
                          trace)
            u = emit_node(graph, aten.mul.Tensor, (emit_node(graph, aten.unsqueeze.default, (x, -1), trace),
                                                   emit_node(graph, aten.unsqueeze.default, (B, -2), trace)), trace)
            h = emit_node(graph, torch.ops.gradshard.linear_scan.default, (a, u, None, False, None), trace)
            y = emit_node(graph, aten.einsum.default, ("blhpn,blhn->blhp", [h, C]), trace)
            if unpadded:  # C is zero on the padded steps, so y is too
                y = emit_node(graph, aten.constant_pad_nd.default, (y, [0, 0, 0, 0, 0, unpadded[1]], 0.0), trace)
            if shape_of(y) != shape_of(r.exit):
                y = emit_node(graph, aten.reshape.default, (y, list(shape_of(r.exit))), trace)
        r.exit.replace_all_uses_with(y)
        notes.append(f"SSD block scan ({len(r.nodes)} nodes, exit {r.exit.name}) -> {h.name} "
                     f"(x={r.x.name}, log_a={r.log_a.name}, B={r.B.name}, C={r.C.name})")
    if notes:
        gm.graph.eliminate_dead_code()
    return notes
