"""Graph structure behind linear-attention detection: node classes, mixing components, evaluation.

Every node of a captured graph gets a *time class* from the time-locality analysis
(:mod:`gradshard.analysis.locality`), relative to the local sequence length ``T``:

===========  ===========================================================================
``const``    does not depend on time-carrying data (parameters, buffers, masks, aranges)
``normal``   one time dim, covering steps ``0..T-1`` at origin 0, position-wise (its own
             rule reads the same step): the world LASP leaves alone
``closing``  like ``normal`` but its own rule reads all of the past (a cumsum along time,
             ``(scores * mask) @ v``, the lightning kernel, the ``stack`` of a per-step loop)
``inner``    anything else that depends on time: score matrices (two time dims), block
             slices (shorter than ``T`` or shifted), loop steps and states (no time dim),
             windows (pads, convolutions), reductions over time
===========  ===========================================================================

A *mixing component* is a connected group of ``inner``/``closing`` nodes (plus the
``normal`` node that gathers block outputs back to full length, e.g. the ``cat`` of a
block-wise loop). Its *inputs* are the ``normal`` nodes it reads (q, k, v, gates) and its
*outputs* the members read from outside. Example (naive form, one layer)::

    q ─┐                       inputs: q, k, v (normal)          const: mask
    k ─┴ matmul(q, k^T) ─ mul(·, mask) ─ matmul(·, v) ─> out      members: matmul, mul, matmul
    v ─────────────────────────────────┘

A full-length cumsum whose result only feeds one component through position-wise nodes
(the cumulative log-decay of a gated naive form) is merged into that component.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from gradshard.analysis.dims import shape_of
from gradshard.analysis.locality import DATA_INDEPENDENT, SCAN_OPS, TimeLocality
from gradshard.pipeline import ancestors

aten = torch.ops.aten

__all__ = [
    "CONST", "NORMAL", "CLOSING", "INNER",
    "Component", "ConstValues", "classify_nodes", "find_components", "evaluate_members",
    "time_extent", "LAYOUT_OPS", "live_nodes",
]

CONST, NORMAL, CLOSING, INNER = "const", "normal", "closing", "inner"

# View-like ops that only change the layout; a component absorbs them from its inputs.
LAYOUT_OPS = {aten.transpose.int, aten.permute.default, aten.t.default, aten.expand.default,
              aten.clone.default, aten.alias.default}
if hasattr(aten, "contiguous"):
    LAYOUT_OPS.add(aten.contiguous.default)
_MERGE_LIMIT = 16  # normal nodes walked when merging a prefix scan into its consumer


@dataclass(frozen=True)
class Component:
    """A connected group of mixing nodes (names, in graph order) and its boundary."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]  # normal (time-carrying) nodes read by the members
    consts: tuple[str, ...]  # const nodes read by the members
    outputs: tuple[str, ...]  # members read by non-members or by the graph output

    def members(self, gm: fx.GraphModule) -> list[fx.Node]:
        names = set(self.nodes)
        return [n for n in gm.graph.nodes if n.name in names]


def time_extent(node: fx.Node, dim: int, tl: TimeLocality) -> int | None:
    """Number of time steps along output dim ``dim`` (the time factor of a merged ``B*T``)."""
    nd = tl.dims.dims_of(node)
    if nd is not None and nd.factors is not None and dim < len(nd.factors) and len(nd.factors[dim]) > 1:
        for labels, size in nd.factors[dim]:
            if any(tl.dims.canon(l) == tl.time_class for l in labels):
                return size
    shp = shape_of(node)
    if shp is None:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor):
            shp = tuple(val[0].shape)
    return shp[dim] if shp is not None and dim < len(shp) else None


def classify_nodes(gm: fx.GraphModule, tl: TimeLocality) -> dict[str, str]:
    """The time class of every node (see the module doc); the output node is left out."""
    T = tl.seq_len
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        info = tl.info.get(node.name)
        if info is None or info.reach is None:
            out[node.name] = CONST
            continue
        td = info.time_dims
        cls = INNER
        if len(td) == 1 and info.origin == 0 and time_extent(node, td[0], tl) == T and not info.causal_mask:
            local = info.local
            if local is None or local.is_pointwise:
                cls = NORMAL
            elif local.reads_all_past and local.hi <= 0:
                cls = CLOSING
        out[node.name] = cls
    return out


def _is_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SCAN_OPS


def live_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes the graph output (or an impure node) depends on."""
    roots = [n for n in gm.graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure())]
    return {n.name for n in ancestors(roots)}


def find_components(gm: fx.GraphModule, tl: TimeLocality,
                    classes: dict[str, str] | None = None) -> list[Component]:
    """Mixing components of the live part of ``gm``, in graph order (see the module doc)."""
    classes = classes or classify_nodes(gm, tl)
    live = live_nodes(gm)
    nodes = [n for n in gm.graph.nodes if n.op != "output" and n.name in live]
    mixing = [n for n in nodes if classes[n.name] in (INNER, CLOSING)]
    parent: dict[str, str] = {n.name: n.name for n in mixing}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    for c in mixing:
        for p in c.all_input_nodes:
            if p.name not in parent:
                continue
            if classes[p.name] == INNER or c.target is operator.getitem:
                union(p.name, c.name)
    groups: dict[str, set[str]] = {}
    for n in mixing:
        groups.setdefault(find(n.name), set()).add(n.name)

    member_of = {m: root for root, ms in groups.items() for m in ms}
    # gather: a normal node whose time-carrying inputs are all inner members of one group
    for n in nodes:
        if classes[n.name] != NORMAL or n.op != "call_function":
            continue
        timed = [a for a in n.all_input_nodes if classes.get(a.name) != CONST]
        if timed and all(classes.get(a.name) == INNER and a.name in member_of for a in timed):
            roots = {member_of[a.name] for a in timed}
            if len(roots) == 1:
                root = roots.pop()
                groups[root].add(n.name)
                member_of[n.name] = root
    _merge_prefix_scans(gm, groups, member_of, classes, live)

    by_name = {n.name: n for n in nodes}
    order = {n.name: i for i, n in enumerate(nodes)}
    comps: list[Component] = []
    for ms in groups.values():
        _absorb_layout_inputs(ms, by_name, classes, live)
        comps.append(_boundary(sorted(ms, key=order.__getitem__), by_name, classes, live))
    comps.sort(key=lambda c: order[c.nodes[0]])
    return comps


def _merge_prefix_scans(gm: fx.GraphModule, groups: dict[str, set[str]], member_of: dict[str, str],
                        classes: dict[str, str], live: set[str]) -> None:
    """Merge a group made of full-length scans into the one group its results feed.

    The scan's results may reach that group through position-wise nodes (``unsqueeze`` of a
    cumulative log-decay) or rejoin its output (``o_intra + (q * exp(cum)) @ kv0`` of a
    single-block loop): such *join* nodes become members too.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    for root in list(groups):
        ms = groups.get(root)
        if ms is None:
            continue
        nodes = [by_name[m] for m in ms]
        if not all(_is_scan(n) or n.target is operator.getitem for n in nodes):
            continue
        targets: set[str] = set()
        visited: set[str] = set()
        frontier = [u for n in nodes for u in n.users if u.name not in ms and u.name in live]
        ok = True
        while frontier and ok:
            u = frontier.pop()
            if u.name in visited:
                continue
            if u.name in member_of and member_of[u.name] != root:
                targets.add(member_of[u.name])
                continue
            if u.op != "call_function" or classes.get(u.name) != NORMAL or len(visited) >= _MERGE_LIMIT:
                ok = False
                break
            visited.add(u.name)
            joined = {member_of[a.name] for a in u.all_input_nodes
                      if a.name in member_of and member_of[a.name] != root}
            if joined:  # rejoins another group's output: a member, not explored further
                targets |= joined
                continue
            frontier.extend(x for x in u.users if x.name in live)
        if ok and len(targets) == 1:
            target = targets.pop()
            groups[target] |= ms | visited
            for m in ms | visited:
                member_of[m] = target
            del groups[root]


def _absorb_layout_inputs(ms: set[str], by_name: dict[str, fx.Node], classes: dict[str, str],
                          live: set[str]) -> None:
    """Pull layout-only input nodes (transpose, expand, ...) used only by members inside."""
    changed = True
    while changed:
        changed = False
        for m in list(ms):
            for a in by_name[m].all_input_nodes:
                if (a.name not in ms and classes.get(a.name) == NORMAL and a.op == "call_function"
                        and a.target in LAYOUT_OPS and all(u.name in ms for u in a.users if u.name in live)):
                    ms.add(a.name)
                    changed = True


def _boundary(members: list[str], by_name: dict[str, fx.Node], classes: dict[str, str],
              live: set[str]) -> Component:
    ms = set(members)
    inputs: list[str] = []
    consts: list[str] = []
    outputs: list[str] = []
    for m in members:
        node = by_name[m]
        for a in node.all_input_nodes:
            if a.name in ms:
                continue
            bucket = consts if classes.get(a.name) == CONST else inputs
            if a.name not in bucket:
                bucket.append(a.name)
        if any(u.name not in ms and (u.op == "output" or u.name in live) for u in node.users):
            outputs.append(m)
    return Component(tuple(members), tuple(inputs), tuple(consts), tuple(outputs))


# --------------------------------------------------------------------------- evaluation


class ConstValues:
    """Values of ``const`` nodes computed from the example inputs (memoised).

    Floating values are returned in float64 so that components evaluate in float64.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], classes: dict[str, str],
                 max_elements: int = 1 << 24) -> None:
        self.gm = gm
        self.classes = classes
        self.max_elements = max_elements
        self._placeholders = {p.name: v for p, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)}
        self._memo: dict[str, Any] = {}

    def raw(self, node: fx.Node) -> Any:
        """The value (floating leaves promoted to float64); ``KeyError`` if not computable."""
        if node.name in self._memo:
            return self._memo[node.name]
        order = _ancestors_topo(node, lambda n: n.name in self._memo or _data_independent(n))
        for n in order:
            if n.name in self._memo:
                continue
            if self.classes.get(n.name, CONST) != CONST and n.op != "get_attr":
                raise KeyError(f"{n.name} depends on time-carrying data")
            if n.op == "placeholder":
                val = self._placeholders.get(n.name)
                if val is None:
                    raise KeyError(n.name)
                self._memo[n.name] = _f64(val.detach()) if isinstance(val, torch.Tensor) else val
            elif n.op == "get_attr":
                self._memo[n.name] = _f64(operator.attrgetter(n.target)(self.gm))
            elif _data_independent(n):  # new_zeros(q, ...): only q's metadata matters
                args = fx.node.map_arg(n.args, lambda a: self._memo.get(a.name, _like(a)))
                kwargs = _promote_dtype(fx.node.map_arg(n.kwargs, lambda a: self._memo.get(a.name, _like(a))))
                self._memo[n.name] = n.target(*args, **kwargs)
            elif n.op == "call_function":
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) and val.numel() > self.max_elements:
                    raise KeyError(f"{n.name} is too large to evaluate ({val.numel()} elements)")
                args = fx.node.map_arg(n.args, lambda a: self._memo[a.name])
                kwargs = _promote_dtype(fx.node.map_arg(n.kwargs, lambda a: self._memo[a.name]))
                with torch.no_grad():
                    self._memo[n.name] = n.target(*args, **kwargs)
            else:
                raise KeyError(f"{n.name}: cannot evaluate a {n.op} node")
        return self._memo[node.name]

    def get(self, node: fx.Node) -> Any:
        """Like :meth:`raw` with floating tensors in float64, or ``None`` if not computable."""
        try:
            v = self.raw(node)
        except KeyError:
            return None
        except Exception:  # noqa: BLE001 - an op that fails on real values: not a usable constant
            return None
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(torch.float64)
        return v


def _data_independent(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "_overloadpacket", None) in DATA_INDEPENDENT


def _f64(x: Any) -> Any:
    """Floating tensors in float64: analyses compare against a float64 reference."""
    return x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _promote_dtype(kwargs: Any) -> Any:
    """Evaluate explicit low-precision float dtypes (``ones(dtype=float32)``) in float64."""
    dt = kwargs.get("dtype") if isinstance(kwargs, dict) else None
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt != torch.float64:
        kwargs = dict(kwargs)
        kwargs["dtype"] = torch.float64
    return kwargs


def _like(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _f64(torch.zeros(val.shape, dtype=val.dtype))
    raise KeyError(f"{node.name} has no shape metadata")


def _ancestors_topo(node: fx.Node, stop) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    found: list[fx.Node] = []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        found.append(n)
        if not stop(n):
            stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=index.__getitem__)


def evaluate_members(members: Iterable[fx.Node], env: dict[str, Any], consts: ConstValues) -> dict[str, Any]:
    """Run ``members`` (graph order) with ``env`` giving the values of their inputs.

    Const inputs not in ``env`` come from ``consts`` (float64). Returns ``env`` extended.
    """
    env = dict(env)

    def value(a: fx.Node) -> Any:
        if a.name not in env:
            v = consts.get(a)
            if v is None:
                raise KeyError(f"no value for `{a.name}`")
            env[a.name] = v
        return env[a.name]

    with torch.no_grad():
        for n in members:
            if n.op != "call_function":
                raise KeyError(f"cannot evaluate a {n.op} node")
            args = fx.node.map_arg(n.args, value)
            kwargs = _promote_dtype(fx.node.map_arg(n.kwargs, value))
            env[n.name] = n.target(*args, **kwargs)
    return env
