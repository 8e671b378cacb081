"""Errors that name the node, its source line, why, and what to do instead."""

from __future__ import annotations

import torch.fx as fx

from .ir import source_of

__all__ = ["GradshardError", "CaptureError", "UnsupportedGraphError", "node_error", "first_line", "summary"]


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message; its type's name when the message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def summary(exc: BaseException) -> str:
    """``"TypeName: first line"`` of ``exc`` (the type alone when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class GradshardError(Exception):
    """Base class of every error gradshard raises on purpose."""


class CaptureError(GradshardError):
    """The model could not be captured into one graph."""


class UnsupportedGraphError(GradshardError):
    """The captured graph cannot be rewritten safely by the requested plan."""


def node_error(
    node: fx.Node | None,
    why: str,
    instead: str,
    cls: type[GradshardError] = UnsupportedGraphError,
) -> GradshardError:
    """Build an error naming ``node`` (op and source line), ``why``, and ``instead``."""
    lines = []
    if node is not None:
        lines.append(f"node `{node.name}` ({node.op} {getattr(node.target, '__name__', node.target)})")
        loc = source_of(node)
        if loc is not None:
            lines.append(f"  at {loc}")
    lines.append(f"  why: {why}")
    lines.append(f"  instead: {instead}")
    return cls("\n".join(lines))
