"""Backend selection: auto choice, explicit choice, and the errors when Triton cannot run."""

import pytest
import torch

import gradshard.kernels as gk
from gradshard.kernels.backend import ensure_interpreter_consistent, select_backend


def test_available_backends_follows_interpreter_flag(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gk.available_backends() == ("torch", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = ("torch", "triton") if torch.cuda.is_available() else ("torch",)
    assert gk.available_backends() == expected


def test_auto_picks_torch_for_cpu_tensors_even_under_interpreter(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(x, None) == "torch"
    assert select_backend(x, "auto") == "torch"
    assert select_backend(x, "torch") == "torch"
    assert select_backend(x, "triton") == "triton"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, u = torch.rand(1, 3, 2), torch.randn(1, 3, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gk.linear_scan(a, u, backend="triton")
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gk.lightning_attention(q, q, q, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gk.adjoint_shard(a, u, u, backend="triton")


def test_unknown_backend_and_mode_mismatch():
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(torch.zeros(1), "numpy")
    with pytest.raises(RuntimeError, match="imported without TRITON_INTERPRET=1"):
        ensure_interpreter_consistent(False, torch.zeros(1))
    ensure_interpreter_consistent(True, torch.zeros(1))
