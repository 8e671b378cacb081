"""plan="partial_update" on Hugging Face `transformers` models (code we did not write).

Tiny random-weight models from ``tests/hf/zoo.py``, float64, T = 37, two slices. Each
family must match eager autograd where the plan promises it: the logits, the gradient of
every trainable slice (the matching entries of eager's full gradient), the gradient of
every sliced layer's bias (the user's own Parameter, trained whole), and the plain
gradients of everything left unsliced; ``cm.parameter_slices()`` must name every tensor
that trains. Fused projections are sliced per block: Phi-3's ``qkv_proj`` (GQA: 4 query,
2 kv heads) and ``gate_up_proj``, GPT-2's ``Conv1D`` (weight stored (in, out), used via
``addmm``), GPT-NeoX's head-interleaved ``query_key_value``, Qwen3-Next's query + output
gate ``q_proj``, Granite's and Zamba2's fused MLP inputs (Zamba2's with a LoRA adapter). A pure SSM (Mamba) has no MLP or
attention projection and is refused with a reason naming its fused ``in_proj``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from gradshard.distributed.diloco import trained_masks
from gradshard.errors import GradshardError

from .zoo import build, inputs

T = 37
TOL = 1e-10

#: family -> {weight: (role, trainable (dim, start, stop) of slice 0, in the stored layout)}.
#: Fused weights list one run per block (q | k | v, gate | up) in that block's head groups.
EXPECT: dict[str, dict[str, tuple[str, list[tuple[int, int, int]]]]] = {
    "llama": {
        "model.layers.0.self_attn.q_proj.weight": ("attn_q", [(0, 0, 16)]),
        "model.layers.0.self_attn.k_proj.weight": ("attn_kv", [(0, 0, 8)]),
        "model.layers.0.mlp.gate_proj.weight": ("mlp_in", [(0, 0, 32)]),
        "model.layers.0.mlp.down_proj.weight": ("mlp_out", [(1, 0, 32)]),
    },
    "phi3": {  # q rows 0:32 (heads 0,1 = kv head 0's group), k 32:48, v 48:64
        "model.layers.0.self_attn.qkv_proj.weight": ("attn_fused", [(0, 0, 16), (0, 32, 40), (0, 48, 56)]),
        "model.layers.0.mlp.gate_up_proj.weight": ("mlp_in", [(0, 0, 32), (0, 64, 96)]),
        "model.layers.0.mlp.down_proj.weight": ("mlp_out", [(1, 0, 32)]),
    },
    "gpt2": {  # Conv1D: output features are dim 1 of the stored weight
        "transformer.h.0.attn.c_attn.weight": ("attn_fused", [(1, 0, 16), (1, 32, 48), (1, 64, 80)]),
        "transformer.h.0.mlp.c_fc.weight": ("mlp_in", [(1, 0, 32)]),
        "transformer.h.0.mlp.c_proj.weight": ("mlp_out", [(0, 0, 32)]),
    },
    "gpt_neox": {  # rows are [q k v] per head: heads 0, 1 are one run
        "gpt_neox.layers.0.attention.query_key_value.weight": ("attn_fused", [(0, 0, 48)]),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": ("mlp_in", [(0, 0, 32)]),
        "gpt_neox.layers.0.mlp.dense_4h_to_h.weight": ("mlp_out", [(1, 0, 32)]),
    },
    "recurrent_gemma": {  # MQA attention (1 kv head) cannot be split in 2: MLPs only
        "model.layers.1.mlp_block.gate_proj.weight": ("mlp_in", [(0, 0, 16)]),
        "model.layers.1.mlp_block.down_proj.weight": ("mlp_out", [(1, 0, 16)]),
    },
    "qwen3_next": {  # q_proj rows are [query, gate] per head; the gate follows its head
        "model.layers.1.self_attn.q_proj.weight": ("attn_fused", [(0, 0, 32)]),
        "model.layers.1.self_attn.k_proj.weight": ("attn_kv", [(0, 0, 8)]),
    },
    "granitemoehybrid": {
        "model.layers.0.shared_mlp.input_linear.weight": ("mlp_in", [(0, 0, 16), (0, 32, 48)]),
        "model.layers.0.shared_mlp.output_linear.weight": ("mlp_out", [(1, 0, 16)]),
    },
    "zamba2": {  # gate_up + a LoRA adapter (A: 32->8, B: 8->128) summed before the chunk
        "model.layers.1.shared_transformer.feed_forward.gate_up_proj.weight": ("mlp_in", [(0, 0, 32), (0, 64, 96)]),
        "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1.weight":
            ("mlp_in", [(0, 0, 32), (0, 64, 96)]),
    },
}

#: Weights that must stay unsliced (output projections, MQA attention, the LM head).
UNSLICED: dict[str, list[str]] = {
    "llama": ["model.layers.0.self_attn.o_proj.weight", "lm_head.weight"],
    "phi3": ["model.layers.0.self_attn.o_proj.weight"],
    "gpt2": ["transformer.h.0.attn.c_proj.weight"],
    "gpt_neox": ["gpt_neox.layers.0.attention.dense.weight"],
    "recurrent_gemma": ["model.layers.1.temporal_block.q_proj.weight"],
    "qwen3_next": ["model.layers.1.self_attn.o_proj.weight"],
    "granitemoehybrid": ["model.layers.1.self_attn.o_proj.weight"],
    "zamba2": ["model.layers.1.shared_transformer.self_attn.o_proj.weight",
               "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.0.weight"],
}


def _rel(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    return float((got - want).norm() / max(float(want.norm()), floor, 1e-300))


def _compile_and_run(family: str, k: int = 0):
    """Compile ``family`` with two slices; run it and eager on the same weighted-logits loss."""
    model, config = build(family)
    ref = copy.deepcopy(model)
    ids = inputs(config, batch=2, T=T)["input_ids"]
    cm = gs.compile(model, plan="partial_update", num_slices=2, slice_index=k)
    got, want = cm(input_ids=ids).logits, ref(input_ids=ids).logits
    assert _rel(got.detach(), want.detach()) <= TOL
    weights = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    return cm, model, ref


def _check_gradients(cm, model, ref) -> dict[str, tuple[str, list[tuple[int, int, int]]]]:
    """The exactness and coverage contract; returns ``{weight: (role, trainable spans)}``."""
    regions = [r.options for r in cm.regions if r.kind == "partial_slice"]
    assert regions, "nothing was sliced"
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    scale = float(torch.stack([g.norm() for g in ref_grads.values() if g is not None]).norm())
    params = dict(cm.named_parameters())
    slices = cm.parameter_slices()
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for name, (orig, (dim, lo, hi)) in slices.items():
        assert name in params, f"{name} is not in cm.named_parameters()"
        expect = ref_grads[orig].narrow(dim, lo, hi - lo)
        got = params[name].grad
        assert got is not None and got.shape == expect.shape, name
        assert _rel(got, expect, 1e-6 * scale) <= TOL, name
        spans.setdefault(orig, []).append((dim, lo, hi))
    sliced_weights = {r["weight"] for r in regions}
    biases = {r["bias"] for r in regions if r["bias"] is not None}
    for w in sliced_weights:  # the full weight is not read any more: no gradient
        assert model.get_parameter(w).grad is None, w
    for b in biases:  # the user's own bias Parameter, trained whole, exact, listed
        p = model.get_parameter(b)
        assert p.grad is not None and _rel(p.grad, ref_grads[b], 1e-6 * scale) <= TOL, b
        assert slices.get(f"model.{b}") == (b, (0, 0, p.numel())), b
        assert params[f"model.{b}"] is p
    # every tensor that trains is a listed slice or an unsliced user parameter (exact)
    unsliced = {f"model.{n}" for n in ref_grads if n not in sliced_weights | biases}
    trained = {n for n, p in params.items() if p.grad is not None}
    assert trained - unsliced == set(slices)
    for n in unsliced:
        g, want = params[n].grad, ref_grads[n[len("model."):]]
        if want is None:
            assert g is None or not g.any(), n
        else:
            assert _rel(g, want, 1e-6 * scale) <= TOL, n
    roles = {r["weight"]: r["role"] for r in regions}
    return {w: (roles[w], sorted(spans[w])) for w in sliced_weights}


@pytest.mark.parametrize("family", list(EXPECT))
def test_family_slices_are_exact_and_complete(family: str) -> None:
    cm, model, ref = _compile_and_run(family)
    got = _check_gradients(cm, model, ref)
    for weight, expect in EXPECT[family].items():
        assert got.get(weight) == expect, weight
    for weight in UNSLICED[family]:
        assert weight not in got, weight


def test_phi3_other_slice_takes_the_other_head_groups_and_units() -> None:
    cm, model, ref = _compile_and_run("phi3", k=1)
    got = _check_gradients(cm, model, ref)
    assert got["model.layers.1.self_attn.qkv_proj.weight"] == (
        "attn_fused", [(0, 16, 32), (0, 40, 48), (0, 56, 64)])
    assert got["model.layers.1.mlp.gate_up_proj.weight"] == ("mlp_in", [(0, 32, 64), (0, 96, 128)])
    # the DiLoCo outer loop reads the same runs as this rank's trained entries
    mask = trained_masks(cm)["model.layers.1.self_attn.qkv_proj.weight"].reshape(-1)
    assert mask.nonzero().reshape(-1).tolist() == [*range(16, 32), *range(40, 48), *range(56, 64)]


def test_gpt2_conv1d_slices_write_through_and_round_trip() -> None:
    cm, model, _ = _compile_and_run("gpt2")
    name = "transformer.h.0.attn.c_attn.weight"
    w = model.get_parameter(name)
    before = w.detach().clone()
    torch.optim.SGD([p for p in cm.parameters() if p.grad is not None], lr=0.1).step()
    trained = [*range(0, 16), *range(32, 48), *range(64, 80)]
    frozen = [c for c in range(96) if c not in trained]
    assert torch.equal(w[:, frozen], before[:, frozen])  # columns of the stored (in, out) weight
    assert not torch.equal(w[:, trained], before[:, trained])
    assert torch.equal(cm.full_parameters([name])[name], w.detach())
    new = torch.randn_like(before)
    cm.load_full_parameters({name: new})
    assert torch.equal(w.detach(), new)


def test_pure_ssm_is_refused_naming_its_fused_in_proj() -> None:
    model, config = build("mamba")
    cm = gs.compile(model, plan="partial_update", num_slices=2, slice_index=0)
    with pytest.raises(GradshardError, match="found no projection to slice") as info:
        cm(input_ids=inputs(config, batch=1, T=T)["input_ids"])
    text = str(info.value)
    assert "node `" in text and "in_proj.weight" in text and "nor attention" in text
