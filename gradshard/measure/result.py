"""The record ``gs.measure`` returns: memory, FLOPs and time of one training step."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gradshard.units import format_bytes, format_flops, format_seconds

__all__ = ["Measurement"]


@dataclass(frozen=True)
class Measurement:
    """Memory, FLOPs and time of one training step (definitions: :mod:`gradshard.measure`).

    Byte counts are above the baseline that was live before the step started.
    """

    peak_bytes: int
    """Peak bytes live during the step above the baseline (see ``peak_source``)."""
    saved_bytes: int
    """Distinct storages saved for backward that were allocated during the step (activations)."""
    saved_bytes_total: int
    """Distinct storages saved for backward, including parameters/inputs that predate the step."""
    flops: int
    """FLOPs of the whole step (``torch.utils.flop_counter.FlopCounterMode``)."""
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
    """``'tracker'`` (storages created by dispatched ops), ``'cpu_allocator'`` (torch.profiler's
    memory events, when compiled code ran on CPU) or ``'cuda_allocator'``."""
    tracked_peak_bytes: int
    """Peak from :class:`LiveTensorTracker` (equals ``peak_bytes`` when the source is the tracker)."""
    retained_bytes: int
    """Bytes allocated during the step still alive after it returned (e.g. new ``.grad``); the
    CPU allocator's count when it gave the peak, else the tracker's."""
    allocated_bytes: int
    """Total bytes allocated during the step, freed or not (same source as ``retained_bytes``)."""
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
    allocator_peak_bytes: int | None = None
    """The allocator's peak above the start of the step (CUDA; CPU when traced), else None."""
    compiled_regions: int | None = None
    """Executions of ``torch.compile``'d regions during the step (None: not observed)."""
    notes: tuple[str, ...] = ()
    """Caveats about this measurement (what could not be seen, and why)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable) of all fields."""
        d = asdict(self)
        d["seconds_all"] = list(self.seconds_all)
        d["flops_by_op"] = {k: v for k, v in self.flops_by_op}
        d["notes"] = list(self.notes)
        return d

    def __str__(self) -> str:
        parts = [
            f"peak {format_bytes(self.peak_bytes)}",
            f"saved {format_bytes(self.saved_bytes)} "
            f"({format_bytes(self.saved_bytes_total)} incl. params/inputs)",
            f"{format_flops(self.flops)} (fwd {format_flops(self.forward_flops)}, "
            f"bwd {format_flops(self.backward_flops)})",
        ]
        if self.compiled_regions:
            parts.append(f"{self.compiled_regions} compiled region runs")
        if self.seconds is not None:
            parts.append(f"{format_seconds(self.seconds)} median of {len(self.seconds_all)}")
        parts.append(self.device)
        return " | ".join(parts)

    def __rich__(self) -> Any:
        """A ``rich`` table (``rich.print(m)``)."""
        from rich.table import Table

        table = Table(title=f"gs.measure on {self.device}", show_header=False)
        table.add_column("quantity", style="bold")
        table.add_column("value", justify="right")
        table.add_column("note", style="dim")
        table.add_row("peak", format_bytes(self.peak_bytes), f"above baseline; {self.peak_source}")
        if self.peak_source != "tracker":
            table.add_row("peak (tracker)", format_bytes(self.tracked_peak_bytes), "dispatched ops only")
        elif self.allocator_peak_bytes is not None:
            table.add_row("peak (allocator)", format_bytes(self.allocator_peak_bytes), "")
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
                "time", format_seconds(self.seconds), f"median of {len(self.seconds_all)}"
            )
        if self.compiled_regions:
            table.add_row("compiled", str(self.compiled_regions), "torch.compile'd region runs")
        for note in self.notes:
            table.add_row("note", "", note)
        return table
