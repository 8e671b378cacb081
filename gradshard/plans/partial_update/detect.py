"""detect_sliceable_linears: find the MLP and attention projections partial updates slice.

Pure analysis on the captured aten graph; returns one ``partial_slice`` region per
targeted projection, with its role and layout in ``options``. A projection is an
``aten.linear(x, W, b)`` or an ``aten.addmm(b, x, W)`` (GPT-2's ``Conv1D``, weight stored
``(in, out)``: ``options["transposed"]``) whose weight is a parameter placeholder.
Structure, not names, decides (paper, section 2.2.1):

- **MLP** (``"mlp"``): a projection ``down`` whose input is reached from projections
  ``in_1..in_j`` through feature-wise ops only (activations, gating products, dropout,
  casts, reshapes of the token dims, and pieces cut from the feature dim). The hidden
  width ``h`` is ``down``'s input size; every output row of an ``in_i`` feeds one hidden
  unit, and slice ``k`` owns the units ``even_bounds(h, N)[k]``: ``in_i`` are split by
  the rows of those units, ``down`` by the columns, so slice ``k`` of every projection
  forms one independent sub-MLP. A *fused* ``gate_up`` projection (its output chunked
  into gate and up) is split inside each block::

      x ─ linear(gate_up) ─ chunk ─┬─ silu ─┐
                                   └────── mul ─ linear(down)
      gate_up rows: [gate: k=0 | k=1][up: k=0 | k=1]     down columns: [k=0 | k=1]

  A norm (or any reduction) over the hidden units between the projections is not
  feature-wise: the structure is not an MLP.

- **attention** (``"attention"``): projections of one common input whose output, or
  each piece of it when it is split/chunked/narrowed into pieces that feed different
  consumers (a fused ``qkv``), is viewed as ``(..., heads, head_dim)`` and reaches
  ``scaled_dot_product_attention`` or a matmul. The rows behind every head are found by
  running the graph's view/split ops on an index tensor, so fused layouts of any order
  work: q|k|v blocks (Phi-3, GPT-2) and per-head interleaved ones (GPT-NeoX). Pieces
  with the most heads are queries; the others (keys/values; fewer heads under GQA) must
  share one head count that divides the query count. Heads are split by whole kv-head
  groups (:func:`gradshard.plans.partial_update.runtime.attention_layouts`), each piece of a fused
  projection separately; a piece that does not reach attention but has the query head
  shape (a per-head output gate, Qwen3-Next) follows the query heads. Output projections
  are not sliced (the paper found that hurts).

Anything else (embeddings, output projections, norms, the LM head, SSM mixers) stays
ordinary and is trained by every rank. Slicing never changes values or input gradients,
only which weight entries get gradients, so a structure this pass does not recognise is
left unsliced (with a note), never mis-differentiated. When nothing at all is found the
pass refuses, naming the fused projections it saw and why they are not MLP/attention.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from gradshard.errors import GradshardError, node_error
from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.plans.partial_update.layout import (
    PartialUpdateError,
    SliceLayout,
    attention_layouts,
    default_slice_index,
    even_bounds,
    layout_from_owners,
    mlp_out_layout,
)

__all__ = ["detect_sliceable_linears", "PARTIAL_KIND", "TARGETS"]

PARTIAL_KIND = "partial_slice"
TARGETS = ("mlp", "attention")

_aten = torch.ops.aten
_LINEAR = _aten.linear.default
_ADDMM = _aten.addmm.default
_ELEMENTWISE_EXTRA = {
    _aten.dropout.default,
    _aten.to.dtype,
    _aten._to_copy.default,
    _aten.type_as.default,
    _aten.alias.default,
}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
# Ops that only re-index the projection output (run on an index probe, see _apply).
_SAME = {
    _aten.contiguous.default, _aten.clone.default, _aten.alias.default, _aten.detach.default,
    _aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.type_as.default,
}
_MOVES = {
    _aten.transpose.int, _aten.permute.default, _aten.t.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default,
}
_SPLITS = {_aten.chunk.default, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int}
_SLICES = {_aten.slice.Tensor, _aten.narrow.default, _aten.select.int}
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
    transposed: bool  # addmm(b, x, W) with W stored (in, out)


@dataclass(frozen=True)
class _Piece:
    """One piece of a projection output: the node it ends at, its rows per head, reach."""

    node: fx.Node
    rows: torch.Tensor  # (heads, head_dim) row indices of the projection weight
    reaches_attention: bool

    @property
    def heads(self) -> int:
        return self.rows.shape[0]

    @property
    def head_dim(self) -> int:
        return self.rows.shape[1]


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _param_name(node: object, params: set[str]) -> str | None:
    if isinstance(node, fx.Node) and node.op == "placeholder":
        name = node.meta.get("gs_input_name")
        return name if name in params else None
    return None


def _param_linears(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, _Linear]:
    """Every ``linear``/``addmm`` whose weight (and bias, if any) are parameters."""
    params = set(ctx.captured.param_names) if ctx.captured is not None else set()
    out: dict[fx.Node, _Linear] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _LINEAR:
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            transposed = False
        elif node.target is _ADDMM:
            if len(node.args) > 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
                continue
            b, x, w = node.args[:3]
            transposed = True
            if _shape(x) is None or len(_shape(x)) != 2 or _shape(b) is None or len(_shape(b)) != 1:
                continue
        else:
            continue
        wname = _param_name(w, params)
        bname = _param_name(b, params) if b is not None else None
        ws = _shape(w)
        if wname is None or (b is not None and bname is None) or ws is None or len(ws) != 2:
            continue
        out_f, in_f = (ws[1], ws[0]) if transposed else ws
        out[node] = _Linear(node, x, wname, bname, out_f, in_f, transposed)
    return out


def _is_elementwise(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and (
        t in _ELEMENTWISE_EXTRA or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
    )


# --------------------------------------------------------------------------- index probes


def _probe(shape: tuple[int, ...]) -> torch.Tensor:
    """``arange(shape[-1])`` broadcast to ``shape`` without copying (stride 0 on lead dims)."""
    return torch.arange(shape[-1]).expand(*shape)


def _apply(node: fx.Node, probe: torch.Tensor | list) -> torch.Tensor | list | None:
    """Run the re-indexing op ``node`` on ``probe`` (in place of its first argument).

    Returns None when ``node`` is not a pure re-indexing op or would copy the (broadcast)
    probe, e.g. a reshape merging a feature dim into a token dim.
    """
    t = node.target
    try:
        if t is operator.getitem:
            out = probe[node.args[1]]
        elif not isinstance(probe, torch.Tensor):
            return None
        elif t in _RESHAPES:
            out = probe.view(_shape(node))
        elif t in _SAME:
            out = probe
        elif t in _MOVES or t in _SPLITS or t in _SLICES:
            out = t(probe, *node.args[1:], **node.kwargs)
        else:
            return None
    except (RuntimeError, IndexError, TypeError, ValueError):
        return None
    if isinstance(out, torch.Tensor) and tuple(out.shape) != _shape(node):
        return None
    return out


def _feature_rows(probe: torch.Tensor) -> torch.Tensor:
    """The probe's values along its feature dims (non-zero stride), lead dims dropped."""
    idx = tuple(slice(None) if probe.stride(d) != 0 and probe.shape[d] > 1 else 0 for d in range(probe.dim()))
    return probe[idx]


def _trunk(node: fx.Node, probe: torch.Tensor) -> tuple[fx.Node, torch.Tensor]:
    """Follow single-user reshapes/transposes/casts from ``node`` as far as they re-index."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function" or not (user.target in _RESHAPES or user.target in _SAME
                                              or user.target in _MOVES):
            break
        nxt = _apply(user, probe)
        if not isinstance(nxt, torch.Tensor):
            break
        node, probe = user, nxt
    return node, probe


def _split(node: fx.Node, probe: torch.Tensor) -> list[tuple[fx.Node, torch.Tensor]] | None:
    """The pieces ``node`` is cut into, if *every* user cuts it (chunk/split/unbind/slice/select)."""
    pieces: list[tuple[fx.Node, torch.Tensor]] = []
    for user in node.users:
        if user.op != "call_function":
            return None
        if user.target in _SLICES:
            out = _apply(user, probe)
            if not isinstance(out, torch.Tensor):
                return None
            pieces.append((user, out))
        elif user.target in _SPLITS:
            outs = _apply(user, probe)
            if not isinstance(outs, (list, tuple)):
                return None
            for g in user.users:
                out = _apply(g, outs) if g.target is operator.getitem else None
                if not isinstance(out, torch.Tensor):
                    return None
                pieces.append((g, out))
        else:
            return None
    return pieces if len(pieces) > 1 else None


def _head_rows(node: fx.Node, probe: torch.Tensor) -> torch.Tensor | None:
    """``(heads, head_dim)`` weight rows if ``node`` is viewed as (..., heads, head_dim).

    The last dim must be a feature dim (``head_dim``) and at most one other dim may carry
    features (the heads). A single head counts only on a tensor of 4+ dims, i.e. one with
    a head dim of size 1 (MQA keys/values), not a plain ``(batch, tokens, features)``.
    """
    if probe.dim() < 2 or probe.shape[-1] < 2 or probe.stride(-1) == 0:
        return None
    feats = [d for d in range(probe.dim()) if probe.stride(d) != 0 and probe.shape[d] > 1]
    if len(feats) > 2 or (len(feats) == 1 and probe.dim() < 4):
        return None
    return _feature_rows(probe).reshape(-1, probe.shape[-1])


def _operand_slots(user: fx.Node, n: fx.Node) -> tuple[tuple[int, ...], ...]:
    """Where ``n`` sits in ``user``'s arguments (``(i,)`` or ``(i, j)`` inside a list)."""
    slots: list[tuple[int, ...]] = []
    for i, a in enumerate(user.args):
        if a is n:
            slots.append((i,))
        elif isinstance(a, (list, tuple)):
            slots.extend((i, j) for j, b in enumerate(a) if b is n)
    return tuple(slots)


def _attention_operands(start: fx.Node, max_hops: int = 16) -> frozenset[tuple[fx.Node, tuple]]:
    """The attention ops (and operand slots) ``start`` reaches through head-layout and
    elementwise ops (RoPE, GQA repeats, per-head norms) within ``max_hops``."""
    found: set[tuple[fx.Node, tuple]] = set()
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
                found.add((u, _operand_slots(u, n)))
            elif u.target in _HEAD_PATH or _is_elementwise(u):
                frontier.append((u, d + 1))
    return frozenset(found)


def _attention_pieces(lin: _Linear) -> tuple[list[_Piece] | None, bool, str]:
    """The head-shaped pieces of ``lin``'s output, whether the output is cut into pieces
    (reported when left unsliced), and why not if None.

    The output is *fused* when every user of the re-indexed output cuts it into pieces
    that partition the rows and that feed different consumers (different attention
    operands, or attention and not). Pieces that all reach the same operands are one
    tensor cut and rejoined (partial rotary embeddings): the whole output is one piece.
    """
    out_shape = _shape(lin.node)
    if out_shape is None:
        return None, False, "no shape"
    end, probe = _trunk(lin.node, _probe(out_shape))
    split = _split(end, probe)
    cut = False
    readings: list[list[tuple[fx.Node, torch.Tensor]]] = []
    if split is not None:
        rows = torch.cat([_feature_rows(p).reshape(-1) for _, p in split])
        cut = torch.equal(rows.sort().values, torch.arange(lin.out_features))
        ends = [_trunk(n, p) for n, p in split]
        if cut and len({_attention_operands(n) for n, _ in ends}) > 1:
            readings.append(ends)
    readings.append([(end, probe)])
    why = "its output is not viewed as (..., heads, head_dim)"
    for reading in readings:
        pieces = []
        for n, p in reading:
            rows = _head_rows(n, p)
            if rows is None:
                break
            pieces.append(_Piece(n, rows, bool(_attention_operands(n))))
        else:
            if len({p.head_dim for p in pieces}) != 1:
                why = f"its pieces have different head sizes {sorted({p.head_dim for p in pieces})}"
                continue
            if not any(p.reaches_attention for p in pieces):
                why = "no piece of it reaches an attention op (scaled_dot_product_attention / matmul)"
                continue
            return pieces, len(reading) > 1, ""
    return None, cut, why


# --------------------------------------------------------------------------- MLPs


@dataclass(frozen=True)
class _Mlp:
    down: _Linear
    ins: tuple[tuple[_Linear, torch.Tensor], ...]  # (projection, hidden unit of each output row)


def _rows_of(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[:-1]:
        n *= s
    return n


def _mlp_match(down: _Linear, linears: dict[fx.Node, _Linear], order: dict[fx.Node, int]) -> _Mlp | str:
    """Walk back from ``down``'s input through feature-wise ops; map projection rows to units.

    Every node of the walk carries ``umap``: the hidden unit of each position of its
    last dim (-1: none). Nodes are visited latest first, so a node's ``umap`` holds the
    contributions of all its users in the walk before it is passed on.
    """
    hidden = _shape(down.x)
    if hidden is None or down.x in linears:
        return "its input is not a hidden activation"  # back to back: one linear map
    tokens, width = _rows_of(hidden), down.in_features
    umaps: dict[fx.Node, torch.Tensor] = {down.x: torch.arange(width)}
    heap = [(-order[down.x], down.x)]
    region: set[fx.Node] = set()
    found: dict[fx.Node, torch.Tensor] = {}
    broadcast: list[fx.Node] = []
    featurewise = False

    def contribute(node: fx.Node, umap: torch.Tensor) -> str | None:
        s = _shape(node)
        if s is None or not s or _rows_of(s) != tokens:
            return f"`{node.name}` is not token-wise with the hidden activation"
        cur = umaps.get(node)
        if cur is None:
            cur = umaps[node] = torch.full((s[-1],), -1, dtype=torch.long)
            heapq.heappush(heap, (-order[node], node))
        clash = (cur >= 0) & (umap >= 0) & (cur != umap)
        if bool(clash.any()):
            return f"`{node.name}` feeds hidden units inconsistently"
        cur[umap >= 0] = umap[umap >= 0]
        return None

    while heap:
        _, n = heapq.heappop(heap)
        if n in region:
            continue
        region.add(n)
        umap = umaps[n]
        if n in linears:
            found[n] = umap
            continue
        if n.op != "call_function":
            return f"`{n.name}` ({n.op}) is not a projection"
        why = None
        if n.target is operator.getitem or n.target in _RESHAPES or n.target in _SLICES:
            src = n.args[0].args[0] if n.target is operator.getitem else n.args[0]
            ss = _shape(src)
            chain = [n.args[0], n] if n.target is operator.getitem else [n]
            p = _probe(ss) if ss else None
            for step in chain:
                p = _apply(step, p) if p is not None else None
            if not isinstance(p, torch.Tensor) or any(p.stride(d) != 0 and p.shape[d] > 1 for d in range(p.dim() - 1)):
                return f"`{n.name}` ({n.target}) is not a re-indexing of the hidden units' dim"
            src_map = torch.full((ss[-1],), -1, dtype=torch.long)
            src_map[p.reshape(-1, p.shape[-1])[0]] = umap
            why = contribute(src, src_map)
        elif _is_elementwise(n) or n.target in _SAME:
            featurewise = featurewise or n.target not in _SAME
            s = _shape(n)
            for a in n.all_input_nodes:
                if _shape(a) == s:
                    why = why or contribute(a, umap)
                else:
                    broadcast.append(a)  # a per-token scalar or a per-unit vector
        else:
            return f"`{n.name}` ({getattr(n.target, '__name__', n.target)}) is not feature-wise"
        if why:
            return why
    if not found or not featurewise:
        return "no projection reaches it through feature-wise ops"
    for node, umap in found.items():
        if bool((umap < 0).any()):
            return f"some output rows of {linears[node].weight} feed something other than this MLP"
    # A broadcast operand computed from the hidden units (a norm's rsqrt(mean(h^2))) mixes
    # the units: the sub-MLPs are not independent. Only ancestors after the first
    # projection can be in the walk.
    first = min(order[node] for node in found)
    stack, seen = list(broadcast), set()
    while stack:
        a = stack.pop()
        if a in seen or order.get(a, -1) < first:
            continue
        seen.add(a)
        if a in region:
            return f"`{a.name}` mixes the hidden units (e.g. a norm over them)"
        stack.extend(a.all_input_nodes)
    return _Mlp(down, tuple((linears[node], umap) for node, umap in found.items()))


# --------------------------------------------------------------------------- regions


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
            "transposed": lin.transposed,
            "dim": layout.dim,
            "bounds": layout.bounds,
            "owners": layout.owners,
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


def _owners(bounds: tuple[int, ...], size: int) -> torch.Tensor:
    """The slice owning each of ``size`` units split at ``bounds``."""
    return torch.searchsorted(torch.tensor(bounds[1:]), torch.arange(size), right=True)


def _describe(layout: SliceLayout) -> str:
    what = "rows" if layout.dim == 0 else "columns"
    return f"{what} " + " + ".join(f"[{lo}:{hi})" for lo, hi in layout.trainable_spans)


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
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions: list[Region] = []
    notes: list[str] = []
    claimed: set[fx.Node] = set()
    why_not: dict[fx.Node, str] = {}  # fused projections left unsliced, and why
    skipped: list[tuple[fx.Node, str]] = []  # MLP / attention matches that cannot be cut, and why

    def add(lin: _Linear, role: str, layout: SliceLayout, group: str) -> None:
        regions.append(_region(len(regions), lin, role, layout, group))
        claimed.add(lin.node)

    if "mlp" in targets:
        for down in linears.values():
            if down.node in claimed:
                continue
            match = _mlp_match(down, linears, order)
            if isinstance(match, str):
                continue
            if any(lin.node in claimed for lin, _ in match.ins):
                continue
            width = down.in_features
            if width < n_slices:
                notes.append(f"MLP at {down.weight}: hidden width {width} < num_slices {n_slices}; left unsliced")
                skipped.append((down.node, f"the MLP at {down.weight} has hidden width {width} < num_slices {n_slices}"))
                continue
            unit_owner = _owners(even_bounds(width, n_slices), width)
            group = f"mlp:{down.node.name}"
            parts = []
            for lin, umap in match.ins:
                layout = layout_from_owners(0, unit_owner[umap].tolist(), index)
                add(lin, "mlp_in", layout, group)
                parts.append(f"{lin.weight} ({_describe(layout)})")
            add(down, "mlp_out", mlp_out_layout(width, n_slices, index), group)
            notes.append(f"MLP (hidden {width}): {', '.join(parts)}; {down.weight} by columns")

    if "attention" in targets:
        groups: dict[fx.Node, list[tuple[_Linear, list[_Piece], bool]]] = {}
        for lin in linears.values():
            if lin.node in claimed:
                continue
            pieces, fused, why = _attention_pieces(lin)
            if pieces is None:
                if fused:
                    why_not[lin.node] = why
                continue
            groups.setdefault(lin.x, []).append((lin, pieces, fused))
        for x, members in groups.items():
            label = ", ".join(m[0].weight for m in members)
            every = [p for _, ps, _ in members for p in ps]
            head_dims = {p.head_dim for p in every}
            # queries: the most heads among pieces that reach attention; a piece that does
            # not (a per-head output gate) must have exactly the query heads
            heads = sorted({p.heads for p in every if p.reaches_attention}, reverse=True)
            companions_ok = all(p.reaches_attention or p.heads == heads[0] for p in every)
            if len(head_dims) != 1 or len(heads) > 2 or (len(heads) == 2 and heads[0] % heads[1]) or not companions_ok:
                shapes = sorted({(p.heads, p.head_dim) for p in every})
                notes.append(f"attention projections {label}: head shapes {shapes} are not q/k/v of one "
                             f"(GQA) attention; left unsliced")
                for lin, _, fused in members:
                    if fused:
                        why_not[lin.node] = f"its pieces' head shapes {shapes} are not q/k/v of one attention"
                continue
            (head_dim,), n_heads, n_kv = head_dims, heads[0], heads[-1]
            try:
                attention_layouts(n_heads, n_kv, head_dim, n_slices, index)
            except PartialUpdateError as exc:
                notes.append(f"attention projections {label}: {exc}; left unsliced")
                skipped.append((members[0][0].node, f"attention projections {label}: {exc}"))
                continue
            kv_owner = _owners(even_bounds(n_kv, n_slices), n_kv)
            rep = n_heads // n_kv
            group = f"attention:{x.name}"
            for lin, pieces, fused in members:
                owner = torch.full((lin.out_features,), -1, dtype=torch.long)
                for p in pieces:
                    for h in range(p.heads):
                        owner[p.rows[h]] = kv_owner[h // rep if p.heads == n_heads else h]
                layout = layout_from_owners(0, owner.tolist(), index)
                role = "attn_fused" if len(pieces) > 1 else "attn_q" if pieces[0].heads == n_heads else "attn_kv"
                add(lin, role, layout, group)
                if fused:
                    notes.append(f"fused attention projection {lin.weight}: {len(pieces)} pieces "
                                 f"{[(p.heads, p.head_dim) for p in pieces]}, {_describe(layout)} trainable")
            notes.append(f"attention ({n_heads} heads, {n_kv} kv heads, head_dim {head_dim}): "
                         f"{label} by head groups")
    for node, why in why_not.items():
        if node not in claimed:
            notes.append(f"fused projection {linears[node].weight}: left unsliced: {why}")
    if not regions:
        _refuse(linears, why_not, skipped, targets, n_slices)
    notes.insert(0, f"slice {index} of {n_slices} trains; targets {targets}")
    return PassResult(gm, regions=tuple(regions), notes=tuple(notes))


def _refuse(linears: dict[fx.Node, _Linear], why_not: dict[fx.Node, str], skipped: list[tuple[fx.Node, str]],
            targets: tuple[str, ...], n_slices: int) -> None:
    """Nothing to slice: a clear error, naming a projection that matched but cannot be cut into
    ``n_slices`` slices if any, else a fused projection that was not sliced if any."""
    why = (
        f"plan 'partial_update' found no projection to slice for targets {targets}: it slices MLP "
        f"in/out projections (projections joined by feature-wise ops) and attention q/k/v "
        f"projections (outputs, or pieces of a fused output, viewed as heads feeding attention) "
        f"whose weights are parameters used only by those projections"
    )
    instead = "use plan='none' for full training, or check that the model calls F.linear / nn.Linear"
    if skipped:
        raise node_error(
            skipped[0][0],
            f"{why}. {len(skipped)} MLP / attention projection group(s) matched, but none can be cut into "
            f"num_slices={n_slices} slices: " + "; ".join(r for _, r in skipped),
            f"use a num_slices that divides the (KV) heads and is at most the MLP hidden width, or plan='none' "
            f"for full training",
        )
    if why_not:
        node, reason = next(iter(why_not.items()))
        raise node_error(
            node,
            f"{why}. The fused projection {linears[node].weight} here (its output is cut into "
            f"pieces) is neither an MLP input (its pieces do not reach one down projection through "
            f"feature-wise ops only) nor attention q/k/v ({reason}); this is what an SSM's in_proj "
            f"looks like, whose pieces feed a convolution, a scan and a gate",
            instead,
        )
    raise GradshardError(f"{why}. Use {instead.removeprefix('use ')}")
