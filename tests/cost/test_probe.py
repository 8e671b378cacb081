"""Probes count exactly what gs.measure counts, on real and on fake tensors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import gradshard as gs
from examples import factories as F
from gradshard.cost.probe import (CostProbeError, default_loss, fake_clone, find_input_axes, make_step,
                                  resize_inputs, run_probe)
from gradshard.measure import measure


def _contiguous(tree):
    return torch.utils._pytree.tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, tree)


def _measured(name, plan="none", seq_len=24, batch=3, **options):
    # Probes resize inputs into contiguous tensors; the factories' labels are a strided slice of
    # the token stream, whose reshape in the loss would copy (and save) 8*B*T more bytes.
    target, inputs = _contiguous(F.FACTORIES[name](seq_len=seq_len, batch=batch))
    cm = gs.compile(target, plan, **options)
    cm(*inputs)  # capture outside the measured step, as a training loop's first call would
    return measure(make_step(cm), *inputs, repeat=0)


@pytest.mark.parametrize("name, mode", [("llama", "fake"), ("llama", "real"), ("ssm_gradshard_scan", "fake"),
                                        ("llama_loss", "fake")])
def test_probe_equals_measure(name, mode):
    target, inputs = F.FACTORIES[name](seq_len=32)
    axes = find_input_axes(target, inputs)
    s = run_probe(target, inputs, plan="none", options={}, axes=axes, batch=3, seq_len=24, mode=mode)
    m = _measured(name)
    assert s.mode == mode
    assert (s.peak_bytes, s.saved_bytes, s.flops_fwd, s.flops_bwd, s.retained_bytes) == \
        (m.peak_bytes, m.saved_bytes, m.forward_flops, m.backward_flops, m.retained_bytes)
    assert max(s.live) == s.peak_bytes and len(s.live) == len(s.ops)


def test_input_axes_of_every_input_kind():
    target, inputs = F.llama_hf(seq_len=32)  # (ids, position_ids, labels): all (B, T)
    axes = find_input_axes(target, inputs)
    assert axes.time == ((1,), (1,), (1,)) and axes.batch == ((0,), (0,), (0,))
    assert (axes.seq_len, axes.batch_size) == (32, 2)
    fn, (model, batch) = F.llama_loss(seq_len=32)
    axes = find_input_axes(fn, (model, batch))
    assert axes.time == ((1,), (1,))
    resized = resize_inputs((model, batch), axes, 5, 7)
    assert resized[0] is model and [tuple(t.shape) for t in resized[1]] == [(5, 7), (5, 7)]
    assert int(resized[1][0].max()) < 256  # token ids stay valid


def test_fake_clone_copies_no_data_and_keeps_ties():
    model, (ids,) = F.llama(seq_len=16, tie_embeddings=True)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    originals = {}
    fm, fids = fake_clone((model, ids), mode, originals)
    assert isinstance(fm.lm_head.weight, FakeTensor) and fm.lm_head.weight is fm.embed_tokens.weight
    assert originals[id(fm.lm_head.weight)] is model.lm_head.weight
    assert isinstance(fids, FakeTensor) and model.lm_head.weight.grad is None
    bf = fake_clone(model, FakeTensorMode(), dtype=torch.bfloat16)
    assert bf.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32


def test_default_loss_prefers_a_scalar_loss():
    x = torch.ones(2, 3, requires_grad=True)
    assert default_loss(x * 2).item() == 12
    out = F.llama_hf(seq_len=8)
    loss = default_loss(out[0](*out[1]))
    assert loss.shape == () and loss.grad_fn is not None
    with pytest.raises(CostProbeError, match="loss_fn"):
        default_loss(torch.ones(3))
