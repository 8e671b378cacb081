"""The chunk stages reach the program, explain() and `gradshard show`."""

from __future__ import annotations

import io

from rich.console import Console

import gradshard as gs
from examples.factories import llama


def test_program_has_forward_and_recompute_chunk_stages() -> None:
    model, (ids,) = llama(seq_len=20, batch=1)
    cm = gs.compile(model, plan="seco", chunk_size=8)
    cm(ids)
    stages = cm.program.stages
    fwd = [s.name for s in stages if s.kind == "forward_chunk"]
    bwd = [s.name for s in stages if s.kind == "recompute_chunk"]
    assert fwd == [f"seco_0:forward_chunk_{j}" for j in range(3)]
    assert bwd == [f"seco_0:recompute_chunk_{j}" for j in (2, 1, 0)]  # reverse chunk order
    first_bwd = next(s for s in stages if s.kind == "recompute_chunk")
    assert "reads" in first_bwd.note and first_bwd.memory_bytes > 0 and first_bwd.flops > 0
    text = cm.explain()
    assert "recompute_chunk" in text and "cache point" in text and "flash attention" in text


def test_spaco_stages_say_the_keep_probability() -> None:
    model, (ids,) = llama(seq_len=32, batch=1)
    cm = gs.compile(model, plan="spaco", chunk_size=4, budget=2)
    cm(ids)
    notes = [s.note for s in cm.program.stages if s.kind == "recompute_chunk"]
    assert len(notes) == 8 and all("kept w.p. 0.25" in n for n in notes)


def test_gradshard_show_prints_the_chunk_stages(monkeypatch) -> None:
    from gradshard.cli import main as cli

    buf = io.StringIO()  # wide enough that rich does not truncate stage names
    monkeypatch.setattr(cli, "console", Console(file=buf, width=250, color_system=None))
    rc = cli.main(["show", "examples/factories.py:llama", "--plan", "seco", "-o", "chunk_size=8", "--max-lines", "3"])
    out = buf.getvalue()
    assert rc == 0
    assert "forward_chunk" in out and "recompute_chunk" in out and "plan_chunk_program" in out
