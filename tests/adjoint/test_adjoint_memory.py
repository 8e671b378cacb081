"""What plan="adjoint" keeps: layer inputs, state checkpoints, and nothing more (float64).

Layer 0's input (the token embedding) is recomputed from the ids; the time-local tail after
the last recurrence (final norm + LM head) keeps only its input and is recomputed in shards
in the backward (``tail_0``). Saved bytes are checked exactly; gradients to 1e-10.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs
from examples.models.ssm import SCANS, LoopSSMLM, SelectiveSSMLM, SSMConfig
from gradshard.plans.adjoint.runtime import AdjointRegion

from .helpers import assert_same_grads
from .models import DiagonalSSM, init_like_training

CFG = dict(vocab_size=37, d_model=8, d_state=3)


def _lm(layers: int = 3, **extra) -> SelectiveSSMLM:
    torch.manual_seed(0)
    return SelectiveSSMLM(SSMConfig(**CFG, n_layers=layers, scan="gradshard", **extra)).double()


def _saved_bytes(model: nn.Module, run, ids: torch.Tensor) -> int:
    shape = (*ids.shape, CFG["vocab_size"]) if not ids.dtype.is_floating_point else ids.shape  # logits, or y -> y
    w = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def step(ids: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        (run(ids) * w).sum().backward()  # the loss saves nothing the step allocates

    step(ids)
    return gs.measure(step, ids).saved_bytes


def _regions(cm, kind: str) -> list:
    return [r for r in cm.regions if r.kind == kind]


@pytest.mark.parametrize("batch,T,shard", [(2, 40, 8), (1, 37, 5)])
def test_lm_saves_only_layer_inputs_tail_input_and_checkpoints(batch, T, shard):
    layers, P, N = 3, CFG["d_model"], CFG["d_state"]
    model = _lm(layers)
    cm = gs.compile(model, plan="adjoint", shard_size=shard)
    ids = torch.randint(0, CFG["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(T))
    saved = _saved_bytes(model, cm, ids)
    n_ckpt = -(-T // shard) - 1
    # inputs of layers 1..K-1 and of the tail (the residual stream after the last layer);
    # layer 0's input is recomputed from the ids; plus K * n_ckpt states (B, N, P)
    want = layers * batch * T * P * 8 + layers * n_ckpt * batch * N * P * 8
    assert saved == want, (saved, want)
    (tail,) = _regions(cm, "local_recompute")
    assert any("linear" in n for n in tail.nodes) and any("rsqrt" in n for n in tail.nodes), tail.nodes
    # the layer's residual add joins the region (one output as wide as the model, not two), so
    # the embedding's only reader is in it: the region reads the ids and the table
    region0 = next(r for r in _regions(cm, "linear_recurrence") if r.name == "adjoint_0")
    assert any(n.startswith("embedding") for n in region0.nodes), region0.nodes
    plain = _saved_bytes(model, gs.compile(model, plan="none"), ids)
    assert plain > 4 * saved


_DECAYS = {"diagonal": {}, "scalar": {"n_heads": 2, "conv_kernel": 4}}


@pytest.mark.parametrize("decay", sorted(_DECAYS))
@pytest.mark.parametrize("scan", [*SCANS, "loop"])
def test_every_scan_form_saves_only_layer_inputs_and_checkpoints(scan, decay):
    """Vectorised scans fold the learned h0 into the first input (``u[:, :1] + a[:, :1] * h0``);
    the region must still pull u's producers in and keep x (B, T, P), not u (B, T, N, P)."""
    layers, batch, T, shard, P, N = 2, 2, 24, 8, CFG["d_model"], CFG["d_state"]
    torch.manual_seed(0)
    config = SSMConfig(**CFG, n_layers=layers, decay=decay, learn_initial_state=True,
                       scan="gradshard" if scan == "loop" else scan, **_DECAYS[decay])
    model = (LoopSSMLM if scan == "loop" else SelectiveSSMLM)(config).double()
    cm = gs.compile(model, plan="adjoint", shard_size=shard)
    ids = torch.randint(0, CFG["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(3))
    saved = _saved_bytes(model, cm, ids)
    n_ckpt = -(-T // shard) - 1
    want = layers * batch * T * P * 8 + layers * n_ckpt * batch * N * P * 8  # as in the test above
    assert saved == want, (scan, decay, saved, want)
    vals = {n.name: n.meta.get("val") for n in cm.graph.graph.nodes}
    for r in _regions(cm, "linear_recurrence"):  # no region reads u or a (N times the layer input)
        sizes = {x: vals[x].numel() for x in r.inputs if isinstance(vals.get(x), torch.Tensor)}
        assert max(sizes.values()) <= batch * T * P, (r.name, sizes)


@pytest.mark.parametrize("scan", ["cumprod", "associative"])
def test_folded_initial_state_keeps_what_the_kernel_form_keeps(scan):
    def saved(form: str) -> int:
        model = init_like_training(DiagonalSSM(d=6, n=4, layers=2, conv=True, h0=True, heads=2, scan=form))
        y = torch.randn(3, 19, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        return _saved_bytes(model, gs.compile(model, plan="adjoint", shard_size=5), y)

    assert saved(scan) == saved("gradshard")


@pytest.mark.parametrize("plan,opts", [("adjoint", {"shard_size": 4}), ("truncated_adjoint", {"window": 64, "shard_size": 4})])
@pytest.mark.parametrize("batch", [1, 3])
def test_lm_gradients_exact_with_recomputed_embedding_and_tail(plan, opts, batch):
    model = _lm(2, learn_initial_state=True)
    ids = torch.randint(0, CFG["vocab_size"], (batch, 13), generator=torch.Generator().manual_seed(batch))
    cm = assert_same_grads(model, (ids,), plan=plan, **opts)
    assert len(_regions(cm, "local_recompute")) == 1


def test_no_tail_when_autograd_keeps_nothing_after_the_last_layer():
    model = init_like_training(DiagonalSSM(d=5, n=3, layers=2, scan="gradshard"))
    y = torch.randn(2, 11, 5, dtype=torch.float64)
    cm = assert_same_grads(model, (y,), shard_size=4)
    assert _regions(cm, "local_recompute") == []  # the tail is `y + readout`: nothing to drop


class _TailLM(nn.Module):
    """An SSM LM whose head mixes pointwise ops with a mean over time and returns two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _lm(2)
        self.proj = nn.Linear(CFG["d_model"], CFG["d_model"]).double()

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lm = self.lm
        y = lm.embed(ids)
        for layer in lm.layers:
            y = layer(y)
        z = F.gelu(self.proj(lm.norm_f(y)))
        logits = lm.lm_head(z - z.mean(dim=1, keepdim=True))  # reads every step
        return logits.reshape(-1, logits.shape[-1]), torch.tanh(z)


@pytest.mark.parametrize("batch", [1, 3])
def test_tail_stops_at_ops_that_are_not_pointwise_in_time(batch):
    model = _TailLM()
    ids = torch.randint(0, CFG["vocab_size"], (batch, 15), generator=torch.Generator().manual_seed(2))
    cm = assert_same_grads(model, (ids,), shard_size=4)
    (tail,) = _regions(cm, "local_recompute")
    assert any(n.startswith("gelu") for n in tail.nodes) and any(n.startswith("tanh") for n in tail.nodes), tail.nodes
    # the mean over time, what reads it (sub, lm_head) and the batch-time reshape stay outside
    assert [n for n in tail.nodes if n.startswith("linear")] == [next(n for n in tail.nodes if n.startswith("linear"))]
    assert not any(n.startswith(("sub", "view", "reshape")) for n in tail.nodes), tail.nodes
    assert len(tail.outputs) == 2  # z (read by the mean) and tanh(z)


class _DropoutTail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = _lm(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        y = lm.layers[0](lm.embed(ids))
        return lm.lm_head(F.dropout(lm.norm_f(y), p=0.5, training=True))


def test_random_ops_are_never_recomputed():
    model = _DropoutTail()
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    cm(torch.randint(0, CFG["vocab_size"], (2, 9)))
    nodes = [n for t in _regions(cm, "local_recompute") for n in t.nodes]
    assert not any("dropout" in n or "bernoulli" in n for n in nodes), nodes


@pytest.mark.parametrize("h0", [pytest.param(False, marks=pytest.mark.slow), True])
def test_loop_stacking_its_states_saves_what_the_kernel_form_saves(h0):
    """``hs.append(h)`` in the loop and the readout (``einsum(c, stack(hs))``) after it: the stacked
    states are the scan's output, so the readout joins the region and h (B, T, N, P) is not kept."""
    def compiled(form: str):
        model = init_like_training(DiagonalSSM(d=6, n=4, layers=2, h0=h0, scan=form))
        return model, gs.compile(model, plan="adjoint", shard_size=16)

    y = torch.randn(2, 64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (loop, cm), (kernel, cm_kernel) = compiled("loop"), compiled("gradshard")
    assert _saved_bytes(loop, cm, y) == _saved_bytes(kernel, cm_kernel, y)
    for r in _regions(cm, "linear_recurrence"):  # the readout is inside: the region returns (B, T, P)
        assert any(n.startswith("einsum") for n in r.nodes), r.nodes
    assert_same_grads(init_like_training(DiagonalSSM(d=5, n=3, layers=2, h0=h0, scan="loop")),
                      (torch.randn(3, 13, 5, dtype=torch.float64),), shard_size=4)


def _scan_loop_stacking_a_transformed_state(a, u, h0):
    h = h0 if h0 is not None else torch.zeros_like(u[:, 0])
    hs = []
    for t in range(u.shape[1]):
        h = a[:, t] * h + u[:, t]
        hs.append(2 * h)
    return torch.stack(hs, 1) / 2


def test_loop_stacking_a_transformed_state_saves_what_the_kernel_form_saves():
    """``hs.append(2 * h)``: the rolled readout body keeps h's state dims (dims analysis of the
    body), so the readout after the loop joins the region and (B, T, N, P) is not kept."""
    def compiled(**kw):
        model = init_like_training(DiagonalSSM(d=6, n=4, layers=2, **kw))
        return model, gs.compile(model, plan="adjoint", shard_size=16)

    y = torch.randn(2, 64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    (loop, cm), (kernel, cm_kernel) = compiled(scan_fn=_scan_loop_stacking_a_transformed_state), compiled(scan="gradshard")
    assert _saved_bytes(loop, cm, y) == _saved_bytes(kernel, cm_kernel, y)
    assert _regions(cm, "local_recompute") == []
    assert_same_grads(init_like_training(DiagonalSSM(d=5, n=3, layers=2, h0=True,
                                                     scan_fn=_scan_loop_stacking_a_transformed_state)),
                      (torch.randn(3, 13, 5, dtype=torch.float64),), shard_size=4)


class _SSMWithMLP(DiagonalSSM):
    """SSM layers interleaved with MLP blocks (``y + W2 gelu(W1 norm(y))``), a common hybrid layout."""

    def __init__(self, hidden: int = 32, **kw) -> None:
        super().__init__(**kw)
        self.up = nn.ModuleList(nn.Linear(self.d, hidden) for _ in self.A)
        self.down = nn.ModuleList(nn.Linear(hidden, self.d) for _ in self.A)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.A)):
            y = self.layer(i, y)
            y = y + self.down[i](F.gelu(self.up[i](F.layer_norm(y, (self.d,)))))
        return y


@pytest.mark.parametrize("layers", [2, 3])
def test_mlp_blocks_between_recurrences_are_recomputed_in_shards(layers):
    """Each MLP block (between two SSM layers, and after the last) runs as its own segment that
    keeps only its input: saved bytes are the layer inputs, the checkpoints and one block input
    per MLP, where plain autograd keeps the MLP's hidden activations."""
    model = init_like_training(_SSMWithMLP(d=6, n=4, layers=layers, scan="gradshard"))
    batch, T, shard, d, n = 2, 40, 8, 6, 4
    y = torch.randn(batch, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    cm = assert_same_grads(model, (y,), shard_size=shard)
    segments = _regions(cm, "local_recompute")
    assert len(segments) == layers
    assert all(sum(x.startswith("gelu") for x in s.nodes) == 1 for s in segments)
    saved = _saved_bytes(model, cm, y)
    n_ckpt = -(-T // shard) - 1
    layer_inputs = (layers - 1) * batch * T * d * 8  # layer 0's is the caller's tensor y
    block_inputs = layers * batch * T * d * 8  # each MLP keeps the residual stream entering it
    assert saved == layer_inputs + block_inputs + layers * n_ckpt * batch * n * d * 8, saved
    assert saved * 4 < _saved_bytes(model, model, y)


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all`
def test_dense_associative_scan_with_a_learned_h0_saves_what_the_loop_saves():
    """The h0 fold of the dense form reads ``A[:, :1] @ h0`` through the reshapes a decomposed-then-
    restored matmul leaves: it is unfolded like the diagonal one (was 7x the loop's saved bytes)."""
    ids = torch.randint(0, CFG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(9))

    def saved(cls) -> int:
        torch.manual_seed(0)
        model = cls(SSMConfig(vocab_size=CFG["vocab_size"], d_model=8, d_state=3, decay="dense",
                              scan="associative_scan", learn_initial_state=True, n_layers=2)).double()
        return _saved_bytes(model, gs.compile(model, plan="adjoint", shard_size=8), ids)

    assert saved(SelectiveSSMLM) == saved(LoopSSMLM)


class _WithLoss(nn.Module):
    """The LM with its loss inside (as ``transformers`` computes it with ``labels=``)."""

    def __init__(self, lm: nn.Module, kind: str) -> None:
        super().__init__()
        self.lm, self.kind = lm, kind
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, CFG["vocab_size"], dtype=torch.float64))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids)
        flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if self.kind == "cross_entropy":
            return F.cross_entropy(flat, target)  # mean over the targets that are not ignored
        if self.kind == "weighted":
            return F.cross_entropy(flat, target, weight=self.class_weight, reduction="mean")
        if self.kind == "summed":
            return F.cross_entropy(flat, target, reduction="sum") / 7.0
        return (logits**2).mean()


@pytest.mark.parametrize("plan,opts", [("adjoint", {"shard_size": 5}),
                                       ("truncated_adjoint", {"window": 64, "shard_size": 5})])
@pytest.mark.parametrize("kind", ["cross_entropy", "weighted", "summed", "mean"])
def test_a_loss_inside_the_model_is_reduced_shard_by_shard(plan, opts, kind):
    """The tail ends in the loss: the logits are never kept (saved = layer inputs, tail input and
    checkpoints, as without the loss), and the loss and every gradient match autograd. Batch 2:
    the loss reads ``(B*T, V)`` rows, batch and time merged, and the reshaped targets join the tail."""
    batch, T = 2, 23
    model = _WithLoss(_lm(2), kind)
    ids = torch.randint(0, CFG["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    labels[0, 3:9] = -100  # ignored targets: the mean divides by the others only
    cm = assert_same_grads(model, (ids, labels), plan=plan, **opts)
    (tail,) = _regions(cm, "local_recompute")
    assert any("cross_entropy" in n or "mean" in n for n in tail.nodes), tail.nodes

    def step(ids: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        cm(ids, labels).backward()

    step(ids)
    saved = gs.measure(step, ids).saved_bytes
    n_ckpt = -(-T // opts["shard_size"]) - 1
    P, N = CFG["d_model"], CFG["d_state"]
    want = 2 * batch * T * P * 8 + 2 * n_ckpt * batch * N * P * 8
    assert saved <= want + 1024, (saved, want)  # + the loss's scalars


def _backward_nodes(out: torch.Tensor, kind: str = "AdjointFunctionBackward") -> list:
    """The backward nodes of type ``kind`` (an autograd Function's) in the graph behind ``out``."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == kind:
            found.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


@pytest.mark.parametrize("shard", [5, 64])
def test_residual_stream_gradient_is_one_buffer(shard):
    """A region whose output feeds only the next region writes its input's gradient into its
    output's gradient: the backward holds one residual-stream gradient buffer, not two."""
    batch, T, d = 2, 61, 32
    torch.manual_seed(0)
    model = SelectiveSSMLM(SSMConfig(vocab_size=37, d_model=d, d_state=3, n_layers=3, scan="gradshard")).double()
    ids = torch.randint(0, 37, (batch, T), generator=torch.Generator().manual_seed(1))
    cm = assert_same_grads(model, (ids,), plan="adjoint", shard_size=shard)
    assert cm.explain().count("written into the gradient of output") == 2, cm.explain()  # layers 1, 2

    shared: list[bool] = []
    out = cm(ids)
    for node in _backward_nodes(out):
        node.register_hook(lambda g_in, g_out: shared.append(
            any(a is not None and b is not None and a.data_ptr() == b.data_ptr() for a in g_in for b in g_out)))
    out.sum().backward()
    assert sorted(shared) == [False, True, True], shared  # layer 0 reads the ids: nothing to write into

    def peak() -> int:
        def step(ids: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            cm(ids).sum().backward()
        step(ids)
        return gs.measure(step, ids).peak_bytes

    donated = peak()
    regions = [m for m in cm.modules() if isinstance(m, AdjointRegion)]
    kept = [dict(m.donors) for m in regions]
    for m in regions:
        m.donors = {}
    try:
        separate = peak()
    finally:
        for m, dn in zip(regions, kept):
            m.donors = dn
    assert donated <= separate, (donated, separate)


class _TappedSSM(DiagonalSSM):
    """Layer 0's output feeds layer 1 and, again, the model's output."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y1 = self.layer(0, y)
        return self.layer(2, self.layer(1, y1)) * y1.tanh()


@pytest.mark.parametrize("conv", [False, True])
def test_an_output_read_twice_keeps_its_own_gradient(conv):
    """Only an output whose one reader is another region gives its gradient buffer away."""
    torch.manual_seed(0)
    model = _TappedSSM(d=6, n=3, layers=3, scan="gradshard", conv=conv).double()
    y = torch.randn(2, 19, 6, dtype=torch.float64, requires_grad=True)
    cm = assert_same_grads(model, (y,), plan="adjoint", shard_size=4)
    notes = [line for line in cm.explain().splitlines() if "written into the gradient of output" in line]
    # layer 0's output is read by layer 1 and by the tail (the product): it keeps its gradient
    assert [n.split(":")[0].strip() for n in notes] == ["adjoint_1", "adjoint_2"], notes


@pytest.mark.parametrize("plan,opts", [("adjoint", {}), ("truncated_adjoint", {"window": 100})])  # exact: window > T
@pytest.mark.parametrize("shard", [5, 8])
def test_recomputed_layer_inputs_are_not_kept_and_gradients_stay_exact(plan, opts, shard):
    """``recompute_layer_inputs``: layers 1 and 3 rerun layers 0 and 2 per backward window (from
    their state checkpoints) instead of keeping their inputs; at a new length too."""
    layers, batch, T = 4, 2, 29
    model = _lm(layers)
    ids = torch.randint(0, CFG["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(3))
    cm = assert_same_grads(model, (ids,), plan=plan, shard_size=shard, recompute_layer_inputs=True, **opts)
    chained = [line for line in cm.explain().splitlines() if "is recomputed in the backward from" in line]
    assert [c.split(":")[0].strip() for c in chained] == ["adjoint_1", "adjoint_3"], chained
    kept = _saved_bytes(model, gs.compile(model, plan=plan, shard_size=shard, **opts), ids)
    assert kept - _saved_bytes(model, cm, ids) == 2 * batch * T * CFG["d_model"] * 8
    # the same compiled module at another length (re-specialised, not captured again)
    ids2 = torch.randint(0, CFG["vocab_size"], (batch, 2 * T + 3), generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    cm(ids2).square().mean().backward()
    ref(ids2).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12), name


@pytest.mark.parametrize("conv", [False, True])
def test_recomputed_layer_input_through_a_halo(conv):
    """A chained layer whose producers read a causal window (conv): its windows start before a
    shard boundary of the layer it reruns; shards of 3 steps, odd T."""
    torch.manual_seed(0)
    model = DiagonalSSM(d=6, n=3, layers=3, scan="gradshard", conv=conv).double()
    y = torch.randn(2, 19, 6, dtype=torch.float64, requires_grad=True)
    cm = assert_same_grads(model, (y,), plan="adjoint", shard_size=3, recompute_layer_inputs=True)
    assert "adjoint_1: input" in cm.explain() and "is recomputed in the backward from adjoint_0" in cm.explain()


@pytest.mark.parametrize("shard", [5, 64])
def test_tail_writes_its_input_gradient_over_its_input(shard):
    """The tail (final norm + head) takes the last layer's output, read by nothing else, and
    writes that input's gradient over it as its shards finish with the rows: exact, the
    gradient it returns is the input's own storage, and the step's peak drops."""
    batch, T, d = 2, 61, 32
    torch.manual_seed(0)
    model = SelectiveSSMLM(SSMConfig(vocab_size=37, d_model=d, d_state=3, n_layers=3, scan="gradshard")).double()
    ids = torch.randint(0, 37, (batch, T), generator=torch.Generator().manual_seed(1))
    w = torch.randn(batch, T, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cm = assert_same_grads(model, (ids,), plan="adjoint", shard_size=shard)
    assert "tail_0: the gradient of input" in cm.explain() and "written over that input's rows" in cm.explain()

    out = cm(ids)
    (tail,) = _backward_nodes(out, "LocalSegmentFunctionBackward")
    saved: set[int] = set()
    same: list[bool] = []
    tail.register_prehook(lambda g_out: saved.update(t.data_ptr() for t in tail.saved_tensors) or None)
    tail.register_hook(lambda g_in, g_out: same.append(any(g is not None and g.data_ptr() in saved for g in g_in)))
    (out * w).sum().backward()
    assert same == [True]

    def peak(run) -> int:
        def step(ids: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            (run(ids) * w).sum().backward()
        step(ids)
        return gs.measure(step, ids).peak_bytes

    kept = gs.compile(model, plan="adjoint", shard_size=shard, reuse_input_buffers=False)
    kept(ids)
    assert "written over that input's rows" not in kept.explain()
    two, one = peak(kept), peak(cm)
    if shard == 5:  # small shards: the peak is the tail's backward, its input and that input's gradient
        assert two - one >= batch * T * d * 8 // 2, (two, one)
    else:  # one shard: the peak is a region's backward (a whole-sequence shard's transients)
        assert one <= two, (two, one)


def test_a_second_backward_through_a_recycled_tail_says_what_to_do():
    """retain_graph=True and a second backward: the tail's input now holds its gradient, so the
    error says so and names the option that keeps it -- which then works."""
    torch.manual_seed(0)
    model = _lm(2)
    ids = torch.randint(0, CFG["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(0))
    out = gs.compile(model, plan="adjoint", shard_size=5)(ids).square().mean()
    out.backward(retain_graph=True)
    with pytest.raises(gs.GradshardError, match="reuse_input_buffers=False"):
        out.backward()
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    out = gs.compile(model, plan="adjoint", shard_size=5, reuse_input_buffers=False)(ids).square().mean()
    out.backward(retain_graph=True)
    out.backward()
    loss = ref(ids).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12)
