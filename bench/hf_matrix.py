"""The Hugging Face model matrix: every zoo family x attention implementation x plan.

For each cell, a tiny float64 model from ``tests/hf/zoo.py`` is compiled with
``gs.compile(model, plan=plan, **opts)`` and called as its users call it,
``cm(input_ids=ids, labels=ids)`` at T=37 (not a multiple of 8), batch 2. The loss and the
parameter gradients (``torch.autograd.grad`` of the loss) are compared with eager autograd
on a deep copy of the model made before compiling. Each cell runs in a worker process
with a per-cell timeout; a worker that times out or dies is replaced.

Status of a cell:

- ``exact``: loss and gradient relative error <= 1e-10, or <= 1e-5 where the eager forward
  differentiates through float32 tensors (``zoo.float32_sites``: transformers' RMSNorm and
  softmax upcasts, Mamba/RWKV scans, ...; the cell's ``fp32`` field lists them);
- ``mismatch (err)``: it ran, but the numbers differ (or a gradient is missing);
- ``refused: <GradshardError subclass>: <first line>``: gradshard declined on purpose;
- ``CRASH: <type>: <first line> at <innermost project file:line>``: any other exception;
- ``TIMEOUT`` / ``CRASH: worker died``: the worker was killed or crashed;
- ``eager reference is not finite``: the eager loss or a gradient is NaN/inf (kind ``invalid``).

Relative errors: the loss ``|l - l_ref| / |l_ref|``; a gradient ``max|g - g_ref| /
max(max|g_ref|, 1e-6 * max over all parameters of max|g_ref|)``, the worst parameter named.

    python bench/hf_matrix.py --check                        # eager fwd+bwd of every family
    python bench/hf_matrix.py --plans none,seco --attn sdpa --json /tmp/m1.json
    python bench/hf_matrix.py --families llama,mamba --plans adjoint
    python bench/hf_matrix.py --cell mamba:eager:adjoint     # one cell, full traceback
    python bench/hf_matrix.py --report out.md --from-json /tmp/m1.json,/tmp/m2.json
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "tests" / "hf" / "zoo.py").is_file():
    raise SystemExit("hf_matrix builds its models from the test suite's zoo (tests/hf/zoo.py), which ships only "
                     "in a source checkout: run `python bench/hf_matrix.py` in a clone of the repository")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: plan -> options (T=37: the chunk/shard size 8 leaves a ragged last chunk).
PLAN_OPTIONS: dict[str, dict[str, Any]] = OrderedDict([
    ("none", {}),
    ("seco", {"chunk_size": 8}),
    ("spaco", {"chunk_size": 8, "budget": 1000}),  # budget >= chunks: keeps every chunk
    ("adjoint", {"shard_size": 8}),
    ("truncated_adjoint", {"window": 1000, "shard_size": 8}),  # window >= T: exact
    ("partial_update", {"num_slices": 2, "slice_index": 0}),
])

T_DEFAULT, BATCH_DEFAULT, TIMEOUT_S = 37, 2, 120.0
EXACT_TOL, FP32_TOL = 1e-10, 1e-5
_PROJECT_DIRS = ("gradshard", "passes", "kernels")


# --------------------------------------------------------------------------- one cell


def innermost_frame(exc: BaseException, dirs: tuple[str, ...] = _PROJECT_DIRS) -> str | None:
    """``path:line (function)`` of the innermost traceback frame under ROOT/<dirs>, or, if
    none, under ROOT (not the venv)."""
    frames = traceback.extract_tb(exc.__traceback__)
    venv = str(ROOT / ".venv")

    def pick(pred) -> str | None:
        for f in reversed(frames):
            if f.filename.startswith(str(ROOT)) and not f.filename.startswith(venv) and pred(f.filename):
                return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} ({f.name})"
        return None

    inside = pick(lambda fn: os.path.relpath(fn, ROOT).split(os.sep)[0] in dirs)
    return inside or pick(lambda fn: True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "").strip()[:200]


def _rel(a: Any, b: Any, floor: float) -> float:
    """``max|a - b| / max(max|b|, floor)``."""
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / max(b.abs().max().item() if b.numel() else 0.0, floor)


def run_cell(family: str, attn: str, plan: str, *, T: int = T_DEFAULT, batch: int = BATCH_DEFAULT,
             hf_loss: bool = False, mask: str = "none", frontend: str | None = None,
             experts: str = "batched_mm") -> dict[str, Any]:
    """Run one cell in this process; never raises (the exception is classified)."""
    import torch

    torch.set_num_threads(1)
    cell: dict[str, Any] = {"family": family, "attn": attn, "plan": plan, "T": T, "batch": batch,
                            "hf_loss": hf_loss, "mask": mask, "frontend": frontend, "experts": experts,
                            "phase": "build"}
    t0 = time.perf_counter()
    try:
        import gradshard as gs
        from tests.hf import zoo

        if family in zoo.UNAVAILABLE:
            cell.update(status=f"unavailable: {zoo.UNAVAILABLE[family]}", kind="unavailable")
            return cell
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, config = zoo.build(family, attn=attn, fp64_loss=not hf_loss, experts=experts)
            ref = copy.deepcopy(model)
            data = zoo.inputs(config, batch, T, mask=mask == "ones", pad=3 if mask == "pad3" else 0)
            call = {k: data[k] for k in ("input_ids", "attention_mask", "labels") if k in data}

            cell["phase"] = "eager"
            te = time.perf_counter()
            out_ref, sites = zoo.float32_sites(ref, **call)
            named_ref = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
            g_ref = torch.autograd.grad(out_ref.loss, [p for _, p in named_ref], allow_unused=True)
            cell["eager_s"] = round(time.perf_counter() - te, 4)
            ref_grads = {n: g for (n, _), g in zip(named_ref, g_ref) if g is not None}
            if not torch.isfinite(out_ref.loss) or not all(torch.isfinite(g).all() for g in ref_grads.values()):
                cell.update(kind="invalid", status="eager reference is not finite (NaN/inf): cell not comparable")
                return cell
            cell["fp32"] = sites
            tol = FP32_TOL if sites else EXACT_TOL

            cell["phase"] = "compile"
            tc = time.perf_counter()
            cm = gs.compile(model, plan=plan, **({"frontend": frontend} if frontend else {}), **PLAN_OPTIONS[plan])
            cell["phase"] = "forward"
            out = cm(**call)
            cell["forward_s"] = round(time.perf_counter() - tc, 4)
            loss = getattr(out, "loss", None)
            if loss is None:
                raise RuntimeError(f"compiled output {type(out).__name__} has no loss")

            cell["phase"] = "grads"
            by_id = {id(p): n for n, p in model.named_parameters()}
            if plan == "partial_update":
                sliced = {orig for orig, _ in cm.parameter_slices().values()}
                wrt = {by_id[id(p)]: p for _, p in cm.named_parameters()
                       if id(p) in by_id and by_id[id(p)] not in sliced and by_id[id(p)] in ref_grads}
                cell["slices"] = len(cm.parameter_slices())
            else:
                params = dict(model.named_parameters())
                wrt = {n: params[n] for n in ref_grads}
            cell["phase"] = "backward"
            tb = time.perf_counter()
            got = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True) if wrt else ()
            cell["backward_s"] = round(time.perf_counter() - tb, 4)
            # adjoint regions whose shards run chunked (plans/adjoint/chunked.py), not per-step scans
            cell["chunked_regions"] = sum(1 for m in cm.graph.modules() if getattr(m, "chunked", None) is not None)

        cell["phase"] = "compare"
        loss_err = _rel(loss.detach().double(), out_ref.loss.detach().double(), 1e-300)
        floor = 1e-6 * max((g.abs().max().item() for g in ref_grads.values()), default=0.0) or 1e-300
        worst, grad_err, missing = None, 0.0, []
        for (name, _), g in zip(wrt.items(), got):
            if g is None:
                missing.append(name)
                continue
            e = _rel(g.double(), ref_grads[name].double(), floor)
            if e > grad_err or worst is None:
                worst, grad_err = name, e
        cell.update(loss_err=loss_err, grad_err=grad_err, worst_param=worst,
                    compared=len(wrt) - len(missing), missing=missing[:5], n_missing=len(missing), tol=tol)
        err = max(loss_err, grad_err)
        if missing:
            cell.update(kind="mismatch", status=f"mismatch (no gradient for {len(missing)} params, "
                        f"e.g. {missing[0]}; err {err:.1e})")
        elif err <= tol:
            cell.update(kind="exact", status="exact")
        else:
            cell.update(kind="mismatch", status=f"mismatch ({err:.1e})")
    except Exception as exc:  # noqa: BLE001 - every failure is classified and reported
        _classify(cell, exc)
    finally:
        cell["seconds"] = round(time.perf_counter() - t0, 3)
    return cell


def _classify(cell: dict[str, Any], exc: BaseException) -> None:
    from gradshard.errors import GradshardError

    where = innermost_frame(exc)
    detail = next((ln.strip().replace(str(ROOT / ".venv") + "/lib/python3.11/site-packages/", "")
                   for ln in str(exc).splitlines()[1:] if ln.strip().startswith("at ")), None)
    cell.update(exc_type=type(exc).__name__, message=_first_line(exc), where=where, detail=detail,
                message_full="\n".join(str(exc).splitlines()[:8])[:2000],
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if isinstance(exc, GradshardError):
        cell.update(kind="refused", status=f"refused: {type(exc).__name__}: {_first_line(exc)}")
    else:
        cell.update(kind="crash", status=f"CRASH: {type(exc).__name__}: {_first_line(exc)} at {where}")


# --------------------------------------------------------------------------- workers


def _worker(conn: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        conn.send(run_cell(**task))


class Runner:
    """Runs cells one at a time in a worker process, replacing it after a timeout or death."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        self.proc = self.conn = None

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        base = {k: task.get(k) for k in ("family", "attn", "plan", "T", "batch", "hf_loss", "mask", "frontend",
                                           "experts")}
        try:
            self.conn.send(task)
            if self.conn.poll(self.timeout_s):
                return self.conn.recv()
            self._stop()
            return {**base, "kind": "timeout", "status": f"TIMEOUT (> {self.timeout_s:.0f} s)",
                    "seconds": round(time.perf_counter() - t0, 3)}
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self.proc.exitcode if self.proc is not None else None
            self._stop()
            return {**base, "kind": "crash", "status": f"CRASH: worker died (exit code {code})",
                    "exc_type": "WorkerDied", "message": f"exit code {code}", "where": None,
                    "seconds": round(time.perf_counter() - t0, 3)}

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
                self.proc.join(10)  # let the worker exit on its own before killing it
            except (BrokenPipeError, OSError):
                pass
        self._stop()


# --------------------------------------------------------------------------- eager check


def check_families(families: list[str], T: int, batch: int) -> list[dict[str, Any]]:
    """Eager forward+backward of every family/attn at (batch, T): time, loss, float32 sites."""
    import torch

    from tests.hf import zoo

    torch.set_num_threads(1)
    rows = []
    for fam in families:
        for attn in zoo.ATTN_IMPLS[fam]:
            row: dict[str, Any] = {"family": fam, "attn": attn}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, config = zoo.build(fam, attn=attn)
                    data = zoo.inputs(config, batch, T)
                    model(input_ids=data["input_ids"], labels=data["labels"])  # warm-up
                    t0 = time.perf_counter()
                    out = model(input_ids=data["input_ids"], labels=data["labels"])
                    out.loss.backward()
                    row["seconds"] = round(time.perf_counter() - t0, 4)
                    _, sites = zoo.float32_sites(model, input_ids=data["input_ids"], labels=data["labels"])
                n_params = sum(p.numel() for p in model.parameters())
                row.update(ok=True, loss=out.loss.detach().item(), loss_dtype=str(out.loss.dtype).replace("torch.", ""),
                           params=n_params, fp32=sites, recurrent=fam in zoo.RECURRENT)
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=f"{type(exc).__name__}: {_first_line(exc)}")
            rows.append(row)
    return rows


def print_check(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"eager forward+backward, T={T_DEFAULT}, batch {BATCH_DEFAULT}")
    for col in ("family", "attn", "ok", "ms", "params", "loss dtype", "recurrent", "float32 on grad path"):
        table.add_column(col)
    for r in rows:
        if r["ok"]:
            table.add_row(r["family"], r["attn"], "ok", f"{1000 * r['seconds']:.0f}", str(r["params"]),
                          r["loss_dtype"], "yes" if r["recurrent"] else "", ", ".join(r["fp32"]))
        else:
            table.add_row(r["family"], r["attn"], "[red]FAIL", "", "", "", "", r["error"])
    Console(width=200).print(table)


# --------------------------------------------------------------------------- tables, report


def _short(cell: dict[str, Any]) -> str:
    kind = cell.get("kind")
    if kind == "exact":
        err = max(cell.get("loss_err", 0.0), cell.get("grad_err", 0.0))
        return (f"exact {err:.0e}" + (" f32" if cell.get("fp32") else "")
                + (f" chunked {cell['chunked_regions']}" if cell.get("chunked_regions") else ""))
    if kind == "mismatch":
        return cell["status"].replace("mismatch ", "MISMATCH ")
    if kind == "refused":
        return f"refused {cell.get('exc_type')}"
    if kind == "crash":
        return f"CRASH {cell.get('exc_type')} @ {(cell.get('where') or '?').split(' ')[0]}"
    return cell.get("status", "?")


def _row_label(cell: dict[str, Any]) -> str:
    """The attn column: the impl, plus the mask/frontend/loss variant when not the default."""
    label = cell["attn"]
    if cell.get("mask", "none") != "none":
        label += f" mask={cell['mask']}"
    if cell.get("frontend"):
        label += f" fe={cell['frontend']}"
    if cell.get("hf_loss"):
        label += " hf-loss"
    if cell.get("experts", "batched_mm") != "batched_mm":
        label += f" experts={cell['experts']}"
    return label


def print_table(cells: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    plans = [p for p in PLAN_OPTIONS if any(c["plan"] == p for c in cells)]
    rows: dict[tuple[str, str], dict[str, dict]] = OrderedDict()
    for c in cells:
        rows.setdefault((c["family"], _row_label(c)), {})[c["plan"]] = c
    table = Table(title=f"gradshard x HF zoo (T={cells[0]['T']}, batch {cells[0]['batch']})")
    table.add_column("family")
    table.add_column("attn")
    for p in plans:
        table.add_column(p)
    colour = {"exact": "green", "mismatch": "red", "refused": "yellow", "crash": "magenta", "timeout": "magenta"}
    for (fam, attn), by_plan in rows.items():
        cols = []
        for p in plans:
            c = by_plan.get(p)
            cols.append("" if c is None else f"[{colour.get(c.get('kind'), 'white')}]{_short(c)}")
        table.add_row(fam, attn, *cols)
    Console(width=240).print(table)


def cause_key(cell: dict[str, Any]) -> str:
    """Cells that failed for the same reason share a key (kind, exception type, location)."""
    kind = cell.get("kind")
    if kind == "refused" and "no linear recurrence" in (cell.get("message") or ""):
        from tests.hf import zoo

        if cell["family"] in zoo.RECURRENT:
            return f"refused: {cell.get('exc_type')}: no linear recurrence found, but the family has one"
        return f"refused: {cell.get('exc_type')}: no linear recurrence found (expected: the family has none)"
    if kind == "refused":
        # capture.py raises every capture failure: the model's source line named in the
        # message ("at file:line") tells those causes apart
        detail = cell.get("detail") if cell.get("exc_type") == "CaptureError" else None
        return f"refused: {cell.get('exc_type')} raised at {cell.get('where')}" + (f"; {detail}" if detail else "")
    if kind == "crash":
        return f"crash: {cell.get('exc_type')} at {cell.get('where')}"
    if kind == "mismatch":
        return "mismatch: " + ("missing gradients" if cell.get("n_missing") else "wrong values")
    return str(kind)


def write_report(cells: list[dict[str, Any]], path: Path, runs: list[dict[str, Any]],
                 rerun: Any = None) -> None:
    """A markdown report: per-cell status, then causes with counts and one traceback each.

    ``rerun(cell) -> cell``, if given, runs the first cell of each cause again; its traceback
    (fresh, since the code may have changed since the matrix ran) goes in the report.
    """
    plans = [p for p in PLAN_OPTIONS if any(c["plan"] == p for c in cells)]
    lines = ["# gradshard x Hugging Face zoo matrix", ""]
    for r in runs:
        lines.append(f"- run {r['started']} -> {r['finished']}: plans {','.join(r['plans'])}, "
                     f"attn {','.join(r['attn'])}, {r['cells']} cells, T={r['T']}, batch {r['batch']}, "
                     f"torch {r.get('torch')}, transformers {r.get('transformers')}")
    lines += ["", "Status legend: `exact E` (max rel. err E; `f32`: the eager grad path has float32 "
              "tensors, tolerance 1e-5, else 1e-10), `MISMATCH`, `refused <GradshardError>`, "
              "`CRASH <type> @ innermost project frame`.", ""]
    lines.append("| family | attn | " + " | ".join(plans) + " |")
    lines.append("|---|---|" + "---|" * len(plans))
    rows: dict[tuple[str, str], dict[str, dict]] = OrderedDict()
    for c in cells:
        rows.setdefault((c["family"], _row_label(c)), {})[c["plan"]] = c
    for (fam, attn), by_plan in rows.items():
        lines.append(f"| {fam} | {attn} | " + " | ".join(_short(by_plan[p]) if p in by_plan else "" for p in plans) + " |")
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.get("kind", "?")] = counts.get(c.get("kind", "?"), 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]

    groups: dict[str, list[dict]] = OrderedDict()
    for c in cells:
        if c.get("kind") != "exact":
            groups.setdefault(cause_key(c), []).append(c)
    lines += ["## Failure causes (grouped by kind, exception type and innermost project frame)", ""]
    for i, (key, group) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1])), 1):
        lines.append(f"### {i}. {key} — {len(group)} cells")
        lines.append("")
        lines.append("Cells: " + ", ".join(f"{c['family']}/{_row_label(c)}/{c['plan']}" for c in group))
        lines.append("")
        msgs = OrderedDict((c.get("message") or c.get("status"), None) for c in group)
        lines.append("Messages (first line, distinct):")
        lines += [f"- `{m}`" for m in list(msgs)[:8]]
        details = OrderedDict((c["detail"], None) for c in group if c.get("detail"))
        if details:
            lines.append("")
            lines.append("Model source lines named in the messages (distinct):")
            lines += [f"- `{d}`" for d in list(details)[:10]]
        full = next((c.get("message_full") for c in group if c.get("message_full")), None)
        if full and "\n" in full:
            lines += ["", "Full message (first cell):", "", "```", full, "```"]
        tb = next((c.get("traceback") for c in group if c.get("traceback")), None)
        if "expected" in key:
            tb = None  # the plan does not apply: no traceback needed
        if tb:
            first = next(c for c in group if c.get("traceback"))
            source = f"from the matrix run, finished {first.get('finished_at')}"
            if rerun is not None:
                again = rerun(first)
                if cause_key(again) == key and again.get("traceback"):
                    source, tb = f"rerun at {_now()}: same cause", again["traceback"]
                else:  # the code changed since the matrix ran: keep the matrix's traceback
                    source += f"; a rerun at {_now()} gives: {again.get('status')}"
            lines += ["", f"Traceback ({first['family']}/{_row_label(first)}/{first['plan']}, phase "
                      f"{first.get('phase')}; {source}):", "", "```", tb.rstrip(), "```"]
        elif group[0].get("kind") == "mismatch":
            lines += [""] + [f"- {c['family']}/{c['attn']}/{c['plan']}: loss err {c.get('loss_err'):.2e}, "
                             f"grad err {c.get('grad_err'):.2e} (worst {c.get('worst_param')}), "
                             f"fp32 sites {c.get('fp32')}" for c in group]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- main


def _now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated (default: every zoo family)")
    ap.add_argument("--plans", default=",".join(PLAN_OPTIONS), help="comma-separated plans")
    ap.add_argument("--attn", default="sdpa,eager",
                    help="attention impls to run where a family supports them (families without "
                         "attention run once, as 'eager')")
    ap.add_argument("--json", help="write the cells (and run metadata) here")
    ap.add_argument("--T", type=int, default=T_DEFAULT)
    ap.add_argument("--batch", type=int, default=BATCH_DEFAULT)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per cell")
    ap.add_argument("--hf-loss", action="store_true",
                    help="keep transformers' loss (upcasts logits to float32) instead of a float64 one")
    ap.add_argument("--mask", default="none", choices=("none", "ones", "pad3"),
                    help="attention_mask passed with the inputs: none (as in the brief), all ones, or "
                         "the last row right-padded by 3 tokens")
    ap.add_argument("--experts", default="batched_mm", choices=("batched_mm", "eager"),
                    help="transformers MoE experts implementation (grouped_mm rejects float64 on CPU)")
    ap.add_argument("--frontend", help="gs.compile frontend (python, fx, dynamo; default: gradshard's)")
    ap.add_argument("--check", action="store_true", help="only run every family eagerly and time it")
    ap.add_argument("--cell", help="FAMILY:ATTN:PLAN: run one cell in this process, print its traceback")
    ap.add_argument("--retry", help="rerun the cells of this --json file that were not exact")
    ap.add_argument("--report", help="write a markdown report of --from-json files here")
    ap.add_argument("--rerun", action="store_true",
                    help="with --report: rerun one cell per failure cause for a fresh traceback")
    ap.add_argument("--from-json", help="comma-separated JSON files written by --json (later wins)")
    args = ap.parse_args(argv)

    from tests.hf import zoo

    families = args.families.split(",") if args.families else list(zoo.FAMILIES)
    unknown = [f for f in families if f not in zoo.FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(zoo.FAMILIES)}")

    if args.report:
        runs, cells = [], OrderedDict()
        for f in (args.from_json or args.json or "").split(","):
            data = json.loads(Path(f).read_text())
            runs.append(data["run"])
            for c in data["cells"]:
                cells[(c["family"], _row_label(c), c["plan"])] = c
        ordered = sorted(cells.values(), key=lambda c: (zoo.FAMILIES.index(c["family"]), c["attn"] != "sdpa",
                                                         _row_label(c), list(PLAN_OPTIONS).index(c["plan"])))
        runner = Runner(args.timeout) if args.rerun else None
        try:
            rerun = None
            if runner is not None:
                keys = ("family", "attn", "plan", "T", "batch", "hf_loss", "mask", "frontend", "experts")
                rerun = lambda c: runner.run({k: c.get(k, d) for k, d in zip(keys, (  # noqa: E731
                    None, None, None, T_DEFAULT, BATCH_DEFAULT, False, "none", None, "batched_mm"))})
            write_report(ordered, Path(args.report), runs, rerun)
        finally:
            if runner is not None:
                runner.close()
        print_table(ordered)
        print(f"wrote {args.report}")
        return 0

    if args.check:
        rows = check_families(families, args.T, args.batch)
        print_check(rows)
        slow = [r for r in rows if r.get("ok") and r["seconds"] >= 1.0]
        bad = [r for r in rows if not r.get("ok")]
        if args.json:
            Path(args.json).write_text(json.dumps({"run": {"started": _now()}, "check": rows}, indent=1))
        print(f"{len(rows) - len(bad)}/{len(rows)} ran; slowest "
              f"{max((r['seconds'] for r in rows if r.get('ok')), default=0):.3f} s; unavailable: {zoo.UNAVAILABLE}")
        return 1 if (bad or slow) else 0

    if args.cell:
        fam, attn, plan = args.cell.split(":")
        cell = run_cell(fam, attn, plan, T=args.T, batch=args.batch, hf_loss=args.hf_loss, mask=args.mask,
                        frontend=args.frontend, experts=args.experts)
        tb = cell.pop("traceback", None)
        print(json.dumps(cell, indent=1, default=str))
        if tb:
            print(tb)
        return 0

    tasks: list[dict[str, Any]] = []
    if args.retry:  # the cells of an earlier run that were not exact, with their own settings
        keys = ("family", "attn", "plan", "T", "batch", "hf_loss", "mask", "frontend", "experts")
        defaults = (None, None, None, T_DEFAULT, BATCH_DEFAULT, False, "none", None, "batched_mm")
        old = json.loads(Path(args.retry).read_text())["cells"]
        tasks = [{k: c.get(k, d) if c.get(k) is not None else d for k, d in zip(keys, defaults)}
                 for c in old if c.get("kind") != "exact"]
        args.plans = ",".join(OrderedDict((t["plan"], None) for t in tasks))
        args.attn = ",".join(OrderedDict((t["attn"], None) for t in tasks))
    plans = args.plans.split(",")
    for p in plans:
        if p not in PLAN_OPTIONS:
            ap.error(f"unknown plan {p!r}; known: {', '.join(PLAN_OPTIONS)}")
    attns = args.attn.split(",")
    for fam in ([] if args.retry else families):
        # a family without any requested impl (no attention, or gemma2 without SDPA) runs
        # once with the impl it has, so every family appears in the table
        impls = [a for a in zoo.ATTN_IMPLS[fam] if a in attns] or list(zoo.ATTN_IMPLS[fam][:1])
        for attn in impls:
            for plan in plans:
                tasks.append(dict(family=fam, attn=attn, plan=plan, T=args.T, batch=args.batch, hf_loss=args.hf_loss,
                                  mask=args.mask, frontend=args.frontend, experts=args.experts))

    import torch
    import transformers

    run = {"started": _now(), "plans": plans, "attn": attns, "T": args.T, "batch": args.batch,
           "torch": torch.__version__, "transformers": transformers.__version__, "hf_loss": args.hf_loss,
           "mask": args.mask, "frontend": args.frontend, "experts": args.experts}
    runner = Runner(args.timeout)
    cells = []
    try:
        for i, task in enumerate(tasks, 1):
            cell = runner.run(task)
            cell["finished_at"] = _now()
            cells.append(cell)
            print(f"[{i}/{len(tasks)} {cell['finished_at']}] {task['family']}/{task['attn']}/{task['plan']}: "
                  f"{cell['status']} ({cell.get('seconds', 0):.1f} s)", flush=True)
            if args.json:  # keep partial results if interrupted
                run["finished"] = _now()
                run["cells"] = len(cells)
                Path(args.json).write_text(json.dumps({"run": run, "cells": cells}, indent=1, default=str))
    finally:
        runner.close()
    run["finished"] = _now()
    run["cells"] = len(cells)
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run, "cells": cells}, indent=1, default=str))
    if cells:
        print_table(cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
