"""Bad or unusual input: the same result as eager, or a clear error (README: Troubleshooting)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from examples.factories import llama, ssm
from gradshard.errors import CaptureError, GradshardError


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(self.a(x)) * self.b(x)).cumsum(1)


@pytest.mark.parametrize("factory, plan, options, T", [
    (ssm, "adjoint", {"shard_size": 8}, 1),
    (ssm, "truncated_adjoint", {"window": 4, "shard_size": 8}, 0),
    (llama, "seco", {"chunk_size": 8}, 0),
    (llama, "spaco", {"chunk_size": 8, "budget": 2}, 1),
])
def test_one_or_zero_steps_after_capture_match_eager(factory, plan: str, options: dict, T: int) -> None:
    model, (ids,) = factory(seq_len=32)
    cm = gs.compile(model, plan=plan, **options)
    cm(ids)
    got, want = cm(ids[:, :T]), model(ids[:, :T])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert "plain autograd" in cm.explain()


@pytest.mark.parametrize("plan, options", [("adjoint", {"shard_size": 4}), ("seco", {"chunk_size": 4}), ("none", {})])
def test_nan_in_the_first_input_gives_eagers_result(plan: str, options: dict) -> None:
    model = Mixer().double()
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    x[0, 3, 1] = float("nan")
    got, want = gs.compile(model, plan=plan, **options)(x), model(x)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("factory, plan, options", [
    (llama, "seco", {"chunk_size": 8}), (llama, "spaco", {"chunk_size": 8}), (llama, "none", {}),
    (ssm, "adjoint", {"shard_size": 8}),
], ids=["seco", "spaco", "none", "adjoint"])
def test_a_token_id_past_the_vocabulary_raises_eagers_index_error_at_the_embedding(factory, plan, options) -> None:
    """Not a gradshard error advising another plan: the model's own error, as every plan raises it (the
    chunked plans and the adjoint's compiled shards add the node that raised it)."""
    model, (ids,) = factory(seq_len=24, batch=1)
    bad = ids.clone()
    bad[0, 5] = 10**6
    with pytest.raises(IndexError, match="index out of range") as eager:
        model(bad)
    with pytest.raises(IndexError, match="index out of range") as got:
        gs.compile(model, plan=plan, **options)(bad)
    assert type(got.value) is type(eager.value)
    assert plan == "none" or "embedding" in "\n".join(getattr(got.value, "__notes__", [])) + str(got.value)


def test_wrong_rank_is_a_capture_error_that_says_what_failed() -> None:
    with pytest.raises(CaptureError, match=r"(?s)raised \w+ while it was traced.*call the model eagerly"):
        gs.compile(Mixer().double(), plan="none")(torch.randn(4, dtype=torch.float64))


def test_a_detector_bug_is_a_gradshard_error_naming_the_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradshard.passes import detect_regions as dr

    def broken(gm, ctx):
        raise KeyError("boom")

    monkeypatch.setitem(dr.DETECTORS, "attention", broken)
    with pytest.raises(GradshardError, match="internal error in region detector 'attention': KeyError"):
        gs.compile(Mixer().double(), plan="none")(torch.randn(2, 5, 4, dtype=torch.float64))


def test_chunk_size_true_is_refused_at_compile() -> None:
    with pytest.raises(GradshardError, match="chunk_size must be a positive int"):
        gs.compile(Mixer(), plan="seco", chunk_size=True)
