"""Installed plugins: the guide's packaging instructions, and what a failed plugin tells a user.

The packaging test takes the plugin module and ``pyproject.toml`` from docs/plugins.md exactly
as written, builds them into a wheel in a temporary directory, installs the wheel into a fresh
virtual environment and runs ``stg`` there; all of it offline (``--no-index``, no build
isolation), so it needs nothing but the setuptools and pip installed where the test runs: the
test extra asks for setuptools >= 70.1, which builds wheels by itself (``bdist_wheel``), and
the venv has no pip or setuptools of its own (a venv's bundled setuptools 65 cannot). It
works the same whether the suite runs in a virtual environment (as the README's command
does) or in the base interpreter.
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.errors import UnknownNameError
from stg.host.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
PROJECT_FILES = ("pyproject.toml", "stg_relu.py", "test_stg_relu.py")
"""The folder the guide's Packaging section lays out."""

BROKEN_NOTE = (
    "plugin fake_broken (stg-fake-broken 1.0) failed to load: "
    "RuntimeError: stg_fake_broken cannot be imported (on purpose)"
)


def guide_files() -> dict[str, str]:
    """Every code block of the guide whose first line is ``# <file name>``, by file name."""
    files = {}
    for _, body in FENCE.findall(GUIDE.read_text(encoding="utf-8")):
        first = body.splitlines()[0] if body else ""
        if re.fullmatch(r"# [\w.-]+\.(py|toml)", first):
            files[first[2:]] = body
    return files


def write_documented_project(dest: Path, names: tuple[str, ...] = PROJECT_FILES) -> Path:
    """The folder of the guide's Packaging section, with the files as the guide has them, and
    the ``out/`` folder that the guide's ``stg generate`` example leaves behind."""
    files = guide_files()
    dest.mkdir(parents=True)
    for name in names:
        (dest / name).write_text(files[name], encoding="utf-8")
    (dest / "out").mkdir()
    (dest / "out" / "workload.0.csv").write_text("id,name,type,num_ops,comm_size,data_deps\n")
    return dest


def _run(args: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment minus pip's configuration and stg's plugin switches: no index, no
    configured find-links; nothing from PYTHONPATH that could shadow the installed module."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("PYTHONPATH", "STG_DISABLE_PLUGIN_AUTOLOAD")
    }
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_NO_CACHE_DIR="1",
        PYTHONDONTWRITEBYTECODE="1",
        HOME=str(tmp_path),
    )
    return env


def _venv_over_this_environment(venv: Path, cwd: Path, env: dict[str, str]) -> Path:
    """A fresh venv without pip that sees this test's own site-packages (its pip, the
    setuptools >= 70.1 of the test extra, the editable stg) and returns its python.

    ``--system-site-packages`` would not do: inside a virtual environment it shows the base
    interpreter's packages (setuptools 65 there, without ``bdist_wheel``), not this one's.
    A ``.pth`` line that calls ``site.addsitedir`` also runs the ``.pth`` files found there,
    which editable installs need."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=cwd, env=env)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = _run([python, "-c", where], cwd, env).strip()
    outer = [*site.getsitepackages(), site.getusersitepackages()]
    dirs = [d for d in dict.fromkeys(outer) if Path(d).is_dir()]
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    (Path(purelib) / "_stg_test_outer_env.pth").write_text(line + "\n", encoding="utf-8")
    return python


def test_guide_pyproject_is_complete() -> None:
    data = tomllib.loads(guide_files()["pyproject.toml"])
    assert data["build-system"]["build-backend"] == "setuptools.build_meta"
    assert any(r.startswith("setuptools") for r in data["build-system"]["requires"])
    assert data["project"]["dependencies"] == ["symbolic-tensor-graph"]
    assert data["project"]["entry-points"]["stg"] == {"relu": "stg_relu"}
    assert data["tool"]["setuptools"]["py-modules"] == ["stg_relu"]


def test_documented_plugin_builds_installs_and_loads(tmp_path: Path) -> None:
    project = write_documented_project(tmp_path / "stg-relu")
    env = _offline_env(tmp_path)
    venv = tmp_path / "venv"
    python = _venv_over_this_environment(venv, tmp_path, env)
    dist = tmp_path / "dist"
    pip_wheel = ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist]
    _run([python, *pip_wheel, project], cwd=tmp_path, env=env)
    (wheel,) = dist.glob("*.whl")
    assert wheel.name == "stg_relu-0.1.0-py3-none-any.whl"

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_text = archive.read(entry_points).decode()
    assert [n for n in names if ".dist-info/" not in n] == ["stg_relu.py"]  # no tests, no folder
    assert "[stg]" in entry_text and "relu = stg_relu" in entry_text

    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp_path, env=env)
    elsewhere = tmp_path / "elsewhere"  # a cwd without stg_relu.py: only the wheel provides it
    elsewhere.mkdir()
    where = _run([python, "-c", "import stg_relu; print(stg_relu.__file__)"], elsewhere, env)
    assert Path(where.strip()).is_relative_to(venv)

    report = json.loads(_run([python, "-m", "stg", "plugins", "list", "--json"], elsewhere, env))
    (plugin,) = [p for p in report["plugins"] if p["name"] == "relu"]
    assert plugin == {
        "name": "relu",
        "dist": "stg-relu",
        "version": "0.1.0",
        "source": "entry point",
        "registers": {"models": ["gpt-relu"], "emitters": ["node-csv"]},
    }
    assert not [f for f in report["failures"] if f["name"] == "relu" or f["dist"] == "stg-relu"]

    generate = ["generate", "--model", "gpt-relu", "--format", "node-csv", "--num_stacks", "2"]
    _run([python, "-m", "stg", *generate, "--tp", "2", "--output_dir", "out"], elsewhere, env)
    written = sorted(p.name for p in (elsewhere / "out").iterdir())
    assert written == ["workload.0.csv", "workload.1.csv", "workload.json"]


@pytest.mark.parametrize("names", [PROJECT_FILES, ("pyproject.toml", "stg_relu.py")])
def test_without_py_modules_setuptools_packages_something_else(
    tmp_path: Path, names: tuple[str, ...]
) -> None:
    """Why the guide says ``py-modules``: without it setuptools refuses (two top-level
    modules) or packages the ``out`` folder instead of the plugin module."""
    project = write_documented_project(tmp_path / "stg-relu", names)
    toml = (project / "pyproject.toml").read_text(encoding="utf-8")
    (project / "pyproject.toml").write_text(toml.split("[tool.setuptools]")[0], encoding="utf-8")
    egg_base = tmp_path / "egg"
    egg_base.mkdir()
    setup = "import sys; sys.argv[0] = 'setup.py'; from setuptools import setup; setup()"
    result = subprocess.run(
        [sys.executable, "-c", setup, "-q", "egg_info", "--egg-base", str(egg_base)],
        cwd=project,
        env=_offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    top_level = [p.read_text().split() for p in egg_base.glob("*.egg-info/top_level.txt")]
    assert result.returncode != 0 or top_level != [["stg_relu"]], top_level


# -- an unknown name names the plugins that failed to load ----------------------------------


def test_unknown_name_mentions_failed_plugins(fake_dists: Path) -> None:
    registry = load_registry()
    assert {f.name for f in registry.failures} >= {"fake_broken", "fake_wrongtype"}
    for catalog, label in (
        (registry.models, "model"),
        (registry.emitters, "emitter"),
        (registry.predictors, "predictor"),
        (registry.kernels, "kernel"),
        (registry.schedules, "pipeline schedule"),
    ):
        with pytest.raises(UnknownNameError) as info:
            catalog.get("no-such-name")
        message = str(info.value)
        assert message.startswith(f"unknown {label} 'no-such-name'; allowed: ")
        assert BROKEN_NOTE in message
        assert "plugin fake_wrongtype (stg-fake-wrongtype 0.3) failed to load: " in message
        assert "\n" not in message
    assert registry.emitters.get("lines") is not None  # known names are unaffected


def test_unknown_name_without_failures_is_unchanged() -> None:
    registry = load_registry(autoload=False)
    assert not registry.failures
    with pytest.raises(UnknownNameError) as info:
        registry.models.get("no-such-model")
    allowed = "bert, bert-qa, deepseek, gated-deltanet, gpt, hybrid, llama, mamba2, moe, mpt, "
    allowed += "roberta, "
    allowed += "roberta-mc"
    assert str(info.value) == f"unknown model 'no-such-model'; allowed: {allowed}"


@pytest.mark.parametrize(
    ("args", "label"),
    [
        (["generate", "--model", "no-such-model"], "model"),
        (["generate", "--format", "no-such-format"], "emitter"),
        (["predict", "--predictor", "no-such-predictor"], "predictor"),
    ],
)
def test_cli_unknown_name_mentions_failed_plugins(
    fake_dists: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    label: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*args, "--num_stacks", "1"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: unknown {label} '{args[-1]}'; allowed: ")
    assert BROKEN_NOTE in line
    assert list(tmp_path.iterdir()) == []  # nothing written
