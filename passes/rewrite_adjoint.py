"""rewrite_adjoint: replace every linear-recurrence region by one adjoint-sharding module.

Before (one layer of a selective SSM, vectorised)::

    x = rms_norm(y); a = sigmoid(linear(x)); u = linear(x)[..., None] * x[..., None, :]
    h = exp(L) * cumsum(u * exp(-L), 1)          # L = cumsum(log a, 1)
    out = y + einsum("btn,btnp->btp", linear(x), h)

After::

    adjoint_0 = self.adjoint_0(y, norm_w, A_w, A_b, B_w, B_b, C_w, C_b)   # AdjointRegion
    getitem = adjoint_0[0]                                                 # the readout
    out = y + getitem

``AdjointRegion`` (:mod:`gradshard.runtime.adjoint`) runs the producers, the scan and the
readout shard by shard and computes the gradient with the adjoint method (or its truncated
form for ``plan="truncated_adjoint"``). Parameters stay graph inputs of the module, so
gradients reach the user's parameters. Each region is checked once on the example inputs:
the sharded forward (small shards, so halos are exercised) must reproduce the captured
graph's values, else compilation stops with an error.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import node_cost
from gradshard.errors import UnsupportedGraphError, node_error
from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.runtime.adjoint import AdjointRegion
from gradshard.runtime.adjoint_respecialize import time_facts

from .detect_recurrence import find_scan_sites
from .recurrence_graph import copy_graph_module, live_nodes
from .recurrence_region import RegionPlan, extract_region

__all__ = ["rewrite_adjoint", "build_region_module", "VERIFY_MAX_LEN"]

VERIFY_MAX_LEN = 4096  # example-input self-check of every region up to this captured length


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
    gm = fx.GraphModule(root, g, name)
    return gm


def _costs(plan: RegionPlan, T: int, shard: int) -> dict[str, int]:
    prod = [node_cost(n) for n in plan.producers if n.op == "call_function"]
    ro = [node_cost(n) for n in plan.readout]
    u_val = plan.producer_outputs[1].meta["val"]
    state_bytes = u_val.numel() * u_val.element_size()
    scan_flops = 2 * u_val.numel()
    if plan.scan.kind == "dense":
        a_val = plan.producer_outputs[0].meta["val"]
        scan_flops = 2 * u_val.numel() * int(a_val.shape[-1])
    saved = sum(x.meta["val"].numel() * x.meta["val"].element_size() for x, d in zip(plan.inputs, plan.io.input_time_dims)
                if d is not None and isinstance(x.meta.get("val"), torch.Tensor))
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


def build_region_module(gm: fx.GraphModule, plan: RegionPlan, facts: dict, name: str, plan_name: str,
                        shard_size: int, window: Optional[int]) -> AdjointRegion:
    """The :class:`AdjointRegion` of ``plan`` (graphs cut from ``gm``)."""
    producer = _subgraph(gm, plan.inputs, plan.producers, plan.producer_outputs, f"{name}_producers")
    h = next(n for n in gm.graph.nodes if n.name == plan.site.h)
    readout = _subgraph(gm, [h, *plan.producer_outputs[3:]], plan.readout, plan.exits, f"{name}_readout")
    lh, rh = plan.io.halo
    desc = (f"{plan.scan.kind} recurrence written as {plan.site.written_as}; {len(plan.producers)} producer nodes "
            f"(halo {lh}/{rh}), {len(plan.readout)} readout nodes")
    return AdjointRegion(name, producer, readout, facts, plan.scan, plan.io, plan=plan_name, shard_size=shard_size,
                         window=window, describe=desc, costs=_costs(plan, plan.io.captured_len, shard_size))


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


def _verify(gm: fx.GraphModule, plans: list[RegionPlan], modules: list[AdjointRegion], example: list[Any]) -> list[str]:
    """Run each region sharded (small shards) on the example inputs; compare with the graph."""
    keep = {x.name for p in plans for x in (*p.inputs, *p.exits, *( [p.final_select] if p.final_select else []))}
    col = _Collect(gm, keep)
    with torch.no_grad():
        col.run(*example)
    notes = []
    for p, mod in zip(plans, modules):
        T = p.io.captured_len
        small = max(1, -(-T // 3))
        probe = AdjointRegion(mod.region_name, mod.producer, mod.readout, mod.facts, mod.scan, mod.io, plan="adjoint",
                              shard_size=small)
        ins = [col.values[x.name] for x in p.inputs]
        with torch.no_grad():
            outs = probe(*ins)
        want = [col.values[x.name] for x in p.exits] + ([col.values[p.final_select.name]] if p.final_select else [])
        for got, ref, node in zip(outs, want, [*p.exits, *([p.final_select] if p.final_select else [])]):
            tol = 1e-9 if ref.dtype == torch.float64 else 1e-3
            scale = ref.abs().max().clamp_min(1.0)
            err = (got - ref).abs().max() / scale
            if not bool(err <= tol):
                raise node_error(node, f"internal check failed: recomputing region {mod.region_name} in shards of "
                                 f"{small} steps (halo {p.io.halo}) gives values differing from the captured graph "
                                 f"(max rel err {float(err):.2e}); its producers have a time dependence gradshard "
                                 "did not model", "use plan='seco' or plan='none', and report this graph")
        notes.append(f"{mod.region_name}: sharded recompute checked on the example inputs (shards of {small})")
    return notes


@graph_pass
def rewrite_adjoint(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each linear-recurrence region by an ``AdjointRegion`` module (see module doc)."""
    tl = ctx.analyses.get("time")
    opts = ctx.options
    window = getattr(opts, "window", None)
    shard = int(getattr(opts, "shard_size", 256))
    new = copy_graph_module(gm)
    new.graph.eliminate_dead_code()
    sites = find_scan_sites(new, tl)
    if not sites:
        raise UnsupportedGraphError(
            f"plan={ctx.plan!r}: no linear recurrence (h_t = a_t * h_(t-1) + u_t) found in the captured graph.\n"
            "  why: adjoint sharding rewrites linear recurrences (per-step loops, gradshard.kernels.linear_scan, "
            "log-space cumsum scans, associative_scan); the model has none that gradshard recognises.\n"
            "  instead: use plan='seco' (any model) or plan='none'; `gradshard show` lists what was found.")
    live = live_nodes(new)
    facts = time_facts(new, tl)
    claimed: set[fx.Node] = set()
    plans: list[RegionPlan] = []
    for site in sites:
        plan = extract_region(new, tl, facts, site, live, claimed)
        claimed.update(plan.producers, plan.readout, plan.covered_nodes)
        plans.append(plan)
    modules = []
    for i, plan in enumerate(plans):
        modules.append(build_region_module(new, plan, facts, f"adjoint_{i}", ctx.plan, shard, window))
    notes: list[str] = []
    if ctx.example_inputs and tl.seq_len <= VERIFY_MAX_LEN:
        notes += _verify(new, plans, modules, list(ctx.example_inputs))
    order = {n: i for i, n in enumerate(new.graph.nodes)}
    h_source = {n.name: source_of(n) for n in new.graph.nodes}
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
            call = new.graph.call_module(name, tuple(plan.inputs))
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
    ctx.regions[:] = kept
    new.graph.eliminate_dead_code()
    new.graph.lint()
    new.recompile()
    from gradshard.runtime.adjoint_generic import install_length_generic

    install_length_generic(new, facts, tl)
    ctx.invalidate("time")
    return PassResult(new, changed=True, notes=tuple(notes))
