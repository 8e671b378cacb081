"""seco/spaco serve a new sequence length from the graph captured at the probe length (issue 17).

A first call longer than twice the probe (67 steps) is compiled at the probe and served by
re-specialising the length-generic graph (``gradshard.plans.length_generic``), verified
by fake-shape propagation and, once, against a real capture one step longer. Gradients are
checked against eager autograd in float64 at the probe length and at a longer odd length.
"""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
import gradshard.api as api
import gradshard.capture as capture_pkg
from chunk_testing import grads, rel_err
from chunked_models import CachedRoPEAttention, TokenShift
from examples.factories import llama, llama_loss, ssm_loop
from gradshard.plans import length_generic
from gradshard.plans.length_generic import PROBE_LENGTH

TOL = 1e-10
LONG = 151  # odd, longer than twice the probe: a first call at this length compiles at the probe


@pytest.fixture
def captured_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The time length (dim 1 of the first input of rank >= 2) of every capture."""
    seen: list[int] = []
    real = capture_pkg.capture

    def counting(target, args, kwargs=None, **kw):
        leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                  if isinstance(x, torch.Tensor) and x.dim() >= 2]
        seen.append(int(leaves[0].shape[1]) if leaves else -1)
        return real(target, args, kwargs, **kw)

    monkeypatch.setattr(api, "capture", counting)
    monkeypatch.setattr(capture_pkg, "capture", counting)
    return seen


def _check_exact(cm: gs.CompiledModule, model: torch.nn.Module, inputs: tuple) -> None:
    out, ref = cm(*inputs), model(*inputs)
    assert (out - ref).abs().max() <= 1e-12 * max(1.0, ref.abs().max().item())
    cot = torch.randn_like(ref)
    wrt = list(model.parameters())
    assert rel_err(grads(ref, wrt, cot), grads(out, wrt, cot)) <= TOL


def _served_from_probe(cm: gs.CompiledModule) -> None:
    assert cm.current.extras.get("respecialized_from") == PROBE_LENGTH, cm.explain()
    assert "respecialize_length" in [r.name for r in cm.passes]


@pytest.mark.parametrize("plan", ["seco", "spaco"])
def test_llama_long_first_call_compiles_at_the_probe(plan: str, captured_lengths: list[int]) -> None:
    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=LONG, batch=2, dtype=torch.float64)
    # spaco with a budget above the 10 chunks keeps every chunk with factor 1: exact
    cm = gs.compile(model, plan=plan, chunk_size=16, **({"budget": 100} if plan == "spaco" else {}))
    _check_exact(cm, model, (ids,))
    _served_from_probe(cm)
    assert captured_lengths == [PROBE_LENGTH, PROBE_LENGTH + 1]  # the probe, then the one cross-check
    assert cm.graph.get_submodule(f"{plan}_0").program.num_chunks == 10  # planned at T=151


def test_served_length_and_probe_length_are_exact_on_a_loop_written_model(captured_lengths: list[int]) -> None:
    """A per-step Python loop is unrolled 67 steps at capture and served rolled at 151 and 97."""
    torch.manual_seed(0)
    model, (ids,) = ssm_loop(seq_len=LONG, batch=2, d_model=16, n_layers=1, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=16)
    _check_exact(cm, model, (ids[:, :PROBE_LENGTH],))  # at the probe length: captured there
    assert "respecialized_from" not in cm.current.extras
    _check_exact(cm, model, (ids,))  # T=151: served from the probe's graph
    _served_from_probe(cm)
    _check_exact(cm, model, (ids[:, :97],))  # another length: served again, checked once only
    _served_from_probe(cm)
    assert captured_lengths == [PROBE_LENGTH, PROBE_LENGTH + 1]


def test_a_loss_function_with_labels_is_served(captured_lengths: list[int]) -> None:
    torch.manual_seed(0)
    fn, (model, (ids, labels)) = llama_loss(seq_len=LONG, batch=2, dtype=torch.float64)
    model = model.double()
    cm = gs.compile(fn, plan="seco", chunk_size=32)
    loss, ref = cm(model, (ids, labels)), fn(model, (ids, labels))
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    wrt = list(model.parameters())
    assert rel_err(grads(ref, wrt), grads(loss, wrt)) <= TOL
    _served_from_probe(cm)
    assert captured_lengths == [PROBE_LENGTH, PROBE_LENGTH + 1]


class CachedRoPELM(torch.nn.Module):
    """Older-HF style attention (cos/sin buffers of ``max_len`` rows sliced ``[:T]``) + token shift."""

    def __init__(self, d: int = 16, max_len: int = 200) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([CachedRoPEAttention(d, 4, 2, max_len=max_len), TokenShift(d)])
        self.head = torch.nn.Linear(d, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_table_cut_to_the_sequence_length_is_served() -> None:
    """``cos_cached[:t]`` (a buffer sliced to T) re-specialises to the new length."""
    torch.manual_seed(0)
    model = CachedRoPELM().double()
    x = torch.randn(2, LONG, 16, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=16)
    _check_exact(cm, model, (x,))
    _served_from_probe(cm)


def test_a_failed_cross_check_captures_at_the_call_length(monkeypatch: pytest.MonkeyPatch,
                                                          captured_lengths: list[int]) -> None:
    monkeypatch.setattr(length_generic, "_same_values", lambda want, got: False)
    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=LONG, batch=2, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=32)
    _check_exact(cm, model, (ids,))
    assert "respecialized_from" not in cm.current.extras
    assert captured_lengths == [PROBE_LENGTH, PROBE_LENGTH + 1, LONG]


def test_a_refused_respecialisation_captures_at_the_call_length(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise length_generic.RespecializeError("node `x` has shape (2, 3) at length 151, expected (2, 151)")

    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=LONG, batch=2, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=32)
    cm(ids[:, :PROBE_LENGTH])
    monkeypatch.setattr(length_generic, "respecialize", refuse)
    _check_exact(cm, model, (ids,))
    assert "respecialized_from" not in cm.current.extras


def test_the_shape_verification_refuses_a_table_too_short_for_the_new_length() -> None:
    """A table cut to T that holds fewer rows than the new T: fake-shape propagation refuses."""
    from gradshard.passes.respecialize import RespecializeError

    torch.manual_seed(0)
    model = CachedRoPELM().double()
    x = torch.randn(2, PROBE_LENGTH, 16, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=16)
    cm(x)
    lg = cm.current.ctx.plan_state["length_generic"]
    rows = model.layers[0].cos_cached.shape[0]
    with pytest.raises(RespecializeError, match="shape"):
        length_generic.respecialize(lg.graph, lg.facts, lg.seq_len, rows + 1, strict_scalars=True)


def test_a_shorter_call_after_a_longer_one_is_served_exactly(captured_lengths: list[int]) -> None:
    """Compiled at T=48, then called at 37 (shorter: the cross-check captures at the call's own
    length, not at 47, which the inputs do not hold) and at 53."""
    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=48, batch=2, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=8)
    for T in (48, 37, 53):
        x = ids[:, :T] if T <= 48 else torch.cat([ids, ids[:, : T - 48]], 1)
        _check_exact(cm, model, (x,))
    assert captured_lengths == [48, 37]  # the first compile, the one cross-check; 37 and 53 served


@pytest.fixture
def captured_sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(batch, time length) of the first input of rank >= 2 of every capture."""
    seen: list[tuple[int, int]] = []
    real = capture_pkg.capture

    def counting(target, args, kwargs=None, **kw):
        leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                  if isinstance(x, torch.Tensor) and x.dim() >= 2]
        seen.append(tuple(int(s) for s in leaves[0].shape[:2]))
        return real(target, args, kwargs, **kw)

    monkeypatch.setattr(api, "capture", counting)
    monkeypatch.setattr(capture_pkg, "capture", counting)
    return seen


@pytest.mark.parametrize("plan", ["seco", "none"])
def test_another_batch_size_is_served_from_the_probe(plan: str, captured_sizes: list[tuple[int, int]]) -> None:
    """A graph captured at batch 3 serves batches 5 and 2 (and new lengths with them): the
    batch dims are re-specialised like the time dims, checked once per kind of change against
    a real capture one row (and step) larger. Exact against eager at every call."""
    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=LONG, batch=5, dtype=torch.float64)
    cm = gs.compile(model, plan=plan, **({"chunk_size": 16} if plan == "seco" else {}))
    for B, T in [(3, LONG), (5, LONG), (2, 100), (5, PROBE_LENGTH)]:
        _check_exact(cm, model, (ids[:B, :T],))
        _served_from_probe(cm)
        assert cm.current.extras.get("batch", 3) == B
    # the probe; the length check; the length-and-batch check (its verdict also serves (2, 100));
    # the batch-only check at the probe length
    assert captured_sizes == [(3, PROBE_LENGTH), (3, PROBE_LENGTH + 1), (4, PROBE_LENGTH + 1), (4, PROBE_LENGTH)]
    assert f"serving T={PROBE_LENGTH}, batch 5: the program compiled at T={PROBE_LENGTH}, batch 3" in cm.explain()


def test_a_batch_of_one_is_a_guard(captured_sizes: list[tuple[int, int]]) -> None:
    """A batch of one cannot be told from a broadcast dim: a graph captured there serves other
    lengths at batch 1 only, and a new batch compiles a new probe."""
    torch.manual_seed(0)
    model, (ids,) = llama(seq_len=LONG, batch=2, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=16)
    _check_exact(cm, model, (ids[:1],))
    lg = cm.current.ctx.plan_state["length_generic"]
    assert lg.batch is None and lg.batch_inputs == {}
    _check_exact(cm, model, (ids,))
    _served_from_probe(cm)
    assert captured_sizes == [(1, PROBE_LENGTH), (1, PROBE_LENGTH + 1), (2, PROBE_LENGTH), (2, PROBE_LENGTH + 1)]
