"""Saved-for-backward accounting with ``torch.autograd.graph.saved_tensors_hooks``.

A :class:`SavedTensorRecorder` counts the distinct storages the forward saves for backward:
``total_bytes`` all of them, ``activation_bytes`` those allocated during the recorded region
(activations; parameters and inputs are saved too but predate it). A saved view counts its
whole storage, because it keeps the whole storage alive. Only saves made outside the autograd
engine count -- what the forward leaves for the backward; tensors saved while the engine runs
(recomputation inside backward, ``create_graph``) are transient.

"Allocated during the region" is the tracker's knowledge (it saw the op that created the
storage). Storages it never saw -- buffers a ``torch.compile``'d region allocated itself -- are
settled afterwards with :meth:`SavedTensorRecorder.settle`, from the addresses the allocator
handed out during the region (:class:`gradshard.measure.allocator.CpuAllocatorTrace`).

Usage::

    recorder = SavedTensorRecorder(tracker)
    with tracker, record_saved(recorder):
        loss = model(x).sum(); loss.backward()
    recorder.activation_bytes, recorder.total_bytes
"""

from __future__ import annotations

import threading
from collections.abc import Collection

import torch
from torch._C import DispatchKey

from .tracker import LiveTensorTracker, StorageRef, graph_task_id, storage_of

__all__ = ["SavedTensorRecorder", "active_saved_recorders", "record_saved"]


class SavedTensorRecorder:
    """Distinct storages packed by ``saved_tensors_hooks`` while :func:`record_saved` is active."""

    def __init__(self, tracker: LiveTensorTracker, *, settle_by_address: bool = False):
        self._tracker = tracker
        self._seen: dict[int, StorageRef] = {}
        self._lock = threading.Lock()
        self._by_address = settle_by_address  # keep the addresses :meth:`settle` needs
        self._unknown: list[tuple[int, int]] = []  # (data_ptr, nbytes) of storages the tracker never saw
        self.activation_bytes = 0
        """Bytes of saved storages allocated during the region."""
        self.total_bytes = 0
        """Bytes of all saved storages, including those that predate the region."""
        self.unpacked = 0
        """How many saved tensors were unpacked (by a backward, on any thread) -- 0: no backward used any."""

    def add(self, t: torch.Tensor) -> None:
        """Record one saved tensor (called by the pack hook)."""
        st = storage_of(t)
        if st is None or not self._tracker.counts_tensor(t):
            return
        key = st._cdata
        if key in self._seen:
            return
        nbytes = st.nbytes()
        ref = StorageRef(st, self._forget)  # a freed key may be reused by a new storage
        ref.key, ref.nbytes = key, nbytes
        with self._lock:
            self._seen[key] = ref
            self.total_bytes += nbytes
            if self._tracker.owns_key(key):
                self.activation_bytes += nbytes
            elif nbytes and self._by_address:
                self._unknown.append((st.data_ptr(), nbytes))

    def settle(self, allocated_ptrs: Collection[int]) -> int:
        """Count the saved storages the tracker never saw whose address the allocator handed out
        during the region (``allocated_ptrs``) as activations; returns the bytes added. Needs
        ``settle_by_address=True`` (real tensors: a fake tensor has no address).

        A storage that predates the region cannot have been allocated at its address during the
        region while it was alive; it could only if it was freed, mid-region, after being saved
        and its address reused -- a baseline tensor dropped by the step itself.
        """
        with self._lock:
            added = sum(n for ptr, n in self._unknown if ptr in allocated_ptrs)
            self._unknown = []
            self.activation_bytes += added
        return added

    def _forget(self, ref: StorageRef) -> None:
        with self._lock:
            if self._seen.get(ref.key) is ref:
                del self._seen[ref.key]

    def close(self) -> None:
        """Drop the weak references (frees after this are no longer observed)."""
        with self._lock:
            self._seen = {}


_saved_state = threading.local()
_PYTHON_KEY = torch._C.DispatchKeySet(DispatchKey.Python)


def active_saved_recorders() -> list[SavedTensorRecorder]:
    """The recorders active on this thread, outermost first (the live list; do not modify)."""
    stack = getattr(_saved_state, "stack", None)
    if stack is None:
        stack = _saved_state.stack = []
    return stack


def _pack_saved(t: torch.Tensor) -> torch.Tensor:
    # Only the innermost saved_tensors_hooks pair is called, so one call records for every
    # enclosing recorder on this thread. Returning a detached alias (not ``t`` itself) avoids a
    # reference cycle grad_fn -> packed output -> grad_fn that would keep outputs alive.
    # Saves made inside backward (recomputation) are transient. A fake tensor counts when the
    # recorder's tracker counts it (``count_fake``: a probe's, not a trace's inside a real step).
    if graph_task_id() == -1:
        for recorder in active_saved_recorders():
            recorder.add(t)
    if type(t) is torch.Tensor:
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY):  # not an op of the step
            return t.detach()
    return t.detach()  # subclasses need their own dispatch


class record_saved:  # noqa: N801 - used like a function: ``with record_saved(recorder):``
    """Context manager: install the pack hooks and make ``recorder`` record on this thread."""

    def __init__(self, recorder: SavedTensorRecorder):
        self._recorder = recorder
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedTensorRecorder:
        stack = active_saved_recorders()
        stack.append(self._recorder)
        recorders = tuple(stack)  # this one and the enclosing ones: a backward ran for all of them

        def unpack(t: torch.Tensor) -> torch.Tensor:
            # Called where the backward runs: the autograd engine's device threads included,
            # which do not share the thread-local stack, hence the snapshot.
            for recorder in recorders:
                recorder.unpacked += 1
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack_saved, unpack)
        try:
            self._hooks.__enter__()
        except BaseException:
            active_saved_recorders().remove(self._recorder)
            raise
        return self._recorder

    def __exit__(self, *exc: object) -> None:
        try:
            if self._hooks is not None:
                self._hooks.__exit__(*exc)
        finally:
            stack = active_saved_recorders()
            if self._recorder in stack:
                stack.remove(self._recorder)
            self._recorder.close()
