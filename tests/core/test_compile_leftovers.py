"""What a compile leaves in the process besides its entry (issue 17: RSS kept by the first step).

Counted on the objects themselves, not on RSS: the fake-tensor dispatch cache, fx's store of
generated sources, the nodes a loop roll erased, and the captured graph a compiled entry keeps.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.graph_module import _loader

import gradshard as gs
from gradshard.examples import factories
from gradshard.fake import private_dispatch_cache


def _loop_model(T: int = 300):
    """The example SSM written as a Python loop over time (67 steps unrolled in the probe)."""
    return factories.ssm_loop(seq_len=T, batch=1, d_model=16, n_layers=2)


def test_a_compile_leaves_the_fake_tensor_dispatch_cache_as_it_found_it() -> None:
    model, (ids,) = _loop_model()
    before = set(FakeTensorMode.cache)
    gs.compile(model, plan="adjoint", shard_size=64).compiled_for(ids)
    assert set(FakeTensorMode.cache) - before == set()


def test_a_call_at_a_new_length_leaves_the_fake_tensor_dispatch_cache_as_it_found_it() -> None:
    """Regions re-specialise their per-shard graphs at a call's first use of a length (verified
    on fake tensors): those dispatches must not stay in torch's process-wide cache either."""
    model, (ids,) = _loop_model(T=300)
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    cm(ids).float().mean().backward()
    before = set(FakeTensorMode.cache)
    cm(ids[:, :250]).float().mean().backward()  # new shard and window lengths: 250 = 3 x 64 + 58
    assert set(FakeTensorMode.cache) - before == set()


def test_the_private_dispatch_cache_keeps_what_was_there_and_serves_repeats_inside() -> None:
    with FakeTensorMode():
        torch.ones(3, 5) @ torch.ones(5, 2)  # an entry made before the block
    before = set(FakeTensorMode.cache)
    assert before
    with private_dispatch_cache():
        with FakeTensorMode():
            torch.ones(7, 11) @ torch.ones(11, 13)
            inside = set(FakeTensorMode.cache) - before
            hits = FakeTensorMode.cache_hits
            torch.ones(7, 11) @ torch.ones(11, 13)
            assert FakeTensorMode.cache_hits > hits
        assert inside
    assert set(FakeTensorMode.cache) == before


def test_a_compile_keeps_only_the_generated_sources_of_the_graphs_it_keeps() -> None:
    model, (ids,) = _loop_model()
    before = set(_loader.eval_cache)
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    cm.compiled_for(ids)
    # graph modules generate their code at the first call: those not called yet have none to keep
    kept = {type(sub).forward.__code__.co_filename for root in cm._kept_graph_modules() for sub in root.modules()
            if isinstance(sub, fx.GraphModule) and type(sub).forward.__code__.co_filename.startswith("<eval_with_key>")}
    new = set(_loader.eval_cache) - before
    with_source = {k for k in new if _loader.eval_cache[k]}
    assert kept <= new | before and with_source == kept & new  # released keys keep an empty source
    assert len(new) > len(with_source)  # the passes recompiled intermediate graphs; their sources went


def test_nodes_a_loop_roll_erased_are_freed() -> None:
    model, (ids,) = _loop_model()
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    entry = cm.compiled_for(ids)
    cap = entry.captured.gm
    rolled = sum(1 for r in entry.records if r.name == "roll_loops" and r.changed)
    assert rolled, [r.name for r in entry.records]
    table = cap.graph._graph_namespace._obj_to_name
    assert not [n for n in table if isinstance(n, fx.Node) and n._erased]
    live = {n for n in cap.graph.nodes}
    assert all(n in live for n in table if isinstance(n, fx.Node))


def test_the_entry_keeps_the_captured_code_not_a_copy_of_the_graph() -> None:
    model, (ids,) = _loop_model()
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    entry = cm.compiled_for(ids)
    assert entry.original.code == entry.records[0].before  # the capture as the first pass saw it
    assert entry.original.num_nodes > len(entry.captured.gm.graph.nodes)  # 67 steps unrolled, then rolled
    assert f"captured {entry.original.num_nodes} nodes" in cm.explain()


def test_nothing_outside_the_compiled_module_holds_its_graphs() -> None:
    model, (ids,) = _loop_model()
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    entry = cm.compiled_for(ids)
    ref = weakref.ref(entry.gm)
    del entry, cm
    gc.collect()
    assert ref() is None


@dataclasses.dataclass
class _Output:
    """Shaped like a ``transformers`` ModelOutput: a dataclass of tensors and a cache object."""

    logits: torch.Tensor
    extras: dict
    cache: object


class _Cache:
    def __init__(self, states: list[torch.Tensor]) -> None:
        self.states = states
        self.seen = len(states)


class _StructuredOutput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> _Output:
        logits = self.model(ids)
        return _Output(logits=logits, extras={"pair": (logits[:, :1], logits.sum())}, cache=_Cache([logits[:, -1:]]))


def _traced_fakes_with_history() -> int:
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is FakeTensor and o.grad_fn is not None)


def test_a_structured_output_does_not_keep_the_traced_forward_alive() -> None:
    """The capture traces above autograd on fake tensors: its outputs carry the whole forward's
    autograd graph (which only C++ keeps alive, so ``gc`` cannot free it). The function that
    rebuilds a dataclass / dict / tuple / object output must not hold those outputs."""
    model, (ids,) = factories.ssm(seq_len=90, batch=1, d_model=16, n_layers=2)
    before = _traced_fakes_with_history()
    cm = gs.compile(_StructuredOutput(model), plan="adjoint", shard_size=32)
    out = cm(ids)
    (out.logits.sum() + out.extras["pair"][1] + out.cache.states[0].sum()).backward()
    assert out.cache.seen == 1 and out.extras["pair"][0].shape == (1, 1, out.logits.shape[-1])
    assert _traced_fakes_with_history() == before


def test_a_length_check_leaves_no_region_graphs_at_its_length() -> None:
    """A first call at T=300 is served from the program compiled at the 67-step probe after a
    check one step longer (T=68: shards of 64 and 4 steps). The graphs the regions re-specialised
    for the check are copies nothing runs again: only the call's own shard lengths stay."""
    model, (ids,) = factories.ssm(seq_len=300, batch=1, d_model=16, n_layers=2)
    cm = gs.compile(model, plan="adjoint", shard_size=64)
    cm(ids).float().mean().backward()
    assert "re-specialised (no new capture)" in cm.explain()
    regions = [m for root in cm._kept_graph_modules() for m in root.modules()
               if callable(getattr(m, "length_keys", None))]
    assert len(regions) >= 3  # two recurrences and the tail
    lengths = {key[1] if isinstance(key, tuple) else key for r in regions for key in r.length_keys()}
    assert lengths == {64, 300 % 64}


def test_a_probe_keeps_one_graph_to_serve_from() -> None:
    """seco compiles a long first call's probe only through its length-generic passes, never runs
    it, and serves the call from the graph those passes kept: the probe entry holds that graph,
    not a second copy of it."""
    model, (ids,) = factories.ssm(seq_len=300, batch=1, d_model=16, n_layers=2)
    cm = gs.compile(model, plan="seco", chunk_size=64)
    cm(ids).float().mean().backward()
    (probe,) = cm._probes.values()
    assert probe.gm is probe.ctx.plan_state["length_generic"].graph
