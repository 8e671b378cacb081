"""Tests for gradshard.measure: exact byte and FLOP counts for computations worked out by hand.

Conventions used in the hand derivations below: ``B`` is the size of one activation tensor in
bytes; a scalar loss ``s = y.sum()`` is one element, and ``backward()`` on it allocates one more
scalar (the ``ones_like`` seed gradient), so ``2 * itemsize`` appears in many peaks. Storages that
exist before the measured step (the leaf ``x``, parameters) are the baseline and never counted.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

from gradshard.measure import (
    CudaPeak,
    LiveSample,
    LiveTensorTracker,
    Measurement,
    StepContractError,
    active_saved_recorders,
    describe_device,
    format_bytes,
    measure,
    step,
)

N = 1000


def _no_instrumentation_left() -> bool:
    """No dispatch mode, saved-tensor hooks, saved recorder or compiler stance remain."""
    return (
        not _get_current_dispatch_mode_stack()
        and torch._dynamo.eval_frame._stance.stance == "default"
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and active_saved_recorders() == []
    )


def _exp_step(x: torch.Tensor) -> None:
    y = x.exp()
    s = y.sum()
    s.backward()


def _sigmoid_chain(
    x: torch.Tensor, segments: int, length: int, use_checkpoint: bool, reentrant: bool = False
) -> None:
    def segment(h: torch.Tensor) -> torch.Tensor:
        for _ in range(length):
            h = torch.sigmoid(h)
        return h

    h = x
    for _ in range(segments):
        h = checkpoint(segment, h, use_reentrant=reentrant) if use_checkpoint else segment(h)
    h.sum().backward()


# ---------------------------------------------------------------------------------------------
# Exact bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_step_exact_bytes(dtype: torch.dtype) -> None:
    x = torch.randn(N, dtype=dtype, requires_grad=True)
    b = N * x.element_size()  # one activation
    e = x.element_size()  # one scalar
    m = measure(_exp_step, x, repeat=0)
    # exp saves its output y (b bytes); sum saves no tensor.
    assert m.saved_bytes == b
    assert m.saved_bytes_total == b
    # Timeline: y = exp(x) -> b; s = y.sum() -> b + e; backward seeds ones_like(s) -> b + 2e;
    # SumBackward expands the seed (a view, +0); ExpBackward computes grad * y -> a new b:
    # 2b + 2e, with y and s still held by the step's locals. That mul output becomes x.grad
    # (AccumulateGrad steals it, no copy). After the step, y, s and the seed are gone and only
    # x.grad remains.
    assert m.peak_bytes == 2 * b + 2 * e
    assert m.tracked_peak_bytes == m.peak_bytes
    assert m.peak_op == "aten.mul.Tensor" and m.peak_phase == "backward"
    # The seed is created by Tensor.backward() before the engine starts: still "forward".
    assert (m.forward_peak_bytes, m.backward_peak_bytes) == (b + 2 * e, 2 * b + 2 * e)
    assert m.allocated_bytes == 2 * b + 2 * e
    assert m.retained_bytes == b
    assert m.flops == 0 and m.peak_source == "tracker" and m.device_type == "cpu"
    assert torch.equal(x.grad, x.detach().exp())


def test_existing_grad_is_baseline() -> None:
    """Accumulating into a .grad that existed before the step adds nothing that survives."""
    x = torch.randn(N, requires_grad=True)
    x.grad = torch.zeros(N)
    m = measure(_exp_step, x, repeat=0)
    # Same transient peak as above (the mul output exists before it is added into x.grad);
    # the accumulation is in place into the pre-existing x.grad, so nothing is retained.
    assert m.peak_bytes == 2 * 4 * N + 2 * 4
    assert m.retained_bytes == 0


def test_views_and_inplace_are_not_double_counted() -> None:
    base = torch.randn(N)  # predates the tracker
    with LiveTensorTracker() as tr:
        a = torch.empty(N)  # +4000
        assert tr.live_bytes == 4 * N
        views = [a.view(10, 100), a[::2], a.view(10, 100).t(), a.unsqueeze(0), a.detach(), a[3:7]]
        a.add_(1.0)
        views[1].mul_(2.0)
        views[0].t_()
        assert tr.live_bytes == 4 * N
        # Views of and in-place ops on a pre-existing tensor allocate nothing.
        base.mul_(2.0)
        base_views = [base.view(2, 500), base[1:], base.expand(3, N)]
        assert tr.live_bytes == 4 * N
        # A new storage of 0 bytes resized by an out= op counts at its new size.
        o = torch.empty(0)
        torch.add(a, a, out=o)  # +4000
        assert tr.live_bytes == 8 * N
        # A constant built outside the dispatcher and lifted in (lift_fresh) is new.
        c = torch.tensor([1.0, 2.0, 3.0])  # +12
        assert tr.live_bytes == 8 * N + 12
        assert tr.owns(a) and tr.owns(views[2]) and tr.owns(c) and not tr.owns(base)
        assert not any(tr.owns(v) for v in base_views)
    assert tr.peak_bytes == 8 * N + 12
    assert tr.allocated_bytes == 8 * N + 12
    del views, base_views, o, c


@pytest.mark.parametrize(
    "make_views",
    [
        lambda t: [torch.ops.aten._unsafe_view(t, [2, 500])],  # emitted by matmul
        lambda t: list(torch.unsafe_split(t, 300)),
        lambda t: list(torch.unsafe_split_with_sizes(t, [100, 900])),
        lambda t: list(torch.unsafe_chunk(t, 3)),
    ],
)
def test_views_whose_schema_claims_fresh_outputs(make_views) -> None:
    """Some aten ops declare fresh outputs yet return views; they must not count."""
    untouched = torch.randn(N)  # predates the tracker; no other op sees it first
    with LiveTensorTracker() as tr:
        views = make_views(untouched)
        assert not any(tr.owns(v) for v in views)
    assert tr.peak_bytes == 0 and len(views) >= 1


def test_frees_lower_live_but_not_peak() -> None:
    outside = torch.empty(N)
    with LiveTensorTracker(timeline=True) as tr:
        a = torch.empty(N)
        b = torch.empty(2 * N)
        tr.mark("both alive")
        del a
        tr.mark("a freed")
        assert tr.live_bytes == 8 * N
        del outside  # predates the tracker: its free is not credited
        tr.mark("outside freed")
        b2 = b * 2  # b is freed by rebinding below, after b2 exists
        b = b2
        del b2
        tr.mark("rebound")
    assert tr.peak_bytes == 16 * N  # a(4N) freed, then b(8N) + b*2(8N)
    assert tr.phase_peak_bytes == {"forward": 16 * N, "backward": 0}
    assert [(s.op, s.live_bytes, s.phase) for s in tr.timeline] == [
        ("aten.empty.memory_format", 4 * N, "forward"),
        ("aten.empty.memory_format", 12 * N, "forward"),
        ("both alive", 12 * N, "mark"),
        ("a freed", 8 * N, "mark"),
        ("outside freed", 8 * N, "mark"),
        ("aten.mul.Tensor", 16 * N, "forward"),
        ("rebound", 8 * N, "mark"),
    ]
    assert all(isinstance(s, LiveSample) for s in tr.timeline)
    assert tr.live_bytes == 8 * N  # b still alive at exit
    del b


def test_backward_ops_and_autograd_frees_are_observed() -> None:
    """The autograd engine's ops go through the mode, and the saved tensors it releases count."""
    x = torch.randn(N, requires_grad=True)
    b = 4 * N
    depth = 3
    with LiveTensorTracker(timeline=True) as tr:
        _sigmoid_chain(x, 1, depth, use_checkpoint=False)
    backward = [s.live_bytes for s in tr.timeline if s.op == "aten.sigmoid_backward.default"]
    assert all(
        s.phase == "backward" for s in tr.timeline if s.op == "aten.sigmoid_backward.default"
    )
    # Forward keeps h1..h3 (each sigmoid saves its output): 3b, then the loss and the seed: +8.
    # Node j (j = 3, 2, 1) runs sigmoid_backward(g_j, h_j) -> a new gradient (b). Alive then:
    # saved h_1..h_j (j*b), h_3 (held by the local `h` when j < 3), the incoming g_j (b, when
    # j < 3; for j = 3 it is the expanded seed), and the new gradient (b), plus 8 bytes.
    # Node j releases h_j and g_j afterwards (autograd frees them), so the count falls again.
    assert backward == [(3 + 1) * b + 8, (2 + 3) * b + 8, (1 + 3) * b + 8]
    assert tr.peak_bytes == 5 * b + 8 and tr.peak_phase == "backward"
    assert tr.backward_ops > 0 and tr.num_ops > tr.backward_ops
    # Everything except x.grad was freed (by autograd or when the locals died).
    assert tr.live_bytes == b
    assert torch.allclose(x.grad, _reference_sigmoid_chain_grad(x, depth))


def _reference_sigmoid_chain_grad(x: torch.Tensor, depth: int) -> torch.Tensor:
    h = x.detach()
    grad = torch.ones_like(h)
    hs = []
    for _ in range(depth):
        h = torch.sigmoid(h)
        hs.append(h)
    for h in reversed(hs):
        grad = grad * h * (1 - h)
    return grad


def test_checkpoint_lowers_peak_by_predicted_amount() -> None:
    """k checkpointed segments of s sigmoids: peak (k+s+1)B+8 instead of (ks+2)B+8."""
    segments, length = 4, 4
    x = torch.randn(N, requires_grad=True)
    b = 4 * N
    plain = measure(_sigmoid_chain, x, segments, length, False, repeat=0)
    grad_plain = x.grad
    x.grad = None
    ckpt = measure(_sigmoid_chain, x, segments, length, True, repeat=0)
    torch.testing.assert_close(x.grad, grad_plain, rtol=0, atol=0)
    n_ops = segments * length
    # Without checkpointing the peak is the first-but-one backward node, as in
    # test_backward_ops_and_autograd_frees_are_observed with j = N-1: (N + 2) b + 8.
    assert plain.peak_bytes == (n_ops + 2) * b + 8
    assert plain.saved_bytes == n_ops * b  # every sigmoid output is saved
    # With checkpointing only segment boundaries survive the forward: b_1..b_{k-1} are saved
    # as inputs of the next segment and b_k is held by the local `h` (k b). Backward of segment
    # k recomputes its s outputs (s b, including a copy of b_k) and its first node allocates a
    # gradient (b); each later node frees one recomputed tensor and one gradient as it
    # allocates one, so the peak is (k + s + 1) b + 8. Earlier segments hold fewer boundaries.
    assert ckpt.peak_bytes == (segments + length + 1) * b + 8
    assert plain.peak_bytes - ckpt.peak_bytes == (segments - 1) * (length - 1) * b
    # Forward: all N outputs plus loss and seed, versus (k - 1) boundaries + two neighbours.
    assert plain.forward_peak_bytes == n_ops * b + 8
    assert ckpt.forward_peak_bytes == (segments + 1) * b
    # Saved for backward: the boundaries b_1..b_{k-1} (activations) and x (baseline).
    assert ckpt.saved_bytes == (segments - 1) * b
    assert ckpt.saved_bytes_total == segments * b
    # Recomputation happens inside the autograd engine, so its ops count as backward ops.
    assert ckpt.backward_ops > plain.backward_ops
    assert plain.retained_bytes == ckpt.retained_bytes == b

    # Reentrant checkpointing saves the same boundaries (via ctx.save_for_backward); the saves
    # its recomputation makes inside backward are not "saved by the forward" and do not count.
    x.grad = None
    reentrant = measure(_sigmoid_chain, x, segments, length, True, True, repeat=0)
    torch.testing.assert_close(x.grad, grad_plain, rtol=0, atol=0)
    assert reentrant.saved_bytes == (segments - 1) * b
    assert reentrant.saved_bytes_total == segments * b
    # Its peak is one b higher: CheckpointFunction.backward keeps the recomputed outputs in a
    # local while it runs the inner backward, so the first recomputed tensor is not freed when
    # its node has run; the second node of segment k peaks at (k + s + 2) b + 8.
    assert reentrant.peak_bytes == (segments + length + 2) * b + 8


# ---------------------------------------------------------------------------------------------
# FLOPs and a small model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b_requires_grad", [True, False])
def test_matmul_flops_split(b_requires_grad: bool) -> None:
    m_, k_, n_ = 3, 5, 7
    a = torch.randn(m_, k_, dtype=torch.float64, requires_grad=True)
    b = torch.randn(k_, n_, dtype=torch.float64, requires_grad=b_requires_grad)
    meas = measure(lambda a, b: (a @ b).sum().backward(), a, b, repeat=0)
    grads = 2 if b_requires_grad else 1  # dA = dC B^T, dB = A^T dC: one mm each
    assert meas.forward_flops == 2 * m_ * n_ * k_
    assert meas.backward_flops == grads * 2 * m_ * n_ * k_
    assert meas.flops == (1 + grads) * 2 * m_ * n_ * k_
    assert meas.flops_by_op == (("aten.mm", meas.flops),)


def test_mlp_saved_flops_and_gradients() -> None:
    torch.manual_seed(0)
    m_, k_, n_, o_ = 3, 5, 7, 2
    x = torch.randn(m_, k_)  # an input that does not require grad
    net = torch.nn.Sequential(torch.nn.Linear(k_, n_), torch.nn.ReLU(), torch.nn.Linear(n_, o_))
    meas = measure(step(lambda x: net(x).sum()), x, repeat=0)
    # Saved: the first addmm saves x (for dW1; baseline); relu saves its output r (m*n floats);
    # the second addmm saves r again (same storage, counted once) and W2^T (a parameter view).
    assert meas.saved_bytes == m_ * n_ * 4
    assert meas.saved_bytes_total == m_ * n_ * 4 + x.numel() * 4 + n_ * o_ * 4
    # Forward: two addmm. Backward: dW2 and dr (two mm of m*n*o), dW1 (one mm of m*k*n);
    # no dx because x does not require grad.
    assert meas.forward_flops == 2 * m_ * k_ * n_ + 2 * m_ * n_ * o_
    assert meas.backward_flops == 2 * (2 * m_ * n_ * o_) + 2 * m_ * k_ * n_
    # Every parameter gradient is new and survives the step.
    assert meas.retained_bytes == sum(p.numel() * 4 for p in net.parameters())


# ---------------------------------------------------------------------------------------------
# Robustness: nesting, exceptions, contract, options
# ---------------------------------------------------------------------------------------------


def test_nested_measure() -> None:
    x = torch.randn(N, requires_grad=True)
    b = 4 * N
    inner: list[Measurement] = []
    outer = measure(lambda: inner.append(measure(_exp_step, x, repeat=1)), repeat=0)
    # The inner measurement is unaffected by the outer one.
    assert inner[0].peak_bytes == 2 * b + 8 and inner[0].saved_bytes == b
    assert inner[0].retained_bytes == b and len(inner[0].seconds_all) == 1
    # The outer step ran the exp step twice. The first call leaves x.grad (b, new to the
    # outer tracker); the second accumulates into it, peaking at x.grad + (2b + 8).
    assert outer.peak_bytes == b + 2 * b + 8
    assert outer.retained_bytes == b
    # Two distinct exp outputs were saved (the second may reuse the first's freed address).
    assert outer.saved_bytes == 2 * b
    assert _no_instrumentation_left()


def test_exception_in_step_restores_state() -> None:
    x = torch.randn(N, requires_grad=True)

    def failing(x: torch.Tensor) -> None:
        x.exp().sum().backward()
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        measure(failing, x, repeat=0)
    assert _no_instrumentation_left()
    with pytest.raises(KeyError, match="boom"):
        measure(lambda: measure(failing, x, repeat=0), repeat=0)
    assert _no_instrumentation_left()
    x.grad = None
    again = measure(_exp_step, x, repeat=0)
    assert again.peak_bytes == 8 * N + 8 and again.saved_bytes == 4 * N

    with pytest.raises(ValueError, match="inside"):
        with LiveTensorTracker():
            raise ValueError("inside")
    assert _no_instrumentation_left()


def test_step_contract() -> None:
    x = torch.randn(N, requires_grad=True)
    with pytest.raises(StepContractError, match="no backward pass ran"):
        measure(lambda x: x.exp().sum(), x, repeat=0)
    assert _no_instrumentation_left() and x.grad is None
    via_helper = measure(step(lambda x: x.exp().sum()), x, repeat=0)
    x.grad = None
    manual = measure(_exp_step, x, repeat=0)
    assert via_helper.peak_bytes == manual.peak_bytes
    assert via_helper.saved_bytes == manual.saved_bytes
    assert measure.step is step and measure.LiveTensorTracker is LiveTensorTracker
    # Forward only: return nothing that requires grad. y (4N) + s (4) are live together.
    fwd = measure(lambda x: x.exp().sum().detach(), x, repeat=0)
    assert fwd.backward_ops == 0 and fwd.peak_bytes == 4 * N + 4 and fwd.saved_bytes == 4 * N
    # Measuring must not keep the never-backpropagated graph (and y) alive.
    assert fwd.retained_bytes == 0
    with pytest.raises(ValueError, match="scalar loss"):
        step(lambda x: x * 2)(x)
    with pytest.raises(ValueError, match="does not require grad"):
        step(lambda x: x.detach().sum())(x)
    with pytest.raises(TypeError, match="not a tensor"):
        step(lambda x: 3.0)(x)


def test_warmup_repeat_and_kwargs() -> None:
    calls: list[int] = []

    def counted(x: torch.Tensor, *, scale: float) -> None:
        calls.append(1)
        (x * scale).sum().backward()

    x = torch.randn(7, requires_grad=True)
    m = measure(counted, x, warmup=2, repeat=3, scale=2.0)
    assert len(calls) == 2 + 1 + 3
    assert len(m.seconds_all) == 3 and m.seconds == sorted(m.seconds_all)[1] and m.seconds > 0
    torch.testing.assert_close(x.grad, torch.full((7,), 12.0))
    none = measure(counted, x, repeat=0, scale=1.0)
    assert none.seconds is None and none.seconds_all == ()
    with pytest.raises(ValueError, match="warmup and repeat"):
        measure(counted, x, repeat=-1, scale=1.0)


def test_device_filter_and_inference() -> None:
    x = torch.randn(N, requires_grad=True)

    def with_meta(x: torch.Tensor) -> None:
        torch.empty(10 * N, device="meta")
        _exp_step(x)

    assert measure(with_meta, x, repeat=0).peak_bytes == 8 * N + 8
    with LiveTensorTracker(device="meta") as tr:
        keep = torch.empty(10, device="meta")
        torch.empty(N)
    assert tr.peak_bytes == 40 and tr.live_bytes == 40
    del keep
    m = measure(lambda: None, repeat=0)
    assert m.device.startswith("cpu") and m.peak_bytes == 0 and m.peak_op is None


def test_tracker_is_single_use_and_resets_peak() -> None:
    tr = LiveTensorTracker()
    with tr:
        a = torch.empty(N)
        del a
        assert tr.peak_bytes == 4 * N
        tr.reset_peak()
        b = torch.empty(N // 2)
        assert tr.peak_bytes == 2 * N and tr.peak_op == "aten.empty.memory_format"
        assert tr.phase_peak_bytes["forward"] == 2 * N
    del b
    with pytest.raises(RuntimeError, match="single-use"):
        with tr:
            pass
    assert _no_instrumentation_left()


def test_summary_rendering() -> None:
    x = torch.randn(N, requires_grad=True)
    m = measure(_exp_step, x)
    text = str(m)
    assert "peak 7.82 KiB" in text and "saved 3.91 KiB" in text and "cpu" in text  # 8008 B
    assert format_bytes(1023) == "1023 B" and format_bytes(1536) == "1.5 KiB"
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(m)
    rendered = console.export_text()
    assert "saved" in rendered and "aten.mul.Tensor" in rendered
    assert json.loads(json.dumps(m.to_dict()))["peak_bytes"] == m.peak_bytes


# ---------------------------------------------------------------------------------------------
# Invariant: the tracker's live count equals the distinct storages actually held
# ---------------------------------------------------------------------------------------------

_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["new", "view", "inplace", "binary", "del", "cat"]), st.integers(0, 7)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(_ACTIONS)
def test_live_bytes_match_held_storages(actions: list[tuple[str, int]]) -> None:
    preexisting = [torch.randn(5), torch.randn(3, 4)]
    with LiveTensorTracker() as tr:
        held: list[torch.Tensor] = list(preexisting)
        for action, i in actions:
            pick = held[i % len(held)]
            if action == "new":
                held.append(torch.empty(i + 1, dtype=torch.float64 if i % 2 else torch.float32))
            elif action == "view":
                held.append(pick.view(-1)[i % pick.numel() :])
            elif action == "inplace":
                pick.add_(1)
            elif action == "binary":
                held.append(pick * 2)
            elif action == "cat":
                held.append(torch.cat([pick.reshape(-1), held[-1].reshape(-1).to(pick.dtype)]))
            elif action == "del" and len(held) > 1:
                held.pop(i % len(held))
            del pick  # hold references only through `held`
            distinct = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}
            pre = {t.untyped_storage()._cdata for t in preexisting}
            assert tr.live_bytes == sum(n for k, n in distinct.items() if k not in pre)
        del held


# ---------------------------------------------------------------------------------------------
# CUDA allocator peak under nesting (allocator simulated; no GPU needed)
# ---------------------------------------------------------------------------------------------


def test_cuda_peak_survives_nested_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"allocated": 100, "peak": 100}

    def alloc(n: int) -> None:
        state["allocated"] += n
        state["peak"] = max(state["peak"], state["allocated"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda device=None: state.update(peak=state["allocated"]),
    )
    dev = torch.device("cuda", 0)
    with CudaPeak(dev) as outer:
        alloc(50)
        alloc(-50)
        with CudaPeak(dev) as inner:  # resets the global peak, erasing the outer's 150
            alloc(30)
            alloc(-40)
        alloc(5)
    assert inner.peak_bytes == 30
    assert outer.peak_bytes == 50
    assert CudaPeak._stack == []
    assert describe_device("cpu").startswith("cpu (")


def test_compiled_step_stays_compiled_when_measured() -> None:
    graph_calls: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            graph_calls.append(1)
            return gm(*args)

        return run

    loss_fn = torch.compile(lambda x: x.exp().sum(), backend=counting_backend)
    x = torch.randn(N, requires_grad=True)
    loss_fn(x).backward()  # compile outside the measurement
    x.grad = None
    assert len(graph_calls) == 1
    m = measure(step(loss_fn), x, repeat=2)
    # The instrumented call and the two timed calls all ran the compiled graph, as does a later
    # call: nothing was switched to eager or marked "skip".
    assert len(graph_calls) == 4 and m.compiled_regions == 1
    loss_fn(x)
    assert len(graph_calls) == 5
    # This backend runs the captured graph op by op, so the allocator (which gives the peak once
    # compiled code ran) and the tracker count the same storages as the eager exp step.
    assert m.peak_source == "cpu_allocator"
    assert m.peak_bytes == m.tracked_peak_bytes == 8 * N + 8 and m.saved_bytes == 4 * N
    assert m.retained_bytes == 4 * N and _no_instrumentation_left()


def test_flops_match_flop_counter_mode() -> None:
    """Same formulas as FlopCounterMode, op by op, on a mix of matmuls and convolutions."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 10)
    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    x, img = torch.randn(2, 7, 6), torch.randn(2, 3, 9, 11)
    bias = torch.randn(2, 7, 7, requires_grad=True)

    def mixed_step() -> None:
        h = lin(x)  # 3-D input: addmm on a flattened view
        a = torch.bmm(h, h.transpose(1, 2))
        b = torch.baddbmm(bias, h, h.transpose(1, 2))
        c = conv(img).mean()
        e = torch.einsum("bij,bjk->bik", a, b)  # bmm
        (e.sum() + c).backward()

    m = measure(mixed_step, repeat=0)
    with FlopCounterMode(display=False) as reference:
        mixed_step()
    expected = {str(op): n for op, n in reference.get_flop_counts()["Global"].items() if n}
    assert dict(m.flops_by_op) == expected
    assert m.flops == reference.get_total_flops() > 0
    assert m.forward_flops + m.backward_flops == m.flops and m.backward_flops > m.forward_flops


def test_fused_cpu_attention_flops() -> None:
    b_, h_, sq, sk, d, dv = 2, 3, 5, 7, 4, 4  # the fused kernel needs equal head sizes
    q = torch.randn(b_, h_, sq, d, requires_grad=True)
    k = torch.randn(b_, h_, sk, d, requires_grad=True)
    v = torch.randn(b_, h_, sk, dv, requires_grad=True)
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    m = measure(lambda: attention(q, k, v)[0].sum().backward(), repeat=0)
    # torch's attention formulas: forward = scores q k^T and p v; backward = the scores again
    # (flash kernels recompute them), then dp = g v^T, dv = p^T g, dq = ds k, dk = ds^T q.
    assert m.forward_flops == 2 * b_ * h_ * sq * sk * (d + dv)
    assert m.backward_flops == 2 * b_ * h_ * sq * sk * (3 * d + 2 * dv)


def test_higher_order_op_runs_below_the_tracker() -> None:
    x = torch.randn(4, 8)

    def branchy(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x.sin() @ x.T, lambda x: x.cos() @ x.T, (x,))

    with LiveTensorTracker(timeline=True) as tr:
        out = branchy(x)
    # x.sum() (4 B, freed once the comparison exists) > 0 (1 B bool, alive while cond runs);
    # the cond output (4 x 4 float32) is observed, the branch's sin/cos temporaries are not.
    assert [(s.op, s.live_bytes) for s in tr.timeline] == [
        ("aten.sum.default", 4),
        ("aten.gt.Scalar", 5),
        ("cond", 1 + 64),
    ]
    assert tr.live_bytes == 64 and out.numel() * 4 == 64
    del out


def test_trackers_on_overlapping_threads_restore_the_compile_stance() -> None:
    """set_stance is process-wide: trackers entered and left in interleaved order on several
    threads must leave torch.compile working afterwards (not stuck in force_eager)."""
    import threading

    inside = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]

    def body(i: int) -> None:
        with LiveTensorTracker():
            inside[i].set()
            assert leave[i].wait(timeout=30)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    threads[0].start()
    assert inside[0].wait(timeout=30)  # thread 0 enters first ...
    threads[1].start()
    assert inside[1].wait(timeout=30)
    for i in range(2):  # ... and leaves first
        leave[i].set()
        threads[i].join(timeout=30)
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(1)
        return gm.forward

    torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.randn(3))
    assert seen == [1]


def test_gs_measure_stays_the_function_after_importing_the_submodule() -> None:
    import gradshard as gs
    import gradshard.measure  # noqa: F401 - binds the submodule attribute on first import

    assert callable(gs.measure) and gs.measure is measure
