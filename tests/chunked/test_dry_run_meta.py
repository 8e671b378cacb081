"""The chunk dry run on meta tensors measures what it measures on fake tensors.

The dry run samples a few chunks for their FLOPs, peak bytes and cache reads (the chunk
program's estimates and cache retention). It runs on meta tensors where it can
(:class:`gradshard.passes.meta_propagate.OnMeta`) and on fake tensors otherwise; both must
give the same numbers, on our models and on transformers' (checked this way over the chunked,
transformers, cost and LASP suites when the meta path landed: ~1,000 dry runs, none differed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gradshard as gs
from examples import factories
from gradshard.plans.chunked import plan as chunk_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from zoo import build, inputs  # noqa: E402


@pytest.fixture
def dry_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict]]:
    """(meta stats, fake stats) of every dry run's final round while the test compiles."""
    seen: list[tuple[dict, dict]] = []
    real = chunk_plan.dry_run

    def both(program, flat, max_rounds=64):
        notes = real(program, flat, max_rounds)
        sample = chunk_plan._sample_chunks(program.num_chunks)
        on_meta = chunk_plan._meta_example(flat)
        meta = None if on_meta is None else chunk_plan._sampled_stats(program, sample, *on_meta)
        seen.append((meta, chunk_plan._sampled_stats(program, sample, *chunk_plan._fake_example(flat))))
        return notes

    monkeypatch.setattr(chunk_plan, "dry_run", both)
    return seen


def _hf(family: str, T: int = 37):
    model, config = build(family)
    return model, inputs(config, 1, T)


@pytest.mark.parametrize("plan", ["seco", "spaco"])
def test_meta_dry_run_matches_fake_on_the_example_llama(plan: str, dry_runs) -> None:
    model, args = factories.llama(seq_len=40)
    gs.compile(model, plan=plan, chunk_size=16)(*args)
    assert dry_runs and all(meta == fake and meta is not None for meta, fake in dry_runs)


def test_meta_dry_run_matches_fake_on_transformers_mamba2(dry_runs) -> None:
    model, batch = _hf("mamba2")
    gs.compile(model, plan="seco", chunk_size=16)(**batch)
    assert dry_runs and all(meta == fake and meta is not None for meta, fake in dry_runs)


def test_under_autocast_the_dry_run_stays_on_fake_tensors(dry_runs) -> None:
    """CPU autocast casts ops on CPU tensors, never on meta ones: a meta dry run would keep float32
    where the captured graph runs bfloat16, and miscount bytes (by up to 18% before this rule)."""
    model, args = factories.ssm(seq_len=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gs.compile(model, plan="seco", chunk_size=16)(*args)
    assert dry_runs and all(meta is None for meta, _ in dry_runs)


def test_an_op_that_fails_on_meta_tensors_reruns_the_round_on_fake_tensors(monkeypatch) -> None:
    """A rule's op without a meta kernel (or reading data) fails on meta tensors: the round reruns
    on fake tensors, and the program is the one a fake-only dry run builds."""
    from gradshard.passes.meta_propagate import OnMeta

    refused: list = []

    class NoMatmulOnMeta(OnMeta):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                refused.append(func)
                raise RuntimeError("no meta kernel (test)")
            return super().__torch_dispatch__(func, types, args, kwargs)

    def program(**patch):
        with monkeypatch.context() as m:
            for name, value in patch.items():
                m.setattr(chunk_plan, name, value)
            model, args = factories.llama(seq_len=40)
            cm = gs.compile(model, plan="seco", chunk_size=16)
            cm(*args)
        prog = cm.graph.seco_0.program
        return [(s.name, s.retention) for s in prog.cache_points.values()], prog.estimates

    assert program(OnMeta=NoMatmulOnMeta) == program(_meta_example=lambda flat: None)
    assert refused, "the meta round never ran a matmul: the test proves nothing"
