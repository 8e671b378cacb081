"""Re-specialise a captured graph to another sequence length (and batch size).

A captured aten graph has the sequence length ``T`` baked into its integer arguments
(``view(x, [2, 32, 8])``, ``slice(conv, 2, 0, 32)``, ``new_zeros(x, [2, 32])``). Plans use
this to avoid capturing again: the adjoint runtime recomputes time-local producers on
windows of other lengths (shards plus halos) and serves a program compiled at one ``T`` at
another (:mod:`gradshard.plans.adjoint.generic`); the chunked plans serve a new length from
the graph their length-generic passes left (:mod:`gradshard.plans.length_generic`).
This module rewrites those integers.

Time facts (computed once from the time-locality analysis): every output dim that carries
time is either

* ``shift c``: size ``T + c`` (the time axis itself, possibly padded or cropped by ``c``);
  sizes ``>= T/2`` are taken to move with ``T``,
* ``scale m``: size ``m * T`` (time merged with other dims, e.g. ``B*T`` rows),
* ``fixed``: a short piece along time (``x[:, :1]``, sizes ``< T/2``) that keeps its size.

A fact may also carry the batch (``DimFact.batch``: the dim is in the class of the inputs'
batch dim, alone or merged with time or heads); its size then scales with the batch, so the
same graph serves another batch size too (``batch=(B_old, B_new)``).

:func:`respecialize` rewrites size lists (view/reshape/expand/new_zeros/full/...), slice and
narrow bounds, select indices and ``arange`` ends from the facts, then *verifies* the result
by shape propagation: every node must come out with exactly the shape its facts predict, or
:class:`RespecializeError` is raised (callers then fall back to capturing again). It runs on
meta tensors (:mod:`gradshard.passes.meta_propagate`; values kept are made fake tensors), and
on fake tensors where meta cannot decide (a module call, a data-dependent op, a refusal to word).
A graph propagated before node for node (same ops, arguments, captured shapes, facts, length
and batch) replays the stored outcome instead (:mod:`gradshard.passes.respecialize_memo`).
Integers that encode positions rather than sizes (bounds near the end of the axis) are
rewritten relative to the end.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from gradshard.ir import graph_module
from gradshard.analysis.dims import shape_of
from gradshard.fake import private_dispatch_cache
from gradshard.passes.meta_propagate import run_on_meta
from gradshard.passes.respecialize_memo import (MEMO, Outcome, apply_outcome, propagation_key, record_outcome,
                                                snapshot_values)

aten = torch.ops.aten

__all__ = ["DimFact", "Facts", "RespecializeError", "time_facts", "respecialize", "expected_shape", "fake_propagate",
           "call_length", "call_sizes", "cut_call"]


class RespecializeError(RuntimeError):
    """The graph cannot be re-specialised to another length safely."""


@dataclass(frozen=True)
class DimFact:
    """How one output dim's size depends on the sequence length ``T`` and, with ``batch``, on
    the batch size ``B`` (the size is then a multiple of ``B`` and scales with it).

    ``"symbolic"``: the size is ``size_of(T, B)``, an expression a symbolic trace gave
    (:mod:`gradshard.passes.symbolic_sizes`: a pad to a multiple of a chunk, a chunk count)."""

    kind: str  # "shift" | "scale" | "fixed" | "symbolic"
    value: int
    batch: bool = False
    size_of: Optional[Callable[[int, Optional[int]], int]] = None

    def size(self, T: int, old: int, batch: tuple[int, int] = (1, 1)) -> int:
        """The size at length ``T``; ``batch``: the captured and the new batch size."""
        if self.kind == "symbolic":
            return self.size_of(T, batch[1])
        if self.kind == "shift":
            n = T + self.value
        elif self.kind == "scale":
            n = self.value * T
        else:
            n = old
        b_old, b_new = batch
        return n // b_old * b_new if self.batch and b_old != b_new else n

    def moves(self, batch: tuple[int, int] = (1, 1)) -> bool:
        """Whether the size changes with ``T`` (or with the batch, when it changes)."""
        return self.kind != "fixed" or (self.batch and batch[0] != batch[1])


Facts = Mapping[str, tuple[Optional[DimFact], ...]]


def time_facts(gm: fx.GraphModule, tl: Any, T: Optional[int] = None,
               batch_inputs: Mapping[str, int] | None = None) -> dict[str, tuple[Optional[DimFact], ...]]:
    """Facts for every tensor node of ``gm`` from the time analysis ``tl`` (see module doc).

    ``batch_inputs`` (placeholder name -> batch dim): the dims in those dims' classes carry the
    batch, and their facts say so (:attr:`DimFact.batch`); without it no fact does."""
    T = int(T or tl.seq_len)
    batch_classes = {tl.dims.canon(tl.dims.input_labels[name][d]) for name, d in (batch_inputs or {}).items()}
    batch_classes.discard(tl.time_class)
    out: dict[str, tuple[Optional[DimFact], ...]] = {}
    for node in gm.graph.nodes:
        shp = shape_of(node)
        if shp is None or node.name not in tl.info:
            continue
        tdims = set(tl.info[node.name].time_dims)
        nd = tl.dims.dims_of(node)
        facts: list[Optional[DimFact]] = []
        for i, s in enumerate(shp):
            labels = nd.dims[i] if nd is not None and i < len(nd.dims) else frozenset()
            classes = {tl.dims.canon(l) for l in labels}
            batched = bool(classes & batch_classes)
            if i not in tdims:
                facts.append(DimFact("fixed", s, batch=True) if batched else None)
                continue
            merged = any(c != tl.time_class for c in classes)
            if merged:
                facts.append(DimFact("scale", s // T, batch=batched) if T and s % T == 0
                             else DimFact("fixed", s, batch=batched))
            elif T and 2 * s >= T:
                facts.append(DimFact("shift", s - T))
            else:
                facts.append(DimFact("fixed", s))
        out[node.name] = tuple(facts)
    return out


def expected_shape(old: Sequence[int], facts: Sequence[Optional[DimFact]], T: int,
                   batch: tuple[int, int] = (1, 1)) -> tuple[int, ...]:
    """The shape a node with ``facts`` has at length ``T`` (and batch ``batch[1]``, captured at ``batch[0]``)."""
    return tuple(f.size(T, s, batch) if f is not None else s for s, f in zip(old, facts))


# --------------------------------------------------------------------------- argument rewriting


class _Rewriter:
    def __init__(self, facts: Facts, T_old: int, T_new: int, batch: tuple[int, int]) -> None:
        self.facts, self.T_old, self.T_new, self.batch = facts, T_old, T_new, batch

    def out_facts(self, node: fx.Node) -> tuple[Optional[DimFact], ...]:
        return self.facts.get(node.name, ())

    def new_size(self, node: fx.Node, dim: int, old: int) -> int:
        f = self.out_facts(node)
        if dim < len(f) and f[dim] is not None and old != -1:
            return f[dim].size(self.T_new, old, self.batch)
        return old

    def in_sizes(self, src: Any, dim: int) -> tuple[int, int, Optional[DimFact]]:
        shp = shape_of(src) or ()
        f = self.facts.get(src.name, ()) if isinstance(src, fx.Node) else ()
        dim = dim % max(len(shp), 1)
        old = shp[dim] if dim < len(shp) else 0
        fact = f[dim] if dim < len(f) else None
        new = fact.size(self.T_new, old, self.batch) if fact is not None else old
        return old, new, fact

    # -- per-op handlers -------------------------------------------------

    def sizes(self, node: fx.Node, index: int, offset: int = 0) -> tuple:
        args = list(node.args)
        lst = list(args[index])
        args[index] = [self.new_size(node, i + offset, v) if isinstance(v, int) else v for i, v in enumerate(lst)]
        return tuple(args)

    def unflatten(self, node: fx.Node) -> tuple:
        dim = node.args[1] % len(shape_of(node.args[0]) or (1,))
        return self.sizes(node, 2, dim)

    def table_window(self, node: fx.Node, dim: int, start: Any, length: Any) -> Optional[int]:
        """The new length of a window ``[start, start + length)`` cut along ``dim`` from a tensor
        with no time dim there when the output runs along time (``cos_cached[:t]``: a table cut
        to the sequence length), else None. A table too short for the new length makes the
        output shape wrong, which the verification reports."""
        f = self.out_facts(node)
        shp = shape_of(node) or ()
        dim = dim % max(len(shp), 1)
        if dim >= len(f) or f[dim] is None or f[dim].kind != "shift" or not isinstance(length, int):
            return None
        if dim >= len(shp) or length != shp[dim] or not isinstance(start, int) or start < 0:
            return None
        return f[dim].size(self.T_new, length, self.batch)

    def slice(self, node: fx.Node) -> tuple:
        args = list(node.args) + [None] * (5 - len(node.args))
        src, dim, start, end, step = args[:5]
        dim = 0 if dim is None else dim
        old, new, fact = self.in_sizes(src, dim)
        if fact is None and step in (None, 1) and isinstance(end, int):
            first = 0 if start is None else start
            length = self.table_window(node, dim, first, end - first)
            if length is not None:
                args[3] = first + length
                return tuple(args[: max(len(node.args), 4)])
        if fact is not None and fact.kind == "fixed" and old != new:
            # a batch dim: only a slice over the whole batch moves with it (a partial one keeps
            # its bounds; the verification refuses what that gets wrong)
            if start in (None, 0) and isinstance(end, int) and old <= end < 2**62:
                args[3] = new
            return tuple(args[: max(len(node.args), 4)])
        if fact is None or fact.kind == "fixed" or old == new:
            return tuple(node.args)
        delta = new - old
        start = 0 if start is None else start
        if start > 0 and 2 * start >= old:
            start += delta  # counted from the end
        if end is not None and 0 <= end < old and 2 * end >= old:
            end += delta
        elif end is not None and end >= old:
            end = new if end < 2**62 else end
        args[2], args[3] = start, end
        return tuple(args[: max(len(node.args), 4)])

    def narrow(self, node: fx.Node) -> tuple:
        src, dim, start, length = node.args
        old, new, fact = self.in_sizes(src, dim)
        if fact is None:
            window = self.table_window(node, dim, start, length)
            if window is not None:
                return (src, dim, start, window)
        if fact is None or fact.kind == "fixed" or old == new:
            return tuple(node.args)
        out = self.new_size(node, dim % len(shape_of(node) or (1,)), length)
        if start > 0 and 2 * start >= old:
            start += new - old
        return (src, dim, start, out)

    def select(self, node: fx.Node) -> tuple:
        src, dim, index = node.args
        old, new, fact = self.in_sizes(src, dim)
        if fact is None or fact.kind == "fixed" or index < 0 or 2 * index < old:
            return tuple(node.args)
        return (src, dim, index + new - old)

    def arange(self, node: fx.Node) -> tuple:
        f = self.out_facts(node)
        if not f or f[0] is None:
            return tuple(node.args)
        old_len = (shape_of(node) or (0,))[0]
        new_len = f[0].size(self.T_new, old_len, self.batch)
        args = list(node.args)
        if node.target is aten.arange.default:
            args[0] = new_len
        else:
            start = args[0]
            step = args[2] if len(args) > 2 else 1
            args[1] = start + new_len * step
        return tuple(args)


_SIZE_ARG: dict[Any, int] = {
    aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1,
    aten.expand.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1,
    aten.new_empty.default: 1, aten.new_full.default: 1, aten.zeros.default: 0,
    aten.ones.default: 0, aten.empty.memory_format: 0, aten.full.default: 0,
    aten.rand.default: 0, aten.randn.default: 0, aten.broadcast_to.default: 1,
}
_HANDLERS: dict[Any, Callable[[_Rewriter, fx.Node], tuple]] = {
    aten.unflatten.int: _Rewriter.unflatten,
    aten.slice.Tensor: _Rewriter.slice,
    aten.narrow.default: _Rewriter.narrow,
    aten.select.int: _Rewriter.select,
    aten.arange.default: _Rewriter.arange,
    aten.arange.start: _Rewriter.arange,
    aten.arange.start_step: _Rewriter.arange,
}
# Ops whose time-carrying outputs cannot be re-specialised from their arguments.
_REFUSE = {aten.as_strided.default, aten.empty_strided.default, aten.split_with_sizes.default,
           aten.tensor_split.sections, aten.tensor_split.indices, aten.lift_fresh_copy.default,
           aten.lift_fresh.default}


def _symint_args_suspicious(node: fx.Node, T_old: int, batch: tuple[int, int] = (1, 1)) -> bool:
    """Unhandled integer size arguments equal to the captured length, or to the captured length
    times the captured batch when the batch changes (whole-graph mode)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or T_old <= 1:
        return False
    counts = {T_old, 1.0 / T_old}
    if batch[0] != batch[1]:
        counts |= {batch[0] * T_old, 1.0 / (batch[0] * T_old)}
    for arg, val in zip(schema.arguments, node.args):
        t = str(arg.type)
        if "SymInt" in t or t in ("Scalar", "float", "int"):
            vals = val if isinstance(val, (list, tuple)) else [val]
            for v in vals:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v in counts:
                    return True
    return False


_FAKE_VALUE_KEYS = ("val", "tensor_meta", "example_value")


def respecialize(gm: fx.GraphModule, facts: Facts, T_old: int, T_new: int, *,
                 strict_scalars: bool = False, module_outputs: Optional[Callable[[fx.Node, list], Any]] = None,
                 batch: tuple[int, int] = (1, 1), keep_values: bool = True,
                 rewrite_args: Optional[Callable[[fx.Node], Optional[tuple[tuple, dict]]]] = None) -> fx.GraphModule:
    """A copy of ``gm`` for sequence length ``T_new`` (verified; see the module doc).

    ``rewrite_args(node)``: the node's ``(args, kwargs)`` at the new sizes, or None to rewrite
    them from the facts (:meth:`gradshard.passes.symbolic_sizes.SymbolicSizes.rewrite_args`
    for the nodes a symbolic trace covers).

    ``keep_values=False``: the copy's nodes keep no fake values once verified (a copy that is
    only run: each value holds a fake tensor, and a program keeps one copy per shard length).

    ``batch``: the captured and the new batch size; dims whose facts carry the batch move with it.

    ``strict_scalars``: refuse graphs with unhandled integer/scalar arguments equal to
    ``T_old`` (used for whole programs, where e.g. a baked ``1/T`` would be wrong).
    ``module_outputs(node, args)`` produces fake outputs for ``call_module`` nodes during
    verification (default: call the module under the fake mode).
    """
    rw = _Rewriter(facts, T_old, T_new, batch)
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        own = rewrite_args(node) if rewrite_args is not None and node.op == "call_function" else None
        if own is not None:
            args, kwargs = own
            new = new_graph.create_node(node.op, node.target, fx.node.map_arg(args, lambda a: env[a]),
                                        fx.node.map_arg(kwargs, lambda a: env[a]), name=node.name)
        elif node.op == "call_function":
            f = facts.get(node.name, ())
            timed = any(x is not None and x.moves(batch) for x in f)
            in_timed = any(any(x is not None and x.moves(batch) for x in facts.get(a.name, ())) for a in node.all_input_nodes)
            if node.target in _REFUSE and timed:
                raise RespecializeError(f"node `{node.name}` ({node.target}) has a time-carrying output built from baked data")
            if node.target in _SIZE_ARG:
                args = rw.sizes(node, _SIZE_ARG[node.target]) if timed else tuple(node.args)
            elif node.target in _HANDLERS and (timed or in_timed):
                args = _HANDLERS[node.target](rw, node)
            else:
                if strict_scalars and (timed or in_timed) and _symint_args_suspicious(node, T_old, batch):
                    raise RespecializeError(
                        f"node `{node.name}` ({node.target}) has an argument equal to the captured length {T_old}")
                args = tuple(node.args)
            new = new_graph.create_node(node.op, node.target, fx.node.map_arg(args, lambda a: env[a]),
                                        fx.node.map_arg(node.kwargs, lambda a: env[a]), name=node.name)
        else:
            new = new_graph.node_copy(node, lambda a: env[a])
        new.meta = dict(node.meta)
        env[node] = new
    out = graph_module(gm, new_graph, gm.__class__.__name__)
    _verify(out, facts, T_new, batch, module_outputs, keep_values)
    if not keep_values:
        for node in out.graph.nodes:
            for key in _FAKE_VALUE_KEYS:
                node.meta.pop(key, None)
    return out


def _verify(out: fx.GraphModule, facts: Facts, T_new: int, batch: tuple[int, int],
            module_outputs: Optional[Callable[[fx.Node, list], Any]], keep_values: bool) -> None:
    """:func:`fake_propagate` ``out``, or replay a propagation of a graph with the same value key
    (:mod:`gradshard.passes.respecialize_memo`): its refusal, or (``keep_values``) its values."""
    key = None if module_outputs is not None else propagation_key(out, facts, T_new, batch)
    stored = MEMO.get(key) if key is not None else None
    if stored is not None:
        if stored.error is not None:
            raise RespecializeError(stored.error)
        if keep_values:
            apply_outcome(out, stored)
        return
    values = _meta_values(out, facts, T_new, batch) if module_outputs is None else None
    if values is not None:  # meta tensors: made fake tensors only where they are kept
        outcome = Outcome(values=values)
        if keep_values:
            apply_outcome(out, outcome)
    else:
        before = snapshot_values(out) if key is not None else []
        try:
            fake_propagate(out, facts, T_new, module_outputs=module_outputs, batch=batch)
        except RespecializeError as exc:
            if key is not None:
                MEMO.put(key, Outcome(error=str(exc)))
            raise
        outcome = record_outcome(out, before) if key is not None else None
    if key is not None:
        MEMO.put(key, outcome)


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Any:
    """A node that fails at the new length is a refusal reported as :class:`RespecializeError`;
    torch also logs the failing meta kernel at error level, which is noise here."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _input_at(node: fx.Node, facts: Facts, T_new: int, batch: tuple[int, int], device: Any) -> torch.Tensor:
    """An empty tensor for placeholder ``node`` at length ``T_new`` (its captured value's dtype and
    ``requires_grad``) on ``device``."""
    old = node.meta["val"]
    shape = expected_shape(old.shape, facts.get(node.name, ()), T_new, batch)
    return torch.empty(shape, dtype=old.dtype, device=device).requires_grad_(old.requires_grad)


def fake_propagate(gm: fx.GraphModule, facts: Facts, T_new: int, *,
                   module_outputs: Optional[Callable[[fx.Node, list], Any]] = None,
                   batch: tuple[int, int] = (1, 1)) -> None:
    """Run ``gm`` on fake tensors at length ``T_new``; check every shape; refresh ``meta['val']``
    (placeholders included)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[fx.Node, Any] = {}
    # private cache: re-specialising runs at a call's first use of a length, outside the
    # compile's own private cache; its entries would stay in torch's process-wide one
    with private_dispatch_cache(), mode, _quiet_fake_tensor_errors():
        for i, node in enumerate(gm.graph.nodes):
            if node.op == "placeholder":
                old = node.meta.get("val")
                if not isinstance(old, torch.Tensor):
                    env[node] = old
                    continue
                env[node] = _input_at(node, facts, T_new, batch, old.device)
                node.meta["val"] = env[node]  # analyses of the new graph read its inputs' shapes here
                continue
            if node.op == "output":
                continue
            args = fx.node.map_arg(node.args, lambda a: env[a])
            kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
            try:
                if node.op == "call_function":
                    val = node.target(*args, **kwargs)
                elif node.op == "get_attr":
                    val = operator.attrgetter(node.target)(gm)
                elif node.op == "call_module":
                    val = module_outputs(node, list(args)) if module_outputs else gm.get_submodule(node.target)(*args, **kwargs)
                else:
                    val = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported as a refusal
                raise RespecializeError(f"node `{node.name}` fails at length {T_new}: {type(exc).__name__}: {exc}") from exc
            env[node] = val
            old = node.meta.get("val")
            if isinstance(old, torch.Tensor) and isinstance(val, torch.Tensor):
                want = expected_shape(old.shape, facts.get(node.name, ()), T_new, batch)
                if tuple(val.shape) != want:
                    raise RespecializeError(
                        f"node `{node.name}` ({getattr(node.target, '__name__', node.target)}) has shape "
                        f"{tuple(val.shape)} at length {T_new}, expected {want}")
                node.meta["val"] = val
            elif node.op == "call_function" and val is not None:
                node.meta["val"] = val


def _meta_values(gm: fx.GraphModule, facts: Facts, T_new: int, batch: tuple[int, int]) -> Optional[tuple]:
    """What :func:`fake_propagate` would write, computed on meta tensors
    (:mod:`gradshard.passes.meta_propagate`): ``(position, value)`` per placeholder and
    ``call_function`` node, or None (nothing run that decides: a node that cannot run on meta
    tensors, or a shape other than its facts predict) for the fake-tensor path to decide and word."""
    def placeholder(node: fx.Node) -> Any:
        old = node.meta.get("val")
        return _input_at(node, facts, T_new, batch, "meta") if isinstance(old, torch.Tensor) else old

    env = run_on_meta(gm, placeholder)
    if env is None:
        return None
    values = []
    for i, node in enumerate(gm.graph.nodes):
        if node not in env:
            continue
        val, old = env[node], node.meta.get("val")
        if isinstance(old, torch.Tensor) and isinstance(val, torch.Tensor) and \
                tuple(val.shape) != expected_shape(old.shape, facts.get(node.name, ()), T_new, batch):
            return None
        if (node.op == "placeholder" and isinstance(old, torch.Tensor)) or (node.op == "call_function" and val is not None):
            values.append((i, val))
    return tuple(values)


def call_length(cap: Any, graph: fx.Graph, time_inputs: Mapping[str, int], args: tuple,
                kwargs: dict) -> Optional[int]:
    """The time length of a call whose inputs differ from ``cap``'s example inputs only along
    their time dims (``time_inputs``: placeholder name -> time dim of ``graph``'s inputs), or
    None when anything else differs (structure, dtype, rank, device, ``requires_grad``, another
    size, a constant argument) or no input carries time."""
    sizes = call_sizes(cap, graph, time_inputs, {}, args, kwargs)
    return None if sizes is None else sizes[0]


def call_sizes(cap: Any, graph: fx.Graph, time_inputs: Mapping[str, int], batch_inputs: Mapping[str, int],
               args: tuple, kwargs: dict) -> Optional[tuple[int, Optional[int]]]:
    """``(T, B)`` of a call whose inputs differ from ``cap``'s example inputs only along their
    time dims (``time_inputs``) and batch dims (``batch_inputs``; placeholder name -> dim of
    ``graph``'s inputs), or None when anything else differs (structure, dtype, rank, device,
    ``requires_grad``, another size, a constant argument) or no input carries time. ``B`` is
    None when no input has a batch dim."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != cap.input_spec:
        return None
    new = [leaves[i] for i in cap.tensor_positions]
    old = cap.example_inputs[cap.num_state:]
    phs = list(graph.find_nodes(op="placeholder"))[cap.num_state:]
    if len(new) != len(old) or len(phs) != len(old):
        return None
    found: dict[str, Optional[int]] = {"T": None, "B": None}
    for t, o, ph in zip(new, old, phs):
        if (not isinstance(t, torch.Tensor) or t.dtype != o.dtype or t.dim() != o.dim() or t.device != o.device
                or t.requires_grad != o.requires_grad):
            return None
        axes = {time_inputs.get(ph.name): "T", batch_inputs.get(ph.name): "B"}
        for d, (a, b) in enumerate(zip(t.shape, o.shape)):
            which = axes.get(d)
            if which is None:
                if a != b:
                    return None
                continue
            if found[which] is not None and found[which] != int(a):
                return None
            found[which] = int(a)
    for i, leaf in enumerate(leaves):
        if i not in cap.tensor_positions and leaf is not cap.constant_leaves[i] and leaf != cap.constant_leaves[i]:
            return None
    return None if found["T"] is None else (found["T"], found["B"])


def cut_call(cap: Any, graph: fx.Graph, time_inputs: Mapping[str, int], args: tuple, kwargs: dict,
             length: int, batch_inputs: Mapping[str, int] | None = None,
             batch: Optional[int] = None) -> tuple[tuple, dict]:
    """The call's inputs cut to their first ``length`` steps along their time dims (and to
    their first ``batch`` rows along ``batch_inputs``' dims, when given)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    phs = list(graph.find_nodes(op="placeholder"))[cap.num_state:]
    for pos, ph in zip(cap.tensor_positions, phs):
        td = time_inputs.get(ph.name)
        if td is not None:
            leaves[pos] = leaves[pos].narrow(td, 0, length)
        bd = (batch_inputs or {}).get(ph.name)
        if bd is not None and batch is not None:
            leaves[pos] = leaves[pos].narrow(bd, 0, batch)
    return pytree.tree_unflatten(leaves, spec)
