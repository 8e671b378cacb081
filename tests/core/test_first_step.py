"""The first step costs what every step costs (issue 17), measured with the CPU allocator.

``CpuAllocatorTrace`` counts every byte the c10 allocator hands out during a step -- capture,
the plan's passes and self-checks included -- so "first step peak <= 1.1 x steady peak" is a
deterministic check, not a timing. Capture traces on fake tensors: its own allocations do not
grow with T.
"""

from __future__ import annotations

import copy

import pytest
import torch

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


def test_pricing_a_factory_node_allocates_nothing() -> None:
    """The scheduler prices every node by replaying it on meta tensors; a node with no tensor
    input (a chunked scan's ``ones(n_chunks, n_chunks)`` mask) used to run for real: 16 MiB at
    each compile of transformers' Mamba-2 at T=64K, growing with T**2."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gradshard.analysis.node_costs import node_cost

    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.masked_fill(torch.ones(n, n, dtype=torch.bool).tril(), 0.0).exp()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3000, 3000))
    ones = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.ones.default)
    with CpuAllocatorTrace() as trace:
        costs = [node_cost(n) for n in gm.graph.nodes]
    assert trace.peak_bytes < 2**16, trace.peak_bytes  # the mask alone is 9 MB
    assert costs[list(gm.graph.nodes).index(ones)].out_bytes == 3000 * 3000


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
    """A long first call compiles at the 67-step probe and is served at T from the rolled graph:
    what is captured (nodes) and what the compile allocates do not grow with T, and the served
    program computes what eager computes."""
    nodes, peaks = [], []
    for T in (300, 900):
        model, (ids,) = factories.ssm_loop(seq_len=T, batch=1, d_model=16, n_layers=1, dtype=torch.float64)
        ref = copy.deepcopy(model)
        cm = gs.compile(model, plan="seco", chunk_size=64)
        with CpuAllocatorTrace() as trace:
            entry = cm.compile_first((ids,))
        assert entry.extras.get("respecialized_from") == 67, cm.explain()
        nodes.append(entry.original.num_nodes)
        peaks.append(trace.peak_bytes)
        cm(ids).pow(2).mean().backward()
        ref(ids).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    assert nodes[0] == nodes[1], nodes
    assert peaks[1] <= peaks[0] + 2**16, peaks


class _PaddedToChunks(torch.nn.Module):
    """Pads time to a multiple of 16 and works chunk by chunk, as transformers' Mamba-2 SSD does:
    the pad (13 steps at the 67-step probe) makes the probe's graph unable to serve other lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        y = torch.nn.functional.pad(self.proj(x), (0, 0, 0, (-T) % 16))
        y = y.reshape(x.shape[0], -1, 16, 8).cumsum(2).reshape(x.shape[0], -1, 8)
        return y[:, :T].tanh()


def test_a_probe_that_cannot_serve_is_dropped_and_explained() -> None:
    model = _PaddedToChunks()
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="none")
    x = torch.randn(2, 300, 8, dtype=torch.float64)
    cm(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert torch.allclose(model.proj.weight.grad, ref.proj.weight.grad, rtol=1e-12)
    assert not cm._probes  # its graphs are not kept for nothing
    text = cm.explain()
    assert "67-step probe does not serve this call's length (the cross-check at T=68, batch 2 failed" in text, text
    assert "reshape" in text


def test_sizes_computed_from_the_length_are_served_from_a_symbolic_trace() -> None:
    """The pad to a multiple of 16 and the chunk count escape the time facts; at a second length
    the graph captured at the first is traced with symbolic sizes and serves every length its
    guards allow (no capture); a length that breaks a guard (a pad of 0) is captured again and
    explain() names the guard. The inputs are slices of a longer tensor (strides that are no
    function of the length)."""
    model = _PaddedToChunks()
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="none")
    base = torch.randn(3, 600, 8, dtype=torch.float64)
    for T in (300, 403, 77, 512):
        x = base[: 3 if T == 77 else 2, :T]  # slices of a longer tensor: not contiguous
        model.proj.weight.grad = ref.proj.weight.grad = None
        cm(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert torch.allclose(model.proj.weight.grad, ref.proj.weight.grad, rtol=1e-12), T
        text = cm.explain()
        if T in (403, 77):
            assert cm.current.extras.get("respecialized_from") == 300, text
            assert "captured again" not in text, text
            assert "from a capture with symbolic sizes at T=403, batch 2" in text, text
    lg = cm.current.ctx.plan_state["length_generic"]
    assert lg.seq_len == 512 and lg.symbolic is None  # captured again, not served
    assert "captured again because the inputs changed (input 0: shape (3, 77, 8) -> (2, 512, 8))" in text, text
    assert "the symbolic trace's guard" in text and "is false at T=512, batch 2" in text, text


@pytest.mark.parametrize("plan", ["none", "partial_update"])
def test_plain_autograd_plans_serve_every_length_from_the_probe(plan: str) -> None:
    """none and partial_update compile a long first call at the 67-step probe and serve T by
    re-specialising it (the same captured graph at T=300 and T=900), computing what eager does;
    partial_update's sliced parameters come with the served program."""
    nodes = []
    for T in (300, 900):
        model, (ids,) = factories.llama(seq_len=T, batch=2, dtype=torch.float64)
        ref = copy.deepcopy(model)
        cm = gs.compile(model, plan=plan)
        entry = cm.compile_first((ids,))
        assert entry.extras.get("respecialized_from") == 67, cm.explain()
        nodes.append(entry.original.num_nodes)
        cm(ids).pow(2).mean().backward()
        ref(ids).pow(2).mean().backward()
        if plan == "partial_update":  # against the plan captured at T itself
            full = gs.compile(ref, plan=plan)
            full.specialize((ids,))
            for q in ref.parameters():
                q.grad = None
            full(ids).pow(2).mean().backward()
            assert cm.parameter_slices() == full.parameter_slices()
            served, captured = dict(cm.named_parameters()), dict(full.named_parameters())
            for name in cm.parameter_slices():
                assert torch.allclose(served[name].grad, captured[name].grad, rtol=1e-10, atol=1e-13), name
            continue
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13), name
    assert nodes[0] == nodes[1], nodes


def test_plan_none_runs_a_loop_written_model_eagerly_beyond_the_captured_length() -> None:
    """Plain autograd runs a per-step loop as captured, unrolled: that graph is not kept for
    serving. A long first call compiles the 67-step probe, then runs the module itself (what
    plan none computes), so nothing unrolls T steps; its first step costs a steady step."""
    model, (ids,) = factories.ssm_loop(seq_len=150, batch=1, d_model=16, n_layers=1, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="none")
    entry = cm.compile_first((ids,))
    assert "run_eagerly" in entry.extras and "respecialized_from" not in entry.extras
    assert entry.captured.example_inputs[-1].shape[1] == 67  # the probe, never T=150
    assert "running the module eagerly at T=150" in cm.explain()
    assert any("unrolled 67 times" in note for r in cm.current.records for note in r.notes), cm.explain()
    first, steady = _peaks(cm, list(model.parameters()), lambda m: m(ids).pow(2).mean().backward())
    assert first <= 1.1 * steady, (first, steady)
    for p in ref.parameters():
        p.grad = None
    ref(ids).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name  # the module itself ran


def test_plan_none_keeps_the_captured_loop_at_its_length_and_runs_others_eagerly() -> None:
    """A short first call is captured (graph run as captured); another length runs the module;
    the first length still runs its captured graph."""
    model, (ids,) = factories.ssm_loop(seq_len=53, batch=1, d_model=16, n_layers=1, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="none")
    for T in (40, 53, 40):
        x = ids[:, :T]
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad = None
        cm(x).pow(2).mean().backward()
        assert ("run_eagerly" in cm.current.extras) == (T != 40), (T, cm.current.extras)
        ref(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13), (T, name)
    assert len(cm.specializations) == 2

@pytest.mark.parametrize("plan", ["seco", "adjoint", "none"])
def test_a_new_batch_size_compiles_again_at_the_probe_and_is_served(plan: str) -> None:
    """Batch size is a guard: a long call at a new batch compiles at the 67-step probe again
    (never at its own length), explain() names the guard, and a further length at that batch
    is served without a capture. Gradients exact at every call."""
    model, (ids,) = factories.ssm(seq_len=500, batch=2, d_model=16, n_layers=1, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan=plan, **OPTIONS.get(plan, {}))
    for B, T in [(1, 300), (2, 300), (2, 500)]:
        x = ids[:B, :T]
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad = None
        cm(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12), (B, T, name)
        entry = cm.current
        assert entry.extras["respecialized_from"] == 67 and tuple(entry.captured.example_inputs[-1].shape) == (B, 67)
        recaptured = entry.extras.get("recaptured_because", "")
        assert ("input 0: shape (1, 300) -> (2, 300)" in recaptured) == ((B, T) == (2, 300)), (B, T, recaptured)
    assert "captured again" not in cm.explain()  # the last call was served
