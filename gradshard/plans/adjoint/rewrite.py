"""rewrite_adjoint: replace every linear-recurrence region by one adjoint-sharding module.

Before (one layer of a selective SSM, vectorised)::

    x = rms_norm(y); a = sigmoid(linear(x)); u = linear(x)[..., None] * x[..., None, :]
    h = exp(L) * cumsum(u * exp(-L), 1)          # L = cumsum(log a, 1)
    out = y + einsum("btn,btnp->btp", linear(x), h)

After::

    adjoint_0 = self.adjoint_0(y, norm_w, A_w, A_b, B_w, B_b, C_w, C_b)   # AdjointRegion
    getitem = adjoint_0[0]                                                 # the readout
    out = y + getitem

``AdjointRegion`` (:mod:`gradshard.plans.adjoint.runtime`) runs the producers, the scan and the
readout shard by shard and computes the gradient with the adjoint method (or its truncated
form for ``plan="truncated_adjoint"``). Parameters stay graph inputs of the module, so
gradients reach the user's parameters. Each region is checked once on the example inputs:
the sharded forward (small shards, so halos are exercised) must reproduce the captured
graph's values, else compilation stops with an error.

Two more reductions of what the plan keeps (both exact):

* a region input computed pointwise from graph inputs and parameters (layer 0's token
  embedding) is recomputed per backward shard from those instead of being saved
  (:mod:`.recurrence_remat`; the region is called with them as extra inputs);
* the time-local tail after the last recurrence (final norm, LM head) becomes a
  ``LocalSegment`` (``tail_0``, :mod:`gradshard.plans.adjoint.local`) that keeps its
  inputs only and recomputes itself shard by shard in the backward, when plain autograd
  would keep more (:mod:`.recurrence_tail`)::

      tail_0 = self.tail_0(add_7, norm_f_w, lm_head_w); linear = tail_0[0]
"""

from __future__ import annotations

import heapq
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import node_cost
from gradshard.analysis.effects import draws_random_numbers
from gradshard.errors import UnsupportedGraphError, node_error, summary
from gradshard.ir import Region, source_of, graph_module
from gradshard.ops.dense_scan import dense_linear_scan_flops
from gradshard.ops.linear_scan import linear_scan_flops
from gradshard.pipeline import PassContext, PassResult, descendants, graph_pass
from gradshard.plans.adjoint.links import assign_gradient_donors, chain_layer_inputs, recycle_segment_inputs
from gradshard.plans.adjoint.chunked import ChunkedForm, block_form_flops, match_chunked_form
from gradshard.plans.adjoint.runtime import AdjointRegion, InputRemat
from gradshard.plans.adjoint.local import LocalSegment
from gradshard.plans.adjoint.reductions import split_time_reductions
from gradshard.plans.adjoint.respecialize import RespecializeError, respecialize, time_facts

from gradshard.passes.detect_recurrence import find_scan_sites
from gradshard.passes.recurrence_graph import copy_graph_module, live_nodes
from gradshard.plans.adjoint.region import RegionPlan, extract_region
from gradshard.plans.adjoint.remat import InputRematPlan, find_input_remats
from gradshard.plans.adjoint.tail import TailPlan, find_local_tails

__all__ = ["rewrite_adjoint", "build_region_module", "VERIFY_MAX_LEN"]

VERIFY_MAX_LEN = 4096  # example-input self-check of every region up to this captured length
# The self-check runs on the example's first CHECK_LEN steps (the graph re-specialised to that
# length), so its memory and time do not grow with the captured length; a graph that cannot be
# re-specialised is checked at full length (up to VERIFY_MAX_LEN).
CHECK_LEN = 256


def _subgraph(root: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[Optional[fx.Node]],
              name: str) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        ph = g.placeholder(x.name)
        ph.meta = dict(x.meta)
        env[x] = ph
    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":  # constants and rolled bodies: read from the root
            env[a] = g.get_attr(a.target)
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        if n in env:
            continue
        env[n] = g.node_copy(n, arg)
    g.output(tuple(env[o] if o is not None else None for o in outputs))
    gm = graph_module(root, g, name)
    return gm


def _costs(plan: RegionPlan, T: int, shard: int, remat: frozenset[int] = frozenset(),
           anchors: tuple[fx.Node, ...] = ()) -> dict[str, int]:
    """The region's cost facts; its saved bytes are the inputs it keeps (not ``remat``), the
    ``anchors`` its remats read (computed values: segments count them as kept by the region),
    and the state checkpoints."""
    prod = [node_cost(n) for n in plan.producers if n.op == "call_function"]
    ro = [node_cost(n) for n in plan.readout]
    u_val = plan.producer_outputs[1].meta["val"]
    state_bytes = u_val.numel() * u_val.element_size()
    scan_flops = linear_scan_flops(u_val.shape)
    if plan.scan.kind == "dense":
        a_val = plan.producer_outputs[0].meta["val"]
        scan_flops = dense_linear_scan_flops(u_val.shape, int(a_val.shape[-1]))
    saved = sum(x.meta["val"].numel() * x.meta["val"].element_size()
                for i, (x, d) in enumerate(zip(plan.inputs, plan.io.input_time_dims))
                if d is not None and i not in remat and isinstance(x.meta.get("val"), torch.Tensor))
    saved += sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in anchors
                 if isinstance(a.meta.get("val"), torch.Tensor) and a not in plan.inputs)
    n_ckpt = max(0, -(-T // max(shard, 1)) - 1)
    saved += n_ckpt * state_bytes // max(T, 1)
    return {
        "producer_bytes": sum(c.out_bytes for c in prod),
        "producer_flops": sum(c.fwd_flops for c in prod),
        "producer_bwd_flops": sum(c.bwd_flops for c in prod),
        "readout_flops": sum(c.fwd_flops + c.bwd_flops for c in ro),
        "state_bytes": state_bytes,
        "scan_flops": scan_flops,
        "saved_bytes": saved,
    }


def _block_costs(plan: RegionPlan, form: ChunkedForm, h: fx.Node) -> dict[str, int]:
    """A chunked region's block form: its forward and backward FLOPs over the captured length
    (:func:`block_form_flops`), and the FLOPs of the per-step contraction it replaces."""
    b, T, H = plan.producer_outputs[1].meta["val"].shape[:3]
    forward, backward = block_form_flops(form, int(b), int(T), int(H), plan.scan.has_a)
    contraction = [node_cost(n) for n in plan.readout if n.target is torch.ops.aten.einsum.default and h in n.args[1]]
    return {"block_flops": forward, "block_bwd_flops": backward,
            "contraction_flops": sum(c.fwd_flops + c.bwd_flops for c in contraction)}


def _remat_leaves(remats: list[InputRematPlan]) -> list[fx.Node]:
    """The extra region inputs the remats read (deduplicated, in first-use order)."""
    return list(dict.fromkeys(leaf for r in remats for leaf in r.leaves))


def build_region_module(gm: fx.GraphModule, plan: RegionPlan, facts: dict, name: str, plan_name: str,
                        shard_size: int, window: Optional[int],
                        remats: Optional[list[InputRematPlan]] = None, chunked: bool = False) -> AdjointRegion:
    """The :class:`AdjointRegion` of ``plan`` (graphs cut from ``gm``); ``remats``: inputs to recompute;
    ``chunked``: run its shards chunked where its graphs have that form."""
    remats = remats or []
    producer = _subgraph(gm, plan.inputs, plan.producers, plan.producer_outputs, f"{name}_producers")
    h = next(n for n in gm.graph.nodes if n.name == plan.site.h)
    readout = _subgraph(gm, [h, *plan.producer_outputs[3:]], plan.readout, plan.exits, f"{name}_readout")
    lh, rh = plan.io.halo
    desc = (f"{plan.scan.kind} recurrence written as {plan.site.written_as}; {len(plan.producers)} producer nodes "
            f"(halo {lh}/{rh}), {len(plan.readout)} readout nodes")
    if plan.extended:
        desc += f" ({plan.extended} past the contraction, to {', '.join(x.name for x in plan.exits)})"
    form = match_chunked_form(producer, readout, plan.scan, plan.io) if chunked else None
    if form is not None:
        desc += "; " + form.describe() + (
            f"; the window ({window}) as a second readout of the states, q_(t+W) against -kappa_t dy_(t+W), "
            "in shards of at most the window" if plan_name == "truncated_adjoint" else "")
    extra = _remat_leaves(remats)
    slot = {leaf: j for j, leaf in enumerate(extra)}
    built = []
    for r in remats:
        x = plan.inputs[r.index]
        g = _subgraph(gm, list(r.leaves), list(r.nodes), [x], f"{name}_input{r.index}")
        built.append((InputRemat(r.index, tuple(slot[leaf] for leaf in r.leaves), r.leaf_time_dims, r.halo), g))
    if remats:
        desc += "; recomputes input(s) " + ", ".join(plan.inputs[r.index].name for r in remats) + " from " + ", ".join(
            leaf.name for leaf in extra)
    anchors = tuple(leaf for r in remats for leaf, d in zip(r.leaves, r.leaf_time_dims)
                    if d is not None and leaf.op == "call_function")
    costs = _costs(plan, plan.io.captured_len, shard_size, frozenset(r.index for r in remats), tuple(dict.fromkeys(anchors)))
    if form is not None:
        costs.update(_block_costs(plan, form, h))
    return AdjointRegion(name, producer, readout, facts, plan.scan, plan.io, plan=plan_name, shard_size=shard_size,
                         window=window, describe=desc, costs=costs, remats=built, n_extra=len(extra), chunked=form)


def _respecializes(fn: Any, lengths: list[int]) -> bool:
    """Whether ``fn(length)`` re-specialises a graph to every length (fake-tensor checked)."""
    try:
        for L in lengths:
            fn(L)
    except RespecializeError:
        return False
    return True


def _check_lengths(T: int, shard: int, halo: int = 0) -> list[int]:
    """The shard lengths a graph captured at ``T`` must re-specialise to, and with a ``halo``
    their windows (``halo`` steps longer)."""
    S = max(1, min(shard, T))
    lengths = {S, T % S or S, max(1, S // 2)}
    return sorted((lengths | {L + halo for L in lengths}) - {T})


def _region_respecializes(gm: fx.GraphModule, plan: RegionPlan, facts: dict, shard: int) -> bool:
    """Whether ``plan``'s producer and readout graphs re-specialise to its shard lengths and to the
    self-check's (a third of the captured length), with their halo windows."""
    T = plan.io.captured_len
    halo = sum(plan.io.halo)
    lengths = sorted(set(_check_lengths(T, shard, halo)) | set(_check_lengths(T, max(1, -(-T // 3)), halo)))
    h = next(n for n in gm.graph.nodes if n.name == plan.site.h)
    graphs = (_subgraph(gm, plan.inputs, plan.producers, plan.producer_outputs, "producer_check"),
              _subgraph(gm, [h, *plan.producer_outputs[3:]], plan.readout, plan.exits, "readout_check"))
    return all(_respecializes(lambda L, g=g: respecialize(g, facts, T, L, keep_values=False), lengths) for g in graphs)


def _usable_remats(gm: fx.GraphModule, tl: Any, facts: dict, plan: RegionPlan, shard: int,
                   barred: frozenset[fx.Node]) -> list[InputRematPlan]:
    """The remats of ``plan``'s inputs whose recomputation re-specialises to shard lengths
    (and to their windows, ``halo`` steps longer)."""
    out = []
    for r in find_input_remats(gm, tl, facts, plan.inputs, plan.io.input_time_dims, barred):
        g = _subgraph(gm, list(r.leaves), list(r.nodes), [plan.inputs[r.index]], "remat_check")
        lengths = _check_lengths(plan.io.captured_len, shard, r.halo + sum(plan.io.halo))
        if _respecializes(lambda L: respecialize(g, facts, plan.io.captured_len, L, keep_values=False), lengths):
            out.append(r)
    return out


def build_tail_module(gm: fx.GraphModule, tail: TailPlan, facts: dict, name: str, T: int,
                      shard_size: int) -> LocalSegment:
    """The :class:`LocalSegment` running ``tail`` (graph cut from ``gm``)."""
    graph = _subgraph(gm, tail.inputs, tail.nodes, tail.outputs, f"{name}_graph")
    divisors = split_time_reductions(graph, [i for i, d in enumerate(tail.output_time_dims) if d is None])
    costs = [node_cost(n) for n in tail.nodes]
    reduced = [y.name for y, d in zip(tail.outputs, tail.output_time_dims) if d is None]
    desc = (f"time-local tail of {len(tail.nodes)} nodes ({', '.join(n.name for n in tail.nodes[:4])}"
            f"{', ...' if len(tail.nodes) > 4 else ''}); keeps {tail.kept:,} B instead of {tail.autograd_saved:,} B"
            + (f"; reduces {', '.join(reduced)} over time shard by shard" if reduced else ""))
    if tail.halo:
        desc += f"; each shard reads {tail.halo} earlier steps (halo)"
    return LocalSegment(name, graph, facts, tail.input_time_dims, tail.output_time_dims, captured_len=T,
                        shard_size=shard_size, describe=desc, divisors=divisors, halo=tail.halo,
                        costs={"saved_bytes": tail.kept, "autograd_saved_bytes": tail.autograd_saved,
                               "fwd_flops": sum(c.fwd_flops for c in costs), "bwd_flops": sum(c.bwd_flops for c in costs),
                               "work_bytes": sum(c.out_bytes for c in costs)})


class _Collect(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = out
        return out


def _collect(gm: fx.GraphModule, plans: list[RegionPlan], remats: list[list[InputRematPlan]], tails: list[TailPlan],
             example: list[Any]) -> dict[str, Any]:
    """Values of the graph's region/remat/tail boundary nodes on the example inputs (no grad)."""
    keep = {x.name for p in plans for x in (*p.inputs, *p.exits, *( [p.final_select] if p.final_select else []))}
    keep |= {x.name for t in tails for x in (*t.inputs, *t.outputs)}
    keep |= {leaf.name for rm in remats for r in rm for leaf in r.leaves}
    col = _Collect(gm, keep)
    with torch.no_grad():
        col.run(*example)
    return col.values


def _check_values(gm: fx.GraphModule, facts: Any, tl: Any, plans: list[RegionPlan],
                  remats: list[list[InputRematPlan]], tails: list[TailPlan], example: list[Any],
                  ) -> tuple[fx.GraphModule, int, dict[str, Any], str]:
    """Boundary values for the self-check: on the example's first :data:`CHECK_LEN` steps when
    the graph re-specialises to that length, else on the whole example.

    Returns ``(graph the values come from, its length, values, note)``."""
    T = int(tl.seq_len)
    if T > CHECK_LEN:
        try:
            short = respecialize(gm, facts, T, CHECK_LEN, strict_scalars=True)
            dims = [tl.time_inputs.get(ph.name) for ph in gm.graph.find_nodes(op="placeholder")]
            sliced = [x.narrow(d, 0, CHECK_LEN) if d is not None and isinstance(x, torch.Tensor) else x
                      for x, d in zip(example, dims)]
            values = _collect(short, plans, remats, tails, sliced)
            return short, CHECK_LEN, values, f"self-check on the example's first {CHECK_LEN} of {T} steps"
        except (RespecializeError, RuntimeError, KeyError) as exc:
            reason = summary(exc)
            if T > VERIFY_MAX_LEN:
                raise _Unchecked(f"self-check skipped: the graph does not re-specialise to {CHECK_LEN} steps "
                                 f"({reason}) and T={T} > {VERIFY_MAX_LEN}") from exc
            note = f"self-check at the full {T} steps (no re-specialisation to {CHECK_LEN}: {reason})"
            return gm, T, _collect(gm, plans, remats, tails, example), note
    return gm, T, _collect(gm, plans, remats, tails, example), f"self-check on the whole example ({T} steps)"


class _Unchecked(Exception):
    """The self-check cannot run at an affordable length (its message is the note to record)."""


def _non_finite_input(gm: fx.GraphModule, example: Any) -> str | None:
    """The name of the first floating example input holding NaN or inf, if any."""
    for ph, x in zip(gm.graph.find_nodes(op="placeholder"), example):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            return f"input `{ph.meta.get('gs_input_name', ph.name)}`"
    return None


def _refuse_random_recompute(recomputed: list[fx.Node]) -> None:
    """The adjoint backward recomputes regions, rematerialised inputs and time-local segments
    shard by shard: a random op among them would draw new numbers and give a wrong gradient."""
    for n in recomputed:
        if draws_random_numbers(n):
            raise node_error(n, f"{getattr(n.target, '__name__', n.target)} draws random numbers, and the "
                             "adjoint backward recomputes it shard by shard, which would draw different numbers "
                             "and give a wrong gradient", "disable dropout/noise in the recurrent layers "
                             "(model.eval() or p=0), or use plan='none'")


def _least_precise(nodes: list[fx.Node], default: torch.dtype) -> torch.dtype:
    """The floating dtype with the largest epsilon that any of ``nodes`` computes in (a float64
    model whose scan accumulates in float32 rounds like float32)."""
    dts = [v.dtype for n in nodes for v in [n.meta.get("val")]
           if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return max([default, *dts], key=lambda d: torch.finfo(d).eps)


def _close(got: torch.Tensor, ref: torch.Tensor, computed_in: torch.dtype | None = None) -> tuple[bool, float]:
    if tuple(got.shape) != tuple(ref.shape):
        return False, float("inf")
    if not ref.dtype.is_floating_point:
        return bool((got == ref).all()), 0.0
    # The sharded recompute reorders a low-precision scan's rounding: allow a few ulps of the
    # dtype the region computes in (bf16: 6e-2, fp16: 8e-3); a time structure modelled wrongly
    # is off by O(1).
    low = computed_in if computed_in is not None else ref.dtype
    tol = 1e-9 if low == torch.float64 else max(1e-3, 8 * torch.finfo(low).eps)
    err = float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1.0)) if ref.numel() else 0.0
    return err <= tol, err


def _verify(plans: list[RegionPlan], modules: list[AdjointRegion], values: dict[str, Any], T: int) -> list[str]:
    """Run each region sharded (small shards) on the example inputs (``T`` steps); compare with the graph."""
    notes = []
    for p, mod in zip(plans, modules):
        small = max(1, -(-T // 3))
        probe = AdjointRegion(mod.region_name, mod.producer, mod.readout, mod.facts, mod.scan, mod.io, plan="adjoint",
                              shard_size=small, chunked=mod.chunked)
        ins = [values[x.name] for x in p.inputs]
        try:
            with torch.no_grad():
                outs = probe(*ins)
        except Exception as exc:  # a shape or time assumption of the sharded recompute does not hold
            where = (p.exits or [p.final_select])[0]
            raise node_error(where, f"internal check failed: recomputing region {mod.region_name} in shards of "
                             f"{small} steps raised {type(exc).__name__}: {exc}; its producers or readout have a "
                             "time structure gradshard did not model",
                             "use plan='seco' or plan='none', and report this graph") from exc
        want = [values[x.name] for x in p.exits] + ([values[p.final_select.name]] if p.final_select else [])
        for got, ref, node in zip(outs, want, [*p.exits, *([p.final_select] if p.final_select else [])]):
            ok, err = _close(got, ref, _least_precise(p.nodes, ref.dtype) if ref.dtype.is_floating_point else None)
            if not ok:
                raise node_error(node, f"internal check failed: recomputing region {mod.region_name} in shards of "
                                 f"{small} steps (halo {p.io.halo}) gives values differing from the captured graph "
                                 f"(max rel err {err:.2e}); its producers have a time dependence gradshard "
                                 "did not model", "use plan='seco' or plan='none', and report this graph")
        notes.append(f"{mod.region_name}: sharded recompute checked on the example inputs (shards of {small})")
    return notes


def _verified_remats(gm: fx.GraphModule, plan: RegionPlan, remats: list[InputRematPlan], values: dict[str, Any],
                     ) -> tuple[list[InputRematPlan], list[str]]:
    """The remats whose recomputation (on the example) reproduces the region input; notes.

    ``gm`` is the graph the values were collected from (the captured one, or its
    re-specialisation to the check length): the remat's nodes are taken from it by name."""
    ok, notes = [], []
    by_name = {n.name: n for n in gm.graph.nodes}
    for r in remats:
        x = plan.inputs[r.index]
        g = _subgraph(gm, [by_name[n.name] for n in r.leaves], [by_name[n.name] for n in r.nodes], [by_name[x.name]],
                      "remat_check")
        with torch.no_grad():
            got = g(*[values[leaf.name] for leaf in r.leaves])[0]
        good, err = _close(got, values[x.name])
        if good:
            ok.append(r)
        else:
            notes.append(f"{x.name}: not recomputed from {[leaf.name for leaf in r.leaves]} (check failed, err {err:.2e})")
    return ok, notes


def _verified_tails(tails: list[TailPlan], mods: list[LocalSegment], values: dict[str, Any], T: int,
                    ) -> tuple[list[TailPlan], list[LocalSegment], list[str]]:
    """The tails whose run in small shards reproduces the graph's values on the example; notes.

    A tail that fails is left to plain autograd (it is an optimisation; the gradient stays exact).
    """
    keep_t, keep_m, notes = [], [], []
    for tail, seg in zip(tails, mods):
        small = max(1, -(-T // 3))
        probe = LocalSegment(seg.region_name, seg.graph_module, seg.facts, seg.input_time_dims, seg.output_time_dims,
                             captured_len=seg.captured_len, shard_size=small, divisors=seg.divisors, halo=seg.halo)
        try:
            with torch.no_grad():
                outs = probe(*[values[x.name] for x in tail.inputs])
            checks = [_close(got, values[node.name]) for got, node in zip(outs, tail.outputs)]
        except Exception as exc:  # noqa: BLE001 - the tail stays under plain autograd
            notes.append(f"{seg.region_name}: left to autograd ({type(exc).__name__}: {exc})")
            continue
        bad = [err for good, err in checks if not good]
        if bad:
            notes.append(f"{seg.region_name}: left to autograd (sharded run differs, rel err {max(bad):.2e})")
            continue
        keep_t.append(tail)
        keep_m.append(seg)
        notes.append(f"{seg.region_name}: sharded tail checked on the example inputs (shards of {small})")
    return keep_t, keep_m, notes


def _tails(gm: fx.GraphModule, tl: Any, facts: dict, regions: list[set[fx.Node]], kept_anyway: set[fx.Node],
           shard: int, exported: set[fx.Node]) -> tuple[list[TailPlan], list[LocalSegment]]:
    """The time-local segments worth recomputing, with their modules (those that re-specialise to
    shards); ``exported``: values the region calls will read (outputs of the segment computing them)."""
    plans, mods = [], []
    for tail in find_local_tails(gm, tl, facts, regions, kept_anyway, exported):
        seg = build_tail_module(gm, tail, facts, f"tail_{len(mods)}", tl.seq_len, shard)
        if not _respecializes(seg.graph_for, _check_lengths(tl.seq_len, shard, seg.halo)):
            continue
        plans.append(tail)
        mods.append(seg)
    return plans, mods


def _restore_topological_order(graph: fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, moving as little as possible.

    A tail call is placed where the tail began; an input it reads (a region output) may be
    defined later, and a node reading its outputs may come earlier. Ready nodes are emitted
    in their current order (a stable topological sort), so a graph already in order is kept.
    """
    nodes = list(graph.nodes)
    seen: set[fx.Node] = set()
    for n in nodes:
        if any(a not in seen for a in n.all_input_nodes):
            break
        seen.add(n)
    else:
        return
    pos = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    indeg = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(pos[n], n) for n in nodes if indeg[n] == 0 and n is not output]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0 and u is not output:
                heapq.heappush(ready, (pos[u], u))
    if len(order) != len(nodes) - 1:
        raise RuntimeError("internal: the graph has a cycle after installing a time-local tail")
    order.append(output)
    for a, b in zip(order, order[1:]):
        a.append(b)


def _install_tail(gm: fx.GraphModule, tail: TailPlan, seg: LocalSegment, facts: dict,
                  replaced: dict[fx.Node, fx.Node]) -> Region:
    """Replace ``tail``'s nodes in ``gm`` by one call of ``seg``; the Region describing it."""
    name = seg.region_name
    gm.add_submodule(name, seg)
    inputs = [replaced.get(x, x) for x in tail.inputs]
    source = source_of(tail.outputs[-1])
    with gm.graph.inserting_before(tail.nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta["stack_trace"] = tail.outputs[-1].meta.get("stack_trace")
        call.meta["gs_region"] = name
        for j, y in enumerate(tail.outputs):
            g = gm.graph.call_function(operator.getitem, (call, j))
            g.meta = {"val": y.meta.get("val"), "stack_trace": y.meta.get("stack_trace")}
            facts[g.name] = facts.get(y.name, ())
            members = set(tail.nodes)
            y.replace_all_uses_with(g, delete_user_cb=lambda usr, m=members: usr not in m)
    for n in reversed(tail.nodes):
        if n.users:
            raise node_error(next(iter(n.users)), f"internal: tail {name} still has an outside user", "report this")
        gm.graph.erase_node(n)
    _restore_topological_order(gm.graph)
    return Region(kind="local_recompute", name=name, nodes=tuple(n.name for n in tail.nodes),
                  inputs=tuple(x.name for x in inputs), outputs=tuple(y.name for y in tail.outputs),
                  time_axis=next(d for d in (*tail.output_time_dims, *tail.input_time_dims) if d is not None),
                  source=source,
                  options={"form": "pointwise in time, recomputed in shards" if not seg.halo else
                           f"a causal window of {seg.halo + 1} steps, recomputed in shards", "shard_size": seg.shard_size,
                           **({"halo": seg.halo} if seg.halo else {}),
                           "kept_bytes": tail.kept, "autograd_saved_bytes": tail.autograd_saved})


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _with_gradient(gm: fx.GraphModule, sites: list[Any]) -> list[Any]:
    """The sites a gradient flows through: a scan of values that depend on no parameter or input
    that requires grad (positions from the attention mask's cumsum) stays a plain op, which
    autograd runs with nothing to save. All sites where nothing in the graph requires grad."""
    seeds = [n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get("gs_requires_grad")]
    if not seeds:
        return sites
    reached = {n.name for n in descendants(seeds)}
    return [s for s in sites if s.h in reached]


@graph_pass
def rewrite_adjoint(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each linear-recurrence region by an ``AdjointRegion`` module (see module doc)."""
    tl = ctx.analyses.get("time")
    opts = ctx.options
    window = getattr(opts, "window", None)
    shard = int(getattr(opts, "shard_size", 256))
    new = copy_graph_module(gm)
    new.graph.eliminate_dead_code()
    found = find_scan_sites(new, tl)
    sites = _with_gradient(new, found)
    if not sites:
        idle = (f" (its {len(found)} scan(s) compute no gradient, e.g. positions from the attention "
                f"mask: `{found[0].h}` at {source_of(_node(new, found[0].h)) or 'an unknown line'})" if found else "")
        raise UnsupportedGraphError(
            f"plan={ctx.plan!r}: no linear recurrence (h_t = a_t * h_(t-1) + u_t) found in the captured graph.\n"
            "  why: adjoint sharding rewrites linear recurrences (per-step loops, gradshard.kernels.linear_scan, "
            f"log-space cumsum scans, associative_scan); the model has none that gradshard recognises{idle}.\n"
            "  instead: use plan='seco' (any model) or plan='none'; `gradshard show` lists what was found.")
    live = live_nodes(new)
    facts = time_facts(new, tl)
    claimed: set[fx.Node] = set()
    plans: list[RegionPlan] = []
    notes: list[str] = []
    for site in sites:
        plan = extract_region(new, tl, facts, site, live, claimed)
        if plan.extended and not _region_respecializes(new, plan, facts, shard):
            notes.append(f"{plan.exits[0].name if plan.exits else site.h}: the {plan.extended} node(s) after the "
                         "readout stay outside the region (they do not re-specialise to shard lengths)")
            plan = extract_region(new, tl, facts, site, live, claimed, extend=False)
        claimed.update(plan.producers, plan.readout, plan.covered_nodes)
        plans.append(plan)
    verify = bool(ctx.example_inputs)
    bad = _non_finite_input(new, ctx.example_inputs) if verify else None
    if bad is not None:
        verify = False
        notes.append(f"self-check skipped: {bad} holds NaN/inf at this first call, so the sharded and "
                     "captured values cannot be compared (the rewrite itself does not depend on values)")
    by_name = {n.name: n for n in new.graph.nodes}
    region_groups = [{*p.producers, *p.readout, *p.covered_nodes, *([p.final_select] if p.final_select else []),
                      by_name[p.site.h]} for p in plans]
    in_regions = frozenset().union(*region_groups)
    remats = [_usable_remats(new, tl, facts, plan, shard, in_regions) for plan in plans]
    remat_leaves = {leaf for rm in remats for r in rm for leaf, d in zip(r.leaves, r.leaf_time_dims) if d is not None}
    kept_anyway = {x for p, rm in zip(plans, remats) for i, (x, d) in enumerate(zip(p.inputs, p.io.input_time_dims))
                   if d is not None and i not in {r.index for r in rm}} | remat_leaves
    remat_nodes = {n for rm in remats for r in rm for n in r.nodes}
    # a remat's nodes may run in a segment too (the forward value); its leaves leave the segment
    tails, tail_modules = _tails(new, tl, facts, region_groups, kept_anyway, shard, remat_leaves)
    _refuse_random_recompute([*(n for g in region_groups for n in g), *remat_nodes, *(n for t in tails for n in t.nodes)])
    check_gm, check_len, values = new, tl.seq_len, {}
    if verify:
        try:
            check_gm, check_len, values, note = _check_values(new, facts, tl, plans, remats, tails,
                                                              list(ctx.example_inputs))
        except _Unchecked as skipped:
            verify, note = False, str(skipped)
        notes.append(note)
    if verify:
        checked = [_verified_remats(check_gm, plan, rm, values) for plan, rm in zip(plans, remats)]
        remats = [rm for rm, _ in checked]
        notes += [n for _, ns in checked for n in ns]
    chunked = bool(getattr(opts, "chunked", False))
    modules = [build_region_module(new, plan, facts, f"adjoint_{i}", ctx.plan, shard, window, remats[i], chunked)
               for i, plan in enumerate(plans)]
    if verify:
        notes += _verify(plans, modules, values, check_len)
        tails, tail_modules, tail_notes = _verified_tails(tails, tail_modules, values, check_len)
        notes += tail_notes
    order = {n: i for i, n in enumerate(new.graph.nodes)}
    h_source = {n.name: source_of(n) for n in new.graph.nodes}
    replaced: dict[fx.Node, fx.Node] = {}  # region exits -> the getitems that replace them
    enriched: dict[str, Region] = {}
    for i, (plan, mod) in enumerate(zip(plans, modules)):
        name = mod.region_name
        new.add_submodule(name, mod)
        members = set(plan.producers) | set(plan.readout) | set(plan.covered_nodes) | {next(
            n for n in new.graph.nodes if n.name == plan.site.h)}
        if plan.final_select is not None:
            members.add(plan.final_select)
        outside_users = [u for x in plan.exits for u in x.users if u not in members]
        if plan.final_select is not None:
            outside_users += list(plan.final_select.users)
        first = min(outside_users, key=order.get) if outside_users else next(iter(new.graph.find_nodes(op="output")))
        with new.graph.inserting_before(first):
            args = [*plan.inputs, *_remat_leaves(remats[i])]  # an earlier region's output is its call's getitem now
            call = new.graph.call_module(name, tuple(replaced.get(x, x) for x in args))
            call.meta["stack_trace"] = plan.exits[0].meta.get("stack_trace") if plan.exits else None
            call.meta["gs_region"] = name
            outs = []
            for j, x in enumerate([*plan.exits, *([plan.final_select] if plan.final_select else [])]):
                g = new.graph.call_function(operator.getitem, (call, j))
                g.meta = {"val": x.meta.get("val"), "stack_trace": x.meta.get("stack_trace")}
                facts[g.name] = facts.get(x.name, ())
                outs.append(g)
        for x, g in zip([*plan.exits, *([plan.final_select] if plan.final_select else [])], outs):
            x.replace_all_uses_with(g, delete_user_cb=lambda usr, m=members: usr not in m)
            replaced[x] = g
        for n in sorted(members, key=lambda m: -order[m]):
            if n.users:
                raise node_error(next(iter(n.users)), f"internal: region {name} still has an outside user", "report this")
            new.graph.erase_node(n)
        lh, rh = plan.io.halo
        h_node = plan.site.h
        enriched[h_node] = Region(
            kind="linear_recurrence", name=name,
            nodes=tuple(n.name for n in sorted(members, key=order.get)),
            inputs=tuple(x.name for x in plan.inputs), outputs=tuple(x.name for x in plan.exits),
            time_axis=plan.site.time_dim, source=h_source.get(plan.site.h),
            options={"form": "diagonal (a=1)" if plan.site.written_as == "cumsum" or not plan.scan.has_a else plan.scan.kind, "written_as": plan.site.written_as,
                     "plan": ctx.plan, "shard_size": shard, **({"window": window} if window else {}),
                     "halo": f"{lh}/{rh}", "producers": len(plan.producers), "readout": len(plan.readout)},
        )
        notes.append(f"{name}: {mod.describe}; inputs {[x.name for x in plan.inputs]}")
    # replace the detector's regions by the enriched ones (same recurrence)
    kept: list[Region] = []
    for r in ctx.regions:
        if r.kind == "linear_recurrence" and r.outputs and r.outputs[0] in enriched:
            kept.append(enriched.pop(r.outputs[0]))
        elif r.kind == "linear_recurrence":
            continue
        elif r.kind == "time_mixer" and set(r.nodes) & {n.name for n in claimed}:
            continue
        else:
            kept.append(r)
    kept.extend(enriched.values())
    for tail, seg in zip(tails, tail_modules):
        kept.append(_install_tail(new, tail, seg, facts, replaced))
        notes.append(f"{seg.region_name}: {seg.describe}")
    ctx.regions[:] = kept
    for mod in [*modules, *tail_modules]:
        mod.forget_lengths()  # the checks' lengths: a call re-specialises to its own at first use
    # last, on the final graph: both read each region output's users
    if getattr(opts, "recompute_layer_inputs", False):
        notes += chain_layer_inputs(new)
    notes += assign_gradient_donors(new)
    if getattr(opts, "reuse_input_buffers", True):
        notes += recycle_segment_inputs(new)
    new.graph.eliminate_dead_code()
    new.graph.lint()
    new.recompile()
    from gradshard.plans.adjoint.generic import install_length_generic

    install_length_generic(new, facts, tl)
    ctx.invalidate("time")
    return PassResult(new, changed=True, notes=tuple(notes))
