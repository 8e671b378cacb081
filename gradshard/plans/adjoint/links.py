"""Links between consecutive regions, made on the final rewritten graph (``rewrite_adjoint``'s last steps).

* :func:`assign_gradient_donors`: a region whose output's gradient comes from one other region
  alone writes its input's gradient into that buffer (:mod:`gradshard.plans.adjoint.donate`).
* :func:`chain_layer_inputs` (``recompute_layer_inputs=True``): every other layer's input
  recomputed from the layer before it, not kept.
* :func:`recycle_segment_inputs` (``reuse_input_buffers=True``, the default): a time-local
  segment after the last region (the final norm, head and loss) writes its input's gradient over
  that input's rows, once its shards no longer read them.

Chained inputs. The adjoint plans keep each layer's input (the residual stream, ``B*T*d``) for its backward: at
long T those inputs are most of what a step keeps. A region's input that is the output of the
region before it, and read by nothing else, can instead be recomputed per backward window by
rerunning that region's forward -- producers, scan from its state checkpoint at the shard start,
readout -- on the window. The source region exports its checkpoints (one small tensor) and the
chained region receives the source's own inputs, which the source keeps anyway; the chained
input itself is then kept by no one.

A chain is one link long (a source is never itself chained, so each backward window reruns one
layer's forward): layers alternate between kept and recomputed inputs, about half the layer
inputs' memory for one more forward of every other layer. Exact: the same ops on the same rows.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

from gradshard.plans.adjoint.local import LocalSegment
from gradshard.plans.adjoint.runtime import AdjointRegion, ChainedInput

__all__ = ["assign_gradient_donors", "chain_layer_inputs", "recycle_segment_inputs"]


def _source_of(x: object, calls: dict[fx.Node, AdjointRegion]) -> tuple[fx.Node, int] | None:
    """``(call, output index)`` when ``x`` is a readout output of a region call."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem):
        return None
    call, j = x.args
    if call not in calls or not isinstance(j, int) or j >= len(calls[call].io.output_time_dims):
        return None
    return call, j


def chain_layer_inputs(gm: fx.GraphModule) -> list[str]:
    """Make each region whose time-carrying input is the sole use of the previous region's output
    recompute that input from the previous region (not itself chained); a note per link."""
    calls = {n: gm.get_submodule(n.target) for n in gm.graph.nodes
             if n.op == "call_module" and isinstance(gm.get_submodule(n.target), AdjointRegion)}
    notes: list[str] = []
    exported: dict[fx.Node, fx.Node] = {}  # source call -> the getitem of its checkpoint stack
    for call, mod in calls.items():  # graph order: a source is decided before its reader
        n_base = len(call.args) - mod.n_extra
        for i, (x, d) in enumerate(zip(call.args[:n_base], mod.io.input_time_dims)):
            src = _source_of(x, calls)
            if d is None or i in mod.remats or src is None or len(x.users) != 1 or mod.chained:
                continue
            scall, j = src
            source = calls[scall]
            if source.chained:
                continue  # one link: the source's own input is kept
            s_base = len(scall.args) - source.n_extra
            if scall not in exported:
                source.exports_checkpoints = True
                k = len(source.io.output_time_dims) + int(source.io.final_state)
                with gm.graph.inserting_after(scall):
                    exported[scall] = gm.graph.call_function(operator.getitem, (scall, k))
                exported[scall].meta = {"val": None, "stack_trace": scall.meta.get("stack_trace")}
            ck = exported[scall]
            # the source's arguments follow this region's own extras: its kept inputs, its extras, the stack
            kept = [t for t in range(s_base) if t not in source.recomputed()]
            first = len(call.args) - n_base + len(kept)
            s_extras = scall.args[s_base:]
            call.args = (*call.args, *(scall.args[t] for t in kept), *s_extras, ck)
            mod.n_extra += len(kept) + len(s_extras) + 1
            slots = tuple(first - len(kept) + kept.index(t) if t in kept else None for t in range(s_base))
            mod.chained[i] = ChainedInput(i, source, j, slots, tuple(range(first, first + len(s_extras))),
                                          first + len(s_extras))
            notes.append(f"{mod.region_name}: input `{x.name}` is recomputed in the backward from {source.region_name} "
                         f"(its forward rerun per window from its state checkpoints), not kept")
    return notes


def _input_grads(mod: torch.nn.Module) -> Optional[list[str]]:
    """Per call argument of region module ``mod``, what its backward returns for that argument's
    gradient: ``"fresh"`` (a time-carrying input: a full-length buffer it alone holds),
    ``"none"`` (an extra input: read without grad) or ``"other"``."""
    if isinstance(mod, AdjointRegion):
        return ["fresh" if d is not None else "other" for d in mod.io.input_time_dims] + ["none"] * mod.n_extra
    if isinstance(mod, LocalSegment):
        return ["fresh" if d is not None else "other" for d in mod.input_time_dims]
    return None


def _one_fresh_gradient(g: fx.Node, calls: dict[fx.Node, torch.nn.Module]) -> Optional[fx.Node]:
    """The one region call that returns a gradient for ``g``, when that gradient is a buffer of its
    own and every other reader of ``g`` is a region call that returns none for it."""
    giving: list[tuple[fx.Node, str]] = []
    for user in g.users:
        kinds = _input_grads(calls[user]) if user in calls else None
        if kinds is None:
            return None
        giving += [(user, kinds[p]) for p, a in enumerate(user.args) if a is g and kinds[p] != "none"]
    return giving[0][0] if len(giving) == 1 and giving[0][1] == "fresh" else None


def assign_gradient_donors(gm: fx.GraphModule) -> list[str]:
    """Set ``donors`` (input index -> output index) on each ``AdjointRegion`` of ``gm`` whose output
    gradient it may write its input's gradient into; returns a note per donation.

    An output qualifies when one call of another region module takes it as a time-carrying input
    (that backward returns a full-length buffer it alone holds: a fresh one, or its own donated
    one), every other reader is a region that reads it without grad (a chained region's extra
    input), and an input of the same shape, dtype and time dim needs a gradient. Must run on the
    final graph: a later consumer of the output would break the proof.
    """
    calls = {n: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    notes: list[str] = []
    for call, mod in calls.items():
        if not isinstance(mod, AdjointRegion):
            continue
        mod.donors = {}
        n_base = len(call.args) - mod.n_extra
        for g in call.users:
            if g.op != "call_function" or g.target is not operator.getitem:
                continue
            j = g.args[1]
            user = _one_fresh_gradient(g, calls) if j < len(mod.io.output_time_dims) else None
            if user is None:
                continue
            out_val, td = g.meta.get("val"), mod.io.output_time_dims[j]
            for i, x in enumerate(call.args[:n_base]):
                x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
                if (i in mod.donors or mod.io.input_time_dims[i] != td or not isinstance(x_val, Tensor)
                        or not isinstance(out_val, Tensor) or x_val.shape != out_val.shape
                        or x_val.dtype != out_val.dtype):
                    continue
                mod.donors[i] = j
                notes.append(f"{mod.region_name}: the gradient of input `{x.name}` is written into the gradient "
                             f"of output {j} (its gradient comes from `{user.target}` alone): one residual-stream buffer, not two")
                break
    return notes


def recycle_segment_inputs(gm: fx.GraphModule) -> list[str]:
    """Mark, per :class:`LocalSegment` of ``gm``, the time-carrying inputs whose storage its backward
    may take for their gradient (``recycled``); a note per input.

    The segment after the last region (norm, head, loss) keeps its input -- the residual stream --
    for its backward and returns that input's gradient, a second buffer of the same size, while
    every earlier region still keeps its own input: at long T that is the step's peak. Shard
    ``[s, e)``'s backward reads rows ``[s - halo, e)`` of the input and no later shard reads rows
    ``[s, e)``, so they may take the gradient (:class:`~gradshard.plans.adjoint.donate.DonatedGrad`).
    Sound when nothing else reads the input: it is a region's readout output (a fresh tensor no
    region saves), this segment is its only user, and it is passed once."""
    regions = {n: gm.get_submodule(n.target) for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), AdjointRegion)}
    notes: list[str] = []
    for call in gm.graph.nodes:
        if call.op != "call_module" or not isinstance(seg := gm.get_submodule(call.target), LocalSegment):
            continue
        seg.recycled = set()
        for i, (x, d) in enumerate(zip(call.args, seg.input_time_dims)):
            val = x.meta.get("val") if isinstance(x, fx.Node) else None
            if (d is None or _source_of(x, regions) is None or len(x.users) != 1 or call.args.count(x) != 1
                    or not isinstance(val, Tensor) or not val.dtype.is_floating_point):
                continue
            seg.recycled.add(i)
            notes.append(f"{seg.region_name}: the gradient of input `{x.name}` is written over that input's rows "
                         f"as its shards finish with them (no second residual-stream buffer)")
    return notes
