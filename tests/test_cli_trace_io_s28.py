"""Trace input and output of ``stg convert``, ``feed``, ``inspect trace`` and ``validate``: bad
paths and names get one error line (exit 2, nothing written), several bad rank files one line,
the comm-group file a trace names is checked, and conversion keeps which attributes a node
gives (v0.0.4 -> json -> v0.0.4 byte-identical on Chakra's own traces)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest

from stg.cli import main
from stg.trace import decode
from stg.trace.convert import convert_trace
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.reader import _open_binary, iter_records
from stg.trace.stats import TraceStats, error_line

DATA = Path(__file__).parent / "data"
GENERATED = DATA / "chakra" / "generated"
CHAKRA_TRACES = sorted({p.name.split(".")[0] for p in GENERATED.glob("*.et")})


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def refused(code: int, out: str, err: str) -> str:
    """The one error line of a refusal (exit 2, nothing on stdout, no traceback)."""
    assert (code, out) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-rank trace (tp 2, pp 2) with its comm-group file, named by its metadata."""
    out = tmp_path_factory.mktemp("t1") / "t1"
    args = ["generate", "--model", "debug", "--tp", "2", "--pp", "2", "--num_stacks", "2",
            "--batch", "4", "--micro_batch", "2", "--seq", "128", "--output_dir", out]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    assert info.value.code in (0, None)
    return out


@pytest.fixture
def trace(generated: Path, tmp_path: Path) -> Path:
    out = tmp_path / "t1"
    shutil.copytree(generated, out)
    return out


# -- 1: a source pattern with two %d ----------------------------------------------------------


def test_convert_refuses_a_source_pattern_with_several_ranks(capsys, trace: Path, tmp_path: Path):
    err = refused(*run(capsys, "convert", trace / "workload.%d.%d.et", tmp_path / "o", "--to",
                       "json"))  # fmt: skip
    assert f"source '{trace}/workload.%d.%d.et' may contain '%d' once" in err
    # another '%' is literal: no such files, and no traceback either
    err = refused(*run(capsys, "convert", trace / "work%load.%d.et", tmp_path / "o", "--to",
                       "json"))  # fmt: skip
    assert "no rank files match" in err
    assert not (tmp_path / "o").exists()


# -- 3: which attributes a node gives survives conversion ------------------------------------


def _convert(capsys, source: Path, dest: str, to: str) -> None:
    code, _, err = run(capsys, "convert", source, dest, "--to", to)
    assert code == 0, err


@pytest.mark.parametrize("name", CHAKRA_TRACES)
def test_chakra_traces_round_trip_through_json_byte_identical(capsys, tmp_path: Path, name: str):
    _convert(capsys, GENERATED / name, f"{tmp_path}/js/", "json")
    _convert(capsys, tmp_path / "js", f"{tmp_path}/back/", "v0.0.4")
    _convert(capsys, GENERATED / name, f"{tmp_path}/direct/", "v0.0.4")
    for rank in (0, 1):
        original = (GENERATED / f"{name}.{rank}.et").read_bytes()
        assert (tmp_path / "back" / f"{name}.{rank}.et").read_bytes() == original
        assert (tmp_path / "direct" / f"{name}.{rank}.et").read_bytes() == original


def _entries(path: Path) -> list[dict]:
    return json.loads(path.read_text())["workload_graph"]


def test_json_output_adds_no_attribute(capsys, tmp_path: Path) -> None:
    _convert(capsys, GENERATED / "one_comm_send_node", f"{tmp_path}/s/", "json")
    (send,) = _entries(tmp_path / "s" / "one_comm_send_node.0.json")
    assert send["tensor_size"] == 1024 and "comm_size" in send["stg_unset"]
    _convert(capsys, GENERATED / "one_metadata_node_all_types", f"{tmp_path}/m/", "json")
    (meta,) = _entries(tmp_path / "m" / "one_metadata_node_all_types.0.json")
    assert meta["stg_unset"] == ["is_cpu_op"] and "num_ops" not in meta
    _convert(capsys, GENERATED / "one_comp_node", f"{tmp_path}/c/", "json")
    (comp,) = _entries(tmp_path / "c" / "one_comp_node.0.json")
    assert "num_ops" not in comp and "tensor_size" not in comp


def _nodes(path: Path) -> list[pb4.Node]:
    nodes = []
    with _open_binary(path) as stream:
        for index, _, data in iter_records(stream, path):
            if index:
                node = pb4.Node()
                node.ParseFromString(data)
                nodes.append(node)
    return nodes


def test_a_pytorch_converted_trace_gains_no_attribute(capsys, tmp_path: Path) -> None:
    source = tmp_path / "chakra.0.et"
    source.write_bytes(gzip.decompress((DATA / "chakra" / "chakra.0.et.gz").read_bytes()))
    _convert(capsys, source, str(tmp_path / "c.0.json"), "json")
    _convert(capsys, tmp_path / "c.0.json", str(tmp_path / "c.0.et"), "v0.0.4")
    before, after = _nodes(source), _nodes(tmp_path / "c.0.et")
    assert len(before) == len(after) == 3664
    for a, b in zip(before, after, strict=True):
        # the same attributes; well-known ones come first (7 nodes had tid before comm_type)
        assert sorted(x.SerializeToString() for x in a.attr) == sorted(
            x.SerializeToString() for x in b.attr
        )
        del a.attr[:], b.attr[:]
        assert a == b


@pytest.mark.parametrize("reference", [False, True], ids=["compiled", "reference"])
def test_stg_traces_still_round_trip(trace: Path, tmp_path: Path, reference: bool) -> None:
    ranks = [f"workload.{r}" for r in range(4)]
    with decode.reference_only() if reference else nullcontext():
        convert_trace(trace, tmp_path / "js", "json")
        convert_trace(tmp_path / "js", tmp_path / "back", "v0.0.4")
        convert_trace(tmp_path / "back", tmp_path / "js2", "json")
        one = GENERATED / "one_metadata_node_all_types"
        convert_trace(one, f"{tmp_path}/mj/", "json")
        convert_trace(tmp_path / "mj", tmp_path / "m2", "v0.0.4")
    for rank in ranks:
        original = (trace / f"{rank}.et").read_bytes()
        assert (tmp_path / "back" / f"{rank}.et").read_bytes() == original
        js = (tmp_path / "js" / f"{rank}.json").read_bytes()
        assert (tmp_path / "js2" / f"{rank}.json").read_bytes() == js
    for rank in (0, 1):
        got = (tmp_path / "m2" / f"one_metadata_node_all_types.{rank}.et").read_bytes()
        assert got == (GENERATED / f"one_metadata_node_all_types.{rank}.et").read_bytes()


# -- 4: one rank file into a name of the other format ----------------------------------------


@pytest.mark.parametrize(
    ("name", "to", "why"),
    [
        ("w0.et", "json", "ends in '.et', the extension of protobuf traces"),
        ("w0.json", "v0.0.1", "ends in '.json', the extension of JSON traces"),
        ("w0.json.gz", "v0.0.4", "ends in '.json', the extension of JSON traces"),
    ],
)
def test_one_file_into_the_other_formats_extension_is_refused(
    capsys, trace: Path, tmp_path: Path, name: str, to: str, why: str
) -> None:
    err = refused(*run(capsys, "convert", trace / "workload.0.et", tmp_path / name, "--to", to))
    assert why in err and "allowed: a name ending in" in err
    assert not (tmp_path / name).exists()
    code, out, _ = run(capsys, "convert", trace / "workload.0.et", tmp_path / "w0.bin", "--to", to)
    assert code == 0 and out.strip() == str(tmp_path / "w0.bin")


# -- 5: the comm-group file the trace's metadata names ---------------------------------------


@pytest.mark.parametrize(
    "command", [["feed"], ["inspect", "trace"], ["inspect", "trace", "--json"]]
)
def test_feed_and_inspect_check_the_named_comm_group_file(
    capsys, trace: Path, command: list[str]
) -> None:
    groups = (trace / "workload.json").read_text()
    (trace / "workload.json").unlink()
    err = refused(*run(capsys, *command, trace))
    assert err == (
        f"error: comm-group file {trace}/workload.json is missing (the trace's metadata names "
        "it); restore it or choose one with --comm_group_file\n"
    )
    (trace / "workload.json").write_text("{bad")
    err = refused(*run(capsys, *command, trace))
    assert err.startswith(f"error: comm-group file {trace}/workload.json: not a readable JSON")
    # --comm_group_file takes its place; one rank file named alone has none
    (trace.parent / "groups.json").write_text(groups)
    assert run(capsys, *command, "--comm_group_file", trace.parent / "groups.json", trace)[0] == 0
    assert run(capsys, *command, trace / "workload.0.et")[0] == 0


def test_inspect_dot_checks_the_named_comm_group_file(capsys, trace: Path, tmp_path: Path):
    (trace / "workload.json").unlink()
    refused(*run(capsys, "inspect", "trace", trace, "--rank", "0", "--dot", tmp_path / "g.dot"))
    assert not (tmp_path / "g.dot").exists()


def test_validate_an_unreadable_comm_group_file_given_is_bad_input(capsys, trace: Path):
    bad = trace.parent / "bad.json"
    bad.write_text("{bad")
    err = refused(*run(capsys, "validate", trace, "--comm_group_file", bad))
    assert err.startswith(f"error: --comm_group_file {bad}: not a readable JSON comm-group file")
    # the trace's own comm-group file is what validate checks: a violation, exit 1
    shutil.copy(bad, trace / "workload.json")
    code, out, _ = run(capsys, "validate", trace, "--json")
    assert code == 1 and "comm-group" in json.loads(out)["errors"]


# -- 6: several unreadable rank files, one line ----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["feed", "--format", "json"], ["feed", "--format", "v0.0.1"],
     ["inspect", "trace", "--format", "json"], ["inspect", "trace", "--json", "--format", "json"]],
)  # fmt: skip
def test_several_unreadable_rank_files_get_one_line(capsys, trace: Path, args: list[str]):
    err = refused(*run(capsys, *args, trace))
    assert err.startswith(f"error: {trace}/workload.0.et: ")
    assert err.endswith(" (the same in 3 more rank files)\n")


def test_error_line_counts_what_differs() -> None:
    def stats(rank: int, error: str | None, unreadable: bool = False) -> TraceStats:
        path = f"t/w.{rank}.et"
        return TraceStats(path, "w", rank, "data", error=error and f"{path}: {error}",
                          unreadable=unreadable)  # fmt: skip

    assert error_line([stats(0, None)]) is None
    assert error_line([stats(0, "cycle"), stats(1, None)]) == "t/w.0.et: cycle"
    mixed = [stats(0, "cycle"), stats(1, "truncated", True), stats(2, "bad", True)]
    assert error_line(mixed) == (
        "t/w.1.et: truncated (and 2 more rank files: 1 unreadable, 1 that cannot be fed)"
    )
    assert (
        error_line(mixed[:2]) == "t/w.1.et: truncated (and 1 more rank file: 1 that cannot be fed)"
    )


# -- 7: destinations that are not file paths, empty paths ------------------------------------


def test_convert_into_a_pipe_or_an_empty_path_is_refused(
    capsys, trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    err = refused(*run(capsys, "convert", trace / "workload.0.et", pipe, "--to", "json"))
    assert (
        err == f"error: cannot write {pipe}: it is not a regular file (a device or a pipe); "
        "stg replaces its outputs whole: give a file path\n"
    )
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for source, dest in ((trace, ""), ("", tmp_path / "out")):
        err = refused(*run(capsys, "convert", source, dest, "--to", "json"))
        what = "destination" if dest == "" else "source"
        assert err == f"error: {what} '': an empty path; give a file, a directory or a prefix\n"
    assert sorted(os.listdir(tmp_path)) == before


def test_converting_stg_traces_gives_what_generate_writes_in_the_other_format(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Presence is kept for third-party traces; stg's own files follow its writers' rules in
    both formats (a generated JSON comm node states ``tensor_size`` 0, which converted to
    v0.0.4 must not become an attribute that the direct v0.0.4 file lacks)."""
    plan = ["--model", "moe", "--num_stacks", "2", "--dmodel", "256", "--dff", "512", "--head",
            "4", "--kvhead", "4", "--seq", "64", "--dvocal", "512", "--experts", "4",
            "--kexperts", "2", "--tp", "2", "--ep", "2", "--batch", "4"]  # fmt: skip
    for fmt in ("json", "chakra-v0.0.4"):
        code, _, err = run(capsys, "generate", *plan, "--format", fmt,
                           "--output_dir", tmp_path / fmt)  # fmt: skip
        assert code == 0, err
    convert_trace(tmp_path / "json", tmp_path / "to_v004", "v0.0.4")
    convert_trace(tmp_path / "chakra-v0.0.4", tmp_path / "to_json", "json")

    def nodes(folder: Path, pattern: str) -> list[list[bytes]]:
        files = sorted(f for f in folder.glob(pattern) if f.name != "workload.json")
        assert files
        if pattern.endswith(".et"):  # the records after the metadata's
            out = []
            for f in files:
                with _open_binary(f) as stream:
                    out.append([payload for _, _, payload in iter_records(stream, f)][1:])
            return out
        return [
            [json.dumps(n, sort_keys=True).encode() for n in json.loads(f.read_text())[
                "workload_graph"]] for f in files
        ]  # fmt: skip

    assert nodes(tmp_path / "to_v004", "*.et") == nodes(tmp_path / "chakra-v0.0.4", "*.et")
    assert nodes(tmp_path / "to_json", "*.json") == nodes(tmp_path / "json", "*.json")
