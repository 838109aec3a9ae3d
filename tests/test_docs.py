"""The code in the docs runs: the plugin guide's modules, commands and tests, and the README."""

from __future__ import annotations

import importlib
import inspect
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app, builtin_command_names
from stg.testing import make_registry

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, language: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


@pytest.fixture
def guide_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Every python block of the guide that starts with ``# name.py``, written to tmp_path."""
    written = {}
    for body in blocks(GUIDE, "python"):
        first = body.splitlines()[0]
        assert first.startswith("# ") and first.endswith(".py"), first
        name = first[2:]
        (tmp_path / name).write_text(body, encoding="utf-8")
        written[name[:-3]] = tmp_path / name
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    yield written
    for module in written:
        sys.modules.pop(module, None)


def test_guide_console_commands_run(guide_modules: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    commands = [
        line[2:]
        for body in blocks(GUIDE, "console")
        for line in body.splitlines()
        if line.startswith("$ stg ")
    ]
    assert len(commands) >= 2
    for command in commands:
        args = shlex.split(command)[1:]
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert "failed" not in result.stdout, (command, result.stdout)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["workload.0.csv", "workload.1.csv", "workload.json"]
    header = (tmp_path / "out" / "workload.0.csv").read_text().splitlines()[0]
    assert header == "id,name,type,num_ops,comm_size,data_deps"


def test_guide_tests_pass(guide_modules: dict[str, Path]) -> None:
    tests = [name for name in guide_modules if name.startswith("test_")]
    assert tests
    ran = 0
    for name in tests:
        module = importlib.import_module(name)
        for attr, fn in sorted(vars(module).items()):
            if attr.startswith("test_") and callable(fn):
                kwargs = {}
                if "stg_registry" in inspect.signature(fn).parameters:
                    kwargs["stg_registry"] = make_registry
                fn(**kwargs)
                ran += 1
    assert ran >= 2


def test_guide_command_plugin(guide_modules: dict[str, Path]) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["-p", "stg_hello", "hello", "--name", "chakra"])
    assert ok.exit_code == 0 and ok.stdout == "hello chakra\n"
    bad = runner.invoke(app, ["-p", "stg_hello", "hello", "--name", ""])
    assert bad.exit_code == 2
    assert bad.stderr == "error: name must not be empty\n"


def test_guide_packaging_names_the_module() -> None:
    (toml,) = blocks(GUIDE, "toml")
    data = tomllib.loads(toml)
    entry_points = data["project"]["entry-points"]["stg"]
    modules = {body.splitlines()[0][2:-3] for body in blocks(GUIDE, "python")}
    assert set(entry_points.values()) <= modules
    assert "symbolic-tensor-graph" in data["project"]["dependencies"]


def test_readme_opens_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = FENCE.search(text)
    assert first is not None
    lines = [line for line in first.group(2).splitlines() if line and not line.startswith("#")]
    assert lines == [
        "pip install -e . && stg generate",
        "pip install -e '.[test]' -e plugins/stg-int8-kernels && python -m pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert lines[1] in ci.splitlines()
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["testpaths"]
    assert "plugins/stg-int8-kernels/tests" in testpaths


def test_readme_cli_reference_covers_every_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in builtin_command_names():
        assert f"stg {command}" in text, command
