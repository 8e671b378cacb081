"""DiLoCo-family outer loop for models whose trainable parameters may be slices.

Algorithm 1 of "Partial Parameter Updates for Efficient Distributed Training" (Filippova
et al., 2025), which contains DiLoCo (every rank trains every entry) as the special case
of unsliced models, plus the streaming variant (Douillard et al., 2025)::

    theta_global <- the (identical) initial parameters of every rank
    repeat:
        H local steps of the inner optimizer on this rank's trainable entries I_k
        delta_k = (theta_global - theta_k) masked to I_k              # outer gradient
        delta   = all_reduce_sum(delta_k) / m     (element-wise; m[i] = #ranks training i,
                                                   entries with m[i] = 0 get delta 0)
        buf     = mu * buf + delta                                    # Nesterov SGD,
        theta_global -= lr * (delta + mu * buf)                       # torch.optim.SGD form
        every rank loads theta_global (trainable and frozen entries)

``delta`` is the *negative* of the paper's averaged update (global minus local, DiLoCo's
outer-gradient convention), so with ``outer_lr=1, outer_momentum=0`` the new global
parameters are exactly the element-wise average of the ranks' trained entries.

Streaming (``fragments=P > 1``): the full parameters are partitioned into ``P`` fragments
of whole layers, and each sync handles one fragment. With ``tau = sync_every / P`` (must
be an integer), after the ``s``-th inner step (``s = 1, 2, ...``) fragment
``(s / tau - 1) mod P`` is synchronised whenever ``s`` is a multiple of ``tau``. So fragment
``f`` syncs after steps ``(f + 1) tau, (f + 1) tau + H, (f + 1) tau + 2H, ...``: every
fragment syncs once every ``H`` steps (its first round is ``(f + 1) tau`` steps long), and
the syncs are staggered by ``tau`` steps, as in Streaming DiLoCo. Fragments are formed
from layers (the first numeric component of a name, ``layers.3.mlp.up.weight`` -> layer
``layers.3``): ``"strided"`` puts layer ``i`` into fragment ``i mod P`` (Streaming DiLoCo's
better pattern), ``"sequential"`` puts contiguous runs of layers together; parameters
outside any layer (embeddings, final norm) join the fragment with the fewest elements.
Communication is not overlapped with computation (Streaming DiLoCo's ``tau_overlap = 0``,
so its mixing factor ``alpha`` plays no role) and is not quantised.

The module interface (:class:`SlicedParameters`) is three methods, which gradshard's
``CompiledModule`` provides and which default to :mod:`gradshard.plans.partial_update.runtime` for any
``nn.Module`` (plain modules: every ``requires_grad`` parameter is trained in full):
``parameter_slices()``, ``full_parameters(names=None)`` and ``load_full_parameters(d)``.
A ``gs.compile(model, plan="partial_update")`` module creates its slices at its first
call: call it once before building the inner optimizer and the outer loop.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from gradshard.errors import GradshardError
from gradshard.plans.partial_update import runtime as partial
from gradshard.distributed.checkpoint import CheckpointError, Checksums, read_checkpoint, write_checkpoint
from gradshard.runtime.comm import CommError, Communicator

Tensor = torch.Tensor

__all__ = [
    "CheckpointError",
    "DiLoCoError",
    "SlicedParameters",
    "PartialDiLoCo",
    "DiLoCo",
    "due_fragment",
    "make_fragments",
    "trained_masks",
]

_FORMAT = "gradshard.diloco/1"


class DiLoCoError(GradshardError, RuntimeError):
    """The outer loop cannot proceed: replicas differ, a checkpoint does not match, a collective failed."""


@runtime_checkable
class SlicedParameters(Protocol):
    """What the outer loop needs from a module whose trainable parameters may be slices."""

    def parameter_slices(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        """``{slice_name: (original_name, (dim, start, stop))}`` (docs/DESIGN.md)."""

    def full_parameters(self, names: Iterable[str] | None = None) -> dict[str, Tensor]:
        """Full values under original names: split tensors reassembled (new tensors), the
        others as the live parameters (their ``requires_grad`` says whether they train)."""

    def load_full_parameters(self, params: Mapping[str, Tensor]) -> None:
        """Write full values (original names) back into the module, in place."""


class _PartialView:
    """:class:`SlicedParameters` for any ``nn.Module`` via :mod:`gradshard.plans.partial_update.runtime`."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def parameter_slices(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        return partial.parameter_slices(self.module)

    def full_parameters(self, names: Iterable[str] | None = None) -> dict[str, Tensor]:
        return partial.full_parameters(self.module, names)

    def load_full_parameters(self, params: Mapping[str, Tensor]) -> None:
        partial.load_full_parameters(self.module, params)


def _view_of(module: nn.Module) -> SlicedParameters:
    if all(callable(getattr(module, m, None)) for m in ("parameter_slices", "full_parameters", "load_full_parameters")):
        return module  # type: ignore[return-value]
    return _PartialView(module)


def trained_masks(
    module: nn.Module, view: SlicedParameters | None = None, full: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """This rank's trained entries of every full parameter, as boolean masks.

    A mask broadcasts against its parameter: a parameter sliced along one dim gets shape
    ``[1, .., size(dim), .., 1]``; an unsliced one ``[1] * ndim`` (all or nothing, by the
    ``requires_grad`` of the live tensor that ``full_parameters()`` returns for it). A slice
    counts as trained when its slice parameter requires grad.
    """
    view = view or _view_of(module)
    full = full if full is not None else view.full_parameters()
    params = dict(module.named_parameters())
    ranges: dict[str, list[tuple[int, int, int, bool]]] = {}
    for slice_name, (orig, (d, lo, hi)) in view.parameter_slices().items():
        if slice_name not in params:
            raise DiLoCoError(
                f"parameter_slices() names `{slice_name}`, which is not in named_parameters(); "
                f"slice names must be parameter names of the module"
            )
        ranges.setdefault(orig, []).append((d, lo, hi, params[slice_name].requires_grad))
    masks: dict[str, Tensor] = {}
    for name, value in full.items():
        if name in ranges:
            dims = {d for d, *_ in ranges[name]}
            if len(dims) == 1:
                (d,) = dims
                shape = [1] * value.dim()
                shape[d] = value.shape[d]
            else:
                shape = list(value.shape)
            mask = torch.zeros(shape, dtype=torch.bool, device=value.device)
            for d, lo, hi, trained in ranges[name]:
                if trained:
                    mask.narrow(d, lo, hi - lo).fill_(True)
        else:
            mask = torch.full([1] * value.dim(), value.requires_grad, device=value.device)
        masks[name] = mask
    return masks


def due_fragment(step: int, sync_every: int, num_fragments: int) -> int | None:
    """The fragment synchronised after inner step ``step`` (1-based), or None (see module doc)."""
    period = sync_every // num_fragments
    if step <= 0 or step % period:
        return None
    return (step // period - 1) % num_fragments


def _layer_key(name: str) -> str | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def make_fragments(
    numels: Mapping[str, int],
    fragments: int | Sequence[Sequence[str]],
    pattern: Literal["strided", "sequential"] = "strided",
) -> list[list[str]]:
    """Partition parameter names (in module order) into streaming fragments of whole layers."""
    names = list(numels)
    if not isinstance(fragments, int):
        groups = [list(g) for g in fragments]
        flat = [n for g in groups for n in g]
        unknown = sorted(set(flat) - set(names))
        missing = [n for n in names if n not in set(flat)]
        dup = sorted({n for n in flat if flat.count(n) > 1})
        if unknown or missing or dup or any(not g for g in groups):
            raise DiLoCoError(
                "explicit fragments must partition the full parameter names into non-empty "
                f"groups: unknown={unknown[:5]}, missing={missing[:5]}, duplicated={dup[:5]}"
            )
        return groups
    if fragments < 1:
        raise DiLoCoError(f"fragments must be >= 1, got {fragments}")
    if fragments == 1:
        return [names]
    blocks: dict[str, list[str]] = {}
    rest: list[str] = []
    for n in names:
        key = _layer_key(n)
        (blocks.setdefault(key, []) if key is not None else rest).append(n)
    layers = list(blocks.values())
    if len(layers) < fragments:
        raise DiLoCoError(
            f"fragments={fragments} but the model has only {len(layers)} layer(s) (names with a "
            f"numeric component such as `layers.3.`); use fewer fragments or pass explicit "
            f"fragments=[[names...], ...]"
        )
    groups: list[list[str]] = [[] for _ in range(fragments)]
    if pattern == "strided":
        for i, block in enumerate(layers):
            groups[i % fragments].extend(block)
    elif pattern == "sequential":
        bounds = partial.even_bounds(len(layers), fragments)
        for f in range(fragments):
            for block in layers[bounds[f] : bounds[f + 1]]:
                groups[f].extend(block)
    else:
        raise DiLoCoError(f"fragment pattern must be 'strided' or 'sequential', got {pattern!r}")
    if rest:
        sizes = [sum(numels[n] for n in g) for g in groups]
        groups[sizes.index(min(sizes))].extend(rest)
    order = {n: i for i, n in enumerate(names)}
    return [sorted(g, key=order.__getitem__) for g in groups]


class _Comm:
    """Timed all-reduce over a ProcessGroup object, the default world (group None), or nothing.

    Goes through :class:`gradshard.runtime.comm.Communicator`, so the bytes show up in a
    :class:`~gradshard.runtime.comm.CommCounter` under labels ``diloco.*``.
    """

    def __init__(self, group: Any | None, timeout_s: float) -> None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.comm = Communicator(group, timeout_s) if group is not None else None
        self.rank = self.comm.rank if self.comm else 0
        self.size = self.comm.world_size if self.comm else 1

    def allreduce(self, t: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, label: str = "diloco") -> None:
        if self.comm is None or self.size == 1:
            return
        try:
            self.comm.all_reduce(t, label=label, op=op)
        except CommError as exc:
            raise DiLoCoError(
                f"{exc}\nDiLoCo: every rank must construct the outer loop and call step() the "
                f"same number of times; a rank that stopped early or crashed leaves the others "
                f"waiting in `{label}` until the timeout"
            ) from exc


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _tensor_bytes(t: Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class PartialDiLoCo:
    """The outer loop: H inner steps, masked delta all-reduce, count average, outer Nesterov.

    ``module``: any ``nn.Module`` (see :class:`SlicedParameters`); every rank must hold the
    same full parameters at construction (checked: a clear error names the first differing
    parameter). ``inner_optimizer`` optimises the module's trainable parameters (slices).
    ``group``: a ProcessGroup object (its own ``allreduce`` is used, so unregistered groups
    work), or None for the default world (single-process when torch.distributed is not
    initialised). ``count_vector``: ``{original_name: counts}`` broadcastable to each full
    parameter; computed by an all-reduce of the trained masks when None. Global parameters,
    counts and the outer momentum live on ``outer_device`` in at least float32.

    Call :meth:`step` after each backward: it runs the inner optimizer step, clears the
    gradients, and synchronises when a fragment is due (returning its index).
    """

    def __init__(
        self,
        module: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_every: int = 100,
        group: Any | None = None,
        fragments: int | Sequence[Sequence[str]] = 1,
        count_vector: Mapping[str, Tensor] | None = None,
        outer_device: str | torch.device = "cpu",
        nesterov: bool = True,
        fragment_pattern: Literal["strided", "sequential"] = "strided",
        timeout_s: float = 300.0,
    ) -> None:
        if sync_every < 1:
            raise DiLoCoError(f"sync_every must be >= 1, got {sync_every}")
        self.module, self.inner_optimizer = module, inner_optimizer
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), nesterov
        self.sync_every = int(sync_every)
        self.outer_device = torch.device(outer_device)
        self._comm = _Comm(group, timeout_s)
        self._view = _view_of(module)

        full = {n: v for n, v in self._view.full_parameters().items() if v.is_floating_point()}
        self._masks = trained_masks(module, self._view, full)
        self.fragments = make_fragments({n: v.numel() for n, v in full.items()}, fragments, fragment_pattern)
        if self.sync_every % len(self.fragments):
            raise DiLoCoError(
                f"sync_every={sync_every} must be a multiple of the number of fragments "
                f"({len(self.fragments)}) so that fragment syncs are evenly staggered"
            )
        self._check_identical(full)
        self._counts = self._count_vector(full, count_vector)
        self._global = {n: v.detach().to(self.outer_device, self._outer_dtype(v), copy=True) for n, v in full.items()}
        self._momentum = {n: torch.zeros_like(g) for n, g in self._global.items()}
        self.inner_steps = 0
        self.fragment_syncs = [0] * len(self.fragments)

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.size

    @property
    def counts(self) -> dict[str, Tensor]:
        """``{original_name: m}``: how many ranks train each entry (broadcastable)."""
        return dict(self._counts)

    @property
    def global_parameters(self) -> dict[str, Tensor]:
        """The outer (global) parameters as of each fragment's last sync."""
        return dict(self._global)

    @property
    def masks(self) -> dict[str, Tensor]:
        """This rank's trained entries (see :func:`trained_masks`)."""
        return dict(self._masks)

    @staticmethod
    def _outer_dtype(v: Tensor) -> torch.dtype:
        return torch.promote_types(v.dtype, torch.float32)

    # ------------------------------------------------------------------ construction checks

    def _check_identical(self, full: Mapping[str, Tensor]) -> None:
        structure = repr(
            [(n, tuple(v.shape), str(v.dtype), tuple(self._masks[n].shape)) for n, v in full.items()]
            + [len(self.fragments)]
        )
        hashes = [_hash64(structure.encode())] + [_hash64(_tensor_bytes(v)) for v in full.values()]
        device = next(iter(full.values())).device if full else torch.device("cpu")
        lo = torch.tensor(hashes, dtype=torch.int64, device=device)
        hi = lo.clone()
        n_max = torch.tensor([len(hashes)], device=device)
        n_min = n_max.clone()
        self._comm.allreduce(n_max, dist.ReduceOp.MAX, "diloco.parameter_count")
        self._comm.allreduce(n_min, dist.ReduceOp.MIN, "diloco.parameter_count")
        if n_max.item() != n_min.item():
            raise DiLoCoError(
                f"rank {self.rank}: replicas have different numbers of parameters "
                f"({n_min.item() - 1} to {n_max.item() - 1}); every rank must build the same model"
            )
        self._comm.allreduce(lo, dist.ReduceOp.MIN, "diloco.parameter_hashes")
        self._comm.allreduce(hi, dist.ReduceOp.MAX, "diloco.parameter_hashes")
        differ = (lo != hi).nonzero().flatten().tolist()
        if not differ:
            return
        if differ[0] == 0:
            raise DiLoCoError(
                f"rank {self.rank}: replicas differ in structure (parameter names, shapes, "
                f"dtypes, slicing dims or fragment count); every rank must build the same model "
                f"with the same partial-update options (only slice_index may differ)"
            )
        names = list(full)
        first = names[differ[0] - 1]
        raise DiLoCoError(
            f"rank {self.rank}: replicas are not identical at start: parameter `{first}` differs "
            f"between ranks ({len(differ)} of {len(names)} parameters differ). The outer loop "
            f"needs every rank to start from the same parameters: seed identically "
            f"(torch.manual_seed before building the model) or load the same checkpoint on "
            f"every rank before constructing {type(self).__name__}"
        )

    def _count_vector(
        self, full: Mapping[str, Tensor], given: Mapping[str, Tensor] | None
    ) -> dict[str, Tensor]:
        if given is None:
            dtype = torch.float64
            flat = torch.cat([m.reshape(-1).to(dtype) for m in self._masks.values()]) if full else torch.zeros(0)
            self._comm.allreduce(flat, dist.ReduceOp.SUM, "diloco.count_vector")
            counts, pos = {}, 0
            for n, m in self._masks.items():
                counts[n] = flat[pos : pos + m.numel()].view(m.shape).to(self.outer_device, self._outer_dtype(full[n]))
                pos += m.numel()
            return counts
        missing = [n for n in full if n not in given]
        if missing:
            raise DiLoCoError(f"count_vector lacks entries for {missing[:5]} (needs every full parameter)")
        counts = {}
        for n, v in full.items():
            c = torch.as_tensor(given[n]).to(self.outer_device, self._outer_dtype(v))
            try:
                ok = torch.broadcast_shapes(c.shape, v.shape) == v.shape
            except RuntimeError:
                ok = False
            if not ok:
                raise DiLoCoError(f"count_vector[`{n}`] of shape {tuple(c.shape)} does not broadcast to {tuple(v.shape)}")
            if bool(((c < 1) & self._masks[n].to(c.device)).any()):
                raise DiLoCoError(
                    f"count_vector[`{n}`] is < 1 on entries this rank (rank {self.rank}) trains; "
                    f"m[i] counts the ranks that train entry i, including this one"
                )
            counts[n] = c
        return counts

    # ------------------------------------------------------------------ the loop

    def step(self) -> int | None:
        """Inner optimizer step + zero_grad; then sync the due fragment. Returns it, or None."""
        self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.inner_steps += 1
        f = due_fragment(self.inner_steps, self.sync_every, len(self.fragments))
        if f is not None:
            self.sync(f)
        return f

    @torch.no_grad()
    def sync(self, fragment: int = 0) -> None:
        """Synchronise one fragment now (collective: every rank must call it together)."""
        names = self.fragments[fragment]
        local = self._view.full_parameters(names)
        deltas = []
        for n in names:
            v, g = local[n], self._global[n]
            d = g.to(v.device) - v.to(g.dtype)
            deltas.append(torch.where(self._masks[n], d, torch.zeros((), dtype=d.dtype, device=d.device)))
        flat = torch.cat([d.reshape(-1) for d in deltas])
        self._comm.allreduce(flat, dist.ReduceOp.SUM, f"diloco.fragment{fragment}")
        new: dict[str, Tensor] = {}
        pos = 0
        for n in names:
            g, buf, cnt = self._global[n], self._momentum[n], self._counts[n]
            d = flat[pos : pos + g.numel()].view(g.shape).to(self.outer_device)
            pos += g.numel()
            avg = torch.where(cnt > 0, d / cnt.clamp_min(1), torch.zeros((), dtype=d.dtype, device=d.device))
            buf.mul_(self.outer_momentum).add_(avg)
            update = avg.add(buf, alpha=self.outer_momentum) if self.nesterov else buf
            g.sub_(update, alpha=self.outer_lr)
            new[n] = g.to(local[n].device, local[n].dtype)
        self._view.load_full_parameters(new)
        self.fragment_syncs[fragment] += 1

    # ------------------------------------------------------------------ checkpoints

    def _config(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "fragments": [list(f) for f in self.fragments],
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
        }

    def state_dict(self, *, include_rng: bool = True) -> dict[str, Any]:
        """The whole training state of this rank (tensors are references, like nn.Module's)."""
        state: dict[str, Any] = {
            "format": _FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self._config(),
            "module": self.module.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "global": dict(self._global),
            "momentum": dict(self._momentum),
            "counts": dict(self._counts),
            "inner_steps": self.inner_steps,
            "fragment_syncs": list(self.fragment_syncs),
        }
        if include_rng:
            state["rng"] = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any], *, restore_rng: bool = True) -> None:
        """Restore :meth:`state_dict`; refuses a checkpoint of another rank or configuration."""
        self._check_state(state)
        self._apply_state(state, restore_rng)

    def _check_state(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`DiLoCoError` unless ``state`` is this rank's, with this configuration."""
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        if found != _FORMAT:
            raise DiLoCoError(f"not a {_FORMAT} checkpoint (format={found!r})")
        for key, mine in (("rank", self.rank), ("world_size", self.world_size)):
            if state[key] != mine:
                raise DiLoCoError(
                    f"checkpoint was written by {key}={state[key]}, this process has {key}={mine}; "
                    f"each rank must load its own checkpoint with the same world size"
                )
        config = self._config()
        for key, mine in config.items():
            if state["config"][key] != mine:
                raise DiLoCoError(
                    f"checkpoint config `{key}`={state['config'][key]!r} differs from this run's {mine!r}"
                )
        for n, c in self._counts.items():
            if not torch.equal(state["counts"][n].to(c.device, c.dtype), c):
                raise DiLoCoError(
                    f"checkpoint count vector differs for `{n}`: it was written with a different "
                    f"slicing (num_slices / slice assignment) or world"
                )

    def _apply_state(self, state: Mapping[str, Any], restore_rng: bool) -> None:
        self.module.load_state_dict(state["module"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        for n in self._global:
            self._global[n].copy_(state["global"][n])
            self._momentum[n].copy_(state["momentum"][n])
        self.inner_steps = int(state["inner_steps"])
        self.fragment_syncs = list(state["fragment_syncs"])
        if restore_rng and "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            if "cuda" in state["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def _path(self, path: str | os.PathLike) -> str:
        return str(path).replace("{rank}", str(self.rank))

    def save(self, path: str | os.PathLike) -> str:
        """Write :meth:`state_dict` with checksums, durably and atomically; returns the path.

        ``{rank}`` in ``path`` becomes this rank. Collective when the group has several
        ranks: each rank writes and fsyncs a temp file, then all ranks check that they saved
        the same step and the same replicated outer state (global parameters and outer
        momentum); only then does each rename its file over ``path``. On disagreement every
        rank raises :class:`CheckpointError` and the previous checkpoints stay in place.
        """
        target = self._path(path)
        try:
            pending = write_checkpoint(self.state_dict(), target)
        except Exception:
            self._report_failure("save", target)
            raise
        try:
            self._agree("save", target, self.inner_steps, _replicated_digest(pending.checksums))
        except BaseException:
            pending.discard()
            raise
        pending.commit()
        return target

    @torch.no_grad()
    def load(self, path: str | os.PathLike) -> None:
        """Load and verify a checkpoint written by :meth:`save` (``{rank}`` becomes this rank).

        Raises :class:`CheckpointError` for a damaged, truncated or foreign file, and (when
        the group has several ranks, collectively) when the ranks' files hold different
        steps or replicated outer states; nothing is loaded then.
        """
        target = self._path(path)
        try:
            ckpt = read_checkpoint(target)
            self._check_state(ckpt.payload)
        except Exception:
            self._report_failure("load", target)
            raise
        state = ckpt.payload
        self._agree("load", target, int(state["inner_steps"]), _replicated_digest(ckpt.checksums))
        self._apply_state(state, restore_rng=True)

    # ------------------------------------------------------------------ rank agreement

    def _report_failure(self, action: str, path: str) -> None:
        """Take part in :meth:`_agree` as a failed rank, so the others fail fast, not by timeout.

        Its own CheckpointError ("rank r could not ...") is dropped: the caller re-raises the
        original error, which says what went wrong here.
        """
        try:
            self._agree(action, path, -1, 0)
        except CheckpointError:
            pass

    def _agree(self, action: str, path: str, step: int, digest: int) -> None:
        """All ranks exchange (step, replicated-state digest) with a timeout; raise unless equal.

        ``step = -1`` marks a rank whose own save or load failed.
        """
        if self._comm.comm is None or self.world_size == 1:
            return
        device = next(iter(self._masks.values())).device if self._masks else torch.device("cpu")
        table = torch.zeros(2, self.world_size, dtype=torch.int64, device=device)
        table[0, self.rank], table[1, self.rank] = step, digest
        try:
            self._comm.comm.all_reduce(table, label="diloco.checkpoint", op=dist.ReduceOp.SUM)
        except CommError as exc:
            raise CheckpointError(
                f"{exc}\nDiLoCo.{action}({path}): every rank must call {action}() at the same "
                f"point; a rank that did not (or crashed) leaves the others waiting. This rank's "
                f"checkpoint was not {'replaced' if action == 'save' else 'loaded'}."
            ) from exc
        steps, digests = table.tolist()
        done = "the previous checkpoint files were kept" if action == "save" else "nothing was loaded"
        failed = [r for r, s in enumerate(steps) if s == -1]
        if failed:
            raise CheckpointError(
                f"rank {self.rank}: rank(s) {failed} could not {action} their checkpoint (see "
                f"their errors); {done} (this rank: {path})"
            )
        if len(set(steps)) > 1:
            seen = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
            raise CheckpointError(
                f"rank {self.rank}: the ranks' checkpoints are from different inner steps ({seen}); "
                f"{done} (this rank: {path}). Every rank must call {action}() after the same "
                f"step()" + ("" if action == "save" else
                             ", and load the checkpoint files of one save (a crash between the "
                             "ranks' renames leaves a mixed set: use an earlier checkpoint)")
            )
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise CheckpointError(
                f"rank {self.rank}: at step {steps[0]} the replicated outer state (global "
                f"parameters and outer momentum) of rank(s) {differ} differs from rank 0's; "
                f"{done} (this rank: {path}). The replicas have diverged or the files come from "
                f"different runs: resume every rank from one earlier, consistent checkpoint set."
            )


def _replicated_digest(checksums: Checksums) -> int:
    """64-bit digest of the state every rank holds identically (from the tensor checksums)."""
    h = hashlib.blake2b(digest_size=8)
    for key, digest in checksums:
        if key.split("/", 1)[0] in ("global", "momentum"):
            h.update(f"{key}={digest};".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


DiLoCo = PartialDiLoCo
