"""Checkpoint files you can trust: per-tensor checksums, clear errors, durable atomic saves.

A checkpoint is ``torch.save`` of an envelope::

    {"format": "gradshard.checkpoint/1",
     "structure_sha256": sha256 of everything that is not tensor data (keys, ints, floats, ...),
     "checksums": [[key_path, sha256 of dtype, shape and bytes], ...]   # one per tensor, in order
     "payload": the saved object}

:func:`read_checkpoint` recomputes every digest and raises :class:`CheckpointError` naming
the file and the first damaged key path (``global/layers.0.q.weight``) instead of returning
corrupted tensors; empty, truncated and foreign files raise it too, naming the file.

Saving is two-phase so that callers (every rank of a job) can agree before anything becomes
visible: :func:`write_checkpoint` writes a temp file next to the target and fsyncs it;
:meth:`PendingCheckpoint.commit` renames it over the target (``os.replace``) and fsyncs the
directory, so after ``commit`` returns the new file survives a power loss.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from gradshard.errors import GradshardError, summary

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "PendingCheckpoint",
    "VerifiedCheckpoint",
    "read_checkpoint",
    "save_checkpoint",
    "tensor_digest",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = "gradshard.checkpoint/1"

# What torch.load raises on damaged or foreign files (found by fuzzing truncations and byte
# flips of real checkpoints): the zip reader's RuntimeError ("PytorchStreamReader failed
# ...") and OSError (EINVAL: a seek to a garbage offset), and the errors of a damaged or
# foreign pickle stream (UnpicklingError, EOFError, UnicodeDecodeError, KeyError, ...).
_UNREADABLE = (
    EOFError,
    pickle.UnpicklingError,
    RuntimeError,
    OSError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
)

Checksums = tuple[tuple[str, str], ...]


class CheckpointError(GradshardError, RuntimeError):
    """A checkpoint file is damaged, incomplete, foreign, or the ranks' checkpoints disagree."""


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's dtype, shape and contiguous CPU bytes."""
    if t.layout != torch.strided:
        raise CheckpointError(f"cannot checksum a {t.layout} tensor; checkpoints hold dense tensors only")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(data.numpy())
    return h.hexdigest()


def _flatten(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """``obj`` with every tensor replaced by a marker; tensors go to ``tensors`` in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append((path, obj))
        return ("<tensor>", path)
    prefix = f"{path}/" if path else ""
    if isinstance(obj, Mapping):
        return (type(obj).__name__, [(k, _flatten(v, f"{prefix}{k}", tensors)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_flatten(v, f"{prefix}{i}", tensors) for i, v in enumerate(obj)])
    return obj


def _digests(obj: Any) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = _flatten(obj, "", tensors)
    return hashlib.sha256(repr(skeleton).encode()).hexdigest(), tensors


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint written and fsynced to ``tmp``, not yet visible at ``path``."""

    path: str
    tmp: str
    checksums: Checksums

    def commit(self) -> None:
        """Atomically replace ``path`` with the new file, then fsync the directory."""
        os.replace(self.tmp, self.path)
        _fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    def discard(self) -> None:
        """Delete the temp file; ``path`` keeps its previous content."""
        _remove(self.tmp)


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose every tensor and non-tensor value matched its stored checksum."""

    path: str
    payload: Any
    checksums: Checksums


def write_checkpoint(obj: Any, path: str | os.PathLike) -> PendingCheckpoint:
    """Checksum ``obj``'s tensors and write it to a temp file beside ``path`` (flushed, fsynced)."""
    path = os.fspath(path)
    structure, tensors = _digests(obj)
    checksums = tuple((p, tensor_digest(t)) for p, t in tensors)
    envelope = {
        "format": CHECKPOINT_FORMAT,
        "structure_sha256": structure,
        "checksums": [list(c) for c in checksums],
        "payload": obj,
    }
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(envelope, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove(tmp)
        raise
    return PendingCheckpoint(path, tmp, checksums)


def save_checkpoint(obj: Any, path: str | os.PathLike) -> Checksums:
    """Write ``obj`` durably and atomically to ``path``; returns the per-tensor checksums."""
    pending = write_checkpoint(obj, path)
    pending.commit()
    return pending.checksums


def _damaged(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged: {what}. The file changed after it was saved (storage, "
        f"copy or transfer fault); its tensors cannot be trusted. Resume from an earlier "
        f"checkpoint, or re-save from a healthy run."
    )


def read_checkpoint(path: str | os.PathLike) -> VerifiedCheckpoint:
    """Load a :func:`write_checkpoint` file to CPU and verify every checksum.

    Raises :class:`CheckpointError` naming the file for empty, truncated, foreign or
    checksum-less files, and the damaged key path for a checksum mismatch. A missing or
    unreadable file raises the ``OSError`` of ``open`` unchanged.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CheckpointError(
                f"checkpoint {path} is empty (0 bytes): it was never written completely "
                f"(a crash or full disk during a save that did not use gradshard's atomic "
                f"save?). Resume from an earlier checkpoint."
            )
        try:
            envelope = torch.load(f, map_location="cpu", weights_only=True)
        except _UNREADABLE as exc:
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({size} bytes): it is "
                f"truncated, damaged or not a torch checkpoint (torch.load: "
                f"{summary(exc)}). Resume from an earlier checkpoint."
            ) from exc
    if not isinstance(envelope, dict) or envelope.get("format") != CHECKPOINT_FORMAT:
        found = envelope.get("format") if isinstance(envelope, dict) else type(envelope).__name__
        raise CheckpointError(
            f"checkpoint {path} is not a {CHECKPOINT_FORMAT} file (found {found!r}): it has no "
            f"checksums (written by torch.save directly or by an older gradshard), so it cannot "
            f"be verified. If you trust it, load it with torch.load(path, weights_only=True) and "
            f"load_state_dict(), then save() again to add checksums."
        )
    payload = envelope.get("payload")
    stored = envelope.get("checksums")
    structure, tensors = _digests(payload)
    well_formed = isinstance(stored, list) and all(
        isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in stored
    )
    if structure != envelope.get("structure_sha256") or not well_formed or len(stored) != len(tensors):
        raise _damaged(path, "its non-tensor data (keys, step counters, config) does not match its checksum")
    bad = [p for (p, t), (q, d) in zip(tensors, stored) if p != q or tensor_digest(t) != d]
    if bad:
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        raise _damaged(path, f"tensor `{bad[0]}` does not match its sha256 checksum{more}")
    return VerifiedCheckpoint(path, payload, tuple((p, d) for p, d in stored))
