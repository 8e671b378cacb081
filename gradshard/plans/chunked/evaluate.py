"""Evaluate a captured graph on one chunk of time steps, by demand.

``ChunkEvaluator(program, flat, j, cache).value(node, demand)`` computes ``node`` on the
windows of ``demand`` (one ``(lo, hi)`` per time dim of its frame), pulling each input on
the window the node's :class:`~gradshard.plans.chunked.rules.NodeRule` derives, memoised
per ``(node, demand)``. Chunk ``j`` covers steps ``[start, end)``; three situations are
handled here, the rest by the rules:

- a node that depends on attention or a scan (``stateful``) asked for a step ``>= end``:
  the model reads the future -> error naming the node that asked;
- a cache point asked for steps ``< start``: served from the :class:`CacheStore`
  (leaves that require grad during the backward), the chunk's own steps computed;
- a stateful node that is not a cache point asked for steps ``< start``: computed on that
  window from its inputs, unless that would recompute attention or a scan for earlier
  chunks; the dry run then makes the first such node a cache point (:class:`NeedsCache`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

from gradshard.errors import GradshardError, UnsupportedGraphError, node_error, summary
from gradshard.plans.chunked.attention import AttentionStash, stash_slot
from gradshard.plans.chunked.frames import SKIP, Demand, is_empty
from gradshard.plans.chunked.windows import narrow_window
from gradshard.runtime.compiled import CompiledCalls

__all__ = ["ChunkEvaluator", "DeferredChecks", "NeedsCache", "FutureRead"]


class NeedsCache(Exception):
    """Raised in the dry run: ``node`` must keep values across chunks."""

    def __init__(self, node: fx.Node) -> None:
        super().__init__(node.name)
        self.node = node


class FutureRead(UnsupportedGraphError):
    """The model reads a step after the one it computes (found while chunking)."""


class DeferredChecks:
    """Run-time refusals the rules of a forward's chunks found, as device flags raised together when
    the forward ends: one host sync per step, not one per chunk and node."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, Callable[[], Exception]]] = []

    def add(self, failed: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Record ``failed`` (a 0-d bool tensor) and the error to raise if it is true."""
        self._items.append((failed, error))

    def raise_first(self) -> None:
        """Raise the error of the first failed check, if any."""
        if not self._items:
            return
        flags = torch.stack([f for f, _ in self._items])
        if bool(flags.any()):
            raise self._items[int(flags.nonzero()[0, 0])][1]()


class ChunkEvaluator:
    """One chunk of one pass (forward, backward recompute, or dry run); see module doc."""

    def __init__(self, program: Any, flat: list[Any], index: int, cache: Any, *,
                 grad_inputs: dict[int, torch.Tensor] | None = None,
                 needs_grad: tuple[bool, ...] = (), dry: bool = False,
                 stash: AttentionStash | None = None, groups: dict[str, Any] | None = None,
                 calls: CompiledCalls | None = None, recompute: bool = False,
                 checks: DeferredChecks | None = None) -> None:
        self.program = program
        self.flat = flat
        self.index = index
        self.start, self.end = program.bounds[index]
        if index == program.num_chunks - 1:
            self.end = sys.maxsize
        self.cache = cache
        self.dry = dry
        #: the backward's rerun of a chunk the forward computed: its run-time checks already passed
        self.recompute = recompute
        #: where rules put run-time refusals (None: raised at once)
        self.checks = checks
        self.memo: dict[tuple[str, Demand], Any] = {}
        self._keys: dict[str, list[tuple[str, Demand]]] = {}
        self._remaining = dict(program.use_counts)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.grad_inputs = grad_inputs  # flat index -> full leaf (params without time)
        self.needs_grad = needs_grad
        self.input_leaves: list[tuple[int, Demand, torch.Tensor]] = []
        self._asking: list[fx.Node] = []
        self._past_chain: list[fx.Node] = []
        self.cache_reads: list[tuple[str, int, int]] = []
        #: attention outputs kept by the forward for the backward recompute (attention.py)
        self.stash = stash
        #: node name -> the compiled group running it (groups.py); None: node by node
        self.groups = None if dry else groups
        #: the rules' compiled functions; None: eager
        self.calls = None if dry else calls
        #: node name -> the window this chunk computes it on; smaller windows are narrows of it
        self.windows = program.windows(index)
        self._computing: set[tuple[str, Demand]] = set()

    # ---------------------------------------------------------------- inputs

    def _input(self, node: fx.Node, demand: Demand) -> Any:
        i = self.program.flat_index[node.name]
        x = self.flat[i]
        frame = self.program.rules[node.name].frame
        if self.grad_inputs is not None and i in self.grad_inputs and not frame:
            return self.grad_inputs[i]
        for t, (lo, hi) in zip(frame, demand):
            x = x.narrow(t.dim, lo, hi - lo)
        if frame and self.grad_inputs is not None and i < len(self.needs_grad) and self.needs_grad[i]:
            x = x.detach().requires_grad_()
            self.input_leaves.append((i, demand, x))
        return x

    def _empty(self, node: fx.Node, demand: Demand) -> torch.Tensor:
        val = node.meta["val"]
        shape = list(val.shape)
        for t, (lo, hi) in zip(self.program.rules[node.name].frame, demand):
            shape[t.dim] = t.size(shape[t.dim], max(0, hi - lo))
        return torch.empty(shape, dtype=val.dtype, device=val.device)

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, compiled when the program is composed with a compiler (a rule's block form)."""
        return fn(*args) if self.calls is None else self.calls(fn, *args)

    # ---------------------------------------------------------------- evaluation

    def value(self, node: fx.Node, demand: Demand) -> Any:
        key = (node.name, demand)
        hit = self.memo.get(key, self.memo)
        if hit is not self.memo:
            return hit
        prog = self.program
        if node.op == "placeholder" or node.name in prog.hoisted:
            out = self._input(node, demand)
        elif node.op == "get_attr":
            out = getattr(prog.gm, node.target)
            for t, (lo, hi) in zip(prog.rules[node.name].frame, demand):
                out = out.narrow(t.dim, lo, hi - lo)
        elif demand and is_empty(demand):
            out = self._empty(node, demand)
        elif (whole := self._window(node, demand)) is not None:
            out = narrow_window(prog, node.name, self.value(node, (whole,)), whole, demand[0])
        else:
            self._computing.add(key)
            try:
                out = self._compute(node, demand)
            finally:
                self._computing.discard(key)
        self.memo[key] = out
        self._keys.setdefault(node.name, []).append(key)
        if self.dry:  # byte accounting only for the dry run's estimates
            self.live_bytes += _own_bytes(out)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _window(self, node: fx.Node, demand: Demand) -> tuple[int, int] | None:
        """The node's chunk window when ``demand`` lies strictly inside it (and it is not being
        computed right now: a rule may ask its own node for a part of the window), else None."""
        whole = self.windows.get(node.name)
        if whole is None or len(demand) != 1 or demand[0] == whole:
            return None
        (lo, hi), = demand
        if not (whole[0] <= lo and hi <= whole[1]) or (node.name, (whole,)) in self._computing:
            return None
        return whole

    def _release(self, node: fx.Node) -> None:
        """A consumer of ``node`` finished: once all have, drop its values (unless pinned)."""
        left = self._remaining.get(node.name, 0) - 1
        self._remaining[node.name] = left
        if left > 0 or node.name in self.program.pinned:
            return
        for key in self._keys.pop(node.name, ()):
            value = self.memo.pop(key, None)
            if self.dry:
                self.live_bytes -= _own_bytes(value)

    def _compute(self, node: fx.Node, demand: Demand) -> Any:
        prog = self.program
        if self.groups is not None and node.name in self.groups and len(demand) == 1:
            (lo, hi), = demand
            if self.start <= lo and hi <= self.end:
                out = self._compute_group(self.groups[node.name], node, demand)
                if out is not None:
                    return out
        rule = prog.rules[node.name]
        in_past = False
        if len(demand) == 1:
            lo, hi = demand[0]
            stateful = node.name in prog.stateful
            if stateful and hi > self.end:
                asker = self._asking[-1] if self._asking else node
                raise node_error(asker, f"reads step(s) after the one it computes (it needs "
                                 f"`{node.name}` at steps up to {hi - 1} to produce steps < {self.end}), "
                                 "which a causal chunked plan cannot provide",
                                 "make the model causal (no shift to the left, flip, reverse scan or "
                                 "bidirectional attention), or use plan='none'", FutureRead)
            if node.name in prog.cache_points and lo < self.start:
                return self._serve(node, lo, hi)
            if stateful and lo < self.start:
                if rule.mixer:
                    if self.dry:
                        raise NeedsCache(self._past_chain[0] if self._past_chain else node)
                    raise RuntimeError(f"gradshard internal: would recompute `{node.name}` for earlier "
                                       "chunks; the dry run should have made a cache point")
                in_past = True
                self._past_chain.append(node)
        vals: list[Any] = []
        arg_demands: list[Any] = []
        inputs = prog.inputs_of[node.name]
        self._asking.append(node)
        try:
            for arg, smap in inputs:
                if smap is SKIP:
                    vals.append(None)
                    arg_demands.append(None)
                    continue
                d = () if smap is None else tuple([m.apply(demand) for m in smap])
                arg_demands.append(d)
                vals.append(self.value(arg, d))
            slot = (stash_slot(self.stash, self.index, (node.name, demand))
                    if self.stash is not None and node.name in prog.attention else contextlib.nullcontext())
            try:
                with slot:
                    out = rule.run(node, vals, demand, arg_demands, self)
            except (GradshardError, NeedsCache):
                raise
            except IndexError as exc:  # an index in the data out of range: the model's own error
                exc.add_note(str(node_error(
                    node, f"raised on steps {list(demand)} of chunk {self.index}",
                    "an index in the input is out of range (a token id >= the vocabulary size, a position "
                    "past the table): the model raises this without gs.compile too; if it does not, "
                    "please report it")))
                raise
            except Exception as exc:
                raise node_error(node, f"failed on steps {list(demand)} of chunk {self.index}: "
                                 f"{summary(exc)}",
                                 "if the model raises this without gs.compile too, fix that first; else this "
                                 "op's time behaviour is not what gradshard assumed: please report it, and use "
                                 "plan='none' meanwhile") from exc
            for arg, smap in inputs:
                if smap is not SKIP:
                    self._release(arg)
            return out
        finally:
            self._asking.pop()
            if in_past:
                self._past_chain.pop()

    def _compute_group(self, runner: Any, node: fx.Node, demand: Demand) -> Any:
        """``node`` and the other outputs of its group in one compiled call (``None``: it declined)."""
        prog = self.program
        group = runner.group
        vals = [self.value(prog.nodes[a], demand if prog.rules[a].frame else ()) for a in group.inputs]
        outs = runner(vals, demand)
        if outs is None:
            return None
        mine = None
        for name, out, internal in zip(group.outputs, outs, group.internal_uses):
            self._remaining[name] = self._remaining.get(name, 0) - internal  # read inside: done
            if name == node.name:
                mine = out
                continue
            key = (name, demand)
            if key not in self.memo:
                self.memo[key] = out
                self._keys.setdefault(name, []).append(key)
        for a in group.input_reads:
            self._release(prog.nodes[a])
        return mine

    def _serve(self, node: fx.Node, lo: int, hi: int) -> torch.Tensor:
        spec = self.program.cache_points[node.name]
        past_hi = min(hi, self.start)
        self.cache_reads.append((node.name, lo, past_hi))
        past = self.cache.read(node.name, lo, past_hi, self.start)
        if hi <= self.start:
            return past
        cur = self.value(node, ((self.start, hi),))
        return torch.cat([past, cur], dim=spec.dim)

    # ---------------------------------------------------------------- chunk-level helpers

    def chunk_value(self, name: str) -> Any:
        """``name`` on this chunk's window (clipped to the node's time length)."""
        return self.value(self.program.nodes[name], self.program.chunk_demand(name, self.index))


def _own_bytes(value: Any) -> int:
    """Bytes a memoised value owns (views of other values own nothing)."""
    total = 0
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, torch.Tensor) and t._base is None:
            total += t.numel() * t.element_size()
    return total


class RecursionGuard:
    """Deep models give deep demand recursion: raise Python's limit while evaluating."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self.old = 0

    def __enter__(self) -> "RecursionGuard":
        self.old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(self.old, self.limit))
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setrecursionlimit(self.old)
