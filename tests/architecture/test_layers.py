"""The rooms import one way: built from the source, the import graph has no cycle between
modules or rooms, and every room imports only rooms below it in :data:`LAYERS`."""

from __future__ import annotations

import networkx as nx

from tests.architecture.import_graph import SOURCES, import_graph, module_files, room_graph, room_of

# Bottom to top. A room may import the rooms listed before it, never one after it.
LAYERS = (
    "gradshard.ir",           # regions, stages, pass records: plain frozen dataclasses
    "gradshard.errors",       # error types (name nodes and source lines from ir)
    "gradshard.fake",         # running graphs on fake tensors
    "gradshard.autocast",     # the autocast state: read, re-entered, switched off
    "gradshard.units",        # formatting bytes, FLOPs, seconds, counts
    "gradshard.pipeline",     # the pass protocol and pass manager
    "gradshard.kernels",      # torch / Triton implementations and the public kernel front doors
    "gradshard.analysis",     # dims, time locality, effects: read a graph, never change it
    "gradshard.ops",          # custom ops: definition, fake, VJP, kernel binding, analysis rules
    "gradshard.capture",      # model -> aten fx graph on fake tensors
    "gradshard.passes",       # graph -> graph passes shared by plans (detect, roll, canonicalise, lower)
    "gradshard.runtime",      # run-time machinery shared by plans (communication with timeouts)
    "gradshard.plans",        # one folder per plan: options, pass list, own passes, runtime modules
    "gradshard.schedule",     # rewritten graph -> program of stages
    "gradshard.compose",      # hand the segments a plan does not rewrite to Inductor
    "gradshard.api",          # compile / CompiledModule / backend: drives the pipeline
    "gradshard.measure",      # measuring steps (torch's counters)
    "gradshard.cost",         # symbolic cost model
    "gradshard.autoplan",     # plan="auto": the cost model chooses the plan
    "gradshard.distributed",  # outer loops and checkpoints across ranks
    "gradshard.examples",     # demo models shipped with the package
    "gradshard.bench",        # benchmarks shipped with the package
    "gradshard.cli",          # the `gradshard` command
    "gradshard",              # the package's public face
)


def test_every_module_lives_in_a_known_room() -> None:
    rooms = {room_of(m) for m in module_files()}
    assert rooms <= set(LAYERS), f"rooms missing from LAYERS: {sorted(rooms - set(LAYERS))}"


def test_no_import_cycle_between_modules() -> None:
    g = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"modules importing each other: {cycles}"


def test_rooms_import_one_way() -> None:
    g = import_graph()
    rank = {room: i for i, room in enumerate(LAYERS)}
    upward = [f"{a} -> {b}" for ra, rb, data in room_graph(g).edges(data=True)
              if rank[rb] > rank[ra] for a, b in data["via"]]
    assert not upward, "imports from a lower room into a higher one:\n" + "\n".join(upward)


def test_the_graph_sees_lazy_and_named_imports() -> None:
    """The builder counts imports inside functions and module names in strings."""
    g = import_graph()
    assert set(SOURCES) == {"gradshard", "gradshard.passes", "gradshard.kernels"}
    # capture's substitution table names its twins as "module:function" strings
    assert g.has_edge("gradshard.capture.substitutions", "gradshard.capture.twins_mamba")
