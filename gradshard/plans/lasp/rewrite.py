"""rewrite_lasp: run every linear-attention layer sequence-parallel (LASP) over the group.

Each detected region (see :mod:`gradshard.passes.detect_linear_attention`) is replaced by
one ``call_module`` node on a :class:`~gradshard.plans.lasp.modules.LaspAttentionRegion`
that calls :func:`gradshard.plans.lasp.runtime.lasp_attention` with a layer id (regions numbered in
graph order, identical on every rank)::

    before:  matmul = q @ k^T;  mul = matmul * mask;  matmul_1 = mul @ v        (one layer)
    after:   lasp_0 = self.lasp_0(view, view_1, view_2, unsqueeze)            (q, k, v, log λ)

Everything else must be position-wise (:mod:`gradshard.plans.lasp.locality`): ``arange``
positions are offset by this rank's first step, reductions over time become per-rank shares
(sum over ranks = full value), and anything that would need other ranks' steps is an error
naming the node. With ``reduce_grads=True`` the parameters enter the graph through a
:class:`~gradshard.plans.lasp.modules.LaspGradSync`, whose backward all-reduces their
gradients once per backward, so every rank's ``.grad`` is the full-sequence gradient.

At compile time the ranks exchange their local lengths and check that they compiled the
same program (:mod:`gradshard.plans.lasp.group`: the plan's ``prepare`` step before the
passes and the ``gs_attach`` hook after them; this pass itself never communicates).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gradshard.errors import GradshardError, node_error
from gradshard.ir import Region, graph_module
from gradshard.pipeline import PassContext, PassResult, copy_graph, graph_pass

from gradshard.passes.detect_linear_attention import KIND, analyze_linear_attention
from gradshard.plans.lasp.group import LaspGroup, check_same_program
from gradshard.plans.lasp.halo import HaloRoot, apply_halo, plan_halo
from gradshard.plans.lasp.locality import (
    ReductionEdit,
    check_constants,
    drop_zero_terms,
    explain_component,
    offset_positions,
    plan_reductions,
)
from gradshard.plans.lasp.modules import LaspAttentionRegion, LaspGlobalMean, LaspGradSync
from gradshard.passes.linear_attention_graph import live_nodes

aten = torch.ops.aten

__all__ = ["rewrite_lasp", "LaspInfo"]


@dataclass(frozen=True)
class LaspLayer:
    site: str
    layer_id: int
    form: str
    state_bytes: int


@dataclass
class LaspInfo:
    """``cm.lasp`` after compiling with plan ``lasp``: this rank's place and the layers.

    ``start``/``stop``: this rank's global steps; ``seq_len``: the global length;
    ``lengths``: every rank's local length; ``layers``: one :class:`LaspLayer` per region.
    """

    group: Any
    rank: int
    world_size: int
    start: int
    stop: int
    seq_len: int
    lengths: tuple[int, ...]
    layers: tuple[LaspLayer, ...]
    reduce_grads: bool
    comm: Any = field(repr=False, default=None)

    def local_slice(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor (same split as the compiled inputs)."""
        return x.narrow(dim, self.start, self.stop - self.start)


@graph_pass
def rewrite_lasp(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each linear-attention region by a LASP layer; make the rest rank-correct."""
    opts = ctx.options
    if ctx.captured is None:
        raise GradshardError(
            "plan 'lasp' needs gs.compile(model, plan='lasp', ...): it owns the gradient reduction "
            "over the group, which the torch.compile backend (gs.backend) cannot attach"
        )
    tl = ctx.analyses.get("time")
    analysis = analyze_linear_attention(gm, ctx)
    assert tl is not None and analysis is not None  # annotate_time ran strictly before
    by_name = {n.name: n for n in gm.graph.nodes}

    reductions: list[ReductionEdit] = []
    shares: set[str] = set()  # members of reductions (per-rank shares) and halo windows: they stay
    halos: list[HaloRoot] = []
    for rj in analysis.rejections:
        if rj.kind in ("softmax_attention", "kernel_state"):
            raise explain_component(rj, by_name, tl)
        edits = plan_reductions(rj.component, by_name, analysis.classes)
        roots = plan_halo(rj.component, by_name, tl, analysis.classes) if edits is None else None
        if edits is None and roots is None:
            raise explain_component(rj, by_name, tl)
        reductions.extend(edits or [])
        halos.extend(roots or [])
        shares.update(rj.component.nodes)
    findings = analysis.findings
    if not findings:
        raise GradshardError(
            "plan 'lasp' found no linear attention in the model (no lightning_attention op, no causal "
            "(q k^T ⊙ M) v, no block-wise or per-step linear-attention loop). LASP splits the "
            "sequence over ranks only around linear attention; use plan='none' for this model"
        )

    group: LaspGroup = ctx.plan_state["lasp_group"]  # joined by the plan's prepare step
    if group.local_len != tl.seq_len:
        raise GradshardError(
            f"plan 'lasp': the input's time axis has {group.local_len} steps on this rank, but the graph's "
            f"time axis has {tl.seq_len}; pass time_axis=(input_index, dim) naming the sequence axis")
    params = _trainable_params(gm, ctx) if opts.reduce_grads else []
    states = [f.spec.state_elements() for f in findings]
    signature = (len(findings), sum(states), len(params), sum(p[1].numel() for p in params), len(halos))

    new_graph = copy_graph(gm)
    new_gm = graph_module(gm, new_graph)
    nodes = {n.name: n for n in new_graph.nodes}
    notes = [group.describe()]
    layers: list[LaspLayer] = []
    regions: list[Region] = []
    for layer_id, f in enumerate(findings):
        site = f"lasp_{layer_id}"
        src = f.region.source
        mod = LaspAttentionRegion(site, layer_id, f.spec, group, opts.chunk_size, tl.seq_len,
                                  source=f"{src.file.rsplit('/', 1)[-1]}:{src.line}" if src else "",
                                  decay_value=f.decay_value)
        new_gm.add_submodule(site, mod)
        old_out = nodes[f.output]
        with new_graph.inserting_before(old_out):
            call = new_graph.call_module(site, tuple(nodes[n] for n in f.inputs))
        call.meta = dict(old_out.meta)
        old_out.replace_all_uses_with(call)
        layers.append(LaspLayer(site, layer_id, f.spec.form, mod.state_bytes()))
        notes.append(f"{site}: {f.region.name} ({f.spec.form}; {f.spec.describe()}); "
                     f"sends {mod.state_bytes():,} B per direction")
        if f.region.kind != KIND:
            regions.append(f.region)
    for edit in reductions:
        notes.append(_apply_reduction(new_gm, nodes, edit, group, tl.seq_len))
    for halo_id, root in enumerate(halos):
        notes.append(apply_halo(new_gm, nodes, root, halo_id, group))
    # before DCE: a dropped zero term takes its cumsum of a constant with it
    dropped = drop_zero_terms(new_graph)
    if dropped:
        notes.append(f"zero terms dropped: {', '.join(dropped)}")
    new_graph.eliminate_dead_code()
    shifted = offset_positions(new_graph, tl, group.start)
    if shifted:
        notes.append(f"positions offset by {group.start}: {', '.join(shifted)}")
    check_constants(new_graph, tl, analysis.classes)
    _check_time_local(new_graph, analysis.classes, tl, shares)
    if params:
        notes.append(_insert_grad_sync(new_gm, params, group))
    new_graph.lint()
    new_gm.recompile()
    info = LaspInfo(group.group, group.rank, group.world_size, group.start, group.stop, group.seq_len,
                    group.lengths, tuple(layers), bool(opts.reduce_grads), group.comm)
    new_gm.gs_attach = _Attach(info, group, signature)  # type: ignore[assignment]
    return PassResult(new_gm, changed=True, regions=tuple(regions), notes=tuple(notes))


def _trainable_params(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[str, torch.Tensor]]:
    """(placeholder name, example value) of the parameters that require grad and are used."""
    live = live_nodes(gm)
    n_params = len(ctx.captured.params)
    out = []
    for i, (ph, val) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), ctx.example_inputs)):
        if i < n_params and isinstance(val, torch.Tensor) and val.requires_grad and ph.name in live and ph.users:
            out.append((ph.name, val))
    return out


def _apply_reduction(gm: fx.GraphModule, nodes: dict[str, fx.Node], edit: ReductionEdit, group: LaspGroup,
                     local_len: int) -> str:
    """Turn one reduction over time into this rank's share (see ReductionEdit)."""
    node = nodes[edit.node]
    graph = gm.graph
    what = f"{node.name} ({getattr(node.target, '__name__', node.target)})"
    if edit.kind == "keep":
        return f"{what}: a sum over time; each rank returns its part (sum over ranks = full value)"
    if edit.kind in ("mean", "elem_mean"):
        total = edit.count * group.seq_len
        if total % local_len:
            raise node_error(node, f"its element count {edit.count} is not a multiple of the local "
                             f"length {local_len}", "reduce over time with a sum instead")
        n_global = total // local_len
        if edit.kind == "mean":
            x = node.args[0]
            if node.target is aten.mean.dim:
                dims = node.args[1]
                keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
                new_target, new_args = aten.sum.dim_IntList, (x, dims, keep)
            else:
                new_target, new_args = aten.sum.default, (x,)
            kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
            with graph.inserting_before(node):
                summed = graph.call_function(new_target, new_args, kwargs)
            summed.meta = dict(node.meta)
        else:
            summed = node
            _set_reduction(node, edit.reduction_pos, 2)
        with graph.inserting_after(summed):
            scaled = graph.call_function(aten.mul.Tensor, (summed, 1.0 / n_global))
        scaled.meta = dict(node.meta)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        if summed is not node:
            graph.erase_node(node)
        return f"{what}: a mean over time; each rank returns sum / {n_global} (sum over ranks = full mean)"
    # count_mean: cross-entropy / NLL with reduction=mean
    _set_reduction(node, edit.reduction_pos, 2)
    site = f"lasp_mean_{edit.node}"
    gm.add_submodule(site, LaspGlobalMean(site, group, edit.ignore_index))
    with graph.inserting_after(node):
        call = graph.call_module(site, (node, nodes[edit.target]))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call, delete_user_cb=lambda u: u is not call)
    return (f"{what}: a mean loss over tokens; each rank returns its loss sum / the global count of "
            f"targets (ignore_index={edit.ignore_index}), all-reduced in the forward")


def _set_reduction(node: fx.Node, pos: int, value: int) -> None:
    args = list(node.args)
    if len(args) > pos:
        args[pos] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs["reduction"] = value
        node.kwargs = kwargs


def _check_time_local(graph: fx.Graph, classes: dict[str, str], tl, shares: set[str]) -> None:
    """After the rewrite, only position-wise nodes and shares may depend on time (a safety net)."""
    for n in graph.nodes:
        cls = classes.get(n.name)
        if n.op == "call_function" and cls in ("inner", "closing") and n.name not in shares:
            info = tl[n]
            raise node_error(n, f"it still mixes time steps after the LASP rewrite ({info.why})",
                             "report this model to the gradshard developers; use plan='none' meanwhile")


def _insert_grad_sync(gm: fx.GraphModule, params: list[tuple[str, torch.Tensor]], group: LaspGroup) -> str:
    graph = gm.graph
    phs = {n.name: n for n in graph.find_nodes(op="placeholder")}
    last = list(graph.find_nodes(op="placeholder"))[-1]
    itemsize = max(v.element_size() for _, v in params)
    sync = LaspGradSync(group, [n for n, _ in params], [v.numel() for _, v in params], itemsize)
    gm.add_submodule("lasp_grad_sync", sync)
    with graph.inserting_after(last):
        call = graph.call_module("lasp_grad_sync", tuple(phs[n] for n, _ in params))
    anchor = call
    for j, (name, _) in enumerate(params):
        ph = phs[name]
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, j))
        item.meta = dict(ph.meta)
        anchor = item
        ph.replace_all_uses_with(item, delete_user_cb=lambda u: u is not call)
    nbytes = sum(v.numel() * v.element_size() for _, v in params)
    return (f"lasp_grad_sync: {len(params)} parameter gradients ({nbytes:,} B) SUM-all-reduced over "
            f"{group.world_size} rank(s) at the end of backward")


class _Attach:
    """``gs_attach``: check every rank compiled the same program (collective), then expose
    :class:`LaspInfo` as ``cm.lasp``."""

    def __init__(self, info: LaspInfo, group: LaspGroup, signature: tuple[int, ...]) -> None:
        self.info, self.group, self.signature = info, group, signature

    def __call__(self, cm: torch.nn.Module) -> None:
        check_same_program(self.group, self.signature)
        cm.lasp = self.info  # type: ignore[attr-defined]
