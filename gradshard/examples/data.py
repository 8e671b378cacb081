"""Offline real text: byte-level tokens from the Python standard library's own sources.

Works on any machine with CPython and needs no download. The ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` are listed in sorted order, shuffled with a fixed seed,
and split by *file* into validation and training sets (no file contributes to both). The
bytes of each set's files are concatenated (separated by a newline) up to a byte budget.
Tokens are raw bytes: vocabulary 256.

The exact text depends on the installed CPython version; for one installation everything
is deterministic.
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
_PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class ByteCorpus:
    """Training and validation byte streams (uint8 tensors) and the files they came from."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    root: str


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the stdlib's ``.py`` files, sorted; third-party dirs skipped."""
    root = stdlib_root() if root is None else root
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _PRUNED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    if not found:
        raise FileNotFoundError(
            f"no .py files under the stdlib directory {root} (is the standard library zipped or "
            "stripped on this interpreter?); pass token tensors to iterate_batches directly instead"
        )
    return sorted(found)


def _read_until(root: Path, files: list[str], budget: int) -> tuple[bytes, tuple[str, ...]]:
    chunks: list[bytes] = []
    used: list[str] = []
    size = 0
    for rel in files:
        if size >= budget:
            break
        data = (root / rel).read_bytes() + b"\n"
        chunks.append(data)
        used.append(rel)
        size += len(data)
    return b"".join(chunks)[:budget], tuple(used)


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def load_corpus(max_bytes: int = 4_000_000, val_fraction: float = 0.1, seed: int = 0) -> ByteCorpus:
    """Load at most ``max_bytes`` of stdlib source, ``val_fraction`` of it for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"load_corpus: val_fraction={val_fraction} must lie in (0, 1)")
    if max_bytes < 2:
        raise ValueError(f"load_corpus: max_bytes={max_bytes} must be at least 2")
    root = stdlib_root()
    files = stdlib_source_files(root)
    random.Random(seed).shuffle(files)
    n_val_files = max(1, round(len(files) * val_fraction))
    val_budget = max(1, int(max_bytes * val_fraction))
    val_bytes, val_files = _read_until(root, files[:n_val_files], val_budget)
    train_bytes, train_files = _read_until(root, files[n_val_files:], max_bytes - val_budget)
    return ByteCorpus(
        train=_to_tensor(train_bytes),
        val=_to_tensor(val_bytes),
        train_files=train_files,
        val_files=val_files,
        root=str(root),
    )


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: ``input_ids`` (B, T) int64 and next-token ``labels`` (B, T)."""
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"sample_batch: a stream of {tokens.numel()} tokens cannot hold a window of "
            f"seq_len + 1 = {seq_len + 1}; load a larger corpus or use a shorter seq_len"
        )
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets[None, :]].long()
    return windows[:, :-1], windows[:, 1:]


def iterate_batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    num_batches: int | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(input_ids, labels)`` batches of shape (B, T); endless if ``num_batches`` is None."""
    generator = torch.Generator().manual_seed(seed)
    produced = 0
    while num_batches is None or produced < num_batches:
        input_ids, labels = sample_batch(tokens, batch_size, seq_len, generator)
        if device is not None:
            input_ids, labels = input_ids.to(device), labels.to(device)
        yield input_ids, labels
        produced += 1


def example_batch(
    batch_size: int = 2, seq_len: int = 32, *, split: str = "train", seed: int = 0, max_bytes: int = 262_144
) -> tuple[torch.Tensor, torch.Tensor]:
    """One deterministic ``(input_ids, labels)`` batch from a small corpus."""
    corpus = load_corpus(max_bytes=max_bytes)
    if split not in ("train", "val"):
        raise ValueError(f"example_batch: split={split!r}; expected 'train' or 'val'")
    tokens = corpus.train if split == "train" else corpus.val
    return sample_batch(tokens, batch_size, seq_len, torch.Generator().manual_seed(seed))
