"""The kernels go through torch.compile (Dynamo + AOTAutograd) as single custom-op nodes."""

import torch

import gradshard.kernels as gk


def test_compiled_graph_keeps_ops_and_gradients():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(a, u, h0, q, d):
        h = gk.linear_scan(torch.sigmoid(a), u, h0, reverse=True)
        o, s = gk.lightning_attention(q, q, q, d, chunk_size=4)
        return h.square().sum() + o.sum() + s.sum()

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 9, 3, generator=g, dtype=torch.float64), torch.randn(2, 9, 3, generator=g, dtype=torch.float64),
              torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64),
              torch.rand(2, generator=g, dtype=torch.float64)]
    for t in inputs:
        t.requires_grad_(True)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    ref = torch.autograd.grad(f(*inputs), inputs)
    assert sum("gradshard.linear_scan" in t for t in seen) == 1, seen
    assert sum("gradshard.lightning_attention" in t for t in seen) == 1
    for x, y in zip(got, ref):
        assert torch.allclose(x, y, rtol=1e-12, atol=0)
