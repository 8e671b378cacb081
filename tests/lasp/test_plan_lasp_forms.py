"""plan="lasp" on linear attention written in other styles (tests/lasp/lasp_models.py): the naive
form without decay, with a learned λ^{i-j} mask, in (B, T, H, d) einsum layout, the unrolled
per-step loop, the cumsum form with a normaliser; plus learned position embeddings (aranges
offset per rank) and windows served by a halo exchange (token shift, causal conv).
All on threaded gloo ranks vs one process, float64 (rel err <= 1e-10).
"""

from __future__ import annotations

import pytest
import torch

from lasp_testing import compare_lasp
from lasp_models import tiny_lm

TOL = 1e-10
CASES = [
    # (impl, decay, world, batch, extra model options)
    ("naive", "none", 4, 3, {}),
    ("naive", "const", 2, 1, {"positions": True}),  # λ = sigmoid(θ) learned, pow mask
    ("einsum", "gated", 4, 1, {}),
    ("recurrent", "gated", 4, 3, {"token_shift": True, "conv_kernel": 3}),
    ("cumsum", "none", 2, 3, {}),
]


@pytest.mark.parametrize("impl,decay,world,batch,kw", CASES)
def test_forms_match_single_process(impl: str, decay: str, world: int, batch: int, kw: dict) -> None:
    model, ids = tiny_lm(impl, decay, seq_len=17, batch=batch, **kw)
    cmp = compare_lasp(model, ids, world)
    assert cmp.out_err <= TOL and cmp.grad_err <= TOL, (cmp.out_err, cmp.grad_err)
    cm = cmp.results[0][2]
    forms = {r.options.get("form") for r in cm.regions if r.kind == "linear_attention"}
    expected = {"naive": "masked", "einsum": "masked", "recurrent": "recurrent", "cumsum": "cumsum"}[impl]
    assert expected in forms
    if kw.get("positions"):
        assert cmp.results[1][2].lasp.start == 9  # 17 tokens over 2 ranks: [0, 9), [9, 17)
        assert any("positions offset by 9" in n for rec in cmp.results[1][2].passes for n in rec.notes)
    if kw.get("conv_kernel"):
        names = [s.name for s in cm.program.stages]
        assert any(n.startswith("lasp_halo_") for n in names)


def test_a_product_with_a_zero_state_is_dropped_with_its_inputs() -> None:
    """A block loop's first block adds ``(q ⊙ exp(cumsum(c))) @ zeros``: the add is folded to its
    other operand, so dead-code elimination removes the cumsum the positional check would refuse."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gradshard.plans.lasp.locality import drop_zero_terms

    def f(o: torch.Tensor, q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        kv = q.new_zeros(q.shape[-1], 3)
        return o + (q * torch.exp(torch.cumsum(c, 0))) @ kv

    gm = make_fx(f)(torch.randn(5, 3), torch.randn(5, 2), torch.randn(5, 2))
    assert drop_zero_terms(gm.graph) == ["add"]
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert not any(n.target is torch.ops.aten.cumsum.default for n in gm.graph.nodes)
    o = torch.randn(5, 3)
    assert torch.equal(gm(o, torch.randn(5, 2), torch.randn(5, 2)), o)
