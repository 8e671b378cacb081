"""Known third-party kernels are swapped for traceable twins while capturing.

mamba_ssm needs CUDA and does not install here, so a stand-in package plays its part: its
``selective_scan_fn`` computes the right function eagerly but, like the real CUDA extension,
needs real storage (``data_ptr``) and so cannot be traced on fake tensors. A user model
imports it by name, as Mamba's own ``mamba_simple.py`` does.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import gradshard as gs
from gradshard.capture.twins_mamba import selective_scan_reference
from gradshard.capture.substitutions import substitute_known_kernels

from .helpers import assert_same_grads
from .standin import OpaqueKernel, standin_package


def _selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    assert not return_last_state

    def fn(u, delta, A, B, C, D, z, delta_bias):
        return selective_scan_reference(u, delta, A, B, C, D, z, delta_bias, delta_softplus)

    return OpaqueKernel.apply(fn, u, delta, A, B, C, D, z, delta_bias)


USER_CODE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn


    class Mixer(nn.Module):
        def __init__(self, d_model=4, d_inner=6, n=3, dt_rank=2, k=3):
            super().__init__()
            self.in_proj = nn.Linear(d_model, 2 * d_inner)
            self.conv = nn.Conv1d(d_inner, d_inner, k, groups=d_inner, padding=k - 1)
            self.x_proj = nn.Linear(d_inner, dt_rank + 2 * n, bias=False)
            self.dt_proj = nn.Linear(dt_rank, d_inner)
            self.A_log = nn.Parameter(torch.log(torch.rand(d_inner, n) + 0.5))
            self.D = nn.Parameter(torch.ones(d_inner))
            self.out_proj = nn.Linear(d_inner, d_model)
            self.n, self.dt_rank = n, dt_rank

        def forward(self, x):
            L = x.shape[1]
            xs, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
            xs = F.silu(self.conv(xs)[..., :L])
            dt, B, C = torch.split(self.x_proj(xs.transpose(1, 2)), [self.dt_rank, self.n, self.n], dim=-1)
            dt = self.dt_proj.weight @ dt.transpose(1, 2)
            y = selective_scan_fn(xs, dt, -torch.exp(self.A_log), B.transpose(1, 2), C.transpose(1, 2), self.D,
                                  z, self.dt_proj.bias, delta_softplus=True)
            return x + self.out_proj(y.transpose(1, 2))
''')


@pytest.fixture
def user_module():
    """The stand-in mamba_ssm and a user module that imports its kernel by name."""
    with standin_package("mamba_ssm.ops.selective_scan_interface", {"selective_scan_fn": _selective_scan_fn},
                         USER_CODE, "user_mamba_model") as user:
        yield user


def test_the_stand_in_really_cannot_be_traced(user_module):
    model = user_module.Mixer().double()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    with pytest.raises(Exception):
        torch.fx.experimental.proxy_tensor.make_fx(model, tracing_mode="fake")(x)


def test_selective_scan_fn_is_substituted_detected_and_exact(user_module):
    torch.manual_seed(0)
    model = user_module.Mixer().double()
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    cm = assert_same_grads(model, (x,), shard_size=4)
    (region,) = [r for r in cm.regions if r.kind == "linear_recurrence"]
    assert region.options["written_as"] == "gradshard.kernels.linear_scan"
    assert "mamba_ssm.ops.selective_scan_interface.selective_scan_fn" in cm.explain()
    # the bindings are restored after capture: eager code runs the original kernel again
    assert user_module.selective_scan_fn is _selective_scan_fn
    assert sys.modules["mamba_ssm.ops.selective_scan_interface"].selective_scan_fn is _selective_scan_fn


def test_nothing_is_substituted_when_the_kernel_was_never_imported():
    saved = sys.modules.pop("mamba_ssm.ops.selective_scan_interface", None)
    try:
        with substitute_known_kernels() as applied:
            assert applied == []
    finally:
        if saved is not None:
            sys.modules["mamba_ssm.ops.selective_scan_interface"] = saved


def test_plan_none_also_runs_the_twin(user_module):
    model = user_module.Mixer().double()
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    out = gs.compile(model, plan="none")(x)
    torch.testing.assert_close(out, model(x))
