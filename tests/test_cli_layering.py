"""Commands never import each other: what several share lives in ``stg.cli._shared``."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / "stg" / "cli"
ALLOWED = frozenset({"stg.cli", "stg.cli._shared"})


def _modules() -> list[str]:
    """Every module of stg/cli but ``__init__``: the commands and the ``_x`` helpers."""
    return sorted(p.stem for p in CLI.glob("*.py") if p.stem != "__init__")


def _command_modules() -> list[str]:
    """The command modules (``_x`` modules are not commands; see builtin_command_names)."""
    return [name for name in _modules() if not name.startswith("_")]


def _imported(tree: ast.AST, modules: list[str]) -> list[tuple[int, str]]:
    """(line, module) of every module of ``stg.cli`` imported, at module level or in a function.

    ``from stg.cli import generate`` counts as importing ``stg.cli.generate``; relative imports
    are resolved as if the file lies in stg/cli.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = ["stg", "cli"][: max(0, 3 - node.level)]
                module = ".".join([*package, *([module] if module else [])])
            found.append((node.lineno, module))
            if module == "stg.cli":
                found += [
                    (node.lineno, f"stg.cli.{alias.name}")
                    for alias in node.names
                    if alias.name in modules
                ]
    return sorted(found)


def _offenders(path: Path, modules: list[str]) -> list[str]:
    """Imports of ``stg.cli`` modules other than ``stg.cli`` and ``stg.cli._shared``."""
    return [
        f"{path.name}:{line} imports {module}"
        for line, module in _imported(ast.parse(path.read_text(encoding="utf-8")), modules)
        if module.startswith("stg.cli.") and module not in ALLOWED
    ]


def test_the_command_modules_are_found() -> None:
    commands = _command_modules()
    assert {"generate", "predict", "plan", "inspect", "feed"} <= set(commands)
    assert (CLI / "_shared.py").is_file()


def test_no_command_imports_another_command() -> None:
    modules = _modules()
    offenders: list[str] = []
    for path in sorted(CLI.glob("*.py")):
        offenders += _offenders(path, modules)
    assert offenders == []


def test_the_check_catches_a_command_importing_another(tmp_path: Path) -> None:
    modules = ["_shared", "feed", "generate", "predict"]
    sample = tmp_path / "predict.py"
    sample.write_text(
        "import json\n"
        "from stg.cli import get_registry\n"
        "from stg.cli._shared import run_predictors\n"
        "from stg.trace.feeder import DEFAULT_WINDOW\n"
        "def f():\n"
        "    from stg.cli.generate import option_parameters\n"
        "    from stg.cli import feed\n"
        "    import stg.cli.generate\n"
        "    from . import generate\n"
        "    from .feed import run_analysis\n"
        "    from ._shared import progress_bar\n",
        encoding="utf-8",
    )
    assert _offenders(sample, modules) == [
        "predict.py:6 imports stg.cli.generate",
        "predict.py:7 imports stg.cli.feed",
        "predict.py:8 imports stg.cli.generate",
        "predict.py:9 imports stg.cli.generate",
        "predict.py:10 imports stg.cli.feed",
    ]
