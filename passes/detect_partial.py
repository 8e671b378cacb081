"""detect_sliceable_linears: find the MLP and attention projections partial updates slice.

Pure analysis on the captured aten graph (``aten.linear`` nodes whose weight is a
parameter placeholder); returns one ``partial_slice`` region per targeted linear, with
its role and layout in ``options``. Structure, not names, decides (paper, section 2.2.1):

- **MLP** (``"mlp"``): a linear ``down`` whose input is reached from one or more linears
  ``in_1..in_j`` of one common input ``x`` through feature-wise elementwise ops only
  (activations, gating products, dropout, casts). The hidden width ``h`` is ``down``'s
  input size; ``in_i`` are split by output rows and ``down`` by input columns, at the same
  boundaries, so slice ``k`` of every projection forms one independent sub-MLP::

      x ─ linear(up) ─┐
      x ─ linear(gate) ─ silu ─ mul ─ linear(down)     =>   up, gate: rows   down: columns

- **attention** (``"attention"``): linears of one common input whose output is viewed as
  ``(..., heads, head_dim)`` and then reaches ``scaled_dot_product_attention`` or a
  matmul. The one with the most heads is ``q``; the others (``k``, ``v``; fewer heads
  under GQA) must share one head count that divides ``q``'s. They are split by whole
  head groups consistently (:func:`gradshard.runtime.partial.attention_layouts`). Output
  projections are not sliced (the paper found that hurts).

Anything else (embeddings, output projections, norms, the LM head) stays ordinary and is
trained by every rank. Slicing never changes values or input gradients, only which weight
entries get gradients, so a structure this pass does not recognise is left unsliced
(with a note), never mis-differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from gradshard.errors import GradshardError
from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.runtime.partial import (
    PartialUpdateError,
    SliceLayout,
    attention_layouts,
    default_slice_index,
    mlp_in_layout,
    mlp_out_layout,
)

__all__ = ["detect_sliceable_linears", "PARTIAL_KIND", "TARGETS"]

PARTIAL_KIND = "partial_slice"
TARGETS = ("mlp", "attention")

_aten = torch.ops.aten
_LINEAR = _aten.linear.default
_ELEMENTWISE_EXTRA = {
    _aten.dropout.default,
    _aten.to.dtype,
    _aten._to_copy.default,
    _aten.type_as.default,
    _aten.alias.default,
}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_HEAD_PATH = _RESHAPES | {
    _aten.transpose.int,
    _aten.permute.default,
    _aten.unsqueeze.default,
    _aten.expand.default,
    _aten.slice.Tensor,
    _aten.cat.default,
    _aten.contiguous.default,
    _aten.clone.default,
    _aten.repeat_interleave.self_int,
    _aten.repeat.default,
    _aten.select.int,
}
_ATTENTION_OPS = {
    _aten.scaled_dot_product_attention.default,
    _aten.matmul.default,
    _aten.bmm.default,
    _aten.einsum.default,
}


@dataclass(frozen=True)
class _Linear:
    node: fx.Node
    x: fx.Node
    weight: str  # original (qualified) parameter name
    bias: str | None
    out_features: int
    in_features: int


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _param_linears(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, _Linear]:
    params = set(ctx.captured.param_names) if ctx.captured is not None else set()
    out: dict[fx.Node, _Linear] = {}
    for node in gm.graph.find_nodes(op="call_function", target=_LINEAR):
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        names = [a.meta.get("gs_input_name") if isinstance(a, fx.Node) and a.op == "placeholder" else None
                 for a in (w, b)]
        if names[0] not in params or (b is not None and names[1] not in params):
            continue
        ws = _shape(w)
        if ws is None or len(ws) != 2:
            continue
        out[node] = _Linear(node, x, names[0], names[1], ws[0], ws[1])
    return out


def _is_elementwise(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and (
        t in _ELEMENTWISE_EXTRA or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
    )


def _mlp_inputs(down: _Linear, linears: dict[fx.Node, _Linear]) -> list[_Linear] | None:
    """The in-projections feeding ``down`` through elementwise ops, or None if not an MLP."""
    hidden_shape = _shape(down.x)
    if hidden_shape is None or down.x in linears:
        return None  # two linears back to back are one linear map, not an MLP
    found: list[_Linear] = []
    frontier, seen = [down.x], set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        lin = linears.get(n)
        if lin is not None:
            if lin.out_features != down.in_features or _shape(n) != hidden_shape:
                return None
            found.append(lin)
            continue
        if not isinstance(n, fx.Node) or not _is_elementwise(n) or _shape(n) != hidden_shape:
            return None
        for a in n.all_input_nodes:
            s = _shape(a)
            if s is not None and s == hidden_shape:
                frontier.append(a)
            elif a.op not in ("placeholder", "get_attr") and s is not None and s and s[-1] == down.in_features:
                return None  # a full-width input that is neither a projection nor broadcast
    if not found or len({lin.x for lin in found}) != 1:
        return None
    return found


def _heads(lin: _Linear) -> tuple[int, int] | None:
    """``(heads, head_dim)`` if the output is only viewed as (..., heads, head_dim)."""
    users = list(lin.node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _RESHAPES:
        return None
    s, out = _shape(users[0]), _shape(lin.node)
    if s is None or out is None or len(s) != len(out) + 1 or s[:-2] != out[:-1]:
        return None
    if s[-2] * s[-1] != lin.out_features:
        return None
    return s[-2], s[-1]


def _reaches_attention(start: fx.Node, max_hops: int = 16) -> bool:
    frontier, seen = [(start, 0)], set()
    while frontier:
        n, d = frontier.pop()
        if n in seen or d > max_hops:
            continue
        seen.add(n)
        for u in n.users:
            if u.op != "call_function":
                continue
            if u.target in _ATTENTION_OPS:
                return True
            if u.target in _HEAD_PATH or _is_elementwise(u):
                frontier.append((u, d + 1))
    return False


def _region(i: int, lin: _Linear, role: str, layout: SliceLayout, group: str) -> Region:
    n = lin.node
    return Region(
        kind=PARTIAL_KIND,
        name=f"partial_{i}",
        nodes=(n.name,),
        inputs=tuple(a.name for a in n.all_input_nodes),
        outputs=(n.name,),
        time_axis=None,
        source=source_of(n),
        options={
            "role": role,
            "weight": lin.weight,
            "bias": lin.bias,
            "dim": layout.dim,
            "bounds": layout.bounds,
            "index": layout.index,
            "group": group,
        },
    )


def _check_targets(targets: tuple[str, ...]) -> None:
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise GradshardError(
            f"plan 'partial_update': targets={targets!r}; choose a non-empty subset of {TARGETS}"
        )


@graph_pass
def detect_sliceable_linears(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Find MLP and attention input projections to slice (analysis; graph unchanged)."""
    opts = ctx.options
    targets = tuple(opts.targets)
    _check_targets(targets)
    n_slices = opts.num_slices
    index = opts.slice_index if opts.slice_index is not None else default_slice_index(n_slices)
    if not 0 <= index < n_slices:
        raise GradshardError(
            f"plan 'partial_update': slice_index={index} is out of range for num_slices={n_slices}"
        )
    linears = _param_linears(gm, ctx)
    regions: list[Region] = []
    notes: list[str] = []
    claimed: set[fx.Node] = set()

    def add(lin: _Linear, role: str, layout: SliceLayout, group: str) -> None:
        regions.append(_region(len(regions), lin, role, layout, group))
        claimed.add(lin.node)

    if "mlp" in targets:
        for down in linears.values():
            ins = _mlp_inputs(down, linears)
            if ins is None or down.node in claimed or any(i.node in claimed for i in ins):
                continue
            if down.in_features < n_slices:
                notes.append(f"MLP at {down.weight}: hidden width {down.in_features} < num_slices "
                             f"{n_slices}; left unsliced")
                continue
            group = f"mlp:{down.node.name}"
            for lin in ins:
                add(lin, "mlp_in", mlp_in_layout(down.in_features, n_slices, index), group)
            add(down, "mlp_out", mlp_out_layout(down.in_features, n_slices, index), group)
            notes.append(f"MLP (hidden {down.in_features}): {', '.join(i.weight for i in ins)} by rows, "
                         f"{down.weight} by columns")

    if "attention" in targets:
        groups: dict[fx.Node, list[tuple[_Linear, int, int]]] = {}
        for lin in linears.values():
            if lin.node in claimed:
                continue
            hd = _heads(lin)
            if hd is None or not _reaches_attention(next(iter(lin.node.users))):
                continue
            groups.setdefault(lin.x, []).append((lin, *hd))
        for x, members in groups.items():
            dims = {hd for _, _, hd in members}
            heads = sorted({h for _, h, _ in members}, reverse=True)
            label = ", ".join(m[0].weight for m in members)
            if len(dims) != 1 or len(heads) > 2 or (len(heads) == 2 and heads[0] % heads[1]):
                notes.append(f"attention projections {label}: head shapes {sorted({(h, d) for _, h, d in members})} "
                             f"are not q/k/v of one (GQA) attention; left unsliced")
                continue
            (head_dim,), n_heads, n_kv = dims, heads[0], heads[-1]
            try:
                q_layout, kv_layout = attention_layouts(n_heads, n_kv, head_dim, n_slices, index)
            except PartialUpdateError as exc:
                notes.append(f"attention projections {label}: {exc}; left unsliced")
                continue
            group = f"attention:{x.name}"
            for lin, h, _ in members:
                if h == n_heads:
                    add(lin, "attn_q", q_layout, group)
                else:
                    add(lin, "attn_kv", kv_layout, group)
            notes.append(f"attention ({n_heads} heads, {n_kv} kv heads, head_dim {head_dim}): "
                         f"{label} by head groups")
    notes.insert(0, f"slice {index} of {n_slices} trains; targets {targets}")
    return PassResult(gm, regions=tuple(regions), notes=tuple(notes))
