"""stg.trace.convert and `stg convert`: lossless v0.0.4 <-> json, lossy v0.0.1, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from formats_samples import pipeline_workload

from stg.cli import main
from stg.emitters import chakra_v004 as chakra_v004_emitter
from stg.errors import UserError
from stg.trace.convert import convert_file, convert_trace
from stg.trace.reader import detect_format, read_metadata, read_nodes
from stg.trace.validate import validate_trace
from stg.trace.writer import write_workload

DATA = Path(__file__).parent / "data"
SHARED = Path(__file__).parent.parent.parent / "shared" / "data" / "chakra"


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    write_workload(
        pipeline_workload(tp=2, pp=2, dp=2), chakra_v004_emitter.EMITTER, tmp_path / "src",
        "workload",
    )
    return tmp_path / "src"


def test_v004_json_v004_round_trip_is_byte_identical(tmp_path: Path, trace: Path) -> None:
    js = convert_trace(trace, tmp_path / "js", "json")  # a directory source: DEST is a dir
    assert [p.name for p in js] == [f"workload.{r}.json" for r in range(8)] + ["workload.json"]
    assert all(detect_format(p) == "json" for p in js[:-1])
    assert validate_trace(tmp_path / "js").ok
    back = convert_trace(tmp_path / "js", str(tmp_path / "back") + "/", "v0.0.4")
    for p in back:
        assert p.read_bytes() == (trace / p.name).read_bytes()


def test_to_v001_merges_deps_and_keeps_groups(tmp_path: Path, trace: Path) -> None:
    out = convert_trace(trace / "workload", tmp_path / "old" / "w.%d.et", "v0.0.1")
    assert out[-1].name == "w.json"
    assert out[-1].read_text() == (trace / "workload.json").read_text()
    for rank in range(8):
        new = read_nodes(trace / f"workload.{rank}.et")
        old = read_nodes(tmp_path / "old" / f"w.{rank}.et")
        assert detect_format(tmp_path / "old" / f"w.{rank}.et") == "v0.0.1"
        assert [n.data_deps for n in old] == [n.data_deps + n.ctrl_deps for n in new]
        assert [n.comm_group for n in old] == [n.comm_group for n in new]
    assert validate_trace(tmp_path / "old", consumer="chakra").ok  # ASTRA-sim reads v0.0.4


@pytest.mark.parametrize(
    "path", [DATA / "one_metadata_node_all_types.0.et", SHARED / "chakra.0.et"],
    ids=lambda p: p.name,
)
def test_single_foreign_file_is_lossless(tmp_path: Path, path: Path) -> None:
    if not path.exists():
        pytest.skip("needs ../shared/data")
    assert convert_file(path, tmp_path / "a.0.json", "json") == len(read_nodes(path))
    convert_file(tmp_path / "a.0.json", tmp_path / "b.0.et", "v0.0.4")
    original, copy = read_nodes(path), read_nodes(tmp_path / "b.0.et")
    assert copy == original
    assert [n.attrs.kinds for n in copy] == [n.attrs.kinds for n in original]
    assert read_metadata(tmp_path / "b.0.et")["attrs"] == read_metadata(path)["attrs"]


def test_feeder_json_to_v004(tmp_path: Path) -> None:
    out = convert_trace(DATA / "small_chakra.0.json", tmp_path, "v0.0.4")
    assert out == [tmp_path / "small_chakra.0.et"]
    assert read_nodes(out[0]) == read_nodes(DATA / "small_chakra.0.json")
    assert read_metadata(out[0])["attrs"]["ngpus"] == 8


def test_inexpressible_v001_writes_nothing(tmp_path: Path) -> None:
    src = SHARED / "generated" / "BROADCAST"
    if not src.parent.exists():
        pytest.skip("needs ../shared/data")
    with pytest.raises(UserError, match=r"BROADCAST has no v0\.0\.1 equivalent"):
        convert_trace(src, tmp_path / "out" / "b", "v0.0.1")
    assert list(tmp_path.iterdir()) == []
    target = tmp_path / "keep.0.et"
    target.write_bytes(b"old")
    with pytest.raises(UserError):
        convert_file(src.parent / "BROADCAST.0.et", target, "v0.0.1")
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]


def test_corrupt_source_writes_nothing(tmp_path: Path, trace: Path) -> None:
    data = (trace / "workload.5.et").read_bytes()
    (trace / "workload.5.et").write_bytes(data[:-4])
    with pytest.raises(UserError, match=r"workload\.5\.et: truncated record"):
        convert_trace(trace, tmp_path / "js" / "workload", "json")
    assert not (tmp_path / "js").exists()


def test_cli(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(trace), str(tmp_path / "j") + "/", "--to", "json"])
    assert exit_info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) == 9
    for args, message in (
        ([str(trace), str(tmp_path / "x"), "--to", "xml"], "--to xml: not known"),
        ([str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "json"], "does not exist"),
        ([str(trace), str(tmp_path / "x"), "--to", "json", "--from", "v2"], "--from v2"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
