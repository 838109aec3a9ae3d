"""The compact encoding of the typed node attributes: integer codes, the op left to the name,
and what readers make of it (the compiled decoder and the reference alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.sizes import DISK_BYTES_PER_NODE
from stg.core.workload import (
    NodeTemplate,
    NodeType,
    Phase,
    RankClass,
    RankGraph,
    Role,
    Workload,
    node_chunk,
    node_micro_batch,
    node_op,
    node_part,
    node_phase,
    node_role,
)
from stg.host.registry import load_registry
from stg.trace import decode
from stg.trace.reader import read_nodes
from stg.trace.writer import write_workload

FORMATS = ("chakra-v0.0.4", "json")
TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}


def _semantics(node: Any) -> tuple[Any, ...]:
    return (
        node_phase(node),
        node_micro_batch(node),
        node_part(node),
        node_role(node),
        node_op(node),
        node_chunk(node),
    )


def _one_rank(*templates: NodeTemplate) -> Workload:
    layout = Layout({"dp": 1})
    rank_class = RankClass(index=0, stage=0, nodes=templates)
    return Workload(ranks=(RankGraph(0, rank_class, layout),), comm_groups={}, layout=layout)


def _read(path: Path) -> list[tuple[Any, ...]]:
    return [_semantics(n) for n in read_nodes(path)]


def _read_reference(path: Path) -> list[tuple[Any, ...]]:
    with decode.reference_only():
        return _read(path)


@pytest.mark.parametrize("emitter", FORMATS)
def test_readers_put_back_the_op_a_name_implies_and_only_that(tmp_path: Path, emitter: str) -> None:
    comp = {"type": NodeType.COMP, "num_ops": 1, "tensor_size": 1}
    workload = _one_rank(
        NodeTemplate(id=0, name="mb0/layer3/fwd/fc1", attrs={"op": "fc1", "phase": 1}, **comp),
        NodeTemplate(id=1, name="mb0/layer3/fwd/x", attrs={"op": "fc2", "phase": 1}, **comp),
        NodeTemplate(id=2, name="mb0/layer3/fwd/y", attrs={"phase": 1}, **comp),
        NodeTemplate(id=3, name="aten::mm", attrs={"op": "aten::mm"}, **comp),
        NodeTemplate(id=4, name="a/b", attrs={"phase": "forward"}, **comp),
    )
    registry = load_registry(autoload=False)
    path = write_workload(workload, registry.emitters.get(emitter), tmp_path, "w")[0]
    expected = [
        (Phase.FORWARD, None, None, None, "fc1", None),
        (Phase.FORWARD, None, None, None, "fc2", None),
        (Phase.FORWARD, None, None, None, None, None),  # no op, and none implied
        (None, None, None, None, "aten::mm", None),  # no phase code: the op as written
        (Phase.FORWARD, None, None, None, None, None),  # a string phase implies no op
    ]
    assert _read(path) == _read_reference(path) == expected
    assert path.read_bytes().count(b"fc1") == 1  # only in the name


@pytest.mark.parametrize("emitter", FORMATS)
def test_a_generated_trace_reads_back_what_each_node_is_for(tmp_path: Path, emitter: str) -> None:
    options = GenerateOptions(
        model="gpt", num_stacks=4, pp=2, tp=2, dp=2, batch=8, micro_batch=2, zero=1,
        precision=tuple((op, "fp8") for op in ("q", "fc1")), **TINY,
    )  # fmt: skip
    registry = load_registry(autoload=False)
    workload = build_workload(options, registry)
    paths = write_workload(workload, registry.emitters.get(emitter), tmp_path, "w")
    parts = set()
    for rank in (0, workload.world_size - 1):  # the first and the last stage
        graph = workload.ranks[rank]
        expected = [_semantics(graph.resolve(t)) for t in graph.rank_class.nodes]
        assert _read(paths[rank]) == _read_reference(paths[rank]) == expected
        assert any(s[5] is not None for s in expected)  # a chunk's amax reduction
        parts |= {s[2] for s in expected}
    assert parts == {"embedding", "layer0", "layer1", "layer2", "layer3", "head", None}
    nodes = sum(len(g) for g in workload.ranks)
    written = sum(p.stat().st_size for p in paths)
    assert written < nodes * DISK_BYTES_PER_NODE[emitter]


def test_the_names_an_earlier_version_wrote_still_read() -> None:
    node = NodeTemplate(
        id=0,
        name="n",
        type=NodeType.COMP,
        attrs={"phase": "recompute", "role": "fp8_amax", "part": "layer7"},
    )
    assert (node_phase(node), node_role(node), node_part(node)) == (
        Phase.RECOMPUTE,
        Role.FP8_AMAX,
        "layer7",
    )
    coded = NodeTemplate(
        id=0, name="n", type=NodeType.COMP, attrs={"phase": 3, "role": 5, "part": 2}
    )
    assert (node_phase(coded), node_role(coded), node_part(coded)) == (
        Phase.RECOMPUTE,
        Role.FP8_AMAX,
        "head",
    )
    boolean = NodeTemplate(id=0, name="n", type=NodeType.COMP, attrs={"phase": True})
    assert node_phase(boolean) is None
