"""Chunk rules: how each aten op of a captured graph runs on a window of time steps.

A rule is built once per node at compile time (:func:`build_rule`) from the frames of
the node's inputs. It fixes the node's output :data:`~gradshard.plans.chunked.frames.Frame`,
one :class:`~gradshard.plans.chunked.frames.DimMap` per time dim of every tensor argument
(which window of the argument the node reads for a given output window) and a ``run``
function that executes the op on windowed values, rewriting what the captured graph baked
in for the full length ``T``: view shapes, factory sizes, ``arange`` offsets, ``triu``
diagonals, pads of convolutions, carries of scans.

Example: the captured ``view(linear, [B, T, H, D])`` for a chunk of ``w`` steps runs as
``reshape(linear_w, [B, w, H, D])``; ``arange(T)`` for window ``(s, s + w)`` runs as
``arange(s, s + w)``; ``triu(full([T, T], -inf), 1)`` for rows ``(s, e)`` and key columns
``(0, e)`` runs as ``triu(full([e - s, e], -inf), 1 + s)``.

Rules never guess: an op whose time behaviour is unknown, or that reads the future
(non-causal attention, reverse scans, flips along time), raises an error naming the node.
New ops plug in with :func:`register_chunk_rule`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.plans.chunked.frames import Demand, DimMap, Frame, TDim

aten = torch.ops.aten

__all__ = [
    "NodeRule", "BuildCtx", "AttentionSource", "register_chunk_rule", "CHUNK_RULES",
    "slots_of", "meta_shape", "default_run", "rebuild_args", "positional", "missing_frame_error", "op_name",
]

RunFn = Callable[[fx.Node, list, Demand, list, Any], Any]
_INSTEAD = ("use plan='none' (plain autograd) for this model, or rewrite the line so that "
            "step t reads only steps <= t")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class AttentionSource:
    """Where an attention node's keys/values come from before any GQA head repeat."""

    k: str
    v: str
    n_rep: int  # key head h is source head h // n_rep


@dataclass
class NodeRule:
    """How one node runs on a window (see module doc).

    ``slots`` has one entry per ``fx.Node`` occurrence in ``(args, kwargs)`` (``map_arg``
    order): a tuple of :class:`DimMap` (one per time dim of that argument), ``None`` for
    an argument without time, or ``SKIP`` (not evaluated; ``run`` fetches what it needs).
    ``kind``: ``local``, ``mixer`` (reads all of the past: attention, contractions and
    reductions over keys), ``scan`` (a recurrence carried across chunks), ``global``
    (a reduction over the whole sequence: only allowed as a top-level loss), ``input``.
    """

    frame: Frame
    slots: tuple[Any, ...]
    run: RunFn
    kind: str = "local"
    elem_frames: tuple[Frame, ...] | None = None
    note: str = ""
    #: what ``run`` needs beyond its slots (a block-read scan's factors: rules_block.py)
    data: Any = None
    #: the nodes ``run`` reads itself beyond its slots, and on which windows
    #: (:class:`ExtraReads`): the chunk windows include them and the memo keeps them
    reads: "ExtraReads | None" = None

    @property
    def mixer(self) -> bool:
        return self.kind in ("mixer", "scan")


class ExtraReads:
    """What a rule's ``run`` asks of other nodes itself: ``nodes``, and ``windows(win, start)`` --
    the ``(node name, window)`` pairs it asks for when run on ``win`` in a chunk starting at ``start``."""

    nodes: tuple[str, ...] = ()
    #: False: the node is computed on each window asked of it, not on their hull (a scan asked
    #: for its carry at the chunk's start and its cached steps at the end: the hull is the chunk)
    hull: bool = True

    def windows(self, win: tuple[int, int], start: int) -> list[tuple[str, tuple[int, int]]]:
        raise NotImplementedError


@dataclass
class BuildCtx:
    """What rule builders may read: frames of earlier nodes, the time analysis, attention sources."""

    frames: dict[str, Frame]
    elem_frames: dict[str, tuple[Frame, ...]]
    tl: Any
    attention: dict[str, AttentionSource] = field(default_factory=dict)
    # (node, argument, the frame the argument should have): constants the time analysis did
    # not tie to time (an SDPA mask, a loss target); the planner backfills their sources
    missing: list[tuple[fx.Node, fx.Node, Frame]] = field(default_factory=list)
    overrides: dict[str, Frame] = field(default_factory=dict)  # backfilled frames of sources

    def frame(self, arg: Any) -> Frame:
        if not isinstance(arg, fx.Node):
            return ()
        return self.frames.get(arg.name, ())


Builder = Callable[[fx.Node, BuildCtx], NodeRule]
CHUNK_RULES: dict[Any, Builder] = {}


def register_chunk_rule(*ops: Any) -> Callable[[Builder], Builder]:
    """Register a rule builder for aten op packets (or callables such as ``operator.getitem``)."""

    def deco(fn: Builder) -> Builder:
        for op in ops:
            CHUNK_RULES[op] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- helpers


def meta_shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return ()


def slots_of(node: fx.Node) -> list[fx.Node]:
    """Every ``fx.Node`` occurrence in ``(args, kwargs)``, in ``map_arg`` order."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a))
    return found


def _compile_builder(node: fx.Node) -> Callable[[Sequence[Any]], tuple[tuple, dict]]:
    """A fast ``vals -> (args, kwargs)`` for ``node`` (slot order as :func:`slots_of`)."""
    k = 0

    def spec_of(a: Any) -> tuple[int, Any] | None:
        nonlocal k
        if isinstance(a, fx.Node):
            k += 1
            return (0, k - 1)
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            items = []
            for x in a:
                if isinstance(x, (list, tuple, dict)) and any(isinstance(y, fx.Node) for y in x):
                    return None
                items.append(spec_of(x) if isinstance(x, fx.Node) else (1, x))
            return (2, (isinstance(a, tuple), items))
        if isinstance(a, dict) and any(isinstance(x, fx.Node) for x in a.values()):
            return None
        return (1, a)

    arg_spec = [spec_of(a) for a in node.args]
    kw_spec = {n: spec_of(a) for n, a in node.kwargs.items()}
    if any(x is None for x in arg_spec) or any(x is None for x in kw_spec.values()):
        def slow(vals: Sequence[Any]) -> tuple[tuple, dict]:
            it = iter(vals)
            return fx.node.map_arg((node.args, node.kwargs), lambda a: next(it))
        return slow

    def fill(spec: tuple[int, Any], vals: Sequence[Any]) -> Any:
        t, v = spec
        if t == 0:
            return vals[v]
        if t == 1:
            return v
        is_tuple, items = v
        seq = [vals[i] if kind == 0 else i for kind, i in items]
        return tuple(seq) if is_tuple else seq

    def build(vals: Sequence[Any]) -> tuple[tuple, dict]:
        return tuple(fill(s, vals) for s in arg_spec), {n: fill(s, vals) for n, s in kw_spec.items()}

    return build


_BUILDERS: "weakref.WeakKeyDictionary[fx.Node, Callable]" = weakref.WeakKeyDictionary()


def rebuild_args(node: fx.Node, vals: Sequence[Any]) -> tuple[tuple, dict]:
    """``node``'s ``(args, kwargs)`` with its input nodes replaced by ``vals`` (slot order)."""
    build = _BUILDERS.get(node)
    if build is None:
        build = _BUILDERS[node] = _compile_builder(node)
    return build(vals)


def default_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    return node.target(*args, **kwargs)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _frame_from(tdims: Iterable[TDim]) -> Frame:
    by_dim: dict[int, TDim] = {}
    for t in tdims:
        old = by_dim.get(t.dim)
        if old is not None and (old.length, old.inner, old.tail) != (t.length, t.inner, t.tail):
            raise ValueError(f"dim {t.dim} carries two different time axes ({old} vs {t})")
        by_dim[t.dim] = t
    return tuple(by_dim[d] for d in sorted(by_dim))


def _index_of(frame: Frame, dim: int) -> int:
    for k, t in enumerate(frame):
        if t.dim == dim:
            return k
    raise KeyError(dim)


def positional(node: fx.Node, bc: BuildCtx, mapper: Callable[[int, fx.Node, TDim], TDim | None],
               run: RunFn = default_run, kind: str = "local", extra: Iterable[TDim] = ()) -> NodeRule:
    """A rule where each argument time dim lands on one output dim (``mapper`` says which).

    ``mapper(slot, arg, tdim)`` returns the output :class:`TDim` or ``None`` (then the node
    does not keep that time dim: an error, the caller handles reductions itself).
    """
    slots = slots_of(node)
    mapped: list[list[TDim]] = []
    outs: list[TDim] = list(extra)
    for i, a in enumerate(slots):
        row: list[TDim] = []
        for td in bc.frame(a):
            out = mapper(i, a, td)
            if out is None:
                raise node_error(node, f"{op_name(node)} removes the time axis of `{a.name}` in a way "
                                 "gradshard cannot split into chunks", _INSTEAD)
            row.append(out)
            outs.append(out)
        mapped.append(row)
    try:
        frame = _frame_from(outs)
    except ValueError as exc:
        raise node_error(node, f"{op_name(node)} combines time axes that do not line up: {exc}", _INSTEAD) from exc
    maps: list[Any] = []
    for a, row in zip(slots, mapped):
        if not bc.frame(a):
            maps.append(None)
        else:
            maps.append(tuple(DimMap("same", _index_of(frame, t.dim)) for t in row))
    return NodeRule(frame, tuple(maps), run, kind)


def _check_unframed_args(node: fx.Node, bc: BuildCtx, frame: Frame) -> None:
    """A tensor argument without time but with a dim of size T aligned to a time dim must be
    sliced too: record it in ``bc.missing`` (the planner backfills its frame, or fails)."""
    out = meta_shape(node)
    for a in slots_of(node):
        if bc.frame(a):
            continue
        shp = meta_shape(a)
        off = len(out) - len(shp)
        want = [replace(t, dim=t.dim - off) for t in frame
                if 0 <= t.dim - off < len(shp) and shp[t.dim - off] == out[t.dim] and out[t.dim] > 1]
        if want:
            bc.missing.append((node, a, tuple(want)))


def missing_frame_error(node: fx.Node, arg: fx.Node) -> Exception:
    return node_error(node, f"argument `{arg.name}` has a dim of the sequence length that gradshard "
                      "cannot slice (it does not come from an input, a buffer or a constant built in "
                      "the model from shapes)", "register the tensor as a buffer of the module "
                      "(register_buffer) or build it inside forward")


# --------------------------------------------------------------------------- dispatch
