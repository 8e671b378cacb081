"""Runs of time-local nodes evaluated as one compiled function per chunk window.

The chunk evaluator (:mod:`gradshard.plans.chunked.evaluate`) runs the captured graph node
by node: a Python-level rule call per node and window, in the forward and again in the
backward recompute. Most nodes of a transformer are *local*: norms, projections, RoPE, the
MLP, residual adds, each reading its inputs on its own window. When the program is composed
with a compiler (``ChunkedRegion.use_graph_compiler``), :func:`find_local_groups` partitions
those nodes into groups that run as one call:

* members: ``local`` rules that run a plain op, a reshape, an expand or a cat
  (:data:`_POSITION_FREE`: their result depends on the window's *width* only, never on where it
  starts), one time dim, a tensor output, and every argument read on the node's own window
  (``DimMap("same")``) or without time;
* a group is a connected set of members linked by such same-window edges, all at the same
  *level* (the number of non-member hops on the longest path from the inputs), which makes
  it convex: nothing outside it sits between two of its nodes, so it can run as one call
  before its consumers;
* its inputs are the values it reads from outside, its outputs the members read outside it
  (or pinned by the program: region outputs, cache points, loss terms).

:class:`GroupRunner` traces a group's rules on the first window of each width and input
signature with ``make_fx`` (the same rule calls the evaluator makes, recorded as aten ops),
compiles the trace with the region's compiler, and keeps it: a forward chunk (no grad) and a
backward recompute (grad; the compiled function is differentiable) are two variants. A group
whose trace or compile fails is left to the per-node path (logged), and so are windows past
:data:`MAX_VARIANTS` variants (a model called at ever new lengths gets a new ragged last chunk
each time: it would otherwise compile at every step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from gradshard.errors import summary
from gradshard.ir import is_view_node
from gradshard.plans.chunked.frames import SKIP, Demand
from gradshard.plans.chunked.rules import default_run
from gradshard.plans.chunked.rules_local import _cat_run, _expand_run, _reshape_run
from gradshard.runtime.compiled import CompiledCalls, GraphCompiler, signature, trace_and_compile

__all__ = ["LocalGroup", "find_local_groups", "GroupRunner", "GroupCache", "MAX_VARIANTS"]

log = logging.getLogger("gradshard")

#: compiled variants a group keeps at most; further windows run node by node
MAX_VARIANTS = 16

#: rule runs whose output depends on the window's width only (not on its start)
_POSITION_FREE = (default_run, _reshape_run, _expand_run, _cat_run)


@dataclass(frozen=True)
class LocalGroup:
    """Members in graph order, the outside values they read (slot order), the members read outside."""

    index: int
    members: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: per output, how many member slots read it (released when the group runs)
    internal_uses: tuple[int, ...]
    #: every member slot reading an input (with repeats): the evaluator releases each once
    input_reads: tuple[str, ...]


def _member(program: Any, name: str) -> bool:
    node = program.nodes[name]
    rule = program.rules[name]
    if node.op != "call_function" or rule.kind != "local" or len(rule.frame) != 1 or rule.run not in _POSITION_FREE:
        return False
    if name in program.hoisted or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    for smap in rule.slots:
        if smap is SKIP:
            return False
        if smap is not None and (len(smap) != 1 or smap[0].kind != "same" or smap[0].k != 0):
            return False
    return True


def find_local_groups(program: Any) -> list[LocalGroup]:
    """The groups of ``program`` (module doc); groups of one node are left out."""
    order = [n for n in program.gm.graph.nodes if n.name in program.rules]
    members = {n.name for n in order if _member(program, n.name)}
    level: dict[str, int] = {}
    parent: dict[str, str] = {m: m for m in members}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in order:
        lv = 0
        for a in program.slots.get(n.name, ()):
            same = n.name in members and a.name in members
            lv = max(lv, level.get(a.name, 0) + (0 if same else 1))
        level[n.name] = lv
    for n in order:
        if n.name not in members:
            continue
        for a in program.slots.get(n.name, ()):
            if a.name in members and level[a.name] == level[n.name]:
                parent[find(a.name)] = find(n.name)
    comps: dict[str, list[str]] = {}
    for n in order:
        if n.name in members:
            comps.setdefault(find(n.name), []).append(n.name)
    users: dict[str, list[str]] = {}
    for name, args in program.slots.items():
        for a in args:
            users.setdefault(a.name, []).append(name)
    groups: list[LocalGroup] = []
    for names in comps.values():
        names = _peel_output_views(program, names, users)
        if len(names) < 2:
            continue
        inside = set(names)
        reads = [a.name for m in names for a in program.slots.get(m, ()) if a.name not in inside]
        inputs = list(dict.fromkeys(reads))
        outputs = [m for m in names if m in program.pinned or any(u not in inside for u in users.get(m, ()))]
        internal = [sum(1 for u in users.get(o, ()) if u in inside) for o in outputs]  # one entry per slot
        groups.append(LocalGroup(len(groups), tuple(names), tuple(inputs), tuple(outputs), tuple(internal),
                                 tuple(reads)))
    return groups


def _peel_output_views(program: Any, names: list[str], users: dict[str, list[str]]) -> list[str]:
    """``names`` without the view ops that only nodes outside the group read (repeatedly: a view of a
    peeled view is peeled too). They run node by node, so the group returns their bases: a compiled
    function that returns a view regenerates it at every call, and AOTAutograd does not cache it
    (``gradshard.compose.returns_views``)."""
    inside = set(names)
    for m in reversed(names):  # users after their inputs: one reverse pass peels whole view chains
        if is_view_node(program.nodes[m]) and not any(u in inside for u in users.get(m, ())):
            inside.discard(m)
    return [m for m in names if m in inside]


class _RuleContext:
    """What the position-free rules read from the evaluator: the program."""

    def __init__(self, program: Any) -> None:
        self.program = program


class GroupRunner:
    """A group's compiled variants, keyed by window width and input signature (module doc)."""

    def __init__(self, program: Any, group: LocalGroup, compiler: GraphCompiler, owner: str) -> None:
        self.program = program
        self.group = group
        self.compiler = compiler
        self.name = f"{owner}:group{group.index}({group.members[0]}..{group.members[-1]})"
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.failed = False
        self.compile_seconds = 0.0

    def eval_rules(self, vals: list[Any], demand: Demand) -> tuple[Any, ...]:
        """The group's rules, one after another, as the evaluator runs them (traced by ``make_fx``)."""
        prog = self.program
        env = dict(zip(self.group.inputs, vals))
        ctx = _RuleContext(prog)
        for m in self.group.members:
            node = prog.nodes[m]
            rule = prog.rules[m]
            args = [env[a.name] for a in prog.slots.get(m, ())]
            arg_demands = [() if smap is None else demand for smap in rule.slots]
            env[m] = rule.run(node, args, demand, arg_demands, ctx)
        return tuple(env[o] for o in self.group.outputs)

    def __call__(self, vals: list[Any], demand: Demand) -> tuple[Any, ...] | None:
        """The outputs on ``demand`` (``None``: this group runs node by node)."""
        if self.failed or not all(isinstance(v, torch.Tensor) for v in vals):
            return None
        (lo, hi), = demand
        key = (hi - lo, *signature(vals))
        fn = self.variants.get(key)
        if fn is None:
            if len(self.variants) >= MAX_VARIANTS:
                return None
            fn = self._compile(vals, demand)
            if fn is None:
                return None
            self.variants[key] = fn
        return tuple(fn(*vals))

    def _compile(self, vals: list[Any], demand: Demand) -> Callable[..., Any] | None:
        t0 = time.perf_counter()
        try:  # every value is a tensor (__call__ checks)
            fn = trace_and_compile(lambda *xs: self.eval_rules(list(xs), demand), vals, self.compiler)
        except Exception as exc:  # noqa: BLE001 - the per-node path computes the same values
            self.failed = True
            log.warning("gradshard: could not compile %s (%s); running it node by node", self.name, summary(exc))
            return None
        self.compile_seconds += time.perf_counter() - t0
        return fn


class GroupCache:
    """A region's group runners (``by_node``: output name -> runner; ``None`` until built) and its
    rules' compiled functions (``calls``).

    Compiled code is process-local: a deep copy or a pickle starts empty (built again at first use).
    """

    def __init__(self) -> None:
        self.runners: list[GroupRunner] = []
        self.by_node: dict[str, GroupRunner] | None = None
        self.calls: CompiledCalls | None = None  # the rules' compiled functions (ChunkedRegion.compiled_calls)

    def fill(self, runners: list[GroupRunner]) -> None:
        self.runners = runners
        self.by_node = {m: r for r in runners for m in r.group.outputs}

    @property
    def compiled_variants(self) -> int:
        return sum(len(r.variants) for r in self.runners)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.runners if r.failed)

    def describe(self) -> str:
        nodes = sum(len(r.group.members) for r in self.runners)
        text = (f"{len(self.runners)} group(s) of local nodes ({nodes} nodes) run compiled, "
                f"{self.compiled_variants} variant(s) so far")
        if self.calls is not None and (self.calls.variants or self.calls.failed):
            text += f"; {len(self.calls.variants)} compiled block-form call(s)"
            text += f" ({len(self.calls.failed)} function(s) left eager: compile failed)" if self.calls.failed else ""
        return text + (f", {self.failures} left node by node (compile failed)" if self.failures else "")

    def __deepcopy__(self, memo: dict) -> "GroupCache":
        return GroupCache()

    def __getstate__(self) -> dict:
        return {"runners": [], "by_node": None, "calls": None}
