"""The compiled fast path of the trace reader against the pure-Python reference decoder.

Every reader goes through :mod:`stg.trace.decode`; these tests check that its results are the
reference's on every test trace and on fuzzed inputs: whole nodes (values, value types,
attribute kinds, doc strings, extras), error messages, the feeder statistics of ``stg feed``,
the reports of ``stg validate``, and predictions replayed once per class of identical ranks.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from stg.cli import app
from stg.core.workload import CollectiveType, Node, NodeType
from stg.errors import TraceError
from stg.trace import chakra_v004, decode, reader
from stg.trace.proto import chakra_v001_pb2 as pb1
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.stats import TraceFile, analyze
from stg.trace.validate import validate_trace
from stg.trace.writer import format_comm_groups, varint

HERE = Path(__file__).parent
DATA = HERE / "data"
SHARED = HERE.parent.parent / "shared" / "data" / "chakra"
SMALL = ["--num_stacks", "2", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

needs_fast = pytest.mark.skipif(not decode.enabled(), reason=f"fast decoder: {decode.status()}")


def test_fast_decoder_is_built() -> None:
    """The fuzz tests and CI run the compiled decoder; a stale or missing build fails here."""
    if os.environ.get("STG_DECODER", "").lower() in ("python", "reference"):
        pytest.skip("STG_DECODER=python")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: stg reads traces with the reference decoder")
    assert decode.enabled(), decode.status()


# -- helpers ----------------------------------------------------------------------------------


def outcome(path: Path, fmt: str | None = None) -> tuple[list[Node], str | None]:
    """The nodes read before the end or an error, and the error."""
    nodes: list[Node] = []
    try:
        for node in reader.iter_nodes(path, format=fmt):
            nodes.append(node)
    except TraceError as exc:
        return nodes, f"TraceError: {exc}"
    return nodes, None


@contextmanager
def tiny_reads(size: int = 5) -> Iterator[None]:
    """The compiled reader asks its stream for ``size`` bytes at a time: every record, JSON
    entry and value spans reads, so the refills of the bounded buffer are exercised."""
    saved = decode.CHUNK
    decode.CHUNK = size
    try:
        yield
    finally:
        decode.CHUNK = saved


def metadata_outcome(path: Path) -> Any:
    """read_metadata's result (attribute kinds and docs included) or its error."""
    try:
        meta = reader.read_metadata(path)
    except TraceError as exc:
        return f"TraceError: {exc}"
    attrs = meta["attrs"]
    kinds = [list(getattr(attrs, slot).items()) for slot in ("kinds", "docs", "extras")]
    return meta["format"], meta["version"], list(attrs.items()), kinds


def assert_same_reading(path: Path, fmt: str | None = None) -> tuple[list[Node], str | None]:
    fast = outcome(path, fmt)
    with tiny_reads():
        fast_tiny = outcome(path, fmt)
    with decode.reference_only():
        slow = outcome(path, fmt)
    for got in (fast, fast_tiny):
        assert got[1] == slow[1]
        assert len(got[0]) == len(slow[0])
        for a, b in zip(got[0], slow[0], strict=True):
            assert decode.same_node(a, b), (a, b)
    if ".json" in path.name:
        # the compiled JSON metadata reader (streaming) against json.load
        with decode.reference_only():
            expected = metadata_outcome(path)
        assert metadata_outcome(path) == expected
        with tiny_reads():
            assert metadata_outcome(path) == expected
    return fast


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` with the fast path, then with the reference only."""
    fast = fn()
    with decode.reference_only():
        slow = fn()
    return fast, slow


def stats_of(path: Path, **kwargs: Any) -> dict[str, Any]:
    return analyze(TraceFile("t", 0, path), **kwargs).to_dict()


def report_of(path: Path, **kwargs: Any) -> dict[str, Any]:
    return validate_trace(path, jobs=1, **kwargs).to_dict()


@pytest.fixture(scope="module")
def small_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2x2x2 trace in every format, and gzipped copies."""
    root = tmp_path_factory.mktemp("decode")
    runner = CliRunner()
    out = root / "v0.0.4"
    args = ["generate", "--dp", "2", "--tp", "2", "--pp", "2", "--batch", "4", "--micro_batch",
            "2", *SMALL, "--output_dir", str(out)]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    traces = {"v0.0.4": out}
    for fmt in ("v0.0.1", "json"):
        result = runner.invoke(app, ["convert", str(out), str(root / fmt), "--to", fmt])
        assert result.exit_code == 0, result.output
        traces[fmt] = root / fmt
    for fmt in ("v0.0.4", "json"):
        gz = root / f"{fmt}-gz"
        gz.mkdir()
        for f in traces[fmt].iterdir():
            data = f.read_bytes()
            if ".0." in f.name or ".1." in f.name:
                (gz / (f.name + ".gz")).write_bytes(gzip.compress(data, mtime=0))
        traces[f"{fmt}-gz"] = gz
    return traces


def _test_traces() -> list[Path]:
    files = sorted(DATA.glob("*.et")) + sorted(DATA.glob("*.json"))
    files += sorted(DATA.glob("chakra/*.gz"))
    if SHARED.is_dir():
        files += sorted(SHARED.glob("**/*.et")) + sorted(SHARED.glob("*.json"))
    return files


# -- whole nodes ------------------------------------------------------------------------------


@needs_fast
@pytest.mark.parametrize("path", _test_traces(), ids=lambda p: p.name)
def test_same_nodes_on_every_test_trace(path: Path) -> None:
    nodes, error = assert_same_reading(path)
    assert nodes and error is None


@needs_fast
def test_same_nodes_on_generated_traces(small_traces: dict[str, Path]) -> None:
    for trace in small_traces.values():
        for path in sorted(trace.iterdir()):
            if path.name.split(".")[-1] in ("et", "gz") or ".0." in path.name:
                nodes, error = assert_same_reading(path)
                assert nodes and error is None, path


@needs_fast
@pytest.mark.parametrize("fmt", ["v0.0.4", "json", "json-gz"])
def test_streaming_reads_in_small_chunks(small_traces: dict[str, Path], fmt: str) -> None:
    path = next(p for p in sorted(small_traces[fmt].iterdir()) if ".0." in p.name)
    expected = outcome(path)
    for size in (1, 3, 64):
        with tiny_reads(size):
            got = outcome(path)
            fast, slow = both(lambda: stats_of(path, window=3))
        assert fast == slow
        assert [n.id for n in got[0]] == [n.id for n in expected[0]]
        assert all(decode.same_node(a, b) for a, b in zip(got[0], expected[0], strict=True))


@needs_fast
def test_json_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """A JSON rank file streams: the compiled reader's buffer holds a read and an entry, never
    the document (tracemalloc counts the extension's PyMem allocations)."""
    import tracemalloc

    name = "aten::mm " + "x" * 250
    entries = [{"Id": i, "Name": name, "NodeType": 4, "data_deps": [i - 1] if i else [],
                "num_ops": 10, "tensor_size": 4} for i in range(40_000)]  # fmt: skip
    path = tmp_path / "big.0.json"
    path.write_text(json.dumps({"workload_graph": entries, "global_metadata": {}}))
    size = path.stat().st_size
    assert size > 12e6
    tracemalloc.start()
    try:
        cols = decode.columns(path, "json", ("id", "data"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cols is not None and cols["id"].tolist() == list(range(40_000))
    # the columns (1.3 MB, growing by doubling, then copied out) and a few reads of
    # decode.CHUNK; reading the document whole would take its 12 MB
    assert peak < 4.5e6 + 4 * decode.CHUNK < size / 2, (peak, size)


@needs_fast
def test_columns_match_the_nodes(small_traces: dict[str, Path]) -> None:
    path = small_traces["v0.0.4"] / "workload.1.et"
    nodes = reader.read_nodes(path)
    cols = decode.columns(path, "v0.0.4", ("id", "num_ops", "comm_group", "data", "type"))
    assert cols is not None
    assert cols["id"].tolist() == [n.id for n in nodes]
    assert cols["type"].tolist() == [int(n.type) for n in nodes]
    assert cols["num_ops"].tolist() == [n.num_ops for n in nodes]
    off, data = cols["data_off"].tolist(), cols["data"].tolist()
    assert [tuple(data[off[i] : off[i + 1]]) for i in range(len(nodes))] == [
        n.data_deps for n in nodes
    ]


# -- fuzzed records ---------------------------------------------------------------------------

KINDS = list(reader.SCALAR_KINDS) + list(reader.LIST_KINDS)
NAMES = ["is_cpu_op", "num_ops", "tensor_size", "comm_type", "comm_size", "comm_src",
         "comm_dst", "comm_tag", "dtype", "pg_name", "comm_priority", "involved_dim", "gemm",
         "rf_id", ""]  # fmt: skip


def _scalar(kind: str) -> st.SearchStrategy[Any]:
    base = kind.removesuffix("_val")
    bounds = {"int32": 31, "sint32": 31, "sfixed32": 31, "int64": 63, "sint64": 63,
              "sfixed64": 63}  # fmt: skip
    if base in bounds:
        b = bounds[base]
        return st.integers(-(2**b), 2**b - 1) | st.sampled_from([0, 1, -1, 7])
    if base in ("uint32", "fixed32"):
        return st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 9])
    if base in ("uint64", "fixed64"):
        return st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2, 9, 12])
    if base == "bool":
        return st.booleans()
    if base == "string":
        return st.text(max_size=6) | st.sampled_from(["12", "007", "bf16", "x", "", "1" * 25])
    if base == "bytes":
        return st.binary(max_size=6)
    if base == "float":
        return st.floats(width=32, allow_nan=False)
    return st.floats(allow_nan=False)


@st.composite
def attributes(draw: st.DrawFn) -> tuple[str, str, Any, str]:
    kind = draw(st.sampled_from(KINDS))
    name = draw(st.sampled_from(NAMES) | st.text(max_size=4))
    if kind.endswith("_list"):
        value = draw(st.lists(_scalar(kind[:-5] + "_val"), max_size=4))
    else:
        value = draw(_scalar(kind))
    return name, kind, value, draw(st.sampled_from(["", "", "doc"]))


@st.composite
def v004_nodes(draw: st.DrawFn) -> bytes:
    msg = pb4.Node()
    msg.id = draw(st.integers(0, 12) | st.integers(0, 2**64 - 1))
    msg.name = draw(st.text(max_size=5))
    msg.type = draw(st.integers(0, 7) | st.sampled_from([8, -1]))
    msg.data_deps.extend(draw(st.lists(st.integers(0, 12), max_size=4)))
    msg.ctrl_deps.extend(draw(st.lists(st.integers(0, 12), max_size=3)))
    msg.start_time_micros = draw(st.sampled_from([0, 0, 5, 2**63]))
    msg.duration_micros = draw(st.sampled_from([0, 3, 2**63 + 5]))
    for io_name in ("inputs", "outputs"):
        if draw(st.booleans()):
            io = getattr(msg, io_name)
            io.SetInParent()
            io.values = draw(st.text(max_size=3))
    for name, kind, value, doc in draw(st.lists(attributes(), max_size=6)):
        attr = msg.attr.add(name=name)
        if doc:
            attr.doc_string = doc
        if kind.endswith("_list"):
            getattr(attr, kind).values.extend(value)
        else:
            setattr(attr, kind, value)
    return msg.SerializeToString()


@st.composite
def v001_nodes(draw: st.DrawFn) -> bytes:
    msg = pb1.Node(id=draw(st.integers(0, 12)), name=draw(st.text(max_size=4)))
    msg.node_type = draw(st.integers(0, 6))
    msg.parent.extend(draw(st.lists(st.integers(0, 12), max_size=4)))
    for field, values in (
        ("tensor_size", st.integers(0, 2**64 - 1)), ("num_ops", st.integers(0, 2**64 - 1)),
        ("comm_type", st.integers(0, 4)), ("communicator_id", st.integers(0, 2**32 - 1)),
        ("comm_src", st.integers(0, 9)), ("comm_dst", st.integers(0, 9)),
        ("comm_tag", st.integers(0, 9)), ("comm_priority", st.integers(0, 9)),
        ("tensor_loc", st.integers(0, 2)), ("input_tensor_size", st.integers(0, 99)),
        ("simulated_run_time", st.integers(0, 2**64 - 1)),
    ):  # fmt: skip
        if draw(st.booleans()):
            setattr(msg, field, draw(values))
    msg.involved_dim.extend(draw(st.lists(st.booleans(), max_size=3)))
    return msg.SerializeToString()


def frame(payload: bytes) -> bytes:
    """A record as the framing has it (empty ones too: readers must reject them)."""
    return varint(len(payload)) + payload


def _v004_file(records: list[bytes]) -> bytes:
    meta = pb4.GlobalMetadata(version="0.0.4").SerializeToString()
    return frame(meta) + b"".join(frame(r) for r in records)


def _check_file(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    assert_same_reading(path)
    fast, slow = both(lambda: stats_of(path, window=2))
    assert fast == slow
    fast, slow = both(lambda: report_of(path))
    assert fast == slow


@needs_fast
@FUZZ
@given(records=st.lists(v004_nodes(), min_size=1, max_size=5))
def test_fuzzed_v004_records(tmp_path: Path, records: list[bytes]) -> None:
    _check_file(tmp_path, "f.0.et", _v004_file(records))


@needs_fast
@FUZZ
@given(records=st.lists(v001_nodes(), min_size=1, max_size=5))
def test_fuzzed_v001_records(tmp_path: Path, records: list[bytes]) -> None:
    path = tmp_path / "f.0.et"
    path.write_bytes(b"".join(frame(r) for r in records))
    assert_same_reading(path, "v0.0.1")
    fast, slow = both(lambda: stats_of(path, format="v0.0.1"))
    assert fast == slow


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        if not out:
            break
        i = where % len(out)
        if kind == 0:
            out[i] = value
        elif kind == 1:
            del out[i:]
        elif kind == 2:
            out[i:i] = bytes([value])
        else:
            out[i : i + 3] = out[i : i + 3] * 2
    return bytes(out)


EDITS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module")
def seeds(small_traces: dict[str, Path]) -> dict[str, bytes]:
    """Small real files to mutate."""
    out = {
        "v0.0.4": (small_traces["v0.0.4"] / "workload.1.et").read_bytes(),
        "v0.0.1": (small_traces["v0.0.1"] / "workload.1.et").read_bytes(),
        "json": (small_traces["json"] / "workload.1.json").read_bytes(),
        "all kinds": (DATA / "one_metadata_node_all_types.0.et").read_bytes(),
    }
    return out


@needs_fast
@FUZZ
@given(seed=st.sampled_from(["v0.0.4", "v0.0.1", "json", "all kinds"]), edits=EDITS)
def test_fuzzed_bytes(tmp_path: Path, seeds: dict[str, bytes], seed: str, edits: list) -> None:
    name = "f.0.json" if seed == "json" else "f.0.et"
    fmt = {"v0.0.1": "v0.0.1"}.get(seed)
    path = tmp_path / name
    path.write_bytes(_mutate(seeds[seed], edits))
    assert_same_reading(path, fmt)
    fast, slow = both(lambda: stats_of(path, format=fmt, window=4))
    assert fast == slow
    if fmt is None:
        fast, slow = both(lambda: report_of(path))
        assert fast == slow


JSON_VALUES = (
    st.integers(-3, 12) | st.sampled_from([2**63, -(2**70), True, False, None, 1.5, "7", "x"])
)


@st.composite
def json_entries(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "Id": draw(st.integers(0, 9) | JSON_VALUES),
        "Name": draw(st.text(max_size=4) | st.sampled_from(["a\\b", "é\n", 'q"'])),
        "NodeType": draw(st.integers(0, 7) | JSON_VALUES),
    }
    optional = {
        "is_cpu_op": st.booleans() | JSON_VALUES,
        "runtime": JSON_VALUES,
        "data_deps": st.lists(st.integers(0, 9), max_size=3) | JSON_VALUES,
        "ctrl_deps": st.lists(st.integers(0, 9), max_size=2),
        "ctrlDeps": st.lists(st.integers(0, 9), max_size=2),
        "num_ops": JSON_VALUES, "tensor_size": JSON_VALUES, "comm_size": JSON_VALUES,
        "comm_type": st.integers(-1, 10) | JSON_VALUES,
        "comm_priority": JSON_VALUES, "comm_src": JSON_VALUES, "comm_dst": JSON_VALUES,
        "comm_tag": JSON_VALUES,
        "pg_name": st.sampled_from(["1", "02", "x", "", "\u0661", None, 3]),
        "dtype": st.sampled_from(["bf16", None, 3, "é"]),
        "start_time_micros": JSON_VALUES,
        "inputs": st.fixed_dictionaries({}, optional={"values": st.text(max_size=3),
                                                      "types": JSON_VALUES}),
        "stg_unset": st.lists(st.sampled_from(["comm_src", "comm_tag", "comm_type", "x"])),
        "other": JSON_VALUES,
        "attr": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["a", "b", "pg_name", "comm_priority", "a"])},
                optional={
                    "int64_val": JSON_VALUES, "bool_list": st.lists(st.booleans(), max_size=2),
                    "double_val": st.floats(allow_nan=False) | JSON_VALUES,
                    "string_val": st.text(max_size=3), "doc_string": st.sampled_from(["", "d"]),
                    "float_list": st.lists(st.floats(allow_nan=False, width=32), max_size=2),
                },
            ),
            max_size=3,
        ),
    }  # fmt: skip
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=8, unique=True)):
        entry[key] = draw(optional[key])
    return entry


@needs_fast
@FUZZ
@given(entries=st.lists(json_entries(), min_size=1, max_size=4), indent=st.booleans())
def test_fuzzed_json(tmp_path: Path, entries: list[dict[str, Any]], indent: bool) -> None:
    path = tmp_path / "f.0.json"
    doc = {"global_metadata": {"version": "0.0.4"}, "workload_graph": entries, "x": [1.5]}
    path.write_text(json.dumps(doc, indent=1 if indent else None, ensure_ascii=False))
    assert_same_reading(path)
    fast, slow = both(lambda: stats_of(path))
    assert fast == slow


# -- feeder statistics, validation ------------------------------------------------------------


@st.composite
def dags(draw: st.DrawFn) -> list[Node]:
    """Mostly well-formed graphs: ids in some order, deps often backwards, now and then
    forwards, dangling, repeated or self-referencing."""
    n = draw(st.integers(1, 30))
    ids = list(range(n))
    if draw(st.booleans()):
        ids = draw(st.permutations(ids))
    if draw(st.integers(0, 9)) == 0:
        ids[-1] = ids[0]  # a duplicate id
    nodes = []
    for pos, nid in enumerate(ids):
        earlier = ids[:pos]
        pool = st.sampled_from(earlier) if earlier else st.nothing()
        data = draw(st.lists(pool, max_size=3, unique=True)) if earlier else []
        ctrl = draw(st.lists(pool, max_size=2, unique=True)) if earlier else []
        odd = draw(st.integers(0, 19))
        if odd == 0:
            data.append(draw(st.integers(0, n + 3)))  # forward, dangling or self
        elif odd == 1 and data:
            data.append(data[0])  # repeated
        elif odd == 2:
            ctrl.append(draw(st.integers(0, n + 3)))
        kind = draw(st.sampled_from([NodeType.COMP, NodeType.COMP, NodeType.COMM_COLL,
                                     NodeType.COMM_SEND, NodeType.MEM_LOAD]))  # fmt: skip
        nodes.append(
            Node(
                id=nid, name=f"n{nid}", type=kind, data_deps=tuple(data), ctrl_deps=tuple(ctrl),
                num_ops=draw(st.integers(0, 5)), tensor_size=draw(st.integers(0, 5)),
                comm_type=CollectiveType.ALL_GATHER if kind is NodeType.COMM_COLL else None,
                comm_size=draw(st.integers(0, 9)), runtime=draw(st.integers(0, 4)),
            )
        )  # fmt: skip
    return nodes


@needs_fast
@FUZZ
@given(
    nodes=dags(),
    window=st.sampled_from([1, 2, 3, 5, 65536]),
    deps=st.sampled_from(["data", "data+ctrl"]),
)
def test_drain_matches_the_feeder(
    tmp_path: Path, nodes: list[Node], window: int, deps: str
) -> None:
    path = tmp_path / "d.0.et"
    path.write_bytes(chakra_v004.encode_nodes(nodes))
    fast, slow = both(lambda: stats_of(path, window=window, deps=deps))
    assert fast == slow


def _comm_rank(draw: st.DrawFn, rank: int, world: int) -> list[Node]:
    nodes: list[Node] = []
    for i in range(draw(st.integers(1, 8))):
        deps = (i - 1,) if i and draw(st.integers(0, 3)) else ()
        kind = draw(st.integers(0, 3))
        size = draw(st.sampled_from([8, 64]))
        if kind == 0:
            nodes.append(Node(id=i, name=f"c{i}", type=NodeType.COMP, data_deps=deps,
                              num_ops=draw(st.sampled_from([0, 10])), tensor_size=4))
        elif kind == 1:
            ctype = draw(st.sampled_from([CollectiveType.ALL_REDUCE, CollectiveType.ALL_GATHER,
                                          CollectiveType.BROADCAST]))
            nodes.append(Node(id=i, name=f"a{i}", type=NodeType.COMM_COLL, data_deps=deps,
                              comm_type=ctype, comm_size=size,
                              comm_group=draw(st.sampled_from([1, 2, None]))))
        else:
            peer = draw(st.integers(0, world))
            tag = draw(st.sampled_from([1, 2, 500_000_000]))
            if kind == 2:
                nodes.append(Node(id=i, name=f"s{i}", type=NodeType.COMM_SEND, data_deps=deps,
                                  comm_src=rank, comm_dst=peer, comm_tag=tag, comm_size=size))
            else:
                nodes.append(Node(id=i, name=f"r{i}", type=NodeType.COMM_RECV, data_deps=deps,
                                  comm_src=peer, comm_dst=rank, comm_tag=tag, comm_size=size))
    return nodes  # fmt: skip


@st.composite
def comm_traces(draw: st.DrawFn) -> tuple[list[list[Node]], dict[int, tuple[int, ...]]]:
    world = draw(st.integers(2, 3))
    ranks = [_comm_rank(draw, r, world) for r in range(world)]
    groups = {1: tuple(range(world)), 2: (0, 1)}
    if draw(st.booleans()):
        groups = {1: tuple(range(world))}
    return ranks, groups


@needs_fast
@FUZZ
@given(trace=comm_traces(), consumer=st.sampled_from(["astra-sim", "chakra"]))
def test_validate_matches_the_reference(tmp_path: Path, trace: tuple, consumer: str) -> None:
    ranks, groups = trace
    out = tmp_path / "t"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    for rank, nodes in enumerate(ranks):
        (out / f"w.{rank}.et").write_bytes(chakra_v004.encode_nodes(nodes))
    (out / "w.json").write_text(format_comm_groups(groups))
    fast, slow = both(lambda: report_of(out, consumer=consumer))
    assert fast == slow


@needs_fast
def test_deadlock_found_on_skeletons_is_reported_as_the_whole_graphs_do(tmp_path: Path) -> None:
    """Each rank receives before it sends: the skeleton check finds the deadlock, the whole
    graphs name it (counts of blocked nodes included)."""

    def rank(r: int) -> list[Node]:
        other = 1 - r
        return [
            Node(id=0, name="c", type=NodeType.COMP, num_ops=1, tensor_size=1),
            Node(id=1, name="r", type=NodeType.COMM_RECV, data_deps=(0,), comm_src=other,
                 comm_dst=r, comm_tag=1, comm_size=8),
            Node(id=2, name="c2", type=NodeType.COMP, data_deps=(1,), num_ops=1, tensor_size=1),
            Node(id=3, name="s", type=NodeType.COMM_SEND, data_deps=(2,), comm_src=r,
                 comm_dst=other, comm_tag=1, comm_size=8),
        ]  # fmt: skip

    out = tmp_path / "t"
    out.mkdir()
    for r in range(2):
        (out / f"w.{r}.et").write_bytes(chakra_v004.encode_nodes(rank(r)))
    (out / "w.json").write_text("{}")
    fast, slow = both(lambda: report_of(out))
    assert fast == slow
    assert fast["errors"] == {"deadlock": 2}
    assert "3 nodes never run" in fast["violations"][0]["message"]


# -- prediction from a trace on disk ----------------------------------------------------------


def _generate(root: Path, name: str, *options: str) -> Path:
    out = root / name
    args = ["generate", *SMALL, *options, "--output_dir", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@needs_fast
@pytest.mark.parametrize(
    "options",
    [
        ("--dp", "2", "--tp", "2", "--pp", "2", "--batch", "8", "--micro_batch", "2"),
        ("--tp", "3", "--pp", "3", "--batch", "6", "--micro_batch", "2", "--num_stacks", "3",
         "--head", "3", "--kvhead", "3", "--dmodel", "48", "--dff", "192", "--dvocal", "96",
         "--seq", "48"),
        ("--dp", "4", "--pp", "2", "--batch", "8", "--micro_batch", "4", "--weight_sharded",
         "1"),
        ("--dp", "2", "--ep", "2", "--model", "moe", "--batch", "4"),
    ],
    ids=["dp2-tp2-pp2", "tp3-pp3", "dp4-pp2-fsdp", "moe-ep2"],
)
def test_prediction_per_class_equals_every_rank(tmp_path: Path, options: tuple[str, ...]) -> None:
    from stg.perf.system import load_system
    from stg.predictors import time as tp
    from stg.trace.ranks import read_ranks
    from stg.trace.validate import find_rank_files, read_comm_groups

    out = _generate(tmp_path, "t", *options)
    files, group_path = find_rank_files(out)
    groups = read_comm_groups(group_path)  # type: ignore[arg-type]
    ranks = read_ranks(files, jobs=1)  # type: ignore[arg-type]
    system = load_system("a100-80g")
    fast = tp.predict_trace(ranks, groups, system)
    slow = tp.predict_problem(tp.problem_from_nodes(ranks.all_nodes(), groups), system)
    assert fast["simulated_ranks"] < len(files)
    for key in ("iteration_time_s", "mfu", "hfu", "model_flops", "hardware_flops"):
        assert fast[key] == slow[key], key
    per_rank = {entry["rank"]: entry for entry in slow["ranks"]}
    for unit in fast["ranks"]:
        rep = per_rank[unit["rank"]]
        for key in ("compute_s", "communication_s", "exposed_communication_s", "bubble_s"):
            assert unit[key] == rep[key], key


@needs_fast
def test_ranks_that_differ_are_replayed_apart(tmp_path: Path) -> None:
    """A rank whose nodes differ from its peers' (a renamed node) gets its own class."""
    from stg.predictors import time as tp
    from stg.trace.ranks import read_ranks
    from stg.trace.validate import find_rank_files, read_comm_groups

    out = _generate(tmp_path, "t", "--dp", "4", "--batch", "4")
    files, group_path = find_rank_files(out)
    before = read_ranks(files, jobs=1)  # type: ignore[arg-type]
    assert len(set(before.classes)) == 1
    nodes = reader.read_nodes(files[2])  # type: ignore[arg-type]
    meta = reader.read_metadata(files[2])  # type: ignore[arg-type]
    nodes[0] = Node(**{**{f: getattr(nodes[0], f) for f in decode.NODE_FIELDS}, "name": "x"})
    files[2].write_bytes(chakra_v004.encode_nodes(nodes, meta["attrs"]))  # type: ignore[union-attr]
    after = read_ranks(files, jobs=1)  # type: ignore[arg-type]
    assert after.classes == [0, 0, 1, 0]
    groups = read_comm_groups(group_path)  # type: ignore[arg-type]
    fast = tp.predict_trace(after, groups, "a100-80g")
    slow = tp.predict_problem(tp.problem_from_nodes(after.all_nodes(), groups), "a100-80g")
    assert fast["iteration_time_s"] == slow["iteration_time_s"]
    assert 1 < fast["simulated_ranks"] < 4


# -- whole commands ---------------------------------------------------------------------------


@needs_fast
@pytest.mark.parametrize("command", ["validate", "feed", "inspect", "predict"])
def test_commands_print_the_same_with_any_jobs(
    monkeypatch: pytest.MonkeyPatch, small_traces: dict[str, Path], command: str
) -> None:
    from stg.trace import parallel

    monkeypatch.setattr(parallel, "SMALL_BYTES", 0)  # use worker processes even here
    args = {"inspect": ["inspect", "trace"], "predict": ["predict", "--predictor", "time"]}.get(
        command, [command]
    )
    outputs = set()
    for fmt in ("v0.0.4", "v0.0.1", "json"):
        path = str(small_traces[fmt])
        # ASTRA-sim does not read v0.0.1: validate it for Chakra's other readers
        more = ["--consumer", "chakra"] if command == "validate" and fmt == "v0.0.1" else []
        runs = []
        for jobs in ("1", "2"):
            result = CliRunner().invoke(app, [*args, path, "--json", "--jobs", jobs, *more])
            assert result.exit_code == 0, result.output
            runs.append(result.stdout)
        with decode.reference_only():
            result = CliRunner().invoke(app, [*args, path, "--json", "--jobs", "1", *more])
        runs.append(result.stdout)
        assert runs[0] == runs[1]
        if command != "predict":  # the reference replays every rank: other per-rank lines
            assert runs[0] == runs[2]
        outputs.add(fmt)
    assert outputs == {"v0.0.4", "v0.0.1", "json"}
