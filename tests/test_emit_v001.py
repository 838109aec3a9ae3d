"""The chakra-v0.0.1 emitter, checked with a schema built here from TRACES.md's field numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from formats_samples import pipeline_workload
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from stg.core.workload import CollectiveType, Node, NodeType
from stg.emitters.chakra_v001 import EMITTER
from stg.trace.chakra_v001 import V001Error, encode_nodes
from stg.trace.reader import detect_format, iter_records, read_nodes
from stg.trace.writer import write_workload

F = descriptor_pb2.FieldDescriptorProto

# (name, number, type, label) straight from TRACES.md "Schema v0.0.1".
FIELDS = [
    ("id", 1, F.TYPE_UINT64, F.LABEL_REQUIRED),
    ("name", 2, F.TYPE_STRING, F.LABEL_REQUIRED),
    ("node_type", 3, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("parent", 4, F.TYPE_UINT64, F.LABEL_REPEATED),
    ("tensor_loc", 5, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("tensor_size", 6, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("simulated_run_time", 7, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("input_tensor_loc", 8, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("input_tensor_size", 9, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("output_tensor_loc", 10, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("output_tensor_size", 11, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("num_ops", 12, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("comm_type", 13, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("involved_dim", 14, F.TYPE_BOOL, F.LABEL_REPEATED),
    ("communicator_id", 15, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("comm_src", 16, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("comm_dst", 17, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("comm_size", 18, F.TYPE_UINT64, F.LABEL_OPTIONAL),
    ("comm_tag", 19, F.TYPE_UINT32, F.LABEL_OPTIONAL),
    ("comm_priority", 20, F.TYPE_UINT32, F.LABEL_OPTIONAL),
]
# Enums are decoded as plain varints, so the numbers are checked as numbers.
V001_TYPE = {NodeType.MEM_LOAD: 1, NodeType.MEM_STORE: 2, NodeType.COMP: 3,
             NodeType.COMM_SEND: 4, NodeType.COMM_RECV: 5, NodeType.COMM_COLL: 6}
V001_COLL = {CollectiveType.ALL_REDUCE: 1, CollectiveType.ALL_TO_ALL: 2,
             CollectiveType.ALL_GATHER: 3, CollectiveType.REDUCE_SCATTER: 4}


def independent_node_class() -> type:
    proto = descriptor_pb2.FileDescriptorProto(
        name="independent_v001_test.proto", package="independent_v001_test", syntax="proto2"
    )
    msg = proto.message_type.add(name="Node")
    for name, number, ftype, label in FIELDS:
        msg.field.add(name=name, number=number, type=ftype, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("independent_v001_test.Node"))


def decode(path: Path) -> list[object]:
    cls = independent_node_class()
    out = []
    with open(path, "rb") as stream:
        for _, _, data in iter_records(stream, path):
            msg = cls()
            msg.ParseFromString(data)
            assert msg.IsInitialized()
            out.append(msg)
    return out


def test_files_decode_with_independent_schema(tmp_path: Path) -> None:
    workload = pipeline_workload(tp=2, pp=2, dp=2)
    paths = write_workload(workload, EMITTER, tmp_path / "out", "workload")
    assert [p.name for p in paths][-1] == "workload.json"
    assert json.loads(paths[-1].read_text()) == {
        str(g): list(m) for g, m in workload.comm_groups.items()
    }
    for graph, path in zip(workload.ranks, paths, strict=False):
        msgs = decode(path)
        nodes = list(graph.nodes())
        assert len(msgs) == len(nodes)  # no GlobalMetadata record
        for msg, node in zip(msgs, nodes, strict=True):
            assert (msg.id, msg.name) == (node.id, node.name)
            assert msg.node_type == V001_TYPE[node.type]
            assert list(msg.parent) == list(dict.fromkeys(node.data_deps + node.ctrl_deps))
            if node.type is NodeType.COMP:
                assert (msg.num_ops, msg.tensor_size) == (node.num_ops, node.tensor_size)
            if node.type is NodeType.COMM_COLL:
                assert msg.comm_type == V001_COLL[node.comm_type]
                assert msg.communicator_id == node.comm_group
                assert msg.comm_size == node.comm_size
                assert list(msg.involved_dim) == [True, True, True]
            if node.type is NodeType.COMM_SEND:
                assert (msg.comm_dst, msg.comm_tag) == (node.comm_dst, node.comm_tag)
            if node.type is NodeType.COMM_RECV:
                assert (msg.comm_src, msg.comm_tag) == (node.comm_src, node.comm_tag)
        assert detect_format(path) == "v0.0.1"
        back = read_nodes(path)
        assert [(n.id, n.type, n.comm_group, n.comm_src, n.comm_dst) for n in back] == [
            (n.id, n.type, n.comm_group, n.comm_src, n.comm_dst) for n in nodes
        ]


def test_memory_nodes_and_merged_parents(tmp_path: Path) -> None:
    nodes = [
        Node(id=0, name="load", type=NodeType.MEM_LOAD, tensor_size=64),
        Node(id=1, name="c", type=NodeType.COMP, data_deps=(0,), ctrl_deps=(0,), runtime=7),
        Node(id=2, name="d", type=NodeType.COMP, data_deps=(1,), ctrl_deps=(0,)),
    ]
    path = tmp_path / "m.0.et"
    path.write_bytes(encode_nodes(nodes))
    load, c, d = decode(path)
    assert load.tensor_loc == 2 and load.tensor_size == 64  # REMOTE_MEMORY
    assert list(c.parent) == [0] and c.simulated_run_time == 7
    assert list(d.parent) == [1, 0]
    back = read_nodes(path)
    assert back[2].data_deps == (1, 0) and back[2].ctrl_deps == ()


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (Node(id=0, name="b", type=NodeType.COMM_COLL, comm_type=CollectiveType.BROADCAST),
         "collective BROADCAST has no v0.0.1 equivalent; allowed: ALL_REDUCE"),
        (Node(id=0, name="m", type=NodeType.METADATA), "type METADATA has no v0.0.1"),
        (Node(id=0, name="s", type=NodeType.COMM_SEND, comm_dst=-1), "comm_dst=-1 does not fit"),
    ],
)
def test_inexpressible_nodes_are_rejected(node: Node, message: str) -> None:
    with pytest.raises(V001Error, match=message):
        encode_nodes([node])


def test_all_three_schemas_import_together() -> None:
    from chakra.schema.protobuf import et_def_pb2  # mlc-chakra

    from stg.trace.proto import chakra_v001_pb2, chakra_v004_pb2

    names = {
        et_def_pb2.Node.DESCRIPTOR.full_name,
        chakra_v004_pb2.Node.DESCRIPTOR.full_name,
        chakra_v001_pb2.Node.DESCRIPTOR.full_name,
    }
    assert len(names) == 3
    wire = chakra_v004_pb2.Node(id=5, name="x", type=chakra_v004_pb2.COMP_NODE)
    assert et_def_pb2.Node.FromString(wire.SerializeToString()).id == 5
