"""The Python ETFeeder: Chakra conformance, strictness, windowing, and random DAGs."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stg.core.workload import CollectiveType, Node, NodeType
from stg.errors import TraceError, UserError
from stg.trace.feeder import (
    CycleError,
    DependencyError,
    DuplicateNodeError,
    ETFeeder,
    FeederError,
    FeederUsageError,
    replay,
)
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.reader import iter_records

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "chakra"
LOCAL = Path(__file__).resolve().parent / "data" / "chakra"
CHAKRA_COPIES = [LOCAL / "chakra.0.et.gz"] + (
    [SHARED / "chakra.0.et"] if (SHARED / "chakra.0.et").is_file() else []
)
ORDER = (LOCAL / "chakra.0.feeder-order.txt").read_text().splitlines()
GENERATED = sorted((LOCAL / "generated").glob("*.et"))


# -- helpers -----------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(payloads: Iterable[bytes]) -> bytes:
    """Varint-length-prefix each record (Chakra's protolib framing)."""
    return b"".join(_varint(len(p)) + p for p in payloads)


def encode_v004(nodes: Iterable[Node], *, metadata: bool = True) -> bytes:
    """A v0.0.4 trace of ``nodes`` (a test helper, not a writer: only the fields fed here)."""
    records = []
    if metadata:
        records.append(pb4.GlobalMetadata(version="0.0.4").SerializeToString())
    for n in nodes:
        msg = pb4.Node(
            id=n.id,
            name=n.name,
            type=int(n.type),
            data_deps=n.data_deps,
            ctrl_deps=n.ctrl_deps,
            duration_micros=n.runtime,
        )
        msg.attr.add(name="is_cpu_op", bool_val=n.is_cpu_op)
        if n.num_ops:
            msg.attr.add(name="num_ops", int64_val=n.num_ops)
        records.append(msg.SerializeToString())
    return frame(records)


def comp(nid: int, data: Sequence[int] = (), ctrl: Sequence[int] = ()) -> Node:
    return Node(nid, f"n{nid}", NodeType.COMP, data_deps=tuple(data), ctrl_deps=tuple(ctrl))


def events(nodes: Iterable[Node], **kwargs: object) -> list[tuple[str, int]]:
    return list(replay(ETFeeder(nodes, **kwargs)))  # type: ignore[arg-type]


def oracle(nodes: Sequence[Node], use_ctrl: bool) -> list[tuple[str, int]]:
    """The FIFO protocol on a fully loaded graph, computed independently of the feeder."""
    parents = {n.id: set(n.data_deps) | (set(n.ctrl_deps) if use_ctrl else set()) for n in nodes}
    children: dict[int, list[int]] = {n.id: [] for n in nodes}
    for nid, ps in parents.items():
        for p in ps:
            children[p].append(nid)
    waiting = {nid: len(ps) for nid, ps in parents.items()}
    ready = [nid for nid, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    log: list[tuple[str, int]] = []
    fifo: list[int] = []

    def pull() -> None:
        while ready:
            nid = heapq.heappop(ready)
            fifo.append(nid)
            log.append(("issue", nid))

    pull()
    while fifo:
        done = fifo.pop(0)
        log.append(("done", done))
        for c in children[done]:
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, c)
        pull()
    return log


# -- conformance with Chakra's C++ feeder ----------------------------------------------------


@pytest.mark.parametrize("path", CHAKRA_COPIES, ids=lambda p: p.name)
def test_chakra_trace_issue_order_matches_the_cpp_feeder(path: Path) -> None:
    feeder = ETFeeder(path, deps="data")
    lines = [f"{kind} {nid}" for kind, nid in replay(feeder)]
    lines.append(f"END hasNodesToIssue={int(feeder.has_nodes_to_issue())}")
    assert lines == ORDER


def test_chakra_trace_pinned_facts() -> None:
    feeder = ETFeeder(CHAKRA_COPIES[0], deps="data")
    node = feeder.lookup_node(216)
    assert node.type is NodeType.COMP
    assert node.is_cpu_op is True
    assert node.get_other_attr("rf_id") == 2
    assert node.attrs.kinds["rf_id"] == "int64_val"  # type: ignore[attr-defined]
    children = [c.id for c in node.children]
    assert children[:3] == [217, 430, 435]
    assert len(children) == 331
    assert children == sorted(children)  # file order; this file's ids increase
    first = []
    while (n := feeder.get_next_issuable_node()) is not None:
        first.append(n.id)
    assert first == [216, 432, 541, 619, 1634]


@pytest.mark.parametrize("window", [1, 16, 500])
def test_chakra_trace_drains_with_small_windows(window: int) -> None:
    feeder = ETFeeder(CHAKRA_COPIES[0], deps="data", window=window)
    log = list(replay(feeder))
    done = [nid for kind, nid in log if kind == "done"]
    assert len(done) == len(set(done)) == 3664
    assert feeder.nodes_read == 3664
    assert not feeder.has_nodes_to_issue()


def test_chakra_trace_ctrl_deps_are_rejected_with_a_hint() -> None:
    with pytest.raises(DependencyError, match=r"ctrl dep.*deps 'data'"):
        list(replay(ETFeeder(CHAKRA_COPIES[0])))


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_generated_traces_drain(path: Path) -> None:
    log = list(replay(ETFeeder(path)))
    issued = [nid for kind, nid in log if kind == "issue"]
    assert issued and sorted(issued) == sorted(set(issued))
    if path.name.startswith("two_comp_nodes_dependent"):
        assert [k for k, _ in log] == ["issue", "done", "issue", "done"]
    if path.name.startswith("two_comp_nodes_independent"):
        assert [k for k, _ in log] == ["issue", "issue", "done", "done"]


def test_generated_collective_attributes() -> None:
    node = ETFeeder(LOCAL / "generated" / "ALL_REDUCE.0.et").get_next_issuable_node()
    assert node is not None
    assert node.type is NodeType.COMM_COLL
    assert node.comm_type is CollectiveType.ALL_REDUCE
    assert node.comm_size > 0


def test_small_json_trace_drains_with_data_deps_only() -> None:
    path = LOCAL / "small_chakra.0.json"
    log = list(replay(ETFeeder(path, deps="data")))
    assert log[:5] == [
        ("issue", 216),
        ("issue", 432),
        ("issue", 541),
        ("done", 216),
        ("issue", 217),
    ]
    assert [n for k, n in log if k == "done"] == [216, 432, 541, 217, 430, 433, 435]
    with pytest.raises(DependencyError, match="node 216 has ctrl dep 3, which never appears"):
        ETFeeder(path)


# -- semantics ---------------------------------------------------------------------------------


def test_ready_nodes_come_out_smallest_id_first() -> None:
    nodes = [comp(9), comp(3), comp(7), comp(1, data=[9])]
    assert events(nodes) == oracle(nodes, use_ctrl=True)
    assert events(nodes)[:3] == [("issue", 3), ("issue", 7), ("issue", 9)]


def test_forward_reference_waits_for_its_parent_and_children_keep_file_order() -> None:
    nodes = [comp(5, data=[1]), comp(6, data=[1]), comp(1), comp(7, data=[1])]
    feeder = ETFeeder(nodes)
    assert [c.id for c in feeder.lookup_node(1).children] == [5, 6, 7]
    assert list(replay(feeder)) == oracle(nodes, use_ctrl=True)


def test_ctrl_deps_order_nodes_only_in_data_ctrl_mode() -> None:
    nodes = [comp(1), comp(2, ctrl=[3]), comp(3)]
    assert [n for k, n in events(nodes, deps="data") if k == "issue"] == [1, 2, 3]
    assert [n for k, n in events(nodes) if k == "done"] == [1, 3, 2]


def test_same_parent_in_data_and_ctrl_deps_counts_once() -> None:
    assert events([comp(1), comp(2, data=[1], ctrl=[1])]) == [
        ("issue", 1),
        ("done", 1),
        ("issue", 2),
        ("done", 2),
    ]


def test_window_bounds_the_nodes_in_memory() -> None:
    chain = [comp(0)] + [comp(i, data=[i - 1]) for i in range(1, 200)]
    feeder = ETFeeder(chain, window=3)
    peak = 0
    while feeder.has_nodes_to_issue():
        node = feeder.get_next_issuable_node()
        assert node is not None
        peak = max(peak, feeder.loaded)
        feeder.free_children_nodes(node.id)
        feeder.remove_node(node.id)
    assert peak == 3
    assert feeder.nodes_read == 200


def test_window_reads_on_past_forward_references() -> None:
    nodes = [comp(1, data=[4]), comp(2), comp(3), comp(4)]
    feeder = ETFeeder(nodes, window=1)
    assert feeder.loaded == 4
    assert [n for k, n in replay(feeder) if k == "done"] == [2, 3, 4, 1]


def test_dep_on_an_already_removed_node_is_satisfied() -> None:
    nodes = [comp(0), comp(1), comp(2), comp(3, data=[0])]
    feeder = ETFeeder(nodes, window=1)
    log = list(replay(feeder))
    assert [n for k, n in log if k == "done"] == [0, 1, 2, 3]


def test_child_read_after_its_parent_completed_is_not_blocked() -> None:
    feeder = ETFeeder([comp(0), comp(5), comp(1, data=[0])], window=2)
    for nid in (0, 5):
        node = feeder.get_next_issuable_node()
        assert node is not None and node.id == nid
    feeder.free_children_nodes(0)  # 0 stays loaded: freed, not removed
    feeder.free_children_nodes(5)
    feeder.remove_node(5)  # reads node 1, whose parent 0 is already complete
    node = feeder.get_next_issuable_node()
    assert node is not None and node.id == 1


def test_push_back_returns_a_node_to_the_ready_set() -> None:
    feeder = ETFeeder([comp(1), comp(2)])
    first = feeder.get_next_issuable_node()
    assert first is not None and first.id == 1
    feeder.push_back_issuable_node(1)
    again = feeder.get_next_issuable_node()
    assert again is first


def test_node_accessors() -> None:
    node = Node(
        4,
        "ar",
        NodeType.COMM_COLL,
        data_deps=(1,),
        ctrl_deps=(2,),
        comm_type=CollectiveType.ALL_GATHER,
        comm_size=1024,
        comm_group=3,
        runtime=17,
        attrs={"comm_priority": 1},
    )
    feeder = ETFeeder([comp(1), comp(2), node], deps="data")
    fnode = feeder.lookup_node(4)
    assert (fnode.id, fnode.name, fnode.type, fnode.runtime) == (4, "ar", NodeType.COMM_COLL, 17)
    assert (fnode.comm_type, fnode.comm_size, fnode.pg_name) == (
        CollectiveType.ALL_GATHER,
        1024,
        "3",
    )
    assert (fnode.data_deps, fnode.ctrl_deps) == ((1,), (2,))
    assert fnode.has_other_attr("comm_priority") and fnode.get_other_attr("comm_priority") == 1
    with pytest.raises(KeyError, match="node 4 has no attribute 'rf_id'"):
        fnode.get_other_attr("rf_id")
    assert [c.id for c in feeder.lookup_node(1).children] == [4]
    assert feeder.lookup_node(2).children == []  # a ctrl child does not count with deps=data


# -- strictness --------------------------------------------------------------------------------


def test_duplicate_id_is_an_error() -> None:
    with pytest.raises(DuplicateNodeError, match="node id 1 appears twice") as info:
        ETFeeder([comp(1), comp(2), comp(1)])
    assert info.value.node_id == 1


def test_duplicate_id_is_caught_after_the_first_copy_was_removed() -> None:
    feeder = ETFeeder([comp(1), comp(2), comp(3), comp(1)], window=1)
    with pytest.raises(DuplicateNodeError):
        list(replay(feeder))


def test_dangling_dep_is_an_error() -> None:
    with pytest.raises(DependencyError, match="node 2 has data dep 9, which never appears"):
        ETFeeder([comp(1), comp(2, data=[9])])


def test_repeated_dep_is_an_error() -> None:
    with pytest.raises(DependencyError, match="node 2 lists data dep 1 twice"):
        ETFeeder([comp(1), comp(2, data=[1, 1])])
    with pytest.raises(DependencyError, match="node 2 lists ctrl dep 1 twice"):
        ETFeeder([comp(1), comp(2, ctrl=[1, 1])])


def test_self_dependency_is_an_error() -> None:
    with pytest.raises(DependencyError, match="node 2 lists itself as a data dep"):
        ETFeeder([comp(2, data=[2])])


def test_cycle_is_an_error_naming_the_cycle() -> None:
    nodes = [comp(0), comp(1, data=[3]), comp(2, data=[1]), comp(3, data=[2, 0])]
    feeder = ETFeeder(nodes)
    with pytest.raises(CycleError, match=r"dependency cycle 1 -> 2 -> 3 -> 1") as info:
        list(replay(feeder))
    assert info.value.node_id in (1, 2, 3)


def test_cycle_detected_by_has_nodes_to_issue() -> None:
    feeder = ETFeeder([comp(1, data=[2]), comp(2, data=[1])])
    with pytest.raises(CycleError):
        feeder.has_nodes_to_issue()


def test_truncated_file_is_an_error_naming_the_last_node(tmp_path: Path) -> None:
    data = encode_v004([comp(1), comp(2, data=[1]), comp(3, data=[2])])
    path = tmp_path / "t.0.et"
    path.write_bytes(data[:-3])
    with pytest.raises(TraceError, match=r"truncated.*\(after node 2\)"):
        list(replay(ETFeeder(path)))


def test_missing_global_metadata_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.0.et"
    path.write_bytes(encode_v004([comp(1), comp(2, data=[1])], metadata=False))
    with pytest.raises(TraceError, match="GlobalMetadata"):
        ETFeeder(path, format="v0.0.4")


def test_bad_options_are_user_errors() -> None:
    with pytest.raises(UserError, match="deps='ctrl' is not known; allowed: data, data\\+ctrl"):
        ETFeeder([], deps="ctrl")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="window=0 must be a positive integer"):
        ETFeeder([], window=0)


def test_protocol_misuse_is_reported() -> None:
    feeder = ETFeeder([comp(1), comp(2, data=[1])])
    with pytest.raises(FeederUsageError, match="free_children_nodes\\(2\\): node was not issued"):
        feeder.free_children_nodes(2)
    with pytest.raises(FeederUsageError, match="lookup_node\\(7\\): no such node"):
        feeder.lookup_node(7)
    node = feeder.get_next_issuable_node()
    assert node is not None
    with pytest.raises(FeederUsageError, match="call free_children_nodes\\(1\\) first"):
        feeder.remove_node(1)
    feeder.free_children_nodes(1)
    with pytest.raises(FeederUsageError, match="already freed"):
        feeder.free_children_nodes(1)
    with pytest.raises(FeederUsageError, match="push_back_issuable_node\\(1\\)"):
        feeder.push_back_issuable_node(1)


def test_empty_source_has_nothing_to_issue() -> None:
    feeder = ETFeeder([])
    assert not feeder.has_nodes_to_issue()
    assert feeder.get_next_issuable_node() is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-5, 60), unique=True))
def test_seen_ids_set_agrees_with_a_python_set(values: list[int]) -> None:
    from stg.trace.feeder import _IdRanges

    seen = _IdRanges()
    model: set[int] = set()
    for v in values:
        assert (v in seen) == (v in model)
        seen.add(v)
        model.add(v)
    assert all((v in seen) == (v in model) for v in range(-7, 63))


# -- properties --------------------------------------------------------------------------------


@st.composite
def dags(draw: st.DrawFn) -> list[Node]:
    """A random DAG in a random file order (so with forward references), ids not in order."""
    n = draw(st.integers(1, 30))
    ids = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n, unique=True))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.floats(0.0, 0.5))
    nodes = []
    for i, nid in enumerate(ids):  # position in ids = a topological order
        parents = [ids[j] for j in range(i) if rnd.random() < density]
        data = [p for p in parents if rnd.random() < 0.7]
        ctrl = [p for p in parents if p not in data or rnd.random() < 0.1]
        nodes.append(comp(nid, data=data, ctrl=ctrl))
    if draw(st.booleans()):
        rnd.shuffle(nodes)
    return nodes


@settings(max_examples=150, deadline=None)
@given(dags(), st.sampled_from(["data", "data+ctrl"]))
def test_random_dags_match_the_oracle_with_a_full_window(nodes: list[Node], deps: str) -> None:
    assert events(nodes, deps=deps) == oracle(nodes, use_ctrl=deps == "data+ctrl")


@settings(max_examples=150, deadline=None)
@given(dags(), st.integers(1, 8), st.sampled_from(["data", "data+ctrl"]))
def test_random_dags_drain_in_topological_order_with_any_window(
    nodes: list[Node], window: int, deps: str
) -> None:
    log = events(nodes, deps=deps, window=window)
    done: set[int] = set()
    issued: set[int] = set()
    by_id = {n.id: n for n in nodes}
    for kind, nid in log:
        node = by_id[nid]
        parents = set(node.data_deps) | (set(node.ctrl_deps) if deps == "data+ctrl" else set())
        if kind == "issue":
            assert parents <= done and nid not in issued
            issued.add(nid)
        else:
            assert nid in issued and nid not in done
            done.add(nid)
    assert done == set(by_id)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_dags_read_from_a_file_feed_like_in_memory(nodes: list[Node]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.0.et"
        path.write_bytes(encode_v004(nodes))
        assert list(replay(ETFeeder(path))) == events(nodes)


@settings(max_examples=150, deadline=None)
@given(dags(), st.data())
def test_broken_graphs_raise_feeder_errors(nodes: list[Node], data: st.DataObject) -> None:
    ids = [n.id for n in nodes]
    fault = data.draw(st.sampled_from(["duplicate", "dangling", "self", "cycle", "repeat"]))
    i = data.draw(st.integers(0, len(nodes) - 1))
    victim = nodes[i]
    if fault == "duplicate":
        broken = [*nodes, comp(data.draw(st.sampled_from(ids)))]
    elif fault == "dangling":
        broken = [*nodes[:i], comp(victim.id, data=(*victim.data_deps, 1000)), *nodes[i + 1 :]]
    elif fault == "self":
        broken = [*nodes[:i], comp(victim.id, ctrl=[victim.id]), *nodes[i + 1 :]]
    elif fault == "repeat":
        other = data.draw(st.sampled_from(ids))
        bad = comp(victim.id, data=[other, other]) if other != victim.id else comp(victim.id)
        broken = [*nodes[:i], bad, *nodes[i + 1 :]]
        if other == victim.id:
            broken.append(comp(other))  # duplicate instead
    else:  # close a cycle through a new pair of nodes hanging off the victim
        broken = [*nodes, comp(1001, data=[victim.id, 1002]), comp(1002, data=[1001])]
    window = data.draw(st.integers(1, 40))
    with pytest.raises(FeederError):
        list(replay(ETFeeder(broken, window=window)))


def _chakra_prefix(records: int) -> bytes:
    import gzip

    raw = gzip.decompress(CHAKRA_COPIES[0].read_bytes())
    import io

    payloads = [p for _, _, p in iter_records(io.BytesIO(raw), "chakra.0.et")]
    return frame(payloads[: records + 1])


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, mtime=0)


CORPUS = {
    "chakra-prefix": _chakra_prefix(120),
    "gzip": _gzip(_chakra_prefix(40)),
    "generated": (LOCAL / "generated" / "two_comp_nodes_dependent.0.et").read_bytes(),
    "synthetic": encode_v004(
        [comp(0)] + [comp(i, data=[i - 1, 0][: 1 + (i > 1)]) for i in range(1, 30)]
    ),
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(CORPUS)), st.data())
def test_corrupt_or_truncated_traces_raise_trace_errors_or_drain(
    name: str, data: st.DataObject
) -> None:
    import tempfile

    blob = bytearray(CORPUS[name])
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(blob) - 1))
            blob[pos] = data.draw(st.integers(0, 255))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.0.et"
        path.write_bytes(bytes(blob))
        try:
            feeder = ETFeeder(path, deps="data", window=data.draw(st.integers(1, 64)))
            log = list(replay(feeder))
        except TraceError:
            return
        done = [nid for kind, nid in log if kind == "done"]
        assert len(done) == len(set(done)) == feeder.nodes_read


# -- traces written by stg's own emitters --------------------------------------------------------


@pytest.mark.parametrize("emitter", ["chakra_v004", "chakra_v001", "json_trace"])
def test_emitted_workload_feeds_in_dependency_order(tmp_path: Path, emitter: str) -> None:
    import importlib

    from formats_samples import pipeline_workload

    from stg.trace.writer import write_workload

    workload = pipeline_workload(tp=2, pp=2)
    module = importlib.import_module(f"stg.emitters.{emitter}")
    paths = write_workload(workload, module.EMITTER, tmp_path / "out", "workload")
    rank_paths = [p for p in paths if p.name != "workload.json"]
    assert len(rank_paths) == workload.world_size
    for graph, path in zip(workload.ranks, rank_paths, strict=True):
        from_file = list(replay(ETFeeder(path)))
        assert from_file == oracle(list(graph.nodes()), use_ctrl=True), path.name
