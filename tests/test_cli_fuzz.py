"""Fuzz the command line: random commands, option names from each command's real option list,
and random values (ints including 0, negative and huge ones, words, paths to missing files,
directories and unwritable targets).

Whatever the input, a command exits 0, 1 or 2, never prints a Python traceback, leaves no
temporary files behind, and writes nothing when it exits 2. Every example runs in a fresh
directory holding only the inputs put there (a small trace, a directory, a file, ...).
Model sizes are kept small (the example may override them with other small values) so that
the test stays fast; work that grows with huge sizes (a huge world, layers or micro-batches)
is left to the other tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from typer._click import Context
from typer.testing import CliRunner

from stg.cli import app

_ROOT = typer.main.get_command(app)
"""The click command tree, for the option lists of each command."""

COMMANDS: tuple[tuple[str, ...], ...] = (
    ("generate",),
    ("predict",),
    ("validate",),
    ("feed",),
    ("inspect", "trace"),
    ("inspect", "model"),
    ("convert",),
    ("plugins", "list"),
    ("plan", "precision"),
    ("bench", "compute"),
    ("bench", "model"),
    ("bench", "calibrate"),
)

SMALL_MODEL: dict[str, str] = {
    "--num_stacks": "1",
    "--dmodel": "64",
    "--dff": "256",
    "--head": "4",
    "--kvhead": "4",
    "--seq": "32",
    "--dvocal": "128",
}
"""Added to every command that takes them, unless the example gives the option itself."""

SIZE_OPTIONS = {name.lstrip("-") for name in SMALL_MODEL}
SMALL_VALUES = ("-1", "0", "1", "2", "3", "4", "8", "16", "64", "x")
"""Values of the model sizes: small (or invalid) only, so that a valid example stays cheap."""

INTS = ("-7", "-1", "0", "1", "2", "3", "4", "8", "64", "2147483648", "9223372036854775808",
        "1000000000000000000000000000000")  # fmt: skip
WORDS = ("", "x", "true", "false", "yes", "none", "full", "selective", "bf16", "fp16", "fp8",
         "int8", "fp32", "nope", "v0.0.4", "v0.0.1", "json", "chakra-v0.0.1", "chakra-v0.0.4",
         "tp,sp,ep,dp,pp", "dp,dp", "pp,dp,tp,sp,ep", "1.5", "1e9", "40GiB", "-1GiB", "nan",
         "inf", "a100-80g", "h100-80g", "all", "time", "memory", "data", "data+ctrl", "gpt",
         "llama", "moe", "1f1b", "gpipe", "interleaved", "astra-sim", "workload.%d",
         "w%d%d", "%s", "bf16,int8", "int8,nope")  # fmt: skip
PATHS = ("trace", "trace/workload.0.et", "trace/workload", "trace/workload.json", "adir",
         "afile", "afile/x.json", "missing", "missing/x.json", "ro", "ro/x.json", "plan.json",
         "bad.json", "new.json", "out", ".", "", "/proc/stg-fuzz.json",
         "/proc/stg-fuzz/x.json")  # fmt: skip

PATH_OPTIONS = frozenset({"output_dir", "output_name", "precision", "system", "timeline", "dot",
                          "out", "consumer", "comm_group_file"})  # fmt: skip


def _command(root: Any, path: tuple[str, ...]) -> Any:
    ctx = Context(root)
    command = root
    for name in path:
        command = command.get_command(ctx, name)
        assert command is not None, path
    return command


def _parameters(root: Any, path: tuple[str, ...]) -> tuple[list[Any], list[Any]]:
    """(options, arguments) of a command, as click declares them."""
    command = _command(root, path)
    options = [p for p in command.params if p.opts and p.opts[0].startswith("-")]
    arguments = [p for p in command.params if p not in options]
    return options, arguments


# -- inputs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The inputs of every example: a small trace of 2 ranks, a directory, a file, ..."""
    root = tmp_path_factory.mktemp("fuzz-inputs")
    args = ["generate", "--dp", "2", "--batch", "2", *_flat(SMALL_MODEL),
            "--output_dir", str(root / "trace")]  # fmt: skip
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (root / "adir").mkdir()
    (root / "afile").write_text("not a trace\n")
    (root / "ro").mkdir()
    (root / "plan.json").write_text('{"ops": {"fc1": "int8"}}\n')
    (root / "bad.json").write_text("{\n")
    return root


def _flat(options: dict[str, str]) -> list[str]:
    return [token for pair in options.items() for token in pair]


def _snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root``: kind, size, mode and modification time."""
    found: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            info = path.lstat()
            size = 0 if stat.S_ISDIR(info.st_mode) else info.st_size
            found[str(path.relative_to(root))] = (info.st_mode, size, info.st_mtime_ns)
    return found


@contextlib.contextmanager
def _fresh_copy(inputs: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stg-fuzz-") as name:
        here = Path(name)
        for entry in inputs.iterdir():
            if entry.is_dir():
                shutil.copytree(entry, here / entry.name)
            else:
                shutil.copy2(entry, here / entry.name)
        os.chmod(here / "ro", 0o555)  # unwritable (for a user other than root)
        old = os.getcwd()
        os.chdir(here)
        try:
            yield here
        finally:
            os.chdir(old)
            os.chmod(here / "ro", 0o755)


# -- examples -------------------------------------------------------------------------------


@st.composite
def invocations(draw: st.DrawFn, root: Any) -> list[str]:
    """One command line: a command, some of its options with random values, arguments."""
    path = draw(st.sampled_from(COMMANDS))
    options, arguments = _parameters(root, path)
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name))
    given: dict[str, str | None] = {}
    for param in chosen:
        spelling = draw(st.sampled_from(param.opts))
        if param.is_flag:
            given[spelling] = None
        elif param.name in SIZE_OPTIONS:
            given[spelling] = draw(st.sampled_from(SMALL_VALUES))
        elif param.name in PATH_OPTIONS:
            given[spelling] = draw(st.sampled_from(PATHS) | st.sampled_from(WORDS))
        else:
            given[spelling] = draw(st.sampled_from(INTS) | st.sampled_from(WORDS))
    args: list[str] = []
    for param in arguments:
        if param.required or draw(st.booleans()):
            pool = ("gpt", "llama", "moe", "nope", "") if param.name == "name" else PATHS
            args.append(draw(st.sampled_from(pool)))
    tokens = list(path)
    names = {p.name for p in options}
    given_names = {p.name for p in chosen}
    for option, value in SMALL_MODEL.items():
        field = option.lstrip("-")
        if field in names and field not in given_names:
            tokens += [option, value]
    for spelling, value in given.items():
        tokens += [spelling] if value is None else [spelling, value]
    tokens += args
    # now and then an unknown option, --help or a stray argument, or a plugin that fails
    extra = draw(st.sampled_from(((),) * 12 + (("--nope",), ("--help",), ("extra",))))
    tokens += list(extra)
    prefix = draw(st.sampled_from(((),) * 5 + (("-p", "stg_fuzz_no_such_module"),)))
    return [*prefix, *tokens]


def _int(tokens: list[str], *names: str, default: int = 1) -> int:
    """The last value of an option spelled as one of ``names``, when it is an integer."""
    value = default
    for i, token in enumerate(tokens[:-1]):
        if token in names:
            try:
                value = int(tokens[i + 1])
            except ValueError:
                pass
    return value


def _cheap(tokens: list[str]) -> bool:
    """False for valid-looking requests whose work grows with a huge value: a world of more
    than 256 ranks (but fewer than the layout refuses), or more than 256 micro-batches."""
    world = 1
    for axis in ("--dp", "--tp", "--sp", "--cp", "--pp", "--ep"):
        world *= max(1, _int(tokens, axis))
    if 256 < world <= 2**24:
        return False
    batch = _int(tokens, "--batch", default=64)
    micro = _int(tokens, "--micro_batch", "--micro-batch", default=batch)
    if batch > 0 and micro > 0 and batch % micro == 0 and 256 < batch // micro <= 500_000_000:
        return False
    virtual = _int(tokens, "--virtual_stages", "--virtual-stages")
    return not 64 < virtual


def _check(inputs: Path, tokens: list[str]) -> None:
    with _fresh_copy(inputs) as here:
        before = _snapshot(here)
        result = CliRunner().invoke(app, tokens, catch_exceptions=False)
        after = _snapshot(here)
    output = result.output
    shown = f"stg {' '.join(repr(t) if not t or ' ' in t else t for t in tokens)}\n{output}"
    assert result.exit_code in (0, 1, 2), shown
    assert "Traceback" not in output, shown
    leftovers = [p for p in after if p not in before and Path(p).name.startswith(".")]
    assert not leftovers, f"temporary files left: {leftovers}\n{shown}"
    if result.exit_code == 2:
        changed = sorted(p for p in after.keys() | before.keys() if after.get(p) != before.get(p))
        assert not changed, f"exit 2 but wrote {changed}\n{shown}"


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(tokens=invocations(_ROOT))
@example(tokens=["predict", *_flat(SMALL_MODEL), "--timeline", "adir"])
@example(tokens=["predict", *_flat(SMALL_MODEL), "--timeline", "/proc/stg-fuzz.json"])
@example(tokens=["predict", *_flat(SMALL_MODEL), "--timeline", "afile/x.json"])
@example(tokens=["predict", "trace", "--timeline", "adir"])
@example(tokens=["inspect", "trace", "trace", "--rank", "0", "--dot", "adir"])
@example(tokens=["inspect", "trace", "trace", "--rank", "0", "--dot", "/proc/stg-fuzz.dot"])
@example(tokens=["inspect", "trace", "trace", "--rank", "0", "--dot", "missing/x.dot"])
@example(tokens=["generate", *_flat(SMALL_MODEL), "--dp", "2147483648", "--batch", "2147483648"])
def test_cli_never_crashes(inputs: Path, tokens: list[str]) -> None:
    assume(_cheap(tokens))
    _check(inputs, tokens)


def test_timeline_mode_follows_umask(inputs: Path) -> None:
    """A written timeline gets the mode of any new file (0666 minus the umask), not 0600."""
    with _fresh_copy(inputs) as here:
        mask = os.umask(0o022)
        try:
            args = ["predict", *_flat(SMALL_MODEL), "--timeline", "t.json"]
            result = CliRunner().invoke(app, args, catch_exceptions=False)
        finally:
            os.umask(mask)
        assert result.exit_code == 0, result.output
        assert stat.S_IMODE((here / "t.json").stat().st_mode) == 0o644
        assert sorted(p.name for p in here.iterdir() if p.name.startswith(".")) == []


def test_no_durations_is_not_a_zero_critical_path(inputs: Path) -> None:
    """A generated trace records no durations: inspect says so instead of "0 us"."""
    with _fresh_copy(inputs):
        result = CliRunner().invoke(app, ["inspect", "trace", "trace"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "0 us" not in result.output
    assert "no durations" in result.output


def test_fuzzing_reads_through_the_fast_decoder() -> None:
    """The examples above read traces through the compiled decoder (stg.trace.decode), when
    it is built (tests/test_decode.py::test_fast_decoder_is_built fails when it should be)."""
    from stg.trace import decode

    if not decode.enabled():
        pytest.skip(decode.status())
    assert decode.status() == "compiled"
