"""qwen3_next (gated delta rule layers + full attention, MoE MLPs) under the chunked plans.

HF's ``torch_chunk_gated_delta_rule`` works in blocks of a fixed 64 tokens (its
``chunk_size`` argument is not read from the config): the sequence is padded to a multiple
of 64, each block builds its UT transform by a lower unitriangular solve along the block's
steps, and a Python loop over blocks carries the state. At the zoo's T = 37 the whole
sequence is one block, so the solve runs along time and the loop has one iteration.

The layer computes in float32 inside a float64 model, and the gradients of ``dt_bias`` and
``A_log`` come out of a heavy cancellation: eager float32 is itself ~0.35 (relative) away
from the float64 gradient there, so reordered float32 sums differ by ~4e-2. To measure
gradshard's error rather than float32 rounding, the exactness tests run model and capture
under ``zoo.Float64Everywhere`` (float32 islands computed in float64; nothing in
transformers is patched): then every gradient matches eager to 1.0e-9 (the float64
reordering noise of that cancellation).
"""

from __future__ import annotations

import pytest

import gradshard as gs
from gradshard.errors import GradshardError

from .test_hf_plans import FLOAT64_REORDER, _run_cell
from .zoo import build, inputs

pytest.importorskip("transformers.models.qwen3_next")

@pytest.mark.slow  # the chunk rules it needs are unit-tested in tests/chunked/test_chunk_rules_select_solve.py
def test_seco_is_exact_within_one_block() -> None:
    """T = 37 < 64: the within-block solve runs chunk by chunk (chunks of 8) exactly."""
    assert _run_cell("qwen3_next", "eager", "seco", float64=True) <= FLOAT64_REORDER


@pytest.mark.slow
@pytest.mark.parametrize("attn, plan", [("sdpa", "seco"), ("sdpa", "spaco"), ("eager", "spaco")])
def test_chunked_plans_are_exact_within_one_block(attn: str, plan: str) -> None:
    assert _run_cell("qwen3_next", attn, plan, float64=True) <= FLOAT64_REORDER


@pytest.mark.slow
@pytest.mark.parametrize("plan, opts", [("adjoint", {"shard_size": 8}),
                                        ("truncated_adjoint", {"window": 1000, "shard_size": 8})])
def test_adjoint_plans_refuse_naming_the_node(plan: str, opts: dict) -> None:
    """No linear recurrence over single steps exists in HF's block form: a refusal naming the
    node and the source line, recommending seco."""
    model, config = build("qwen3_next", attn="eager")
    ids = inputs(config, batch=2, T=37)["input_ids"]
    with pytest.raises(GradshardError) as info:
        gs.compile(model, plan=plan, **opts)(input_ids=ids)
    msg = str(info.value)
    assert "node `" in msg and "modeling_qwen3_next.py" in msg
    assert "seco" in msg


@pytest.mark.slow
def test_seco_over_several_blocks_is_refused_naming_the_node() -> None:
    """T = 150 spans three 64-token blocks: the time axis is split over (block, step in block),
    which the chunked plans cannot window; a refusal, never a wrong gradient."""
    model, config = build("qwen3_next", attn="eager")
    ids = inputs(config, batch=2, T=150)["input_ids"]
    with pytest.raises(GradshardError, match="node `"):
        gs.compile(model, plan="seco", chunk_size=64)(input_ids=ids)
