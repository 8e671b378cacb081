"""IR records shared by every pass: source locations, regions, pass records, stages.

All records are frozen dataclasses: a pass never edits a record, it returns new ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

try:  # Inductor's own graph modules: Python code generated at the first call, not at construction
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModuleClass
except ImportError:  # pragma: no cover - an older torch: code generated at construction
    _GraphModuleClass = fx.GraphModule

__all__ = ["SourceLoc", "Region", "PassRecord", "Stage", "source_of", "graph_module", "is_call_input",
           "is_view_node"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')
_INTERNAL = ("/torch/", "/gradshard/", "/passes/", "/kernels/", "<eval_with_key>")


@dataclass(frozen=True)
class SourceLoc:
    """The user source line that produced a node (innermost non-library frame)."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.code.strip()}"


def source_of(node: fx.Node) -> SourceLoc | None:
    """Parse ``node.meta['stack_trace']`` and return the innermost user frame."""
    trace = node.meta.get("stack_trace") or ""
    frames = [m.groupdict() for m in _FRAME.finditer(trace)]
    if not frames:
        return None
    user = [f for f in frames if not any(s in f["file"] for s in _INTERNAL)]
    f = (user or frames)[-1]
    return SourceLoc(f["file"], int(f["line"]), f["func"], f["code"])


@dataclass(frozen=True)
class Region:
    """A subgraph whose memory grows with sequence length, found by a detect pass.

    ``kind`` is one of ``linear_recurrence``, ``attention``, ``linear_attention``,
    ``sliceable_matmul`` (or a plan-specific kind); ``nodes`` are node names in the graph
    the region was found in; ``time_axis`` is the time dimension of the region's main
    output; ``options`` holds kind-specific facts (e.g. ``{"form": "diagonal"}``).
    """

    kind: str
    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    time_axis: int | None
    source: SourceLoc | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        where = f" at {self.source}" if self.source else ""
        return f"{self.kind} {self.name} (time axis {self.time_axis}{'; ' + opts if opts else ''}){where}"


@dataclass(frozen=True)
class PassRecord:
    """Provenance of one pass run: the graph before/after and what changed."""

    name: str
    doc: str
    changed: bool
    before: str
    after: str
    created: tuple[str, ...]
    erased: tuple[str, ...]
    notes: tuple[str, ...]
    regions: tuple[Region, ...]
    seconds: float


@dataclass(frozen=True)
class Stage:
    """One unit of the scheduled program.

    ``kind`` is e.g. ``forward``, ``forward_chunk``, ``adjoint_scan``, ``vjp_shard``,
    ``send``, ``recv``, ``accumulate``, ``autograd_backward``. ``memory_bytes`` is the
    activation memory the stage holds while it runs, ``flops`` its arithmetic; both are
    numbers for the captured shapes (the symbolic forms live in ``gradshard.cost``).
    ``kernel`` names what runs it (``torch``, ``triton:linear_scan``, ...).
    """

    name: str
    kind: str
    phase: str  # "forward" | "backward"
    region: str | None = None
    nodes: tuple[str, ...] = ()
    memory_bytes: int = 0
    flops: int = 0
    kernel: str = "torch"
    note: str = ""


def is_call_input(ph: fx.Node, untagged: bool = True) -> bool:
    """A placeholder that is a call input (``input{i}``), not a parameter or buffer (named after
    the module state by the capture); an untagged placeholder counts as an input if ``untagged``."""
    name = ph.meta.get("gs_input_name")
    return untagged if name is None else str(name).startswith("input")


def is_view_node(node: fx.Node) -> bool:
    """Whether ``node`` runs an aten op whose result aliases its input (``view``, ``transpose``, ...)."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def graph_module(root: torch.nn.Module | dict, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """A graph module of ``graph`` (attributes from ``root``) whose Python code is generated when it
    is first called or printed, not here: most graphs a compile builds (checks, proofs, shape
    propagations at other lengths) are only walked node by node, and generating and compiling the
    code of each took a fifth of a compile."""
    return _GraphModuleClass(root, graph, class_name)
