"""The wheel stands alone: build it, install it into a temporary folder, run the CLI from an empty one.

No network: the wheel is built by the running environment's setuptools (``--no-build-isolation``)
from a copy of the sources, and installed with ``--no-deps --no-index --target``; torch and the
other dependencies come from the running environment. Every check asserts that the *installed*
copy is the one that runs (``gradshard.__file__``), from a folder holding nothing of the checkout,
so anything the CLI still took from ``examples/``, ``bench/`` or ``tests/`` fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site as site_module
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: source folder -> where its modules land in the wheel (pyproject.toml's package-dir)
SOURCES = {"gradshard": "gradshard", "passes": "gradshard/passes", "kernels": "gradshard/kernels",
           "bench": "gradshard/bench"}
TIMEOUT_S = 240

FACTORY_FILE = '''\
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ScanConfig:  # a dataclass: the CLI must register the file's module like an import does
    d: int = 8


class LoopScan(nn.Module):
    def __init__(self, config: ScanConfig) -> None:
        super().__init__()
        self.gate, self.inp, self.out = (nn.Linear(config.d, config.d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, u = torch.sigmoid(self.gate(x)), self.inp(x)
        h, hs = torch.zeros_like(u[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + u[:, t]
            hs.append(h)
        return self.out(torch.stack(hs, dim=1))


def build(seq_len: int = 12, batch: int = 2):
    torch.manual_seed(0)
    return LoopScan(ScanConfig()), (torch.randn(batch, seq_len, 8),)
'''

#: one interpreter runs these CLI commands in turn (importing torch once, not per command)
DRIVER = '''\
import json, sys, traceback
import gradshard
from gradshard.cli.main import main
print("GRADSHARD_FILE", gradshard.__file__, flush=True)
for argv in json.loads(sys.argv[1]):
    print("<<<", " ".join(argv), flush=True)
    try:
        rc = main(argv)
    except Exception:  # reported with the command's output; the other commands still run
        traceback.print_exc(file=sys.stdout)
        rc = "exception"
    print(">>> rc", rc, flush=True)
'''


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "out", "*.png", "RESULTS.md")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in SOURCES:
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build the wheel from a copy of the sources and install it with pip into a bare folder."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    _copy_sources(src)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", str(base / "dist"), str(src)], cwd=base)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (base / "dist").glob("gradshard-*.whl")
    site = base / "site"
    inst = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                 str(wheel)], cwd=base)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    return {"wheel": wheel, "site": site, "base": base, "src": src}


def _empty_folder(installed: dict[str, Path], name: str) -> Path:
    folder = installed["base"] / "cwd" / name
    folder.mkdir(parents=True)
    return folder


def _python(site: Path) -> tuple[list[str], dict[str, str]]:
    """An interpreter that sees the installed wheel and the dependencies, not the checkout.

    ``-S`` skips the ``.pth`` files of site-packages, among them the editable install's finder,
    which would otherwise serve any module missing from the wheel out of the checkout; the
    running environment's site-packages (torch, sympy, rich, ...) come after the wheel's folder.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = [str(site), *site_module.getsitepackages()]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", COLUMNS="200",
               PYTHONDONTWRITEBYTECODE="1", PYTHONIOENCODING="utf-8")
    return [sys.executable, "-S"], env


def test_the_wheel_holds_every_module_and_nothing_of_the_checkout(installed) -> None:
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    src = installed["src"]  # the copy of the sources the wheel was built from
    missing = [f"{dest}/{f.relative_to(src / folder).as_posix()}"
               for folder, dest in SOURCES.items() for f in (src / folder).rglob("*.py")]
    missing = [m for m in missing if m not in names]
    assert not missing, f"not in the wheel (list the package in pyproject.toml `packages`): {missing}"
    tops = {n.split("/")[0] for n in names}
    assert tops - {"gradshard"} == {installed["wheel"].name.split("-py")[0] + ".dist-info"}, tops
    for needed in ("gradshard/examples/factories.py", "gradshard/examples/models/ssm.py",
                   "gradshard/examples/data.py", "gradshard/bench/results_md.py", "gradshard/bench/bench_seco.py"):
        assert needed in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gradshard = gradshard.cli.main:main" in zipfile.ZipFile(installed["wheel"]).read(entry_points).decode()


def test_demo_runs_from_an_empty_folder(installed) -> None:
    python, env = _python(installed["site"])
    folder = _empty_folder(installed, "demo")
    script = installed["site"] / "bin" / "gradshard"  # the console script pip generated
    run = _run([*python, str(script), "demo", "--steps", "2", "--seq-len", "128", "--batch", "2"],
               cwd=folder, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "gradshard demo" in out and "Python standard library" in out and "plan adjoint" in out
    assert "over 2 steps" in out and "lower than plain autograd" in out and "gradient difference" in out
    assert not any(folder.iterdir()), "the demo wrote into the current folder"


def test_cli_commands_from_an_empty_folder(installed) -> None:
    folder = _empty_folder(installed, "commands")
    (folder / "my_model.py").write_text(FACTORY_FILE)
    commands = [
        ["factories"],
        ["plans"],
        ["show", "gradshard.examples.factories:ssm_loop", "--plan", "adjoint", "--max-lines", "2"],
        ["show", "my_model.py:build", "--plan", "adjoint", "--max-lines", "2"],
        ["cost", "ssm", "--plan", "none", "--seq-len", "1k,64k"],  # one cheap plan: pricing llama's
        ["whatif", "ssm", "--plan", "none", "--max-seq-len", "--memory", "80GB"],  # seco takes a minute
        ["bench", "list"],
        ["bench", "hf"],
        ["show", "no_such_factory"],
        ["show", "my_model.py:nope"],
    ]
    python, env = _python(installed["site"])
    run = _run([*python, "-c", DRIVER, json.dumps(commands)], cwd=folder, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    head, *parts = out.split("<<< ")
    ran = Path(head.split("GRADSHARD_FILE ", 1)[1].split("\n", 1)[0]).resolve()
    assert ran.is_relative_to(installed["site"].resolve()), f"gradshard came from {ran}, not the wheel"
    got = {p.split("\n", 1)[0]: p for p in parts}
    assert len(got) == len(commands), out

    def result(*argv: str, rc: int = 0) -> str:
        text = got[" ".join(argv)]
        assert f">>> rc {rc}" in text, text
        return text

    assert "ssm_loop" in result("factories") and "linear_attention" in result("factories")
    assert "truncated_adjoint" in result("plans") and "rewrite_chunked" in result("plans")
    shown = result("show", "gradshard.examples.factories:ssm_loop", "--plan", "adjoint", "--max-lines", "2")
    assert "linear_recurrence" in shown and "roll_loops" in shown and "Stage program" in shown
    mine = result("show", "my_model.py:build", "--plan", "adjoint", "--max-lines", "2")
    assert "linear_recurrence" in mine and "my_model.py" in mine and "h = a[:, t] * h + u[:, t]" in mine
    cost = result("cost", "ssm", "--plan", "none", "--seq-len", "1k,64k")
    assert "none" in cost and "64k" in cost and "FLOP" in cost
    assert "max seq len" in result("whatif", "ssm", "--plan", "none", "--max-seq-len", "--memory", "80GB")
    listed = result("bench", "list")
    for name in ("adjoint", "seco", "kernels", "partial", "hf"):
        assert re.search(rf"^\W*{name} ", listed, re.M), name
    assert "needs a source checkout" in listed and f"results: {folder}" in listed.replace("\n", "")
    assert "ships only in a source checkout" in result("bench", "hf", rc=2)
    assert "no built-in factory 'no_such_factory'" in result("show", "no_such_factory", rc=2)
    assert "has no factory 'nope'" in result("show", "my_model.py:nope", rc=2)
    assert sorted(p.name for p in folder.iterdir()) == ["my_model.py"], "a command wrote into the current folder"
