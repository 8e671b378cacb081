"""rewrite_partial_update: run each detected projection through a sliced runtime layer.

Every ``partial_slice`` region (one ``aten.linear`` or ``aten.addmm`` whose weight is a
parameter, found by :mod:`gradshard.plans.partial_update.detect`) becomes one ``call_module``
node; the bias, if any, stays a graph input passed to it::

    before:  linear_4 = aten.linear(mul_8, arg7_1, arg8_1)       # arg7_1: mlp.up_proj.weight
    after:   partial_mlp_up_proj = self.partial_mlp_up_proj(mul_8, arg8_1)
    before:  addmm_2 = aten.addmm(arg9_1, view_8, arg10_1)       # GPT-2 Conv1D: W is (in, out)
    after:   partial_mlp_c_fc = self.partial_mlp_c_fc(view_8, arg9_1)

The module (:class:`PartialLinearRegion`) wraps a
:class:`~gradshard.plans.partial_update.sliced.SlicedLinear` whose weight pieces are *views* of the
user's parameter (``share_storage=True``): the trainable runs are new leaf
``nn.Parameter``s, the frozen runs are buffers, no memory is duplicated, and the user's
full weight always holds the current values. The weight placeholder stays in the
signature but is no longer read, so the full weight gets no gradient (optimizers skip
it); the slices get the exact gradient of their entries, and the input gradient still
flows through every slice.

Biases are not sliced. docs/DESIGN.md splits *weights* into a trainable slice and frozen
slices and says nothing of biases, so a sliced layer's bias stays the user's own
``nn.Parameter``, read from the graph like any other parameter, trained whole on every
rank (like norms and embeddings) and receiving its full gradient.

After compile, ``gs_attach`` registers the sliced layers on the ``CompiledModule`` as
``cm.partial`` (one shared layer per weight, reused by later captures) and gives it the
docs/DESIGN.md surface: ``cm.parameter_slices()``, ``cm.full_parameters(names=None)`` and
``cm.load_full_parameters(params)`` (the interface the DiLoCo outer loop uses).
"""

from __future__ import annotations

import copy
from typing import Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from gradshard.errors import GradshardError, node_error
from gradshard.ir import Stage, graph_module
from gradshard.pipeline import PassContext, PassResult, copy_graph, graph_pass
from gradshard.plans.partial_update.layout import SliceLayout
from gradshard.plans.partial_update.sliced import SlicedLinear
from gradshard.plans.partial_update.views import FullEntry, read_full, write_full

from gradshard.plans.partial_update.detect import PARTIAL_KIND

__all__ = ["rewrite_partial_update", "PartialLinearRegion", "PartialSlices"]


class PartialLinearRegion(nn.Module):
    """One sliced-linear call site: the shared :class:`SlicedLinear` plus its shapes for stages."""

    def __init__(self, layer: SlicedLinear, *, site: str, role: str, tokens: int, itemsize: int) -> None:
        super().__init__()
        self.layer = layer
        self.site, self.role, self.tokens, self.itemsize = site, role, tokens, itemsize

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.layer(x, bias)

    def stages(self) -> list[Stage]:
        """Forward: the full GEMM. Backward: input grad through all slices + one slice's weight grad."""
        lay, m = self.layer.layout, self.tokens
        out_f, in_f = self.layer.out_features, self.layer.in_features
        trained = lay.trainable_size * (in_f if lay.dim == 0 else out_f)
        fwd = Stage(name=f"{self.site}:forward", kind="forward", phase="forward", region=self.site,
                    memory_bytes=m * in_f * self.itemsize, flops=2 * m * in_f * out_f,
                    kernel="torch:partial_linear", note=f"{self.role}, {self.layer.weight_name}")
        bwd = Stage(name=f"{self.site}:backward", kind="partial_backward", phase="backward",
                    region=self.site, flops=2 * m * in_f * out_f + 2 * m * trained,
                    kernel="torch:partial_linear", note=fwd.name)
        return [fwd, bwd]


def _module_key(weight_name: str) -> str:
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base.replace(".", "_") or "root"


def _placeholder_values(gm: fx.GraphModule, ctx: PassContext) -> dict[str, torch.Tensor]:
    phs = list(gm.graph.find_nodes(op="placeholder"))
    return {p.name: v for p, v in zip(phs, ctx.example_inputs) if isinstance(v, torch.Tensor)}


@graph_pass
def rewrite_partial_update(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each detected projection by a sliced linear (trainable slice + frozen slices)."""
    if ctx.captured is None:
        raise GradshardError(
            "plan 'partial_update' owns the trainable slices as parameters of the compiled "
            "module, which needs gs.compile(model, plan='partial_update', ...); the torch.compile "
            "backend (gs.backend) does not support it"
        )
    regions = ctx.regions_of(PARTIAL_KIND)
    if not regions:
        raise GradshardError(
            f"plan 'partial_update' found no projection to slice for targets "
            f"{tuple(ctx.options.targets)}: it slices MLP in/out projections (projections joined "
            f"by feature-wise ops) and attention q/k/v projections (outputs viewed as heads "
            f"feeding attention) whose weights are parameters used only by those projections. "
            f"Use plan='none' for full training, or check that the model calls F.linear / nn.Linear"
        )
    new_graph = copy_graph(gm)
    new_gm = graph_module(gm, new_graph)
    values = _placeholder_values(gm, ctx)
    by_name = {n.name: n for n in new_graph.nodes}

    layers: dict[str, SlicedLinear] = {}
    notes: list[str] = []
    sites: list[str] = []
    region_nodes = {r.nodes[0] for r in regions}
    for r in regions:
        node = by_name[r.nodes[0]]
        opts = r.options
        if opts["transposed"]:  # addmm(bias, x, W), W stored (in, out)
            b_node, x_node, w_node = node.args[:3]
        else:
            x_node, w_node = node.args[:2]
            b_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        layout = SliceLayout(opts["dim"], tuple(opts["bounds"]), opts["index"], tuple(opts["owners"]))
        others = [u for u in w_node.users if u is not node and u.name not in region_nodes]
        if others:
            raise node_error(
                others[0],
                f"the weight {opts['weight']} is also used here, outside the projections this plan "
                f"slices (e.g. tied to an embedding); slicing it would split its gradient between "
                f"two tensors",
                "untie the weights, or use targets that exclude this layer",
            )
        key = _module_key(opts["weight"])
        layer = layers.get(key)
        if layer is None:
            layer = SlicedLinear(
                values[w_node.name], values[b_node.name] if b_node is not None else None, layout,
                weight_name=opts["weight"], bias_name=opts["bias"] or f"{opts['weight']}.bias",
                share_storage=True, transposed=opts["transposed"], whole_bias=True,
            )
            layers[key] = layer
            what = "rows" if layout.dim == 0 else "columns"
            spans = " + ".join(f"[{lo}:{hi})" for lo, hi in layout.trainable_spans)
            notes.append(f"{opts['weight']} ({opts['role']}): {what} {spans} of {layout.size} "
                         f"trainable (slice {layout.index} of {layout.num_slices})"
                         + (f"; bias {opts['bias']} trained whole" if opts["bias"] else ""))
        elif layer.layout != layout or layer.transposed != opts["transposed"]:
            raise node_error(node, f"the weight {opts['weight']} is used by linears with different "
                                   f"roles ({opts['role']} here)", "use targets that exclude it")
        x_val = x_node.meta.get("val")
        tokens = x_val.numel() // max(1, x_val.shape[-1]) if isinstance(x_val, torch.Tensor) else 0
        site = f"partial_{key}" if f"partial_{key}" not in sites else f"partial_{key}_{len(sites)}"
        sites.append(site)
        region_mod = PartialLinearRegion(layer, site=site, role=opts["role"], tokens=tokens,
                                         itemsize=x_val.element_size() if isinstance(x_val, torch.Tensor) else 0)
        new_gm.add_submodule(site, region_mod)
        with new_graph.inserting_before(node):
            call = new_graph.call_module(site, (x_node,) if b_node is None else (x_node, b_node))
        call.meta = copy.copy(node.meta)
        node.replace_all_uses_with(call)
        new_graph.erase_node(node)
    new_graph.lint()
    new_gm.recompile()
    new_gm.gs_attach = _Attach(new_gm)  # type: ignore[assignment]
    return PassResult(new_gm, changed=True, notes=tuple(notes))


class PartialSlices(nn.Module):
    """The sliced layers of a compiled model (one per weight), registered as ``cm.partial``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()


class _Attach:
    """``gs_attach``: share layers across captures; give the CompiledModule its partial API."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm

    def __call__(self, cm: nn.Module) -> None:
        registry = cm._modules.get("partial")
        if registry is None:
            registry = PartialSlices()
            cm.add_module("partial", registry)
        for region in self.gm.modules():
            if not isinstance(region, PartialLinearRegion):
                continue
            key = _module_key(region.layer.weight_name)
            if key in registry.layers:
                region.layer = registry.layers[key]  # a later capture reuses the same parameters
            else:
                registry.layers[key] = region.layer
        cm._partial_api = _CompiledPartial(cm)  # behind CompiledModule.parameter_slices() etc.


class _CompiledPartial:
    """docs/DESIGN.md's partial-update surface of a CompiledModule (see module doc)."""

    def __init__(self, cm: nn.Module) -> None:
        self.cm = cm

    def _layers(self) -> dict[str, SlicedLinear]:
        return dict(self.cm.partial.layers.items())

    def _captured(self):
        entry = self.cm._entry()
        if entry.captured is None:
            raise GradshardError("partial_update: the compiled module has no captured model")
        return entry.captured

    def _entries(self) -> list[FullEntry]:
        """A :class:`FullEntry` per full parameter, in capture order: a sliced layer's
        weight/bias by its layer, every other captured parameter as itself."""
        cap = self._captured()
        sliced: dict[str, FullEntry] = {}
        for layer in self._layers().values():
            sliced[layer.weight_name] = FullEntry(layer.weight_name, layer, "weight")
            if layer.has_bias:
                sliced[layer.bias_name] = FullEntry(layer.bias_name, layer, "bias")
        return [sliced.get(name) or FullEntry(name, param=p) for name, p in zip(cap.param_names, cap.params)]

    def parameter_slices(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        """``{slice_name in cm.named_parameters(): (original_name, (dim, start, stop))}``.

        Every trainable tensor of a sliced layer: its weight slices and its bias, which is
        trained whole (``(0, 0, out_features)``) and listed under the name
        ``cm.named_parameters()`` gives the user's Parameter (``model.<bias name>``).
        """
        names = {id(p): n for n, p in self.cm.named_parameters()}
        out: dict[str, tuple[str, tuple[int, int, int]]] = {}
        for key, layer in self._layers().items():
            entries = dict(layer.slices(f"partial.layers.{key}."))
            if layer.bias_mode == "whole":
                entries[f"partial.layers.{key}.bias"] = (layer.bias_name, (0, 0, layer.out_features))
            for name, value in entries.items():
                out[names.get(id(self.cm.get_parameter(name)), name)] = value
        return out

    def full_parameters(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Full values under the user's names; unsliced ones are the live parameters."""
        return read_full(self._entries(), names)

    def load_full_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        """Write full values (the user's names) into the slices and parameters, in place."""
        write_full(self._entries(), params)
