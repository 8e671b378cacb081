"""Adjoint-sharding runtime: one autograd.Function per linear-recurrence region (one layer).

A region (built by ``rewrite_adjoint``) is three pieces cut from the captured graph:

* ``producer``: region inputs (the layer input ``x``, parameters) -> ``(a, u, h0, r...)``,
  time-local (a causal window of ``w`` steps means a halo of ``w-1`` steps per shard);
* the recurrence ``h_t = a_t * h_{t-1} + u_t`` (diagonal/scalar per head/dense);
* ``readout``: ``(h, r...) -> y...`` pointwise in time (``r`` are the producer values it reads).

Forward (``plan="adjoint"`` and ``"truncated_adjoint"``), shard by shard without autograd::

    for each shard [s, e):  producers on x[s-halo : e+halo] -> a, u, r (trimmed to the shard
                            inside the producer graph: :func:`shard_producers`)
                            h = scan(a, u, from the state at s-1) -> y[s:e] = readout(h, r)
    saved: x, the parameters' references, and h at every shard boundary (T/shard states)

A layer input that is a cheap pointwise function of graph inputs and parameters (layer 0's
``embedding(W, ids)``) is not saved: the region receives its sources as extra inputs
(:class:`InputRemat`), saves those, and recomputes the input's window in each backward shard.

Backward, shards right to left; only one shard's graph is ever alive::

    recompute producers on the window (grad on), h from its checkpoint (no grad)
    g       = dL/dh from the readout's VJP with the true incoming dL/dy (all layers' terms)
    truncated: g_t -= kappa_t g_{t+W} (gradshard.plans.adjoint.truncated: then lam below is the windowed one)
    lam     = lam_t = g_t + a_{t+1} lam_{t+1}, carried across shards
    da = lam * h_{t-1}, du = lam, dh0 = a_1 lam_1  ->  one VJP through the shard's producers

A *chunked* region (an outer-product state read by a contraction: SSD, decayed linear
attention; :mod:`gradshard.plans.adjoint.chunked`) runs each shard as one graph in block form,
``(window, h_start) -> (y, h_end)``, never forming per-step states; its backward reruns that
graph from the checkpoint with grad and takes one VJP with ``dL/dy`` and the carried
``dL/dh_end``, whose ``dL/dh_start`` is the carry for the shard before.

The producer/readout graphs carry the captured length in their views; they are
re-specialised per window length (:mod:`gradshard.plans.adjoint.respecialize`) and cached,
so a region runs at any sequence length. When the program is composed with Inductor
(:func:`gradshard.compose.compose_graph` calls ``use_graph_compiler``), a per-step shard runs as
one compiled function, forward (producers, scan, readout) and backward (recompute, readout VJP,
adjoint scan, producers' VJP) alike (:mod:`gradshard.plans.adjoint.shards`); the other graphs
(chunked shards, recomputed inputs, the truncated adjoint's shards) go through
:meth:`AdjointRegion.runner`: compiled once per window length and input signature
(:mod:`gradshard.runtime.compiled`), the backward recompute's variant differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch import Tensor, nn

from gradshard.ir import Stage
from gradshard.autocast import AutocastState
from gradshard.runtime.compiled import GraphCompiler, LengthCache, RegionGraphs

from gradshard.plans.adjoint.layout import (RegionIO, ScanSpec, canon, narrow, shard_producers, state_canon,
                                           state_uncanon, uncanon)
from gradshard.plans.adjoint.chunked import ChunkedForm, chunked_shard_graph
from gradshard.plans.adjoint.donate import DonatedGrad, donatable
from gradshard.plans.adjoint.respecialize import DimFact, add_input_grad, respecialize, shard_bounds, time_length
from gradshard.plans.adjoint.scan import recurrence_for
from gradshard.plans.adjoint.shards import (adjoint_shard_grads, chunked_shard_grads, compiled_shard_grads,
                                           forward_shard, forward_shard_graphs, shard_vjp)
from gradshard.plans.adjoint.truncated import ChunkedTruncation, StepTruncation

__all__ = ["InputRemat", "ChainedInput", "AdjointRegion", "AdjointFunction"]


def _zeros_like_input(x: Optional[Tensor], like: Optional[tuple]) -> Tensor:
    """A zero gradient buffer for a region input; a recomputed input (``x is None``) is described by
    ``like = (shape, dtype, device)``."""
    if x is not None:
        return torch.zeros_like(x)
    shape, dtype, device = like
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class InputRemat:
    """Region input ``index`` is recomputed (not saved) from some of the region's extra inputs.

    The extra inputs follow the region's own inputs in the call; ``leaf_slots`` are positions
    among them (graph inputs, parameters, constants, values the caller keeps anyway) and
    ``leaf_time_dims`` their time dims. The recomputation reads ``halo`` steps before each
    position (0: pointwise in time), so a window of the input is the recomputation on the
    leaves from ``halo`` steps earlier, trimmed.
    """

    index: int
    leaf_slots: tuple[int, ...]
    leaf_time_dims: tuple[Optional[int], ...]
    halo: int = 0


@dataclass(frozen=True)
class ChainedInput:
    """Region input ``index`` is output ``output`` of the region before (``source``), recomputed per
    backward window by rerunning that region's forward from its state checkpoints, not kept.

    The source's call arguments are among this region's extra inputs: ``base_slots`` for its own
    inputs (None where the source recomputes that input itself: it is not passed), then
    ``extra_slots`` for its extras, and ``ckpt_slot`` for the checkpoint stack its forward exports.
    """

    index: int
    source: "AdjointRegion" = field(compare=False, repr=False)
    output: int = 0
    base_slots: tuple[Optional[int], ...] = ()
    extra_slots: tuple[int, ...] = ()
    ckpt_slot: int = 0


# --------------------------------------------------------------------------- the region module


class AdjointRegion(LengthCache, nn.Module):
    """One linear-recurrence region run with adjoint sharding (installed by ``rewrite_adjoint``).

    ``forward(*inputs)`` returns the region's outputs as a tuple (readout outputs, then the
    final state if the graph uses it). ``stages()`` lists what it runs, for the scheduler.
    """

    def __init__(self, name: str, producer: fx.GraphModule, readout: fx.GraphModule,
                 facts: Mapping[str, tuple[Optional[DimFact], ...]], scan: ScanSpec, io: RegionIO, *,
                 plan: str, shard_size: int, window: Optional[int] = None, describe: str = "",
                 costs: Optional[Mapping[str, int]] = None,
                 remats: Sequence[tuple[InputRemat, fx.GraphModule]] = (), n_extra: int = 0,
                 chunked: Optional[ChunkedForm] = None) -> None:
        super().__init__()
        self.region_name = name
        self.producer = producer
        self.readout = readout
        self.facts = dict(facts)
        self.scan = scan
        self.io = io
        self.plan = plan
        self.shard_size = int(shard_size)
        self.window = window
        self.describe = describe
        self.costs = dict(costs or {})
        #: shards run as one chunked graph each (:mod:`gradshard.plans.adjoint.chunked`), not per-step scans
        self.chunked = chunked
        self._cache: dict[tuple, fx.GraphModule] = {}
        self.rec = recurrence_for(scan.kind)
        self.kernel_backend: Optional[str] = None  # set by the lower_kernels pass
        self.remats = {r.index: r for r, _ in remats}
        self.remat_graphs = nn.ModuleDict({f"input{r.index}": g for r, g in remats})
        self.n_extra = int(n_extra)
        #: input index -> output index whose incoming gradient takes the input's gradient rows
        #: (set by :func:`gradshard.plans.adjoint.donate.assign_gradient_donors`)
        self.donors: dict[int, int] = {}
        #: inputs recomputed from the region before (set by ``chain_layer_inputs``); a region some
        #: other region chains from exports its state checkpoints as a last output
        self.chained: dict[int, ChainedInput] = {}
        self.exports_checkpoints = False
        #: compiled producer/readout graphs (when the program is composed with Inductor)
        self.graphs = RegionGraphs(name)

    # ---------------------------------------------------------------- graphs per length

    def use_graph_compiler(self, compiler: Optional[GraphCompiler]) -> None:
        """Run the per-shard graphs compiled by ``compiler`` (``None``: eagerly); see
        :mod:`gradshard.runtime.compiled`. Called by :func:`gradshard.compose.compose_graph`."""
        self.graphs.set_compiler(compiler)

    def runner(self, which: str, length: int) -> Any:
        """What runs graph ``which`` on ``length`` steps: the graph, or its compiled variants."""
        return self.graphs.get((which, length), lambda: self.graph_for(which, length))

    def producers_on(self, length: int, start: int, steps: int) -> Any:
        """What runs the producers on a ``length``-step window, their outputs trimmed to the window's
        steps ``[start, start + steps)`` (:func:`shard_producers`)."""
        return self.graphs.get(("producer", length, start, steps), lambda: self.trimmed_producer(length, start, steps))

    def trimmed_producer(self, length: int, start: int, steps: int) -> fx.GraphModule:
        """The producer graph itself (cached) on a ``length``-step window, trimmed to ``[start, start + steps)``."""
        key = ("producer", length, start, steps)
        g = self._cache.get(key)
        if g is None:  # the untrimmed graph at this length is not kept: nothing runs it
            g = shard_producers(self._at_length(self.producer, length), self.io, self.scan, start, steps)
            self._cache[key] = g
        return g

    def shard_on(self, length: int, start: int, steps: int, state_in: bool, truncated: Optional[str] = None) -> Any:
        """What runs a chunked shard (:func:`chunked_shard_graph`) on a ``length``-step window, its
        steps ``[start, start + steps)``; ``state_in``: the state enters after the window's inputs;
        ``truncated``: the truncated adjoint's form of it (``"keep"`` or ``"correct"``)."""
        key = ("shard", length, start, steps, state_in) + ((truncated,) if truncated else ())
        return self.graphs.get(key, lambda: self._chunked_shard(key))

    def _chunked_shard(self, key: tuple) -> fx.GraphModule:
        g = self._cache.get(key)
        if g is None:
            _, length, start, steps, state_in, *truncated = key
            g = chunked_shard_graph(self._at_length(self.producer, length), self._at_length(self.readout, steps),
                                    self.chunked, self.io, start, steps, state_in=state_in,
                                    has_h0=self.scan.has_h0, backend=self.kernel_backend,
                                    truncated=truncated[0] if truncated else None)
            self._cache[key] = g
        return g

    def graph_for(self, which: str, length: int) -> fx.GraphModule:
        """The producer or readout graph re-specialised to ``length`` steps (cached)."""
        if which == "producer":
            base = self.producer
        elif which == "readout":
            base = self.readout
        else:
            base = self.remat_graphs[which]
        if length == self.io.captured_len:
            return base
        key = (which, length)
        g = self._cache.get(key)
        if g is None:
            g = self._at_length(base, length)
            self._cache[key] = g
        return g

    def _at_length(self, base: fx.GraphModule, length: int) -> fx.GraphModule:
        """``base`` re-specialised to ``length`` steps (not cached; itself at the captured length)."""
        if length == self.io.captured_len:
            return base
        return respecialize(base, self.facts, self.io.captured_len, length, keep_values=False)

    # ---------------------------------------------------------------- calling

    def seq_len(self, inputs: Sequence[Tensor]) -> int:
        return time_length(inputs, self.io.input_time_dims, f"{self.region_name}: no region input")

    def shards(self, T: int) -> list[tuple[int, int]]:
        """Shard bounds; a chunked region's truncated shards are at most the window long
        (:class:`~gradshard.plans.adjoint.truncated.ChunkedTruncation` reads the next window's steps
        from the shards right of one)."""
        size = self.shard_size
        if self.chunked is not None and self.plan == "truncated_adjoint":
            size = min(size, self.window)
            if self.io.final_state and self.window < T:  # a shard ends at T-1-W: the final state's correction
                cut = T - self.window
                return shard_bounds(cut, size) + [(cut + s, cut + e) for s, e in shard_bounds(self.window, size)]
        return shard_bounds(T, size)

    def window_of(self, s: int, e: int, T: int) -> tuple[int, int]:
        lh, rh = self.io.halo
        return max(0, s - lh), min(T, e + rh)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return AdjointFunction.apply(self, *inputs)

    def recomputed(self) -> set[int]:
        """The inputs the forward does not keep: recomputed from extra inputs, or chained."""
        return set(self.remats) | set(self.chained)

    def remat_window(self, index: int, extras: Sequence[Tensor], ws: int, we: int, T: int) -> Tensor:
        """Window ``[ws, we)`` of region input ``index``, recomputed from the extra inputs (no grad)."""
        c = self.chained.get(index)
        if c is not None:
            args = [None if j is None else extras[j] for j in c.base_slots] + [extras[j] for j in c.extra_slots]
            return c.source.output_window(args, extras[c.ckpt_slot], ws, we, T)[c.output]
        r = self.remats[index]
        start = max(0, ws - r.halo)
        leaves = [narrow(extras[j], d, start, we - start) for j, d in zip(r.leaf_slots, r.leaf_time_dims)]
        with torch.no_grad():
            out = self.runner(f"input{index}", we - start)(*leaves)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.narrow(self.io.input_time_dims[index], ws - start, we - ws).detach()

    def output_window(self, args: Sequence[Optional[Tensor]], ckpts: Tensor, ws: int, we: int, T: int) -> list[Tensor]:
        """The outputs' steps ``[ws, we)`` (of ``T``), recomputed without grad from this region's call
        arguments (None: an input it recomputes itself) and the checkpoint stack its forward
        exported: producers, scan and readout from the shard start at or before ``ws``."""
        n_base = len(args) - self.n_extra
        inputs, extras = args[:n_base], args[n_base:]
        b = ws // self.shard_size * self.shard_size
        lo, hi = self.window_of(b, we, T)
        with torch.no_grad():
            leaves = [x if d is None else self.remat_window(i, extras, lo, hi, T) if x is None else x.narrow(d, lo, hi - lo)
                      for i, (x, d) in enumerate(zip(inputs, self.io.input_time_dims))]
            ys, _ = self.run_shard(leaves, hi - lo, b - lo, we - b, None if b == 0 else ckpts[b // self.shard_size - 1],
                                   self.chunked_at(T))
        return [y.narrow(td, ws - b, we - ws) for y, td in zip(ys, self.io.output_time_dims)]

    # ---------------------------------------------------------------- per-shard pieces

    def shard_window(self, inputs: Sequence[Tensor], s: int, e: int, T: int) -> tuple[list[Tensor], int, int]:
        """The inputs' steps of shard ``[s, e)``'s window, its length, and where the shard starts in it."""
        ws, we = self.window_of(s, e, T)
        return [narrow(x, d, ws, we - ws) for x, d in zip(inputs, self.io.input_time_dims)], we - ws, s - ws

    def chunked_at(self, T: int) -> bool:
        """Whether a ``T``-step call runs chunked shards: wherever the region has the form (under the
        truncated adjoint too: :class:`~gradshard.plans.adjoint.truncated.ChunkedTruncation`)."""
        return self.chunked is not None

    def run_shard(self, win: Sequence[Tensor], length: int, start: int, steps: int,
                  h: Optional[Tensor], chunked: bool,
                  how: Literal["whole", "graphs", "traced"] = "whole") -> tuple[list[Tensor], Tensor]:
        """The readout outputs of steps ``[start, start + steps)`` of a ``length``-step window of the
        inputs, and the state after them, from state ``h`` (None: the region's initial state);
        ``chunked``: as one chunked shard graph (:meth:`chunked_at`). Per-step shards, ``how``:
        ``"whole"`` (with a compiler and no grad: producers, scan and readout traced and compiled as
        one function, :func:`~gradshard.plans.adjoint.shards.forward_shard`), ``"graphs"`` (each
        graph through :meth:`producers_on` and :meth:`runner`) or ``"traced"`` (the graphs
        themselves: inside the traced function)."""
        if chunked:
            outs = self.shard_on(length, start, steps, h is not None)(*win, *([] if h is None else [h]))
            return list(outs[:-1]), outs[-1]
        calls = self.graphs.calls
        if how == "whole" and calls is not None and not torch.is_grad_enabled():
            *ys, h_end = calls(forward_shard, self, length, start, steps, *win, h, fallback=forward_shard_graphs)
            # compiled code may hand out the last step as a view of the shard's states: a checkpoint
            # must not keep them alive
            if h_end.untyped_storage().nbytes() > h_end.numel() * h_end.element_size():
                h_end = h_end.clone()
            return ys, h_end
        traced = how == "traced"
        prod = self.trimmed_producer(length, start, steps) if traced else self.producers_on(length, start, steps)
        outs = prod(*win)
        a, u, h0, rs = self.split(list(outs) if isinstance(outs, (tuple, list)) else [outs])
        if h is None:
            h = state_canon(h0, self.scan.rank)
        ac, uc = self.canon_au(a, u)
        hc = self.rec.scan(ac, uc, h, self.kernel_backend)
        ys = self.run_readout(self.h_for_readout(hc), rs, traced=traced)
        return ys, (hc[:, -1].clone() if hc.shape[1] else h)  # a copy: a view would keep the shard alive

    def split(self, prod: list[Any]) -> tuple[Optional[Tensor], Tensor, Optional[Tensor], list[Tensor]]:
        return prod[0], prod[1], prod[2], prod[3:]

    def canon_au(self, a: Optional[Tensor], u: Tensor) -> tuple[Optional[Tensor], Tensor]:
        sp = self.scan
        return canon(a, sp.time_dim, sp.rank), canon(u, sp.time_dim, sp.rank)

    def h_for_readout(self, hc: Tensor) -> Tensor:
        return uncanon(hc, self.scan.time_dim, self.scan.rank)

    def run_readout(self, h: Tensor, rs: Sequence[Tensor], traced: bool = False) -> list[Tensor]:
        """The readout on states ``h``; ``traced``: the graph itself, never a compiled variant (inside
        a function traced whole)."""
        n = int(h.shape[self.scan.time_dim])
        out = (self.graph_for("readout", n) if traced else self.runner("readout", n))(h, *rs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # ---------------------------------------------------------------- stages

    def stages(self) -> list[Stage]:
        """Forward (sharded, checkpointing), then per shard in reverse: recompute, adjoint scan, VJP."""
        T = self.io.captured_len
        shards = self.shards(T)
        c = self.costs
        n = self.region_name
        chunked = self.chunked_at(T)
        kernel = self.chunked_kernel() if chunked else _scan_kernel_name(self.scan.kind, self.kernel_backend)
        lam = "truncated adjoint (blockwise, window %s)" % self.window if self.plan == "truncated_adjoint" else "adjoint"
        # a chunked region's block form replaces the per-step scan and its contraction
        scan_flops = c.get("block_flops", 0) if chunked else c.get("scan_flops", 0)
        readout_flops = c.get("readout_flops", 0) - c.get("contraction_flops", 0)
        fwd = Stage(name=f"{n}:forward", kind="forward_chunk", phase="forward", region=n,
                    memory_bytes=int(c.get("saved_bytes", 0)),
                    flops=int(c.get("producer_flops", 0) + scan_flops + readout_flops),
                    kernel=kernel, note=f"{len(shards)} shard(s) of {self.shard_size}; saves the layer input and "
                                        f"{len(shards)} state checkpoint(s)")
        out = [fwd]
        per_step = lambda key: c.get(key, 0) / max(T, 1)  # noqa: E731
        if chunked:  # one graph per shard, run again with grad: one VJP, no per-step states
            windowed = (f"; the window's second readout (W={self.window})"
                        if self.plan == "truncated_adjoint" and self.window < T else "")
            for k in range(len(shards) - 1, -1, -1):
                s, e = shards[k]
                ws, we = self.window_of(s, e, T)
                L, S = we - ws, e - s
                out.append(Stage(name=f"{n}:shard{k}:vjp_shard", kind="vjp_shard", phase="backward", region=n,
                                 memory_bytes=int(per_step("producer_bytes") * L),
                                 flops=int((per_step("producer_flops") + per_step("producer_bwd_flops")) * L
                                           + (readout_flops + c.get("block_flops", 0) + c.get("block_bwd_flops", 0))
                                           * S / max(T, 1)),
                                 kernel=kernel, note=f"steps [{ws}, {we}) -> shard [{s}, {e}) in blocks of "
                                                     f"{self.chunked.chunk}, from its checkpoint; carries dL/dh"
                                                     + windowed))
            return out
        for k in range(len(shards) - 1, -1, -1):
            s, e = shards[k]
            ws, we = self.window_of(s, e, T)
            L, S = we - ws, e - s
            out.append(Stage(name=f"{n}:shard{k}:recompute", kind="recompute", phase="backward", region=n,
                             memory_bytes=int(per_step("producer_bytes") * L + per_step("state_bytes") * S),
                             flops=int(per_step("producer_flops") * L + per_step("scan_flops") * S),
                             kernel=kernel, note=f"steps [{ws}, {we}) -> shard [{s}, {e})"))
            out.append(Stage(name=f"{n}:shard{k}:adjoint_scan", kind="adjoint_scan", phase="backward", region=n,
                             memory_bytes=int(per_step("state_bytes") * S * 2),
                             flops=int(per_step("scan_flops") * S * 2 + per_step("readout_flops") * S * 2),
                             kernel=(f"{self.kernel_backend or 'auto'}:adjoint_shard" if self.scan.kind == "diagonal"
                                     else "torch:dense_adjoint"),
                             note=lam))
            out.append(Stage(name=f"{n}:shard{k}:vjp_shard", kind="vjp_shard", phase="backward", region=n,
                             memory_bytes=int(per_step("producer_bytes") * L),
                             flops=int(per_step("producer_bwd_flops") * L),
                             kernel="torch", note=f"{n}:forward" if k == 0 else ""))
        return out

    def extra_repr(self) -> str:
        return f"{self.region_name}: {self.describe}, plan={self.plan}, shard_size={self.shard_size}" + (
            f", window={self.window}" if self.window else "")

    def chunked_kernel(self) -> str:
        """The block form a chunked region's shards run."""
        if self.chunked.log_decay:
            return "inductor:ssd_chunk_scan" if self.graphs.compiler is not None else "torch:ssd_chunk_scan"
        return f"{self.kernel_backend or 'auto'}:lightning_attention"


def _scan_kernel_name(kind: str, backend: Optional[str]) -> str:
    if kind == "dense":
        return "torch:dense_linear_scan"
    return f"{backend or 'auto'}:linear_scan"


# --------------------------------------------------------------------------- the Function


class AdjointFunction(torch.autograd.Function):
    """Sharded forward with state checkpoints; adjoint (or truncated adjoint) backward."""

    @staticmethod
    def forward(ctx: Any, region: AdjointRegion, *all_inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        n_base = len(all_inputs) - region.n_extra
        inputs, extras = all_inputs[:n_base], all_inputs[n_base:]
        T = region.seq_len(inputs)
        shards = region.shards(T)
        chunked = region.chunked_at(T)
        sp = region.scan
        io = region.io
        outputs: list[Optional[Tensor]] = [None] * len(io.output_time_dims)
        ckpts: list[Optional[Tensor]] = []
        h: Optional[Tensor] = None
        with torch.no_grad():
            for s, e in shards:
                ckpts.append(h)
                win, length, start = region.shard_window(inputs, s, e, T)
                ys, h = region.run_shard(win, length, start, e - s, h, chunked)
                for i, (y, td) in enumerate(zip(ys, io.output_time_dims)):
                    if td is None:
                        raise RuntimeError(f"{region.region_name}: readout output {i} has no time axis")
                    if outputs[i] is None:
                        shape = list(y.shape)
                        shape[td] = T
                        outputs[i] = y.new_empty(shape)
                    outputs[i].narrow(td, s, e - s).copy_(y)
        result = [o for o in outputs if o is not None]
        if io.final_state:
            result.append(state_uncanon(h, sp.rank).clone())
        # one tensor (shard k starts from row k-1), also exported when a later region chains from this one
        stack = torch.stack(ckpts[1:]) if len(ckpts) > 1 else torch.empty(0, device=inputs[0].device)
        if region.exports_checkpoints:
            result.append(stack)
            ctx.mark_non_differentiable(stack)
        ctx.region = region
        ctx.autocast = AutocastState.current()
        ctx.T = T
        ctx.n_inputs = len(inputs)
        ctx.n_extra = len(extras)
        remat = {i for i in region.recomputed() if i < len(inputs)}
        ctx.remat_like = {i: (tuple(inputs[i].shape), inputs[i].dtype, inputs[i].device) for i in remat}
        kept = [None if i in remat else x for i, x in enumerate(inputs)]
        ctx.save_for_backward(*kept, *extras, stack)
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        with ctx.autocast.restore():  # the shards are recomputed as the forward ran them
            return AdjointFunction._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        region: AdjointRegion = ctx.region
        saved = ctx.saved_tensors
        inputs = list(saved[: ctx.n_inputs])
        extras = list(saved[ctx.n_inputs: ctx.n_inputs + ctx.n_extra])
        stack = saved[ctx.n_inputs + ctx.n_extra]
        ckpts = [None, *stack.unbind(0)]
        needs = ctx.needs_input_grad[1:]
        io, sp, T = region.io, region.scan, ctx.T
        n_out = len(io.output_time_dims)
        dys = list(grads[:n_out])
        d_final = grads[n_out] if io.final_state else None
        static_leaves: list[Optional[Tensor]] = []
        for x, d, need in zip(inputs, io.input_time_dims, needs):
            static_leaves.append(None if d is not None else (x.detach().requires_grad_(need) if x.dtype.is_floating_point else x))
        grads_in: list[Optional[Tensor]] = [None] * len(inputs)
        donated: dict[int, DonatedGrad] = {}
        for i, j in region.donors.items():
            x, like = inputs[i], ctx.remat_like.get(i)
            shape, dtype, device = (tuple(x.shape), x.dtype, x.device) if x is not None else like
            if needs[i] and donatable(dys[j], shape, dtype, device):
                donated[i] = DonatedGrad(dys[j], io.input_time_dims[i])
        shards = region.shards(T)
        carry: Optional[Tensor] = None
        chunked = region.chunked_at(T)
        # the windowed lam: of per-step shards, or the corrected gradients of chunked ones (none needed
        # where the window covers the call: the exact adjoint)
        truncating = region.plan == "truncated_adjoint" and region.window < T
        sweep = StepTruncation(sp.kind, region.window, T) if truncating and not chunked else None
        window = ChunkedTruncation(region.window, T) if truncating and chunked else None
        for k in range(len(shards) - 1, -1, -1):
            s, e = shards[k]
            ws, we = region.window_of(s, e, T)
            leaves: list[Tensor] = []
            for i, (x, d) in enumerate(zip(inputs, io.input_time_dims)):
                if d is None:
                    leaves.append(static_leaves[i])
                else:
                    w = region.remat_window(i, extras, ws, we, T) if x is None else x.narrow(d, ws, we - ws).detach()
                    leaves.append(w.requires_grad_(bool(needs[i])) if w.dtype.is_floating_point else w)
            last = k == len(shards) - 1
            if chunked:
                d_end = d_final if last else carry
                if window is not None and d_final is not None and e == T - region.window:
                    fix = window.final_correction(state_canon(d_final, sp.rank))
                    d_end = fix if d_end is None else state_canon(d_end, sp.rank).to(fix.dtype) + fix
                shard_grads, carry = chunked_shard_grads(region, leaves, needs, ckpts[k], dys, s, e,
                                                         ws, we, d_end, window, stack)
            elif sweep is None and region.graphs.calls is not None and shard_vjp not in region.graphs.calls.failed:
                shard_grads, carry = compiled_shard_grads(region, leaves, needs, ckpts[k], dys, s, e, ws, we, carry,
                                                          d_final if last else None)
            else:
                shard_grads, carry = adjoint_shard_grads(region, leaves, needs, ckpts[k], dys, s, e,
                                                         ws, we, carry, d_final if last else None, sweep)
            for i, gv in shard_grads.items():
                if i not in donated:
                    add_input_grad(grads_in, i, gv, io.input_time_dims[i], ws, we,
                                   lambda i=i: _zeros_like_input(inputs[i], ctx.remat_like.get(i)))
            for i, buf in donated.items():
                buf.close(s, e, shard_grads.get(i), ws, we)
        for i, buf in donated.items():
            grads_in[i] = buf.result()
        return (None, *grads_in, *([None] * ctx.n_extra))
