"""lower_kernels: choose the kernel backend of every gradshard kernel call and region module.

Runs last in every plan (it needs the final graph and region modules). For each
``torch.ops.gradshard.*`` node it fixes the ``backend`` argument, and for every region module
with a ``kernel_backend`` attribute (the plans' runtime modules) it sets that attribute, so
``gradshard show`` can mark which kernel each stage runs::

    before: linear_scan = torch.ops.gradshard.linear_scan.default(a, u, None, False, None)
    after:  linear_scan = torch.ops.gradshard.linear_scan.default(a, u, None, False, 'triton')

The choice: ``gs.compile(..., backend="torch"|"triton")`` if given; otherwise ``"triton"``
when the example inputs live on CUDA and Triton is importable, else ``"torch"``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.errors import GradshardError
from gradshard.pipeline import PassContext, PassResult, graph_pass

__all__ = ["lower_kernels", "choose_backend"]


def choose_backend(ctx: PassContext) -> str:
    """The backend for this compilation (see module doc); errors if it cannot run here."""
    from gradshard.kernels.backend import available_backends, triton_importable

    requested = ctx.backend
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in ctx.example_inputs)
    if requested in (None, "auto"):
        return "triton" if on_cuda and triton_importable() else "torch"
    if requested not in ("torch", "triton"):
        raise GradshardError(f"backend={requested!r}: choose 'torch', 'triton' or None (automatic)")
    if requested == "triton" and "triton" not in available_backends():
        raise GradshardError(
            "backend='triton' needs CUDA tensors, or the Triton interpreter on CPU "
            "(set TRITON_INTERPRET=1 before importing gradshard); use backend='torch' here")
    return requested


def _is_gradshard_op(node: fx.Node) -> bool:
    packet = getattr(node.target, "_overloadpacket", None)
    return str(getattr(packet, "_qualified_op_name", "")).startswith("gradshard::")


@graph_pass
def lower_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fix the kernel backend of gradshard kernel calls and region modules."""
    backend = choose_backend(ctx)
    changed = False
    notes = [f"kernel backend: {backend}"]
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _is_gradshard_op(node):
            continue
        schema = node.target._schema
        names = [a.name for a in schema.arguments]
        if "backend" not in names:
            continue
        i = names.index("backend")
        args = list(node.args) + [a.default_value if a.has_default_value() else None for a in schema.arguments[len(node.args):]]
        if i < len(node.args):
            args = list(node.args)
            if args[i] != backend:
                args[i] = backend
                node.args = tuple(args)
                changed = True
        elif node.kwargs.get("backend") != backend:
            node.kwargs = {**node.kwargs, "backend": backend}
            changed = True
        node.meta["gs_kernel"] = f"{backend}:{node.target._overloadpacket.__name__}"
        notes.append(f"{node.name} -> {node.meta['gs_kernel']}")
    for name, mod in gm.named_modules():
        if hasattr(mod, "kernel_backend"):
            mod.kernel_backend = backend
            notes.append(f"region {name} -> {backend}")
    return PassResult(gm, changed=changed, notes=tuple(notes))
