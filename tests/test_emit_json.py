"""The json emitter: Chakra feeder keys, determinism and lossless round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from formats_samples import pipeline_workload

from stg.core.workload import COMM_TYPES, CollectiveType, Node, NodeType
from stg.emitters.json_trace import EMITTER
from stg.trace import chakra_v004, json_trace
from stg.trace.reader import read_metadata, read_nodes
from stg.trace.writer import write_workload

DATA = Path(__file__).parent / "data"
SHARED = Path(__file__).parent.parent.parent / "shared" / "data" / "chakra"
CHAKRA_KEYS = ("Id", "Name", "NodeType", "is_cpu_op", "runtime", "data_deps")
CHAKRA_COMM_KEYS = ("tensor_size", "comm_type", "comm_priority", "comm_size", "comm_src",
                    "comm_dst", "comm_tag")


def test_workload_round_trip_and_chakra_keys(tmp_path: Path) -> None:
    workload = pipeline_workload(tp=2, pp=2, dp=2)
    paths = write_workload(workload, EMITTER, tmp_path / "out", "workload")
    assert [p.name for p in paths] == [f"workload.{r}.json" for r in range(8)] + ["workload.json"]
    for graph, path in zip(workload.ranks, paths, strict=False):
        assert read_nodes(path) == list(graph.nodes())
        doc = json.loads(path.read_text())
        for entry in doc["workload_graph"]:
            for key in CHAKRA_KEYS:
                assert key in entry
            if entry["NodeType"] in {int(t) for t in COMM_TYPES}:
                for key in CHAKRA_COMM_KEYS:
                    assert type(entry[key]) is int, key
            if entry["NodeType"] == NodeType.COMM_COLL:
                assert entry["pg_name"].isdecimal()
        assert read_metadata(path)["attrs"]["generator"] == "stg"
    again = write_workload(workload, EMITTER, tmp_path / "again", "workload")
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]


def test_unset_comm_keys_stay_unset(tmp_path: Path) -> None:
    nodes = [
        Node(id=1, name="s", type=NodeType.COMM_SEND, comm_dst=3, comm_tag=9, comm_size=8),
        Node(id=2, name="ag", type=NodeType.COMM_COLL, comm_type=CollectiveType.ALL_GATHER,
             comm_size=4, comm_group=7, data_deps=(1,), attrs={"comm_priority": 2}),
    ]
    path = tmp_path / "t.0.json"
    path.write_bytes(json_trace.encode_nodes(nodes))
    back = read_nodes(path)
    assert back == nodes
    entry = json.loads(path.read_text())["workload_graph"][0]
    assert entry["comm_type"] == 0 and "comm_type" in entry["stg_unset"]


@pytest.mark.parametrize(
    "path",
    [DATA / "one_metadata_node_all_types.0.et", SHARED / "chakra.0.et"],
    ids=lambda p: p.name,
)
def test_v004_json_v004_is_lossless(tmp_path: Path, path: Path) -> None:
    if not path.exists():
        pytest.skip("needs ../shared/data")
    nodes = read_nodes(path)
    meta = read_metadata(path)
    js = tmp_path / "t.0.json"
    js.write_bytes(json_trace.encode_nodes(nodes, meta["attrs"], version=meta["version"]))
    via_json = read_nodes(js)
    assert via_json == nodes
    for a, b in zip(via_json, nodes, strict=True):
        assert (a.attrs.kinds, a.attrs.docs, a.attrs.extras) == (
            b.attrs.kinds, b.attrs.docs, b.attrs.extras
        )
    meta_js = read_metadata(js)
    assert meta_js["version"] == meta["version"] and meta_js["attrs"] == meta["attrs"]
    et = tmp_path / "t.0.et"
    et.write_bytes(chakra_v004.encode_nodes(via_json, meta_js["attrs"], version=meta_js["version"]))
    direct = chakra_v004.encode_nodes(nodes, meta["attrs"], version=meta["version"])
    assert et.read_bytes() == direct


def test_feeder_json_sample_converts(tmp_path: Path) -> None:
    nodes = read_nodes(DATA / "small_chakra.0.json")
    out = tmp_path / "s.0.json"
    out.write_bytes(json_trace.encode_nodes(nodes))
    assert read_nodes(out) == nodes
