"""What ``lasp`` does with everything that is not linear attention.

Under LASP every rank runs the whole model on its slice, so every node outside the
linear-attention regions must give, on the slice, the slice of its full-sequence value:

- position-wise nodes (``normal``: linears, norms over features, activations) need nothing;
- constants built along time (``arange`` position ids, rotary angles) must count *global*
  positions: ``arange`` nodes are offset by the rank's first step
  (:func:`offset_positions`); other position-dependent constants (``tril`` masks, cumsums or
  slices of constants along time, ``linspace``) are errors naming the node;
- reductions over time (a loss) become *shares*: each rank returns its part and the
  full-sequence value is the SUM over ranks (:func:`plan_reductions`). ``sum`` stays;
  ``mean`` becomes ``sum / N_global`` (static count); a mean cross-entropy / NLL becomes
  ``sum / (targets != ignore_index counted over all ranks)``. A share may only be scaled by
  constants, added to other shares and returned; anything else (``exp(loss)``, a mean over
  time broadcast back) is an error;
- windows (token shift, causal convolutions), softmax attention and other recurrences are
  errors that say what to use instead (:func:`explain_component`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.dims import shape_of
from gradshard.analysis.locality import SCAN_OPS, TimeLocality
from gradshard.errors import GradshardError, node_error

from gradshard.passes.detect_linear_attention import Rejection
from gradshard.passes.linear_attention_graph import CONST, Component

aten = torch.ops.aten

__all__ = ["ReductionEdit", "plan_reductions", "explain_component", "offset_positions", "check_constants",
           "drop_zero_terms"]

_SUM_OPS = {aten.sum.dim_IntList, aten.sum.default}
_MEAN_OPS = {aten.mean.dim, aten.mean.default}
# loss op -> (position of `reduction`, position of `ignore_index` or None, counts targets?)
_COUNT_LOSSES = {aten.cross_entropy_loss.default: (3, 4), aten.nll_loss.default: (3, 4),
                 aten.nll_loss_nd.default: (3, 4), aten.nll_loss2d.default: (3, 4)}
_ELEM_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
                aten.huber_loss.default: 2, aten.binary_cross_entropy_with_logits.default: 4,
                aten.binary_cross_entropy.default: 3, aten.soft_margin_loss.default: 2}
_SHARE_VIEWS = {aten.view.default, aten.reshape.default, aten.squeeze.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.unsqueeze.default, aten.alias.default, aten.clone.default,
                aten._to_copy.default, aten.to.dtype, aten.detach.default, aten.expand.default}
_LOSS_DEFAULTS = {"reduction": 1, "ignore_index": -100}


@dataclass(frozen=True)
class ReductionEdit:
    """How one reduction over time becomes this rank's share of the full-sequence value.

    ``kind``: ``keep`` (a sum), ``mean`` (a mean op: sum, then ``* local_count / N_global``),
    ``elem_mean`` (a mean-reduced elementwise loss: reduction=sum, then scale), ``count_mean``
    (cross-entropy/NLL with reduction=mean: reduction=sum, then divide by the global count of
    targets != ignore_index). ``count`` is the local number of reduced elements.
    """

    node: str
    kind: str
    count: int = 0
    reduction_pos: int = 0
    ignore_index: Optional[int] = None
    target: Optional[str] = None


def _arg(node: fx.Node, pos: int, name: str) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, _LOSS_DEFAULTS.get(name))


def _numel(node: Any) -> int:
    shp = shape_of(node) if isinstance(node, fx.Node) else None
    n = 1
    for s in shp or ():
        n *= s
    return n


def plan_reductions(comp: Component, by_name: dict[str, fx.Node], classes: dict[str, str]
                    ) -> Optional[list[ReductionEdit]]:
    """Edits turning ``comp`` into shares, or ``None`` if it is not a supported reduction."""
    members = [by_name[m] for m in comp.nodes]
    names = set(comp.nodes)
    edits: list[ReductionEdit] = []
    for n in members:
        if shape_of(n) is None and n.target is not operator.getitem:
            return None
        timed_in = [a for a in n.all_input_nodes if classes.get(a.name) != CONST]
        if not any(a.name in names for a in timed_in):  # a root: reads only normal nodes
            edit = _root_edit(n)
            if edit is None:
                return None
            edits.append(edit)
        elif not _is_share_op(n, names, classes):
            return None
    for out in comp.outputs:
        if any(u.op != "output" for u in by_name[out].users if u.name not in names):
            return None
    return edits


def _root_edit(n: fx.Node) -> Optional[ReductionEdit]:
    if n.target in _SUM_OPS:
        return ReductionEdit(n.name, "keep")
    if n.target in _MEAN_OPS:
        return ReductionEdit(n.name, "mean", count=max(_numel(n.args[0]) // max(_numel(n), 1), 1))
    if n.target in _COUNT_LOSSES:
        red_pos, ign_pos = _COUNT_LOSSES[n.target]
        reduction = _arg(n, red_pos, "reduction")
        if reduction == 2:
            return ReductionEdit(n.name, "keep")
        if reduction != 1 or _arg(n, 2, "weight") is not None:
            return None
        target = n.args[1]
        if not isinstance(target, fx.Node) or target.meta.get("val") is None or target.meta["val"].is_floating_point():
            return None
        return ReductionEdit(n.name, "count_mean", reduction_pos=red_pos,
                             ignore_index=_arg(n, ign_pos, "ignore_index"), target=target.name)
    if n.target in _ELEM_LOSSES:
        red_pos = _ELEM_LOSSES[n.target]
        reduction = _arg(n, red_pos, "reduction")
        if reduction == 2:
            return ReductionEdit(n.name, "keep")
        if reduction != 1:
            return None
        return ReductionEdit(n.name, "elem_mean", count=_numel(n.args[0]), reduction_pos=red_pos)
    return None


def _is_share_op(n: fx.Node, shares: set[str], classes: dict[str, str]) -> bool:
    """Ops whose output is again a share: linear in the shares, constants elsewhere."""
    ins = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]
    share_in = [a for a in ins if a.name in shares]
    others = [a for a in ins if a.name not in shares]
    if any(classes.get(a.name) != CONST for a in others):
        return False
    if n.target in _SHARE_VIEWS or n.target is aten.neg.default:
        return len(share_in) == 1 and n.args[0].name in shares
    if n.target in _SUM_OPS or n.target in _MEAN_OPS:  # over non-time dims of a share: linear
        return len(share_in) == 1 and n.args[0].name in shares
    if n.target in (aten.mul.Tensor, aten.mul.Scalar):
        return len(share_in) == 1
    if n.target in (aten.div.Tensor, aten.div.Scalar):
        return len(share_in) == 1 and n.args[0].name in shares
    if n.target in (aten.add.Tensor, aten.sub.Tensor):  # share + share (a constant would count W times)
        return len(share_in) == 2 and not others
    return False


# --------------------------------------------------------------------------- explanations


_WINDOW_OPS = {aten.constant_pad_nd.default, aten.pad.default, aten.conv1d.default, aten.convolution.default,
               aten.slice.Tensor, aten.roll.default}


def explain_component(rj: Rejection, by_name: dict[str, fx.Node], tl: TimeLocality) -> GradshardError:
    """The error for a mixing component plan ``lasp`` cannot run sequence-parallel."""
    members = [by_name[m] for m in rj.component.nodes]
    if rj.kind == "softmax_attention":
        return node_error(
            by_name[rj.node],
            "softmax attention: the softmax over q k^T mixes every past step nonlinearly, so a "
            "rank cannot summarise its slice in a fixed-size state as LASP requires",
            "use plan='seco' (or 'spaco') for softmax attention, or replace it by linear attention",
        )
    if rj.kind == "kernel_state":
        return node_error(by_name[rj.node], rj.why,
                          "do not use the final state of lightning_attention inside a model compiled with "
                          "plan='lasp' (use gradshard.plans.lasp.runtime.lasp_attention(..., "
                          "return_final_state=True) directly if you need it)")
    window = next((n for n in members if _window_of(n, tl) is not None), None)
    if window is not None:
        w = _window_of(window, tl)
        return node_error(
            window,
            f"it reads {w} step(s) before the current one ({tl[window].why}): a token shift or a short "
            f"causal convolution. On a rank's first {w} step(s) those values live on the previous rank "
            "(a halo), which plan 'lasp' does not exchange",
            "remove the token shift / causal convolution, apply it before splitting the sequence "
            "(e.g. shift the inputs once on the full batch), or use plan='none'",
        )
    reduction = next((n for n in members if "reduces" in tl[n].why or "normalises" in tl[n].why), None)
    if reduction is not None:
        return node_error(
            reduction,
            f"it reduces over the time axis ({tl[reduction].why}) and its result is used in a way "
            "that is not a sum of per-rank parts (only sums, means and mean/sum losses that are "
            "scaled, added and returned can be split over ranks)",
            "return the loss (a sum or mean over tokens) and do any further arithmetic outside "
            "the compiled module, after summing the per-rank values",
        )
    future = next((n for n in members if tl[n].local is not None and tl[n].local.hi > 0
                   and tl[n].time_dims), None)
    if future is not None:
        return node_error(
            future,
            f"it reads future steps ({tl[future].why}): it is not causal, so no rank can finish "
            "its slice from the states of earlier ranks alone (not linear attention in the causal sense)",
            "mask the scores causally (tril) if the model is meant to be causal; plan 'lasp' "
            "parallelises causal linear attention only",
        )
    scan = next((n for n in members if n.target in SCAN_OPS or tl[n].why.startswith("loop step")), None)
    node = scan or by_name[rj.node]
    return node_error(
        node,
        f"it mixes time steps but is not linear attention: {rj.why}",
        "plan 'lasp' parallelises linear attention (o_t = q_t kv_t, kv_t = λ_t kv_{t-1} + k_t^T v_t) and "
        "position-wise layers; for other recurrences use plan='adjoint', for softmax attention "
        "plan='seco'",
    )


def _window_of(n: fx.Node, tl: TimeLocality) -> Optional[int]:
    info = tl[n]
    local = info.local
    if local is not None and not local.is_pointwise and local.lo > float("-inf") and local.hi <= 0:
        return int(-local.lo)
    if n.target in _WINDOW_OPS and info.origin < 0:
        return int(-info.origin)
    return None


# --------------------------------------------------------------------------- positions


_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_POSITIONAL = {aten.tril.default, aten.triu.default, aten.linspace.default, aten.logspace.default,
               aten.flip.default, aten.roll.default}


def _has_time(n: fx.Node, tl: TimeLocality) -> bool:
    info = tl.info.get(n.name)
    return info is not None and bool(info.time_dims)


def offset_positions(graph: fx.Graph, tl: TimeLocality, start: int) -> list[str]:
    """Shift every ``arange`` along the time axis by ``start`` (in place); returns their names."""
    done = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _ARANGE or not _has_time(n, tl):
            continue
        if start:
            if n.target is aten.arange.default:
                n.target, n.args = aten.arange.start, (start, n.args[0] + start, *n.args[1:])
            elif n.target is aten.arange.start:
                n.args = (n.args[0] + start, n.args[1] + start, *n.args[2:])
            else:
                step = n.args[2]
                n.args = (n.args[0] + start * step, n.args[1] + start * step, *n.args[3:])
        done.append(n.name)
    return done


_ZERO_FACTORIES = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}
_ZERO_IF_ANY = {aten.mul.Tensor, aten.matmul.default, aten.bmm.default, aten.mm.default}
_ZERO_IF_FIRST = {aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                  aten.unsqueeze.default, aten.transpose.int, aten.permute.default, aten.t.default,
                  aten.alias.default, aten.clone.default}


def drop_zero_terms(graph: fx.Graph) -> list[str]:
    """Replace ``a + z`` by ``a`` where ``z`` is a product with a zero tensor (in place); returns
    the adds dropped.

    A block-wise loop's first block adds ``(q ⊙ exp(cumsum(log λ))) @ kv_0`` with ``kv_0 =
    new_zeros(...)``: a zero the region does not own, whose positions restart on every rank.
    Once dropped, the dead term (and its cumsum of a constant) goes with dead-code elimination
    instead of failing :func:`check_constants`. (``inf * 0`` would have been NaN: the fold
    only ever removes a NaN, never creates one.)"""
    zero: set[fx.Node] = set()
    dropped = []
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in _ZERO_FACTORIES:
            zero.add(n)
        elif n.target in _ZERO_IF_ANY and any(a in zero for a in n.args[:2]):
            zero.add(n)
        elif n.target in _ZERO_IF_FIRST and n.args and n.args[0] in zero:
            zero.add(n)
        elif n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs:
            for keep, z in (n.args, n.args[::-1]):
                val, kept = n.meta.get("val"), getattr(keep, "meta", {}).get("val")
                if (z in zero and isinstance(kept, torch.Tensor) and isinstance(val, torch.Tensor)
                        and kept.shape == val.shape and kept.dtype == val.dtype):
                    n.replace_all_uses_with(keep)
                    dropped.append(n.name)
                    break
    return dropped


def check_constants(graph: fx.Graph, tl: TimeLocality, classes: dict[str, str]) -> None:
    """Position-dependent constants left outside the regions are errors (see the module doc)."""
    for n in graph.nodes:
        if n.op != "call_function" or classes.get(n.name) != CONST or not _has_time(n, tl):
            continue
        if n.target in _ARANGE:
            continue
        info = tl[n]
        bad = None
        if n.target in _POSITIONAL:
            bad = f"{n.target._overloadpacket.__name__} builds values that depend on the position along time"
        elif n.target in SCAN_OPS:
            src = shape_of(n.args[0]) or ()
            if src and n.args[1] % len(src) in info.time_dims:
                bad = "a cumulative op along time over a constant (positions counted from this rank's first step)"
        elif n.target in (aten.slice.Tensor, aten.narrow.default):
            src = shape_of(n.args[0]) or ()
            dim = n.args[1] % max(len(src), 1) if len(n.args) > 1 else 0
            if dim in info.time_dims and (shape_of(n) or ())[dim:dim + 1] != src[dim:dim + 1]:
                bad = "a slice along time of a constant (e.g. a positional table cut to the local length)"
        if bad is not None:
            raise node_error(
                n, f"{bad}; under plan 'lasp' each rank sees only its slice, so this constant would "
                "restart at every rank's first step",
                "compute positions with torch.arange over the sequence length (gradshard offsets "
                "those), or pass global position ids as an input sliced like the tokens",
            )
