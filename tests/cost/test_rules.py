"""Per-plan rules: SpaCO's expected FLOPs (checked by enumerating every selection), LASP's
per-rank costs and communication, and the registry."""

import itertools

import pytest
import sympy

import gradshard as gs
from examples import factories as F
from gradshard.cost import cost
from gradshard.cost.fit import B
from gradshard.cost.rules import R, PlanRule, get_rule, register_rule, RULES
from gradshard.cost.validate import measure_step


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all`
def test_spaco_expected_backward_flops_equal_the_enumerated_expectation():
    from gradshard.plans.chunked.runtime import force_selection

    target, inputs = F.llama(seq_len=32)
    opts = {"chunk_size": 8, "budget": 2}
    report = cost(target, "spaco", example_inputs=inputs, extra_rounds=0, **opts)
    k, q = 3, 2 / 3  # T = 24: three chunks of unequal cost (attention over a growing prefix), each kept w.p. 2/3
    model, batch = F.llama(seq_len=24)
    cm = gs.compile(model, "spaco", **opts)
    cm(*batch)
    expected = 0.0
    for keep in itertools.product((0, 1), repeat=k):
        chosen = [j for j in range(k) if keep[j]]
        for p in cm.parameters():
            p.grad = None
        with force_selection(chosen):
            from gradshard.cost import make_step
            from gradshard.measure import measure

            flops = measure(make_step(cm), *batch, repeat=0).backward_flops
        expected += q ** len(chosen) * (1 - q) ** (k - len(chosen)) * flops
    predicted = report.evaluate(seq_len=24, batch=2)["flops_bwd"]
    assert predicted == pytest.approx(expected, rel=1e-9)
    assert report.expressions["flops_bwd"].has(sympy.ceiling)
    # memory is the worst case: every chunk kept
    worst = measure_step(F.llama, "spaco", opts, 48, 2).peak_bytes
    assert report.evaluate(seq_len=48, batch=2)["peak_bytes"] == pytest.approx(worst, rel=0.10)


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all` (tests/cost/test_lasp_distributed.py covers LASP by default)
def test_lasp_rule_is_the_per_rank_cost_plus_state_relay():
    target, inputs = F.linear_attention_gradshard(seq_len=32)
    lasp = cost(target, "lasp", example_inputs=inputs)
    assert lasp.symbols["world_size"] == R and lasp.defaults == {"world_size": 2}
    elements = 2 * 2 * 4 * 8 * 8  # batch 2, two layers of 4 heads, dk = dv = 8
    for t, r in [(1024, 4), (4096, 8)]:  # a rank of R holds T/R tokens
        per_rank, alone = lasp.evaluate(seq_len=t, batch=2, world_size=r), lasp.evaluate(t // r, 2, world_size=1)
        assert per_rank["activation_bytes"] == alone["activation_bytes"]
        assert per_rank["peak_bytes"] == max(alone["peak_bytes"], 2 * alone["grad_bytes"])  # bucketed all-reduce
        assert per_rank["flops_fwd"] - alone["flops_fwd"] == 2 * (t // r) * elements  # q S
        assert per_rank["flops_bwd"] - alone["flops_bwd"] == 6 * (t // r) * elements  # do S^T, v D^T, k D
    # two layers of 4 heads, dk = dv = 8, float32: one B*H*dk*dv state per layer and direction
    state = 2 * (4 * 8 * 8 * 4) * B
    grads = lasp.expressions["grad_bytes"]
    assert sympy.simplify(lasp.expressions["comm_bytes"] - (2 * state + 2 * (R - 1) / R * grads)) == 0
    no_reduce = cost(target, "lasp", example_inputs=inputs, reduce_grads=False)
    assert not no_reduce.expressions["comm_bytes"].has(R)


def test_registry():
    assert {"none", "seco", "spaco", "lasp", "adjoint", "truncated_adjoint", "partial_update"} <= set(RULES)
    assert get_rule("some_future_plan").granularity(None) == 1
    old = RULES.get("none")
    try:
        register_rule(PlanRule("none", "test", granularity=lambda o: 4))
        assert get_rule("none").granularity(None) == 4
    finally:
        RULES["none"] = old


@pytest.mark.slow  # 66 s on 2 cores (16 probes): the default suite stays under 15 min; `make test-all` runs it
def test_truncated_adjoint_is_probed_above_its_window():
    """A call its window covers runs the exact adjoint, a longer one the windowed form (its
    buffers of the next window's steps, and on chunked shards a second readout): the probes price the longer calls' form,
    so every one runs above twice the window (past the calls that end in the second window), and
    the fit predicts a measured step there. (With a window of several shards the step's allocated
    bytes move with ``T`` mod the window: the fit is least squares, not exact.)"""
    opts = {"window": 32, "shard_size": 8}
    target, inputs = F.ssm(seq_len=40)
    report = cost(target, "truncated_adjoint", example_inputs=inputs, extra_rounds=0, first_step=False, **opts)
    assert min(p.seq_len for p in report.probes) > 2 * opts["window"], [p.seq_len for p in report.probes]
    measured = measure_step(F.ssm, "truncated_adjoint", opts, 120, 2)
    predicted = report.evaluate(seq_len=120, batch=2)
    assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.1)
    assert predicted["flops"] == pytest.approx(measured.flops, rel=0.1)
