"""detect_attention finds SDPA and explicit softmax attention, their KV sources, GQA and RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs
from chunked_models import CachedRoPEAttention, TinyGPT
from examples.factories import llama, llama_explicit_softmax


def _attention(cm: gs.CompiledModule) -> list:
    return [r for r in cm.regions if r.kind == "attention"]


def _node(cm: gs.CompiledModule, name: str):
    return next(n for n in cm.graph.graph.nodes if n.name == name)  # plan="none": graph unchanged


def test_sdpa_with_repeat_kv_and_rope() -> None:
    model, (ids,) = llama(seq_len=12, batch=2)
    cm = gs.compile(model, plan="none")
    cm(ids)
    regs = _attention(cm)
    assert len(regs) == 2
    for r in regs:
        o = r.options
        assert (o["form"], o["causal"], o["mask"], o["kv_repeat"], o["n_rep"]) == ("sdpa", True, "is_causal", "interleave", 2)
        assert o["rope"] and (o["heads"], o["kv_heads"]) == (4, 2)
        assert r.source is not None and r.source.file.endswith("llama.py")
        k = _node(cm, o["k_cache"])
        assert tuple(k.meta["val"].shape) == (2, 2, 12, 8)  # before the head repeat


def test_explicit_softmax_with_repeat_interleave() -> None:
    model, (ids,) = llama_explicit_softmax(seq_len=10, batch=1, kv_repeat="repeat_interleave")
    cm = gs.compile(model, plan="none")
    cm(ids)
    regs = _attention(cm)
    assert len(regs) == 2
    for r in regs:
        o = r.options
        assert (o["form"], o["causal"], o["mask"], o["kv_repeat"], o["n_rep"]) == ("explicit", True, "tensor", "interleave", 2)
        assert tuple(_node(cm, o["k_cache"]).meta["val"].shape) == (1, 2, 10, 8)


def test_bool_tril_masked_fill_and_cached_rope() -> None:
    torch.manual_seed(0)
    cm = gs.compile(TinyGPT(), plan="none")
    cm(torch.randint(0, 50, (1, 9)))
    regs = _attention(cm)
    assert len(regs) == 2 and all(r.options["causal"] and r.options["n_rep"] == 1 for r in regs)
    assert not any(r.options["rope"] for r in regs)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att = CachedRoPEAttention(16, 4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.att(x)

    cm = gs.compile(M(), plan="none")
    cm(torch.randn(1, 9, 16))
    (r,) = _attention(cm)
    assert r.options["rope"] and r.options["n_rep"] == 2 and r.options["kv_repeat"] == "interleave"


def test_non_causal_and_enable_gqa() -> None:
    class M(nn.Module):
        def __init__(self, causal: bool) -> None:
            super().__init__()
            self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)
            self.causal = causal

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
            k, v = self.kv(x).view(b, t, 2, 2, 4).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)

    for causal in (True, False):
        cm = gs.compile(M(causal), plan="none")
        cm(torch.randn(2, 7, 16))
        (r,) = _attention(cm)
        assert r.options["causal"] is causal
        assert (r.options["n_rep"], r.options["kv_repeat"], r.options["kv_heads"]) == (2, "interleave", 2)
