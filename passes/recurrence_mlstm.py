"""Rewrite xLSTM's chunkwise mLSTM kernel as its step recurrence (proven numerically on the region).

The mLSTM carries a matrix state ``C`` and a normaliser ``n`` beside a running maximum ``m``::

    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)                                   # the driver
    C_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_tᵀ
    n_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = (s q_t) C_t / (max(|(s q_t) · n_t|, exp(-m_t)) + eps)

Hugging Face's ``mlstm_chunkwise_native_autograd`` computes it in blocks of ``chunk_size``
steps: a Python loop over the blocks carries ``(C, n, m)`` with one stabiliser per block
(written into preallocated state buffers), then all blocks' outputs are computed at once from
a masked ``(L, L)`` intra-block product and the carried states. Unrolled by tracing, no
analysis follows time through that form (time split over block and step-in-block axes, the
intra-block product reads past the diagonal, masked only by values), so the plans refused
the layer. The block stabiliser is, in exact arithmetic, the step stabiliser at the block's
steps (a running maximum over the same terms, grouped by block), so the outputs and final
states are the step recurrence's up to rounding (the ``eps`` term in the denominator makes
them depend on ``m`` itself, which both forms compute as the same maximum).

This pass finds a candidate region from its structure: per ``cumsum(logsigmoid(f))`` of a gate
viewed in blocks ``(B, H, L/c, c)``, the five tensors viewed in the same blocks since the
previous such region (q, k, v, i, f), the nodes in graph order from their first use to the view
merging the block outputs back to ``(B, H, L, d)``, and the reads of the state buffers right
after it (the final ``C``, ``n``, ``m``, where used). It then *proves* the region: cut out and
run in float64 (its casts widened too) on random ``q, k, v, i, f`` and random initial states, it must match
:func:`mlstm_step_reference` (relative error <= ``PROOF_TOL``) for one assignment of roles the
shapes allow and one ``(scale, eps)`` among the region's literals; nothing is rewritten
otherwise. When the block outputs are concatenated along time with the outputs of the steps
after the last whole block (the kernel's tail, started from its final states), the region
grows to that concatenation, read from the full-length inputs, and is proven again with the
proven ``scale``/``eps`` (a tail carrying its states in float32, as ``inference_state_dtype``
makes it, is proven in float64 like the rest: the rewrite computes it in the inputs' precision).

The region is replaced by the step recurrence written out step by step (the form of
``mlstm_recurrent_step_native``, in the inputs' precision; final states, where used, read from
the stacked per-step states): a loop carrying ``(C, n, m)`` that ``roll_driven_loops``
(adjoint plans: a driver loop for ``m``, one scan of ``C`` and ``n``) and
``roll_loops_carrying`` (chunked plans) roll exactly, over the whole time axis.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.pipeline import PassContext, PassResult, ancestors, graph_pass

from gradshard.passes.recurrence_graph import copy_graph_module, emit_node, live_nodes
from gradshard.passes.region_proof import MAX_EVAL_ELEMENTS, exact_arithmetic, region_subgraph

aten = torch.ops.aten

__all__ = ["MlstmRegion", "match_chunkwise_mlstm", "mlstm_step_reference",
           "rewrite_chunkwise_mlstm"]

#: The proof's tolerance (relative to each output's largest entry) in float64.
PROOF_TOL = 1e-9

_ROLES_IN = ("q", "k", "v", "i", "f", "C0", "n0", "m0")
_ROLES_OUT = ("h", "C", "n", "m")


@dataclass(frozen=True)
class MlstmRegion:
    """A proven chunkwise mLSTM region: role -> input node, role -> output node, constants."""

    inputs: dict[str, fx.Node]
    outputs: dict[str, fx.Node]
    nodes: frozenset[fx.Node]
    scale: float
    eps: float


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _block_split(n: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """``(source, blocks, block)`` when ``n`` views a ``(B, H, L, ...)`` tensor as ``(B, H, L/c, c, ...)``."""
    if n.op != "call_function" or n.target not in _VIEWS or not isinstance(n.args[0], fx.Node):
        return None
    src, out = _val(n.args[0]), _val(n)
    if src is None or out is None or src.dim() < 3 or out.dim() != src.dim() + 1:
        return None
    s, o = tuple(src.shape), tuple(out.shape)
    if s[:2] != o[:2] or s[3:] != o[4:] or o[2] * o[3] != s[2] or o[2] < 1:
        return None
    return n.args[0], o[2], o[3]


def _block_merge(n: fx.Node, blocks: int, block: int) -> bool:
    """``n`` views ``(B, H, L/c, c, d)`` back as ``(B, H, L, d)``."""
    if n.op != "call_function" or n.target not in _VIEWS or not isinstance(n.args[0], fx.Node):
        return False
    src, out = _val(n.args[0]), _val(n)
    return src is not None and out is not None and src.dim() == 5 and out.dim() == 4 and \
        tuple(src.shape[2:4]) == (blocks, block) and out.shape[2] == blocks * block


def _candidates(gm: fx.GraphModule) -> list[frozenset[fx.Node]]:
    """Candidate regions (module doc): per ``cumsum(log_sigmoid(f viewed in blocks))``, the nodes
    in graph order from the first use of a source viewed in the same blocks to the view merging
    the blocks' outputs back to time, and the run of nodes right after it that read only those
    (the final states)."""
    nodes = list(gm.graph.nodes)
    order = {n: j for j, n in enumerate(nodes)}
    out = []
    for anchor in gm.graph.find_nodes(op="call_function", target=aten.cumsum.default):
        ls = anchor.args[0]
        if not isinstance(ls, fx.Node) or ls.target is not aten.log_sigmoid.default:
            continue
        split = _block_split(ls.args[0]) if isinstance(ls.args[0], fx.Node) else None
        if split is None:
            continue
        _, blocks, block = split
        L = blocks * block
        stop = next((order[n] for n in nodes[order[anchor]:] if _block_merge(n, blocks, block)), None)
        if stop is None:
            continue
        # the sources: tensors viewed in the same blocks after the previous layer's merge
        low = max((order[n] for n in nodes[:order[anchor]] if _block_merge(n, blocks, block)), default=-1)
        sources = {sp[0] for n in nodes[low + 1:stop] if (sp := _block_split(n)) is not None
                   and sp[1:] == (blocks, block) and _val(sp[0]).shape[2] == L}
        if len(sources) != 5:
            continue
        start = min(order[u] for x in sources for u in x.users if order[u] > low)
        if start > order[anchor]:
            continue
        region = set(nodes[start:stop + 1])
        for n in nodes[stop + 1:]:  # the final states (reads of the state buffers), not the outputs' users
            if n.op != "call_function" or not n.all_input_nodes or not all(a in region for a in n.all_input_nodes) \
                    or nodes[stop] in n.all_input_nodes:
                break
            region.add(n)
        out.append(frozenset(region))
    return out


def mlstm_step_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                         C0: torch.Tensor, n0: torch.Tensor, m0: torch.Tensor, scale: float,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mLSTM step recurrence (module doc): ``q, k (B, H, T, dk)``, ``v (B, H, T, dv)``,
    ``i, f (B, H, T)``, ``C0 (B, H, dk, dv)``, ``n0 (B, H, dk)``, ``m0 (B, H, 1)`` ->
    ``h (B, H, T, dv)`` and the final ``C``, ``n``, ``m``."""
    C, n, m = C0, n0, m0
    hs = []
    for t in range(q.shape[2]):
        logf = torch.nn.functional.logsigmoid(f[:, :, t, None])
        m_new = torch.maximum(logf + m, i[:, :, t, None])
        a, b = torch.exp(logf + m - m_new), torch.exp(i[:, :, t, None] - m_new)
        C = a[..., None] * C + b[..., None] * (k[:, :, t, :, None] * v[:, :, t, None, :])
        n = a * n + b * k[:, :, t]
        qs = q[:, :, t] * scale
        num = (qs[:, :, None, :] @ C).squeeze(2)
        qn = (qs[:, :, None, :] @ n[..., None]).squeeze(2)
        hs.append(num / (torch.maximum(qn.abs(), torch.exp(-m_new)) + eps))
        m = m_new
    return torch.stack(hs, dim=2), C, n, m


def _assignments(ins: list[fx.Node], outs: list[fx.Node]) -> list[tuple[dict[str, fx.Node], dict[str, fx.Node]]]:
    """Role assignments the shapes allow (module doc), each a pair of role -> node maps."""
    shapes = {n: tuple(_val(n).shape) for n in (*ins, *outs) if _val(n) is not None}
    if len(shapes) != len(ins) + len(outs) or len(ins) != len(_ROLES_IN) or not 1 <= len(outs) <= len(_ROLES_OUT):
        return []
    found = []
    for perm in itertools.permutations(ins):
        r = dict(zip(_ROLES_IN, perm))
        q, k, v, i, f = (shapes[r[x]] for x in "qkvif")
        if len(q) != 4 or q != k or len(v) != 4 or v[:3] != q[:3] or i != q[:3] or f != q[:3]:
            continue
        B, H, L, dk = q
        dv = v[3]
        if shapes[r["C0"]] != (B, H, dk, dv) or shapes[r["n0"]] != (B, H, dk) or shapes[r["m0"]] != (B, H, 1):
            continue
        want = {"h": (B, H, L, dv), "C": (B, H, dk, dv), "n": (B, H, dk), "m": (B, H, 1)}
        for roles_out in itertools.permutations(_ROLES_OUT, len(outs)):  # unused final states are dead
            o = dict(zip(roles_out, outs))
            if "h" in o and all(shapes[o[x]] == want[x] for x in o):
                found.append((r, o))
    return found


def _literals(nodes: frozenset[fx.Node]) -> set[float]:
    out: set[float] = set()
    for n in nodes:
        for a in (*n.args, *n.kwargs.values()):
            if isinstance(a, float) and math.isfinite(a) and a > 0:
                out.add(a)
    return out


def _prove(gm: fx.GraphModule, comp: set[fx.Node], ins: list[fx.Node], outs: list[fx.Node]) -> Optional[MlstmRegion]:
    """The region's roles, scale and eps for which it equals the step reference, or None."""
    if sum(_val(n).numel() for n in comp if _val(n) is not None) > MAX_EVAL_ELEMENTS:
        return None
    nodes = frozenset(comp)
    literals = _literals(nodes)
    gen = torch.Generator().manual_seed(20260316)
    f64 = torch.float64
    for roles, oroles in _assignments(ins, outs):
        vals = {}
        for name, node in roles.items():
            shape = tuple(_val(node).shape)
            x = torch.randn(shape, generator=gen, dtype=f64)
            vals[name] = x + 2.0 if name == "f" else x  # forget gates mostly open, as trained models have
        try:
            with exact_arithmetic():  # in float64: the proof does not depend on the model's dtype or casts
                got = region_subgraph(gm, ins, nodes, list(oroles.values()))(*[vals[_role_of(roles, n)] for n in ins])
        except Exception:  # noqa: BLE001 - a region that does not run on its own is not claimed
            return None
        if not all(isinstance(x, torch.Tensor) and x.dtype == f64 and torch.isfinite(x).all() for x in got):
            return None
        dk = _val(roles["q"]).shape[-1]
        for scale in sorted({1.0, dk ** -0.5, *literals}):
            for eps in sorted({0.0, *(x for x in literals if x <= 1e-2)}):
                ref = dict(zip(_ROLES_OUT, mlstm_step_reference(*(vals[x] for x in _ROLES_IN), scale=scale, eps=eps)))
                want = [ref[x] for x in oroles]
                if all(float((a - b).abs().max()) <= PROOF_TOL * max(float(b.abs().max()), 1e-300)
                       for a, b in zip(got, want)):
                    return MlstmRegion(dict(roles), dict(oroles), nodes, scale, eps)
    return None


def _role_of(roles: dict[str, fx.Node], node: fx.Node) -> str:
    return next(r for r, n in roles.items() if n is node)


_CATS = (aten.cat.default, aten.concatenate.default)
_COPIES = (aten.contiguous.default, aten.clone.default)


def _full_source(node: fx.Node) -> Optional[fx.Node]:
    """``X`` when ``node`` is ``X[:, :, 0:L]`` (copied or not), else None."""
    while node.op == "call_function" and node.target in _COPIES:
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.slice.Tensor or len(node.args) < 4:
        return None
    x, dim, start = node.args[:3]
    if not isinstance(x, fx.Node) or _val(x) is None or dim % _val(x).dim() != 2 or start not in (0, None):
        return None
    return x


def _extend(gm: fx.GraphModule, r: MlstmRegion, live: set[fx.Node]) -> Optional[MlstmRegion]:
    """The region extended over the rest of the sequence (module doc): when the block outputs
    are concatenated along time with the outputs of more steps (``mlstm_recurrent_sequence_native``
    over the tail shorter than a block, started from the block kernel's final states), the
    whole concatenation read from the full-length ``q, k, v, i, f``; proven like the region,
    with its ``scale``/``eps``, in float64."""
    cats = [u for u in r.outputs["h"].users if u.op == "call_function" and u.target in _CATS
            and isinstance(u.args[0], (list, tuple)) and u.args[0][0] is r.outputs["h"]
            and (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)) % 4 == 2]
    full = {x: _full_source(r.inputs[x]) for x in "qkvif"}
    if len(cats) != 1 or any(v is None for v in full.values()):
        return None
    cat = cats[0]
    T = _val(cat).shape[2]
    if any(_val(v).shape[2] != T for v in full.values()):
        return None
    inits = [r.inputs[x] for x in ("C0", "n0", "m0")]
    outside = ancestors([*full.values(), *inits])
    nodes = (ancestors([cat]) - outside) | set(r.nodes)
    ins = sorted({a for n in nodes for a in n.all_input_nodes if a not in nodes},
                 key={n: j for j, n in enumerate(gm.graph.nodes)}.__getitem__)
    if set(ins) != {*full.values(), *inits} or not _writes_stay_inside(frozenset(nodes)):
        return None
    outs = [n for n in nodes if any(u in live and u not in nodes for u in n.users)]
    if outs != [cat]:
        return None  # the tail's final states are used too: not claimed (left as it is)
    roles = {**full, "C0": r.inputs["C0"], "n0": r.inputs["n0"], "m0": r.inputs["m0"]}
    gen = torch.Generator().manual_seed(20260317)
    vals = {x: torch.randn(tuple(_val(n).shape), generator=gen, dtype=torch.float64) + (2.0 if x == "f" else 0.0)
            for x, n in roles.items()}
    try:
        with exact_arithmetic():
            got = region_subgraph(gm, ins, nodes, cat)(*[vals[_role_of(roles, n)] for n in ins])
    except Exception:  # noqa: BLE001 - a region that does not run on its own is not claimed
        return None
    want = mlstm_step_reference(*(vals[x] for x in _ROLES_IN), scale=r.scale, eps=r.eps)[0]
    if got.shape != want.shape or not bool(torch.isfinite(got).all()) or \
            float((got - want).abs().max()) > PROOF_TOL * float(want.abs().max()):
        return None
    return MlstmRegion(roles, {"h": cat}, frozenset(nodes), r.scale, r.eps)


_VIEW_OPS = (aten.slice.Tensor, aten.select.int, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.transpose.int, aten.permute.default, aten.expand.default, aten.alias.default,
             aten.narrow.default, aten.as_strided.default, aten.diagonal.default, aten._unsafe_view.default)


def _writes_stay_inside(nodes: frozenset[fx.Node]) -> bool:
    """Every mutating op of ``nodes`` writes into (a view of) a tensor allocated inside ``nodes``."""
    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        base = n.args[0] if n.args else None
        while isinstance(base, fx.Node) and base.target in _VIEW_OPS:
            base = base.args[0]
        if not isinstance(base, fx.Node) or base not in nodes or base.all_input_nodes:
            return False  # an allocation (zeros, empty) reads no node
    return True


def match_chunkwise_mlstm(gm: fx.GraphModule) -> list[MlstmRegion]:
    """Every proven chunkwise mLSTM region of ``gm`` (module doc)."""
    live = live_nodes(gm)
    order = {n: j for j, n in enumerate(gm.graph.nodes)}
    found = []
    for comp in _candidates(gm):
        ins = sorted({a for n in comp for a in n.all_input_nodes if a not in comp}, key=order.__getitem__)
        outs = sorted({n for n in comp if any(u in live and u not in comp for u in n.users)}, key=order.__getitem__)
        # exactly the eight roles enter (the kernel builds its masks and buffers itself), and
        # every in-place write lands in a buffer the region allocated (no effect outside it)
        if len(ins) != len(_ROLES_IN) or not all(_val(n) is not None for n in (*ins, *outs)) \
                or not _writes_stay_inside(comp):
            continue
        region = _prove(gm, comp, ins, outs)
        if region is None:
            continue
        whole = _extend(gm, region, live)
        if whole is not None:
            found.append(whole)
        elif not _cropped(region):
            found.append(region)
        # else: the blocks cover part of the sequence and the rest is not claimed with them; a
        # loop over part of the time axis would only move the plans' refusal elsewhere
    return found


def _cropped(r: MlstmRegion) -> bool:
    """Whether the region reads ``q, k, v, i, f`` cut short of a longer sequence."""
    L = _val(r.inputs["q"]).shape[2]
    return any((x := _full_source(r.inputs[role])) is not None and _val(x).shape[2] != L for role in "qkvif")


def _emit_steps(graph: fx.Graph, r: MlstmRegion, trace: Any) -> dict[str, fx.Node]:
    """The step recurrence written out (module doc), in the dtype of ``q``; role -> new node."""
    e = lambda target, *args: emit_node(graph, target, args, trace)  # noqa: E731
    q, k, v, i, f = (r.inputs[x] for x in "qkvif")
    dtype = _val(q).dtype
    C, n, m = (r.inputs[x] if _val(r.inputs[x]).dtype == dtype else e(aten.to.dtype, r.inputs[x], dtype)
               for x in ("C0", "n0", "m0"))
    hs, Cs, ns, ms = [], [], [], []
    L = _val(q).shape[2]
    for t in range(L):
        f_t = e(aten.unsqueeze.default, e(aten.select.int, f, 2, t), -1)
        i_t = e(aten.unsqueeze.default, e(aten.select.int, i, 2, t), -1)
        q_t, k_t, v_t = (e(aten.select.int, x, 2, t) for x in (q, k, v))
        logf = e(aten.log_sigmoid.default, f_t)
        m_new = e(aten.maximum.default, e(aten.add.Tensor, logf, m), i_t)
        a = e(aten.exp.default, e(aten.sub.Tensor, e(aten.add.Tensor, logf, m), m_new))
        b = e(aten.exp.default, e(aten.sub.Tensor, i_t, m_new))
        kv = e(aten.mul.Tensor, e(aten.unsqueeze.default, k_t, -1), e(aten.unsqueeze.default, v_t, -2))
        C = e(aten.add.Tensor, e(aten.mul.Tensor, e(aten.unsqueeze.default, a, -1), C),
              e(aten.mul.Tensor, e(aten.unsqueeze.default, b, -1), kv))
        n = e(aten.add.Tensor, e(aten.mul.Tensor, a, n), e(aten.mul.Tensor, b, k_t))
        qs = e(aten.unsqueeze.default, e(aten.mul.Tensor, q_t, r.scale), 2)
        num = e(aten.squeeze.dim, e(aten.matmul.default, qs, C), 2)
        qn = e(aten.squeeze.dim, e(aten.matmul.default, qs, e(aten.unsqueeze.default, n, -1)), 2)
        den = e(aten.add.Tensor, e(aten.maximum.default, e(aten.abs.default, qn),
                                   e(aten.exp.default, e(aten.neg.default, m_new))), r.eps)
        hs.append(e(aten.div.Tensor, num, den))
        m = m_new
        Cs.append(C)
        ns.append(n)
        ms.append(m)

    def last(steps: list[fx.Node]) -> fx.Node:
        """The last step's value, read from the stacked steps: a loop's value after its last step
        may not leave it (a chunked plan runs it inside its region), its stacked steps may."""
        return e(aten.squeeze.dim, e(aten.slice.Tensor, e(aten.stack.default, steps, 2), 2, L - 1, L), 2)

    steps = {"C": Cs, "n": ns, "m": ms}
    return {"h": e(aten.stack.default, hs, 2), **{x: last(steps[x]) for x in r.outputs if x != "h"}}


def rewrite_chunkwise_mlstm_regions(gm: fx.GraphModule) -> list[str]:
    """Replace every proven region of ``gm`` (in place) by the step recurrence; notes."""
    notes = []
    for r in match_chunkwise_mlstm(gm):
        order = {n: j for j, n in enumerate(gm.graph.nodes)}
        # before the first use outside the region: every input precedes the region, so it is in scope
        first = min((u for o in r.outputs.values() for u in o.users if u not in r.nodes), key=order.__getitem__)
        trace = r.outputs["h"].meta.get("stack_trace")
        with gm.graph.inserting_before(first):
            new = _emit_steps(gm.graph, r, trace)
            for role, old in r.outputs.items():
                node = new[role]
                if _val(node).dtype != _val(old).dtype:
                    node = emit_node(gm.graph, aten.to.dtype, (node, _val(old).dtype), trace)
                if tuple(_val(node).shape) != tuple(_val(old).shape):
                    raise AssertionError(f"mLSTM rewrite: {role} shape {tuple(_val(node).shape)} "
                                         f"!= {tuple(_val(old).shape)}")  # ruled out by the role assignment
                old.replace_all_uses_with(node, delete_user_cb=lambda u: u not in r.nodes)
        L = _val(r.inputs["q"]).shape[2]
        notes.append(f"chunkwise mLSTM ({L} steps, {len(r.nodes)} nodes, q={r.inputs['q'].name}, "
                     f"scale={r.scale:g}, eps={r.eps:g}) -> step recurrence carrying (C, n, m)")
        _erase_region(gm, r.nodes)
    return notes


def _erase_region(gm: fx.GraphModule, nodes: frozenset[fx.Node]) -> None:
    """Erase a replaced region's nodes, its in-place writes into the buffers it allocated
    itself (``copy_``, kept by ``eliminate_dead_code`` as side effects) included."""
    for n in reversed(list(gm.graph.nodes)):
        if n in nodes and not n.users:
            gm.graph.erase_node(n)


def _worth_matching(gm: fx.GraphModule) -> bool:
    """Cheap screen: a ``log_sigmoid`` and a ``cumsum``."""
    return bool(gm.graph.find_nodes(op="call_function", target=aten.log_sigmoid.default)) and \
        bool(gm.graph.find_nodes(op="call_function", target=aten.cumsum.default))


@graph_pass
def rewrite_chunkwise_mlstm(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite each proven chunkwise mLSTM region as its step recurrence (see module doc).

    Runs before the time analysis: the analysis then sees a per-step loop along time."""
    if not _worth_matching(gm):
        return PassResult(gm, notes=("no chunkwise mLSTM",))
    new = copy_graph_module(gm)
    notes = rewrite_chunkwise_mlstm_regions(new)
    if not notes:
        return PassResult(gm, notes=("no chunkwise mLSTM",))
    new.graph.lint()
    new.recompile()
    return PassResult(new, changed=True, notes=tuple(notes))
