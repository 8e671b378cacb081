"""Point-to-point and collective helpers on any ``ProcessGroup`` object, with timeouts.

Every operation goes through the group object's own methods (``group.send([t], peer, tag)``,
``group.recv``, ``group.allreduce``), so groups that are not registered with the default
world (sub-groups, the thread-backed groups of :mod:`gradshard.distributed.testing`) work
the same as ``dist.new_group`` ones. Ranks are *group* ranks.

No wait can hang: each one has a timeout, and a peer that is dead, stuck or failing
surfaces as :class:`CommTimeoutError` naming who waited, for what, from whom::

    comm = Communicator(group, timeout_s=20)
    op = comm.irecv(buf, src=0, tag=6, label="the KV state of layer 3")
    ...                                   # overlap local compute here
    op.wait()   # CommTimeoutError: rank 1 waited 20 s for the KV state of layer 3 from rank 0 ...

Communication volume is measured by wrapping the code in a :class:`CommCounter`::

    with CommCounter(group) as counter:   # group=None: every group in this process
        loss.backward()
    counter.bytes(label="lasp.kv[layer=0]", direction="send")

A counter is keyed by group, not by thread, so it also sees operations posted from
autograd's backward threads.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed import ReduceOp

from gradshard.errors import first_line

__all__ = [
    "CommCounter",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "PendingOp",
    "communicator",
    "get_default_timeout",
    "set_default_timeout",
]

SEND = "send"
RECV = "recv"
ALLREDUCE = "allreduce"

_default_timeout_s: float = float(os.environ.get("GRADSHARD_COMM_TIMEOUT_S", "60"))


def get_default_timeout() -> float:
    """Seconds a wait lasts when neither the call nor the communicator sets a timeout."""
    return _default_timeout_s


def set_default_timeout(seconds: float) -> None:
    """Set the process-wide default wait timeout (env ``GRADSHARD_COMM_TIMEOUT_S`` sets it at import)."""
    global _default_timeout_s
    if not seconds > 0:
        raise ValueError(f"communication timeout must be positive, got {seconds!r}")
    _default_timeout_s = float(seconds)


class CommError(RuntimeError):
    """A communication operation failed."""


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not deliver in time: it is dead, stuck, failing, or slower than the timeout."""


@dataclass(frozen=True)
class CommStats:
    """Payload bytes and message count for one (label, direction)."""

    bytes: int
    messages: int


class CommCounter:
    """Records payload bytes per ``(label, direction)`` while active (a context manager).

    ``group``: count only operations on this group object (``None``: every group). Directions
    are ``"send"``, ``"recv"`` and ``"allreduce"`` (the reduced payload, not the wire traffic
    of the reduction algorithm). Counting happens when an operation is posted.
    """

    def __init__(self, group: Any | None = None) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], CommStats] = {}

    def __enter__(self) -> "CommCounter":
        with _registry_lock:
            _active_counters.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _registry_lock:
            _active_counters.remove(self)

    def watches(self, group: Any) -> bool:
        """Whether operations on ``group`` are counted."""
        return self.group is None or self.group is group

    def record(self, label: str, direction: str, nbytes: int) -> None:
        """Add one message of ``nbytes`` under ``(label, direction)``."""
        with self._lock:
            old = self._stats.get((label, direction), CommStats(0, 0))
            self._stats[(label, direction)] = CommStats(old.bytes + nbytes, old.messages + 1)

    def stats(self) -> dict[tuple[str, str], CommStats]:
        """A snapshot ``{(label, direction): CommStats}``."""
        with self._lock:
            return dict(self._stats)

    def bytes(self, label: str | None = None, direction: str | None = None) -> int:
        """Total bytes, optionally restricted to one label and/or one direction."""
        return sum(
            s.bytes
            for (lab, d), s in self.stats().items()
            if (label is None or lab == label) and (direction is None or d == direction)
        )

    def messages(self, label: str | None = None, direction: str | None = None) -> int:
        """Number of messages, optionally restricted to one label and/or one direction."""
        return sum(
            s.messages
            for (lab, d), s in self.stats().items()
            if (label is None or lab == label) and (direction is None or d == direction)
        )

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self._stats.clear()


_registry_lock = threading.Lock()
_active_counters: list[CommCounter] = []


def _record(group: Any, label: str, direction: str, nbytes: int) -> None:
    with _registry_lock:
        counters = [c for c in _active_counters if c.watches(group)]
    for c in counters:
        c.record(label, direction, nbytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class PendingOp:
    """A posted operation; :meth:`wait` completes it or raises :class:`CommTimeoutError`."""

    def __init__(self, comm: "Communicator", work: Any, what: str, tensor: torch.Tensor) -> None:
        self._comm = comm
        self._work = work
        self._what = what
        self.tensor = tensor  # kept alive until the operation is complete
        self.done = work is None

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """Block until complete (at most ``timeout_s``); returns the operation's tensor."""
        if self.done:
            return self.tensor
        timeout = self._comm.resolve_timeout(timeout_s)
        start = time.monotonic()
        try:
            self._work.wait(datetime.timedelta(seconds=timeout))
        except Exception as exc:  # gloo/nccl raise RuntimeError on timeout or a closed peer
            raise self._comm.failure(self._what, time.monotonic() - start, exc) from exc
        self.done = True
        return self.tensor


class Communicator:
    """Timed point-to-point and collective operations on one ``ProcessGroup`` object.

    ``timeout_s=None`` uses :func:`get_default_timeout` at wait time. Tensors must live
    where the group's backend expects them (CPU for gloo, CUDA for nccl) and be contiguous.
    """

    def __init__(self, group: Any, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"communication timeout must be positive, got {timeout_s!r}")
        self.group = group
        self.timeout_s = timeout_s
        self.rank: int = group.rank()
        self.world_size: int = group.size()

    @contextlib.contextmanager
    def _op_timeout(self) -> Iterator[None]:
        """Post an operation under gradshard's timeout, then restore the group's own.

        gloo fixes an operation's deadline when it is posted, from the group's timeout
        (``init_process_group(timeout=...)``, 30 min by default). An operation abandoned
        after a :class:`CommTimeoutError` would otherwise keep the process alive (its
        threads never exit) until that much later deadline. Groups that do not expose their
        timeout (thread-based test groups) are left alone.
        """
        backend = None
        get_backend = getattr(self.group, "_get_backend", None)
        if callable(get_backend):
            try:
                backend = get_backend(torch.device("cpu"))
            except RuntimeError:  # no CPU backend (nccl only): its ops carry their own timeout
                backend = None
        old = getattr(getattr(backend, "options", None), "_timeout", None)
        if old is None or not callable(getattr(backend, "set_timeout", None)):
            yield
            return
        backend.set_timeout(datetime.timedelta(seconds=self.resolve_timeout()))
        try:
            yield
        finally:
            backend.set_timeout(old)

    def resolve_timeout(self, timeout_s: float | None = None) -> float:
        """The timeout a wait uses: the call's, else this communicator's, else the default."""
        if timeout_s is not None:
            return timeout_s
        return self.timeout_s if self.timeout_s is not None else get_default_timeout()

    def failure(self, what: str, waited_s: float | None, exc: BaseException) -> CommTimeoutError:
        """The error for an operation ``what`` ("for X from rank 0") that failed after
        ``waited_s`` seconds of waiting (``None``: it failed when it was posted)."""
        text = str(exc)
        if "closed" in text.lower() or "reset" in text.lower():
            why = "the connection was closed: the peer most likely crashed or raised"
        elif "timed out" in text.lower() or "timeout" in text.lower():
            why = (
                "the peer did not take part in time: it is dead, stuck, or slower than the "
                f"timeout of {self.resolve_timeout():g} s (the group's own timeout may be shorter)"
            )
        else:
            why = f"the backend reported: {first_line(exc)}"
        if waited_s is None:
            head = f"rank {self.rank} could not post the operation {what}"
        else:
            head = f"rank {self.rank} waited {waited_s:.1f} s {what} and gave up"
        return CommTimeoutError(
            f"{head} ({why}). Check the "
            f"other ranks' logs for the first error; if the peer is only slow, raise the timeout "
            f"(Communicator(group, timeout_s=...), set_default_timeout or GRADSHARD_COMM_TIMEOUT_S)."
        )

    def _check_peer(self, peer: int, role: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank}: invalid {role} rank {peer} in a group of {self.world_size}"
            )

    def isend(
        self, tensor: torch.Tensor, dst: int, *, tag: int, label: str, description: str | None = None
    ) -> PendingOp:
        """Post a send of ``tensor`` to group rank ``dst``.

        ``label`` keys the bytes in :class:`CommCounter`; ``description`` ("the KV state of
        layer 3") names the payload in errors (default: the label).
        """
        self._check_peer(dst, "destination")
        tensor = tensor.contiguous()
        what = f"to send {description or label} to rank {dst} (tag {tag})"
        _record(self.group, label, SEND, _nbytes(tensor))
        try:
            with self._op_timeout():
                work = self.group.send([tensor], dst, tag)
        except Exception as exc:
            raise self.failure(what, None, exc) from exc
        return PendingOp(self, work, what, tensor)

    def irecv(
        self, tensor: torch.Tensor, src: int, *, tag: int, label: str, description: str | None = None
    ) -> PendingOp:
        """Post a receive into ``tensor`` (contiguous) from group rank ``src``."""
        self._check_peer(src, "source")
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self.rank}: receive buffer for {label} must be contiguous")
        what = f"for {description or label} from rank {src} (tag {tag})"
        _record(self.group, label, RECV, _nbytes(tensor))
        try:
            with self._op_timeout():
                work = self.group.recv([tensor], src, tag)
        except Exception as exc:
            raise self.failure(what, None, exc) from exc
        return PendingOp(self, work, what, tensor)

    def send(
        self, tensor: torch.Tensor, dst: int, *, tag: int, label: str, description: str | None = None
    ) -> None:
        """Blocking send with timeout."""
        self.isend(tensor, dst, tag=tag, label=label, description=description).wait()

    def recv(
        self, tensor: torch.Tensor, src: int, *, tag: int, label: str, description: str | None = None
    ) -> torch.Tensor:
        """Blocking receive into ``tensor`` with timeout; returns ``tensor``."""
        return self.irecv(tensor, src, tag=tag, label=label, description=description).wait()

    def iall_reduce(
        self, tensor: torch.Tensor, *, label: str, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> PendingOp:
        """Post an in-place all-reduce of ``tensor`` (contiguous) over the group."""
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self.rank}: all-reduce buffer for {label} must be contiguous")
        what = f"for the all-reduce of {label} over {self.world_size} ranks"
        _record(self.group, label, ALLREDUCE, _nbytes(tensor))
        try:
            with self._op_timeout():
                work = self.group.allreduce([tensor], op)
        except Exception as exc:
            raise self.failure(what, None, exc) from exc
        return PendingOp(self, work, what, tensor)

    def all_reduce(
        self, tensor: torch.Tensor, *, label: str, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        """Blocking in-place all-reduce with timeout; returns ``tensor``."""
        return self.iall_reduce(tensor, label=label, op=op).wait()


_default_communicators: "weakref.WeakKeyDictionary[Any, Communicator]" = weakref.WeakKeyDictionary()
_default_lock = threading.Lock()


def communicator(group: Any) -> Communicator:
    """The shared default :class:`Communicator` of ``group`` (default timeout), created once."""
    with _default_lock:
        comm = _default_communicators.get(group)
        if comm is None:
            comm = _default_communicators[group] = Communicator(group)
        return comm
