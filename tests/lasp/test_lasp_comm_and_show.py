"""Communication volume of plan="lasp" and what `gradshard show --plan lasp` prints.

Bytes are measured by wrapping the step in a CommCounter: per layer and direction a rank
sends exactly one KV state, B·H·dk·dv·element_size, whatever the sequence length.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from rich.console import Console

import gradshard as gs
from examples import factories
from gradshard.runtime.comm import CommCounter
from gradshard.distributed.testing import run_threaded
from gradshard.plans.lasp.runtime import dkv_label, kv_label, local_slice

B, H, DK, DV = 3, 4, 8, 8  # the example factory: d_model 32, 4 heads


def _step_bytes(seq_len: int, world: int) -> list[dict[str, int]]:
    model, (ids,) = factories.linear_attention_gradshard(seq_len=seq_len, batch=B, dtype=torch.float64)

    def body(rank: int, group: Any) -> dict[str, int]:
        cm = gs.compile(copy.deepcopy(model), plan="lasp", group=group)
        x = local_slice(ids, rank, world)
        cm(x)  # compile outside the counted step
        with CommCounter(group) as counter:
            cm(x).sum().backward()
        out = {}
        for layer in (0, 1):
            out[f"kv{layer}"] = counter.bytes(kv_label(layer), "send")
            out[f"dkv{layer}"] = counter.bytes(dkv_label(layer), "send")
        out["messages"] = counter.messages(direction="send")
        return out

    return run_threaded(world, body)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bytes_per_layer_are_one_state_and_independent_of_t(world: int) -> None:
    state = B * H * DK * DV * 8  # float64
    short, long = _step_bytes(23, world), _step_bytes(61, world)
    assert short == long
    for rank, got in enumerate(short):
        for layer in (0, 1):
            assert got[f"kv{layer}"] == (state if rank < world - 1 else 0)
            assert got[f"dkv{layer}"] == (state if rank > 0 else 0)
        assert got["messages"] == 2 * ((rank < world - 1) + (rank > 0))


def test_show_lists_send_and_recv_stages_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradshard.cli import main as cli

    buf = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=buf, width=240, color_system=None))
    rc = cli.main(["show", "examples/factories.py:linear_attention", "--plan", "lasp", "--max-lines", "2"])
    text = buf.getvalue()
    assert rc == 0, text
    for layer in (0, 1):
        for stage in ("recv_kv", "send_kv", "recv_dkv", "send_dkv"):
            assert f"lasp_{layer}:{stage}" in text
    assert "lasp_grad_sync:all_reduce" in text


def test_stages_name_peers_and_bytes() -> None:
    model, (ids,) = factories.linear_attention_gradshard(seq_len=23, batch=B, dtype=torch.float64)

    def body(rank: int, group: Any) -> list:
        cm = gs.compile(copy.deepcopy(model), plan="lasp", group=group)
        cm.compiled_for(local_slice(ids, rank, 2))
        return [(s.name, s.kind, s.phase, s.note) for s in cm.program.stages if s.region == "lasp_0"]

    r0, r1 = run_threaded(2, body)
    state = B * H * DK * DV * 8
    kinds0 = {name.split(":")[1]: (kind, phase, note) for name, kind, phase, note in r0}
    assert kinds0["send_kv"][:2] == ("send", "forward") and "to rank 1" in kinds0["send_kv"][2]
    assert f"{state:,} B" in kinds0["send_kv"][2] and "none" in kinds0["recv_kv"][2]
    kinds1 = {name.split(":")[1]: (kind, phase, note) for name, kind, phase, note in r1}
    assert kinds1["recv_kv"][:2] == ("recv", "forward") and "from rank 0" in kinds1["recv_kv"][2]
    assert kinds1["send_dkv"][:2] == ("send", "backward") and "to rank 0" in kinds1["send_dkv"][2]
    order = [name.split(":")[1] for name, *_ in r1]
    assert order.index("recv_kv") < order.index("local") < order.index("send_kv")
    assert order.index("recv_dkv") < order.index("local_backward") < order.index("send_dkv")
