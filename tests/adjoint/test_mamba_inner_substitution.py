"""Mamba-1's fused training path ``mamba_inner_fn`` gets a traceable twin while capturing.

The stand-in kernel needs real storage and computes the op the way mamba_ssm's
``mamba_inner_ref`` does -- (batch*time)-merged projections -- with a per-step loop for the
selective scan, written apart from gradshard's twin. The user model is mamba_ssm's
``mamba_simple.Mamba`` forward (fast path), including its ``in_proj`` computed as
``W @ rearrange(x, "b l d -> d (b l)")``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from gradshard.capture.twins_mamba import mamba_inner_reference

from .helpers import assert_same_grads
from .standin import OpaqueKernel, standin_package

F64 = torch.float64


def selective_scan_loop(u, delta, A, B, C, D, z, delta_bias):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t``, ``y_t = C_t h_t + D u_t``, times ``silu(z)``; one step at a time."""
    dt = F.softplus(delta + delta_bias[:, None])
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[-1]):
        h = torch.exp(dt[:, :, t, None] * A) * h + dt[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + u * D[:, None]
    return y * F.silu(z)


def mamba_inner_loop(xz, conv_w, conv_b, x_proj_w, dt_proj_w, out_w, out_b, A, D, delta_bias):
    L = xz.shape[-1]
    rank, n = dt_proj_w.shape[1], A.shape[1]
    x, z = xz.chunk(2, dim=1)
    x = F.silu(F.conv1d(F.pad(x, (conv_w.shape[-1] - 1, 0)), conv_w, conv_b, groups=x.shape[1]))
    x_dbl = F.linear(x.transpose(1, 2).reshape(-1, x.shape[1]), x_proj_w)  # (b l) d, as mamba_inner_ref
    delta = (dt_proj_w @ x_dbl[:, :rank].t()).reshape(-1, x.shape[0], L).transpose(0, 1)
    B = x_dbl[:, rank:rank + n].reshape(x.shape[0], L, n).transpose(1, 2)
    C = x_dbl[:, -n:].reshape(x.shape[0], L, n).transpose(1, 2)
    y = selective_scan_loop(x, delta, A, B, C, D, z, delta_bias)
    return F.linear(y.transpose(1, 2), out_w, out_b)


def _mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                    delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                    b_c_dt_rms_eps=1e-6):
    assert B is None and C is None and delta_softplus
    return OpaqueKernel.apply(mamba_inner_loop, xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                              out_proj_weight, out_proj_bias, A, D, delta_bias)


USER_CODE = textwrap.dedent('''
    import math
    import torch
    from torch import nn
    from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn


    class Mamba(nn.Module):
        """mamba_ssm's mamba_simple.Mamba, training path (use_fast_path=True)."""

        def __init__(self, d_model=4, d_state=3, d_conv=3, expand=2):
            super().__init__()
            self.d_inner = expand * d_model
            self.dt_rank = math.ceil(d_model / 16)
            self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=False)
            self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
            self.x_proj = nn.Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False)
            self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
            A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(self.d_inner, 1)
            self.A_log = nn.Parameter(torch.log(A))
            self.D = nn.Parameter(torch.ones(self.d_inner))
            self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

        def forward(self, hidden_states):
            batch, seqlen, dim = hidden_states.shape
            xz = (self.in_proj.weight @ hidden_states.reshape(batch * seqlen, dim).t()).reshape(-1, batch, seqlen)
            xz = xz.transpose(0, 1)  # "d (b l) -> b d l", as mamba_simple writes it with einops
            A = -torch.exp(self.A_log.float())
            out = mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                                 self.out_proj.weight, self.out_proj.bias, A, None, None, self.D.float(),
                                 delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
            return hidden_states + out


    class MambaLM(nn.Module):
        def __init__(self, layers=2):
            super().__init__()
            self.layers = nn.ModuleList(Mamba() for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
''')


@pytest.fixture
def user_module():
    with standin_package("mamba_ssm.ops.selective_scan_interface", {"mamba_inner_fn": _mamba_inner_fn},
                         USER_CODE, "user_mamba_inner_model") as user:
        yield user


def test_the_twin_equals_the_step_by_step_computation():
    g = torch.Generator().manual_seed(3)
    b, d, L, n, rank, width = 2, 6, 9, 3, 2, 4
    args = [torch.randn(b, 2 * d, L, generator=g, dtype=F64), torch.randn(d, 1, width, generator=g, dtype=F64),
            torch.randn(d, generator=g, dtype=F64), torch.randn(rank + 2 * n, d, generator=g, dtype=F64),
            torch.randn(d, rank, generator=g, dtype=F64), torch.randn(5, d, generator=g, dtype=F64),
            torch.randn(5, generator=g, dtype=F64), -torch.rand(d, n, generator=g, dtype=F64) - 0.1,
            torch.randn(d, generator=g, dtype=F64), torch.randn(d, generator=g, dtype=F64)]
    for t in args:
        t.requires_grad_(True)
    xz, cw, cb, xw, dw, ow, ob, A, D, db = args
    got = mamba_inner_reference(xz, cw, cb, xw, dw, ow, ob, A, None, None, D, delta_bias=db)
    ref = mamba_inner_loop(xz, cw, cb, xw, dw, ow, ob, A, D, db)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(got.shape, generator=g, dtype=F64)
    for a, r in zip(torch.autograd.grad((got * w).sum(), args), torch.autograd.grad((ref * w).sum(), args)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_a_fast_path_mamba_model_compiles_with_adjoint_and_matches(user_module):
    torch.manual_seed(2)
    model = user_module.MambaLM().double()
    x = torch.randn(3, 11, 4, dtype=F64)
    # mamba_simple casts A_log, D and dt_proj.bias with `.float()`: their gradients pass through
    # float32 on both sides and agree to float32 rounding (<= 1.1e-7); the others to <= 4e-16
    cm = assert_same_grads(model, (x,), shard_size=4, tol=1e-6)
    assert len([r for r in cm.regions if r.kind == "linear_recurrence"]) == 2
    assert "mamba_ssm.ops.selective_scan_interface.mamba_inner_fn" in cm.explain()
