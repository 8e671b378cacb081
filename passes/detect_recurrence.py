"""detect_recurrence: find linear recurrences ``h_t = a_t * h_{t-1} + u_t`` in a captured graph.

Each finding is a :class:`ScanSite` -- the nodes for ``a``, ``u``, the initial state ``h0``
and the state sequence ``h``, the time dim, and the nodes that implement the scan -- and is
reported as a ``linear_recurrence`` :class:`~gradshard.ir.Region`. Forms recognised:

=============================  =============================================================
written as                     graph pattern
=============================  =============================================================
``gs.kernels.linear_scan``     one ``gradshard::linear_scan`` node (forward direction)
rolled loop (``roll_loops``)   ``gradshard::linear_scan`` / ``gradshard::dense_linear_scan``
log-space cumsum               ``exp(L) * cumsum(u * exp(-L))`` or ``cumsum(u / exp(L))`` with
                               ``L = cumsum(log a)``; ``cumprod(a)`` in place of ``exp(L)``
``associative_scan``           the generic-mode tree (odd/even step-2 slices, stacks, pads);
                               the combine function is verified numerically against the
                               diagonal (``a2*a1, a2*u1+u2``) or dense (``a2@a1, a2@u1+u2``) scan
``cumsum``                     a float ``cumsum`` along time (``a = 1``)
=============================  =============================================================

Heinsen's log-space form ``exp(A + logcumsumexp(log_u - A))`` with ``A = cumsum(log a)``
(minGRU / minLSTM) is rewritten to a ``linear_scan`` before detection, by
:mod:`.recurrence_logspace` (called from ``canonicalize_recurrences``), and then found as the
first form above.

Not recognised (left to autograd and reported as ``time_mixer`` regions): Mamba-2 ``segsum``
/ SSD chunked forms (a decay *matrix* ``exp(segsum(log a))`` times ``C B^T``; this is linear
attention with decay, not a scan over a state), a ``logcumsumexp`` whose result stays in log
space, a bare ``cumprod``.
``torch.ops.higher_order.associative_scan`` nodes (the pointwise mode, CUDA) have a detection
hook below that is **untested** here (no CUDA). mamba_ssm's ``selective_scan_fn`` never reaches
this pass: capture swaps it for a twin written with ``gs.kernels.linear_scan``
(:mod:`gradshard.capture.substitutions`), which is found as the first form above.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext, ancestors

from gradshard.ops.dense_scan import is_scan_op
from gradshard.passes.recurrence_graph import live_nodes

aten = torch.ops.aten

__all__ = ["ScanSite", "find_scan_sites", "detect_linear_recurrences", "SITE_FINDERS"]


@dataclass(frozen=True)
class ScanSite:
    """A linear recurrence found in a graph (names of its nodes)."""

    kind: str  # "diagonal" | "dense"
    written_as: str
    a: Optional[str]  # None: a = 1
    u: str
    h0: Optional[str]
    h: str
    time_dim: int  # of u and h (a is right-aligned to u)
    covered: tuple[str, ...]  # nodes implementing the scan (h included)
    reverse: bool = False


SiteFinder = Callable[[fx.GraphModule, Any], list[ScanSite]]
SITE_FINDERS: dict[str, SiteFinder] = {}


def register_site_finder(name: str) -> Callable[[SiteFinder], SiteFinder]:
    def deco(fn: SiteFinder) -> SiteFinder:
        SITE_FINDERS[name] = fn
        return fn

    return deco


def _ndim(node: Any) -> int:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _is_float(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


# --------------------------------------------------------------------------- op nodes


@register_site_finder("linear_scan op")
def _scan_op_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_scan_op(node):
            continue
        dense = "dense" in str(node.target)
        a, u = node.args[0], node.args[1]
        h0 = node.args[2] if len(node.args) > 2 else node.kwargs.get("h0")
        reverse = bool(node.args[3]) if not dense and len(node.args) > 3 else False
        rolled = node.meta.get("gs_rolled_loop")
        written = f"rolled loop ({rolled['steps']} steps)" if rolled else node.meta.get("gs_written_as") or (
            "gradshard.kernels.linear_scan" if not dense else "gradshard dense_linear_scan")
        sites.append(ScanSite("dense" if dense else "diagonal", written, a.name, u.name,
                              h0.name if isinstance(h0, fx.Node) else None, node.name, 1, (node.name,), reverse))
    return sites


# --------------------------------------------------------------------------- log-space forms


def _classify(node: Any, memo: dict) -> Optional[tuple]:
    """Symbolic class of a node in log-space scan patterns: loga/L/negL/P/Pinv of ``a``."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node in memo:
        return memo[node]
    memo[node] = None
    t, args = node.target, node.args
    res = None
    if t is aten.log.default:
        inner = _classify(args[0], memo)
        res = ("L",) + inner[1:] if inner and inner[0] == "P" else ("loga", args[0], None)
    elif t is aten.cumsum.default:
        inner = _classify(args[0], memo)
        if inner and inner[0] == "loga":
            res = ("L", inner[1], args[1] % max(_ndim(node), 1))
    elif t is aten.neg.default:
        inner = _classify(args[0], memo)
        res = ("negL",) + inner[1:] if inner and inner[0] == "L" else None
    elif t in (aten.mul.Tensor, aten.mul.Scalar) and len(args) == 2 and args[1] == -1:
        inner = _classify(args[0], memo)
        res = ("negL",) + inner[1:] if inner and inner[0] == "L" else None
    elif t is aten.exp.default:
        inner = _classify(args[0], memo)
        if inner and inner[0] == "L":
            res = ("P",) + inner[1:]
        elif inner and inner[0] == "negL":
            res = ("Pinv",) + inner[1:]
    elif t is aten.cumprod.default:
        res = ("P", args[0], args[1] % max(_ndim(node), 1))
    elif t is aten.reciprocal.default or (t is aten.pow.Tensor_Scalar and args[1] == -1):
        inner = _classify(args[0], memo)
        res = ("Pinv",) + inner[1:] if inner and inner[0] == "P" else None
    memo[node] = res
    return res


def _pattern_nodes(start: fx.Node, stop: fx.Node) -> set[fx.Node]:
    """Ancestors of ``start`` down to (excluding) ``stop``."""
    return ancestors([start], lambda n: n is not stop)


@register_site_finder("log-space cumsum")
def _logspace_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    memo: dict = {}
    sites = []
    live = live_nodes(gm)
    for S in gm.graph.nodes:
        if S.op != "call_function" or S.target is not aten.cumsum.default or not _is_float(S):
            continue
        d = S.args[1] % max(_ndim(S), 1)
        inner = S.args[0]
        if not isinstance(inner, fx.Node) or inner.op != "call_function":
            continue
        u = a = None
        pinv = None
        if inner.target is aten.mul.Tensor:
            x, y = inner.args[:2]
            for p, q in ((x, y), (y, x)):
                c = _classify(p, memo)
                if c and c[0] == "Pinv" and c[2] == d and isinstance(q, fx.Node):
                    u, a, pinv = q, c[1], p
                    break
        elif inner.target is aten.div.Tensor:
            c = _classify(inner.args[1], memo)
            if c and c[0] == "P" and c[2] == d and isinstance(inner.args[0], fx.Node):
                u, a, pinv = inner.args[0], c[1], inner.args[1]
        if u is None:
            continue
        h = None
        pnode = None
        for user in S.users:
            if user.target is aten.mul.Tensor:
                other = user.args[1] if user.args[0] is S else user.args[0]
                c = _classify(other, memo)
                if c and c[0] == "P" and c[1] is a and c[2] == d:
                    h, pnode = user, other
                    break
        if h is None or len([x for x in S.users if x in live]) != 1:
            continue
        covered = {S, inner, h} | _pattern_nodes(pinv, a) | _pattern_nodes(pnode, a)
        # the pattern must be self-contained: internal values used only inside it
        if any(u_ in covered for u_ in [a]) or any(
                any(usr not in covered and usr in live for usr in n.users) for n in covered if n is not h):
            continue
        if u in covered:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        sites.append(ScanSite("diagonal", "log-space cumsum", a.name, u.name, None, h.name, d,
                              tuple(n.name for n in sorted(covered, key=order.get))))
    return sites


# --------------------------------------------------------------------------- associative_scan (generic mode)


def _is_step2_slice(node: fx.Node, src: fx.Node, start: int) -> Optional[int]:
    if node.target is not aten.slice.Tensor or node.args[0] is not src:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    _, d, s, e, step = args[:5]
    if step != 2 or (s or 0) != start:
        return None
    if start == 0 and e != -1:
        return None
    if start == 1 and e not in (None, 2**63 - 1):
        return None
    return d


def _tree_closure(seeds: list[fx.Node], T: int, d: int, rank: int) -> tuple[set[fx.Node], list[fx.Node], set[fx.Node]]:
    """Nodes computed from ``seeds`` alone (constants allowed), stopping at full-length outputs."""
    tree: set[fx.Node] = set(seeds)
    outputs: list[fx.Node] = []
    external: set[fx.Node] = set()
    graph = seeds[0].graph
    start = min(seeds, key=lambda n: list(graph.nodes).index(n))
    started = False
    out_set: set[fx.Node] = set()
    for n in graph.nodes:
        if n is start:
            started = True
        if not started or n in tree or n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if not ins or not any(a in tree and a not in out_set for a in ins):
            continue
        ext = [a for a in ins if a not in tree or a in out_set]
        if any(a in out_set for a in ins):
            continue
        if any(_is_float_tensor(a) for a in ext):
            external.update(ext)
            continue
        tree.add(n)
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == rank and v.shape[d] == T and n not in seeds:
            outputs.append(n)
            out_set.add(n)
    return tree, outputs, external


def _is_float_tensor(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.numel() > 1


def _eval_subgraph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], values: list[torch.Tensor],
                   sizes: Optional[Callable[[list[Any]], list[Any]]] = None) -> list[torch.Tensor]:
    """Run ``nodes`` on ``values`` for ``inputs``; each value is dropped after its last reader
    among ``nodes`` (a combine tree has ~log2(T) levels of full-size intermediates).
    ``sizes`` rewrites the size lists of reshaping ops (the proof on fewer channels)."""
    env: dict[fx.Node, Any] = dict(zip(inputs, values))
    gm = nodes[0].graph.owning_module if nodes else None
    last_read = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    keep = set(outputs) | set(inputs)
    for i, n in enumerate(nodes):
        if n in env:
            continue
        if n.op == "get_attr":
            env[n] = getattr(gm, n.target)
            continue
        args = fx.node.map_arg(n.args, lambda a: env[a] if a in env else _const(a, gm))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a] if a in env else _const(a, gm))
        if sizes is not None and n.target in _SIZE_LISTS and len(args) > 1 and isinstance(args[1], (list, tuple)):
            args = (args[0], sizes(list(args[1])), *args[2:])
        env[n] = n.target(*args, **kwargs)
        for a in n.all_input_nodes:
            if last_read.get(a) == i and a not in keep:
                env.pop(a, None)
    return [env[o] for o in outputs]


#: Ops whose second argument is a size list baked at the captured sizes.
_SIZE_LISTS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def _channel_sizes(full: tuple[int, ...], small: tuple[int, ...], d: int) -> Callable[[list[Any]], list[Any]]:
    """Map a size list written for ``full`` leaves to ``small`` ones: the dims before time ``d``
    aligned from the left, those after it from the right; only entries equal to the full size
    at their place change (a wrong guess fails or misses the reference, and the proof then runs
    at full size)."""
    n = len(full)
    before, after = list(zip(full[:d], small[:d])), list(zip(full[d + 1:], small[d + 1:]))

    def remap(lst: list[Any]) -> list[Any]:
        out = list(lst)
        for i, (f, s) in enumerate(before[: len(out)]):
            if out[i] == f:
                out[i] = s
        for k, (f, s) in enumerate(reversed(after)):
            j = len(out) - 1 - k
            if j >= len(before) and out[j] == f:
                out[j] = s
        return out

    return remap if n == len(small) else (lambda lst: lst)


def _const(a: fx.Node, gm: Any) -> Any:
    if a.op == "get_attr":
        return getattr(gm, a.target)
    raise KeyError(a.name)


def _reference_scan(kind: str, a: torch.Tensor, u: torch.Tensor, d: int) -> torch.Tensor:
    a1, u1 = a.movedim(d, 0), u.movedim(d, 0)
    h = torch.zeros_like(u1[0]) if kind == "diagonal" else None
    outs = []
    for t in range(u1.shape[0]):
        if kind == "diagonal":
            h = a1[t] * h + u1[t]
        else:
            h = u1[t] if h is None else a1[t] @ h + u1[t]
        outs.append(h)
    return torch.stack(outs, 0).movedim(0, d)


def _match_tree(tree_nodes: list[fx.Node], leaves: list[fx.Node], outputs: list[fx.Node], d: int) -> Optional[tuple[str, int, int, fx.Node]]:
    """Try the diagonal/dense hypotheses numerically; ``(kind, a_index, u_index, h_output)``.

    The proof runs first on a few channels (every dim but time and a dense state's matrix cut
    to at most :data:`_PROOF_CHANNELS`), so it allocates the same small tensors whatever the
    captured sizes; a tree that bakes a channel count into its ops cannot run there and is
    proved at its own sizes."""
    if len(leaves) != 2:
        return None
    shapes = [tuple(l.meta["val"].shape) for l in leaves]
    for small in (True, False):
        found = _try_hypotheses(tree_nodes, leaves, outputs, d, shapes, small)
        if found is not None:
            return found
    return None


#: Channels per dim for the associative-scan proof (3: no size-1 broadcasting coincidence).
_PROOF_CHANNELS = 3


def _proof_shape(shape: tuple[int, ...], d: int, keep_last: int) -> tuple[int, ...]:
    """``shape`` with every dim but ``d`` and the last ``keep_last`` cut to ``_PROOF_CHANNELS``."""
    n = len(shape)
    return tuple(s if i == d % n or i >= n - keep_last else min(s, _PROOF_CHANNELS) for i, s in enumerate(shape))


def _try_hypotheses(tree_nodes: list[fx.Node], leaves: list[fx.Node], outputs: list[fx.Node], d: int,
                    shapes: list[tuple[int, ...]], small: bool) -> Optional[tuple[str, int, int, fx.Node]]:
    gen = torch.Generator().manual_seed(1234)
    for ai, ui in ((0, 1), (1, 0)):
        for kind in ("diagonal", "dense"):
            sa, su = shapes[ai], shapes[ui]
            if kind == "diagonal" and sa != su:
                continue
            if kind == "dense" and (len(sa) != len(su) or sa[-1] != sa[-2] or sa[-1] != su[-2]):
                continue
            if small:
                sa = _proof_shape(sa, d, 2 if kind == "dense" else 0)
                su = _proof_shape(su, d, 2 if kind == "dense" else 0)
                if (sa, su) == (shapes[ai], shapes[ui]):
                    continue  # nothing to cut: the full-size proof runs it
            a = 0.5 + 0.5 * torch.rand(sa, generator=gen, dtype=torch.float64)
            if kind == "dense":
                a = a / sa[-1]
            u = torch.randn(su, generator=gen, dtype=torch.float64)
            vals = [None, None]
            vals[ai], vals[ui] = a, u
            try:
                outs = _eval_subgraph(tree_nodes, leaves, outputs, vals,
                                      _channel_sizes(shapes[ui], su, d % len(su)) if small else None)
            except Exception:  # noqa: BLE001 - a hypothesis that does not even run is false
                continue
            want = _reference_scan(kind, a, u, d)
            for o, val in zip(outputs, outs):
                if isinstance(val, torch.Tensor) and val.shape == want.shape and torch.allclose(val, want, rtol=1e-9, atol=1e-9):
                    return kind, ai, ui, o
    return None


@register_site_finder("associative_scan")
def _associative_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    cands: list[tuple[fx.Node, int]] = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "placeholder"):
            continue
        d0 = d1 = None
        for user in n.users:
            d0 = d0 if d0 is not None else _is_step2_slice(user, n, 0)
            d1 = d1 if d1 is not None else _is_step2_slice(user, n, 1)
        if d0 is not None and d0 == d1:
            cands.append((n, d0 % max(_ndim(n), 1)))
    if not cands:
        return []
    live = live_nodes(gm)
    # top-level leaves: candidates not computed from other candidates' trees
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    internal: set[fx.Node] = set()
    for n, d in cands:
        if n in internal:
            continue
        v = n.meta["val"]
        tree, _, _ = _tree_closure([n], int(v.shape[d]), d, v.dim())
        internal |= tree - {n}
    tops = [(n, d) for n, d in cands if n not in internal]
    sites = []
    used: set[fx.Node] = set()
    for n, d in tops:
        if n in used:
            continue
        group = [m for m, dm in tops if dm == d and m not in used and m.meta["val"].shape[d] == n.meta["val"].shape[d]]
        T = int(n.meta["val"].shape[d])
        for size in range(len(group), 0, -1):
            found = False
            for leaves in itertools.combinations(group, size):
                if n not in leaves:
                    continue
                tree, outputs, external = _tree_closure(list(leaves), T, d, n.meta["val"].dim())
                if external or not outputs:
                    continue
                tree_nodes = sorted(tree, key=order.get)
                m = _match_tree(tree_nodes, list(leaves), outputs, d)
                if m is None:
                    continue
                kind, ai, ui, h = m
                others = [o for o in outputs if o is not h]
                if any(any(u not in tree and u in live for u in o.users) for o in others):
                    continue  # the cumulative product of a is used: not a plain scan of h
                covered = [x for x in tree_nodes if x not in leaves]
                sites.append(ScanSite(kind, "associative_scan", leaves[ai].name, leaves[ui].name, None, h.name, d,
                                      tuple(x.name for x in covered)))
                used.update(leaves)
                found = True
                break
            if found:
                break
    return sites


# --------------------------------------------------------------------------- cumsum (a = 1)


@register_site_finder("cumsum")
def _cumsum_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    sites = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.cumsum.default and _is_float(n) and isinstance(n.args[0], fx.Node):
            d = n.args[1] % max(_ndim(n), 1)
            if tl is not None and d not in tl.info.get(n.name, _NoInfo).time_dims:
                continue
            sites.append(ScanSite("diagonal", "cumsum", None, n.args[0].name, None, n.name, d, (n.name,)))
    return sites


class _NoInfo:
    time_dims: tuple = ()


# --------------------------------------------------------------------------- untested hooks


@register_site_finder("higher_order associative_scan (untested)")
def _hop_associative_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    """UNTESTED (needs CUDA): ``torch.ops.higher_order.associative_scan(combine, xs, additional)``.

    The HOP scans along dim 0 of each leaf; the combine subgraph is checked numerically
    like the generic tree.
    """
    hop = getattr(torch.ops.higher_order, "associative_scan", None)
    sites = []
    if hop is None:
        return sites
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not hop:
            continue
        combine, xs = n.args[0], n.args[1]
        addl = n.args[2] if len(n.args) > 2 else ()
        if addl or len(xs) != 2:
            continue
        fn = getattr(gm, combine.target) if isinstance(combine, fx.Node) and combine.op == "get_attr" else None
        if fn is None:
            continue
        getters = [u for u in n.users if u.target is operator.getitem]
        h_get = next((g for g in getters if g.args[1] == 1), None)
        if h_get is None:
            continue
        for kind in ("diagonal", "dense"):
            if _combine_matches(fn, kind, [x.meta["val"] for x in xs]):
                sites.append(ScanSite(kind, "higher_order associative_scan (untested)", xs[0].name, xs[1].name,
                                      None, h_get.name, 0, tuple(x.name for x in [n, *getters])))
                break
    return sites


def _combine_matches(fn: Callable, kind: str, vals: list) -> bool:
    shp_a, shp_u = tuple(vals[0].shape[1:]), tuple(vals[1].shape[1:])
    g = torch.Generator().manual_seed(7)
    a1, a2 = (torch.rand(shp_a, generator=g, dtype=torch.float64) for _ in range(2))
    u1, u2 = (torch.randn(shp_u, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        out = fn(a1, u1, a2, u2)
    except Exception:  # noqa: BLE001
        return False
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    if kind == "diagonal":
        want = [a2 * a1, a2 * u1 + u2]
    else:
        if len(shp_a) < 2 or shp_a[-1] != shp_a[-2]:
            return False
        want = [a2 @ a1, a2 @ u1 + u2]
    return len(out) == 2 and all(o.shape == w.shape and torch.allclose(o, w) for o, w in zip(out, want))


# --------------------------------------------------------------------------- all sites


def find_scan_sites(gm: fx.GraphModule, tl: Any) -> list[ScanSite]:
    """Every linear recurrence of ``gm``, each node claimed by at most one site."""
    claimed: set[str] = set()
    out: list[ScanSite] = []
    for finder in SITE_FINDERS.values():
        for site in finder(gm, tl):
            nodes = set(site.covered) | {site.h}
            if nodes & claimed:
                continue
            claimed |= nodes
            out.append(site)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(out, key=lambda s: order[s.h])


def detect_linear_recurrences(gm: fx.GraphModule, ctx: PassContext) -> list[Region]:
    """Report every linear recurrence as a ``linear_recurrence`` region (pure)."""
    tl = ctx.analyses.get("time")
    sites = find_scan_sites(gm, tl)
    ctx.analyses["recurrence_sites"] = sites
    nodes = {n.name: n for n in gm.graph.nodes}
    regions = []
    for i, s in enumerate(sites):
        regions.append(Region(
            kind="linear_recurrence", name=f"recurrence_{i}", nodes=s.covered,
            inputs=tuple(x for x in (s.a, s.u, s.h0) if x), outputs=(s.h,), time_axis=s.time_dim,
            source=source_of(nodes[s.h]),
            options={"form": s.kind if s.a is not None and s.written_as != "cumsum" else "diagonal (a=1)",
                     "written_as": s.written_as},
        ))
    return regions
