"""Resident set size: how much memory the operating system has given this process.

:class:`PeakRss` reads the peak RSS of a region above the RSS at its start (Linux: the kernel's
high-water mark ``VmHWM``, reset at entry through ``/proc/self/clear_refs``). It is the
measurement nothing in torch can bias -- and the coarsest: it covers the whole process (every
thread, the Python heap, libraries), and memory ``malloc`` keeps after a free is reused without
growing it, so it agrees with the allocator only for large tensors (which ``malloc`` maps and
unmaps) in a region that starts with little free memory held. Used to validate ``gs.measure``.
"""

from __future__ import annotations

__all__ = ["PeakRss", "rss_bytes"]

_STATUS = "/proc/self/status"


def _status_bytes(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """This process's resident set size now (None where ``/proc`` is unavailable)."""
    return _status_bytes("VmRSS")


class PeakRss:
    """Peak RSS during the context above the RSS at entry (``peak_bytes``; None if unavailable).

    Nested regions fold the peak seen so far into the enclosing ones before resetting it.
    """

    _stack: list[PeakRss] = []

    def __init__(self) -> None:
        self.start = 0
        self.carried = 0
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakRss:
        hwm = _status_bytes("VmHWM")
        for outer in PeakRss._stack:
            outer.carried = max(outer.carried, hwm or 0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            self.start = -1
        else:
            self.start = rss_bytes() or 0
        PeakRss._stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        PeakRss._stack.remove(self)
        hwm = _status_bytes("VmHWM")
        if self.start >= 0 and hwm is not None:
            self.peak_bytes = max(0, max(hwm, self.carried) - self.start)
