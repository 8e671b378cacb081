"""Detection of linear recurrences and the errors for what adjoint sharding cannot handle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradshard as gs
from gradshard.errors import UnsupportedGraphError

from .helpers import assert_same_grads
from .models import DiagonalSSM, PositionalProducer, TanhRNN, init_like_training


def _x(b=2, T=9, d=4):
    return torch.randn(b, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def test_nonlinear_recurrence_is_refused_with_the_node_and_an_alternative():
    cm = gs.compile(TanhRNN().double(), plan="adjoint")
    with pytest.raises(UnsupportedGraphError) as err:
        cm(_x())
    text = str(err.value)
    assert "tanh" in text and "not linear in the state" in text
    assert "models.py" in text  # the user's source line
    # the chunked plans roll any loop whose steps repeat (a carried loop): the advice names them
    assert "plan='seco'" in text and "plan='spaco'" in text and "plan='none'" in text
    for plan in ("seco", "spaco"):  # the advice works, exactly
        assert_same_grads(TanhRNN().double(), (_x(),), plan=plan, chunk_size=4)
    gs.compile(TanhRNN().double(), plan="none")(_x()).sum().backward()


@pytest.mark.parametrize("plan, options", [("adjoint", {}), ("truncated_adjoint", {"window": 100})])
def test_position_dependent_producer_enters_the_region_sliced(plan, options):
    """Positions built in the graph (``arange``) are computed once outside the region and sliced
    per shard like any region input: the sharded recompute reads the right positions."""
    cm = assert_same_grads(init_like_training(PositionalProducer()), (_x(),), plan=plan, shard_size=4, **options)
    assert any(r.kind == "linear_recurrence" for r in cm.regions)


def test_model_without_recurrence_is_refused():
    cm = gs.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double(), plan="adjoint", time_axis=(0, 1))
    with pytest.raises(UnsupportedGraphError, match="no linear recurrence"):
        cm(_x())


@pytest.mark.parametrize("scan,written", [("loop", "rolled loop (9 steps)"), ("gradshard", "gradshard.kernels.linear_scan"),
                                          ("cumprod", "log-space cumsum"), ("associative", "associative_scan")])
def test_one_region_per_layer_names_how_it_was_written(scan, written):
    model = init_like_training(DiagonalSSM(d=4, scan=scan, layers=3))
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    cm(_x())
    regions = [r for r in cm.regions if r.kind == "linear_recurrence"]
    assert len(regions) == 3
    assert {r.options["written_as"] for r in regions} == {written}
    assert all(r.source is not None and "models.py" in r.source.file for r in regions)


def test_plan_none_reports_recurrences_without_rewriting():
    model = init_like_training(DiagonalSSM(d=4, scan="cumprod"))
    cm = gs.compile(model, plan="none")
    cm(_x())
    assert [r.options["written_as"] for r in cm.regions if r.kind == "linear_recurrence"] == ["log-space cumsum"] * 2


def test_stage_program_lists_recompute_adjoint_scan_vjp_per_shard():
    model = init_like_training(DiagonalSSM(d=4, scan="loop", layers=2))
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    cm(_x(T=9))
    kinds = [s.kind for s in cm.program.stages if s.region == "adjoint_1"]
    # forward, then 3 shards (9 steps / 4) in reverse: recompute, adjoint_scan, vjp_shard
    assert kinds == ["forward_chunk"] + ["recompute", "adjoint_scan", "vjp_shard"] * 3
    names = [s.name for s in cm.program.stages if s.region == "adjoint_1" and s.kind == "recompute"]
    assert names == ["adjoint_1:shard2:recompute", "adjoint_1:shard1:recompute", "adjoint_1:shard0:recompute"]
    fwd = next(s for s in cm.program.stages if s.name == "adjoint_1:forward")
    assert fwd.memory_bytes > 0 and fwd.flops > 0 and "linear_scan" in fwd.kernel
    assert "adjoint_0" in cm.explain()


def test_only_the_layer_input_and_checkpoints_are_saved():
    """The region's autograd node saves its inputs and T/shard - 1 states, not a, u, h."""
    model = init_like_training(DiagonalSSM(d=4, n=5, scan="gradshard", layers=1))
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    x = _x(b=2, T=12)
    cm(x)  # compile
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cm(x)
    region_saved = [t for t in saved if t.dim() == 3 and t.shape[-1] == 5 and t.shape[-2] == 4]
    stacked = [t for t in saved if t.shape == (2, 2, 5, 4)]
    assert len(stacked) == 1  # the checkpoints at steps 4 and 8 (12 steps, shards of 4), one tensor
    assert not [t for t in saved if t.dim() == 4 and t.shape[1] == 12]  # no (B, T, N, P) tensor (u or h) is kept
    del region_saved, out


class _MaskPositionsSSM(nn.Module):
    """Positions from the cumsum of a padding mask (OPT's learned positions) added to the input of
    a diagonal SSM: the positions' scan computes no gradient, the SSM's does."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, d)
        self.ssm = DiagonalSSM(d=d, layers=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = (torch.cumsum(mask, dim=1) * mask - 1).clamp_min(0).long()
        return self.ssm(x + self.pos(positions))


def test_a_scan_without_gradient_is_not_a_region():
    """A scan of values that depend on no parameter stays a plain op (autograd saves nothing for
    it); only the SSM's recurrence is sharded. With no other scan the refusal names it."""
    mask = torch.ones(2, 9, dtype=torch.long)  # OPT's: an integer mask (a float one would take a gradient)
    mask[1, -3:] = 0
    cm = assert_same_grads(init_like_training(_MaskPositionsSSM()).double(), (_x(), mask), shard_size=4)
    assert [name for name, _ in cm.graph.named_children() if name.startswith("adjoint_")] == ["adjoint_0"]
    with pytest.raises(UnsupportedGraphError, match="compute no gradient") as err:
        gs.compile(_MaskPositionsSSMFree(), plan="adjoint")(_x(), mask.double())  # OPT casts its mask to float
    assert "test_detection.py" in str(err.value)


class _MaskPositionsSSMFree(nn.Module):
    """Positions from the mask scaled by a parameter-free function of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(x) * torch.cumsum(mask, dim=1)[..., None]
