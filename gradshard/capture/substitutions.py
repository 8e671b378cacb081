"""Known third-party kernels no front door can trace, and the traceable twins used instead.

A fused CUDA kernel behind a Python function (mamba_ssm's ``selective_scan_fn`` calls the
``selective_scan_cuda`` extension) cannot run on the fake tensors of tracing, and even where
it could, the captured graph would hold an opaque call instead of the recurrence the detect
passes look for. While a model is being captured, :func:`substitute_known_kernels` rebinds
every reference to such a function -- in the module that defines it and in every module that
imported it by name (``from mamba_ssm... import selective_scan_fn``) -- to a twin that
computes the same function with gradshard primitives, and restores the bindings afterwards.
The compiled program then runs the twin (gradshard's kernels), never the original.

The table is keyed by where the kernel is defined; add entries with
:func:`register_substitution`. A kernel whose defining module was never imported cannot be
in the user's model, so nothing is imported to look for it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

__all__ = ["Substitution", "SUBSTITUTIONS", "install_traceable_twins", "register_substitution",
           "substitute_known_kernels"]


@dataclass(frozen=True)
class Substitution:
    """``module.name`` is replaced by ``replacement`` (``"pkg.mod:function"``) while capturing."""

    module: str
    name: str
    replacement: str
    why: str

    def load_replacement(self) -> Callable[..., Any]:
        mod, _, fn = self.replacement.partition(":")
        return getattr(importlib.import_module(mod), fn)


SUBSTITUTIONS: list[Substitution] = []


def register_substitution(sub: Substitution) -> Substitution:
    """Add ``sub`` to the table (replacing an entry for the same ``module.name``)."""
    SUBSTITUTIONS[:] = [s for s in SUBSTITUTIONS if (s.module, s.name) != (sub.module, sub.name)]
    SUBSTITUTIONS.append(sub)
    return sub


register_substitution(Substitution(
    module="mamba_ssm.ops.selective_scan_interface",
    name="selective_scan_fn",
    replacement="gradshard.capture.twins_mamba:selective_scan_reference",
    why="calls the selective_scan_cuda extension; the twin is the same recurrence written "
        "with gradshard.kernels.linear_scan, so it is detected as a linear recurrence",
))


register_substitution(Substitution(
    module="mamba_ssm.ops.selective_scan_interface",
    name="mamba_inner_fn",
    replacement="gradshard.capture.twins_mamba:mamba_inner_reference",
    why="the fused conv + projections + selective scan path Mamba trains with (use_fast_path); "
        "the twin is those ops around one gradshard.kernels.linear_scan",
))


register_substitution(Substitution(
    module="mamba_ssm.ops.triton.ssd_combined",
    name="mamba_chunk_scan_combined",
    replacement="gradshard.capture.twins_mamba:mamba_chunk_scan_reference",
    why="Mamba-2's SSD Triton kernels; the twin computes the same state space model as one "
        "gradshard.kernels.linear_scan per head, so it is detected as a linear recurrence",
))


register_substitution(Substitution(
    module="mamba_ssm.ops.triton.ssd_combined",
    name="mamba_split_conv1d_scan_combined",
    replacement="gradshard.capture.twins_mamba:mamba_split_conv1d_scan_reference",
    why="the fused conv + SSD + gated-norm + out-proj path Mamba2 trains with (use_mem_eff_path); "
        "the twin is those ops around one gradshard.kernels.linear_scan per head",
))


def _bindings_of(fn: object) -> list[tuple[ModuleType, str]]:
    """Every ``(module, global name)`` currently bound to ``fn`` in an imported module."""
    found = []
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if value is fn:
                found.append((mod, key))
    return found


def _swap_known_kernels() -> tuple[list[str], list[tuple[ModuleType, str, object]]]:
    """Rebind every imported known kernel to its twin; ``(applied, undo)``."""
    undo: list[tuple[ModuleType, str, object]] = []
    applied: list[str] = []
    for sub in SUBSTITUTIONS:
        home = sys.modules.get(sub.module)
        original = getattr(home, sub.name, None) if home is not None else None
        if original is None:
            continue
        twin = sub.load_replacement()
        if original is twin:
            continue  # already installed for good (install_traceable_twins)
        for mod, key in _bindings_of(original):
            undo.append((mod, key, original))
            setattr(mod, key, twin)
        applied.append(f"{sub.module}.{sub.name}")
    return applied, undo


@contextlib.contextmanager
def substitute_known_kernels() -> Iterator[list[str]]:
    """Rebind the known kernels of :data:`SUBSTITUTIONS` to their twins for the duration.

    Yields the list of ``"module.name"`` that were substituted (empty when none is imported).
    """
    undo: list[tuple[ModuleType, str, object]] = []
    try:
        applied, undo = _swap_known_kernels()
        yield applied
    finally:
        for mod, key, original in reversed(undo):
            setattr(mod, key, original)


def install_traceable_twins() -> list[str]:
    """Rebind every imported known kernel to its twin for the rest of the process.

    For ``torch.compile(model, backend=gs.backend(...))``: there Dynamo traces the model before
    gradshard captures anything, so the swap must already be in place. Import the kernels' modules
    (or the model) first; returns the ``"module.name"`` rebound. The model then runs the twins
    everywhere, also outside compiled code.
    """
    applied, _ = _swap_known_kernels()
    return applied
