"""plan_chunk_program: prove a captured graph can run one chunk of time steps at a time.

Builds a :class:`~gradshard.plans.chunked.runtime.ChunkProgram` from the aten graph, the time
analysis and the attention regions, in four steps:

1. **rules**: every node the outputs need gets a chunk rule (its time frame, how each
   input's window follows from its own, how to run it on a window). Unknown time use,
   non-causal attention, reductions or normalisations over time inside the model, random
   ops and gathers along time are errors here, naming the node and its source line.
2. **boundary**: graph outputs with a time axis become *time outputs* (concatenated over
   chunks); whole-sequence reductions (the loss) become *reductions* split into per-chunk
   partials; everything after them (scalar arithmetic on the loss) stays outside.
3. **cache points**: the keys/values of each attention region (after RoPE, before the
   GQA repeat) and every scan output are kept across chunks.
4. **dry run**: the chunk program runs on meta (or fake) tensors for a few chunks (first, second,
   third, middle, last two). It finds reads of the future (error), makes every other node
   that later chunks read a cache point (e.g. the input of a causal convolution), measures
   how far back each cache point is read (all of the past, or a window), and estimates
   FLOPs and bytes per chunk for the stage program.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from gradshard.errors import GradshardError, UnsupportedGraphError, node_error
from gradshard.ir import Region, is_call_input
from gradshard.passes.meta_propagate import OnMeta, to_meta
from gradshard.pipeline import PassContext, PassResult, ancestors, graph_pass
from gradshard.plans.chunked.cache import CacheSpec
from gradshard.plans.chunked.evaluate import ChunkEvaluator, NeedsCache, RecursionGuard
from gradshard.plans.chunked.frames import SKIP, Frame, TDim
from gradshard.plans.chunked.reductions import make_reduction
from gradshard.plans.chunked.rule_lookup import build_rule
from gradshard.plans.chunked.rules import (AttentionSource, BuildCtx, NodeRule, meta_shape, missing_frame_error,
                                           slots_of)
from gradshard.plans.chunked.rules_local import reshape_time
from gradshard.plans.chunked.runtime import ChunkEstimate, ChunkProgram, RegionOutput

aten = torch.ops.aten

__all__ = ["build_chunk_program", "dry_run", "plan_chunk_program", "outer_nodes", "hoisted_subgraph", "hoisted_values"]

_INSTEAD = "use plan='none' (plain autograd) for this model"


# --------------------------------------------------------------------------- building


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _flatten(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _flatten(o)]
    return [obj]


def _attention_sources(regions: Sequence[Region], nodes: dict[str, fx.Node]) -> tuple[dict[str, AttentionSource], dict[str, str]]:
    """SDPA fast-path sources and designated KV cache points (node -> reason)."""
    sources: dict[str, AttentionSource] = {}
    caches: dict[str, str] = {}
    for r in regions:
        if r.kind != "attention" or not r.options.get("causal"):
            continue
        opts = r.options
        k, v = opts.get("k_cache"), opts.get("v_cache")
        if k not in nodes or v not in nodes:
            continue
        caches[k] = f"keys of {r.name}"
        caches[v] = f"values of {r.name}"
        kshape, vshape = meta_shape(nodes[k]), meta_shape(nodes[v])
        if (r.options.get("form") == "sdpa" and opts.get("kv_repeat") in ("interleave", "none")
                and len(kshape) == 4 and len(vshape) == 4):
            sources[r.outputs[0]] = AttentionSource(k, v, int(opts.get("n_rep", 1)))
    return sources, caches


def _seq_len(gm: fx.GraphModule, rules: dict[str, NodeRule]) -> int:
    user = [rules[p.name].frame for p in gm.graph.find_nodes(op="placeholder")
            if p.name in rules and is_call_input(p) and rules[p.name].frame]
    frames = user or [r.frame for n, r in rules.items() if r.kind == "input" and r.frame]
    if not frames:
        raise UnsupportedGraphError("no graph input runs along the time axis: nothing to chunk.\n"
                                    f"  instead: {_INSTEAD}, or pass time_axis=(input_index, dim)")
    return max(t.length for f in frames for t in f)


def build_chunk_program(gm: fx.GraphModule, tl: Any, regions: Sequence[Region], chunk_size: int,
                        example_inputs: Sequence[Any] = ()) -> ChunkProgram:
    """Steps 1-3 of the module doc (the dry run is :func:`dry_run`). ``example_inputs`` (the
    flat placeholder values) tell which inputs require grad; without them every input is
    taken to, and nothing is hoisted."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    out_args = [a for a in _flatten(out_node.args[0]) if isinstance(a, fx.Node)]
    needed = ancestors(out_args)
    sources, designated = _attention_sources(regions, nodes)
    overrides: dict[str, Frame] = {}
    grad_free = _grad_free(gm, example_inputs)
    hoist: dict[str, Frame] = {}  # gradient-free values a consumer needs sliced along ``frame``
    for _ in range(8):
        rules, missing, hoisted = _build_rules(gm, needed, tl, sources, overrides, grad_free, hoist)
        if not missing:
            break
        fresh = {arg.name: frame for _, arg, frame in missing
                 if arg in grad_free and arg.op == "call_function" and arg.name not in hoist}
        if fresh:
            hoist.update(fresh)
            continue
        if not any([_backfill(arg, frame, overrides) for _, arg, frame in missing]):
            node, arg, _ = missing[0]
            raise missing_frame_error(node, arg)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    slots = {n: slots_of(nodes[n]) for n in rules if nodes[n].op == "call_function"}
    _check_boundary(nodes, rules, slots, needed)
    stateful = _stateful(gm, rules, slots)
    outputs = _region_outputs(gm, nodes, rules, out_args, needed)
    cache_points: dict[str, CacheSpec] = {}
    for name, reason in [*designated.items(), *((n, "scan carry") for n, r in rules.items() if r.kind == "scan")]:
        if name not in rules:
            continue
        frame = rules[name].frame
        if len(frame) == 1 and frame[0].pure(meta_shape(nodes[name])[frame[0].dim]):
            cache_points[name] = CacheSpec(name, frame[0].dim, frame[0].length, None, reason)
        elif rules[name].kind == "scan":
            raise node_error(nodes[name], "a scan whose state gradshard cannot carry across chunks", _INSTEAD)
    flat_names = [p.name for p in placeholders] + hoisted
    return ChunkProgram(
        gm=gm, nodes=nodes, rules=rules, slots=slots, flat_index={n: i for i, n in enumerate(flat_names)},
        flat_names=flat_names, seq_len=_seq_len(gm, rules), chunk_size=chunk_size, outputs=outputs,
        cache_points=cache_points, stateful=stateful, attention=sources, hoisted=tuple(hoisted))


def _grad_free(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> set[fx.Node]:
    """Nodes no gradient flows through and that read no floating-point model input: computed
    from token ids, integer or boolean masks, buffers and constants that do not require grad
    (position ids, masks, RoPE tables, the packed-sequence probe). A float input is data the
    model transforms, never hoisted even when nothing requires grad."""
    free: set[fx.Node] = set()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(example_inputs) != len(placeholders):
        return free
    values = dict(zip(placeholders, example_inputs))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            val = values.get(node) if node.op == "placeholder" else getattr(gm, node.target, None)
            data = (node.op == "placeholder" and is_call_input(node, untagged=False)
                    and isinstance(val, torch.Tensor) and val.is_floating_point())
            if not data and not (isinstance(val, torch.Tensor) and val.requires_grad):
                free.add(node)
        elif node.op == "call_function" and all(a in free for a in node.all_input_nodes):
            free.add(node)
    return free


def hoisted_subgraph(program: ChunkProgram) -> list[fx.Node]:
    """The hoisted nodes and the nodes they are computed from, in graph order (no placeholders)."""
    stack = [program.nodes[n] for n in program.hoisted]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in program.gm.graph.nodes if n in seen]


def hoisted_values(program: ChunkProgram, flat: Sequence[Any]) -> list[Any]:
    """Whole-sequence values of the hoisted nodes, computed from the region's flat inputs."""
    env: dict[fx.Node, Any] = {ph: flat[i] for i, ph in enumerate(program.gm.graph.find_nodes(op="placeholder"))}
    for node in hoisted_subgraph(program):
        if node.op == "get_attr":
            env[node] = getattr(program.gm, node.target)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        env[node] = node.target(*args, **kwargs)
    return [env[program.nodes[n]] for n in program.hoisted]


def _build_rules(gm: fx.GraphModule, needed: set[fx.Node], tl: Any, sources: dict[str, AttentionSource],
                 overrides: dict[str, Frame], grad_free: set[fx.Node], hoist: dict[str, Frame],
                 ) -> tuple[dict[str, NodeRule], list[tuple[fx.Node, fx.Node, Frame]], list[str]]:
    """Step 1: a chunk rule for every needed node, in graph order (+ arguments missing a frame,
    + the hoisted nodes).

    A node no gradient flows through (a mask, position ids) whose op has no chunk rule, or
    whose time dims a consumer needs but the analysis did not find (``hoist``), is
    *hoisted*: computed once for the whole sequence outside the region and sliced per chunk
    like an input, whatever ops build it."""
    bc = BuildCtx(frames={}, elem_frames={}, tl=tl, attention=sources, overrides=overrides)
    rules: dict[str, NodeRule] = {}
    hoisted: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output" or node not in needed:
            continue
        if node.op == "placeholder":
            shp = meta_shape(node)
            tdims = tl[node].time_dims if node.name in tl.info else ()
            frame = overrides.get(node.name, tuple(TDim(d, shp[d]) for d in tdims))
            rule = NodeRule(frame, (), None, kind="input")
        elif node.op == "get_attr":
            rule = NodeRule(overrides.get(node.name, ()), (), None, kind="const")
        elif node.op == "call_function" and node.name in hoist:
            rule = NodeRule(hoist[node.name], (), None, kind="input")
            hoisted.append(node.name)
        elif node.op == "call_function":
            try:
                rule = build_rule(node, bc)
            except UnsupportedGraphError:
                if node not in grad_free or not isinstance(node.meta.get("val"), torch.Tensor):
                    raise
                rule = _hoisted_rule(node, tl)
                hoisted.append(node.name)
            info = tl.info.get(node.name)
            if (not rule.frame and rule.kind != "global" and info is not None and info.time_dims
                    and isinstance(node.meta.get("val"), torch.Tensor)):
                if node not in grad_free:
                    raise node_error(node, "its output runs along time but gradshard cannot follow the time "
                                     "axis through it (a constant of the sequence length it cannot slice?)",
                                     _INSTEAD)
                rule = _hoisted_rule(node, tl)  # e.g. a gather of positions its rule cannot slice
                hoisted.append(node.name)
        else:
            raise node_error(node, f"{node.op} nodes are not supported by chunked plans", _INSTEAD)
        rules[node.name] = rule
        bc.frames[node.name] = rule.frame
        if rule.elem_frames is not None:
            bc.elem_frames[node.name] = rule.elem_frames
    return rules, bc.missing, hoisted


def _hoisted_rule(node: fx.Node, tl: Any) -> NodeRule:
    shp = meta_shape(node)
    tdims = tl[node].time_dims if node.name in tl.info else ()
    return NodeRule(tuple(TDim(d, shp[d]) for d in tdims), (), None, kind="input")


_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.unsqueeze.default}
_FACTORIES = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
              aten.arange.default, aten.arange.start, aten.arange.start_step}


def _backfill(node: fx.Node, frame: Frame, overrides: dict[str, Frame]) -> bool:
    """Give the sources of ``node`` (factories, buffers, inputs, constants) the time dims that
    make ``node`` carry ``frame``; walks back through views, expands, slices and pointwise
    ops. Returns whether anything was added."""
    if not frame:
        return False
    shp = meta_shape(node)
    if node.op in ("placeholder", "get_attr") or (node.op == "call_function" and node.target in _FACTORIES):
        if any(not t.pure(shp[t.dim]) for t in frame) or overrides.get(node.name) == frame:
            return False
        overrides[node.name] = frame
        return True
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    t = node.target
    src = node.args[0]
    if t in _VIEWS:
        mapped = [reshape_time(shp, meta_shape(src), td) for td in frame]
        return None not in mapped and _backfill(src, tuple(mapped), overrides)
    if t in (aten.slice.Tensor, aten.narrow.default):
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(shp)
        return _backfill(src, tuple(TDim(d.dim, meta_shape(src)[d.dim]) if d.dim == dim else d for d in frame),
                         overrides)
    if t in (aten.transpose.int, aten.permute.default):
        nd = len(shp)
        if t is aten.permute.default:
            perm = [p % nd for p in node.args[1]]
        else:
            perm = list(range(nd))
            a, b = node.args[1] % nd, node.args[2] % nd
            perm[a], perm[b] = perm[b], perm[a]
        return _backfill(src, tuple(replace(d, dim=perm[d.dim]) for d in frame), overrides)
    changed = False
    for arg in slots_of(node):  # pointwise, expand, triu/tril, comparisons, casts
        ashp = meta_shape(arg)
        off = len(shp) - len(ashp)
        sub = tuple(replace(d, dim=d.dim - off) for d in frame
                    if 0 <= d.dim - off < len(ashp) and ashp[d.dim - off] == shp[d.dim])
        changed |= _backfill(arg, sub, overrides)
    return changed

def _check_boundary(nodes: dict[str, fx.Node], rules: dict[str, NodeRule], slots: dict[str, list[fx.Node]],
                    needed: set[fx.Node]) -> None:
    """Time leaves the region only through whole-sequence reductions; those stay outside it."""
    reduced: dict[str, str] = {}  # node -> the whole-sequence reduction it is computed from
    for name, rule in rules.items():
        node = nodes[name]
        if node.op != "call_function":
            continue
        ins = [a for a, m in zip(slots[name], rule.slots) if m is not SKIP]  # SKIP: dtype/device only
        if rule.kind == "global":
            reduced[name] = name
        elif not rule.frame:
            source = next((reduced[a.name] for a in ins if a.name in reduced), None)
            if source is not None:
                reduced[name] = source
        if rule.frame and any(a.name in reduced for a in ins):
            g = reduced[next(a.name for a in ins if a.name in reduced)]
            raise node_error(node, f"uses `{g}`, a reduction over the whole sequence, inside the model "
                             "(every step then depends on future steps)", _INSTEAD)
        if not rule.frame and rule.kind not in ("global",) and any(rules[a.name].frame for a in ins if a.name in rules):
            raise node_error(node, "drops the time axis in a way that is not a sum or mean over all steps "
                             "(e.g. picks one step, or a max over time), so chunks cannot be combined",
                             "return the per-step tensor and reduce it outside the compiled module, "
                             "or use plan='none'")


def _stateful(gm: fx.GraphModule, rules: dict[str, NodeRule], slots: dict[str, list[fx.Node]]) -> set[str]:
    """Nodes that depend on attention or a scan (cannot be recomputed for earlier chunks)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        r = rules.get(node.name)
        if r is None or not r.frame or node.op != "call_function":
            continue
        if r.mixer or any(a.name in out for a in slots[node.name]):
            out.add(node.name)
    return out


def _region_outputs(gm: fx.GraphModule, nodes: dict[str, fx.Node], rules: dict[str, NodeRule],
                    out_args: list[fx.Node], needed: set[fx.Node]) -> list[RegionOutput]:
    outputs: list[RegionOutput] = []
    seen: set[str] = set()
    globals_used = [n for n in gm.graph.nodes if n in needed and rules.get(n.name) is not None
                    and rules[n.name].kind == "global"]
    for a in [*out_args, *globals_used]:
        if a.name in seen or a.op == "placeholder":
            continue
        rule = rules[a.name]
        if rule.kind == "global":
            for s in slots_of(a):
                if len(rules[s.name].frame) > 1:
                    raise node_error(a, "reduces a tensor with two time axes (e.g. attention weights) over "
                                     "the whole sequence", _INSTEAD)
            outputs.append(RegionOutput(a.name, "reduction", reduction=make_reduction(a)))
            seen.add(a.name)
        elif rule.frame:
            t = rule.frame
            shp = meta_shape(a)
            if len(t) != 1 or not t[0].pure(shp[t[0].dim]):
                raise node_error(a, "the module returns a tensor whose time axis is merged with another "
                                 "dim, or with two time axes", "return it with a separate time dim "
                                 "(reshape outside the compiled module)")
            outputs.append(RegionOutput(a.name, "time", dim=t[0].dim))
            seen.add(a.name)
    if not outputs:
        raise UnsupportedGraphError("the compiled function returns nothing that depends on the sequence: "
                                    f"nothing to chunk.\n  instead: {_INSTEAD}")
    return outputs


def outer_nodes(program: ChunkProgram) -> list[fx.Node]:
    """Nodes that stay outside the region: after the reductions (needed by outputs), in order."""
    gm = program.gm
    region_out = {o.name for o in program.outputs}
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    keep: set[fx.Node] = set()
    stack = [a for a in _flatten(out_node.args[0]) if isinstance(a, fx.Node)]
    while stack:
        n = stack.pop()
        if n in keep or n.name in region_out or n.op == "placeholder":
            continue
        keep.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in gm.graph.nodes if n in keep]


# --------------------------------------------------------------------------- dry run


class _DryCache:
    """Cache stand-in for the dry run: reads return empty tensors of the right shape (meta or fake, as the round runs)."""

    def __init__(self, program: ChunkProgram) -> None:
        self.program = program

    def read(self, name: str, lo: int, hi: int, start: int) -> torch.Tensor:
        val = self.program.nodes[name].meta["val"]
        spec = self.program.cache_points[name]
        shape = list(val.shape)
        shape[spec.dim] = hi - lo
        return torch.empty(shape, dtype=val.dtype, device=val.device)



def _sample_chunks(k: int) -> list[int]:
    return sorted({j for j in (0, 1, 2, k // 2, k - 2, k - 1) if 0 <= j < k})


def _run_chunk(program: ChunkProgram, flat: list[Any], j: int) -> ChunkEvaluator:
    ev = ChunkEvaluator(program, flat, j, _DryCache(program), dry=True)
    for o in program.outputs:
        if o.kind == "time":
            ev.chunk_value(o.name)
        else:
            o.reduction.partial(program.nodes[o.name], ev)
    for name in program.cache_points:  # a scan's carry is its last step (retention: from the reads)
        (lo, hi), = program.chunk_demand(name, j)
        if program.rules[name].kind == "scan" and hi > lo:
            ev.value(program.nodes[name], ((hi - 1, hi),))
        else:
            ev.chunk_value(name)
    return ev


def dry_run(program: ChunkProgram, example_flat: Sequence[Any], max_rounds: int = 64) -> list[str]:
    """Step 4 of the module doc: fills ``program.cache_points`` retention and ``estimates``.

    A round runs on meta tensors where the example lives on one device (C++ meta kernels, not
    fake tensors' Python dispatch); a round that fails there for any other reason than a missing
    cache point or a refusal of the program reruns on fake tensors, which decide (and word any
    refusal of an op)."""
    notes: list[str] = []
    on_meta = _meta_example(example_flat)
    runner = on_meta or _fake_example(example_flat)
    sample = _sample_chunks(program.num_chunks)
    for _ in range(max_rounds):
        try:
            stats = _sampled_stats(program, sample, *runner)
        except NeedsCache as nc:
            node = nc.node
            frame = program.rules[node.name].frame
            if len(frame) != 1 or not frame[0].pure(meta_shape(node)[frame[0].dim]):
                raise node_error(node, "later chunks read earlier steps of this value, but it has no single "
                                 "time axis gradshard can cache", _INSTEAD) from None
            program.cache_points[node.name] = CacheSpec(node.name, frame[0].dim, frame[0].length, None,
                                                        "read by later chunks (window)")
            program.refresh_uses()
            notes.append(f"cache point {node.name}: later chunks read its earlier steps")
            continue
        except Exception as exc:  # noqa: BLE001 - not runnable on meta tensors: fake tensors decide
            if runner is not on_meta or (isinstance(exc, GradshardError) and exc.__cause__ is None):
                raise  # a refusal of the program itself, not of an op on meta tensors
            runner = _fake_example(example_flat)
            continue
        break
    else:
        raise UnsupportedGraphError("gradshard internal: the chunk dry run did not converge")
    _set_retention(program, stats)
    program.estimates = _estimates(program, stats)
    return notes


_Stats = dict[int, tuple[int, int, list[tuple[str, int, int]]]]


def _meta_example(example_flat: Sequence[Any]) -> Optional[tuple[list[Any], Any]]:
    """The example on meta tensors and the mode that keeps every op there, or None when the
    example's tensors live on several devices (or none), or under autocast (which casts ops on
    its device's tensors, never on meta ones)."""
    devices = {x.device for x in example_flat if isinstance(x, torch.Tensor)}
    if len(devices) != 1:
        return None
    (device,) = devices
    if torch.is_autocast_enabled(device.type):
        return None
    return [to_meta(x) for x in example_flat], OnMeta(device)


def _fake_example(example_flat: Sequence[Any]) -> tuple[list[Any], Any]:
    """The example on fake tensors and their mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_flat], mode


def _sampled_stats(program: ChunkProgram, sample: list[int], flat: list[Any], mode: Any) -> _Stats:
    """``chunk -> (FLOPs, peak bytes, cache reads)`` for the sampled chunks, run under ``mode``."""
    stats: _Stats = {}
    with mode, RecursionGuard():
        for j in sample:
            with FlopCounterMode(display=False) as fc:
                ev = _run_chunk(program, flat, j)
            stats[j] = (fc.get_total_flops(), ev.peak_bytes, list(ev.cache_reads))
    return stats


def _set_retention(program: ChunkProgram, stats: dict[int, tuple[int, int, list[tuple[str, int, int]]]]) -> None:
    reads: dict[str, list[tuple[int, int, int]]] = {n: [] for n in program.cache_points}
    for j, (_, _, rs) in stats.items():
        for name, lo, hi in rs:
            reads[name].append((j, lo, program.bounds[j][0]))
    k = program.num_chunks
    for name, spec in list(program.cache_points.items()):
        rs = reads[name]
        all_past = any(lo == 0 and (j >= 3 or k <= 3) for j, lo, _ in rs)
        if all_past or not rs:
            retention = None if (all_past or spec.reason.startswith(("keys", "values"))) else 1
        else:
            retention = max(s - lo for _, lo, s in rs)
        program.cache_points[name] = CacheSpec(spec.name, spec.dim, spec.length, retention, spec.reason)
    program.refresh_uses()  # the chunk windows follow what the cache points keep


def _estimates(program: ChunkProgram, stats: dict[int, tuple[int, int, list[tuple[str, int, int]]]]) -> list[ChunkEstimate]:
    k = program.num_chunks
    per_step: dict[str, int] = {}
    for name, spec in program.cache_points.items():
        val = program.nodes[name].meta["val"]
        per_step[name] = val.numel() * val.element_size() // max(val.shape[spec.dim], 1)
    sampled = sorted(stats)
    out: list[ChunkEstimate] = []
    for j in range(k):
        lo, hi = program.bounds[j]
        a = max((s for s in sampled if s <= j), default=sampled[0])
        b = min((s for s in sampled if s >= j), default=sampled[-1])
        w = 0.0 if b == a else (j - a) / (b - a)
        flops = round(stats[a][0] * (1 - w) + stats[b][0] * w)
        act = round(stats[a][1] * (1 - w) + stats[b][1] * w)
        read = sum(per_step[n] * (lo if spec.retention is None else min(lo, spec.retention))
                   for n, spec in program.cache_points.items())
        write = sum(per_step[n] * ((hi - lo) if spec.retention is None else min(hi - lo, spec.retention))
                    for n, spec in program.cache_points.items())
        out.append(ChunkEstimate(flops, act, read, write))
    return out


# --------------------------------------------------------------------------- the pass


@graph_pass
def plan_chunk_program(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Prove the graph runs one chunk at a time and build its chunk program (analysis only).

    Stores the :class:`~gradshard.plans.chunked.runtime.ChunkProgram` in
    ``ctx.analyses["chunks"]``; notes list the chunks, cache points and region outputs.
    """
    tl = ctx.analyses.get("time")
    if tl is None:
        raise UnsupportedGraphError("chunked plans need the time analysis (annotate_time_locality) first")
    program = build_chunk_program(gm, tl, ctx.regions, ctx.options.chunk_size, ctx.example_inputs)
    flat = list(ctx.example_inputs)
    flat += hoisted_values(program, flat)
    notes = dry_run(program, flat)
    ctx.analyses["chunks"] = program
    k = program.num_chunks
    lines = [f"T={program.seq_len}, chunk_size={program.chunk_size}: {k} chunk(s)"]
    for name, spec in program.cache_points.items():
        keep = "all past steps" if spec.retention is None else f"last {spec.retention} step(s) per chunk"
        lines.append(f"cache point {name} ({spec.reason}): keeps {keep}")
    for o in program.outputs:
        what = f"time output (dim {o.dim})" if o.kind == "time" else f"reduction split per chunk ({o.reduction.kind})"
        lines.append(f"region output {o.name}: {what}")
    if program.hoisted:
        lines.append(f"hoisted (no gradient, no chunk rule; computed once for the whole sequence, sliced per "
                     f"chunk): {', '.join(program.hoisted)}")
    for name in program.attention:
        if "flash" in program.rules[name].note:
            lines.append(f"{name}: flash attention against the KV cache (GQA native)")
    for name, rule in program.rules.items():
        if rule.reads is not None and rule.kind == "mixer":
            lines.append(f"{name}: block-read scan -- {rule.note}")
    lines.append(f"cache at full length: {program.cache_bytes():,} bytes")
    return PassResult(gm, notes=tuple(lines + notes))
