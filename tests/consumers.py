"""What the real consumers of a written trace check, for the tests of each new option."""

from __future__ import annotations

from pathlib import Path

from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib

from stg.trace.feeder import ETFeeder, replay


def assert_ranks_decode_and_feed(out: Path) -> None:
    """Every rank file of ``out`` decodes with the official Chakra reader (mlc-chakra), and
    stg's feeder issues each of its nodes exactly once, in dependency order."""
    ranks = sorted(out.glob("workload.*.et"))
    assert ranks, f"no rank files in {out}"
    for path in ranks:
        ids = []
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            node = et_def_pb2.Node()
            while protolib.decodeMessage(f, node):
                ids.append(node.id)
                node = et_def_pb2.Node()
        issued = [nid for kind, nid in replay(ETFeeder(path)) if kind == "issue"]
        assert sorted(issued) == sorted(ids), path.name
