"""Plan comparisons and the tables behind ``gradshard cost`` / ``gradshard whatif``.

The CLI is meant to be a thin layer over these functions::

    gradshard cost FILE.py:FACTORY --plan none,seco:chunk_size=512 --seq-len 1k,64k,1M --device h100
        reports = cost_reports(target, parse_plans("none,seco:chunk_size=512"), example_inputs=inputs,
                               device="h100")
        table = cost_table(reports, parse_counts("1k,64k,1M"), device="h100")
        rich.print(table)                       # CostTable renders as a rich table

    gradshard whatif FILE.py:FACTORY --plan adjoint,seco --max-seq-len --memory 80GB [--batch 8]
        table = max_seq_len_table(reports, parse_bytes("80GB"), batch=8)

    ... --plot out.png
        plot_memory_vs_seq_len(reports, "out.png", device="h100")

Plan specs: plans separated by commas; a plan's options follow its name after colons,
``"seco:chunk_size=512:budget=4"``; values are read as counts (``512``, ``4k``), booleans,
floats or strings. ``common_options`` (``--option chunk_size=512``) go to every plan whose
options accept them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from .build import cost
from .devices import DeviceProfile, get_device
from .report import CostReport
from .units import format_bytes, format_count, format_flops, format_seconds, parse_bytes, parse_count

__all__ = ["PlanRequest", "parse_plans", "parse_option_value", "cost_reports", "cost_table", "max_seq_len_table",
           "compare_plans", "CostTable"]


@dataclass(frozen=True)
class PlanRequest:
    """A plan name and its options (``"seco:chunk_size=512"``)."""

    plan: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.plan}({opts})" if opts else self.plan


def parse_option_value(text: str) -> Any:
    """``"512" -> 512``, ``"4k" -> 4000``, ``"true" -> True``, ``"0.5" -> 0.5``, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return parse_count(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text.strip()


def parse_plans(spec: str | Iterable[Any]) -> list[PlanRequest]:
    """Plan specs (module doc) from a string, or a list of strings / ``(name, options)`` / requests."""
    items: list[Any] = [s for s in spec.split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if isinstance(item, PlanRequest):
            out.append(item)
        elif isinstance(item, tuple):
            name, opts = item
            out.append(PlanRequest(str(name), dict(opts)))
        else:
            name, *parts = str(item).strip().split(":")
            opts = {}
            for part in parts:
                if "=" not in part:
                    raise ValueError(f"plan option {part!r} in {item!r} must look like name=value")
                k, v = part.split("=", 1)
                opts[k.strip()] = parse_option_value(v)
            out.append(PlanRequest(name.strip(), opts))
    if not out:
        raise ValueError(f"no plan in {spec!r}")
    return out


def _accepted(plan: str, options: Mapping[str, Any]) -> dict[str, Any]:
    from ..plans import get_plan

    try:
        cls = get_plan(plan).options
    except Exception:
        return dict(options)
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in options.items() if k in names}


def cost_reports(model_or_fn: Any, plans: str | Iterable[Any], *, example_inputs: Sequence[Any],
                 device: str | DeviceProfile | None = None, common_options: Mapping[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None, **cost_kwargs: Any) -> list[CostReport]:
    """One :class:`CostReport` per plan spec (``cost_kwargs`` go to :func:`gradshard.cost.cost`)."""
    reports = []
    dev = get_device(device).name if device is not None else None
    for req in parse_plans(plans):
        opts = {**_accepted(req.plan, common_options or {}), **req.options}
        if progress:
            progress(f"pricing {PlanRequest(req.plan, opts).label}")
        reports.append(cost(model_or_fn, req.plan, example_inputs=example_inputs, device=dev, progress=progress,
                            **cost_kwargs, **opts))
    return reports


@dataclass(frozen=True)
class CostTable:
    """Rows of raw values (``rows``), their column keys and headers, and how to show them."""

    title: str
    columns: tuple[str, ...]
    headers: tuple[str, ...]
    rows: tuple[Mapping[str, Any], ...]
    notes: tuple[str, ...] = ()

    def formatted(self) -> list[list[str]]:
        """Every row as display strings, in column order."""
        return [[_show(c, row.get(c)) for c in self.columns] for row in self.rows]

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "|".join("---" for _ in self.headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.formatted()]
        return "\n".join(lines + [f"\n{n}" for n in self.notes])

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=self.title, caption="\n".join(self.notes) or None)
        for h, c in zip(self.headers, self.columns):
            table.add_column(h, justify="left" if c in ("plan", "fits") else "right")
        for r in self.formatted():
            table.add_row(*r)
        return table

    def __str__(self) -> str:
        return self.to_markdown()


def _show(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "fits":
        return "yes" if value else "NO"
    if column in ("seq_len", "max_seq_len", "batch"):
        return format_count(value) if column != "batch" else str(value)
    if column.endswith("bytes"):
        return format_bytes(value)
    if column.startswith("flops") or column.endswith("flops"):
        return format_flops(value)
    if column == "time_s":
        return format_seconds(value)
    return str(value)


def cost_table(reports: Sequence[CostReport], seq_lens: Sequence[int | str], *, batch: int | None = None,
               device: str | DeviceProfile | None = None, memory_bytes: float | str | None = None,
               **sizes: int) -> CostTable:
    """One row per plan and sequence length: memory, whether it fits, FLOPs, comm, roofline time."""
    dev = get_device(device) if device is not None else None
    budget = parse_bytes(memory_bytes) if memory_bytes is not None else (dev.memory_bytes if dev else None)
    rows = []
    for rep in reports:
        for t in seq_lens:
            t = parse_count(t)
            extra = {k: v for k, v in sizes.items() if k in rep.symbols}
            v = rep.evaluate(t, batch, **extra)
            d = dev or rep.device
            rows.append({
                "plan": rep.short_name(), "seq_len": t, "batch": batch or rep.example["batch"],
                "activation_bytes": v["activation_bytes"], "peak_bytes": v["peak_bytes"],
                "total_bytes": v["total_bytes"], "fits": None if budget is None else v["total_bytes"] <= budget,
                "flops": v["flops"], "comm_bytes": v["comm_bytes"],
                "time_s": rep.time_estimate(t, batch, device=d, **extra).seconds if d is not None else None,
                "first_step_peak_bytes": v.get("first_step_peak_bytes"), "first_step_flops": v.get("first_step_flops"),
            })
    cols = ("plan", "seq_len", "batch", "activation_bytes", "peak_bytes", "total_bytes", "fits", "flops",
            "comm_bytes", "time_s", "first_step_peak_bytes", "first_step_flops")
    heads = ("plan", "seq len", "batch", "activations", "step peak", "total memory",
             f"fits {format_bytes(budget)}" if budget else "fits", "FLOPs", "comm/step", "time (roofline est.)",
             "first step peak*", "first step FLOPs*")
    notes = ["total memory = parameters + optimizer state + inputs + step peak (activations, gradients, "
             "transients); time is a roofline estimate (lower bound), not a measurement",
             "* the first step of a fresh compiled module (capture and passes included) as gs.measure counts it: "
             "the capture's fake tensors count as bytes there, though the allocator sees them as nothing"]
    if dev:
        notes.append(f"device: {dev.description}")
    return CostTable("gradshard cost", cols, heads, tuple(rows), tuple(notes))


def max_seq_len_table(reports: Sequence[CostReport], memory_bytes: float | str | None = None, *,
                      batch: int | None = None, quantity: str = "total_bytes",
                      device: str | DeviceProfile | None = None, **sizes: int) -> CostTable:
    """The longest sequence each plan fits in ``memory_bytes`` (default: the device's memory)."""
    dev = get_device(device) if device is not None else None
    if memory_bytes is None:
        if dev is None:
            raise ValueError("max_seq_len_table needs memory_bytes=... or device=...")
        memory_bytes = dev.memory_bytes
    budget = parse_bytes(memory_bytes)
    rows = []
    for rep in reports:
        extra = {k: v for k, v in sizes.items() if k in rep.symbols}
        granule = int(rep.options.get("chunk_size", rep.options.get("shard_size", 1)) or 1)
        t = rep.max_seq_len(budget, batch, quantity=quantity, multiple_of=1, **extra)
        rows.append({"plan": rep.short_name(), "batch": batch or rep.example["batch"], "memory_bytes": budget,
                     "max_seq_len": t, "granule": granule})
    cols = ("plan", "batch", "memory_bytes", "max_seq_len")
    heads = ("plan", "batch", "memory", "max seq len")
    what = "total memory (parameters + optimizer state + inputs + step peak)" if quantity == "total_bytes" else quantity
    return CostTable("gradshard whatif --max-seq-len", cols, heads, tuple(rows), (f"limit on {what}",))


def compare_plans(model_or_fn: Any, plans: str | Iterable[Any], example_inputs: Sequence[Any],
                  seq_lens: Sequence[int | str], *, device: str | DeviceProfile | None = "h100",
                  batch: int | None = None, memory_bytes: float | str | None = None,
                  common_options: Mapping[str, Any] | None = None, **cost_kwargs: Any) -> CostTable:
    """Price every plan and tabulate them at ``seq_lens`` (see :func:`cost_table`)."""
    reports = cost_reports(model_or_fn, plans, example_inputs=example_inputs, device=device,
                           common_options=common_options, **cost_kwargs)
    return cost_table(reports, seq_lens, batch=batch, device=device, memory_bytes=memory_bytes)
