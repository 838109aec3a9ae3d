"""The layering of the tree (pyproject.toml's import-linter contracts) holds, and breaks loudly.

`lint-imports` runs on the checkout; then on a scratch copy with one deliberately wrong
import, where it must fail naming the contract. The example plugin distribution is a single
module, which import-linter cannot take as a root package, so its rule is checked here.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("stg", "stg.api", "stg.errors", "stg.testing")
LINT_IMPORTS = shutil.which("lint-imports")  # a test extra: pip install -e '.[test]'


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [LINT_IMPORTS] if LINT_IMPORTS else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run(
        [*command, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True
    )


def test_the_checkout_keeps_its_contracts() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        ("stg/core/plan.py", "import stg.trace.reader", "Layers"),
        ("stg/trace/writer.py", "import stg.core.lowering", "without the core's lowering"),
        ("models/gpt.py", "import stg.core.symbolic", "only the public API"),
        ("stg/cli/feed.py", "import stg.cli.validate", "Commands never import each other"),
    ],
)
def test_a_wrong_import_breaks_a_contract(
    tmp_path: Path, module: str, bad_import: str, contract: str
) -> None:
    for name in ("stg", "models", "emitters", "predictors"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{bad_import}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and contract in result.stdout, result.stdout


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_example_plugins_import_only_the_public_api() -> None:
    offenders = []
    for path in sorted((ROOT / "plugins").glob("*/*.py")):
        for line, name in _imports(path):
            if (name == "stg" or name.startswith("stg.")) and name not in PUBLIC:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert offenders == []
