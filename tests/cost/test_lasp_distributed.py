"""LASP on three threaded gloo ranks: each rank's measured peak, FLOPs and communication vs. the
cost model's per-rank prediction (the middle rank sends one state per layer in each direction)."""

import pytest

import gradshard as gs
from examples import factories as F
from gradshard.cost import cost, make_step

WORLD, SEQ_LEN, BATCH = 3, 48, 2


def _rank_step(rank, group):
    from gradshard.runtime.comm import CommCounter
    from gradshard.measure import measure
    from gradshard.plans.lasp.runtime import local_slice

    model, (ids,) = F.linear_attention_gradshard(seq_len=SEQ_LEN, batch=BATCH)  # same seed: same weights
    local = local_slice(ids, rank, WORLD).contiguous()
    cm = gs.compile(model, "lasp", group=group)
    cm(local)  # collective compile
    for p in cm.parameters():
        p.grad = None
    with CommCounter(group) as counter:
        m = measure(make_step(cm), local, repeat=0)  # one step: no timed repeats
    return (m.peak_bytes, (m.forward_flops, m.backward_flops), counter.bytes(direction="send"),
            counter.bytes(direction="allreduce"))


@pytest.mark.slow  # 11 s of threaded ranks; runs in `make test-all`
def test_lasp_per_rank_prediction_matches_threaded_ranks():
    from gradshard.distributed.testing import run_threaded

    target, inputs = F.linear_attention_gradshard(seq_len=32)
    report = cost(target, "lasp", example_inputs=inputs)
    results = run_threaded(WORLD, _rank_step, timeout_s=240)
    peak, flops, sent, reduced = results[1]  # the middle rank relays in both directions
    pred = report.evaluate(seq_len=SEQ_LEN, batch=BATCH, world_size=WORLD)
    assert abs(pred["peak_bytes"] - peak) <= 0.10 * peak
    # the middle rank: its local work plus the products with the states it receives
    assert (pred["flops_fwd"], pred["flops_bwd"]) == flops
    wire = sent + 2 * (WORLD - 1) / WORLD * reduced  # ring all-reduce traffic of the reduced payload
    assert pred["comm_bytes"] == pytest.approx(wire, abs=1)  # evaluate() rounds to whole bytes
    assert reduced == pred["grad_bytes"]
