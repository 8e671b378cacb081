"""A time axis reshaped into blocks and merged back is the time axis again (issue 16).

Mamba-2's SSD (Hugging Face ``torch_forward`` of bamba, granitemoehybrid, nemotron_h, ...)
splits time into ``(T/c, c)`` blocks, scans inside and across the blocks, and merges the
blocks back. When ``T`` is a multiple of ``c`` nothing pads the axis, its label is linked to
nothing yet at the split, so the blocks get fresh labels; the rules checked here:

* merging exactly those blocks back, in order, restores the input's labels (dims);
* a scan along a block counts as evidence for the axis the block was split from;
* the time class holds an axis of the caller's inputs when any evidence class does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradshard.analysis.dims import analyze_dims
from gradshard.analysis.locality import analyze_time_locality
from gradshard.capture import capture

aten = torch.ops.aten


class BlockCumsum(nn.Module):
    """Cumsum along time computed blockwise: split ``(B, T, D)`` into ``(B, T/c, c, D)``,
    scan inside each block and across block totals, merge the blocks back. ``pad`` pads T up to
    a multiple of ``c`` first and slices the result back (what SSD does at other T)."""

    def __init__(self, c: int = 4, pad: bool = False, transpose_blocks: bool = False) -> None:
        super().__init__()
        self.c, self.pad, self.transpose_blocks = c, pad, transpose_blocks
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.proj(x)
        extra = (-T) % self.c if self.pad else 0
        if extra:
            h = nn.functional.pad(h, (0, 0, 0, extra))
        n = (T + extra) // self.c
        blocks = h.reshape(B, n, self.c, D)
        within = blocks.cumsum(2)  # along the in-block position
        totals = within[:, :, -1]
        before = totals.cumsum(1) - totals  # along the block index: what precedes each block
        y = within + before[:, :, None]
        if self.transpose_blocks:
            y = y.transpose(1, 2)  # (B, c, n, D): merging this is not time order
        y = y.reshape(B, n * self.c, D)
        return y[:, :T] if extra else y


class NestedBlocks(nn.Module):
    """Time split into ``(T/4, 4)``, the block split again into ``(2, 2)``, all merged at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        y = x.reshape(B, T // 4, 4, D).reshape(B, T // 4, 2, 2, D)
        y = y.cumsum(3).cumsum(2).cumsum(1)
        return y.reshape(B, T, D)


class InternalScans(nn.Module):
    """Two cumsums along an axis made inside the graph, one along the input's time axis."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.arange(6, dtype=x.dtype).cumsum(0).cumsum(0)
        return x.cumsum(1) * inner.sum()


def _analyze(model: nn.Module, x: torch.Tensor):
    cap = capture(model, (x,))
    return cap, analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)


def _output(cap) -> torch.fx.Node:
    return next(iter(cap.gm.graph.find_nodes(op="output"))).args[0][0]


def _user_input(cap) -> torch.fx.Node:
    return next(p for p in cap.gm.graph.find_nodes(op="placeholder")
                if str(p.meta.get("gs_input_name", "")).startswith("input"))


def _reshapes(cap) -> list[torch.fx.Node]:
    return [n for n in cap.gm.graph.nodes if n.target in (aten.reshape.default, aten.view.default)]


def test_split_then_merge_of_a_multiple_of_the_block_finds_time_on_the_input() -> None:
    cap, tl = _analyze(BlockCumsum(c=4), torch.randn(2, 12, 8))
    x = _user_input(cap)
    assert tl.time_inputs == {x.name: 1}
    assert tl.seq_len == 12
    assert tl[_output(cap)].time_dims == (1,)
    assert tl[_output(cap)].reach.lo == -float("inf")  # reads from step 0 on, through the blocks
    # the blocks are not the time axis themselves: the split gives them fresh labels ...
    split, merge = _reshapes(cap)[0], _reshapes(cap)[-1]
    assert tl[split].time_dims == ()
    # ... and the merge of exactly those blocks gives the input's label back
    assert tl[merge].time_dims == (1,)
    # the scans along the blocks are what found the axis
    assert sum("a block of this axis" in why for why in tl.evidence[str(tl.time_class)]) == 2


def test_the_split_is_recorded_and_the_merge_restores_the_labels() -> None:
    cap = capture(BlockCumsum(c=4), (torch.randn(2, 12, 8),))
    dims = analyze_dims(cap.gm)
    x = _user_input(cap)
    time_label = dims.input_labels[x.name][1]
    split, merge = _reshapes(cap)[0], _reshapes(cap)[-1]
    recs = [r for r in dims.splits if dims.canon(time_label) in {dims.canon(l) for l in r.whole}]
    assert [tuple(s for _, s in r.pieces) for r in recs] == [(3, 4)]
    block_labels = dims.dims_of(split).dims[1:3]
    assert [ls for ls in block_labels] == [frozenset([l]) for l, _ in recs[0].pieces]
    merged = dims.dims_of(merge)
    assert {dims.canon(l) for l in merged.dims[1]} == {dims.canon(time_label)}
    assert merged.factors is not None and len(merged.factors[1]) == 1  # one factor again: splittable anew


def test_blocks_merged_out_of_order_are_not_the_time_axis() -> None:
    cap = capture(BlockCumsum(c=4, transpose_blocks=True), (torch.randn(2, 12, 8),))
    dims = analyze_dims(cap.gm)
    time_cls = dims.canon(dims.input_labels[_user_input(cap).name][1])
    merged = dims.dims_of(_reshapes(cap)[-1])
    assert time_cls not in {dims.canon(l) for l in merged.dims[1]}


def test_nested_splits_merged_at_once_restore_the_time_axis() -> None:
    cap, tl = _analyze(NestedBlocks(), torch.randn(2, 16, 8))
    assert tl.time_inputs == {_user_input(cap).name: 1}
    assert tl[_output(cap)].time_dims == (1,)


def test_padded_odd_length_still_finds_time() -> None:
    cap, tl = _analyze(BlockCumsum(c=4, pad=True), torch.randn(2, 13, 8))
    assert tl.time_inputs == {_user_input(cap).name: 1}
    assert tl.seq_len == 13
    out = tl[_output(cap)]
    # the blocks have no time axis, so the analysis cannot prove causality through them; it
    # must not claim less than they read: output step t reads step 0
    assert out.time_dims == (1,) and out.reach.lo == -float("inf")


def test_time_class_holds_an_input_axis_over_more_evidence_elsewhere() -> None:
    cap, tl = _analyze(InternalScans(), torch.randn(2, 9, 3))
    # the arange's axis has two cumsums, the input's time axis one: the input's wins
    assert max(len(v) for v in tl.evidence.values()) == 2
    assert len(tl.evidence[str(tl.time_class)]) == 1
    assert tl.time_inputs == {_user_input(cap).name: 1}


def test_seco_refuses_blocks_it_cannot_chunk_naming_the_split() -> None:
    """The time axis is found now, but seco cannot chunk a blocked computation it does not
    recognise (SSD is rewritten into a scan first): a refusal naming the split, not a wrong
    gradient."""
    import gradshard as gs
    from gradshard.errors import UnsupportedGraphError

    model = BlockCumsum(c=4).double()
    with pytest.raises(UnsupportedGraphError, match=r"node `reshape`.*\n.*blocks = h\.reshape"):
        gs.compile(model, plan="seco", chunk_size=4)(torch.randn(2, 12, 8, dtype=torch.float64))
