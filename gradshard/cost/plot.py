"""``plot_memory_vs_seq_len``: memory against sequence length per plan (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .devices import DeviceProfile, get_device
from .report import CostReport
from .units import parse_bytes

__all__ = ["plot_memory_vs_seq_len"]


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'gradshard[plot]' (or pip install matplotlib)") from exc
    return plt


def plot_memory_vs_seq_len(reports: CostReport | Sequence[CostReport], path: str | Path, *,
                           seq_lens: Sequence[int] | None = None, batch: int | None = None,
                           quantity: str = "total_bytes", device: str | DeviceProfile | None = None,
                           memory_bytes: float | str | None = None) -> Path:
    """Draw ``quantity`` (default total memory) against sequence length, one line per plan.

    ``seq_lens`` defaults to powers of two from the example length to 2^24 (log-log axes); a
    horizontal line marks ``memory_bytes`` (default: the device's memory). Returns ``path``.
    """
    plt = _matplotlib()
    reps = [reports] if isinstance(reports, CostReport) else list(reports)
    if not reps:
        raise ValueError("plot_memory_vs_seq_len needs at least one report")
    dev = get_device(device) if device is not None else reps[0].device
    budget = parse_bytes(memory_bytes) if memory_bytes is not None else (dev.memory_bytes if dev else None)
    if seq_lens is None:
        start = max(1, min(r.example["seq_len"] for r in reps))
        seq_lens = [start * 2**k for k in range(64) if start * 2**k <= 2**24]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rep in reps:
        ys = [rep.evaluate(t, batch)[quantity] / 2**30 for t in seq_lens]
        ax.plot(seq_lens, ys, marker="o", markersize=3, label=rep.short_name())
    if budget:
        ax.axhline(budget / 2**30, color="black", linestyle="--", linewidth=1,
                   label=f"{dev.name if dev else 'budget'}: {budget / 2**30:.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"{quantity.replace('_', ' ')} (GiB)")
    b = batch or reps[0].example["batch"]
    ax.set_title(f"gradshard cost model: {quantity.replace('_', ' ')} vs sequence length (batch {b})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
