"""SeCO / SpaCO runtime: run a captured graph chunk by chunk, backward in reverse chunk order.

Forward (``torch.no_grad``), for chunks ``j = 0 .. k-1``: evaluate the region outputs on
the chunk's steps (:class:`~gradshard.plans.chunked.evaluate.ChunkEvaluator`), add the partial
sums of whole-sequence losses, and write the chunk's cache points (KV, scan carries,
convolution tails) into the :class:`~gradshard.plans.chunked.cache.CacheStore`. Only the
cache and the returned time outputs (e.g. logits, when the module returns them) stay.

Backward, for ``j = k-1 .. 0`` (SpaCO: selected chunks only): recompute chunk ``j`` with
grad from parameter leaves and cache leaves for the steps before it, then one
``torch.autograd.grad`` with the cotangents of its outputs (the incoming gradient of the
time outputs, ``dL/dR`` over the loss denominator) and of its own cache values (what later
chunks sent back); the gradient reaching earlier cache leaves is accumulated for their
chunks. Only one chunk's graph is alive at a time. SeCO is exact. When the region returns only
reductions (the loss inside the module), SeCO's forward (SpaCO's at a budget of every chunk) runs
the last chunk with grad already (:class:`KeptChunk`): the backward starts from its graph instead of recomputing it, which the
backward's first step would hold anyway (one chunk's forward fewer per step: a tenth of a
2-chunk step's FLOPs).

SpaCO (``budget = t`` of ``k`` chunks): ``sampling="bernoulli"`` keeps chunk ``j``
independently with probability ``q = min(1, t/k)`` and scales every cotangent of a kept
chunk (its loss gradient and the gradient relayed through its cache) by ``1/q``. Because
a chunk's cache cotangent depends only on the selection of later chunks, the estimate is
exactly unbiased by induction over chunks. ``"fixed"`` keeps exactly ``t`` chunks chosen
without replacement with factor ``k/t`` (the paper's scheme: biased for paths through
several chunks); ``max_compensation`` caps the factor (biased). :func:`force_selection`
overrides the draw (tests enumerate outcomes with it).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.autograd.function import once_differentiable

from gradshard.ir import Stage
from gradshard.plans.chunked.attention import AttentionStash
from gradshard.plans.chunked.cache import CacheSpec, CacheStore
from gradshard.plans.chunked.evaluate import ChunkEvaluator, DeferredChecks, RecursionGuard
from gradshard.plans.chunked.groups import GroupCache, GroupRunner, find_local_groups
from gradshard.plans.chunked.frames import SKIP, Demand
from gradshard.plans.chunked.reductions import Reduction
from gradshard.plans.chunked.rules import AttentionSource, NodeRule
from gradshard.plans.chunked.windows import chunk_windows
from gradshard.autocast import AutocastState
from gradshard.runtime.compiled import CompiledCalls

__all__ = [
    "RegionOutput", "ChunkEstimate", "ChunkProgram", "Selection", "sample_chunks", "force_selection",
    "ChunkedRegion", "chunk_bounds",
]


# --------------------------------------------------------------------------- the program


@dataclass(frozen=True)
class RegionOutput:
    """A value the region returns: a time output (concatenated over chunks) or a reduction."""

    name: str
    kind: str  # "time" | "reduction"
    dim: int = 0
    reduction: Reduction | None = None


@dataclass(frozen=True)
class ChunkEstimate:
    """Dry-run numbers for one chunk: forward FLOPs, activation bytes, cache bytes read/written."""

    flops: int
    activation_bytes: int
    cache_read_bytes: int
    cache_write_bytes: int


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(0, c), (c, 2c), ..., (s_last, T)]``: the steps of every chunk."""
    return [(s, min(s + chunk_size, seq_len)) for s in range(0, max(seq_len, 1), chunk_size)]


@dataclass
class ChunkProgram:
    """Everything the runtime needs to run the captured graph ``gm`` chunk by chunk."""

    gm: fx.GraphModule
    nodes: dict[str, fx.Node]
    rules: dict[str, NodeRule]
    slots: dict[str, list[fx.Node]]
    flat_index: dict[str, int]
    flat_names: list[str]
    seq_len: int
    chunk_size: int
    outputs: list[RegionOutput]
    cache_points: dict[str, CacheSpec]
    stateful: set[str]
    attention: dict[str, AttentionSource] = field(default_factory=dict)
    estimates: list[ChunkEstimate] = field(default_factory=list)
    #: Nodes computed once for the whole sequence outside the region and passed in after
    #: the placeholders (``flat_names`` ends with them); chunks slice them like inputs.
    hoisted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.bounds = chunk_bounds(self.seq_len, self.chunk_size)
        self.refresh_uses()

    def refresh_uses(self) -> None:
        """Consumer counts (memo eviction) and pinned values (outputs, cache points, loss inputs)."""
        counts: dict[str, int] = {}
        for name, rule in self.rules.items():
            for arg, smap in zip(self.slots.get(name, ()), rule.slots):
                if smap is not SKIP:
                    counts[arg.name] = counts.get(arg.name, 0) + 1
        self.use_counts = counts
        self.inputs_of = {name: tuple(zip(self.slots.get(name, ()), rule.slots)) for name, rule in self.rules.items()}
        pinned = {o.name for o in self.outputs} | set(self.cache_points)
        # what rules read outside their slots is not counted down: kept for the chunk
        pinned |= {n for rule in self.rules.values() if rule.reads is not None for n in rule.reads.nodes}
        for o in self.outputs:
            if o.kind == "reduction":
                pinned |= {a.name for a in self.slots.get(o.name, ())}
        self.pinned = pinned
        self._windows: dict[int, dict[str, tuple[int, int]]] = {}

    def windows(self, j: int) -> dict[str, tuple[int, int]]:
        """Node name -> the window chunk ``j`` computes it on (:mod:`~gradshard.plans.chunked.windows`)."""
        wins = self._windows.get(j)
        if wins is None:
            wins = self._windows[j] = chunk_windows(self, j)
        return wins

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    def chunk_demand(self, name: str, j: int) -> Demand:
        """The window of chunk ``j`` on node ``name`` (one time dim; clipped to its length)."""
        (t,) = self.rules[name].frame
        lo, hi = self.bounds[j]
        if j == self.num_chunks - 1:
            hi = t.length
        return ((min(lo, t.length), min(hi, t.length)),)

    def cache_window(self, name: str, j: int) -> tuple[int, int]:
        """The steps of chunk ``j`` cache point ``name`` keeps: all, or its last ``retention``."""
        (lo, hi), = self.chunk_demand(name, j)
        keep = self.cache_points[name].retention
        return (lo, hi) if keep is None else (max(lo, hi - keep), hi)

    def cache_bytes(self) -> int:
        """Bytes of all cache points at the full sequence length (retention respected)."""
        total = 0
        for spec in self.cache_points.values():
            val = self.nodes[spec.name].meta["val"]
            per_step = val.numel() * val.element_size() // max(val.shape[spec.dim], 1)
            steps = spec.length if spec.retention is None else min(spec.length, spec.retention * self.num_chunks)
            total += per_step * steps
        return total


# --------------------------------------------------------------------------- SpaCO sampling


@dataclass(frozen=True)
class Selection:
    """Which chunks run their backward, and the factor scaling each kept chunk's cotangents."""

    selected: tuple[bool, ...]
    factors: tuple[float, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.selected) if s)


_FORCED: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("gs_forced_chunks", default=None)


@contextlib.contextmanager
def force_selection(indices: Sequence[int]) -> Iterator[None]:
    """Backwards run inside this block keep exactly chunks ``indices`` (SpaCO factors unchanged).

    For tests that enumerate every selection outcome with its probability.
    """
    token = _FORCED.set(tuple(int(i) for i in indices))
    try:
        yield
    finally:
        _FORCED.reset(token)


def keep_probability(num_chunks: int, budget: int) -> float:
    return min(1.0, budget / num_chunks)


def sample_chunks(num_chunks: int, options: Any) -> Selection:
    """Draw a SpaCO selection (``options``: budget, sampling, max_compensation, generator)."""
    k, t = num_chunks, options.budget
    if options.sampling == "bernoulli":
        factor = 1.0 / keep_probability(k, t)
    else:
        factor = k / min(t, k)
    if options.max_compensation is not None:
        factor = min(factor, float(options.max_compensation))
    forced = _FORCED.get()
    if forced is not None:
        bad = [i for i in forced if not 0 <= i < k]
        if bad:
            raise ValueError(f"force_selection: chunk indices {bad} out of range for {k} chunks")
        chosen = set(forced)
    elif t >= k:
        chosen = set(range(k))
    elif options.sampling == "bernoulli":
        draw = torch.rand(k, generator=options.generator)
        chosen = {i for i in range(k) if float(draw[i]) < t / k}
    else:
        chosen = set(torch.randperm(k, generator=options.generator)[:t].tolist())
    sel = tuple(i in chosen for i in range(k))
    return Selection(sel, tuple(factor if s else 0.0 for s in sel))


# --------------------------------------------------------------------------- execution


@dataclass
class KeptChunk:
    """The last chunk, evaluated with grad by the forward: the backward differentiates its graph
    instead of recomputing it (seco, where every chunk takes part in the backward). Holding it
    from the end of the forward costs what the backward's first recompute would hold anyway."""

    index: int
    evaluator: ChunkEvaluator | None  # None once the backward took it
    values: dict[str, torch.Tensor]  # output name -> the chunk's value / reduction numerator, with grad
    cache_leaves: list[tuple[Any, torch.Tensor]]


def grad_leaves(program: ChunkProgram, flat: Sequence[torch.Tensor], needs: Sequence[bool]) -> dict[int, torch.Tensor]:
    """Flat index -> a leaf that accumulates the input's gradient over the chunks. An input with
    no rule is read by no node (an unused parameter): no leaf, its gradient None (as eager
    autograd leaves it); a framed input gets a leaf per chunk window instead (the evaluator's)."""
    rules = {i: program.rules.get(_flat_name(program, i)) for i in range(len(flat))}
    return {i: flat[i].detach().requires_grad_() for i, need in enumerate(needs)
            if need and rules[i] is not None and not rules[i].frame}


def run_forward(program: ChunkProgram, flat: list[torch.Tensor], stash: AttentionStash | None = None,
                groups: dict[str, Any] | None = None, keep_leaves: dict[int, torch.Tensor] | None = None,
                needs: Sequence[bool] = (), calls: CompiledCalls | None = None,
                ) -> tuple[list[torch.Tensor], CacheStore, dict[str, Any], KeptChunk | None]:
    """Chunked forward without grad: region outputs, the filled cache, loss denominators
    (and, given a ``stash``, each chunk's attention outputs for the backward; ``groups``:
    compiled runs of local nodes, :mod:`gradshard.plans.chunked.groups`; ``calls``: the rules'
    compiled functions). With ``keep_leaves``
    (:func:`grad_leaves`) the last chunk runs with grad from them and is returned kept."""
    cache = CacheStore(program.cache_points, program.bounds)
    pieces: dict[str, list[torch.Tensor]] = {o.name: [] for o in program.outputs if o.kind == "time"}
    nums: dict[str, Any] = {}
    dens: dict[str, Any] = {}
    kept = None
    checks = DeferredChecks()
    with torch.no_grad(), RecursionGuard():
        for j in range(program.num_chunks):
            keep = keep_leaves is not None and j == program.num_chunks - 1
            if keep:  # reads of earlier chunks' cache become leaves, as in the backward
                cache.grad_mode = True
                cache.begin_chunk(j)
                ev = ChunkEvaluator(program, flat, j, cache, grad_inputs=keep_leaves, needs_grad=tuple(needs),
                                    groups=groups, calls=calls, checks=checks)
            else:
                ev = ChunkEvaluator(program, flat, j, cache, stash=stash, groups=groups, calls=calls, checks=checks)
            values: dict[str, torch.Tensor] = {}
            with torch.enable_grad() if keep else contextlib.nullcontext():
                for o in program.outputs:
                    if o.kind == "time":
                        values[o.name] = v = ev.chunk_value(o.name)
                        pieces[o.name].append(v.detach())
                    else:
                        num, den = o.reduction.partial(program.nodes[o.name], ev)
                        values[o.name], num = num, num.detach()
                        nums[o.name] = num if o.name not in nums else nums[o.name] + num
                        if den is not None:
                            den = den.detach() if isinstance(den, torch.Tensor) else den
                            dens[o.name] = den if o.name not in dens else dens[o.name] + den
            if keep:  # no later chunk reads its cache values
                ev.memo.clear()  # autograd keeps what the backward needs
                kept = KeptChunk(j, ev, values, cache.leaf_list())
                cache.grad_mode = False
                continue
            for name in program.cache_points:  # only the steps it keeps (a scan: not its every state)
                win = program.cache_window(name, j)
                cache.write(name, j, win[0], ev.value(program.nodes[name], (win,)))
            del ev, values
    checks.raise_first()
    results = []
    for o in program.outputs:
        if o.kind == "time":
            ps = pieces.pop(o.name)
            results.append(ps[0] if len(ps) == 1 else torch.cat(ps, dim=o.dim))
        else:
            results.append(_finish_reduction(o.reduction, nums[o.name], dens.get(o.name)))
    return results, cache, dens, kept


def _finish_reduction(red: Reduction, num: torch.Tensor, den: Any) -> torch.Tensor:
    if red.kind == "sum":
        return num
    if red.kind == "mean":
        return num / red.count
    return num / den


def _reduction_scale(red: Reduction, den: Any) -> Any:
    if red.kind == "sum":
        return 1.0
    if red.kind == "mean":
        return 1.0 / red.count
    return 1.0 / den


def run_backward(region: "ChunkedRegion", flat: Sequence[torch.Tensor], needs: Sequence[bool],
                 cache: CacheStore, dens: dict[str, Any], grads: Sequence[torch.Tensor | None],
                 selection: Selection, stash: AttentionStash | None = None,
                 kept: tuple[dict[int, torch.Tensor], KeptChunk] | None = None) -> list[torch.Tensor | None]:
    """Reverse chunk loop (module doc); returns one gradient per flat input. ``kept``: the leaves
    and the last chunk the forward ran with grad from them (differentiated, not recomputed)."""
    program = region.program
    flat = list(flat)
    leaves, last = kept if kept is not None else (grad_leaves(program, flat, needs), None)
    out_grads: list[torch.Tensor | None] = [None] * len(flat)
    cache.begin_backward()
    for j in reversed(range(program.num_chunks)):
        if not selection.selected[j]:
            cache.drop_chunk(j)
            if stash is not None:
                stash.drop(j)
            region.stats["skipped_chunks"] += 1
            continue
        f = selection.factors[j]
        values: dict[str, torch.Tensor] = {}
        if last is not None and last.index == j:
            ev, values, cache_leaves = last.evaluator, last.values, last.cache_leaves
            # the caller's reference to ``kept`` must not keep the graph (or its leaves' gradients)
            last.evaluator, last.values, last.cache_leaves = None, {}, []
            last = None
        else:
            cache.begin_chunk(j)
            ev = ChunkEvaluator(program, flat, j, cache, grad_inputs=leaves, needs_grad=tuple(needs), stash=stash,
                                groups=region.group_runners(), calls=region.compiled_calls(), recompute=True)
            cache_leaves = None
        outs: list[torch.Tensor] = []
        cots: list[torch.Tensor] = []
        with torch.enable_grad(), RecursionGuard():
            for o, g in zip(program.outputs, grads):
                if g is None:
                    continue
                if o.kind == "time":
                    (lo, hi), = program.chunk_demand(o.name, j)
                    outs.append(values[o.name] if values else ev.chunk_value(o.name))
                    g = g.narrow(o.dim, lo, hi - lo)
                    cots.append(g * f if f != 1.0 else g)
                else:
                    num = values[o.name] if values else o.reduction.partial(program.nodes[o.name], ev)[0]
                    outs.append(num)
                    cots.append((g * (_reduction_scale(o.reduction, dens.get(o.name)) * f)).to(num.dtype).expand_as(num))
            for name, spec in program.cache_points.items():
                seed = cache.seed(name, j)
                if seed is None:
                    continue
                p_lo, g = seed
                val = ev.value(program.nodes[name], ((p_lo, p_lo + g.shape[spec.dim]),))
                outs.append(val)
                cots.append(g * f if f != 1.0 else g)
            ev.memo.clear()  # autograd keeps what the backward needs; drop every other intermediate
            pairs = [(o, c) for o, c in zip(outs, cots) if isinstance(o, torch.Tensor) and o.requires_grad]
            if cache_leaves is None:
                cache_leaves = cache.leaf_list()
            inputs = [*leaves.values(), *(t for _, _, t in ev.input_leaves), *(t for _, t in cache_leaves)]
            if pairs and inputs:
                # backward(inputs=...) accumulates into each leaf's .grad as the engine goes, so a
                # chunk never holds all of its parameter gradients next to the running sum
                torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs], inputs=inputs)
        region.stats["backward_chunks"] += 1
        for i, demand, leaf in ev.input_leaves:
            g = leaf.grad
            if g is None:
                continue
            if out_grads[i] is None:
                out_grads[i] = torch.zeros_like(flat[i])
            view = out_grads[i]
            for t, (lo, hi) in zip(program.rules[_flat_name(program, i)].frame, demand):
                view = view.narrow(t.dim, lo, hi - lo)
            view.add_(g)
        for key, leaf in cache_leaves:
            cache.accumulate(key, leaf.grad)
        cache.drop_chunk(j)
        if stash is not None:
            stash.drop(j)
        del ev, outs, cots, pairs, values
    for i, leaf in leaves.items():
        out_grads[i] = leaf.grad
    return out_grads


def _flat_name(program: ChunkProgram, i: int) -> str:
    return program.flat_names[i]


class _ChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region, grad_enabled, *flat):  # type: ignore[override]
        program = region.program
        needs = ctx.needs_input_grad[2:]
        # ``needs_input_grad`` says what requires grad even under torch.no_grad(): ``grad_enabled``
        # (the caller's mode) keeps an inference call from stashing or keeping for no backward
        training = grad_enabled and any(needs)
        stash = AttentionStash() if region.stash_attention and training else None
        leaves = grad_leaves(program, flat, needs) if region.keeps_last_chunk and training else None
        results, cache, dens, kept = run_forward(program, list(flat), stash, region.group_runners(), leaves, needs,
                                                   region.compiled_calls())
        region.stats["forward_calls"] += 1
        ctx.region = region
        ctx.autocast = AutocastState.current()
        ctx.cache = cache
        ctx.stash = stash
        ctx.dens = dens
        ctx.kept = None if kept is None else (leaves, kept)
        ctx.save_for_backward(*flat)
        ctx.set_materialize_grads(False)
        nondiff = [r for r in results if not (r.is_floating_point() or r.is_complex())]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(results)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        region = ctx.region
        if ctx.cache is None:
            raise RuntimeError(f"{region.plan}: the chunked backward runs once per forward (it consumes the "
                               "KV/state cache); retain_graph=True is not supported, call the module again")
        flat = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        selection = region.select()
        region.last_selection = selection
        kept, ctx.kept = ctx.kept, None
        with ctx.autocast.restore():  # the chunks are recomputed as the forward ran them
            out = run_backward(region, flat, needs, ctx.cache, ctx.dens, grads, selection, ctx.stash, kept)
        ctx.cache = ctx.stash = None
        return (None, None, *out)


# --------------------------------------------------------------------------- the region module


class ChunkedRegion(nn.Module):
    """The region module a chunked plan installs: runs the whole captured graph by chunks.

    ``stats`` counts forward calls and backward chunks run/skipped; ``last_selection`` is
    the SpaCO selection of the latest backward; ``stages()`` lists the chunk stages.
    """

    def __init__(self, program: ChunkProgram, plan: str, options: Any, name: str = "chunked_0") -> None:
        super().__init__()
        self.program = program
        self.plan = plan
        self.options = options
        self.region_name = name
        self.stats: dict[str, int] = {"forward_calls": 0, "backward_chunks": 0, "skipped_chunks": 0}
        self.last_selection: Selection | None = None
        #: keep each chunk's attention outputs for its backward recompute (attention.py's
        #: stash): on when the program is composed with Inductor (``use_graph_compiler``)
        self.stash_attention = False
        self.compiler: Any = None
        self._groups = GroupCache()

    def use_graph_compiler(self, compiler: Any) -> None:
        """Composed with a compiler (:func:`gradshard.compose.compose_graph`): run the groups of
        local nodes compiled (:mod:`gradshard.plans.chunked.groups`), and trade one activation per
        attention layer for not running the attention forward again in the backward."""
        self.stash_attention = compiler is not None
        if compiler is not self.compiler:
            self.compiler = compiler
            self._groups = GroupCache()

    def compiled_calls(self) -> CompiledCalls | None:
        """The rules' compiled functions (SSD's block form, ...; built at first use); None without a compiler."""
        if self.compiler is None:
            return None
        if self._groups.calls is None:
            self._groups.calls = CompiledCalls(self.compiler, self.region_name)
        return self._groups.calls

    def group_runners(self) -> dict[str, GroupRunner] | None:
        """Node name -> the compiled group that runs it (built at first use); None without a compiler."""
        if self.compiler is None:
            return None
        if self._groups.by_node is None:
            self._groups.fill([GroupRunner(self.program, g, self.compiler, self.region_name)
                               for g in find_local_groups(self.program)])
        return self._groups.by_node

    @property
    def compiled_groups(self) -> GroupCache:
        """The compiled groups of local nodes (``describe()``, counts)."""
        return self._groups


    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _ChunkedFunction.apply(self, torch.is_grad_enabled(), *flat)

    @property
    def keeps_last_chunk(self) -> bool:
        """Whether the forward runs the last chunk with grad and keeps its graph (:class:`KeptChunk`):
        when the backward is sure to run it (seco; spaco with a budget of every chunk) and every
        output is a reduction (a loss), so that nothing the caller computes from a time output (a
        loss over logits outside the module) is allocated while the graph is held. (A selection
        forced to skip it, :func:`force_selection`, leaves the kept graph unused: still exact.)"""
        every_chunk = self.plan == "seco" or (self.plan == "spaco" and self.options.budget >= self.program.num_chunks)
        return every_chunk and all(o.kind != "time" for o in self.program.outputs)

    def select(self) -> Selection:
        k = self.program.num_chunks
        if self.plan == "spaco":
            return sample_chunks(k, self.options)
        return Selection((True,) * k, (1.0,) * k)

    def stages(self) -> list[Stage]:
        """Forward chunk stages, then backward recompute stages in reverse chunk order."""
        prog = self.program
        est = prog.estimates or [ChunkEstimate(0, 0, 0, 0)] * prog.num_chunks
        fwd, bwd = [], []
        note_sel = ""
        if self.plan == "spaco":
            q = keep_probability(prog.num_chunks, self.options.budget)
            note_sel = f"; kept w.p. {q:.3g}" if self.options.sampling == "bernoulli" else \
                f"; {min(self.options.budget, prog.num_chunks)} of {prog.num_chunks} kept"
        kept = prog.num_chunks - 1 if self.keeps_last_chunk else None  # run with grad by the forward (KeptChunk)
        for j, ((lo, hi), e) in enumerate(zip(prog.bounds, est)):
            if j == kept:
                fwd.append(Stage(name=f"{self.region_name}:forward_chunk_{j}", kind="forward_chunk",
                                 phase="forward", region=self.region_name,
                                 memory_bytes=e.activation_bytes + e.cache_read_bytes, flops=e.flops,
                                 note=f"steps [{lo}, {hi}) with grad, its graph kept for the backward"))
                continue
            fwd.append(Stage(name=f"{self.region_name}:forward_chunk_{j}", kind="forward_chunk",
                             phase="forward", region=self.region_name, memory_bytes=e.cache_write_bytes,
                             flops=e.flops, note=f"steps [{lo}, {hi}) without grad; writes "
                             f"{e.cache_write_bytes:,} B of KV/state cache"))
        for j in reversed(range(prog.num_chunks)):
            (lo, hi), e = prog.bounds[j], est[j]
            if j == kept:
                bwd.append(Stage(name=f"{self.region_name}:vjp_chunk_{j}", kind="recompute_chunk",
                                 phase="backward", region=self.region_name,
                                 memory_bytes=e.activation_bytes + e.cache_read_bytes, flops=2 * e.flops,
                                 note=f"steps [{lo}, {hi}): VJP through the graph the forward kept"))
                continue
            bwd.append(Stage(name=f"{self.region_name}:recompute_chunk_{j}", kind="recompute_chunk",
                             phase="backward", region=self.region_name,
                             memory_bytes=e.activation_bytes + e.cache_read_bytes, flops=3 * e.flops,
                             note=f"steps [{lo}, {hi}): recompute with grad + VJP; reads "
                             f"{e.cache_read_bytes:,} B of cache{note_sel}"))
        return fwd + bwd

    def extra_repr(self) -> str:
        p = self.program
        return (f"plan={self.plan}, T={p.seq_len}, chunk_size={p.chunk_size}, chunks={p.num_chunks}, "
                f"cache_points={len(p.cache_points)}")
