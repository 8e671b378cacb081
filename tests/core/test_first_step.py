"""The first step costs what every step costs (issue 17), measured with the CPU allocator.

``CpuAllocatorTrace`` counts every byte the c10 allocator hands out during a step -- capture,
the plan's passes and self-checks included -- so "first step peak <= 1.1 x steady peak" is a
deterministic check, not a timing. Capture traces on fake tensors: its own allocations do not
grow with T.
"""

from __future__ import annotations

import copy

import pytest

import gradshard as gs
from gradshard.examples import factories
from gradshard.measure import CpuAllocatorTrace

OPTIONS = {"seco": {"chunk_size": 64}, "adjoint": {"shard_size": 64}}


def _peaks(module, params, step, n: int = 2) -> list[int]:
    peaks = []
    for _ in range(n):
        for p in params:
            p.grad = None
        with CpuAllocatorTrace() as trace:
            step(module)
        assert trace.available, trace.why_unavailable
        peaks.append(trace.peak_bytes)
    return peaks


@pytest.mark.parametrize("plan", ["seco", "adjoint"])
def test_first_step_peak_is_the_steady_peak_on_the_ssm_example(plan: str) -> None:
    model, (ids,) = factories.ssm(seq_len=1000, batch=1)
    cm = gs.compile(model, plan=plan, **OPTIONS[plan])
    first, steady = _peaks(cm, list(model.parameters()), lambda m: m(ids).pow(2).mean().backward())
    assert steady > 0
    assert first <= 1.1 * steady, (first, steady)


def test_capture_allocates_nothing_that_grows_with_length() -> None:
    """Capture + passes at T=512 and T=4096 allocate the same: tracing runs on fake tensors, and
    the adjoint plan's self-check runs on the first 256 steps whatever T is."""
    peaks = []
    for T in (512, 4096):
        model, (ids,) = factories.ssm(seq_len=T, batch=1)
        cm = gs.compile(model, plan="adjoint", shard_size=64)
        with CpuAllocatorTrace() as trace:
            cm.specialize((ids,))
        peaks.append(trace.peak_bytes)
    assert peaks[1] <= peaks[0] + 2**16, peaks


def test_plan_none_on_a_transformers_model_costs_what_eager_costs() -> None:
    """Traced, transformers builds a (T, T) causal mask eager never builds; plan none folds it
    back into ``is_causal`` (before: 7.5x eager's peak at T=4096), and its first step is a steady step."""
    pytest.importorskip("transformers")
    from tests.hf.zoo import build, inputs

    model, config = build("llama", fp64_loss=False)
    model = model.float()
    ref = copy.deepcopy(model)
    ids = inputs(config, batch=1, T=512)["input_ids"]

    def step(m) -> None:
        m(input_ids=ids).logits.mean().backward()

    eager = _peaks(ref, list(ref.parameters()), step)[-1]
    first, steady = _peaks(gs.compile(model, plan="none"), list(model.parameters()), step)
    assert first <= 1.1 * steady, (first, steady)
    assert steady <= 1.1 * eager, (steady, eager)


def test_a_loop_written_model_unrolls_the_probe_not_the_sequence_under_seco() -> None:
    """seco compiles a long first call at the 67-step probe and serves T from its rolled graph:
    what is captured (nodes) and what the compile allocates do not grow with T."""
    nodes, peaks = [], []
    for T in (300, 900):
        model, (ids,) = factories.ssm_loop(seq_len=T, batch=1, d_model=16, n_layers=1)
        cm = gs.compile(model, plan="seco", chunk_size=64)
        with CpuAllocatorTrace() as trace:
            entry = cm.compile_first((ids,))
        assert entry.extras.get("respecialized_from") == 67, cm.explain()
        nodes.append(len(entry.original.graph.nodes))
        peaks.append(trace.peak_bytes)
    assert nodes[0] == nodes[1], nodes
    assert peaks[1] <= peaks[0] + 2**16, peaks
