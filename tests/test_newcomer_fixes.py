"""Small stumbles of a newcomer: a picture named .et, a malformed comm-group file given to
convert, a directory as --system, "1 GPUs", and ``stg -p MODULE`` for a module in the current
directory."""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.errors import TraceError
from stg.trace import decode
from stg.trace.reader import read_nodes

SMALL = ["--num_stacks", "1", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip


def invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("newcomer") / "out"
    code, _, err = invoke("generate", "--output_dir", out, "--dp", "2", *SMALL)
    assert code == 0, err
    return out


def png() -> bytes:
    """A valid 1x1 PNG image."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = (1).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


# -- C2: a file that is not a trace ------------------------------------------------------------


@pytest.mark.parametrize("content", [png(), b"some notes, not a trace\n" * 4])
def test_a_non_trace_named_et_is_not_a_chakra_trace(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "picture.0.et"
    path.write_bytes(content)
    prefix = f"{path}: not a Chakra trace ("
    messages = set()
    for fmt in (None, "v0.0.4", "v0.0.1"):
        for reference in (False, True):
            with pytest.raises(TraceError) as info:
                if reference:
                    with decode.reference_only():
                        read_nodes(path, format=fmt)
                else:
                    read_nodes(path, format=fmt)
            messages.add(str(info.value))
    assert len(messages) == 1, messages  # compiled and reference decoders, any format
    (message,) = messages
    assert message.startswith(prefix) and message.endswith(")")
    for args in (
        ["validate", path],
        ["feed", path],
        ["inspect", "trace", path],
        ["predict", path, "--predictor", "time"],
        ["convert", path, tmp_path / "c.0.json", "--to", "json"],
    ):
        code, out, err = invoke(*args)
        assert (code, out, err) == (2, "", f"error: {message}\n"), args
    assert not (tmp_path / "c.0.json").exists()


# -- C3: convert checks the comm-group file ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"1": [0, 1', "not a readable JSON comm-group file"),
        ('{"1": [0, "x"]}', "group 1 must be a list of ranks"),
        ("[[0, 1]]", "must be a JSON object"),
    ],
)
def test_convert_refuses_a_malformed_comm_group_file(
    trace: Path, tmp_path: Path, text: str, why: str
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for path in trace.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    (source / "workload.json").write_text(text)
    dest = tmp_path / "dest"
    code, out, err = invoke("convert", source, dest, "--to", "json")
    assert code == 2 and out == "", err
    assert err.startswith(f"error: comm-group file {source}/workload.json: ") and why in err
    assert err.count("\n") == 1
    assert not dest.exists()


# -- C4: a directory as --system ---------------------------------------------------------------


def test_a_directory_as_system_says_so(tmp_path: Path) -> None:
    code, out, err = invoke("predict", "--system", tmp_path, *SMALL)
    assert code == 2 and out == ""
    assert err.startswith(f"error: system {str(tmp_path)!r} is a directory; allowed: a preset (")
    assert "a100-80g" in err and err.rstrip().endswith("or a system JSON file")
    assert err.count("\n") == 1


# -- C5: singular counts -----------------------------------------------------------------------


def test_counts_of_one_are_singular(trace: Path, tmp_path: Path) -> None:
    code, out, err = invoke("validate", trace / "workload.0.et")
    assert code == 0, err
    assert out.startswith("valid: 1 rank, ") and out.splitlines()[0].endswith(
        " nodes, 0 violations, 0 warnings"
    )
    code, _, err = invoke(
        "convert", trace / "workload.0.et", tmp_path / "one.0.json", "--to", "json"
    )
    assert code == 0 and f"wrote 1 file to {tmp_path}" in err
    code, out, err = invoke("search", "--model", "gpt", "--gpus", "1", "--batch", "8", *SMALL)
    assert code == 0, err
    assert out.startswith("gpt on 1 GPU of a100-80g")
    code, out, err = invoke("predict", "--predictor", "time", *SMALL)
    assert code == 0, err
    assert "critical path: 1 run of nodes;" in " ".join(out.split())


# -- C6: -p finds a module in the current directory --------------------------------------------

PLUGIN = """
import stg
from stg.api import Emitter


def write(workload, directory, output_name):
    return []


@stg.hookimpl
def stg_register_emitters(register):
    register(Emitter(name="cwd-nothing", write=write, extension=".txt", description="nothing"))
"""


def test_dash_p_finds_a_module_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the console script ``stg`` has no current directory on sys.path; python -m would
    cwd = str(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", cwd)])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stg_cwd_plugin.py").write_text(PLUGIN)
    path_before = list(sys.path)
    try:
        code, out, err = invoke("-p", "stg_cwd_plugin", "plugins", "list", "--json")
    finally:
        sys.modules.pop("stg_cwd_plugin", None)
    assert code == 0 and "failed" not in err, err
    plugins = json.loads(out)["plugins"]
    assert plugins[-1]["name"] == "stg_cwd_plugin"
    assert plugins[-1]["registers"]["emitters"] == ["cwd-nothing"]
    assert sys.path == path_before  # the directory was on sys.path only while importing
    # a module that is nowhere is still one warning naming it
    code, _, err = invoke("-p", "stg_no_such_plugin", "plugins", "list")
    assert code == 0
    assert "ModuleNotFoundError: No module named 'stg_no_such_plugin'" in err
    assert os.getcwd() == cwd
