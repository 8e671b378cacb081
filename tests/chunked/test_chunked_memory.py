"""Only one chunk's activations are alive during the SeCO backward (shown with gs.measure).

Peak memory of a SeCO step is ``C + a * T`` where the slope ``a`` is a small multiple of the
KV cache per step (the cache, the cotangent buffer of the cache, the transient gradient of
the cached prefix inside one chunk's backward), while plain autograd's slope is every
activation of every layer per step. With the sequence length fixed, SeCO's peak grows with
the chunk size (one chunk's activations) and a single chunk costs what plain autograd does.
"""

from __future__ import annotations

import pytest

import gradshard as gs
from examples.factories import llama_loss
from gradshard.measure import LiveTensorTracker, measure, step

_CFG = {"batch": 1, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 172}


def _peaks(seq_len: int, chunk: int) -> tuple[int, int, int]:
    """(plain autograd peak, seco peak, kv-cache bytes) of one loss.backward() step."""
    fn, (model, batch) = llama_loss(seq_len=seq_len, **_CFG)
    cm = gs.compile(fn, plan="seco", chunk_size=chunk)
    seco = measure(step(lambda m, b: cm(m, b)), model, batch, warmup=1)  # warmup: capture
    plain = measure(step(fn), model, batch)
    return plain.peak_bytes, seco.peak_bytes, cm.graph.seco_0.program.cache_bytes()


def test_peak_grows_only_with_the_kv_cache() -> None:
    (p1, s1, kv1), (p4, s4, kv4) = _peaks(64, 16), _peaks(256, 16)
    plain_slope = (p4 - p1) / (256 - 64)
    seco_slope = (s4 - s1) / (256 - 64)
    kv_slope = (kv4 - kv1) / (256 - 64)
    assert seco_slope <= 5 * kv_slope  # cache + its cotangent + transient prefix gradients
    assert plain_slope >= 6 * seco_slope  # plain autograd keeps every layer's activations per step
    assert s4 < p4


@pytest.mark.slow  # keeps the default suite under 15 min on 2 cores; `make test-all` runs it
def test_peak_follows_one_chunk_and_one_chunk_costs_plain() -> None:
    fn, (model, batch) = llama_loss(seq_len=256, **_CFG)
    plain = measure(step(fn), model, batch).peak_bytes
    peaks = {}
    for chunk in (16, 64, 256):
        cm = gs.compile(fn, plan="seco", chunk_size=chunk)
        peaks[chunk] = measure(step(lambda m, b: cm(m, b)), model, batch, warmup=1).peak_bytes
    assert peaks[16] < peaks[64] < peaks[256]
    assert abs(peaks[256] - plain) <= 0.05 * plain  # one chunk = the whole sequence = plain autograd


def test_backward_peak_is_bounded_by_one_chunk_on_the_timeline() -> None:
    """During the backward, live bytes are at most: the parameter gradients, the activations
    one 16-step chunk saves (plain autograd on a 16-step sequence) and cache-sized buffers."""
    fn, (model, batch) = llama_loss(seq_len=96, **_CFG)
    cm = gs.compile(fn, plan="seco", chunk_size=16)
    cm(model, batch)  # capture outside the measurement
    plain = measure(step(fn), model, batch).peak_bytes
    fn16, (model16, batch16) = llama_loss(seq_len=16, **_CFG)
    one_chunk = measure(step(fn16), model16, batch16).saved_bytes
    with LiveTensorTracker(timeline=True) as tracker:
        loss = cm(model, batch)
        tracker.mark("backward")
        loss.backward()
    samples = tracker.timeline
    start = max(i for i, s in enumerate(samples) if s.phase == "mark" and s.op == "backward")
    base = samples[start].live_bytes
    live = [s.live_bytes - base for s in samples[start:]]
    kv = cm.graph.seco_0.program.cache_bytes()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert max(live) <= params + one_chunk + 4 * kv
    assert max(live) < 0.6 * plain
    # the 6 chunks allocate far more than is ever live at once: each chunk's memory is reused
    allocated = sum(max(0, b - a) for a, b in zip(live, live[1:]))
    assert allocated >= 4 * max(live)
