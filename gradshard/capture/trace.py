"""Capture: turn a module or a ``(model, batch) -> loss`` function into one aten-level graph.

Every front door ends in the same IR: a pre-dispatch aten ``fx.GraphModule`` traced by
``make_fx(pre_dispatch=True)`` whose placeholders are, in order, the parameters, the
buffers and the tensor inputs (flattened). High-level ops survive in this IR
(``aten.linear``, ``aten.scaled_dot_product_attention``, ``aten.conv1d``, ``aten.cumsum``,
gradshard's custom ops), every node carries ``meta['val']`` (shape/dtype),
``meta['stack_trace']`` and ``meta['nn_module_stack']``.

Front doors (``frontend=``):

- ``"python"`` (default): trace the Python code at the example shapes. Loops over
  ``x.shape``, config branches and dataclass outputs are followed (loops unroll).
- ``"fx"``: ``torch.fx`` symbolic tracing with :class:`GradshardTracer` first (fails on
  Python control flow over tensor values/shapes), then lowered to aten.
- ``"dynamo"``: ``torch._dynamo.export`` first (graph breaks become errors), then lowered.
- :func:`gradshard.backend` plugs into ``torch.compile`` and receives Dynamo's graph.

Data-dependent control flow (``if x.sum() > 0``) cannot be captured into one graph by any
front door; it raises :class:`CaptureError` naming the line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from gradshard.ir import graph_module
from gradshard.capture.canonical import canonicalize
from gradshard.capture.data_dependent import refuse_data_dependent_sizes
from gradshard.capture.stack_traces import frames_above, share_stack_traces
from gradshard.capture.mutations import functionalize_buffer_updates
from gradshard.errors import CaptureError, first_line, summary
from gradshard.pipeline import TRACE_LOCK, forget_erased_nodes
from gradshard.capture.substitutions import substitute_known_kernels

__all__ = ["Captured", "capture", "capture_graph_module", "GradshardTracer", "FRONTENDS", "guard_key", "state_key"]

FRONTENDS = ("python", "fx", "dynamo")
# Trace on fake tensors: no activation is materialised while capturing, and library code
# that probes values only outside tracing (transformers' padding-mask `.all()`) sees a trace.
_TRACING_MODE = "fake"
# Tracing swaps global dispatch state; ranks run as threads in tests and share it: tracing holds
# pipeline.TRACE_LOCK.


# --------------------------------------------------------------------------- outputs


_depth = [0]  # nesting of plain objects flattened by attribute (bounds reference cycles)


def _flatten_parts(items: Sequence[Any]) -> tuple[list[Any], list[Callable[[Sequence[Any]], Any]], list[int]]:
    """Flatten each item: all leaves, and each item's rebuilder and leaf count (the rebuilders
    keep no leaf: a rebuilder that held the traced outputs would keep them alive)."""
    parts = [flatten_output(x) for x in items]
    return [x for p in parts for x in p[0]], [p[1] for p in parts], [len(p[0]) for p in parts]


def flatten_output(obj: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """Flatten a model output into leaves, returning a function that rebuilds it.

    Handles tensors, tuples/lists/dicts, dataclass instances (HF-style ``ModelOutput``
    included) and other objects holding tensors as attributes (a KV cache) recursively;
    other leaves (None, numbers, objects without tensors) are kept as constants.
    """
    if isinstance(obj, torch.Tensor):
        return [obj], lambda leaves: leaves[0]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if getattr(obj, f.name, None) is not None]
        leaves, rebuild = flatten_output({n: getattr(obj, n) for n in names})
        cls = type(obj)
        return leaves, lambda ls: cls(**rebuild(ls))
    if isinstance(obj, dict):
        keys = list(obj.keys())
        leaves, rebuilds, counts = _flatten_parts([obj[k] for k in keys])
        cls = type(obj)

        def rebuild_dict(ls: Sequence[Any]) -> Any:
            out, i = {}, 0
            for k, rb, n in zip(keys, rebuilds, counts):
                out[k] = rb(ls[i : i + n])
                i += n
            return out if cls is dict else cls(out)

        return leaves, rebuild_dict
    if isinstance(obj, (tuple, list)):
        leaves, rebuilds, counts = _flatten_parts(list(obj))
        is_named = hasattr(obj, "_fields")
        cls = type(obj)

        def rebuild_seq(ls: Sequence[Any]) -> Any:
            items, i = [], 0
            for rb, n in zip(rebuilds, counts):
                items.append(rb(ls[i : i + n]))
                i += n
            return cls(*items) if is_named else cls(items)

        return leaves, rebuild_seq
    if obj is None or isinstance(obj, (int, float, bool, str, torch.dtype, torch.device)):
        return [], lambda leaves: obj
    if hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)) and _depth[0] < 8:
        # Another object that holds tensors (e.g. a transformers KV cache returned with the
        # logits): its tensor attributes become outputs; a shallow copy with the new tensors
        # rebuilds it. An object with no tensor is kept as it was traced.
        _depth[0] += 1
        try:
            leaves, rebuild_attrs = flatten_output(dict(vars(obj)))
        finally:
            _depth[0] -= 1
        if not leaves:
            return [], lambda ls: obj
        # The rebuilder copies a template whose attributes are cleared, not ``obj``: ``obj``
        # holds the traced outputs, and (traced on fake tensors above autograd) their whole
        # autograd graph, which only C++ would then keep alive.
        template = copy.copy(obj)
        template.__dict__.update(dict.fromkeys(vars(obj)))

        def rebuild_object(ls: Sequence[Any]) -> Any:
            new = copy.copy(template)
            new.__dict__.update(rebuild_attrs(ls))
            return new

        return leaves, rebuild_object
    raise CaptureError(
        f"cannot capture an output of type {type(obj).__name__}: outputs must be tensors, "
        "tuples, lists, dicts or dataclasses of them. Return tensors (or wrap the model in a "
        "function that does)."
    )


# --------------------------------------------------------------------------- the record


@dataclass
class Captured:
    """A captured graph and everything needed to call it like the original.

    ``gm`` takes ``(*params, *buffers, *tensor_inputs)``; ``param_names`` and
    ``buffer_names`` are qualified names (prefixed ``argN.`` for modules passed as
    arguments of a function); ``rebuild_output`` turns the graph's flat outputs back into
    the user's output structure.
    """

    gm: fx.GraphModule
    frontend: str
    param_names: list[str]
    buffer_names: list[str]
    params: list[nn.Parameter]
    buffers: list[torch.Tensor]
    input_spec: pytree.TreeSpec
    tensor_positions: list[int]
    constant_leaves: list[Any]
    rebuild_output: Callable[[Sequence[Any]], Any]
    example_inputs: list[torch.Tensor]
    modules: list[tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    #: Buffers (indices into ``buffers``) the forward updates: their new values are the
    #: graph's last outputs, written back by :meth:`finish` (see ``capture_mutations``).
    buffer_updates: tuple[int, ...] = ()

    @property
    def num_state(self) -> int:
        return len(self.params) + len(self.buffers)

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return [leaves[i] for i in self.tensor_positions]

    def state(self) -> list[torch.Tensor]:
        """The parameters and buffers the modules hold *now*, in placeholder order.

        Read by name at every call, so a Parameter or buffer rebound after capture
        (``layer.weight = nn.Parameter(w)``) is the one the graph runs on.
        """
        if not self.modules:
            return [*self.params, *self.buffers]
        # resolved by path at every call: a replaced submodule is followed too
        return [getattr(owner, attr) for owner, attr in
                (_slot(self.modules, name) for name in (*self.param_names, *self.buffer_names))]

    def call_state(self) -> list[torch.Tensor]:
        """:meth:`state` as a graph call reads it: buffers the forward updates are passed as
        copies, so the write-back in :meth:`finish` cannot change what a backward recompute
        (a chunk, a shard) reads, nor a tensor autograd saved."""
        state = self.state()
        for i in self.buffer_updates:
            j = len(self.params) + i
            state[j] = state[j].clone()
        return state

    def finish(self, flat_out: Sequence[Any]) -> Any:
        """Write the forward's buffer updates back (once, as eager does) and rebuild the
        user's output structure from the graph's flat outputs."""
        n = len(flat_out) - len(self.buffer_updates)
        if self.buffer_updates:
            current = self.state()[len(self.params):]
            with torch.no_grad():
                for i, new in zip(self.buffer_updates, flat_out[n:]):
                    current[i].copy_(new)
        return self.rebuild_output(list(flat_out[:n]))


def _slot(modules: Sequence[tuple[str, nn.Module]], name: str) -> tuple[nn.Module, str]:
    """The (owning submodule, attribute) that holds the parameter or buffer ``name``."""
    root = next((m for prefix, m in modules if prefix and name.startswith(prefix + ".")), None)
    if root is not None:
        name = name.split(".", 1)[1]
    else:
        root = next(m for prefix, m in modules if not prefix)
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def state_key(target: Any, args: tuple, kwargs: dict) -> tuple:
    """What a capture is specialised on in the modules' state: every module's training
    flag and every parameter's and buffer's name, shape, dtype, device and requires_grad.

    Values are not part of it (the graph reads them at each call), so in-place updates and
    rebinding to a tensor of the same kind reuse the capture; ``.eval()``, freezing, a new
    parameter or a dtype/device move capture again.
    """
    key: list[Any] = []
    for prefix, mod in _find_modules(target, args, kwargs):
        key.append(prefix)
        key.append(tuple(m.training for m in mod.modules()))
        for name, t in (*mod.named_parameters(), *mod.named_buffers()):
            key.append((name, tuple(t.shape), t.dtype, t.device, t.requires_grad))
    return tuple(key)


def guard_key(args: tuple, kwargs: dict) -> tuple:
    """What a captured graph is specialised on: tree structure, tensor metadata, constants."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("T", tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad))
        elif isinstance(leaf, nn.Module):
            key.append(("M", id(leaf)))
        else:
            try:
                hash(leaf)
                key.append(("C", leaf))
            except TypeError:
                key.append(("C", id(leaf)))
    return tuple(key)


# --------------------------------------------------------------------------- module stack meta


@contextlib.contextmanager
def _record_module_stack(modules: Sequence[tuple[str, nn.Module]]):
    """Record ``nn_module_stack`` on every traced node via forward hooks (make_fx has none)."""
    import torch.fx.traceback as fx_traceback

    stack: list[tuple[str, str]] = []
    handles = []

    def pre(name: str):
        def hook(mod, args):
            stack.append((name, type(mod).__qualname__))
            fx_traceback.current_meta["nn_module_stack"] = {n: (n, t) for n, t in stack}

        return hook

    def post(mod, args, out):
        if stack:
            stack.pop()
        fx_traceback.current_meta["nn_module_stack"] = {n: (n, t) for n, t in stack}

    for prefix, root in modules:
        for name, mod in root.named_modules():
            full = ".".join(p for p in (prefix, name) if p)
            handles.append(mod.register_forward_pre_hook(pre(full or type(root).__name__)))
            handles.append(mod.register_forward_hook(post))
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _restore_plain_attributes(modules: Sequence[tuple[str, nn.Module]]):
    """Undo what a traced forward assigns to modules' plain (non-parameter, non-buffer) tensor
    attributes (a recurrent layer's ``self.state = h``): those values are tracing tensors,
    which must not outlive the trace on the user's modules."""
    saved: list[tuple[nn.Module, dict[str, Any]]] = []
    for _, root in modules:
        for mod in root.modules():
            saved.append((mod, dict(vars(mod))))
    try:
        yield
    finally:
        for mod, before in saved:
            for key, value in list(vars(mod).items()):
                if isinstance(value, torch.Tensor) and (key not in before or before[key] is not value):
                    if key in before:
                        setattr(mod, key, before[key])
                    else:
                        delattr(mod, key)


# --------------------------------------------------------------------------- front doors


class GradshardTracer(fx.Tracer):
    """``torch.fx`` tracer whose leaves are gradshard primitives and registered modules.

    Third-party kernels are kept opaque by registering their module class with
    :func:`register_leaf_module`.
    """

    leaf_modules: set[type] = set()

    def __init__(self) -> None:
        super().__init__(autowrap_functions=_autowrap_functions())
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, tuple(self.leaf_modules)) or super().is_leaf_module(m, qualname)


def register_leaf_module(cls: type) -> type:
    """Keep modules of ``cls`` opaque in the ``fx`` front door (usable as a decorator)."""
    GradshardTracer.leaf_modules.add(cls)
    return cls


def _autowrap_functions() -> tuple:
    from gradshard import kernels

    return tuple(
        getattr(kernels, n) for n in ("linear_scan", "lightning_attention") if hasattr(kernels, n)
    )


def _symbolic(module: nn.Module) -> nn.Module:
    tracer = GradshardTracer()
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, ... on control flow
        raise CaptureError(
            f"torch.fx symbolic tracing failed on {type(module).__name__}: {exc}\n"
            "  instead: use frontend='python' (follows Python control flow at the example "
            "shapes) or frontend='dynamo'."
        ) from exc
    return graph_module(module, graph, type(module).__name__)


def _dynamo(module: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
    import torch._dynamo

    try:
        with torch._dynamo.config.patch(allow_rnn=True):  # nn.GRU/LSTM are user code too
            gm, _guards = torch._dynamo.export(module)(*args, **kwargs)
    except Exception as exc:
        raise CaptureError(
            f"TorchDynamo could not capture {type(module).__name__} in one graph: "
            f"{first_line(exc)}\n  instead: use frontend='python', or remove the graph "
            "break (data-dependent Python control flow) it names."
        ) from exc
    return gm


def _find_modules(target: Any, args: tuple, kwargs: dict) -> list[tuple[str, nn.Module]]:
    """Modules whose parameters become graph inputs: the target and module arguments."""
    found: list[tuple[str, nn.Module]] = []
    if isinstance(target, nn.Module):
        found.append(("", target))
    leaves, _ = pytree.tree_flatten((args, kwargs))
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nn.Module) and all(leaf is not m for _, m in found):
            found.append((f"arg{i}", leaf))
    return found


def _why_trace_failed(exc: BaseException) -> str:
    """The ``why``/``instead`` lines of a capture failure, by what the exception says."""
    text = str(exc)
    if "allow_non_fake_inputs" in text or "Please convert all Tensors to FakeTensors" in text:
        return ("  why: a tensor that requires grad is used by the model but is not a parameter of any "
                "module passed in (e.g. a module captured from a closure or a global)\n"
                "  instead: pass the module as an argument of the compiled function, or register the "
                "tensor as an nn.Parameter or buffer of the compiled model")
    if any(s in text for s in ("data-dependent", "tracing tensor", "DataDependent", "GuardOnDataDependent")):
        return ("  why: a value computed from tensor data decides Python control flow (e.g. "
                "`if x.sum() > 0`, `.item()`, `.tolist()`)\n"
                "  instead: make the branch a tensor op (torch.where) or move it out of the model (a "
                "mixture of experts that loops over the experts that got tokens: compute every expert on "
                "every token, weighted by the routing, or a grouped GEMM); or train this model with plain "
                "autograd, without gs.compile")
    return (f"  why: the model raised {type(exc).__name__} while it was traced at the example inputs' shapes "
            "and dtypes (the same call fails, or would fail, eagerly: check the inputs' rank, dtype and "
            "length)\n  instead: call the model eagerly with these inputs to see the error in its own terms, "
            "then fix the inputs or the model")


def _misplaced_inputs(state: Sequence[tuple[str, torch.Tensor]], call: tuple[tuple, dict]) -> str | None:
    """The ``why``/``instead`` lines when input tensors live on another device than the model's
    parameters and buffers (all on one device), else None."""
    homes = {t.device for _, t in state}
    if len(homes) != 1:
        return None
    home = homes.pop()
    leaves, _ = pytree.tree_flatten_with_path(call)
    away = [(("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:]), t.device) for path, t in leaves
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device != home]
    if not away:
        return None
    names = ", ".join(f"input {name} is on {dev}" for name, dev in away)
    return (f"  why: {names}, but the model's parameters and buffers are on {home}\n"
            f"  instead: move the inputs to the model's device first (`x.to('{home}')`), or the model to "
            "theirs (`model.to(device)`) before the first call")


def _explain_trace_failure(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"
    return f"{summary(exc)}\n  at {where}"


def capture(
    target: nn.Module | Callable[..., Any],
    args: tuple,
    kwargs: dict | None = None,
    *,
    frontend: str = "python",
    symbolic: Mapping[int, Sequence[int]] | None = None,
) -> Captured:
    """Capture ``target(*args, **kwargs)`` into one aten-level graph (see module doc).

    Known third-party kernels that cannot be traced (mamba_ssm's ``selective_scan_fn``) are
    replaced by traceable twins while capturing (:mod:`gradshard.capture.substitutions`); the graph
    records which in ``gm.meta["gs_substituted"]``.

    ``symbolic`` (tensor input index -> dims): trace with those input dims as symbols (every
    other size, parameters' included, static) and keep the symbolic graph as traced, not
    canonicalised: sizes computed in Python from them (a pad to a multiple of a chunk, a
    chunk count) stay expressions in the nodes' integer arguments and ``meta['val']`` shapes,
    and ``gm.meta["gs_shape_env"]`` holds the guards tracing assumed. A shape oracle for
    :mod:`gradshard.passes.symbolic_sizes`, not a graph to run.
    """
    with substitute_known_kernels() as substituted:
        captured = _capture(target, args, kwargs or {}, frontend, symbolic)
    captured.gm.meta["gs_substituted"] = tuple(substituted)
    return captured


def _capture(target: nn.Module | Callable[..., Any], args: tuple, kwargs: dict, frontend: str,
             symbolic: Mapping[int, Sequence[int]] | None = None) -> Captured:
    if frontend not in FRONTENDS:
        raise ValueError(f"unknown frontend {frontend!r}; choose one of {FRONTENDS}")
    modules = _find_modules(target, args, kwargs)
    named_params: list[tuple[str, nn.Parameter]] = []
    named_buffers: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, mod in modules:
        for n, p in mod.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named_params.append((f"{prefix}.{n}" if prefix else n, p))
        for n, b in mod.named_buffers():
            if id(b) not in seen:
                seen.add(id(b))
                named_buffers.append((f"{prefix}.{n}" if prefix else n, b))

    call = target
    if frontend in ("fx", "dynamo"):
        if not isinstance(target, nn.Module):
            raise CaptureError(
                f"frontend={frontend!r} captures an nn.Module; got a function. "
                "Use frontend='python' for a `(model, batch) -> loss` function."
            )
        call = _symbolic(target) if frontend == "fx" else _dynamo(target, args, kwargs)

    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    rebuild_box: dict[str, Any] = {}
    n_p, n_b = len(named_params), len(named_buffers)

    def flat_fn(*flat: torch.Tensor) -> list[torch.Tensor]:
        p_vals, b_vals, t_vals = flat[:n_p], flat[n_p : n_p + n_b], flat[n_p + n_b :]
        new_leaves = list(leaves)
        for pos, t in zip(tensor_positions, t_vals):
            new_leaves[pos] = t
        a, kw = pytree.tree_unflatten(new_leaves, in_spec)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_restore_plain_attributes(modules))
            for prefix, mod in modules:
                sub = {}
                for (name, _), v in zip(named_params + named_buffers, (*p_vals, *b_vals)):
                    if prefix == "" and not name.startswith("arg"):
                        sub[name] = v
                    elif prefix and name.startswith(prefix + "."):
                        sub[name[len(prefix) + 1 :]] = v
                stack.enter_context(stateless._reparametrize_module(mod, sub, tie_weights=True))
            if call is not target and isinstance(call, nn.Module):
                # fx/dynamo graph modules share the target's parameter objects by attribute;
                # reparametrize them too so the traced graph reads the placeholders.
                sub = {n: v for (n, _), v in zip(named_params + named_buffers, (*p_vals, *b_vals))}
                own = dict(call.named_parameters(remove_duplicate=False))
                own.update(dict(call.named_buffers(remove_duplicate=False)))
                by_id = {id(t): v for (_, t), v in zip(named_params + named_buffers, (*p_vals, *b_vals))}
                remap = {n: by_id[id(t)] for n, t in own.items() if id(t) in by_id}
                stack.enter_context(stateless._reparametrize_module(call, remap or sub))
            out = call(*a, **kw)
        flat_out, rebuild = flatten_output(out)
        rebuild_box["rebuild"] = rebuild
        return flat_out

    # Trace on copies of the buffers: tracing runs the forward, and an update it makes
    # (a counter, BatchNorm statistics) must not reach the user's buffers.
    traced_buffers = [b.detach().clone().requires_grad_(b.requires_grad) for _, b in named_buffers]
    example = [p for _, p in named_params] + traced_buffers + [leaves[i] for i in tensor_positions]
    dynamic = None if symbolic is None else {n_p + n_b + i: tuple(dims) for i, dims in symbolic.items()}
    try:
        gm = _trace(flat_fn, example, modules if frontend == "python" else [], dynamic=dynamic)
    except CaptureError:
        raise
    except Exception as exc:
        why = _misplaced_inputs(named_params + named_buffers, (args, kwargs)) or _why_trace_failed(exc)
        raise CaptureError("could not capture the model into one graph: " + _explain_trace_failure(exc) + "\n"
                           + why) from exc
    _name_placeholders(gm, [n for n, _ in named_params] + [n for n, _ in named_buffers], example)
    refuse_data_dependent_sizes(gm)
    if symbolic is not None:
        return Captured(gm=gm, frontend=frontend, param_names=[n for n, _ in named_params],
                        buffer_names=[n for n, _ in named_buffers], params=[p for _, p in named_params],
                        buffers=[b for _, b in named_buffers], input_spec=in_spec, tensor_positions=tensor_positions,
                        constant_leaves=leaves, rebuild_output=rebuild_box["rebuild"], example_inputs=example,
                        modules=modules)
    canonicalize(gm)
    phs = list(gm.graph.find_nodes(op="placeholder"))
    updates = functionalize_buffer_updates(gm, phs[n_p : n_p + n_b], [n for n, _ in named_buffers])
    forget_erased_nodes(gm.graph)
    return Captured(
        gm=gm,
        frontend=frontend,
        param_names=[n for n, _ in named_params],
        buffer_names=[n for n, _ in named_buffers],
        params=[p for _, p in named_params],
        buffers=[b for _, b in named_buffers],
        input_spec=in_spec,
        tensor_positions=tensor_positions,
        constant_leaves=leaves,
        rebuild_output=rebuild_box["rebuild"],
        example_inputs=example,
        modules=modules,
        buffer_updates=updates,
    )


def _trace(fn: Callable[..., Any], example: list[torch.Tensor], modules: Sequence[tuple[str, nn.Module]],
           mode: str = _TRACING_MODE, dynamic: Mapping[int, Sequence[int]] | None = None) -> fx.GraphModule:
    """make_fx at the pre-dispatch level (high-level aten ops survive); fall back to the
    post-dispatch level when pre-dispatch tracing loses the data flow.

    Pre-dispatch tracing of ``torch.vmap`` (used e.g. by ``associative_scan``'s generic
    mode) bakes traced intermediates in as constants; the post-dispatch level traces it
    correctly, at the price of decomposing composite ops (``linear`` becomes
    ``t``+``addmm``). A graph that still holds a constant requiring grad is rejected.

    ``dynamic`` (index into ``example`` -> dims): trace symbolically, those dims as symbols
    (the shape environment in ``gm.meta["gs_shape_env"]``).
    """
    fake_mode = contextlib.nullcontext()
    if dynamic is not None:
        example, fake_mode = _symbolic_example(example, dynamic)
        mode = "symbolic"
    # make_fx is not thread-safe; node stack traces start above this frame (the caller's stack is not the model)
    with TRACE_LOCK, _record_module_stack(modules), fake_mode, frames_above(_trace.__code__):
        gm = make_fx(fn, tracing_mode=mode, pre_dispatch=True, record_stack_traces=True,
                     _allow_non_fake_inputs=True)(*example)
        if _trainable_constants(gm):
            gm = make_fx(fn, tracing_mode=mode, pre_dispatch=False, record_stack_traces=True,
                         _allow_non_fake_inputs=True)(*example)
            gm.meta["gs_dispatch_level"] = "post"
    _check_no_trainable_constants(gm)
    share_stack_traces(gm)
    if dynamic is not None:
        gm.meta["gs_shape_env"] = fake_mode.shape_env
    return gm


def _contiguous_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape with contiguous strides, over ``t``'s storage where it is large enough
    (no copy: only its metadata is read), else a contiguous copy."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(int(size), 1)
    try:
        return t.detach().as_strided(t.shape, tuple(reversed(strides)), t.storage_offset()).requires_grad_(
            t.requires_grad)
    except RuntimeError:
        return t.detach().contiguous().requires_grad_(t.requires_grad)


def _symbolic_example(example: list[torch.Tensor], dynamic: Mapping[int, Sequence[int]]) -> tuple[list[Any], Any]:
    """Fake copies of ``example`` in a new mode with a shape environment: the dims in
    ``dynamic`` are symbols (one per size: inputs of one length share it), every other size
    static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    out = []
    for i, t in enumerate(example):
        dims = set(dynamic.get(i, ()))
        if dims and not t.is_contiguous():
            # a slice of a longer tensor: its strides would be symbols of their own, tied to the
            # sizes by guards no new length can be checked against; the trace reads no data
            t = _contiguous_alias(t)
        ctx = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC for d in range(t.dim())])
        out.append(fake_mode.from_tensor(t, symbolic_context=ctx))
    return out, fake_mode


def _trainable_constants(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.find_nodes(op="get_attr")
            if isinstance(getattr(gm, n.target, None), torch.Tensor) and getattr(gm, n.target).requires_grad]


def capture_graph_module(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Lower a torch-level graph (e.g. from Dynamo) with flat tensor inputs to aten IR."""

    def flat_fn(*flat: torch.Tensor):
        out = gm(*flat)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # Dynamo's graph is already a trace (and its inputs may carry Dynamo's own fake/symbolic
    # sizes): lower it on the tensors Dynamo hands over, as they are.
    aten = _trace(flat_fn, list(example_inputs), [], mode="real")
    for node, src, x in zip(aten.graph.find_nodes(op="placeholder"), gm.graph.find_nodes(op="placeholder"), example_inputs):
        node.meta["gs_input_name"] = src.name
        node.meta["gs_requires_grad"] = isinstance(x, torch.Tensor) and x.requires_grad
    return aten


def _name_placeholders(gm: fx.GraphModule, state_names: list[str], example: Sequence[Any]) -> None:
    """Tag placeholders with what they are (the parameter or buffer name, or ``input{i}``) and
    whether the tensor traced there requires grad (the fake values do not say)."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    for i, node in enumerate(phs):
        node.meta["gs_input_name"] = state_names[i] if i < len(state_names) else f"input{i - len(state_names)}"
        node.meta["gs_input_index"] = i
        node.meta["gs_requires_grad"] = i < len(example) and isinstance(example[i], torch.Tensor) and example[i].requires_grad


def _check_no_trainable_constants(gm: fx.GraphModule) -> None:
    """A tensor that requires grad baked into the graph as a constant would get no gradient."""
    from gradshard.errors import node_error

    for node in _trainable_constants(gm):
        raise node_error(
            node,
            "a tensor that requires grad is used by the model but is not a parameter of any "
            "module passed in (e.g. a module captured from a closure or a global)",
            "pass the module as an argument of the compiled function, or register the "
            "tensor as an nn.Parameter of the compiled model",
            CaptureError,
        )
