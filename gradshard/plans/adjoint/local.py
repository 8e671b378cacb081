"""Time-local segments run shard by shard and recomputed in the backward (adjoint plans).

The adjoint plans keep, per recurrence layer, only the layer input and state checkpoints.
What follows the last recurrence -- typically the final norm and the LM head -- is plain
autograd otherwise, and autograd keeps every intermediate it needs for its backward: for an
RMSNorm + linear head that is the head input, the normalised input, its scaled copy and
the inverse RMS (three to four copies of the residual stream). Such a segment is pointwise
in time, so the backward can recompute it one shard at a time from its inputs.

:class:`LocalSegment` (installed by ``rewrite_adjoint``, see
:mod:`gradshard.plans.adjoint.tail`) runs a captured subgraph ``inputs -> outputs``:

* forward, without autograd, shard by shard (outputs written into full-length tensors);
  saves the inputs only (parameters and the time-carrying inputs);
* backward, per shard: recompute the subgraph on the shard's inputs with autograd, apply
  the VJP of the incoming output gradients, write the input gradients into the shard's
  rows and accumulate the parameter gradients. Exact: the same ops on the same rows.

Every time-carrying input and output has one time dim of full length. With a ``halo`` (a
causal ``conv1d`` inside: position ``t`` reads ``t - halo .. t``) each shard ``[s, e)`` runs on
the inputs' rows ``[s - halo, e)`` and keeps its outputs' last ``e - s`` rows; the backward
adds the window's input gradients into those rows (overlapping windows add up). An output
may instead be a reduction over time (the loss; its time dim is ``None``): the graph returns
its per-shard numerator and, appended to the outputs, its denominator
(:mod:`gradshard.plans.adjoint.reductions`); the forward sums both over shards and divides
once, the backward hands each shard's numerator the output gradient over the total
denominator. Exact up to the order of the sum.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch import Tensor, nn

from gradshard.errors import GradshardError
from gradshard.ir import Stage
from gradshard.autocast import AutocastState
from gradshard.runtime.compiled import GraphCompiler, LengthCache, RegionGraphs

from gradshard.plans.adjoint.donate import DonatedGrad, donatable
from gradshard.plans.adjoint.respecialize import (DimFact, add_input_grad, grad_leaves, respecialize, shard_bounds,
                                                  time_length, wanted_grads)

__all__ = ["LocalSegment", "LocalSegmentFunction"]


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class LocalSegment(LengthCache, nn.Module):
    """A time-local subgraph run in shards; backward recomputes it shard by shard.

    ``graph``: the subgraph (placeholders = inputs, output = tuple of outputs, then the
    denominators); ``input_time_dims`` / ``output_time_dims``: the time dim of each (``None``:
    an input without time, or an output reduced over time); ``divisors``: per reduced output
    in order, the position of its denominator among the graph's outputs (``None``: a sum);
    ``facts``: time facts by node name, to re-specialise ``graph`` to a shard; ``halo``: the
    steps before a shard its outputs read (no reduced output then).
    """

    def __init__(self, name: str, graph: fx.GraphModule, facts: Mapping[str, tuple[Optional[DimFact], ...]],
                 input_time_dims: Sequence[Optional[int]], output_time_dims: Sequence[Optional[int]], *,
                 captured_len: int, shard_size: int, describe: str = "", costs: Optional[Mapping[str, int]] = None,
                 divisors: Sequence[Optional[int]] = (), halo: int = 0) -> None:
        super().__init__()
        self.region_name = name
        self.graph_module = graph
        self.facts = dict(facts)
        self.input_time_dims = tuple(input_time_dims)
        self.output_time_dims = tuple(output_time_dims)
        reduced = [i for i, d in enumerate(self.output_time_dims) if d is None]
        if len(reduced) != len(divisors):
            raise ValueError(f"{name}: {len(reduced)} reduced output(s) but {len(divisors)} divisor(s)")
        self.divisors = tuple(divisors)
        if halo and reduced:
            raise ValueError(f"{name}: a reduction over time cannot run in windows with a halo ({halo} steps)")
        self.halo = int(halo)
        #: reduced output position -> position of its denominator among the graph's outputs
        self.denominator_of = dict(zip(reduced, self.divisors))
        self.captured_len = int(captured_len)
        self.shard_size = int(shard_size)
        self.describe = describe
        self.costs = dict(costs or {})
        self._cache: dict[int, fx.GraphModule] = {}
        #: the subgraph compiled per shard length (when the program is composed with Inductor)
        self.graphs = RegionGraphs(name)
        #: time-carrying inputs whose storage the backward takes for their gradient (set by
        #: :func:`gradshard.plans.adjoint.links.recycle_segment_inputs`)
        self.recycled: set[int] = set()

    def use_graph_compiler(self, compiler: Optional[GraphCompiler]) -> None:
        """Run the per-shard subgraph compiled by ``compiler`` (``None``: eagerly); see
        :mod:`gradshard.runtime.compiled`. Called by :func:`gradshard.compose.compose_graph`."""
        self.graphs.set_compiler(compiler)

    def runner(self, length: int) -> Any:
        """What runs the subgraph on ``length`` steps: the graph, or its compiled variants."""
        return self.graphs.get(length, lambda: self.graph_for(length))

    def graph_for(self, length: int) -> fx.GraphModule:
        """The subgraph re-specialised to ``length`` steps (cached)."""
        if length == self.captured_len:
            return self.graph_module
        g = self._cache.get(length)
        if g is None:
            g = respecialize(self.graph_module, self.facts, self.captured_len, length, keep_values=False)
            self._cache[length] = g
        return g

    def seq_len(self, inputs: Sequence[Tensor]) -> int:
        return time_length(inputs, self.input_time_dims, f"{self.region_name}: no segment input")

    def shards(self, T: int) -> list[tuple[int, int]]:
        return shard_bounds(T, self.shard_size)

    def window_start(self, s: int) -> int:
        """First input row shard ``[s, e)`` reads."""
        return max(0, s - self.halo)

    def window(self, inputs: Sequence[Any], s: int, e: int) -> list[Any]:
        """Rows ``[s - halo, e)`` of the time-carrying inputs (contiguous: the graph's views expect it)."""
        w = self.window_start(s)
        return [x.narrow(d, w, e - w).contiguous() if d is not None else x for x, d in zip(inputs, self.input_time_dims)]

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return LocalSegmentFunction.apply(self, *inputs)

    def stages(self) -> list[Stage]:
        """Forward in shards (saving the inputs), then per shard in reverse: recompute + VJP."""
        T = self.captured_len
        c = self.costs
        n = self.region_name
        shards = self.shards(T)
        per_step = lambda key: c.get(key, 0) / max(T, 1)  # noqa: E731
        out = [Stage(name=f"{n}:forward", kind="forward_chunk", phase="forward", region=n,
                     memory_bytes=int(c.get("saved_bytes", 0)), flops=int(c.get("fwd_flops", 0)), kernel="torch",
                     note=f"{len(shards)} shard(s) of {self.shard_size}"
                          + (f" (+{self.halo} steps of halo)" if self.halo else "") + "; saves its inputs only "
                          f"(autograd would keep {c.get('autograd_saved_bytes', 0):,} B)")]
        for k in range(len(shards) - 1, -1, -1):
            s, e = shards[k]
            # the last backward stage names the forward stage: Program.estimated_peak_bytes frees it there
            out.append(Stage(name=f"{n}:shard{k}:vjp_shard", kind="vjp_shard", phase="backward", region=n,
                             memory_bytes=int(per_step("work_bytes") * (e - self.window_start(s))),
                             flops=int((per_step("fwd_flops") + per_step("bwd_flops")) * (e - self.window_start(s))),
                             kernel="torch",
                             note=f"{n}:forward" if k == 0 else f"recompute steps [{s}, {e}) and apply the VJP"))
        return out

    def extra_repr(self) -> str:
        return f"{self.region_name}: {self.describe}, shard_size={self.shard_size}" + (f", halo={self.halo}" if self.halo else "")


def _shard_grad(ctx: Any, i: int, g: Tensor, td: Optional[int], s: int, e: int) -> Tensor:
    """The gradient reaching output ``i`` of shard ``[s, e)``: its rows, or for a reduction over
    time the whole gradient (over the total denominator: ``den`` carries no gradient)."""
    if td is not None:
        return g.narrow(td, s, e - s)
    den = ctx.dens.get(i)
    return g if den is None else g / den


class LocalSegmentFunction(torch.autograd.Function):
    """Sharded forward saving the inputs; backward recomputes each shard and applies its VJP."""

    @staticmethod
    def forward(ctx: Any, seg: LocalSegment, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        T = seg.seq_len(inputs)
        outputs: list[Optional[Tensor]] = [None] * len(seg.output_time_dims)
        dens: dict[int, Tensor] = {}
        with torch.no_grad():
            for s, e in seg.shards(T):
                w = seg.window_start(s)
                ys = _as_list(seg.runner(e - w)(*seg.window(inputs, s, e)))
                for i, (y, td) in enumerate(zip(ys, seg.output_time_dims)):
                    if td is None:  # a reduction over time: numerator (and denominator) summed
                        outputs[i] = y if outputs[i] is None else outputs[i] + y
                        k = seg.denominator_of[i]
                        if k is not None:
                            dens[i] = ys[k] if i not in dens else dens[i] + ys[k]
                        continue
                    if outputs[i] is None:
                        shape = list(y.shape)
                        shape[td] = T
                        outputs[i] = y.new_empty(shape)
                    outputs[i].narrow(td, s, e - s).copy_(y.narrow(td, s - w, e - s))
        for i, den in dens.items():
            outputs[i] = outputs[i] / den
        ctx.seg = seg
        ctx.T = T
        ctx.dens = dens
        ctx.autocast = AutocastState.current()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        return tuple(outputs)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        with ctx.autocast.restore():  # the shards are recomputed as the forward ran them
            return LocalSegmentFunction._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        seg: LocalSegment = ctx.seg
        inputs = _saved_inputs(ctx)
        needs = ctx.needs_input_grad[1:]
        grads_in: list[Optional[Tensor]] = [None] * len(inputs)
        if not any(g is not None for g in grads):
            return (None, *grads_in)
        # inputs whose rows take their own gradient once no later shard reads them
        recycled = {i: DonatedGrad(inputs[i].detach(), seg.input_time_dims[i]) for i in sorted(seg.recycled)
                    if needs[i] and donatable(inputs[i], tuple(inputs[i].shape), inputs[i].dtype, inputs[i].device)}
        ctx.recycled = bool(recycled)
        shards = seg.shards(ctx.T)
        calls = seg.graphs.calls
        whole = calls is not None and segment_vjp not in calls.failed
        flags = tuple(bool(n) for n in needs)
        for k in range(len(shards) - 1, -1, -1):
            s, e = shards[k]
            w = seg.window_start(s)
            # the window's rows of each time-carrying input (contiguous: the graph's views expect it)
            leaves = [x if d is None else x.narrow(d, w, e - w).contiguous() for x, d in zip(inputs, seg.input_time_dims)]
            leaves = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
            cots = [None if g is None else _shard_grad(ctx, i, g, td, s, e)
                    for i, (g, td) in enumerate(zip(grads, seg.output_time_dims))]
            args = (seg, flags, e - w, s - w, e - s, len(leaves), *leaves, *cots)
            got = calls(segment_vjp, *args, fallback=segment_vjp_graphs) if whole else segment_vjp_graphs(*args)
            targets = wanted_grads(leaves, flags)
            del leaves, cots, args
            shard_grads = {i: g for i, g in zip(targets, got) if g is not None}
            for i, gv in shard_grads.items():
                if i not in recycled:
                    add_input_grad(grads_in, i, gv, seg.input_time_dims[i], w, e,
                                   lambda i=i: torch.zeros_like(inputs[i]))
            for i, buf in recycled.items():  # after the VJP: the shard's recompute read these rows
                buf.close(s, e, shard_grads.get(i), w, e)
            del got, shard_grads
        for i, buf in recycled.items():
            grads_in[i] = buf.result()
        return (None, *grads_in)


def _saved_inputs(ctx: Any) -> list[Tensor]:
    """The inputs the forward saved; a clear error where an earlier backward wrote a gradient over them."""
    try:
        return list(ctx.saved_tensors)
    except RuntimeError as exc:
        if not getattr(ctx, "recycled", False):
            raise
        raise GradshardError(
            f"{ctx.seg.region_name}: a second backward through the same forward (retain_graph=True), but the first "
            "wrote its input's gradient over the input it would recompute from, to save memory. Compile with "
            "reuse_input_buffers=False to keep the input (one more residual-stream buffer at the backward's peak), "
            "or run the forward again before each backward") from exc


# --------------------------------------------------------------------------- one backward shard


def _segment_vjp_as(traced: bool, seg: LocalSegment, needs: tuple[bool, ...], length: int, offset: int, steps: int,
                    n_leaves: int, *args: Optional[Tensor]) -> tuple[Tensor, ...]:
    """A backward shard of ``seg`` as one function: ``args`` = the window's leaves (``length`` steps,
    detached) and the cotangent of each output (None where none), the time outputs' on the shard's
    steps ``[offset, offset + steps)`` of the window. Recomputes the subgraph with grad and returns
    the gradient of every leaf that needs one (None where none reaches it). ``traced``: on the graph
    itself (:func:`segment_vjp`), else on its compiled variant (:func:`segment_vjp_graphs`)."""
    leaves, cots = list(args[:n_leaves]), args[n_leaves:]
    with torch.enable_grad():
        leaves = grad_leaves(leaves, needs)
        run = seg.graph_for(length) if traced else seg.runner(length)
        ys = [y if td is None or not isinstance(y, Tensor) else y.narrow(td, offset, steps)
              for y, td in zip(_as_list(run(*leaves)), seg.output_time_dims)]
        pairs = [(y, g) for y, g in zip(ys, cots) if g is not None and isinstance(y, Tensor) and y.requires_grad]
        targets = wanted_grads(leaves, needs)
        got = (torch.autograd.grad([y for y, _ in pairs], [leaves[i] for i in targets], [g for _, g in pairs],
                                   allow_unused=True) if pairs and targets else [None] * len(targets))
    return tuple(got)


def segment_vjp(*args: Any) -> tuple[Tensor, ...]:
    """A tail segment's backward shard traced whole: the recompute and its VJP in one graph
    (``torch.autograd.grad`` inside ``make_fx``). Arguments as :func:`_segment_vjp_as`'s."""
    return _segment_vjp_as(True, *args)


def segment_vjp_graphs(*args: Any) -> tuple[Tensor, ...]:
    """:func:`segment_vjp` on the subgraph's compiled variant, autograd around it: without a compiler,
    or where the whole function is not compiled."""
    return _segment_vjp_as(False, *args)
