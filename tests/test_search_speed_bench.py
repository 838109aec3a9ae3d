"""benchmarks/search_speed.py ``--tree DIR`` runs the other checkout's own built-in plugins
(``stg.predictors`` and the others), not this checkout's, which the editable install maps
those packages to whatever ``PYTHONPATH`` says."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SEARCH = [
    "search", "--model", "llama", "--dvocal", "1024", "--dmodel", "512", "--dff", "2048",
    "--head", "8", "--kvhead", "8", "--seq", "256", "--num_stacks", "8", "--batch", "32",
    "--gpus", "2", "--refine", "0", "--jobs", "1", "--json",
]  # fmt: skip


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "search_speed", ROOT / "benchmarks" / "search_speed.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_another_tree_runs_its_own_predictors(tmp_path: Path) -> None:
    bench = _benchmark()
    tree = tmp_path / "tree"
    for name in ("stg", *bench.PLUGIN_PACKAGES):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    # the tree's memory predictor differs from this checkout's: it cannot be imported
    with (tree / "predictors" / "memory.py").open("a") as f:
        f.write('\nraise ImportError("the memory predictor of the other tree")\n')
    args, env = bench.stg_command(SEARCH, str(tree))
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tree)
    assert done.returncode == 2
    assert "the memory predictor of the other tree" in done.stderr
    args, env = bench.stg_command(SEARCH)  # this checkout: its own memory predictor
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert '"enumerated"' in done.stdout
