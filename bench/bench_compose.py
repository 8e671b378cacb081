"""Benchmark gradshard composed with Inductor (issue 19) against eager and ``torch.compile``.

For each model (the example selective SSM, a log-space minGRU LM, the example Llama, a
``transformers`` Llama and Mamba-2 built from config) and each
length T, one training step (forward, cross-entropy outside the model, backward) is measured
with ``gs.measure`` after a warm-up step that captures and compiles:

- ``eager``: the model as written;
- ``ckpt``: the model as written with per-layer activation checkpointing: each block of its layer
  list under ``torch.utils.checkpoint`` (non-reentrant), ``activation_checkpointing_enable()`` for
  the ``transformers`` model;
- ``compile``: ``torch.compile(model)`` (Inductor, static shapes);
- ``compile_budget``: the same with ``torch._functorch.config.activation_memory_budget=0.1``
  (AOTAutograd's partitioner recomputes activations to fit 10% of the saved bytes);
- ``gs_none`` / ``gs_adjoint`` / ``gs_seco``: ``gs.compile(model, plan=..., inductor=True)``:
  the segments the plan does not rewrite compiled by Inductor, and inside the regions what they
  run per shard or chunk (adjoint: producer/readout/tail graphs; seco: runs of local nodes, with
  each chunk's attention output kept for its backward);
- ``gs_adjoint_eager`` / ``gs_seco_eager``: the same plans with ``inductor=False`` (what ran before);
- ``gs_truncated`` / ``gs_spaco`` / ``gs_partial`` (named with ``--methods``): plans
  ``truncated_adjoint`` (window 1024), ``spaco`` (budget 8 chunks) and ``partial_update`` (a quarter
  of the MLP and attention projections per step), with Inductor;
- ``gs_adjoint_recompute``: ``gs_adjoint`` with ``recompute_layer_inputs=True`` (every other layer's
  input recomputed from the layer before it, not kept);
- ``backend_none`` / ``backend_adjoint`` / ``backend_seco``:
  ``torch.compile(model, backend=gs.backend(plan=...))``.

Adjoint rows run on the recurrent models, partial-update rows on the attention ones, seco and
spaco rows on every model. Peak memory is the allocator's peak during the step above what was
live before it (``gs.measure``'s ``allocator_peak_bytes``: on CPU from ``torch.profiler`` memory events, the same instrument for
every row since the process compiles before the first measurement; on CUDA the CUDA caching
allocator's ``max_memory_allocated``); time is the median of ``--repeat`` plain steps after the
measured one (synchronized on CUDA). Writes "## Composing with Inductor (issue 19)" (CPU) or
"## Composing with Inductor on GPU (issue 19)" (``--device cuda``) in ``RESULTS.md`` (``bench/``
in a checkout, the current folder for an installed gradshard).

    python bench/bench_compose.py --quick             # T=1K,4K, one timed step per point
    python bench/bench_compose.py --seq-lens 1k,4k,8k --repeat 3
    python bench/bench_compose.py --models mingru --methods compile,gs_adjoint --no-write
    python bench/bench_compose.py --device cuda --seq-lens 4k,16k --repeat 10
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the shared RESULTS.md writer

import gradshard as gs  # noqa: E402
from gradshard.examples import factories  # noqa: E402
from gradshard.units import format_bytes  # noqa: E402
from results_md import OUTPUT_DIR, RESULTS, write_section  # noqa: E402

HEADING = "## Composing with Inductor (issue 19)"
HEADING_GPU = "## Composing with Inductor on GPU (issue 19)"
MODELS = ("ssm", "mingru", "llama", "llama_mqa", "hf_llama", "hf_mamba2")
RECURRENT = ("ssm", "mingru", "hf_mamba2")  # adjoint rows (seco and spaco rows on every model)
METHODS = ("eager", "ckpt", "compile", "compile_budget", "gs_none", "gs_adjoint", "gs_adjoint_eager",
           "gs_adjoint_recompute", "gs_truncated", "gs_seco", "gs_seco_eager", "gs_spaco", "gs_partial",
           "backend_none", "backend_adjoint", "backend_seco")
#: the rows of a plain run: every method but the plans' extra variants, which ``--methods`` names
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("gs_truncated", "gs_spaco", "gs_partial"))
#: gs_<name> -> plan, for the plans whose method name is not the plan's
PLAN_OF = {"gs_truncated": "truncated_adjoint", "gs_partial": "partial_update"}


def parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


# --------------------------------------------------------------------------- models


def log_g(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


class MinGRU(nn.Module):
    """minGRU in log space (Feng et al., 2024), as its reference code writes it: Heinsen's scan."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(d, 2 * hidden, bias=False)
        self.to_out = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)
        log_values = -F.softplus(-gate) + log_g(hidden)
        a_star = log_coeffs.cumsum(dim=1)
        log_h = a_star + (log_values - a_star).logcumsumexp(dim=1)
        return self.to_out(log_h.exp())


class MinGRULM(nn.Module):
    """Embedding, ``layers`` x (RMSNorm, minGRU, residual), RMSNorm, LM head."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 4, expansion: float = 1.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.RMSNorm(d, eps=1e-6) for _ in range(layers))
        self.layers = nn.ModuleList(MinGRU(d, int(d * expansion)) for _ in range(layers))
        self.norm_f = nn.RMSNorm(d, eps=1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.lm_head(self.norm_f(x))


class LogitsOf(nn.Module):
    """A ``transformers`` causal LM called as ``model(ids) -> logits`` (the bench's step convention)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def hf_llama() -> nn.Module:
    """A random-weight ``transformers`` LlamaForCausalLM the size of the example Llama."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:  # the dev extra pins it; the wheel does not need it otherwise
        raise SystemExit("bench_compose --models hf_llama needs `transformers` (pip install gradshard[dev])") from exc
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return LogitsOf(LlamaForCausalLM(config))


def hf_mamba2() -> nn.Module:
    """A random-weight ``transformers`` Mamba2ForCausalLM: d=64, 4 layers, 8 heads of 16, N=16."""
    try:
        from transformers import Mamba2Config, Mamba2ForCausalLM
    except ImportError as exc:
        raise SystemExit("bench_compose --models hf_mamba2 needs `transformers` (pip install gradshard[dev])") from exc
    config = Mamba2Config(vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16,
                          n_groups=1, conv_kernel=4, chunk_size=64, num_hidden_layers=4, use_cache=False)
    torch.manual_seed(0)
    return LogitsOf(Mamba2ForCausalLM(config))


class WithLoss(nn.Module):
    """``model`` with its cross-entropy inside: ``transformers``' own ``labels=`` loss (logits cast
    to float32, labels shifted inside) for a :class:`LogitsOf`, else the next-token cross-entropy
    of the logits against ``labels`` (the ids rolled by one)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, LogitsOf):  # transformers shifts the labels itself: pass the ids
            return self.model.model(input_ids=ids, labels=ids).loss
        logits = self.model(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_model(name: str, T: int, batch: int) -> tuple[nn.Module, torch.Tensor, str]:
    """The model, a batch of token ids, and a description for the table's caption."""
    if name == "hf_llama":
        ids = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(T))
        return hf_llama(), ids, ("`transformers` LlamaForCausalLM from config: d=64, 4 layers, 4 heads (2 KV), "
                                 "SDPA, called as `model(input_ids=ids).logits`")
    if name == "hf_mamba2":
        ids = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(T))
        return hf_mamba2(), ids, ("`transformers` Mamba2ForCausalLM from config: d=64, 4 layers, 8 heads of 16, "
                                  "N=16, SSD chunk 64 (its torch path)")
    if name == "ssm":
        model, (ids,) = factories.ssm(d_model=64, n_layers=4, d_state=16, seq_len=T, batch=batch)
        return model, ids, "example selective SSM (`factories.ssm`): d=64, N=16, 4 layers, log-space cumsum scan"
    if name == "llama":
        model, (ids,) = factories.llama(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=172,
                                        seq_len=T, batch=batch)
        return model, ids, "example Llama (`factories.llama`): d=64, 4 layers, 4 heads (2 KV), SDPA, RoPE"
    if name == "llama_mqa":
        model, (ids,) = factories.llama(d_model=64, n_layers=4, n_heads=4, n_kv_heads=1, intermediate_size=172,
                                        seq_len=T, batch=batch)
        return model, ids, "example Llama with one KV head (multi-query): d=64, 4 layers, 4 heads, SDPA, RoPE"
    if name == "mingru":
        torch.manual_seed(0)
        model = MinGRULM()
        ids = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(T))
        return model, ids, "log-space minGRU LM (in this script): d=64, hidden 96, 4 layers, Heinsen scan"
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# --------------------------------------------------------------------------- methods


def applies(method: str, model: str) -> bool:
    """The adjoint plans run on the recurrent models, partial updates (which slice MLP and attention
    projections) on the attention models, seco and spaco on every model."""
    if "adjoint" in method or method == "gs_truncated":
        return model in RECURRENT
    if method == "gs_partial":
        return model not in RECURRENT
    return True


class Checkpointed(nn.Module):
    """``block`` under ``torch.utils.checkpoint``: its inputs are saved, its activations recomputed in backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """``model`` (changed in place) with per-layer activation checkpointing: a ``transformers`` model
    through its ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before 5.x),
    any other model by wrapping every block of its layer list (the ``nn.ModuleList`` holding the most
    parameters) in :class:`Checkpointed`."""
    hf = [m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")]
    if hf:
        if hasattr(hf[0], "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            hf[0].activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf[0].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"ckpt: {type(model).__name__} has no nn.ModuleList of layers to checkpoint; "
                         "wrap its blocks in Checkpointed yourself")
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    for i, block in enumerate(layers):
        layers[i] = Checkpointed(block)
    return model


def runner(method: str, model: nn.Module, *, shard: int, chunk: int) -> tuple[Callable[..., Any], str]:
    """``(run, label)`` for ``method``; ``run(ids) -> logits``."""
    opts = {"adjoint": {"shard_size": shard}, "truncated_adjoint": {"shard_size": shard, "window": 1024},
            "seco": {"chunk_size": chunk}, "spaco": {"chunk_size": chunk}, "none": {}, "partial_update": {}}
    if method == "eager":
        return model, "eager"
    if method == "ckpt":
        return checkpoint_layers(model), "eager, per-layer checkpointing"
    if method in ("compile", "compile_budget"):
        label = "torch.compile" + (" (activation_memory_budget=0.1)" if method == "compile_budget" else "")
        return torch.compile(model, dynamic=False), label
    if method == "gs_adjoint_recompute":
        return (gs.compile(model, plan="adjoint", inductor=True, recompute_layer_inputs=True, **opts["adjoint"]),
                "gs.compile(plan='adjoint', inductor=True, recompute_layer_inputs=True)")
    if method.startswith("gs_"):
        plan = PLAN_OF.get(method, method.split("_")[1])
        inductor = not method.endswith("_eager")
        return (gs.compile(model, plan=plan, inductor=inductor, **opts[plan]),
                f"gs.compile(plan={plan!r}, inductor={inductor})")
    if method.startswith("backend_"):
        plan = method.split("_")[1]
        return (torch.compile(model, backend=gs.backend(plan=plan, **opts[plan]), dynamic=False),
                f"torch.compile(backend=gs.backend(plan={plan!r}))")
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def warm_up_inductor(device: torch.device) -> None:
    """Compile something tiny first: Inductor's one-time start-up is not charged to a row, and
    ``gs.measure`` traces the CPU allocator for every row (it does once anything has compiled)."""
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), dynamic=False)
    fn(torch.randn(8, requires_grad=True, device=device)).backward()
    torch._dynamo.reset()


def measure_one(model_name: str, method: str, T: int, batch: int, shard: int, chunk: int, repeat: int,
                device: torch.device = torch.device("cpu"), loss_inside: bool = False) -> dict:
    torch._dynamo.reset()  # every torch.compile row compiles afresh, under its own config
    model, ids, desc = make_model(model_name, T, batch)
    if loss_inside:
        model, desc = WithLoss(model), desc + "; the cross-entropy inside the compiled module"
    model, ids = model.to(device), ids.to(device)
    run, label = runner(method, model, shard=shard, chunk=chunk)
    labels = torch.roll(ids, -1, 1)

    def step(ids: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        if loss_inside:
            run(ids, labels).backward()
            return
        logits = run(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()

    budget = 0.1 if method == "compile_budget" else 1.0
    with torch._functorch.config.patch(activation_memory_budget=budget):
        t0 = time.perf_counter()
        step(ids)  # warm-up: capture and compile (forward and backward) happen here
        first = time.perf_counter() - t0
        m = gs.measure(step, ids, repeat=repeat)
    peak = m.allocator_peak_bytes if m.allocator_peak_bytes is not None else m.peak_bytes
    source = m.peak_source if device.type == "cuda" or m.allocator_peak_bytes is None else "cpu_allocator"
    out = {"model": model_name, "model_desc": desc, "method": method, "label": label, "T": T, "batch": batch,
           "device": device.type, "peak": peak,
           "peak_source": source, "seconds": m.seconds, "first_call_s": first,
           "compiled_runs": m.compiled_regions}
    return out


# --------------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    base = {(r["model"], r["T"]): r for r in rows if r["method"] == "compile"}
    lines = ["| model | T | method | step time | time / torch.compile | peak memory | peak / torch.compile | "
             "first call (compile) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get((r["model"], r["T"]))
        rt = f"{r['seconds'] / b['seconds']:.2f}x" if b and b["seconds"] and r["seconds"] else "-"
        rm = f"{r['peak'] / b['peak']:.2f}x" if b and b["peak"] and r["peak"] else "-"
        lines.append(f"| {r['model']} | {r['T']} | {r['label']} | {r['seconds']:.3f} s | {rt} | "
                     f"{format_bytes(r['peak'])} | {rm} | {r['first_call_s']:.0f} s |")
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    """The device the rows ran on, for the table's caption."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} ({format_bytes(props.total_memory)}, CUDA {torch.version.cuda}), host "
                f"{cpu_name()}, torch {torch.__version__}")
    return (f"{cpu_name()}, {os.cpu_count()} cores shared with other jobs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1k,4k,8k")
    p.add_argument("--models", default=",".join(m for m in MODELS if m != "llama_mqa"),
                   help=f"any of {','.join(MODELS)} (llama_mqa: only when named)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {','.join(METHODS)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--quick", action="store_true", help="T=1K,4K and one timed step per point")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--notes", default="", help="text appended under the table")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--loss-inside", action="store_true",
                   help="compile the model with its cross-entropy (as transformers' labels=) instead of the logits")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.quick:
        args.seq_lens, args.repeat = "1k,4k", 1
    if args.threads:
        torch.set_num_threads(args.threads)
    lens = [parse_len(s) for s in args.seq_lens.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(METHODS)) + sorted(set(models) - set(MODELS))
    if bad:
        p.error(f"unknown method/model {bad}; methods: {METHODS}, models: {MODELS}")
    warm_up_inductor(device)
    rows: list[dict] = []
    descs: dict[str, str] = {}
    for model_name in models:
        for T in lens:
            for method in methods:
                if not applies(method, model_name):
                    continue
                r = measure_one(model_name, method, T, args.batch, args.shard_size, args.chunk_size, args.repeat,
                                device, loss_inside=args.loss_inside)
                gc.collect()  # the row's model and compiled code are garbage now
                descs[model_name] = r["model_desc"]
                rows.append(r)
                print(f"{model_name:7s} T={T:5d} {r['label']:55s} {r['seconds']:7.3f} s  peak "
                      f"{format_bytes(r['peak']):>10s} ({r['peak_source']})  first call {r['first_call_s']:.1f} s",
                      flush=True)
    if not args.no_write:
        raw = OUTPUT_DIR / "out" / f"bench_compose{'_' + device.type if device.type != 'cpu' else ''}.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(rows, indent=1))
    text = (
        "Models: " + "; ".join(f"{k}: {v}" for k, v in descs.items())
        + f". Batch {args.batch}, float32, vocab 256, cross-entropy "
        + ("inside" if args.loss_inside else "outside") + f" the model; adjoint shard "
        f"{args.shard_size}, seco chunk {args.chunk_size}. Machine: {machine(device)}. Step time: median of "
        f"{args.repeat} step(s) after a warm-up step and one measured step"
        + (" (noisy on this shared machine); peak: the CPU allocator's peak during the step above what was live "
           "before it (`gs.measure`, `allocator_peak_bytes`: torch.profiler memory events, the same instrument "
           "for every row); first call: " if device.type == "cpu" else
           ", synchronized; peak: the CUDA caching allocator's `max_memory_allocated` during the step above what "
           "was allocated before it (`gs.measure`); first call: ")
        + "capture + plan + Inductor compile of the forward and backward (Inductor's on-disk caches were warm "
        "for kernels seen before). Ratios are to plain `torch.compile` at the same model and T.\n\n"
        + table(rows)
        + (f"\n\n{args.notes}" if args.notes else "")
    )
    print(text)
    if not args.no_write:
        write_section(HEADING if device.type == "cpu" else HEADING_GPU, text, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
