"""Recurrent layers written as loops: a fresh tensor filled one step at a time
(``out[:, t] = y_t``) is captured as a ``stack``, a ``bmm`` over a merged ``(batch*time)``
row dim keeps batch and time apart, and state a forward assigns to a plain attribute does
not keep tracing tensors.

Small float64 models with odd shapes; every graph is compared with eager autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from gradshard.analysis.locality import analyze_time_locality
from gradshard.capture import capture

aten = torch.ops.aten


class StepFilled(nn.Module):
    """``h = a_t * h + u_t`` in a loop that writes each step into ``zeros_like(u)`` in place,
    accumulating in ``acc`` (float32 inside a float64 model, as transformers' RG-LRU does)."""

    def __init__(self, d: int = 5, acc: torch.dtype = torch.float64, *, skip: int | None = None,
                 read_early: bool = False) -> None:
        super().__init__()
        self.a, self.u, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.acc, self.skip, self.read_early = acc, skip, read_early

        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, u = torch.sigmoid(self.a(x)), self.u(x)
        h = torch.zeros(x.shape[0], x.shape[2], dtype=self.acc)
        out = torch.zeros_like(u)
        early = None
        for t in range(x.shape[1]):
            h = a[:, t].to(self.acc) * h + u[:, t].to(self.acc)
            if t != self.skip:
                out[:, t] = h.to(u.dtype)
            if self.read_early and t == 1:
                early = out.sum()
        self.state = h  # a plain attribute, not a buffer (as transformers' RG-LRU does)
        y = self.out(out)
        return y if early is None else y + early


class MergedRows(nn.Module):
    """Per-head gates from ``baddbmm`` over ``x.reshape(B*T, H, W)`` (time merged with batch),
    then a cumulative sum along time: the time axis must stay T, not B."""

    def __init__(self, heads: int = 3, width: int = 2) -> None:
        super().__init__()
        self.heads, self.width = heads, width
        self.w = nn.Parameter(torch.randn(heads, width, width) / width)
        self.b = nn.Parameter(torch.randn(heads, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        rows = x.reshape(B * T, self.heads, self.width).permute(1, 0, 2)
        g = torch.baddbmm(self.b[:, None, :], rows, self.w)
        g = torch.sigmoid(g.transpose(0, 1).reshape(B, T, D))
        return torch.cumsum(g * x, dim=1)


class PieceFilled(nn.Module):
    """Keys built as transformers' DeepSeek-V3 attention builds them: a fresh tensor whose last
    dim is written in pieces (``k[..., :d] = k_nope; k[..., d:] = k_rope``), then a causal
    mixing along time; ``mixed`` writes one column through ``select`` and the rest by slices."""

    def __init__(self, d: int = 5, mixed: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 3), nn.Linear(d, 3 if mixed else 2)
        self.mixed = mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.new_empty(*x.shape[:2], 5 + self.mixed)
        if self.mixed:
            k[..., 0] = self.a(x)[..., 0]
            k[..., 1:3] = self.a(x)[..., 1:]
            k[..., 3:] = self.b(x)
        else:
            k[..., 3:] = self.b(x)  # written out of order: the pieces are sorted by position
            k[..., :3] = self.a(x)
        return torch.cumsum(torch.tanh(k), dim=1)


class ViewReadAfterWrite(nn.Module):
    """A view taken before an in-place write and read after it: the data flow (slice, then
    add_) does not show that the slice's values are the written ones."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        head = y[..., :2]
        y.mul_(2.0)
        return torch.cumsum(head.sum(-1, keepdim=True) * y, dim=1)


def _x(b: int = 3, T: int = 7, d: int = 5) -> torch.Tensor:
    return torch.randn(b, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _max_rel_err(model: nn.Module, x: torch.Tensor, plan: str, **options) -> float:
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan=plan, **options)
    got, want = cm(x), ref(x)
    w = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * w).sum().backward()
    (want * w).sum().backward()
    errs = [float((got - want).detach().abs().max() / want.detach().abs().max())]
    for p, q in zip(ref.parameters(), model.parameters()):
        errs.append(float((q.grad - p.grad).abs().max() / p.grad.abs().max()))
    return max(errs)


def test_step_filled_buffer_is_captured_as_a_stack():
    gm = capture(StepFilled().double(), (_x(),)).gm
    ops = _ops(gm)
    assert aten.copy_.default not in ops and aten.zeros_like.default not in ops
    stacks = [n for n in gm.graph.nodes if n.target is aten.stack.default]
    assert len(stacks) == 1 and len(stacks[0].args[0]) == 7 and stacks[0].args[1] == 1
    assert "test_loop_capture.py" in stacks[0].meta["stack_trace"]  # the write's source line
    tl = analyze_time_locality(gm)
    assert tl[stacks[0]].reach.reads_all_past  # the readout now sees the recurrence


@pytest.mark.parametrize("kwargs", [{"skip": 4}, pytest.param({"read_early": True}, marks=pytest.mark.slow)])
def test_partly_filled_or_early_read_buffer_is_left_as_written(kwargs):
    """A step never written keeps the allocator's value; a read before the last write sees a
    partly filled buffer: neither is a stack, so the graph keeps the in-place writes."""
    model = StepFilled(**kwargs).double()
    gm = capture(model, (_x(),)).gm
    assert aten.copy_.default in _ops(gm)
    assert _max_rel_err(model, _x(), "none") == 0.0


def test_cast_steps_are_cast_as_copy_does():
    """Steps computed in float32 are written into a float64 buffer: the stack casts each one."""
    gm = capture(StepFilled(acc=torch.float32).double(), (_x(),)).gm
    stack = next(n for n in gm.graph.nodes if n.target is aten.stack.default)
    assert stack.meta["val"].dtype == torch.float64
    assert all(p.meta["val"].dtype == torch.float64 for p in stack.args[0])


@pytest.mark.parametrize("mixed", [False, True])
def test_piece_filled_buffer_is_captured_as_a_cat(mixed):
    gm = capture(PieceFilled(mixed=mixed).double(), (_x(),)).gm
    ops = _ops(gm)
    assert aten.copy_.default not in ops and aten.new_empty.default not in ops
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    assert cat.args[1] == 2 and len(cat.args[0]) == 2 + mixed
    assert _max_rel_err(PieceFilled(mixed=mixed).double(), _x(), "seco", chunk_size=3) <= 1e-12


@pytest.mark.parametrize("model, written", [(lambda: StepFilled(skip=4), "copy_"), (ViewReadAfterWrite, "mul_")])
def test_write_outside_the_data_flow_is_refused_by_cutting_plans(model, written):
    """Chunks and shards follow the data flow: a read that sees a write only through the
    mutation is refused naming the write and its line, and plan none (in order) stays exact."""
    with pytest.raises(gs.UnsupportedGraphError) as info:
        gs.compile(model().double(), plan="seco", chunk_size=3)(_x())
    text = str(info.value)
    assert f"(call_function {written}." in text
    assert "test_loop_capture.py" in text and "plan='none'" in text
    assert _max_rel_err(model().double(), _x(), "none") == 0.0


@pytest.mark.parametrize("plan, options", [pytest.param("none", {}, marks=pytest.mark.slow),
                                           ("seco", {"chunk_size": 3}), ("adjoint", {"shard_size": 3}),
                                           pytest.param("truncated_adjoint", {"window": 100, "shard_size": 3},
                                                        marks=pytest.mark.slow)])
def test_step_filled_recurrence_is_exact_under_every_plan(plan, options):
    assert _max_rel_err(StepFilled().double(), _x(), plan, **options) <= 1e-10


def test_float32_accumulation_passes_the_adjoint_self_check():
    """The sharded recompute of a float32 scan rounds like float32: the self-check allows it,
    and the gradient agrees to float32 precision."""
    assert _max_rel_err(StepFilled(acc=torch.float32).double(), _x(), "adjoint", shard_size=3) <= 1e-5


def test_bmm_over_merged_batch_time_rows_keeps_time_apart():
    model = MergedRows().double()
    gm = capture(model, (_x(b=2, T=7, d=6),)).gm
    tl = analyze_time_locality(gm)
    assert tl.seq_len == 7 and set(tl.time_inputs.values()) == {1}
    g = next(n for n in gm.graph.nodes if n.target is aten.sigmoid.default)
    assert tl[g].time_dims == (1,)
    assert _max_rel_err(model, _x(b=2, T=7, d=6), "seco", chunk_size=3) <= 1e-10


def test_state_assigned_in_forward_keeps_no_tracing_tensor():
    model = StepFilled().double()
    cm = gs.compile(model, plan="adjoint", shard_size=3)
    cm(_x())
    assert model.state is None  # the trace's fake tensor was not left on the module
    model(_x())
    assert type(model.state) is torch.Tensor and model.state.shape == (3, 5)
