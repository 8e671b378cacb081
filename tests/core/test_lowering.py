"""lower_kernels: the kernel backend per stage, the override, and Triton under the interpreter.

The Triton part runs in a child pytest process with TRITON_INTERPRET=1 (the interpreter is
chosen when kernels are defined, i.e. at import time).
"""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
from examples import factories
from tests.interpreted import INTERPRETED, run_under_interpreter


def _grads(backend):
    model, inputs = factories.ssm_gradshard_scan(dtype=torch.float64, seq_len=7, batch=2)
    cm = gs.compile(model, backend=backend)
    cm(*inputs).square().mean().backward()
    return cm, [p.grad.clone() for p in model.parameters()]


def test_kernel_nodes_and_stages_name_their_backend():
    cm, _ = _grads("torch")
    nodes = [n for n in cm.graph.graph.nodes if "gs_kernel" in n.meta]
    assert nodes and all(n.meta["gs_kernel"] == "torch:linear_scan" for n in nodes)
    assert all("backend" not in n.kwargs and n.args[-1] == "torch" for n in nodes)
    assert any("torch:linear_scan" in s.kernel for s in cm.program.stages)


if not INTERPRETED:

    def test_triton_backend_needs_cuda_or_interpreter():
        with pytest.raises(gs.GradshardError, match="TRITON_INTERPRET=1"):
            _grads("triton")

    @pytest.mark.slow  # keeps the default suite under 15 min on 2 cores; `make test-all` runs it (the kernels' interpreter test runs by default)
    def test_triton_backend_under_interpreter_matches_torch():
        run_under_interpreter(__file__)

else:

    def test_triton_matches_torch_end_to_end():
        _, g_torch = _grads("torch")
        cm, g_triton = _grads("triton")
        assert any(s.kernel.endswith("triton:linear_scan") for s in cm.program.stages)
        for a, b in zip(g_triton, g_torch):
            assert ((a - b).norm() / b.norm().clamp_min(1e-300)).item() <= 1e-10
