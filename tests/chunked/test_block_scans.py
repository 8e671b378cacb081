"""seco/spaco on a scan read only through contractions (SSD, decayed linear attention): each chunk
runs the block form from the carried state and never forms the chunk's per-step states; exact."""

from __future__ import annotations

import pytest
import torch

from tests.adjoint.helpers import assert_same_grads
from tests.adjoint.models import SsdNet
from tests.adjoint.test_chunked_shards import StateWatch

F64 = torch.float64


def _block_rules(cm) -> list[str]:
    region = next(m for m in cm.graph.modules() if hasattr(m, "program"))  # seco_0 / spaco_0
    rules = region.program.rules.values()
    return [r.note for r in rules if r.reads is not None]


@pytest.mark.parametrize("plan", ["seco", "spaco"])
@pytest.mark.parametrize("decay,learn_h0,layout", [
    ("exp", False, "pn"), ("exp", True, "pn"), ("sigmoid", False, "pn"),  # SSD: log-decay / lightning op
    ("const", True, "kv"),  # linear attention, a constant decay per head
])
def test_block_read_scans_are_exact_without_per_step_states(plan, decay, learn_h0, layout):
    torch.manual_seed(0)
    model = SsdNet(decay=decay, learn_h0=learn_h0, layout=layout).double()
    x = torch.randn(2, 37, 6, dtype=F64)  # chunks of 8: four full, one of 5
    options = {"chunk_size": 8} if plan == "seco" else {"chunk_size": 8, "budget": 5}  # spaco: every chunk
    cm = assert_same_grads(model, (x,), plan=plan, **options)
    assert len(_block_rules(cm)) == 4  # per layer: the scan and its contraction
    assert cm.explain().count("block-read scan") == 2
    watch = StateWatch((3, 4, 5) if layout == "pn" else (3, 5, 4))
    with watch:
        cm(x.requires_grad_()).square().sum().backward()
    # carries, one cached step, and the block form's per-block states (two blocks of a chunk):
    # never the chunk's 8 per-step states
    assert 0 < watch.most_steps <= 2


def test_a_chunk_inside_a_window_reads_the_steps_before_from_its_start():
    """Chunks shorter than the block form's blocks and a final state read by a later layer's
    convolution window: the scan is asked for states inside chunks (summed from the chunk's start)."""
    torch.manual_seed(3)
    model = SsdNet(decay="exp", learn_h0=True, layers=3).double()
    x = torch.randn(3, 23, 6, dtype=F64)
    assert_same_grads(model, (x,), plan="seco", chunk_size=3)
