"""A memo of :func:`gradshard.passes.respecialize.respecialize`'s shape verification.

Re-specialising rewrites a graph's length-dependent integers (cheap), then verifies the copy
by fake-tensor shape propagation (about 30 ms for a small region graph). One compile repeats
that propagation many times on graphs that are the same node for node: a region's check
(``producer_check``) and its runtime producer cut from the same nodes, every layer's region,
and the same shard and window lengths asked for again. The propagation's outcome depends on
nothing but

* the rewritten graph, position by position: op, target, arguments (nodes by position),
  the captured shape each node's ``meta['val']`` holds (placeholders: dtype, device and
  ``requires_grad`` too), and each ``get_attr`` tensor's metadata (and values when tiny),
* the facts of its nodes, the new length, the batch pair,
* torch's grad / inference / autocast modes,

so :func:`propagation_key` builds exactly that key (by value, never by object identity or
node name) and :class:`PropagationMemo` keeps, per key, the values propagation wrote
into ``meta['val']`` (by node position) or the refusal's message. A graph that is not fully
described by such a key (a ``call_module`` node, a target that is not a torch op or a
builtin, an argument that is not a plain constant, a symbolic size fact, a symbolic shape) gets
no key and is always propagated. The key is computed from the graph at each call, so a base
graph mutated in place between two calls simply gets another key.

Memory: the memo is a bounded LRU (:data:`MAX_ENTRIES`) holding only keys of plain
constants, torch ops and :class:`DimFact` records, and fake or meta tensors (no storage); it holds no
graph, module or parameter.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["Outcome", "PropagationMemo", "MEMO", "MAX_ENTRIES", "propagation_key", "snapshot_values",
           "record_outcome", "apply_outcome", "clear_memo", "fresh_memo"]

MAX_ENTRIES = 1024
_MISSING = object()
_LEAF_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format,
               type(Ellipsis))
_SMALL_CONSTANT = 16  # get_attr tensors up to this many elements are keyed by value too


class _NoKey(Exception):
    """The graph is not fully described by a value key (it is propagated every time)."""


@dataclass(frozen=True)
class Outcome:
    """What one propagation did: the ``meta['val']`` it wrote per node position, or the
    message of the :class:`RespecializeError` it raised."""

    values: tuple[tuple[int, Any], ...] = ()
    error: Optional[str] = None


class PropagationMemo:
    """A bounded, thread-safe LRU of :class:`Outcome` by :func:`propagation_key`."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, Outcome] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Optional[Outcome]:
        """The outcome stored for ``key`` (counted as a hit), else None (a miss)."""
        with self._lock:
            out = self._entries.get(key)
            if out is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return out

    def put(self, key: Hashable, outcome: Outcome) -> None:
        """Store ``outcome`` for ``key``, dropping the least recently used entries past the bound."""
        with self._lock:
            self._entries[key] = outcome
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


MEMO = PropagationMemo()


def clear_memo() -> None:
    """Empty the process-wide memo (:data:`MEMO`)."""
    MEMO.clear()


@contextlib.contextmanager
def fresh_memo() -> Iterator[None]:
    """Run the block with :data:`MEMO` empty, as in a fresh process, and put its entries back after.

    What a compile costs depends on what earlier compiles left in the memo; the cost model
    measures (and predicts) the first step of a fresh process, so its compile probes and the
    first steps it is validated against run inside this."""
    with MEMO._lock:
        saved, MEMO._entries = MEMO._entries, OrderedDict()
    try:
        yield
    finally:
        with MEMO._lock:
            MEMO._entries = saved


# --------------------------------------------------------------------------- the key


def _target_key(target: Any) -> Hashable:
    """A torch op or a builtin (alive for the process: safe to hold and to compare); else no key."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target
    if isinstance(target, types.BuiltinFunctionType):
        return target
    raise _NoKey(f"target {target!r}")


def _arg_key(a: Any, index: Mapping[fx.Node, int]) -> Hashable:
    if isinstance(a, fx.Node):
        return ("%", index[a])
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg_key(x, index) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(v, index)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _arg_key(a.start, index), _arg_key(a.stop, index), _arg_key(a.step, index))
    if isinstance(a, _LEAF_TYPES):
        return (type(a), a)
    raise _NoKey(f"argument {a!r}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    if any(not isinstance(s, int) for s in t.shape):
        raise _NoKey("symbolic shape")
    return tuple(t.shape)


def _placeholder_key(val: Any) -> Hashable:
    if isinstance(val, torch.Tensor):
        return ("T", _shape(val), val.dtype, val.device, val.requires_grad)
    if isinstance(val, _LEAF_TYPES):
        return (type(val), val)
    raise _NoKey(f"placeholder value {type(val).__name__}")


def _attr_key(val: Any) -> Hashable:
    if not isinstance(val, torch.Tensor):
        raise _NoKey(f"attribute {type(val).__name__}")
    from torch._subclasses.fake_tensor import FakeTensor

    content = None
    if not isinstance(val, FakeTensor) and val.layout == torch.strided and val.numel() <= _SMALL_CONSTANT:
        content = tuple(val.detach().cpu().reshape(-1).tolist())
    return (_shape(val), tuple(val.stride()), val.dtype, val.device, val.layout, val.requires_grad, content)


def _facts_key(facts: tuple) -> Hashable:
    if any(f is not None and f.kind == "symbolic" for f in facts):
        raise _NoKey("symbolic size fact")  # its size_of compares by expression, not by trace
    return facts


def _global_state() -> Hashable:
    autocast = tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


def propagation_key(gm: fx.GraphModule, facts: Mapping[str, tuple], T_new: int,
                    batch: tuple[int, int]) -> Optional[Hashable]:
    """The value key of propagating ``gm`` at ``T_new`` (see the module doc), or None when the
    graph is not fully described by one."""
    index: dict[fx.Node, int] = {}
    nodes: list[Hashable] = []
    try:
        for i, node in enumerate(gm.graph.nodes):
            index[node] = i
            val = node.meta.get("val")
            if node.op == "placeholder":
                meta: Hashable = _placeholder_key(val)
                target: Hashable = None
            elif node.op == "get_attr":
                meta = ("T", _shape(val)) if isinstance(val, torch.Tensor) else None
                target = _attr_key(operator.attrgetter(node.target)(gm))
            elif node.op == "call_function":
                meta = ("T", _shape(val)) if isinstance(val, torch.Tensor) else None
                target = _target_key(node.target)
            elif node.op in ("call_method", "output"):
                meta = ("T", _shape(val)) if isinstance(val, torch.Tensor) else None
                target = node.target
            else:
                raise _NoKey(f"{node.op} node")
            args = (_arg_key(node.args, index), _arg_key(dict(node.kwargs), index))
            nodes.append((node.op, target, args, meta, _facts_key(tuple(facts.get(node.name, ())))))
    except (_NoKey, AttributeError):
        return None
    return (tuple(nodes), int(T_new), tuple(batch), _global_state())


# --------------------------------------------------------------------------- outcomes


def snapshot_values(gm: fx.GraphModule) -> list[Any]:
    """Each node's ``meta['val']`` before propagation (to tell what propagation wrote)."""
    return [n.meta.get("val", _MISSING) for n in gm.graph.nodes]


def record_outcome(gm: fx.GraphModule, before: list[Any]) -> Outcome:
    """The values propagation wrote into ``gm``'s nodes since ``before``."""
    return Outcome(values=tuple((i, n.meta["val"]) for i, (n, old) in enumerate(zip(gm.graph.nodes, before))
                                if n.meta.get("val", _MISSING) is not old))


def apply_outcome(gm: fx.GraphModule, outcome: Outcome) -> None:
    """Write a stored propagation's values into ``gm``'s nodes (same positions). Meta tensors
    (a propagation on meta tensors) are written as fake tensors on the device of the value the
    node held before (its capture's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode: Optional[FakeTensorMode] = None
    nodes = list(gm.graph.nodes)
    for i, val in outcome.values:
        node = nodes[i]
        leaves = [x for x in pytree.tree_leaves(val) if isinstance(x, torch.Tensor) and x.device.type == "meta"]
        if leaves:
            mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
            device = next((x.device for x in pytree.tree_leaves(node.meta.get("val")) if isinstance(x, torch.Tensor)),
                          torch.device("cpu"))
            val = pytree.tree_map_only(
                torch.Tensor, lambda t: mode.fake_tensor_converter.from_meta_and_device(mode, t, device)
                if t.device.type == "meta" else t, val)
        node.meta["val"] = val
