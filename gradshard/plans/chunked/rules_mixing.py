"""Chunk rules for ops that read across time: causal contractions and reductions over the
key axis of a score matrix, softmax over keys, SDPA (flash attention against the KV cache),
scans carried across chunks (cumsum/cumprod/logcumsumexp, ``gradshard::linear_scan``),
convolutions along time (a window into the past), rolled loop bodies, and the ops that
are refused (reductions/normalisations over time, reverse scans). Registered into
:data:`gradshard.plans.chunked.rules.CHUNK_RULES` on import.
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.ops.rolled_body import run_rolled_body
from gradshard.plans.chunked.frames import SKIP, Demand, DimMap, TDim
from gradshard.plans.chunked.rules_block import block_readout_rule, block_states_rule, match_block_scan
from gradshard.plans.chunked.rules_local import pointwise_rule
from gradshard.plans.chunked.rules import (
    AttentionSource, BuildCtx, CHUNK_RULES, default_run, meta_shape, NodeRule, positional,
    rebuild_args, register_chunk_rule, slots_of, _arg, _frame_from, _index_of, _INSTEAD, _norm,
    op_name,
)

aten = torch.ops.aten


# --------------------------------------------------------------------------- contractions


def _check_causal_mixer(node: fx.Node, bc: BuildCtx, what: str) -> None:
    info = bc.tl.info.get(node.name)
    local = info.local if info is not None else None
    if local is None or not (local.lo == -math.inf and local.hi <= 0):
        raise node_error(node, f"{what} reads future steps (non-causal attention: no causal mask, "
                         "or one gradshard cannot verify)", "mask the scores causally (is_causal=True or "
                         "a causal mask built in the model), or use plan='none'")


def _place_operand(frame: Any, rank: int, contract: int, nd: int, outs: list[TDim], row: list[tuple[TDim, Any]]) -> bool:
    """Map one matmul operand's time dims to the output (``outs``, ``row``); True if time is contracted."""
    contracted = False
    for td in frame:
        if td.dim == contract:
            row.append((td, "contract"))
            contracted = True
        else:
            out = replace(td, dim=td.dim + nd - rank)
            outs.append(out)
            row.append((td, out.dim))
    return contracted


def _matmul_like(node: fx.Node, bc: BuildCtx, a: fx.Node, b: fx.Node, bias: Any = None) -> NodeRule:
    out = meta_shape(node)
    nd = len(out)
    sa, sb = meta_shape(a), meta_shape(b)
    if len(sa) < 2 or len(sb) < 2:
        raise node_error(node, "matrix-vector products along time are not supported", _INSTEAD)
    outs: list[TDim] = []
    row_a: list[tuple[TDim, Any]] = []
    row_b: list[tuple[TDim, Any]] = []
    # a's last dim and b's second-to-last are contracted; every other dim keeps its place
    # counted from the end (batch dims broadcast to the output's rank ``nd``)
    contracted = _place_operand(bc.frame(a), len(sa), len(sa) - 1, nd, outs, row_a)
    contracted |= _place_operand(bc.frame(b), len(sb), len(sb) - 2, nd, outs, row_b)
    frame = _frame_from(outs)
    if contracted:
        if len({td.tail for td, where in (*row_a, *row_b) if where == "contract"}) > 1:
            raise node_error(node, "contracts a time axis whose appended positions (a sink column) only one "
                             "operand has", "drop them before the product (probs[..., :-1] @ v), append as "
                             "many to the other operand, or use plan='none'")
        _check_causal_mixer(node, bc, f"the product `{node.name}` contracts the time axis and")
        if len(frame) != 1:
            raise node_error(node, "contracts time but keeps no query time axis", _INSTEAD)
        if not bc.tl.info[a.name].causal_mask:
            raise node_error(node, "contracts time with a score matrix that is not causally masked", _INSTEAD)

    def maps_for(row: list[tuple[TDim, Any]]) -> tuple[DimMap, ...] | None:
        if not row:
            return None
        return tuple(DimMap("prefix", 0) if where == "contract" else DimMap("same", _index_of(frame, where))
                     for _, where in row)

    slot_maps: list[Any] = []
    for s in slots_of(node):
        if s is a:
            slot_maps.append(maps_for(row_a))
        elif s is b:
            slot_maps.append(maps_for(row_b))
        elif s is bias:
            bf = bc.frame(s)
            sh = meta_shape(s)
            slot_maps.append(tuple(DimMap("same", _index_of(frame, t.dim + nd - len(sh))) for t in bf) or None)
        else:
            slot_maps.append(None)
    return NodeRule(frame, tuple(slot_maps), default_run, kind="mixer" if contracted else "local",
                    note="causal contraction over time" if contracted else "")


@register_chunk_rule(aten.matmul, aten.bmm, aten.mm)
def _matmul_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    a, b = node.args[0], node.args[1]
    if a is b:
        raise node_error(node, "multiplies a tensor with itself", _INSTEAD)
    return _matmul_like(node, bc, a, b)


@register_chunk_rule(aten.addmm, aten.baddbmm)
def _addmm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    return _matmul_like(node, bc, node.args[1], node.args[2], bias=node.args[0])


@register_chunk_rule(aten.linear)
def _linear_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    x = node.args[0]
    if any(bc.frame(w) for w in node.args[1:]):
        raise node_error(node, "the weight of a linear layer runs along time", _INSTEAD)
    if any(t.dim == len(meta_shape(x)) - 1 for t in bc.frame(x)):
        raise node_error(node, "a linear layer mixes the time axis", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td)


def _einsum_letters(spec: str, nd: int) -> list[str]:
    if "..." in spec:
        pre, post = spec.split("...")
        return list(pre) + [f"_{i}" for i in range(nd - len(pre) - len(post))] + list(post)
    return list(spec)


@register_chunk_rule(aten.einsum)
def _einsum_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    eq = node.args[0].replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    operands = list(node.args[1])
    specs = lhs.split(",")
    out = meta_shape(node)
    if not rhs:
        raise node_error(node, "einsum without an explicit output", "write the '->' part of the equation")
    out_letters = _einsum_letters(rhs, len(out))
    letter_t: dict[str, TDim] = {}
    for spec, op in zip(specs, operands):
        letters = _einsum_letters(spec, len(meta_shape(op)))
        for td in bc.frame(op):
            letter_t[letters[td.dim]] = td
    outs = [replace(t, dim=out_letters.index(l)) for l, t in letter_t.items() if l in out_letters]
    frame = _frame_from(outs)
    contracted = [l for l in letter_t if l not in out_letters]
    if contracted:
        _check_causal_mixer(node, bc, f"the einsum `{node.name}` contracts the time axis and")
        if len(frame) != 1:
            raise node_error(node, "contracts time but keeps no query time axis", _INSTEAD)
    slot_maps = []
    for s in slots_of(node):
        letters = _einsum_letters(specs[operands.index(s)], len(meta_shape(s)))
        maps = []
        for td in bc.frame(s):
            l = letters[td.dim]
            maps.append(DimMap("prefix", 0) if l in contracted else DimMap("same", _index_of(frame, out_letters.index(l))))
        slot_maps.append(tuple(maps) or None)
    rule = NodeRule(frame, tuple(slot_maps), default_run, kind="mixer" if contracted else "local")
    for op in operands:  # the contraction of a scan's state: block form (rules_block.py)
        bs = match_block_scan(op, bc)
        if bs is not None:
            return block_readout_rule(rule, node, bs)
    return rule


# --------------------------------------------------------------------------- reductions


def _reduced_dims(node: fx.Node, nd: int) -> tuple[list[int] | None, bool]:
    t = node.target
    if t in (aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default):
        dims = _arg(node, 2, "dim")
        keep = _arg(node, 3, "keepdim", False)
    elif t in (aten.sum.default, aten.mean.default, aten.amax.default, aten.amin.default) and len(node.args) < 2:
        dims, keep = None, False
    else:
        dims = _arg(node, 1, "dim")
        keep = _arg(node, 2, "keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None, bool(keep)
    return [_norm(d, nd) for d in dims], bool(keep)


@register_chunk_rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod,
                     aten.var, aten.std, aten.norm, aten.linalg_vector_norm, aten.logsumexp,
                     aten.any, aten.all, aten.argmax, aten.argmin, aten.var_mean, aten.std_mean)
def _reduce_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if len(node.args) > 1 and isinstance(node.args[1], fx.Node):  # max.other / min.other: elementwise
        return pointwise_rule(node, bc)
    src = node.args[0]
    shp = meta_shape(src)
    nd = len(shp)
    dims, keep = _reduced_dims(node, nd)
    if node.target in (aten.max.default, aten.min.default):
        dims = None
    red = set(range(nd)) if dims is None else set(dims)
    fr = bc.frame(src)
    time_red = [t for t in fr if t.dim in red]
    kept = [t for t in fr if t.dim not in red]

    def out_dim(d: int) -> int:
        return d if keep else d - sum(1 for r in red if r < d)

    multi = isinstance(node.meta.get("val"), (tuple, list))
    if time_red and not kept:
        return NodeRule((), (None,) * len(slots_of(node)), default_run, kind="global",
                        note="reduces over the whole sequence")
    if not time_red:
        rule = positional(node, bc, lambda i, a, td: replace(td, dim=out_dim(td.dim)))
        if multi:
            rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
        return rule
    # a reduction over the key axis of a score matrix (manual softmax / attention pooling)
    if len(kept) != 1 or len(time_red) != 1 or not bc.tl.info[src.name].causal_mask:
        raise node_error(node, "reduces over the time axis inside the model (reads future steps)", _INSTEAD)
    frame = (TDim(out_dim(kept[0].dim), kept[0].length, kept[0].inner),)
    maps = tuple(DimMap("prefix", 0) if t in time_red else DimMap("same", 0) for t in fr)
    slots = tuple(maps if s is src else None for s in slots_of(node))
    rule = NodeRule(frame, slots, default_run, kind="mixer", note="reduction over causal keys")
    if multi:
        rule.elem_frames = tuple(frame for _ in node.meta["val"])
    return rule


def _softmax_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    d = _norm(node.args[1], vals[0].dim())
    k = _index_of(rule.frame, d)
    other = [w for j, w in enumerate(demand) if j != k]
    if demand[k][0] != 0 or (other and demand[k][1] != other[0][1]):
        raise RuntimeError(f"gradshard internal: softmax `{node.name}` asked for keys {demand[k]} "
                           f"with queries {other}; keys must be the causal prefix")
    if not ev.recompute:
        _refuse_fully_masked_rows(node, vals[0], d, _softmax_input_dtype(node, vals[0]), _EAGER_PADDING, ev)
    return default_run(node, vals, demand, arg_demands, ev)


def _softmax_input_dtype(node: fx.Node, x: torch.Tensor) -> torch.dtype:
    """The dtype the softmax computes in (``softmax(x, dim, dtype)``; ``_softmax``'s half_to_float)."""
    if node.target in (aten.softmax.int, aten.log_softmax.int):
        dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
        return dtype or x.dtype
    half_to_float = node.args[2] if len(node.args) > 2 else False
    return torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype


_EAGER_PADDING = ("pad on the right, or use plan='none' (under attn_implementation='sdpa' most models give SDPA "
                  "a boolean mask, whose masked rows read no future keys)")


def _refuse_fully_masked_rows(node: fx.Node, scores: torch.Tensor, d: int, dtype: torch.dtype, instead: str,
                              ev: Any) -> None:
    """Refuse (at once, or through ``ev.checks`` when the forward ends) a query row that masks every
    key of its causal prefix with a finite value.

    A causal mask is additive, and transformers' eager attention masks with the dtype's most
    negative finite value (others use -1e9), not -inf: where a row keeps one key, the masked ones weigh 0
    and the prefix is the whole softmax. A row that keeps none (a left-padded position, every
    key before it padding) weighs every key, future ones included: eager mixes the
    values of the whole sequence there, which a chunk of the causal prefix cannot compute.
    (With -inf the row is NaN in eager and in the chunk alike.) ``scores`` are the logits in
    ``dtype`` (a softmax's input) or an SDPA's float mask."""
    if scores.device.type == "meta" or isinstance(scores, torch._subclasses.FakeTensor) or not scores.numel():
        return
    x = scores.detach().to(dtype)
    if not x.is_floating_point():
        return
    top = x.amax(dim=d)
    # masked as the causality proof reads a mask (``is_causal_mask``: below -1e4), finite (a row of
    # -inf is NaN in eager and in the chunk alike)
    failed = ((top < -1e4) & top.isfinite()).any()

    def error() -> Exception:
        return node_error(
            node, "a query row of this attention masks every key up to it with a finite value (left "
            "padding under an additive mask): the model then weighs the values of every "
            "position, future ones included, which a chunk of the sequence cannot compute", instead)

    if ev.checks is not None:
        ev.checks.add(failed, error)
    elif bool(failed):
        raise error()


@register_chunk_rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    d = _norm(node.args[1], len(meta_shape(src)))
    fr = bc.frame(src)
    if not any(t.dim == d for t in fr):
        return positional(node, bc, lambda i, a, td: td)
    if len(fr) != 2 or not bc.tl.info[src.name].causal_mask:
        raise node_error(node, "normalises over the time axis without a causal mask (reads future steps)",
                         "mask the scores causally before the softmax, or use plan='none'")
    return positional(node, bc, lambda i, a, td: td, run=_softmax_run)


@register_chunk_rule(aten.layer_norm, aten.rms_norm, aten.native_layer_norm)
def _norm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    nd = len(meta_shape(src))
    k = len(node.args[1])
    if any(t.dim >= nd - k for t in bc.frame(src)) or any(bc.frame(w) for w in slots_of(node)[1:]):
        raise node_error(node, "normalises over the time axis (reads future steps)", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td)
    if isinstance(node.meta.get("val"), (tuple, list)):
        rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
    return rule


@register_chunk_rule(aten.group_norm, aten.native_group_norm, aten.batch_norm, aten.native_batch_norm,
                     aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
                     aten.instance_norm)
def _batch_norm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    raise node_error(node, f"{op_name(node)} normalises over the time axis (statistics over all steps)",
                     "use LayerNorm/RMSNorm over features, or plan='none'")


@register_chunk_rule(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd)
def _loss_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    reduction = _arg(node, 3, "reduction", 1)
    x, target = node.args[0], node.args[1]
    if any(t.dim == 1 for t in bc.frame(x)) and len(meta_shape(x)) > 1:
        raise node_error(node, "the class dim of the loss runs along time", _INSTEAD)
    rows = [t for t in bc.frame(x) if t.dim == 0]
    if isinstance(target, fx.Node) and rows and not bc.frame(target) and meta_shape(target) \
            and meta_shape(target)[0] == meta_shape(x)[0]:
        bc.missing.append((node, target, (rows[0],)))
    if reduction != 0:
        return NodeRule((), (None,) * len(slots_of(node)), default_run, kind="global",
                        note="loss over the whole sequence")

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        if a is x and len(meta_shape(x)) > 1:
            return replace(td, dim=td.dim if td.dim == 0 else td.dim - 1)
        return td

    return positional(node, bc, mapper)


# --------------------------------------------------------------------------- scans


_COMBINE = {
    aten.cumsum.default: torch.add,
    aten.cumprod.default: torch.mul,
    aten.logcumsumexp.default: torch.logaddexp,
}


def _scan_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    k = 0
    lo, hi = demand[k]
    if lo > ev.start:  # a window starting inside the chunk: compute from the chunk start
        full = ev.value(node, tuple((ev.start, hi) if j == k else w for j, w in enumerate(demand)))
        return full.narrow(rule.frame[k].dim, lo - ev.start, hi - lo)
    out = default_run(node, vals, demand, arg_demands, ev)
    if lo == 0:
        return out
    carry = ev.value(node, tuple((lo - 1, lo) if j == k else w for j, w in enumerate(demand)))
    return _COMBINE[node.target](carry, out)


@register_chunk_rule(aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin)
def _scan_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    shp = meta_shape(src)
    d = _norm(node.args[1], len(shp))
    fr = bc.frame(src)
    hit = [t for t in fr if t.dim == d]
    if not hit:
        rule = positional(node, bc, lambda i, a, td: td)
        if isinstance(node.meta.get("val"), (tuple, list)):
            rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
        return rule
    if node.target not in _COMBINE:
        raise node_error(node, f"{op_name(node)} along time (indices of the running extremum) is not "
                         "supported by chunked plans", "use cumsum/cumprod/logcumsumexp or plan='none'")
    if not hit[0].pure(shp[d]) or len(fr) != 1:
        raise node_error(node, "scans a dim where time is merged with another dim", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td, run=_scan_run, kind="scan")
    rule.note = f"{op_name(node)} carried across chunks"
    return rule


def _linear_scan_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    lo, hi = demand[0]
    if lo > ev.start:
        full = ev.value(node, ((ev.start, hi),))
        return full.narrow(1, lo - ev.start, hi - lo)
    args, kwargs = rebuild_args(node, vals)
    args = list(args)
    while len(args) < 5:
        args.append({2: None, 3: False, 4: None}[len(args)])
    if lo > 0:
        args[2] = ev.value(node, ((lo - 1, lo),)).squeeze(1)
    return torch.ops.gradshard.linear_scan(*args, **kwargs)


def _dense_scan_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    lo, hi = demand[0]
    if lo > ev.start:
        full = ev.value(node, ((ev.start, hi),))
        return full.narrow(1, lo - ev.start, hi - lo)
    args, kwargs = rebuild_args(node, vals)
    args = list(args) + [None] * (3 - len(args))
    if lo > 0:
        args[2] = ev.value(node, ((lo - 1, lo),)).squeeze(1)
    return node.target(*args, **kwargs)


def _carried_scan_rule(node: fx.Node, bc: BuildCtx, what: str, run: Any) -> NodeRule:
    """A forward scan along dim 1 of ``u`` (args[1]) with initial state args[2]: the last state of
    one chunk is the next chunk's initial state."""
    u = node.args[1]
    fr = bc.frame(u)
    if len(fr) != 1 or fr[0].dim != 1 or not fr[0].pure(meta_shape(u)[1]):
        raise node_error(node, f"{what} whose time axis gradshard cannot follow", _INSTEAD)
    h0 = _arg(node, 2, "h0")
    if isinstance(h0, fx.Node) and bc.frame(h0):
        raise node_error(node, "the initial state of a scan runs along time", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td, run=run, kind="scan")
    rule.note = f"{what} carried across chunks"
    return rule


@register_chunk_rule("gradshard::dense_linear_scan")
def _dense_scan_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``h_t = A_t @ h_{t-1} + u_t`` (a rolled dense loop): the last state is the next chunk's h0."""
    return _carried_scan_rule(node, bc, "dense_linear_scan", _dense_scan_run)


@register_chunk_rule("gradshard::linear_scan")
def _linear_scan_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if _arg(node, 3, "reverse", False):
        raise node_error(node, "a reverse scan reads future steps", _INSTEAD)
    rule = _carried_scan_rule(node, bc, "linear_scan", _linear_scan_run)
    bs = match_block_scan(node, bc)  # read only by contractions: per-step states only where asked
    return rule if bs is None else block_states_rule(rule, bs)


# --------------------------------------------------------------------------- attention


def _sdpa_general_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    q, k, v = args[:3]
    mask = _arg_value(node, args, kwargs, 3, "attn_mask")
    is_causal = bool(_arg_value(node, args, kwargs, 5, "is_causal", False))
    lo, hi = demand[0]
    if is_causal:  # bottom-right aligned: query lo + i sees keys <= lo + i
        if q.device.type != "cpu":  # a fused kernel, not the math one an explicit mask picks (attention.py)
            from gradshard.plans.chunked.attention import lower_right_attention
            return lower_right_attention(q, k, v, kwargs.get("scale"))
        mask = torch.ones(hi - lo, hi, dtype=torch.bool, device=q.device).tril(lo)
    elif isinstance(mask, torch.Tensor) and mask.is_floating_point() and not ev.recompute:  # additive
        _refuse_fully_masked_rows(node, mask, -1, mask.dtype, "pad on the right, or use plan='none'", ev)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
        scale=kwargs.get("scale"), enable_gqa=bool(kwargs.get("enable_gqa", False)))


def _arg_value(node: fx.Node, args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _sdpa_fast_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    from gradshard.plans.chunked.attention import prefix_attention

    src: AttentionSource = ev.program.attention[node.name]
    q = vals[0]
    lo, hi = demand[0]
    nodes = ev.program.nodes
    k_node, v_node = nodes[src.k], nodes[src.v]
    k_cur, v_cur = ev.value(k_node, ((lo, hi),)), ev.value(v_node, ((lo, hi),))
    k_past = v_past = None
    if lo > 0:
        k_past, v_past = ev.value(k_node, ((0, lo),)), ev.value(v_node, ((0, lo),))
    return prefix_attention(q, k_past, v_past, k_cur, v_cur, node.kwargs.get("scale"))


@register_chunk_rule(aten.scaled_dot_product_attention)
def _sdpa_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    is_causal = bool(_arg(node, 5, "is_causal", False))
    if dropout:
        raise node_error(node, "attention dropout draws random numbers; the recomputed forward would "
                         "draw different ones", "set dropout_p=0 for chunked training, or plan='none'")
    _check_causal_mixer(node, bc, "this attention")
    fq, fk, fv = bc.frame(q), bc.frame(k), bc.frame(v)
    nq, nk = len(meta_shape(q)), len(meta_shape(k))
    if len(fq) != 1 or fq[0].dim != nq - 2 or len(fk) != 1 or fk[0].dim != nk - 2 or len(fv) != 1:
        raise node_error(node, "attention whose query/key time axis is not the second-to-last dim", _INSTEAD)
    frame = (TDim(nq - 2, fq[0].length, fq[0].inner),)
    if isinstance(mask, fx.Node) and not bc.frame(mask):
        ms = meta_shape(mask)
        if len(ms) >= 2 and ms[-2] == fq[0].length and ms[-1] == fk[0].length:
            bc.missing.append((node, mask, (TDim(len(ms) - 2, fq[0].length), TDim(len(ms) - 1, fk[0].length))))
    src = bc.attention.get(node.name)
    fast = (src is not None and is_causal and mask is None and nq == 4
            and meta_shape(q)[-1] == meta_shape(v)[-1])
    slot_maps: list[Any] = []
    for s in slots_of(node):
        if s is q and not slot_maps:
            slot_maps.append((DimMap("same", 0),))
        elif s is mask:
            mf = bc.frame(s)
            ms = meta_shape(s)
            row = []
            for t in mf:
                j = t.dim + 4 - len(ms)
                row.append(DimMap("same", 0) if j == 2 else DimMap("prefix", 0))
            slot_maps.append(tuple(row) or None)
        elif fast:
            slot_maps.append(SKIP)
        else:
            slot_maps.append((DimMap("prefix", 0),))
    return NodeRule(frame, tuple(slot_maps), _sdpa_fast_run if fast else _sdpa_general_run,
                    kind="mixer", note="causal attention against the KV cache" + (" (flash, GQA)" if fast else ""))


# --------------------------------------------------------------------------- tuples


def _getitem_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    return vals[0][node.args[1]]


@register_chunk_rule(operator.getitem)
def _getitem_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src, i = node.args[0], node.args[1]
    elems = bc.elem_frames.get(src.name)
    frame = elems[i] if elems is not None and i < len(elems) else bc.frame(src)
    sf = bc.frame(src)
    if not sf:
        return NodeRule(frame, (None,), _getitem_run)
    if len(sf) != len(frame):
        raise node_error(node, "an element of a tuple with a different number of time axes", _INSTEAD)
    return NodeRule(frame, (tuple(DimMap("same", k) for k in range(len(sf))),), _getitem_run)


@register_chunk_rule(aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.tensor_split)
def _split_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    nd = len(meta_shape(src))
    dim = _norm(_arg(node, 1 if node.target is aten.unbind.int else 2, "dim", 0), nd)
    fr = bc.frame(src)
    if any(t.dim == dim for t in fr):
        raise node_error(node, "splits the time axis into pieces", _INSTEAD)
    removed = node.target is aten.unbind.int
    frame = tuple(replace(t, dim=t.dim - (removed and t.dim > dim)) for t in fr)
    maps = tuple(DimMap("same", k) for k in range(len(fr))) or None
    n = len(node.meta.get("val") or ())
    rule = NodeRule(frame, tuple(maps if s is src else None for s in slots_of(node)), default_run)
    rule.elem_frames = tuple(frame for _ in range(n))
    return rule


def _rolled_body_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``run_rolled_body(body, *args)`` (a per-step loop rolled by ``roll_loops``): vmap over time."""
    body = getattr(node.graph.owning_module, node.args[0].target)
    args = node.args[1:]
    lengths = [meta_shape(a)[d] for a, d in zip(args, body.in_dims) if d is not None and isinstance(a, fx.Node)]
    if not lengths:
        raise node_error(node, "a rolled loop body without a time input", _INSTEAD)
    slot_maps: list[Any] = [None]
    for a, d in zip(args, body.in_dims):
        if not isinstance(a, fx.Node):
            continue
        fr = bc.frame(a)
        if d is None:
            if fr:
                raise node_error(node, f"loop-invariant input `{a.name}` of a rolled loop runs along time", _INSTEAD)
            slot_maps.append(None)
            continue
        if len(fr) != 1 or fr[0].dim != _norm(d, len(meta_shape(a))):
            raise node_error(node, f"input `{a.name}` of a rolled loop has a time axis gradshard cannot follow", _INSTEAD)
        slot_maps.append((DimMap("same", 0),))
    vals = node.meta.get("val") or ()
    elems = tuple((TDim(_norm(d, v.dim()), lengths[0]),) for d, v in zip(body.out_dims, vals))
    rule = NodeRule(elems[0] if elems else (), tuple(slot_maps), default_run, note="rolled loop body (per step)")
    rule.elem_frames = elems
    return rule


CHUNK_RULES[run_rolled_body] = _rolled_body_rule


# --------------------------------------------------------------------------- convolution


def _conv_params(node: fx.Node) -> tuple[int, int, int, int]:
    if node.target is aten.conv1d.default or node.target is aten.conv1d.padding:
        stride, padding, dilation = _arg(node, 3, "stride", 1), _arg(node, 4, "padding", 0), _arg(node, 5, "dilation", 1)
    else:
        stride, padding, dilation = node.args[3], node.args[4], node.args[5]
        if node.args[6]:
            raise ValueError("transposed convolution")
    pick = lambda v: v[-1] if isinstance(v, (list, tuple)) else v  # noqa: E731
    k = meta_shape(node.args[1])[-1]
    if isinstance(padding, str):
        padding = 0 if padding == "valid" else None
    return pick(stride), pick(padding) if padding is not None else -1, pick(dilation), k


def _conv_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    x = vals[0]
    _, padding, dilation, k = _conv_params(node)
    t = rule.frame[-1]
    lo, hi = demand[_index_of(rule.frame, t.dim)]
    got_lo, got_hi = arg_demands[0][-1]
    need_lo, need_hi = lo - padding, hi - padding + dilation * (k - 1)
    x = aten.constant_pad_nd.default(x, [got_lo - need_lo, need_hi - got_hi], 0.0)
    args, kwargs = rebuild_args(node, vals)
    args, kwargs = list(args), dict(kwargs)
    args[0] = x
    if node.target is aten.conv1d.default:
        while len(args) < 7:
            args.append({2: None, 3: [1], 4: [0], 5: [1], 6: 1}[len(args)])
        args[4] = [0]
        kwargs.pop("padding", None)
    else:
        args[4] = [0] * len(args[4]) if isinstance(args[4], (list, tuple)) else 0
    return node.target(*args, **kwargs)


@register_chunk_rule(aten.conv1d, aten.convolution)
def _conv_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    x = node.args[0]
    nd = len(meta_shape(x))
    fr = bc.frame(x)
    if any(bc.frame(a) for a in slots_of(node)[1:]):
        raise node_error(node, "convolution weights run along time", _INSTEAD)
    try:
        stride, padding, dilation, k = _conv_params(node)
    except ValueError as exc:
        raise node_error(node, f"{exc} along time", _INSTEAD) from exc
    along = [t for t in fr if t.dim == nd - 1]
    if not along:
        return positional(node, bc, lambda i, a, td: td)
    if nd != 3 or stride != 1 or padding < 0 or not along[0].pure(meta_shape(x)[-1]):
        raise node_error(node, "a convolution along time with stride, 'same' padding or more than "
                         "one spatial dim", "use a stride-1 Conv1d with integer padding, or plan='none'")
    out = meta_shape(node)
    frame = _frame_from([TDim(nd - 1, out[-1])] + [t for t in fr if t.dim != nd - 1])
    maps = []
    for t in fr:
        if t.dim == nd - 1:
            maps.append(DimMap("extend", _index_of(frame, t.dim), padding,
                               right=dilation * (k - 1) - padding, length=t.length))
        else:
            maps.append(DimMap("same", _index_of(frame, t.dim)))
    slots = tuple(tuple(maps) if i == 0 else None for i, _ in enumerate(slots_of(node)))
    return NodeRule(frame, slots, _conv_run, note=f"window of {dilation * (k - 1) + 1} steps")


