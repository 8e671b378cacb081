"""Rich renderings of regions, pass records (with graph diffs) and stage programs."""

from __future__ import annotations

import difflib

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gradshard.api import CompiledGraph
from gradshard.ir import PassRecord, Region
from gradshard.schedule import Program
from gradshard.units import format_bytes, format_count

__all__ = ["regions_table", "pass_panel", "program_table", "graph_text"]



def regions_table(regions: tuple[Region, ...]) -> Table:
    t = Table(title=f"Regions found ({len(regions)})", title_justify="left", expand=False)
    for col in ("kind", "name", "time axis", "facts", "source"):
        t.add_column(col, overflow="fold")
    for r in regions:
        facts = ", ".join(f"{k}={v}" for k, v in r.options.items())
        src = f"{_short(r.source.file)}:{r.source.line}\n[dim]{r.source.code.strip()}[/dim]" if r.source else "-"
        t.add_row(f"[bold cyan]{r.kind}[/]", r.name, str(r.time_axis), facts, src)
    if not regions:
        t.add_row("-", "(none: nothing here grows with sequence length)", "", "", "")
    return t


def _short(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def graph_text(code: str, max_lines: int | None = None) -> Text:
    lines = [l for l in code.strip("\n").splitlines() if l.strip()]
    if max_lines and len(lines) > max_lines:
        lines = lines[:max_lines] + [f"    ... ({len(lines) - max_lines} more lines; --full shows all)"]
    return Text("\n".join(lines), style="white")


def graph_diff(before: str, after: str, max_lines: int | None = None) -> Text:
    """The after-graph with created lines green (+) and erased lines red (-)."""
    a = [l for l in before.splitlines() if l.strip()]
    b = [l for l in after.splitlines() if l.strip()]
    out = Text()
    shown = 0
    for line in difflib.ndiff(a, b):
        tag, body = line[:1], line[2:]
        if tag == "?":
            continue
        if max_lines and shown >= max_lines:
            out.append(f"... (diff truncated; --full shows all)\n", style="dim")
            break
        if tag == "+":
            out.append(f"+ {body}\n", style="bold green")
        elif tag == "-":
            out.append(f"- {body}\n", style="red")
        else:
            out.append(f"  {body}\n", style="dim")
        shown += 1
    return out


def pass_panel(index: int, rec: PassRecord, max_lines: int | None) -> Panel:
    title = f"[bold]{index}. {rec.name}[/]  " + (
        f"[green]+{len(rec.created)}[/] [red]-{len(rec.erased)}[/] nodes" if rec.changed else "[dim]analysis (graph unchanged)[/]")
    body: list = [Text(rec.doc, style="italic")]
    for note in rec.notes:
        body.append(Text(f"• {note}", style="yellow"))
    for r in rec.regions:
        body.append(Text(f"→ found {r.describe()}", style="cyan"))
    if rec.changed:
        body.append(graph_diff(rec.before, rec.after, max_lines))
    return Panel(Group(*body), title=title, title_align="left", border_style="green" if rec.changed else "blue")


def program_table(program: Program) -> Table:
    t = Table(title=f"Stage program ({len(program.stages)} stages, est. peak "
                    f"{format_bytes(program.estimated_peak_bytes())}, {format_count(program.total_flops)} FLOPs)",
              title_justify="left")
    for col in ("#", "phase", "kind", "stage", "region", "memory", "FLOPs", "kernel"):
        t.add_column(col, justify="right" if col in ("#", "memory", "FLOPs") else "left",
                     overflow="fold", no_wrap=col in ("#", "memory", "FLOPs"))
    for i, s in enumerate(program.stages):
        style = "magenta" if s.phase == "backward" else ""
        t.add_row(str(i), s.phase, s.kind, s.name, s.region or "", format_bytes(s.memory_bytes),
                  format_count(s.flops), s.kernel, style=style)
    return t


def summary_panel(entry: CompiledGraph, gradient: str) -> Panel:
    tl = entry.ctx.analyses.get("time")
    lines = [f"plan [bold]{entry.plan}[/] — gradient: {gradient}", f"options: {entry.options}",
             f"captured graph: {entry.original.num_nodes} nodes"
             + (f" via the {entry.captured.frontend} front door" if entry.captured else "")]
    if tl is not None:
        lines.append(f"time axis: T={tl.seq_len}; evidence: " + "; ".join(e for es in tl.evidence.values() for e in es))
    return Panel("\n".join(lines), title="gradshard", title_align="left")


def program_summary(program: Program) -> Table:
    """Stages grouped by phase and kind (the full list is `gradshard show`'s)."""
    t = Table(title=f"Stage program: {len(program.stages)} stages, est. peak "
                    f"{format_bytes(program.estimated_peak_bytes())}", title_justify="left")
    for col in ("phase", "kind", "stages", "largest memory", "FLOPs", "kernels"):
        t.add_column(col, justify="right" if col in ("stages", "largest memory", "FLOPs") else "left")
    groups: dict[tuple[str, str], list] = {}
    for st in program.stages:
        groups.setdefault((st.phase, st.kind), []).append(st)
    for (phase, kind), sts in groups.items():
        t.add_row(phase, kind, str(len(sts)), format_bytes(max(x.memory_bytes for x in sts)),
                  format_count(sum(x.flops for x in sts)), ", ".join(sorted({x.kernel for x in sts})))
    return t
