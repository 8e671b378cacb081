"""A second process with a warm compile cache runs what the first compiled.

torch 2.13's AOTAutograd cache stores the view replay of outputs that alias intermediates as process
addresses; a chunk group of seco (a projection's ``transpose``, a one-head ``expand``) loaded from it
failed with garbage sizes. gradshard compiles graphs that return views with that cache off (Inductor's
own cache still serves the kernels): ``gradshard/compose.py``, ``compile_with_inductor``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradshard.compose import compile_with_inductor

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fn, cached", [
    (lambda x: x.t(), False),  # a view of an input
    (lambda x: (x.sin().view(3, 2), x.cos()), False),  # a view of an intermediate
    (lambda x: torch.split(x.exp(), 1), False),  # items of a view op's list
    (lambda x: (x.sin() @ x.t(),), True),  # fresh tensors only: AOTAutograd's cache serves it
], ids=["input-view", "intermediate-view", "split", "no-view"])
def test_graphs_returning_views_compile_with_the_autograd_cache_off(monkeypatch: pytest.MonkeyPatch, fn,
                                                                     cached: bool) -> None:
    import torch._inductor.compile_fx as cfx
    from torch.fx.experimental.proxy_tensor import make_fx

    seen: list[bool] = []

    def fake_compile_fx(gm, inputs, config_patches=None):  # type: ignore[no-untyped-def]
        seen.append(torch._functorch.config.enable_autograd_cache)
        return gm

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    x = torch.randn(2, 3)
    compile_with_inductor(make_fx(fn)(x), [x])
    assert seen == [cached and torch._functorch.config.enable_autograd_cache]


_STEP = textwrap.dedent("""
    import torch, gradshard as gs
    from gradshard.examples import factories
    model, (ids,) = factories.llama(d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=16,
                                    seq_len=32, batch=1)
    ref = torch.autograd.grad(model(ids).square().mean(), list(model.parameters()))
    cm = gs.compile(model, plan="seco", inductor=True, chunk_size=16)
    got = torch.autograd.grad(cm(ids).square().mean(), list(model.parameters()))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, ref))
    print("same gradients")
""")


@pytest.mark.slow
def test_seco_compiled_again_from_a_warm_cache_in_a_new_process(tmp_path: Path) -> None:
    """The model that failed: seco with Inductor on a one-KV-head Llama, compiled in one process and
    loaded from the caches in the next (about 45 s cold, 15 s warm)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(_ROOT)}
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _STEP], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "same gradients" in run.stdout, run.stderr[-3000:]
