"""File-system faults on every command that writes files: a move across file systems (EXDEV),
a full disk or quota (ENOSPC, EDQUOT), no permission (EACCES) and a read-only file system
(EROFS).

Each fault is one ``error:`` line naming the path and the problem, exit code 2, no traceback,
and nothing left behind: no temporary file, no half-written output, earlier outputs intact.

The faults are injected by patching the call that fails (creating the temporary file,
setting its mode after it is written, or moving it into place), so these tests run anywhere;
a write that fails midway is real everywhere (the file size limit, EFBIG). Where this
process may mount a tmpfs (root with mount permission) the faults also happen for real: a
full tmpfs, a read-only one, and a tmpfs mount point as the output directory (which must
simply work).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from stg.cli import app
from stg.trace.validate import validate_trace

SMALL = ["--num_stacks", "1", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip
PARAM = Path(__file__).resolve().parents[2] / "shared" / "data" / "param"
FAULTS = {
    "EXDEV": errno.EXDEV,
    "ENOSPC": errno.ENOSPC,
    "EDQUOT": getattr(errno, "EDQUOT", errno.ENOSPC),
    "EACCES": errno.EACCES,
    "EROFS": errno.EROFS,
}
SYSCALLS = ("create", "chmod", "rename")
"""Where the fault strikes: creating the temporary file or directory, setting the mode of
the written files (after the data, before the move), moving them into place."""


def _stg(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def _ok(*args: str | Path) -> Any:
    result = _stg(*args)
    assert result.exit_code == 0, result.output
    return result


# -- the commands that write -------------------------------------------------------------------


@dataclass(frozen=True)
class Writer:
    """A command that writes: ``earlier(work)`` puts inputs and earlier outputs into ``work``,
    ``args(work)`` is the command line of the run that meets the fault, ``named(work)`` the
    paths of which the error line must name one."""

    name: str
    earlier: Callable[[Path], None]
    args: Callable[[Path], list[str | Path]]
    named: Callable[[Path], list[Path]]
    needs: tuple[str, ...] = field(default=())


def _trace(work: Path, name: str = "src", *extra: str) -> Path:
    _ok("generate", *SMALL, *extra, "--output_dir", work / name)
    return work / name


def _earlier_trace(work: Path) -> None:
    _trace(work, "out", "--dp", "4")  # more ranks than the run that meets the fault


def _earlier_groups(work: Path) -> None:
    _trace(work, "out", "--dp", "2")  # out/workload.json: removed by the new run, if it works


def _earlier_conversion(work: Path) -> None:
    _trace(work, "src", "--dp", "2")
    _ok("convert", work / "src", work / "conv", "--to", "json")
    _trace(work)  # the source changes: one rank fewer


def _earlier_file(
    name: str, inputs: Callable[[Path], object] = lambda work: None
) -> Callable[[Path], None]:
    """Earlier outputs: ``inputs(work)``, then the file ``name`` as an earlier run left it."""

    def earlier(work: Path) -> None:
        inputs(work)
        (work / name).write_text("earlier output\n")

    return earlier


def _bench_config(work: Path) -> None:
    tensor = {"type": "tensor", "dtype": "float"}
    mm = {"args": [{**tensor, "shape": [16, 8]}, {**tensor, "shape": [8, 4]}]}
    config = {
        "torch.mm": {"input_data_generator": "PyTorch:DefaultDataGenerator",
                     "config": [{"input": [mm]}]}
    }  # fmt: skip
    (work / "c.json").write_text(json.dumps(config))
    (work / "r.jsonl").write_text("earlier output\n")
    (work / "roof.png").write_text("earlier output\n")


SWEEP = ["sweep", "--model", "debug", *SMALL, "--dp", "1,2", "--plot"]

WRITERS: tuple[Writer, ...] = (
    Writer(
        "generate",
        _earlier_trace,
        lambda w: ["generate", *SMALL, "--dp", "2", "--output_dir", w / "out"],
        lambda w: [w / "out"],
    ),
    Writer(
        "generate-new-dir",
        lambda w: None,
        lambda w: ["generate", *SMALL, "--output_dir", w / "new" / "out"],
        lambda w: [w / "new" / "out"],
    ),
    Writer(
        "generate-comm-group-file",
        _earlier_groups,
        lambda w: [
            "generate",
            *SMALL,
            "--dp",
            "2",
            "--comm_group_file",
            "groups.json",
            "--output_dir",
            w / "out",
        ],
        lambda w: [w / "out"],
    ),
    Writer(
        "convert",
        _earlier_conversion,
        lambda w: ["convert", w / "src", w / "conv", "--to", "json", "--force"],
        lambda w: [w / "conv"],
    ),
    Writer(
        "convert-file",
        _earlier_file("one.json", _trace),
        lambda w: [
            "convert",
            w / "src" / "workload.0.et",
            w / "one.json",
            "--to",
            "json",
            "--force",
        ],
        lambda w: [w / "one.json"],
    ),
    Writer(
        "predict-timeline",
        _earlier_file("timeline.json"),
        lambda w: ["predict", *SMALL, "--timeline", w / "timeline.json"],
        lambda w: [w / "timeline.json"],
    ),
    Writer(
        "inspect-trace-dot",
        _earlier_file("rank.dot", _trace),
        lambda w: ["inspect", "trace", w / "src", "--dot", w / "rank.dot"],
        lambda w: [w / "rank.dot"],
    ),
    Writer(
        "inspect-model-dot",
        _earlier_file("block.dot"),
        lambda w: ["inspect", "model", "gpt", "--dot", w / "block.dot"],
        lambda w: [w / "block.dot"],
    ),
    Writer(
        "plan-precision",
        _earlier_file("plan.json"),
        lambda w: ["plan", "precision", *SMALL, "--out", w / "plan.json"],
        lambda w: [w / "plan.json"],
    ),
    Writer(
        "sweep",
        lambda w: _ok(*SWEEP, "-o", w / "sweep"),  # the same sweep again: resumed
        lambda w: [*SWEEP, "-o", w / "sweep"],
        lambda w: [w / "sweep"],
        needs=("pyarrow", "plotly", "matplotlib"),
    ),
    Writer(
        "bench-model",
        _earlier_file("bench_model.json"),
        lambda w: ["bench", "model", *SMALL, "-o", w / "bench_model.json"],
        lambda w: [w / "bench_model.json"],
    ),
    Writer(
        "bench-calibrate",
        _earlier_file("calibration.json"),
        lambda w: [
            "bench",
            "calibrate",
            PARAM / "h100-param_mm_range.jsonl",
            "-o",
            w / "calibration.json",
        ],
        lambda w: [w / "calibration.json"],
    ),
    Writer(
        "bench-compute",
        _bench_config,
        lambda w: [
            "bench",
            "compute",
            w / "c.json",
            "-w",
            "0",
            "-i",
            "1",
            "-o",
            w / "r.jsonl",
            "--plot",
            w / "roof.png",
        ],
        lambda w: [w / "r.jsonl", w / "roof.png"],
        needs=("torch", "matplotlib"),
    ),
)
BY_NAME = {w.name: w for w in WRITERS}


def _needs(writer: Writer) -> None:
    for module in writer.needs:
        pytest.importorskip(module)


# -- checks -----------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a directory."""
    tree: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        if path.is_mount():
            continue
        rel = str(path.relative_to(root))
        tree[rel] = None if path.is_dir() and not path.is_symlink() else path.read_bytes()
    return tree


def _assert_one_error_line(result: Any, problem: str, named: list[Path]) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    assert problem.lower() in line.lower(), line
    assert any(str(path) in line for path in named), (line, named)
    return line


def _no_temporary_files(root: Path) -> None:
    left = [p for p in root.rglob("*") if "stg-tmp" in p.name or p.name.endswith(".tmp")]
    assert not left, left


# -- faults by patching -----------------------------------------------------------------------


class Fault:
    """Makes one call of a kind under ``root`` fail with ``code``: the one after ``skip`` such
    calls succeeded (later ones succeed again). ``fired`` counts the failures (0 or 1)."""

    def __init__(self, root: Path, syscall: str, code: int, skip: int = 0) -> None:
        self.root, self.syscall, self.code, self.skip = root, syscall, code, skip
        self.fired = 0

    def _under_root(self, path: Any) -> bool:
        try:
            return Path(os.fsdecode(path)).absolute().is_relative_to(self.root)
        except TypeError:  # a file descriptor
            return False

    def _strike(self, path: Any) -> None:
        if self.skip > 0 or self.fired:
            self.skip -= 1
            return
        self.fired += 1
        raise OSError(self.code, os.strerror(self.code), os.fsdecode(path))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if self.syscall == "create":
            for name in ("mkstemp", "mkdtemp"):
                real = getattr(tempfile, name)

                def create(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                    place = kwargs.get("dir")
                    if place is not None and self._under_root(place):
                        self._strike(place)
                    return _real(*args, **kwargs)

                monkeypatch.setattr(tempfile, name, create)
        elif self.syscall == "chmod":
            real_chmod = os.chmod

            def chmod(path: Any, mode: int, *args: Any, **kwargs: Any) -> None:
                if self._under_root(path):
                    self._strike(path)
                real_chmod(path, mode, *args, **kwargs)

            monkeypatch.setattr(os, "chmod", chmod)
        else:
            for name in ("rename", "replace"):
                real = getattr(os, name)

                def move(src: Any, dst: Any, *args: Any, _real: Any = real, **kwargs: Any) -> None:
                    # a move into the final place, not into a backup or back out of one
                    source, target = os.fsdecode(src), os.fsdecode(dst)
                    if (
                        self._under_root(dst)
                        and "stg-tmp" not in target
                        and f"{os.sep}.old{os.sep}" not in source
                    ):
                        self._strike(dst)
                    _real(src, dst, *args, **kwargs)

                monkeypatch.setattr(os, name, move)


def _run_with_fault(
    writer: Writer,
    work: Path,
    syscall: str,
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    skip: int = 0,
) -> tuple[Any, Fault]:
    fault = Fault(work, syscall, code, skip)
    with monkeypatch.context() as patch:
        fault.install(patch)
        result = _stg(*writer.args(work))
    return result, fault


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("syscall", SYSCALLS)
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_fault_is_one_line_and_leaves_nothing_behind(
    name: str, syscall: str, fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = BY_NAME[name]
    _needs(writer)
    work = tmp_path.resolve()
    writer.earlier(work)
    before = _snapshot(work)
    code = FAULTS[fault]
    result, injected = _run_with_fault(writer, work, syscall, code, monkeypatch)
    assert injected.fired, f"{name} made no {syscall} call under {work}"
    _assert_one_error_line(result, os.strerror(code), writer.named(work))
    assert _snapshot(work) == before


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes that grow a file beyond ``limit`` bytes fail with EFBIG, in the kernel."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_write_that_fails_midway(name: str, tmp_path: Path) -> None:
    """A real fault while the data is written (the file size limit: no mount needed)."""
    writer = BY_NAME[name]
    _needs(writer)
    work = tmp_path.resolve()
    writer.earlier(work)
    before = _snapshot(work)
    args = writer.args(work)
    with _file_size_limit(8):
        result = _stg(*args)
    _assert_one_error_line(result, os.strerror(errno.EFBIG), writer.named(work))
    assert _snapshot(work) == before


def test_a_switch_that_fails_halfway_puts_every_file_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = BY_NAME["generate-comm-group-file"]
    work = tmp_path.resolve()
    writer.earlier(work)
    before = _snapshot(work)
    # the first rank file is in place when the second cannot be moved
    result, fault = _run_with_fault(writer, work, "rename", errno.ENOSPC, monkeypatch, skip=1)
    assert fault.fired == 1
    _assert_one_error_line(result, "No space left on device", [work / "out"])
    assert _snapshot(work) == before
    assert validate_trace(work / "out").ok


def test_results_and_their_plot_are_written_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = BY_NAME["bench-compute"]
    _needs(writer)
    work = tmp_path.resolve()
    writer.earlier(work)
    before = _snapshot(work)
    # the plot's temporary file fails after the results are complete (the results'
    # temporary file comes first)
    result, fault = _run_with_fault(writer, work, "create", errno.ENOSPC, monkeypatch, skip=1)
    assert fault.fired == 1
    _assert_one_error_line(result, "No space left on device", [work / "roof.png"])
    assert _snapshot(work) == before


def test_the_sweep_plots_are_written_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = BY_NAME["sweep"]
    _needs(writer)
    work = tmp_path.resolve()
    writer.earlier(work)
    before = _snapshot(work)
    # the tables, then sweep.html (moved aside, moved in), then sweep.png's move fails
    result, fault = _run_with_fault(writer, work, "rename", errno.EDQUOT, monkeypatch, skip=5)
    assert fault.fired == 1
    _assert_one_error_line(result, os.strerror(errno.EDQUOT), [work / "sweep" / "sweep.png"])
    assert _snapshot(work) == before
    _ok(*writer.args(work))
    assert _snapshot(work) == before  # same sweep, same bytes (the HTML included)


@pytest.mark.parametrize("earlier", [True, False])
def test_a_json_file_and_what_follows_it(tmp_path: Path, earlier: bool) -> None:
    from stg.bench.results import write_json_atomic

    target = tmp_path / "net.json"
    if earlier:
        target.write_text("earlier output\n")
    before = _snapshot(tmp_path)

    def plot() -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "busbw.png"))

    with pytest.raises(OSError):
        write_json_atomic(target, {"rows": []}, then=plot)
    assert _snapshot(tmp_path) == before
    write_json_atomic(target, {"rows": []}, then=lambda: None)
    assert json.loads(target.read_text()) == {"rows": []}
    assert sorted(os.listdir(tmp_path)) == ["net.json"]


def test_files_that_cannot_be_put_back_wait_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path.resolve()
    out = _trace(work, "out", "--dp", "4")
    before = _snapshot(out)
    real_rename, real_replace = os.rename, os.replace

    def failing(src: Any, dst: Any) -> None:
        source = os.fsdecode(src)
        if "stg-tmp" in source and f"{os.sep}.old{os.sep}" not in source:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(dst))
        real_rename(src, dst)

    def no_way_back(src: Any, dst: Any) -> None:
        if f"{os.sep}.old{os.sep}" in os.fsdecode(src):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fsdecode(dst))
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", failing)
        patch.setattr(os, "replace", no_way_back)
        result = _stg("generate", *SMALL, "--dp", "2", "--output_dir", out)
    _assert_one_error_line(result, "No space left on device", [out])
    kept = [p for p in out.iterdir() if "stg-tmp" in p.name]
    assert len(kept) == 1 and sorted(os.listdir(kept[0] / ".old")) == sorted(before)
    then = time.time() - 60
    os.utime(kept[0], (then, then))
    _trace(work, "out", "--output_name", "other")  # the next run puts them back first
    assert {k: v for k, v in _snapshot(out).items() if not k.startswith("other")} == before


def test_a_fault_the_writers_miss_is_still_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stg.trace.writer

    target = tmp_path / "out" / "workload.json"

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/x/.tmp", None, str(target))

    monkeypatch.setattr(stg.trace.writer, "write_workload", full)
    result = _stg("generate", *SMALL, "--output_dir", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {target}: No space left on device\n"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(BY_NAME)),
    syscall=st.sampled_from(SYSCALLS),
    fault=st.sampled_from(sorted(FAULTS)),
    skip=st.integers(min_value=0, max_value=3),
)
def test_any_fault_anywhere(
    name: str, syscall: str, fault: str, skip: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever call fails, after however many succeeded: exit 2 with one line and the old
    state, or (the fault never came) exit 0 with no temporary file left."""
    writer = BY_NAME[name]
    for module in writer.needs:
        try:
            __import__(module)
        except ImportError:
            return
    with tempfile.TemporaryDirectory() as place:
        work = Path(place).resolve()
        writer.earlier(work)
        before = _snapshot(work)
        result, injected = _run_with_fault(writer, work, syscall, FAULTS[fault], monkeypatch, skip)
        if injected.fired:
            _assert_one_error_line(result, os.strerror(FAULTS[fault]), writer.named(work))
            assert _snapshot(work) == before
        else:
            assert result.exit_code == 0, result.output
            _no_temporary_files(work)


# -- real faults on a tmpfs -------------------------------------------------------------------


def _mount(point: Path, options: str) -> None:
    point.mkdir(parents=True, exist_ok=True)
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts() -> Iterator[Callable[[Path, str], Path]]:
    """``mount(point, options)`` mounts a tmpfs at ``point`` (skips where it cannot);
    everything mounted is unmounted at the end."""
    mounted: list[Path] = []

    def mount(point: Path, options: str) -> Path:
        _mount(point, options)
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def _fill(directory: Path) -> None:
    """Fill the file system of ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as filler:
        for chunk in (4096, 1):
            try:
                while True:
                    filler.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_generate_and_convert_into_a_mount_point(
    tmp_path: Path, mounts: Callable[[Path, str], Path]
) -> None:
    work = tmp_path.resolve()
    volume = mounts(work / "volume", "size=4m")
    _trace(work, "volume", "--dp", "4")
    _trace(work, "volume", "--dp", "2")  # into the existing mount point: moved within it
    assert sorted(os.listdir(volume)) == [
        "workload.0.et", "workload.1.et", "workload.json"
    ]  # fmt: skip
    assert validate_trace(volume).ok
    _trace(work, "src")
    converted = mounts(work / "converted", "size=4m")
    _ok("convert", work / "src", converted, "--to", "json")
    assert validate_trace(converted).ok
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


FULL_DISK = ("generate", "generate-comm-group-file", "convert", "convert-file",
             "predict-timeline", "inspect-trace-dot", "plan-precision", "sweep", "bench-model",
             "bench-calibrate")  # fmt: skip


@pytest.mark.parametrize("name", FULL_DISK)
def test_a_full_disk(name: str, tmp_path: Path, mounts: Callable[[Path, str], Path]) -> None:
    writer = BY_NAME[name]
    _needs(writer)
    work = mounts(tmp_path.resolve() / "disk", "size=512k")
    writer.earlier(work)
    _fill(work)
    before = _snapshot(work)
    result = _stg(*writer.args(work))
    _assert_one_error_line(result, "No space left on device", writer.named(work))
    assert _snapshot(work) == before


@pytest.mark.parametrize("name", FULL_DISK)
def test_a_read_only_file_system(
    name: str, tmp_path: Path, mounts: Callable[[Path, str], Path]
) -> None:
    writer = BY_NAME[name]
    _needs(writer)
    work = mounts(tmp_path.resolve() / "ro", "size=4m")
    writer.earlier(work)
    before = _snapshot(work)
    remount = ["mount", "-o", "remount,ro", str(work)]
    if subprocess.run(remount, capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    result = _stg(*writer.args(work))
    _assert_one_error_line(result, "read-only file system", writer.named(work))
    assert _snapshot(work) == before
