"""plan="partial_update" through gs.compile: detection, gradients, FLOPs, optimizer, outer loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gradshard as gs
from examples.models.llama import LlamaConfig, LlamaLM
from gradshard.distributed.diloco import PartialDiLoCo
from gradshard.distributed.testing import run_threaded
from gradshard.errors import GradshardError

DT = torch.float64
CFG = LlamaConfig(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=22)


def llama(seed: int = 0) -> LlamaLM:
    torch.manual_seed(seed)
    return LlamaLM(CFG).to(DT)


def tokens(b: int = 3, t: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _roles(cm) -> dict[str, str]:
    return {r.options["weight"]: r.options["role"] for r in cm.regions if r.kind == "partial_slice"}


@pytest.mark.parametrize("k", [0, 1])
def test_llama_slices_detected_and_gradients_exact(k: int) -> None:
    ref = llama()
    cm = gs.compile(copy.deepcopy(ref), plan="partial_update", num_slices=2, slice_index=k)
    x, y = tokens()
    out = cm(x)
    out_ref = ref(x)
    assert ((out - out_ref).norm() / out_ref.norm()).item() <= 1e-13
    roles = _roles(cm)
    for i in range(CFG.n_layers):
        p = f"layers.{i}."
        assert roles[p + "mlp.up_proj.weight"] == roles[p + "mlp.gate_proj.weight"] == "mlp_in"
        assert roles[p + "mlp.down_proj.weight"] == "mlp_out"
        assert roles[p + "self_attn.q_proj.weight"] == "attn_q"
        assert roles[p + "self_attn.k_proj.weight"] == roles[p + "self_attn.v_proj.weight"] == "attn_kv"
        assert p + "self_attn.o_proj.weight" not in roles
    assert "lm_head.weight" not in roles and len(roles) == 6 * CFG.n_layers

    lm_loss(out, y).backward()
    lm_loss(out_ref, y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    scale = torch.stack([g.norm() for g in ref_grads.values()]).norm()
    slices = cm.parameter_slices()
    assert len(slices) == 6 * CFG.n_layers
    for name, (orig, (dim, lo, hi)) in slices.items():
        p = dict(cm.named_parameters())[name]
        expect = ref_grads[orig].narrow(dim, lo, hi - lo)
        err = (p.grad - expect).norm() / torch.maximum(expect.norm(), 1e-6 * scale)
        assert err <= 1e-10, name
        assert cm.model.get_parameter(orig).grad is None, f"{orig}: the full weight must get no grad"
    sliced = {orig for orig, _ in slices.values()}
    for n, p in cm.model.named_parameters():
        if n not in sliced:
            assert ((p.grad - ref_grads[n]).norm() / ref_grads[n].norm()).item() <= 1e-10, n
    # head groups: q rows [8k, 8k+8) hold heads 2k, 2k+1, which attend with kv head k
    q = slices["partial.layers.layers_0_self_attn_q_proj.weight_slice"][1]
    kv = slices["partial.layers.layers_0_self_attn_k_proj.weight_slice"][1]
    assert q == (0, 8 * k, 8 * k + 8) and kv == (0, 4 * k, 4 * k + 4)


def test_optimizer_trains_slices_in_place_of_the_full_weight() -> None:
    cm = gs.compile(llama(), plan="partial_update", num_slices=2, slice_index=1, targets=("mlp",))
    x, y = tokens()
    lm_loss(cm(x), y).backward()
    assert "self_attn" not in " ".join(_roles(cm))  # targets=("mlp",): attention trained fully
    up = cm.model.layers[0].mlp.up_proj.weight
    before = up.detach().clone()
    opt = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    slice_param = cm.get_parameter("partial.layers.layers_0_mlp_up_proj.weight_slice")
    assert slice_param in opt.state and up not in opt.state  # full weight: no grad, no state
    # the slice is a view of the user's weight: rows [11, 22) moved, rows [0, 11) did not
    assert torch.equal(up[:11], before[:11]) and not torch.equal(up[11:], before[11:])
    assert torch.equal(cm.full_parameters(["layers.0.mlp.up_proj.weight"])["layers.0.mlp.up_proj.weight"], up)
    # a new input signature captures again but reuses the same slice parameters
    n_layers = len(cm.partial.layers)
    cm(tokens(2, 5)[0])
    assert len(cm.partial.layers) == n_layers
    assert cm.get_parameter("partial.layers.layers_0_mlp_up_proj.weight_slice") is slice_param


def test_backward_flops_drop_by_skipped_weight_gradients() -> None:
    x, y = tokens(2, 16)
    flops = {}
    for plan, opts in (("none", {}), ("partial_update", {"num_slices": 2, "slice_index": 0})):
        cm = gs.compile(llama(), plan=plan, **opts)
        loss = lm_loss(cm(x), y)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[plan] = counter.get_total_flops()
    m, d, h = 2 * 16, CFG.d_model, CFG.intermediate_size
    per_layer = 3 * 2 * m * d * h + 2 * m * d * (d + 2 * d // 2)  # MLP (3 weights) + q, k, v
    assert flops["none"] - flops["partial_update"] == CFG.n_layers * per_layer // 2


class GeluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(9, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.down(F.dropout(F.gelu(self.up(h)), p=0.0))
        return self.head(h)


def test_plain_gelu_mlp_with_biases_and_uneven_slices() -> None:
    torch.manual_seed(3)
    ref = GeluBlock().to(DT)
    cm = gs.compile(copy.deepcopy(ref), plan="partial_update", num_slices=4, slice_index=3)
    x = torch.randn(3, 5, 3, dtype=DT)
    cm(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert _roles(cm) == {"up.weight": "mlp_in", "down.weight": "mlp_out"}
    slices = cm.parameter_slices()
    assert slices["partial.layers.up.weight_slice"][1] == (0, 7, 9)  # 9 = 3 + 2 + 2 + 2
    # biases stay the user's own Parameters, trained whole (issue 16: they get their gradient)
    assert slices["model.up.bias"] == ("up.bias", (0, 0, 9)) and slices["model.down.bias"] == ("down.bias", (0, 0, 6))
    for name, (orig, (dim, lo, hi)) in slices.items():
        got = cm.get_parameter(name).grad
        torch.testing.assert_close(got, ref.get_parameter(orig).grad.narrow(dim, lo, hi - lo), rtol=1e-10, atol=0)
    # the down bias is not split: it stays trainable on every rank
    torch.testing.assert_close(cm.get_parameter("partial.layers.down.bias").grad, ref.down.bias.grad, rtol=1e-10, atol=0)
    full = cm.full_parameters()
    assert list(full) == [n for n, _ in ref.named_parameters()]
    assert full["down.bias"].requires_grad and not full["up.weight"].requires_grad


def test_gqa_with_fewer_kv_heads_than_slices_is_left_unsliced_with_a_note() -> None:
    cm = gs.compile(llama(), plan="partial_update", num_slices=3, slice_index=2)
    cm(tokens()[0])
    assert set(_roles(cm).values()) == {"mlp_in", "mlp_out"}
    notes = [n for r in cm.passes if r.name == "detect_sliceable_linears" for n in r.notes]
    assert any("num_slices <= 2" in n and "left unsliced" in n for n in notes)


def test_nothing_to_slice_is_a_clear_error() -> None:
    cm = gs.compile(nn.Linear(4, 3), plan="partial_update", num_slices=2, slice_index=0)
    with pytest.raises(GradshardError, match="found no projection to slice"):
        cm(torch.randn(2, 4))


def test_bad_targets_are_rejected() -> None:
    cm = gs.compile(llama(), plan="partial_update", num_slices=2, slice_index=0, targets=("mlp", "heads"))
    with pytest.raises(GradshardError, match="subset of"):
        cm(tokens()[0])


def test_compiled_module_runs_the_outer_loop() -> None:
    # make_fx tracing is not thread-safe: compile (at the first call) on the main thread
    cms = [gs.compile(llama(), plan="partial_update", num_slices=2, slice_index=r) for r in range(2)]
    for r, cm in enumerate(cms):
        cm(tokens(seed=10 + r)[0])

    def body(rank, group):
        cm = cms[rank]
        x, y = tokens(seed=10 + rank)
        lm_loss(cm(x), y).backward()
        opt = torch.optim.SGD([p for p in cm.parameters() if p.requires_grad], lr=0.05)
        outer = PartialDiLoCo(cm, opt, sync_every=2, group=group)
        outer.step()
        lm_loss(cm(x), y).backward()
        assert outer.step() == 0
        return {n: t.detach().clone() for n, t in cm.full_parameters().items()}, outer.counts

    (a, counts), (b, _) = run_threaded(2, body)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert torch.all(counts["layers.0.mlp.up_proj.weight"] == 1)
    assert torch.all(counts["layers.0.self_attn.o_proj.weight"] == 2)


def test_a_single_target_may_be_given_as_a_string() -> None:
    cm = gs.compile(llama(), plan="partial_update", num_slices=2, slice_index=0, targets="mlp")
    cm(tokens()[0])
    assert set(_roles(cm).values()) == {"mlp_in", "mlp_out"}


def test_compiled_full_parameters_round_trip_and_refuse_a_broadcast() -> None:
    """cm.full_parameters / load_full_parameters share one implementation with the module-level
    functions: a value that would broadcast (a scalar for an unsliced weight) is an error."""
    torch.manual_seed(4)
    cm = gs.compile(GeluBlock().to(DT), plan="partial_update", num_slices=2, slice_index=1)
    cm(torch.randn(2, 3, 3, dtype=DT))
    new = {n: torch.randn_like(v) for n, v in cm.full_parameters().items()}
    cm.load_full_parameters(new)
    got = cm.full_parameters()
    for n in new:
        assert torch.equal(got[n], new[n]), n
    before = cm.full_parameters(["head.weight"])["head.weight"].detach().clone()
    with pytest.raises(GradshardError, match="head.weight.*has shape \\(1, 6\\), got \\(\\); pass the full tensor"):
        cm.load_full_parameters({"head.weight": torch.tensor(0.5, dtype=DT)})
    assert torch.equal(cm.model.head.weight, before)  # nothing written
    with pytest.raises(GradshardError, match="up.weight: full weight has shape \\(2, 6\\), expected \\(9, 6\\)"):
        cm.load_full_parameters({"up.weight": torch.zeros(2, 6, dtype=DT)})
    with pytest.raises(GradshardError, match="unknown parameter name"):
        cm.full_parameters(["up.weight_slice"])


class MatmulBlock(nn.Module):
    """The GELU MLP written as ``x @ W.T + b`` (transformers' ``FalconLinear``, hand-written
    layers): the capture folds ``matmul(x, t(W))`` into ``linear(x, W)``, bit for bit."""

    def __init__(self, d: int = 3, h: int = 9) -> None:
        super().__init__()
        self.w_up, self.b_up = nn.Parameter(torch.randn(h, d)), nn.Parameter(torch.randn(h))
        self.w_down = nn.Parameter(torch.randn(d, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w_up.T + self.b_up) @ self.w_down.T


def test_projections_written_as_matmuls_with_transposed_weights_are_sliced() -> None:
    torch.manual_seed(3)
    ref = MatmulBlock().to(DT)
    cm = gs.compile(copy.deepcopy(ref), plan="partial_update", num_slices=3, slice_index=1)
    x = torch.randn(3, 5, 3, dtype=DT)
    plain = gs.compile(copy.deepcopy(ref), plan="none")
    assert torch.equal(plain(x), ref(x))  # the folded linear is the matmul it replaces, bit for bit
    assert [n.target for n in plain.graph.graph.nodes if n.op == "call_function"].count(torch.ops.aten.linear.default) == 2
    out = cm(x)
    assert ((out - ref(x)).norm() / ref(x).norm()).item() <= 1e-13
    assert _roles(cm) == {"w_up": "mlp_in", "w_down": "mlp_out"}
    out.square().sum().backward()
    ref(x).square().sum().backward()
    for name, (orig, (dim, lo, hi)) in cm.parameter_slices().items():
        torch.testing.assert_close(cm.get_parameter(name).grad, ref.get_parameter(orig).grad.narrow(dim, lo, hi - lo),
                                   rtol=1e-10, atol=0)
