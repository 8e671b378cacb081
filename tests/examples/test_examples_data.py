"""Offline byte-level corpus from the standard library's sources."""

from __future__ import annotations

import pytest
import torch

from examples.data import (
    VOCAB_SIZE,
    example_batch,
    iterate_batches,
    load_corpus,
    sample_batch,
    stdlib_root,
    stdlib_source_files,
)

SMALL = 200_000


def test_files_are_sorted_stdlib_sources() -> None:
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert "os.py" in files and (stdlib_root() / "os.py").is_file()


def test_corpus_is_deterministic_and_split_by_file() -> None:
    corpus = load_corpus(max_bytes=SMALL)
    load_corpus.cache_clear()
    again = load_corpus(max_bytes=SMALL)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert corpus.train.dtype == torch.uint8
    assert corpus.train.numel() == SMALL - int(SMALL * 0.1) and corpus.val.numel() == int(SMALL * 0.1)
    assert not set(corpus.train_files) & set(corpus.val_files)
    other_seed = load_corpus(max_bytes=SMALL, seed=1)
    assert other_seed.train_files != corpus.train_files
    first = (stdlib_root() / corpus.train_files[0]).read_bytes()
    assert bytes(corpus.train[: min(len(first), 1000)].tolist()) == first[:1000]


def test_batches_are_shifted_windows() -> None:
    corpus = load_corpus(max_bytes=SMALL)
    batches = list(iterate_batches(corpus.train, 3, 17, seed=5, num_batches=4))
    assert len(batches) == 4
    stream = bytes(corpus.train.tolist())
    for input_ids, labels in batches:
        assert input_ids.shape == labels.shape == (3, 17) and input_ids.dtype == torch.int64
        assert int(input_ids.max()) < VOCAB_SIZE and int(input_ids.min()) >= 0
        assert torch.equal(input_ids[:, 1:], labels[:, :-1])
        for row, lab in zip(input_ids, labels):
            window = bytes(row.tolist()) + bytes(lab[-1:].tolist())
            assert window in stream
    again = list(iterate_batches(corpus.train, 3, 17, seed=5, num_batches=4))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


def test_example_batch_and_errors() -> None:
    x, y = example_batch(2, 32, split="val")
    assert x.shape == y.shape == (2, 32)
    with pytest.raises(ValueError, match="seq_len"):
        sample_batch(torch.zeros(10, dtype=torch.uint8), 1, 10, torch.Generator())
    with pytest.raises(ValueError, match="split"):
        example_batch(split="test")
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(max_bytes=SMALL, val_fraction=1.5)
