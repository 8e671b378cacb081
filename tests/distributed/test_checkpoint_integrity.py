"""Checkpoints you can trust: checksums, clear errors, durable saves, ranks that agree.

Single-process tests use a world of one; the agreement tests run two threaded gloo ranks.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gradshard.distributed import checkpoint as ckpt_mod
from gradshard.distributed.checkpoint import read_checkpoint, save_checkpoint, tensor_digest
from gradshard.distributed.diloco import CheckpointError, DiLoCo, DiLoCoError
from gradshard.distributed.testing import run_threaded
from gradshard.errors import GradshardError

DT = torch.float64


def make_outer(group=None, steps: int = 3, timeout_s: float = 10.0) -> DiLoCo:
    """Identical tiny model on every rank, trained ``steps`` inner steps (syncs every 2)."""
    g = torch.Generator().manual_seed(7)
    net = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)).to(DT)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT))
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    outer = DiLoCo(net, opt, sync_every=2, group=group, timeout_s=timeout_s)
    rank = group.rank() if group is not None else 0
    for s in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + s)
        x = torch.randn(4, 5, generator=gen, dtype=DT)
        net(x).square().mean().backward()
        outer.step()
    return outer


def same(a, b) -> bool:
    """Bit-exact equality of nested checkpoint payloads."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


# --------------------------------------------------------------------------- single process


def test_good_checkpoint_round_trips_bit_exactly(tmp_path: Path) -> None:
    outer = make_outer()
    path = outer.save(tmp_path / "c.pt")
    expected = outer.state_dict()
    fresh = make_outer(steps=0)
    fresh.load(path)
    assert same(fresh.state_dict(), expected)
    verified = read_checkpoint(path)
    assert dict(verified.checksums)["global/0.weight"] == tensor_digest(outer.global_parameters["0.weight"])
    assert len(verified.checksums) == sum(1 for _ in _tensors(expected))
    assert leftovers(tmp_path) == []


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_64_flipped_bytes_in_tensor_data_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    outer = make_outer()
    path = outer.save(tmp_path / "c.pt")
    raw = bytearray(Path(path).read_bytes())
    victim = outer.state_dict()["momentum"]["0.weight"]  # 45 float64 = 360 bytes, nonzero after a sync
    needle = victim.numpy().tobytes()
    assert raw.count(needle) == 1
    start = raw.find(needle) + 64
    for i in range(start, start + 64):
        raw[i] ^= 0xFF
    Path(path).write_bytes(raw)
    # the defect: torch.load alone accepts the file and returns a different tensor
    plain = torch.load(path, weights_only=True)["payload"]
    assert not torch.equal(plain["momentum"]["0.weight"], victim)
    fresh = make_outer(steps=0)
    with pytest.raises(CheckpointError) as info:
        fresh.load(path)
    msg = str(info.value)
    assert path in msg and "`momentum/0.weight`" in msg and "earlier checkpoint" in msg
    assert isinstance(info.value, GradshardError)
    assert fresh.inner_steps == 0  # nothing was loaded


def _rewrite_envelope(path: str, edit) -> None:
    envelope = torch.load(path, weights_only=True)
    edit(envelope["payload"])
    torch.save(envelope, path)  # the stored checksums are the old ones


def test_tensor_changed_under_its_stored_checksum_is_refused(tmp_path: Path) -> None:
    path = make_outer().save(tmp_path / "c.pt")
    _rewrite_envelope(path, lambda p: p["global"]["2.bias"].view(-1)[1].add_(1e-12))
    with pytest.raises(CheckpointError, match=r"tensor `global/2\.bias` does not match"):
        make_outer(steps=0).load(path)


def test_changed_step_counter_is_refused(tmp_path: Path) -> None:
    path = make_outer().save(tmp_path / "c.pt")
    _rewrite_envelope(path, lambda p: p.__setitem__("inner_steps", p["inner_steps"] + 1))
    with pytest.raises(CheckpointError, match="non-tensor data"):
        make_outer(steps=0).load(path)


@pytest.mark.parametrize("kind", ["empty", "one_byte", "half", "all_but_one", "text", "tensor", "unchecksummed"])
def test_unreadable_files_raise_checkpoint_error_naming_the_file(tmp_path: Path, kind: str) -> None:
    outer = make_outer()
    path = outer.save(tmp_path / "c.pt")
    good = Path(path).read_bytes()
    if kind == "empty":
        Path(path).write_bytes(b"")
    elif kind == "one_byte":
        Path(path).write_bytes(good[:1])
    elif kind == "half":
        Path(path).write_bytes(good[: len(good) // 2])
    elif kind == "all_but_one":
        Path(path).write_bytes(good[:-1])
    elif kind == "text":
        Path(path).write_text("not a checkpoint\n")
    elif kind == "tensor":
        torch.save(torch.ones(3), path)
    else:  # what DiLoCo.save wrote before checksums existed
        torch.save(outer.state_dict(), path)
    with pytest.raises(CheckpointError) as info:
        make_outer(steps=0).load(path)
    msg = str(info.value)
    assert path in msg
    expect = {"empty": "is empty", "tensor": "no checksums", "unchecksummed": "no checksums"}
    assert expect.get(kind, "cannot be read") in msg


def test_damage_anywhere_is_refused_or_harmless(tmp_path: Path) -> None:
    """Flip 8 bytes at offsets across the whole file, truncate at many lengths: every outcome
    is a CheckpointError or a bit-exact payload, never silently different data."""
    outer = make_outer()
    path = outer.save(tmp_path / "c.pt")
    good = Path(path).read_bytes()
    expected = read_checkpoint(path).payload
    variants = [good[:n] for n in range(0, len(good), 211)]
    for off in range(0, len(good), 37):
        raw = bytearray(good)
        for i in range(off, min(off + 8, len(raw))):
            raw[i] ^= 0xFF
        variants.append(bytes(raw))
    refused = 0
    for data in variants:
        Path(path).write_bytes(data)
        try:
            payload = read_checkpoint(path).payload
        except CheckpointError as exc:
            assert path in str(exc)
            refused += 1
        else:
            assert same(payload, expected)
    assert refused > len(variants) // 2


def test_save_fsyncs_file_before_rename_and_directory_after(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = make_outer().save(tmp_path / "c.pt")
    file_ino, dir_ino = os.stat(path).st_ino, os.stat(tmp_path).st_ino
    assert events == [("fsync", file_ino, False), ("replace", path), ("fsync", dir_ino, True)]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    outer = make_outer()
    path = outer.save(tmp_path / "c.pt")
    before = Path(path).read_bytes()
    outer.step()

    def full_disk(obj, f) -> None:
        f.write(b"PK\x03\x04partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        outer.save(path)
    assert Path(path).read_bytes() == before and leftovers(tmp_path) == []


def test_save_checkpoint_of_plain_objects(tmp_path: Path) -> None:
    obj = {"w": torch.arange(6, dtype=torch.int32).view(2, 3).t(), "flags": torch.tensor([True, False]),
           "half": torch.randn(4, dtype=torch.bfloat16), "meta": [1, 2.5, "x", None, (3, 4)]}
    save_checkpoint(obj, tmp_path / "o.pt")
    assert same(read_checkpoint(tmp_path / "o.pt").payload, obj)


# --------------------------------------------------------------------------- two ranks


def test_ranks_saving_different_steps_raise_and_keep_previous_files(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "c-{rank}.pt")

    def body(rank, group):
        outer = make_outer(group, steps=2)
        outer.save(ckpt)  # both at step 2: agreed and committed
        if rank == 1:
            outer.step()  # rank 1 is one step ahead (step() syncs only every 2 steps)
        outer.save(ckpt)

    out = run_threaded(2, body, raise_on_error=False, timeout_s=30)
    for e in out:
        assert isinstance(e, CheckpointError), e
        assert "different inner steps (rank 0: step 2, rank 1: step 3)" in str(e)
        assert "previous checkpoint files were kept" in str(e)
    for r in range(2):
        assert read_checkpoint(tmp_path / f"c-{r}.pt").payload["inner_steps"] == 2
    assert leftovers(tmp_path) == []


def test_diverged_replicated_state_is_refused_at_save(tmp_path: Path) -> None:
    def body(rank, group):
        outer = make_outer(group, steps=2)
        if rank == 1:
            outer.global_parameters["2.bias"].add_(1e-12)  # the live global tensor
        outer.save(str(tmp_path / "c-{rank}.pt"))

    out = run_threaded(2, body, raise_on_error=False, timeout_s=30)
    for e in out:
        assert isinstance(e, CheckpointError), e
        assert "replicated outer state" in str(e) and "rank(s) [1]" in str(e)
    assert not any(tmp_path.iterdir())


def test_loading_a_mixed_set_is_refused_and_loads_nothing(tmp_path: Path) -> None:
    # what a crash between the ranks' renames leaves: rank 0's new file, rank 1's old one
    def save(rank, group):
        outer = make_outer(group, steps=2)
        outer.save(str(tmp_path / "old-{rank}.pt"))
        outer.step(), outer.step()
        outer.save(str(tmp_path / "new-{rank}.pt"))

    def mixed(rank, group):
        fresh = make_outer(group, steps=0)
        before = {n: p.clone() for n, p in fresh.module.state_dict().items()}
        with pytest.raises(CheckpointError) as info:
            fresh.load(str(tmp_path / ("new-0.pt" if rank == 0 else "old-1.pt")))
        assert fresh.inner_steps == 0 and same(dict(fresh.module.state_dict()), before)
        return str(info.value)

    run_threaded(2, save)
    for msg in run_threaded(2, mixed, timeout_s=30):
        assert "rank 0: step 4, rank 1: step 2" in msg and "nothing was loaded" in msg

    def good(rank, group):
        fresh = make_outer(group, steps=0)
        fresh.load(str(tmp_path / "new-{rank}.pt"))
        return fresh.inner_steps

    assert run_threaded(2, good) == [4, 4]


def test_one_damaged_file_fails_every_rank_fast(tmp_path: Path) -> None:
    def save(rank, group):
        make_outer(group, steps=2).save(str(tmp_path / "c-{rank}.pt"))

    run_threaded(2, save)
    (tmp_path / "c-1.pt").write_bytes(b"")

    def load(rank, group):
        make_outer(group, steps=0, timeout_s=20).load(str(tmp_path / "c-{rank}.pt"))

    t0 = time.monotonic()
    out = run_threaded(2, load, raise_on_error=False, timeout_s=30)
    assert time.monotonic() - t0 < 10  # the peer is told, it does not wait for the timeout
    assert isinstance(out[1], CheckpointError) and "c-1.pt is empty" in str(out[1])
    assert isinstance(out[0], CheckpointError) and "rank(s) [1] could not load" in str(out[0])


def test_save_on_one_rank_only_is_reported_not_hung(tmp_path: Path) -> None:
    def body(rank, group):
        outer = make_outer(group, steps=2, timeout_s=2)
        if rank == 0:
            outer.save(str(tmp_path / "c-{rank}.pt"))

    out = run_threaded(2, body, raise_on_error=False, timeout_s=30)
    assert isinstance(out[0], CheckpointError), out[0]
    assert "every rank must call save()" in str(out[0]) and "diloco.checkpoint" in str(out[0])
    assert not any(tmp_path.iterdir())


def test_wrong_rank_file_is_still_a_diloco_error(tmp_path: Path) -> None:
    def save(rank, group):
        make_outer(group, steps=2).save(str(tmp_path / "c-{rank}.pt"))

    def load_other(rank, group):  # a separate run: a peer's rename may lag behind our own
        make_outer(group, steps=0).load(str(tmp_path / f"c-{1 - rank}.pt"))

    run_threaded(2, save)
    out = run_threaded(2, load_other, raise_on_error=False, timeout_s=30)
    assert all(isinstance(e, DiLoCoError) and "rank=" in str(e) for e in out)
