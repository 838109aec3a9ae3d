"""The ``stg`` script and ``python -m stg`` run :func:`stg.cli.run`: the command line, then
the objects left frozen out of the cyclic collector (``gc.freeze``) so that the interpreter's
last collection does not walk them; exit codes, output and errors are the command's."""

from __future__ import annotations

import gc
import importlib.metadata
import subprocess
import sys

import pytest

from stg.cli import run


def test_run_is_main_then_a_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(sys, "argv", ["stg", "--version"])
    with pytest.raises(SystemExit) as info:
        run()
    assert info.value.code in (0, None)
    assert frozen == [True]


def test_the_script_is_run() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [e.value for e in scripts if e.name == "stg"] == ["stg.cli:run"]


@pytest.mark.parametrize(
    ("args", "code", "stream"),
    [
        (["--version"], 0, "stdout"),
        (["predict", "--model", "gpt", "--dmodel", "64", "--head", "4", "--tp", "3"], 2, "stderr"),
    ],
)
def test_python_m_stg_keeps_the_exit_code_and_output(
    args: list[str], code: int, stream: str
) -> None:
    done = subprocess.run([sys.executable, "-m", "stg", *args], capture_output=True, text=True)
    assert done.returncode == code, done.stderr
    text = getattr(done, stream)
    if code == 0:
        assert text.startswith("stg ")
    else:
        assert text.startswith("error: ") and len(text.strip().splitlines()) == 1
        assert "Traceback" not in done.stderr
