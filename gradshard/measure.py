"""Measure one training step: peak memory, saved activations, FLOPs and wall time.

``measure(step_fn, *args)`` runs ``step_fn(*args, **kwargs)`` -- which must run the forward
*and* the backward itself -- and returns a :class:`Measurement`::

    m = gs.measure(lambda x: model(x).sum().backward(), x)
    m = gs.measure(gs.measure.step(lambda x: model(x).sum()), x)   # same thing
    print(m)            # peak 12.0 MiB | saved 8.0 MiB | 1.2 GFLOP (fwd 0.4, bwd 0.8) | ...

What is counted (all byte counts are of tensor *storages*, i.e. ``untyped_storage().nbytes()``):

- ``peak_bytes``: the highest number of bytes live at once during the step, counting only storages
  allocated during the step. Everything alive before the step (parameters, inputs, optimizer
  state, existing ``.grad``) is the baseline and is not counted. On CPU (and any non-CUDA device)
  this comes from :class:`LiveTensorTracker`, a ``TorchDispatchMode`` that sees every op output,
  adds the bytes of each storage the first time it appears and subtracts them when the storage is
  freed (a weakref callback on the storage, so frees by autograd during backward are seen). Views
  share their base's storage and in-place ops return it, so neither adds bytes. On CUDA the number
  is the caching allocator's ``max_memory_allocated()`` minus the allocation at the start of the
  step (this includes the allocator's 512-byte rounding, and credits frees of baseline tensors);
  the tracker's number is kept in ``tracked_peak_bytes``.
- ``saved_bytes``: bytes of distinct storages saved for backward (``saved_tensors_hooks``) that
  were allocated during the step, i.e. activations. ``saved_bytes_total`` also counts saved
  storages that existed before the step (parameters, inputs, buffers). A saved view counts its
  whole storage, because it keeps the whole storage alive. Only saves made outside the autograd
  engine count -- what the forward leaves for the backward; tensors saved while the engine runs
  (recomputation inside backward, ``create_graph``) show up in the peak instead.
- ``flops``: the whole step, counted with ``torch.utils.flop_counter``'s formulas exactly as
  ``FlopCounterMode`` counts them (matmuls, convolutions, attention; pointwise ops are free),
  but inside the tracker's dispatch mode so the step pays for one mode, not two.
  ``backward_flops`` are those of ops run by the autograd engine (including recomputation such
  as activation checkpointing, which happens during backward); ``forward_flops`` are the rest.
- ``seconds``: median wall time of ``repeat`` uninstrumented calls (``torch.cuda.synchronize``
  around each on CUDA). Memory and FLOPs come from one separate instrumented call.

``torch.compile``'d code runs eagerly during the instrumented call (so its ops are visible and
Dynamo's caches are left alone); the timed calls run it compiled. Memory and FLOPs therefore
describe the eager computation.

Limits: allocations that bypass the dispatcher (``torch.from_numpy``, custom C++ code) and scratch
memory inside a single kernel are invisible to the tracker; higher-order ops (``torch.cond``,
scans) run below it, so only their outputs are seen; sparse tensors and tensor subclasses without
a storage are skipped.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import platform
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

__all__ = [
    "LiveSample",
    "LiveTensorTracker",
    "Measurement",
    "StepContractError",
    "describe_device",
    "format_bytes",
    "format_flops",
    "measure",
    "step",
]

_graph_task_id = torch._C._current_graph_task_id  # -1 outside the autograd engine

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


class StepContractError(ValueError):
    """``step_fn`` broke the contract of :func:`measure` (e.g. it ran no backward)."""


# --------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """``4000 -> '3.91 KiB'``; exact below 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """``2.4e9 -> '2.40 GFLOP'``."""
    if abs(n) < 1000:
        return f"{int(n)} FLOP"
    for unit in ("KFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"):
        n /= 1000.0
        if abs(n) < 1000 or unit == "PFLOP":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def _format_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


# --------------------------------------------------------------------------------------------
# Live tensor tracking
# --------------------------------------------------------------------------------------------


class _StorageRef(weakref.ref):
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


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
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


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
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
            for t in _iter_tensors(item):
                st = _storage_of(t)
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
    ``force_eager``: run ``torch.compile``'d code eagerly while active
    (``torch.compiler.set_stance("force_eager")``). Compiled kernels allocate outside the
    dispatcher, so the tracker could not see them; and Dynamo, meeting a frame for the first
    time under a dispatch mode, marks it "skip" for good, which would de-optimize the caller's
    compiled function after the measurement. Compiled code runs compiled again after exit.

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
        force_eager: bool = True,
    ):
        super().__init__()
        self._force_eager = force_eager
        self._stance: Any = None
        self._device = None if device is None else torch.device(device)
        self._counts = self._make_device_predicate()
        self._record_timeline = timeline
        self._lock = threading.RLock()
        self._alive: dict[int, _StorageRef] = {}  # storages allocated inside the context
        self._foreign: dict[int, _StorageRef] = {}  # storages known to predate the context
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
        st = _storage_of(t)
        return st is not None and st._cdata in self._alive

    def _owns_key(self, key: int) -> bool:
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

    @contextlib.contextmanager
    def _reentered(self) -> Iterator[None]:
        TorchDispatchMode.__enter__(self)
        try:
            yield
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)

    def _observe(self, func: Any, out: Any, args: tuple, kwargs: dict | None) -> None:
        phase = "forward" if _graph_task_id() == -1 else "backward"
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(_iter_tensors(out))
        fresh = _FRESH_OUTPUTS.get(func)
        if fresh is None:
            fresh = _FRESH_OUTPUTS[func] = _has_fresh_outputs(func)
        input_keys: set[int] | None = None
        # Output storages stay referenced by this list until the method returns, so no free
        # callback for them can interleave with the bookkeeping below.
        storages = []
        with self._lock:
            for t in outs:
                st = _storage_of(t)
                if st is None or not self._counts(t):
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
                        ref = _StorageRef(st, self._on_foreign_free)
                        ref.key, ref.nbytes = key, 0
                        self._foreign[key] = ref
                        continue
                nbytes = st.nbytes()
                ref = _StorageRef(st, self._on_free)
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

    def _make_device_predicate(self) -> Callable[[torch.Tensor], bool]:
        """A fast ``tensor -> counted?`` test (called for every op output)."""
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

    def _on_free(self, ref: _StorageRef) -> None:
        with self._lock:
            if self._alive.get(ref.key) is ref:
                del self._alive[ref.key]
                self._live -= ref.nbytes

    def _on_foreign_free(self, ref: _StorageRef) -> None:
        with self._lock:
            if self._foreign.get(ref.key) is ref:
                del self._foreign[ref.key]


# --------------------------------------------------------------------------------------------
# Saved-for-backward accounting
# --------------------------------------------------------------------------------------------


class _SavedRecorder:
    """Distinct storages packed by ``saved_tensors_hooks`` while active."""

    def __init__(self, tracker: LiveTensorTracker):
        self._tracker = tracker
        self._seen: dict[int, _StorageRef] = {}
        self._lock = threading.Lock()
        self.activation_bytes = 0
        self.total_bytes = 0

    def add(self, t: torch.Tensor) -> None:
        st = _storage_of(t)
        if st is None or not self._tracker._counts(t):
            return
        key = st._cdata
        if key in self._seen:
            return
        nbytes = st.nbytes()
        ref = _StorageRef(st, self._forget)  # a freed key may be reused by a new storage
        ref.key, ref.nbytes = key, nbytes
        with self._lock:
            self._seen[key] = ref
            self.total_bytes += nbytes
            if self._tracker._owns_key(key):
                self.activation_bytes += nbytes

    def _forget(self, ref: _StorageRef) -> None:
        with self._lock:
            if self._seen.get(ref.key) is ref:
                del self._seen[ref.key]

    def close(self) -> None:
        with self._lock:
            self._seen = {}


_saved_state = threading.local()
_PYTHON_KEY = torch._C.DispatchKeySet(DispatchKey.Python)


def _saved_stack() -> list[_SavedRecorder]:
    stack = getattr(_saved_state, "stack", None)
    if stack is None:
        stack = _saved_state.stack = []
    return stack


def _pack_saved(t: torch.Tensor) -> torch.Tensor:
    # Only the innermost saved_tensors_hooks pair is called, so one call records for every
    # enclosing measure() on this thread. Returning a detached alias (not ``t`` itself) avoids a
    # reference cycle grad_fn -> packed output -> grad_fn that would keep outputs alive.
    if _graph_task_id() == -1:  # saves made inside backward (recomputation) are transient
        for recorder in _saved_stack():
            recorder.add(t)
    if type(t) is torch.Tensor:
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY):  # not an op of the step
            return t.detach()
    return t.detach()  # subclasses need their own dispatch


def _unpack_saved(t: torch.Tensor) -> torch.Tensor:
    return t


class _RecordSaved:
    """Context manager: register the pack hooks and a recorder for this measurement."""

    def __init__(self, recorder: _SavedRecorder):
        self._recorder = recorder
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack_saved, _unpack_saved)

    def __enter__(self) -> _SavedRecorder:
        _saved_stack().append(self._recorder)
        try:
            self._hooks.__enter__()
        except BaseException:
            _saved_stack().remove(self._recorder)
            raise
        return self._recorder

    def __exit__(self, *exc) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            stack = _saved_stack()
            if self._recorder in stack:
                stack.remove(self._recorder)
            self._recorder.close()


# --------------------------------------------------------------------------------------------
# FLOPs with a forward/backward split
# --------------------------------------------------------------------------------------------


def _triton_kernel_of(func: HigherOrderOperator, kwargs: dict) -> Any:
    """The Triton ``JITFunction`` launched by a ``triton_kernel_wrapper_*`` op (else None).

    Same lookup as ``FlopCounterMode``: flop formulas for Triton kernels are registered on it.
    """
    if not func.name().startswith("triton_kernel_wrapper"):
        return None
    from torch._higher_order_ops.triton_kernel_wrap import get_kernel
    from triton.runtime.jit import JITFunction

    kernel = get_kernel(kwargs["kernel_idx"])
    while not isinstance(kernel, JITFunction) and hasattr(kernel, "fn"):  # autotune, heuristics
        kernel = kernel.fn
    return kernel


_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: 0).__code__


def _shapes(obj: Any) -> Any:
    """``obj`` with every tensor replaced by its shape (what ``shape_wrapper`` passes on)."""
    if isinstance(obj, torch.Tensor):
        return obj.shape
    if isinstance(obj, (tuple, list)):
        return type(obj)(_shapes(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _shapes(v) for k, v in obj.items()}
    return obj


def _apply_flop_formula(formula: Callable[..., int], args: tuple, kwargs: dict, out: Any) -> int:
    """``formula(*args, **kwargs, out_val=out)``, skipping ``shape_wrapper``'s slow tree_map.

    Registry entries are ``shape_wrapper(f)`` (``functools.wraps``: ``__wrapped__`` is ``f``),
    which calls ``f`` on shapes with ``out_shape=``; raw formulas take the tensors.
    """
    if getattr(formula, "__code__", None) is not _SHAPE_WRAPPER_CODE:
        return formula(*args, **kwargs, out_val=out)
    return formula.__wrapped__(*_shapes(args), out_shape=_shapes(out), **_shapes(kwargs))


def _has_composite_implicit(func: Any) -> bool:
    key = DispatchKey.CompositeImplicitAutograd
    return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), key
    )


_DECOMPOSES: dict[Any, bool] = {}


def _cpu_flash_attention_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward_flop(
    grad_out, query, key, value, *args, out_val=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# Formulas torch's registry lacks (checked after it): the fused CPU attention kernels, counted
# with torch's formulas for the GPU ones (two matmuls forward; backward five, as flash kernels
# recompute the scores).
_EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _cpu_flash_attention_backward_flop
    ),
}


class _StepInstrument(LiveTensorTracker):
    """The tracker plus FLOP counting, in one dispatch mode (one mode costs half of two).

    FLOPs use ``torch.utils.flop_counter``'s formula registry exactly as ``FlopCounterMode``
    does: an op whose overload packet has a formula is counted with it; an op without one that
    has a ``CompositeImplicitAutograd`` decomposition is decomposed and its parts counted; a
    higher-order op with a formula (flex_attention, Triton kernels registered with
    ``register_flop_formula``) is counted by it. Other higher-order ops run below the mode
    (see ``LiveTensorTracker._run_higher_order``), so the FLOPs inside them are not counted;
    ``FlopCounterMode`` counts ``torch.cond``'s larger branch and rejects the rest. The fused
    CPU attention kernel, which torch's registry lacks, is counted like the GPU ones.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.flops_by_op: dict[str, int] = {}
        self.backward_flops = 0
        self.total_flops = 0

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self._active:
            return super()._dispatch(func, args, kwargs)
        if isinstance(func, HigherOrderOperator):
            triton_kernel = _triton_kernel_of(func, kwargs)
            key = func if triton_kernel is None else triton_kernel
            formula = flop_registry.get(key)
            if formula is None:
                return super()._dispatch(func, args, kwargs)
            out = super()._dispatch(func, args, kwargs)
            name = getattr(key, "__name__", None) or str(key)
            out_val = None if triton_kernel is not None else out  # as FlopCounterMode does
            self._add_flops(name, formula(*args, **kwargs, out_val=out_val))
            return out
        packet = func._overloadpacket
        formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
        if formula is None and func is not torch.ops.prim.device.default:
            decomposes = _DECOMPOSES.get(func)
            if decomposes is None:
                decomposes = _DECOMPOSES[func] = _has_composite_implicit(func)
            if decomposes:
                with self._reentered():
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        out = super()._dispatch(func, args, kwargs)
        if formula is not None:
            self._add_flops(str(packet), _apply_flop_formula(formula, args, kwargs, out))
        return out

    def _add_flops(self, name: str, flops: int) -> None:
        flops = int(flops)
        with self._lock:
            self.flops_by_op[name] = self.flops_by_op.get(name, 0) + flops
            self.total_flops += flops
            if _graph_task_id() != -1:
                self.backward_flops += flops


# --------------------------------------------------------------------------------------------
# CUDA allocator peak, safe under nesting
# --------------------------------------------------------------------------------------------


class _CudaPeak:
    """Peak of ``max_memory_allocated`` above the start, surviving nested peak resets.

    ``reset_peak_memory_stats`` is global, so an inner scope resetting it would erase the peak of
    an outer one; each scope therefore folds the current peak into the enclosing scopes first.
    """

    _stack: list[_CudaPeak] = []

    def __init__(self, device: torch.device):
        self.device = device
        self.start = 0
        self.carried = 0
        self.peak_bytes = 0

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize(self.device)
        current_peak = torch.cuda.max_memory_allocated(self.device)
        for outer in _CudaPeak._stack:
            if outer.device == self.device:
                outer.carried = max(outer.carried, current_peak)
        self.start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        _CudaPeak._stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            torch.cuda.synchronize(self.device)
            peak = max(self.carried, torch.cuda.max_memory_allocated(self.device))
            self.peak_bytes = max(0, peak - self.start)
        finally:
            _CudaPeak._stack.remove(self)


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: torch.device | str) -> str:
    """One line describing ``device`` for reports: ``'cuda:0 (NVIDIA H100, 79.2 GiB)'``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {format_bytes(props.total_memory)})"
    if device.type == "cpu":
        return (
            f"cpu ({_cpu_model()}, {os.cpu_count()} cores, "
            f"torch {torch.get_num_threads()} threads)"
        )
    return str(device)


def _infer_device(device: torch.device | str | None, args: tuple, kwargs: dict) -> torch.device:
    found = torch.device("cpu") if device is None else torch.device(device)
    if device is None:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                found = leaf.device
                break
            if isinstance(leaf, torch.nn.Module):
                param = next(leaf.parameters(), None)
                if param is not None:
                    found = param.device
                    break
    if found.type == "cuda" and found.index is None:
        found = torch.device("cuda", torch.cuda.current_device())
    return found


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """Memory, FLOPs and time of one training step (see the module docstring for definitions).

    Byte counts are above the baseline that was live before the step started.
    """

    peak_bytes: int
    """Peak live bytes during the step above the baseline (allocator on CUDA, else tracker)."""
    saved_bytes: int
    """Distinct storages saved for backward that were allocated during the step (activations)."""
    saved_bytes_total: int
    """Distinct storages saved for backward, including parameters/inputs that predate the step."""
    flops: int
    """FLOPs of the whole step (``torch.utils.flop_counter`` formulas)."""
    forward_flops: int
    """FLOPs of ops run outside the autograd engine."""
    backward_flops: int
    """FLOPs of ops run by the autograd engine (includes recomputation during backward)."""
    seconds: float | None
    """Median wall time over ``repeat`` uninstrumented calls (None when ``repeat=0``)."""
    seconds_all: tuple[float, ...]
    """Every timed call, in order."""
    device: str
    """Description of the measured device."""
    device_type: str
    """``'cpu'``, ``'cuda'``, ..."""
    peak_source: str
    """``'tracker'`` (dispatch-mode tracker) or ``'cuda_allocator'``."""
    tracked_peak_bytes: int
    """Peak from :class:`LiveTensorTracker` (equals ``peak_bytes`` off CUDA)."""
    retained_bytes: int
    """Bytes allocated during the step still alive after it returned (e.g. new ``.grad``)."""
    allocated_bytes: int
    """Total bytes of all storages allocated during the step (the tracker's count)."""
    peak_op: str | None
    """The op whose output set the tracked peak."""
    peak_phase: str
    """``'forward'`` or ``'backward'``: where the tracked peak happened."""
    forward_peak_bytes: int
    """Tracked peak over ops run outside the autograd engine."""
    backward_peak_bytes: int
    """Tracked peak over ops run by the autograd engine (includes what the forward left alive)."""
    num_ops: int
    """Ops dispatched during the step."""
    backward_ops: int
    """Ops dispatched by the autograd engine."""
    flops_by_op: tuple[tuple[str, int], ...]
    """``(op, flops)`` pairs, largest first."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable) of all fields."""
        d = asdict(self)
        d["seconds_all"] = list(self.seconds_all)
        d["flops_by_op"] = {k: v for k, v in self.flops_by_op}
        return d

    def __str__(self) -> str:
        parts = [
            f"peak {format_bytes(self.peak_bytes)}",
            f"saved {format_bytes(self.saved_bytes)} "
            f"({format_bytes(self.saved_bytes_total)} incl. params/inputs)",
            f"{format_flops(self.flops)} (fwd {format_flops(self.forward_flops)}, "
            f"bwd {format_flops(self.backward_flops)})",
        ]
        if self.seconds is not None:
            parts.append(f"{_format_seconds(self.seconds)} median of {len(self.seconds_all)}")
        parts.append(self.device)
        return " | ".join(parts)

    def __rich__(self):
        """A ``rich`` table (``rich.print(m)``)."""
        from rich.table import Table

        table = Table(title=f"gs.measure on {self.device}", show_header=False)
        table.add_column("quantity", style="bold")
        table.add_column("value", justify="right")
        table.add_column("note", style="dim")
        table.add_row("peak", format_bytes(self.peak_bytes), f"above baseline; {self.peak_source}")
        if self.peak_source != "tracker":
            table.add_row("peak (tracker)", format_bytes(self.tracked_peak_bytes), "")
        table.add_row(
            "", "", f"at {self.peak_op} ({self.peak_phase})" if self.peak_op else "no allocation"
        )
        table.add_row("saved", format_bytes(self.saved_bytes), "activations saved for backward")
        table.add_row("saved (total)", format_bytes(self.saved_bytes_total), "incl. params/inputs")
        table.add_row("retained", format_bytes(self.retained_bytes), "alive after the step")
        table.add_row("FLOPs", format_flops(self.flops), f"{self.num_ops} ops")
        table.add_row("  forward", format_flops(self.forward_flops), "")
        table.add_row(
            "  backward",
            format_flops(self.backward_flops),
            f"{self.backward_ops} ops (incl. recompute)",
        )
        if self.seconds is not None:
            table.add_row(
                "time", _format_seconds(self.seconds), f"median of {len(self.seconds_all)}"
            )
        return table


def _requires_grad_output(out: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        for t in tree_leaves(out)
    )


def measure(
    step_fn: Callable[..., Any],
    *args: Any,
    device: torch.device | str | None = None,
    warmup: int = 0,
    repeat: int = 1,
    **kwargs: Any,
) -> Measurement:
    """Run ``step_fn(*args, **kwargs)`` -- forward and backward -- and measure it.

    Contract: ``step_fn`` runs the backward itself (``loss.backward()`` or
    ``torch.autograd.grad``); ``measure`` never calls it for you. If ``step_fn`` returns a tensor
    that requires grad and no backward ran, :class:`StepContractError` is raised (wrap a loss
    function with :func:`step` to get a conforming ``step_fn``). To measure a forward only,
    return nothing that requires grad.

    Calls, in order: ``warmup`` untimed, unmeasured calls (compilation, autotuning, lazy init);
    one instrumented call that yields memory, saved bytes and FLOPs; ``repeat`` plain timed calls.
    Every call is a real step: gradients accumulate into ``.grad`` across calls as in a training
    loop without ``zero_grad``, so the instrumented call sees the state left by the warmup calls
    (with ``warmup=0``: the caller's state). Have ``step_fn`` zero gradients first if each call
    should start clean.

    ``device``: where to measure; default: the device of the first tensor (or module parameter)
    in ``args``/``kwargs``, else CPU. Byte counts cover storages on that device only. The keyword
    names ``device``, ``warmup`` and ``repeat`` are taken by ``measure``; everything else in
    ``kwargs`` goes to ``step_fn``.

    Exceptions from ``step_fn`` propagate unchanged, after the dispatch modes and hooks
    ``measure`` installed are removed. ``measure`` calls may be nested.
    """
    if not callable(step_fn):
        raise TypeError(f"measure: step_fn must be callable, got {type(step_fn).__name__}")
    if warmup < 0 or repeat < 0:
        raise ValueError(f"measure: warmup and repeat must be >= 0, got {warmup=} {repeat=}")
    dev = _infer_device(device, args, kwargs)

    for _ in range(warmup):
        step_fn(*args, **kwargs)
    _synchronize(dev)

    if dev.type == "cuda":
        # Collect garbage left by earlier code now, so the allocator does not see it freed
        # mid-step (that would lower the allocation below the starting point). The tracker
        # counts only storages allocated in the step, so it does not need this.
        gc.collect()
    tracker = _StepInstrument(device=dev)
    recorder = _SavedRecorder(tracker)
    cuda_peak = _CudaPeak(dev) if dev.type == "cuda" else None
    if cuda_peak is not None:
        cuda_peak.__enter__()
    try:
        with tracker, _RecordSaved(recorder):
            out = step_fn(*args, **kwargs)
            needs_backward = _requires_grad_output(out)
            del out
            _synchronize(dev)
    finally:
        if cuda_peak is not None:
            cuda_peak.__exit__(None, None, None)
    if needs_backward and tracker.backward_ops == 0:
        raise StepContractError(
            "measure: step_fn returned a tensor that requires grad, but no backward pass ran. "
            "measure() does not call backward for you: make step_fn call loss.backward() "
            "(or wrap a loss function: gs.measure.step(loss_fn)), or return a detached value "
            "if only the forward should be measured."
        )

    times: list[float] = []
    for _ in range(repeat):
        _synchronize(dev)
        t0 = time.perf_counter()
        step_fn(*args, **kwargs)
        _synchronize(dev)
        times.append(time.perf_counter() - t0)

    by_op = sorted(
        ((op, n) for op, n in tracker.flops_by_op.items() if n), key=lambda kv: (-kv[1], kv[0])
    )
    return Measurement(
        peak_bytes=cuda_peak.peak_bytes if cuda_peak is not None else tracker.peak_bytes,
        saved_bytes=recorder.activation_bytes,
        saved_bytes_total=recorder.total_bytes,
        flops=tracker.total_flops,
        forward_flops=tracker.total_flops - tracker.backward_flops,
        backward_flops=tracker.backward_flops,
        seconds=statistics.median(times) if times else None,
        seconds_all=tuple(times),
        device=describe_device(dev),
        device_type=dev.type,
        peak_source="cuda_allocator" if cuda_peak is not None else "tracker",
        tracked_peak_bytes=tracker.peak_bytes,
        retained_bytes=tracker.live_bytes,
        allocated_bytes=tracker.allocated_bytes,
        peak_op=tracker.peak_op,
        peak_phase=tracker.peak_phase,
        forward_peak_bytes=tracker.phase_peak_bytes["forward"],
        backward_peak_bytes=tracker.phase_peak_bytes["backward"],
        num_ops=tracker.num_ops,
        backward_ops=tracker.backward_ops,
        flops_by_op=tuple(by_op),
    )


def step(
    loss_fn: Callable[..., torch.Tensor], *, retain_graph: bool = False
) -> Callable[..., torch.Tensor]:
    """Build a ``step_fn`` for :func:`measure` from a loss function.

    The returned function computes ``loss = loss_fn(*args, **kwargs)``, checks that it is a
    scalar tensor that requires grad, calls ``loss.backward()`` and returns ``loss.detach()``.
    """

    def step_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = loss_fn(*args, **kwargs)
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"measure.step: {name} returned {type(loss).__name__}, not a tensor")
        if loss.numel() != 1:
            raise ValueError(
                f"measure.step: {name} returned a tensor of shape {tuple(loss.shape)}; "
                "it must return a scalar loss (reduce it, e.g. .sum() or .mean())"
            )
        if not loss.requires_grad:
            raise ValueError(
                f"measure.step: the loss returned by {name} does not require grad "
                "(no parameter or input in its graph requires grad, or it ran under no_grad)"
            )
        loss.backward(retain_graph=retain_graph)
        return loss.detach()

    step_fn.__qualname__ = f"step({getattr(loss_fn, '__qualname__', 'loss_fn')})"
    return step_fn


# ``gs.measure`` is this function once the package re-exports it, so expose the helpers on it
# too: ``gs.measure.step(loss_fn)``, ``gs.measure.LiveTensorTracker``, ``gs.measure.Measurement``.
measure.step = step  # type: ignore[attr-defined]
measure.LiveTensorTracker = LiveTensorTracker  # type: ignore[attr-defined]
measure.Measurement = Measurement  # type: ignore[attr-defined]
measure.LiveSample = LiveSample  # type: ignore[attr-defined]
measure.StepContractError = StepContractError  # type: ignore[attr-defined]
