"""An output path that is a device or a pipe (``-o /dev/null``) is refused in one line: stg
writes its outputs by renaming a complete file over the path, which replaced the device node
(run as root, ``stg convert ... /dev/null`` left /dev/null a regular file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.errors import OutputError, write_replacing


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _still_a_pipe(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_write_replacing_leaves_a_pipe_alone(fifo: Path) -> None:
    with pytest.raises(OutputError, match="it is not a regular file"):
        write_replacing(fifo, lambda tmp: tmp.write_text("x"))
    assert _still_a_pipe(fifo)
    assert sorted(p.name for p in fifo.parent.iterdir()) == ["pipe"]


@pytest.mark.parametrize(
    ("name", "command"),
    [
        ("plan.json", ["plan", "precision", "--model", "debug", "--out", "{out}"]),
        ("requests.csv", ["serve", "--model", "debug", "--rate", "2", "--duration", "1",
                          "--requests-table", "{out}"]),
    ],
)  # fmt: skip
def test_commands_refuse_a_pipe_as_output(tmp_path: Path, name: str, command: list[str]) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    args = [a.replace("{out}", str(fifo)) for a in command]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "not a regular file" in result.stderr
    assert _still_a_pipe(fifo)
