"""Schedule: turn a rewritten graph into a program of stages in a networkx DAG.

Plain graph nodes between region modules form ``forward`` segments, each paired with an
``autograd_backward`` stage. A region module (a ``call_module`` node whose module has a
``stages()`` method, installed by a rewrite pass) contributes its own stages — forward
chunks, adjoint scans, VJP shards, send/recv — in the order its runtime executes them.
Edges follow data dependencies forward and reversed for the backward; the order is a
topological sort that runs the forward in graph order and the backward in reverse, which
bounds live memory to what each stage saved plus the stage running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import networkx as nx
import torch.fx as fx

from .analysis.node_costs import node_cost
from .ir import Stage

__all__ = ["Program", "build_program"]


@dataclass(frozen=True)
class Program:
    """The scheduled program: stages in execution order and their dependency DAG."""

    stages: tuple[Stage, ...]
    dag: nx.DiGraph

    @property
    def forward(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.phase == "forward")

    @property
    def backward(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.phase == "backward")

    @property
    def total_flops(self) -> int:
        return sum(s.flops for s in self.stages)

    def estimated_peak_bytes(self) -> int:
        """Saved bytes of forward stages still awaiting their backward, plus the running stage."""
        live = peak = 0
        for s in self.stages:
            if s.phase == "forward":
                live += s.memory_bytes
                peak = max(peak, live)
            else:
                peak = max(peak, live + s.memory_bytes)
                live -= sum(f.memory_bytes for f in self.stages if f.name == s.note)
        return peak

    def describe(self) -> str:
        lines = [f"{len(self.stages)} stages ({len(self.forward)} forward, {len(self.backward)} backward)"]
        for i, s in enumerate(self.stages):
            region = f" [{s.region}]" if s.region else ""
            lines.append(f"  {i:3d} {s.phase:8s} {s.kind:18s} {s.name}{region} "
                         f"mem={s.memory_bytes:,}B flops={s.flops:,} kernel={s.kernel}")
        return "\n".join(lines)


def block_key(node: fx.Node) -> str | None:
    """The repeated block a node belongs to: the first module path ending in an index
    (``layers.0``), else the top-level child module; ``None`` when unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    for p in paths:
        if p.split(".")[-1].isdigit():
            return p
    inner = [p for p in paths if p and "." not in p and p != paths[0]]
    return inner[0] if inner else (paths[0] if paths else None)


def _segments(gm: fx.GraphModule) -> Iterable[tuple[str, list[fx.Node]]]:
    """Split the graph into runs of plain nodes (one per model block) and staged region nodes."""
    run: list[fx.Node] = []
    key: str | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        if mod is not None and hasattr(mod, "stages"):
            if run:
                yield "plain", run
                run = []
            yield "region", [node]
            continue
        k = block_key(node)
        if run and k is not None and key is not None and k != key:
            yield "plain", run
            run = []
        key = k if k is not None else key
        run.append(node)
    if run:
        yield "plain", run


def build_program(gm: fx.GraphModule) -> Program:
    """Build the stage program of ``gm`` (see module doc)."""
    dag = nx.DiGraph()
    forward: list[Stage] = []
    backward_of: dict[str, list[Stage]] = {}
    owner: dict[str, str] = {}  # node name -> forward stage name
    seg_id = 0
    flops_seen: dict = {}  # node_cost replays each distinct op signature once
    for kind, nodes in _segments(gm):
        if kind == "region":
            node = nodes[0]
            mod = gm.get_submodule(node.target)
            st = list(mod.stages())
            fwd = [s for s in st if s.phase == "forward"]
            bwd = [s for s in st if s.phase == "backward"]
            anchor = fwd[-1].name if fwd else f"{node.name}:forward"
            for s in fwd:
                forward.append(s)
                dag.add_node(s.name, stage=s)
            for a, b in zip(fwd, fwd[1:]):
                dag.add_edge(a.name, b.name)
            for a, b in zip(bwd, bwd[1:]):
                dag.add_edge(a.name, b.name)
            for s in bwd:
                dag.add_node(s.name, stage=s)
            if fwd and bwd:
                dag.add_edge(anchor, bwd[0].name)
            backward_of[anchor] = bwd
            owner[node.name] = anchor
            first = fwd[0].name if fwd else anchor
            deps = {owner[a.name] for a in node.all_input_nodes if a.name in owner}
            for d in deps:
                dag.add_edge(d, first)
                for bs in bwd[-1:]:
                    for db in backward_of.get(d, [])[:1]:
                        dag.add_edge(bs.name, db.name)
            continue
        costs = [node_cost(n, flops_seen) for n in nodes]
        block = next((k for k in map(block_key, nodes) if k), None)
        name = f"{block or 'segment'}#{seg_id}"
        seg_id += 1
        saved = sum(c.out_bytes for c in costs)
        kernels = sorted({n.meta["gs_kernel"] for n in nodes if "gs_kernel" in n.meta})
        kernel = "torch" + "".join(f" + {k}" for k in kernels)
        fs = Stage(name=name, kind="forward", phase="forward", nodes=tuple(n.name for n in nodes),
                   memory_bytes=saved, flops=sum(c.fwd_flops for c in costs), kernel=kernel)
        bs = Stage(name=f"{name}:backward", kind="autograd_backward", phase="backward",
                   nodes=fs.nodes, memory_bytes=0, flops=sum(c.bwd_flops for c in costs), note=name,
                   kernel=kernel)
        forward.append(fs)
        backward_of[name] = [bs]
        dag.add_node(name, stage=fs)
        dag.add_node(bs.name, stage=bs)
        dag.add_edge(name, bs.name)
        for n in nodes:
            owner[n.name] = name
        deps = {owner[a.name] for n in nodes for a in n.all_input_nodes if owner.get(a.name, name) != name}
        for d in deps:
            dag.add_edge(d, name)
            for db in backward_of.get(d, [])[:1]:
                dag.add_edge(bs.name, db.name)
    # forward in graph order, then backward in reverse graph order
    position = {s.name: i for i, s in enumerate(forward)}
    rank: dict[str, tuple[int, int]] = {}
    for anchor, bwd in backward_of.items():
        for j, s in enumerate(bwd):
            rank[s.name] = (1, -position.get(anchor, 0) * 1000 + j)
    for s in forward:
        rank[s.name] = (0, position[s.name])
    order = list(nx.lexicographical_topological_sort(dag, key=lambda n: rank.get(n, (2, 0))))
    stages = tuple(dag.nodes[n]["stage"] for n in order)
    return Program(stages=stages, dag=dag)
