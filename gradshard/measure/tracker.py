"""The live-tensor tracker: bytes of tensor storages allocated in a region and still alive.

:class:`LiveTensorTracker` is a ``TorchDispatchMode`` that sees every op output (forward ops,
ops the autograd engine runs during backward, recomputation), adds the bytes of each storage the
first time it appears and subtracts them when the storage is freed (a weakref callback on the
storage, so frees by autograd during backward are seen). Views share their base's storage and
in-place ops return it, so neither adds bytes. It works on fake tensors too (the cost model's
probes), where no allocator is involved.

It counts what goes through the dispatcher. Code compiled by ``torch.compile`` allocates its
buffers directly; by default the tracker runs such code eagerly (``force_eager``), and with
``force_eager=False`` it lets compiled code run compiled and sees only the ops that code
dispatches (``gs.measure`` then takes the peak from the allocator instead).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveSample", "LiveTensorTracker", "StorageRef", "graph_task_id", "storage_of", "tensors_in"]

graph_task_id = torch._C._current_graph_task_id  # -1 outside the autograd engine

# Outputs of these ops are new storages although their schemas say they alias an input:
# lift_fresh returns a constant created outside the dispatcher (``torch.tensor([...])``).
_ALWAYS_NEW = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
# Ops whose schemas promise fresh outputs but which return views of an input.
_SCHEMA_LIES = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsafe_chunk.default,
    torch.ops.aten.unsafe_split.Tensor,
    torch.ops.aten.unsafe_split_with_sizes.default,
}
_FRESH_OUTPUTS: dict[Any, bool] = {}


def _has_fresh_outputs(func: Any) -> bool:
    """Whether every output of ``func`` is a new storage (so inputs need not be inspected).

    Trusted only for aten ops, from their schemas: returns without an alias annotation are
    freshly allocated. Anything else (custom ops, views, in-place and out= ops) is checked
    against the storages of its inputs at run time.
    """
    if func in _ALWAYS_NEW:
        return True
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "namespace", None) != "aten" or func in _SCHEMA_LIES:
        return False
    return all(r.alias_info is None for r in schema.returns)



class StorageRef(weakref.ref):
    """Weak reference to an untyped storage that remembers its key and counted size."""

    __slots__ = ("key", "nbytes")
    key: int
    nbytes: int


@dataclass(frozen=True)
class LiveSample:
    """One point of a :class:`LiveTensorTracker` timeline.

    ``op`` is the aten overload just executed (``"aten.mm.default"``) or a :meth:`mark` label;
    ``live_bytes`` the bytes live right after it; ``phase`` is ``"forward"`` (outside the autograd
    engine), ``"backward"`` (run by the autograd engine) or ``"mark"``.
    """

    op: str
    live_bytes: int
    phase: str


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's output or arguments (aten schemas nest at most one list deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from (t for t in tree_leaves(item) if isinstance(t, torch.Tensor))
    elif obj is not None and not isinstance(obj, (int, float, bool, str)):
        yield from (t for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without one (sparse, some subclasses)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _input_storage_keys(args: tuple, kwargs: dict | None) -> set[int]:
    keys: set[int] = set()
    for group in (args, tuple(kwargs.values()) if kwargs else ()):
        for item in group:
            if isinstance(item, torch.UntypedStorage):
                keys.add(item._cdata)
                continue
            for t in tensors_in(item):
                st = storage_of(t)
                if st is not None:
                    keys.add(st._cdata)
    return keys


# torch.compiler.set_stance is process-wide, not per thread: trackers entered on several
# threads (threaded ranks) must share one "force_eager" stance, set by the first to enter and
# restored by the last to leave -- nested set/restore pairs from different threads would
# otherwise leave the process in force_eager for good.
_STANCE_LOCK = threading.Lock()
_STANCE: dict[str, Any] = {"users": 0, "handle": None}


def _enter_eager_stance() -> None:
    with _STANCE_LOCK:
        if _STANCE["users"] == 0:
            # Constructing set_stance switches the stance at once; its __exit__ restores it.
            _STANCE["handle"] = torch.compiler.set_stance("force_eager")
        _STANCE["users"] += 1


def _exit_eager_stance() -> None:
    with _STANCE_LOCK:
        _STANCE["users"] -= 1
        if _STANCE["users"] == 0:
            handle, _STANCE["handle"] = _STANCE["handle"], None
            handle.__exit__(None, None, None)


class LiveTensorTracker(TorchDispatchMode):
    """Count the bytes of tensor storages allocated inside the context and still alive.

    Every op output (forward ops, ops run by the autograd engine during backward, recomputation)
    passes through this dispatch mode. A storage is counted once, when first seen as the output
    of an op that did not receive it as an input, and uncounted when it is freed. Views and
    in-place results share a counted storage and add nothing; storages that existed before the
    context (parameters, inputs, existing ``.grad``) are never counted, and neither are their
    frees. Gradients created during the context count while they live.

    ``device``: count only storages on this device (``None``: all devices except ``meta``).
    ``timeline``: record a :class:`LiveSample` after every op (costs a list append per op).
    ``count_fake``: count fake tensors (the cost model's probes run on them); ``False`` when the
    region runs real tensors, so a trace inside it (a plan capturing its graph on a first call)
    adds no bytes. :meth:`set_count_fake` changes it mid-region.
    ``force_eager``: run ``torch.compile``'d code eagerly while active
    (``torch.compiler.set_stance("force_eager")``), so every op it runs is seen. Compiled code
    runs compiled again after exit. With ``force_eager=False`` compiled code runs compiled:
    the tracker declares ``ignore_compile_internals``, so Dynamo neither falls back to eager
    nor marks the frame "skip" for good; it is off while Dynamo and Inductor compile and on
    while the compiled code runs, where it sees only the ops that code dispatches (extern
    kernels such as ``aten.mm.out``, custom ops), not the buffers Inductor allocates itself.

    Usage::

        with LiveTensorTracker(timeline=True) as tr:
            loss = model(x).sum(); loss.backward()
        tr.peak_bytes, tr.live_bytes, tr.timeline

    Counters stay readable after exit; frees after exit are no longer observed.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        timeline: bool = False,
        count_fake: bool = True,
        force_eager: bool = True,
    ):
        super().__init__()
        self._force_eager = force_eager
        self._stance: Any = None
        self._device = None if device is None else torch.device(device)
        self._count_fake = count_fake
        self.counts_tensor: Callable[[torch.Tensor], bool] = self._make_device_predicate()
        """``tensor -> bool``: whether the tensor is counted (its device; fake or not), a fast per-op test."""
        self._record_timeline = timeline
        self._lock = threading.RLock()
        self._alive: dict[int, StorageRef] = {}  # storages allocated inside the context
        self._foreign: dict[int, StorageRef] = {}  # storages known to predate the context
        self._live = 0
        self._peak = 0
        self._allocated = 0
        self._peak_op: Any = None
        self._peak_phase = "forward"
        self._phase_peak = {"forward": 0, "backward": 0}
        self._num_ops = 0
        self._backward_ops = 0
        self._samples: list[tuple[Any, int, str]] = []
        self._active = False
        self._entered = False

    # ----- context management ------------------------------------------------------------

    def __enter__(self) -> LiveTensorTracker:
        if self._entered:
            raise RuntimeError(
                "LiveTensorTracker is single-use: this instance was already entered; "
                "create a new LiveTensorTracker for each measured region."
            )
        self._entered = True
        if self._force_eager:
            _enter_eager_stance()
            self._stance = True
        try:
            super().__enter__()
        except BaseException:
            self._restore_stance()
            raise
        self._active = True
        return self

    def _restore_stance(self) -> None:
        if self._stance is not None:
            self._stance = None
            _exit_eager_stance()

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._restore_stance()
            with self._lock:
                self._active = False
                # Dropping the weakrefs cancels their callbacks: frees after exit are ignored.
                self._alive = {}
                self._foreign = {}

    # ----- results -----------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        """Bytes allocated inside the context and alive now (at exit, once exited)."""
        return self._live

    @property
    def peak_bytes(self) -> int:
        """Highest ``live_bytes`` observed (sampled after every op)."""
        return self._peak

    @property
    def allocated_bytes(self) -> int:
        """Total bytes of all storages allocated inside the context (freed or not)."""
        return self._allocated

    @property
    def peak_op(self) -> str | None:
        """The op whose output brought ``live_bytes`` to its peak (None if nothing allocated)."""
        return None if self._peak_op is None else str(self._peak_op)

    @property
    def peak_phase(self) -> str:
        """``"forward"`` or ``"backward"``: where the peak happened."""
        return self._peak_phase

    @property
    def phase_peak_bytes(self) -> dict[str, int]:
        """Highest ``live_bytes`` after an op of each phase: ``{"forward": .., "backward": ..}``.

        The backward peak includes whatever the forward left alive (saved activations).
        """
        return dict(self._phase_peak)

    @property
    def num_ops(self) -> int:
        """Number of ops dispatched inside the context."""
        return self._num_ops

    @property
    def backward_ops(self) -> int:
        """Number of those ops run by the autograd engine."""
        return self._backward_ops

    @property
    def timeline(self) -> list[LiveSample]:
        """Samples after every op and mark (empty unless ``timeline=True``)."""
        return [LiveSample(str(op), live, phase) for op, live, phase in self._samples]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was allocated inside the context and is still tracked."""
        st = storage_of(t)
        return st is not None and st._cdata in self._alive

    def owns_key(self, key: int) -> bool:
        """Whether the storage with this ``_cdata`` key was allocated inside the context and is alive."""
        return key in self._alive

    def counts_device(self, device: torch.device) -> bool:
        """Whether storages on ``device`` are counted by this tracker."""
        if self._device is None:
            return device.type != "meta"
        if device.type != self._device.type:
            return False
        return self._device.index is None or device.index == self._device.index

    def mark(self, label: str) -> None:
        """Append a timeline sample labelled ``label`` (no-op unless ``timeline=True``)."""
        if self._record_timeline:
            with self._lock:
                self._samples.append((label, self._live, "mark"))

    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes."""
        with self._lock:
            self._peak = self._live
            self._peak_op = None
            self._phase_peak = {"forward": self._live, "backward": self._live}

    # ----- dispatch ----------------------------------------------------------------------

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` compile and run compiled code under this mode (see ``force_eager``)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # torch wraps every __torch_dispatch__ in a Dynamo-disabling shim; subclasses extend
        # _dispatch instead, so one op pays for one shim.
        return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(func, HigherOrderOperator):
            out = self._run_higher_order(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self._active:
            self._observe(func, out, args, kwargs)
        return out

    def _run_higher_order(self, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
        """Run a higher-order op (``torch.cond``, scans, ...) below this mode.

        The mode is popped while its ``__torch_dispatch__`` runs, so the op executes normally;
        its outputs are observed, the temporaries inside it are not. (Dense implementations of
        these ops assert that no mode is active, so they cannot be re-entered with the mode on.)
        """
        return func(*args, **kwargs)

    def _observe(self, func: Any, out: Any, args: tuple, kwargs: dict | None) -> None:
        phase = "forward" if graph_task_id() == -1 else "backward"
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(tensors_in(out))
        fresh = _FRESH_OUTPUTS.get(func)
        if fresh is None:
            fresh = _FRESH_OUTPUTS[func] = _has_fresh_outputs(func)
        input_keys: set[int] | None = None
        # Output storages stay referenced by this list until the method returns, so no free
        # callback for them can interleave with the bookkeeping below.
        storages = []
        with self._lock:
            for t in outs:
                st = storage_of(t)
                if st is None or not self.counts_tensor(t):
                    continue
                storages.append(st)
                key = st._cdata
                known = self._alive.get(key)
                if known is not None:
                    nbytes = st.nbytes()
                    if nbytes != known.nbytes:  # resized in place (resize_, out= variants)
                        self._allocated += max(0, nbytes - known.nbytes)
                        self._add_live(nbytes - known.nbytes, func, phase)
                        known.nbytes = nbytes
                    continue
                if key in self._foreign:
                    continue
                if not fresh:
                    if input_keys is None:
                        input_keys = _input_storage_keys(args, kwargs)
                    if key in input_keys:  # aliases a storage that predates the context
                        ref = StorageRef(st, self._on_foreign_free)
                        ref.key, ref.nbytes = key, 0
                        self._foreign[key] = ref
                        continue
                nbytes = st.nbytes()
                ref = StorageRef(st, self._on_free)
                ref.key, ref.nbytes = key, nbytes
                self._alive[key] = ref
                self._allocated += nbytes
                self._add_live(nbytes, func, phase)
            self._num_ops += 1
            if phase == "backward":
                self._backward_ops += 1
            if self._live > self._phase_peak[phase]:
                self._phase_peak[phase] = self._live
            if self._record_timeline:
                self._samples.append((func, self._live, phase))
        del storages

    def set_count_fake(self, count_fake: bool) -> None:
        """Count fake tensors from now on, or stop counting them (storages already counted stay
        counted until freed)."""
        self._count_fake = count_fake
        self.counts_tensor = self._make_device_predicate()

    def _make_device_predicate(self) -> Callable[[torch.Tensor], bool]:
        """A fast ``tensor -> counted?`` test (called for every op output)."""
        on_device = self._make_on_device_predicate()
        if self._count_fake:
            return on_device
        return lambda t: on_device(t) and not is_fake(t)

    def _make_on_device_predicate(self) -> Callable[[torch.Tensor], bool]:
        device = self._device
        if device is None:
            return lambda t: not t.is_meta
        if device.type == "cpu":
            return operator.attrgetter("is_cpu")
        if device.type == "cuda" and device.index is not None:
            index = device.index
            return lambda t: t.is_cuda and t.get_device() == index
        return lambda t: self.counts_device(t.device)

    def _add_live(self, nbytes: int, func: Any, phase: str) -> None:
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live
            self._peak_op = func
            self._peak_phase = phase

    def _on_free(self, ref: StorageRef) -> None:
        with self._lock:
            if self._alive.get(ref.key) is ref:
                del self._alive[ref.key]
                self._live -= ref.nbytes

    def _on_foreign_free(self, ref: StorageRef) -> None:
        with self._lock:
            if self._foreign.get(ref.key) is ref:
                del self._foreign[ref.key]
