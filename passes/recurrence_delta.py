"""Rewrite the chunked gated delta rule (Qwen3-Next, Gated DeltaNet) as one dense scan per layer.

The gated delta rule carries a matrix state ``S`` (``dk x dv`` per head)::

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,        o_t = S_tᵀ q_t

a dense linear recurrence along time (``A_t = exp(g_t) (I - β_t k_t k_tᵀ)``). Hugging Face's
``torch_chunk_gated_delta_rule`` computes it in blocks of ``L`` (64) steps: the inputs are
padded to a multiple of ``L`` and reshaped to ``(..., blocks, L, d)``, each block solves a
unitriangular system (the UT transform) for all blocks at once, and a Python loop over the
blocks carries ``S``; the block outputs are stacked, merged back to time and the padding
sliced off. Unrolled by tracing, no analysis can follow time through that form (time is
split over the block and the step-in-block axes, and the solve runs along the steps), so
the plans refused the layer. This pass finds the region from its structure and proves what
it computes, as :mod:`.recurrence_lightning` does for lightning attention::

    region:  q, k, v, β, g (..., T, ...)  --pad to a multiple of L--> ... block solve, loop
             over blocks carrying S ... --stack(block outputs)--> reshape --slice [:T]--> o
    after:   A = exp(g)[..., None, None] * (I - (β k)[..., :, None] * k[..., None, :])
             U = (β k)[..., :, None] * v[..., None, :]
             o = einsum("bthk,bthkv->bthv", q, dense_linear_scan(A, U))   (time moved to dim 1)

A region is every node between zero ``pad`` s that extend a full-length tensor to the
blocked length and the exit (the block ``stack``, the reshape merging blocks back to time,
and the ``slice`` dropping the padding): five sources, every other input computed from
grad-free parameters, buffers and constants only, and no block value used outside (the
final state, when the model returns it, keeps the region as it is). Which source plays q, k,
v, β or g is found by evaluating the region on random inputs in float64 and comparing it with
the step recurrence for every assignment the shapes allow; nothing is rewritten unless one
matches. The rewrite holds no block size: every plan then sees a recurrence along the real
time axis (adjoint shards, chunks and truncation windows of any size, no block alignment),
at the cost of forming ``A_t`` (``dk x dk`` per step and head) where the blocked form
solves a ``L x L`` system per block.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.dims import shape_of
from gradshard.fake import fake_run
from gradshard.pipeline import PassContext, PassResult, ancestors, descendants, graph_pass

from gradshard.passes.recurrence_graph import copy_graph_module, emit_node, live_nodes, time_from_dim1, time_to_dim1
from gradshard.passes.region_proof import (constant_value, exact_arithmetic, grad_free_constant, is_data, proof_tolerance,
                                           region_subgraph, to_f64)

aten = torch.ops.aten

__all__ = ["DeltaRuleRegion", "delta_rule_reference", "match_delta_rule_blocks", "rewrite_delta_rule_blocks"]

_PADS = (aten.pad.default, aten.constant_pad_nd.default)
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_ROLES = ("q", "k", "v", "beta", "g")
#: Elements the proof may evaluate (the region's node values summed), a bound on its cost.
_MAX_EVAL_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class DeltaRuleRegion:
    """A proven blocked gated-delta-rule region: its sources by role, the time dim they share
    (every source has it at ``time_dim``; q, k, v carry a feature dim last), its exit."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    beta: fx.Node
    g: fx.Node
    time_dim: int
    exit: fx.Node
    nodes: frozenset[fx.Node]
    blocks: int
    block_len: int


@dataclass(frozen=True)
class _Region:
    sources: tuple[fx.Node, ...]
    time_dim: int
    nodes: frozenset[fx.Node]
    consts: tuple[fx.Node, ...]


# --------------------------------------------------------------------------- reference


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         g: torch.Tensor) -> torch.Tensor:
    """The gated delta rule step by step, time at dim 1: ``q, k (B, T, *H, dk)``, ``v (B, T, *H,
    dv)``, ``beta, g (B, T, *H)`` -> ``o (B, T, *H, dv)`` (zero initial state)."""
    S = q.new_zeros((q.shape[0], *q.shape[2:-1], k.shape[-1], v.shape[-1]))
    out = []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, ..., None]
        kS = torch.einsum("...k,...kv->...v", kt, S)
        S = g[:, t, ..., None, None].exp() * (S - (bt * kt)[..., :, None] * kS[..., None, :]) \
            + (bt * kt)[..., :, None] * v[:, t, ..., None, :]
        out.append(torch.einsum("...k,...kv->...v", q[:, t], S))
    return torch.stack(out, 1)


# --------------------------------------------------------------------------- structure


def _single_live_user(node: fx.Node, live: set[fx.Node]) -> Optional[fx.Node]:
    users = [u for u in node.users if u in live]
    return users[0] if len(users) == 1 else None


def _exit_of(stack: fx.Node, live: set[fx.Node]) -> Optional[tuple[fx.Node, int, int, int, int]]:
    """``(exit, time dim, blocks, block length, T)`` of a block ``stack`` -> merging reshape ->
    optional ``slice [:T]`` (or ``alias``) chain, else None."""
    if stack.op != "call_function" or stack.target is not aten.stack.default or stack not in live:
        return None
    shp = shape_of(stack)
    if not shp or len(shp) < 3:
        return None
    dim = (stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)) % len(shp)
    if dim + 1 >= len(shp) - 1 or dim == 0:
        return None
    blocks, block_len = shp[dim], shp[dim + 1]
    merge = _single_live_user(stack, live)
    if merge is None or merge.target not in _RESHAPES:
        return None
    want = (*shp[:dim], blocks * block_len, *shp[dim + 2:])
    if tuple(shape_of(merge) or ()) != want:
        return None
    exit_, length = merge, blocks * block_len
    nxt = _single_live_user(merge, live)
    if nxt is not None and nxt.target is aten.alias.default:
        exit_ = nxt
    elif nxt is not None and nxt.target is aten.slice.Tensor:
        args = list(nxt.args) + [None] * (5 - len(nxt.args))
        if (args[1] % len(want) == dim and args[2] in (0, None) and isinstance(args[3], int)
                and args[4] in (1, None) and shape_of(nxt)[dim] > length - block_len):
            exit_, length = nxt, shape_of(nxt)[dim]
    return exit_, dim, blocks, block_len, length


def _padded_dim(pad: fx.Node, length: int, padded: int) -> Optional[int]:
    """The dim a zero ``pad`` node extends from ``length`` to ``padded`` at its end (the outermost
    dim its pad list names; every other entry zero), else None."""
    if pad.op != "call_function" or pad.target not in _PADS or not isinstance(pad.args[0], fx.Node):
        return None
    widths = pad.args[1] if len(pad.args) > 1 else pad.kwargs.get("pad")
    mode = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("mode", "constant")
    value = pad.args[3] if len(pad.args) > 3 else pad.kwargs.get("value")
    if pad.target is aten.constant_pad_nd.default:
        mode, value = "constant", pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0)
    if mode != "constant" or value not in (None, 0, 0.0) or not isinstance(widths, (list, tuple)):
        return None
    if len(widths) % 2 or not widths or not all(isinstance(w, int) for w in widths):
        return None
    shp = shape_of(pad.args[0])
    rank = len(shp or ())
    dim = rank - len(widths) // 2
    if dim < 1 or any(widths[:-1]) or shp[dim] != length or widths[-1] != padded - length:
        return None
    return dim


def _region_of(exit_: fx.Node, dim: int, padded: int, length: int, live: set[fx.Node],
               values: dict[str, Any]) -> Optional[_Region]:
    """The nodes between the sources' pads and ``exit_`` (see the module doc)."""
    above = ancestors([exit_])
    pads: dict[fx.Node, list[fx.Node]] = {}
    dims: dict[fx.Node, int] = {}
    for n in (n for n in exit_.graph.nodes if n in above):  # graph order: deterministic
        d = _padded_dim(n, length, padded)
        if d is None or grad_free_constant(n.args[0], values):
            continue
        pads.setdefault(n.args[0], []).append(n)
        dims[n.args[0]] = d
    below = {s: descendants(p, above.__contains__) for s, p in pads.items()}
    # an earlier layer's sources, padded the same way, feed this layer's: not part of this region
    sources = [s for s in pads if not any(o in below[s] for o in pads if o is not s)]
    if len(sources) != len(_ROLES) or len({dims[s] for s in sources}) != 1:
        return None
    td = dims[sources[0]]
    rank = max(len(shape_of(s)) for s in sources)
    if td > rank - 2 or any(len(shape_of(s)) not in (rank, rank - 1) for s in sources):
        return None  # q, k, v have a feature dim after time; β and g end at time
    nodes = set().union(*(below[s] for s in sources))
    if exit_ not in nodes:
        return None
    for n in nodes - {exit_}:
        if any(u not in nodes for u in n.users if u in live):
            return None  # a block value leaves the region another way (e.g. the final state)
    order = {n: i for i, n in enumerate(exit_.graph.nodes)}
    entries = {p for s in sources for p in pads[s]}
    consts: list[fx.Node] = []
    for n in sorted(nodes, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a in nodes or (n in entries and a is n.args[0]) or a in consts:
                continue
            if not grad_free_constant(a, values):
                return None
            consts.append(a)
    sources.sort(key=order.__getitem__)
    return _Region(tuple(sources), td, frozenset(nodes), tuple(consts))


# --------------------------------------------------------------------------- proof


def _assignments(region: _Region, out_shape: tuple[int, ...]) -> list[dict[str, int]]:
    """Role -> source index for every assignment the shapes allow."""
    shapes = [tuple(shape_of(s)) for s in region.sources]
    out = []
    for perm in itertools.permutations(range(len(_ROLES))):
        r = dict(zip(_ROLES, perm))
        q, k, v, b, g = (shapes[r[x]] for x in _ROLES)
        if q != k or v != out_shape or q[:-1] != v[:-1] or b != q[:-1] or g != b:
            continue
        out.append(r)
    return out


def _random_sources(region: _Region, gen: torch.Generator) -> list[torch.Tensor]:
    """Float64 inputs in the ranges the roles take (unit-norm-ish keys, β in (0, 1), decays
    ``g <= 0``), distinct enough that a wrong assignment cannot match."""
    rank = max(len(shape_of(s)) for s in region.sources)
    vals, small = [], []
    for i, s in enumerate(region.sources):
        shp = shape_of(s)
        if len(shp) == rank:
            vals.append(torch.randn(shp, generator=gen, dtype=torch.float64) / math.sqrt(shp[-1]))
        else:
            vals.append(torch.rand(shp, generator=gen, dtype=torch.float64))
            small.append(i)
    # the two time-only sources: one in (0.1, 0.9) (a β), one in (-0.5, -0.05) (a log decay)
    if len(small) == 2:
        vals[small[0]] = 0.1 + 0.8 * vals[small[0]]
        vals[small[1]] = -0.05 - 0.45 * vals[small[1]]
    return vals


def _canonical(x: torch.Tensor, td: int) -> torch.Tensor:
    return x.movedim(td, 1)


def _prove(gm: fx.GraphModule, region: _Region, exit_: fx.Node, known: dict[str, torch.Tensor]
           ) -> Optional[dict[str, int]]:
    """Role -> source index for which the region equals :func:`delta_rule_reference`, or None."""
    out_shape = tuple(shape_of(exit_) or ())
    options = _assignments(region, out_shape)
    if not options or not all(s.meta["val"].is_floating_point() for s in region.sources):
        return None
    if sum(math.prod(shape_of(n) or (0,)) for n in region.nodes) > _MAX_EVAL_ELEMENTS:
        return None
    memo: dict[fx.Node, Any] = {}
    consts = [constant_value(c, known, memo) for c in region.consts]
    if any(c is None for c in consts):
        return None
    tol = proof_tolerance(consts)
    if tol is None:
        return None
    gen = torch.Generator().manual_seed(20261216)
    td = region.time_dim
    for flip in (False, True):  # which time-only source gets β's range and which g's
        src = _random_sources(region, gen)
        if flip:
            small = [i for i, s in enumerate(src) if s.dim() < max(x.dim() for x in src)]
            src[small[0]], src[small[1]] = src[small[1]], src[small[0]]
        try:
            with exact_arithmetic():  # in float64: the proof does not depend on the model's dtype or casts
                run = region_subgraph(gm, (*region.sources, *region.consts), region.nodes, exit_)
                got = run(*src, *[to_f64(c) for c in consts])
        except Exception:  # noqa: BLE001 - a region that does not run on its own is not claimed
            return None
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != out_shape or not torch.isfinite(got).all():
            return None
        got = _canonical(got, td)
        for roles in options:
            if src[roles["beta"]].min() <= 0 or src[roles["g"]].max() >= 0:
                continue  # try only the assignment that gets β and g their ranges
            with exact_arithmetic():
                want = delta_rule_reference(*(_canonical(src[roles[x]], td) for x in _ROLES))
            scale = float(want.abs().max())
            if scale > 0 and float((got - want).abs().max()) <= tol * scale:
                return roles
    return None


def match_delta_rule_blocks(gm: fx.GraphModule, values: dict[str, Any]) -> list[DeltaRuleRegion]:
    """Every proven blocked gated-delta-rule region of ``gm`` (see the module doc).

    ``values``: placeholder name -> example value (parameters and buffers are read from it).
    """
    live = live_nodes(gm)
    data = {p.name for p in gm.graph.find_nodes(op="placeholder") if is_data(p)}
    known = {n: v for n, v in values.items()
             if isinstance(v, torch.Tensor) and not v.requires_grad and n not in data}
    found: list[DeltaRuleRegion] = []
    claimed: set[fx.Node] = set()
    for stack in list(gm.graph.nodes):
        chain = _exit_of(stack, live) if stack not in claimed else None
        if chain is None:
            continue
        exit_, _dim, blocks, block_len, length = chain
        region = _region_of(exit_, _dim, blocks * block_len, length, live, values)
        if region is None or region.nodes & claimed:
            continue
        roles = _prove(gm, region, exit_, known)
        if roles is None:
            continue
        q, k, v, beta, g = (region.sources[roles[x]] for x in _ROLES)
        found.append(DeltaRuleRegion(q, k, v, beta, g, region.time_dim, exit_, region.nodes, blocks, block_len))
        claimed |= region.nodes
    return found


# --------------------------------------------------------------------------- rewrite


def _emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict, trace: Any) -> fx.Node:
    n = graph.call_function(target, args, kwargs)
    n.meta["val"] = fake_run(target, args, kwargs)
    if trace:
        n.meta["stack_trace"] = trace
    return n


def _emit_scan(graph: fx.Graph, r: DeltaRuleRegion, trace: Any) -> tuple[fx.Node, fx.Node]:
    """``(o, h)``: the step recurrence of ``r`` written as one dense scan and its readout."""
    q, k, v, beta, g = (time_to_dim1(graph, x, r.time_dim, x.meta["val"].dim(), trace)
                        for x in (r.q, r.k, r.v, r.beta, r.g))
    un = lambda x, d: emit_node(graph, aten.unsqueeze.default, (x, d), trace)  # noqa: E731
    kb = emit_node(graph, aten.mul.Tensor, (k, un(beta, -1)), trace)
    kb_col = un(kb, -1)
    outer = emit_node(graph, aten.mul.Tensor, (kb_col, un(k, -2)), trace)
    val = k.meta["val"]
    eye = _emit(graph, aten.eye.default, (val.shape[-1],), {"dtype": val.dtype, "device": val.device}, trace)
    decay = un(un(emit_node(graph, aten.exp.default, (g,), trace), -1), -1)
    A = emit_node(graph, aten.mul.Tensor, (emit_node(graph, aten.sub.Tensor, (eye, outer), trace), decay), trace)
    U = emit_node(graph, aten.mul.Tensor, (kb_col, un(v, -2)), trace)
    h = emit_node(graph, torch.ops.gradshard.dense_linear_scan.default, (A, U, None), trace)
    h.meta["gs_written_as"] = "chunked gated delta rule"
    lead = "abcdefghij"[:q.meta["val"].dim() - 1]
    o = emit_node(graph, aten.einsum.default, (f"{lead}y,{lead}yz->{lead}z", [q, h]), trace)
    return time_from_dim1(graph, o, r.time_dim, o.meta["val"].dim(), trace), h


def rewrite_delta_rule_regions(gm: fx.GraphModule, values: dict[str, Any]) -> list[str]:
    """Replace every proven blocked gated-delta-rule region of ``gm`` (in place) by one dense scan
    and its readout; the notes name each region."""
    notes = []
    for r in match_delta_rule_blocks(gm, values):
        trace = r.exit.meta.get("stack_trace")
        with gm.graph.inserting_before(r.exit):
            o, h = _emit_scan(gm.graph, r, trace)
            dtype = r.exit.meta["val"].dtype
            if o.meta["val"].dtype != dtype:
                o = emit_node(gm.graph, aten.to.dtype, (o, dtype), trace)
        r.exit.replace_all_uses_with(o)
        notes.append(f"chunked gated delta rule ({r.blocks} blocks of {r.block_len}, {len(r.nodes)} nodes, "
                     f"exit {r.exit.name}) -> {h.name} (q={r.q.name}, k={r.k.name}, v={r.v.name}, "
                     f"beta={r.beta.name}, g={r.g.name})")
    if notes:
        gm.graph.eliminate_dead_code()
    return notes


def _worth_matching(gm: fx.GraphModule) -> bool:
    """Cheap screen: a ``stack`` and at least five ``pad`` nodes."""
    pads = sum(1 for t in _PADS for _ in gm.graph.find_nodes(op="call_function", target=t))
    return pads >= len(_ROLES) and bool(gm.graph.find_nodes(op="call_function", target=aten.stack.default))


@graph_pass
def rewrite_delta_rule_blocks(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite the blocked gated delta rule as one dense scan per layer (see module doc).

    Runs before the time analysis: the analysis then sees a recurrence along time.
    """
    if not _worth_matching(gm):
        return PassResult(gm, notes=("no blocked gated delta rule",))
    new = copy_graph_module(gm)
    placeholders = new.graph.find_nodes(op="placeholder")
    notes = rewrite_delta_rule_regions(new, {p.name: v for p, v in zip(placeholders, ctx.example_inputs or ())})
    if not notes:
        return PassResult(gm, notes=("no blocked gated delta rule",))
    new.graph.lint()
    new.recompile()
    return PassResult(new, changed=True, notes=tuple(notes))
