"""ASTRA-sim's consumption rules (TRACES.md): every generated COMP node can be timed by the
roofline (num_ops > 0 whenever tensor_size > 0), and `stg validate` enforces the rules by
default (`--consumer astra-sim`) and relaxes them to warnings with `--consumer chakra`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from formats_samples import workload_from_classes
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stg.cli import main
from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeTemplate, NodeType, RankClass
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import write_workload

SMALL = dict(
    dvocal=128, dmodel=32, dff=64, seq=16, head=4, kvhead=2, num_stacks=2, batch=8, experts=4
)

# The generation matrix: models x parallelism x memory-saving features x precision.
MATRIX = [
    dict(model="gpt"),
    dict(model="gpt", dp=2, tp=2, micro_batch=4),
    dict(model="gpt", tp=2, tpsp=False, pp=2, micro_batch=4, activation_recompute="full"),
    dict(model="gpt", sp=2, micro_batch=4, activation_recompute="selective", causal=True),
    dict(model="gpt", dp=2, micro_batch=4, weight_sharded=True, mixed_precision=True),
    dict(model="gpt", dp=2, tp=2, micro_batch=8, zero=1, precision=(("fc*", "int8"),)),
    dict(model="llama", tp=2, sp=2, micro_batch=4, activation_recompute="selective"),
    dict(model="llama", dp=2, pp=2, micro_batch=4, zero=2, mixed_precision=True),
    dict(model="llama", pp=2, micro_batch=2, pipeline_schedule="gpipe",
         precision=(("q", "fp8"), ("gate", "int8"))),
    dict(model="moe", ep=2, micro_batch=4),
    dict(model="moe", dp=2, ep=2, tp=2, micro_batch=8, zero=2, mixed_precision=True,
         activation_recompute="full"),
    dict(model="moe", ep=2, sp=2, pp=2, micro_batch=4, weight_sharded=True,
         precision=(("expert_up", "int8"),)),
]  # fmt: skip


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def ids(kw: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in kw.items())


def official_nodes(path: Path) -> list:
    """Every Node of a v0.0.4 rank file, decoded by mlc-chakra's reader."""
    nodes = []
    with path.open("rb") as f:
        meta = et_def_pb2.GlobalMetadata()
        assert protolib.decodeMessage(f, meta)
        while True:
            node = et_def_pb2.Node()
            if not protolib.decodeMessage(f, node):
                return nodes
            nodes.append(node)


def typed_attrs(node) -> dict[str, tuple[str, object]]:
    return {a.name: (a.WhichOneof("value"), getattr(a, a.WhichOneof("value"))) for a in node.attr}


def write(registry, tmp_path: Path, **kw) -> tuple[Path, int]:
    workload = build_workload(GenerateOptions(**{**SMALL, **kw}), registry)
    out = tmp_path / "out"
    write_workload(workload, registry.emitters.get("chakra-v0.0.4"), out, "workload.%d.et")
    return out, workload.world_size


@pytest.mark.parametrize("kw", MATRIX, ids=ids)
def test_every_written_comp_node_can_be_timed_by_the_roofline(registry, tmp_path, kw):
    out, world = write(registry, tmp_path, **kw)
    comp = 0
    for rank in range(world):
        for node in official_nodes(out / f"workload.{rank}.et"):
            attrs = typed_attrs(node)
            if node.type != et_def_pb2.COMP_NODE:
                continue
            comp += 1
            kind_ops, num_ops = attrs["num_ops"]
            kind_size, tensor_size = attrs["tensor_size"]
            assert (kind_ops, kind_size) == ("int64_val", "uint64_val"), node.name
            assert attrs["is_cpu_op"] == ("bool_val", False), node.name
            assert num_ops > 0 or tensor_size == 0, f"rank {rank} node {node.id} {node.name}"
    assert comp > 0
    report = validate_trace(out)  # ASTRA-sim's rules by default
    assert report.ok, [v.message for v in report.errors[:3]]
    assert not [v for v in report.warnings if v.check in {"roofline", "collective-type"}]


@st.composite
def generation_options(draw) -> dict:
    model = draw(st.sampled_from(["gpt", "llama", "moe"]))
    kw: dict = dict(model=model, **{a: draw(st.sampled_from([1, 2])) for a in ("dp", "tp", "pp")})
    kw["sp"] = draw(st.sampled_from([1, 2]))
    kw["ep"] = draw(st.sampled_from([1, 2])) if model == "moe" else 1
    kw["micro_batch"] = draw(st.sampled_from([4, 8]))
    kw["tpsp"] = draw(st.booleans())
    memory = draw(st.sampled_from(["none", "fsdp", "zero1", "zero2"]))
    kw["weight_sharded"] = memory == "fsdp"
    kw["zero"] = {"zero1": 1, "zero2": 2}.get(memory, 0)
    kw["activation_recompute"] = draw(st.sampled_from(["none", "selective", "full"]))
    kw["mixed_precision"] = draw(st.booleans())
    mlp = {"gpt": "fc*", "llama": "up", "moe": "expert_*"}[model]
    kw["precision"] = draw(st.sampled_from([(), ((mlp, "int8"),), (("*", "fp8"),)]))
    return kw


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(generation_options())
def test_roofline_rule_holds_on_random_combinations(registry, tmp_path_factory, kw):
    try:
        out, world = write(registry, tmp_path_factory.mktemp("w"), **kw)
    except UserError:
        assume(False)  # an invalid combination (degrees that do not divide, ...)
    for rank in range(world):
        for node in official_nodes(out / f"workload.{rank}.et"):
            if node.type == et_def_pb2.COMP_NODE:
                attrs = typed_attrs(node)
                assert attrs["num_ops"][1] > 0 or attrs["tensor_size"][1] == 0, node.name


def test_embedding_lookup_counts_one_op_per_element_it_writes(registry, tmp_path):
    # stg 0.x wrote the embedding gather with num_ops 0 and tensor_size > 0: ASTRA-sim's
    # roofline computed 0/0 and no rank ever finished.
    b, s, h = 8, SMALL["seq"], SMALL["dmodel"]
    out, _ = write(registry, tmp_path, model="gpt", micro_batch=b)
    (node,) = [
        n
        for n in official_nodes(out / "workload.0.et")
        if n.name.endswith("embedding/token_embedding")
    ]
    attrs = typed_attrs(node)
    assert attrs["tensor_size"][1] > 0
    assert attrs["num_ops"] == ("int64_val", b * s * h)


# -- stg validate on hand-made traces ----------------------------------------------------------


def _attr(node, name: str, kind: str, value: object) -> None:
    setattr(node.attr.add(name=name), kind, value)


def _collective(nid: int, dep: int, ctype: int, pg_kind: str, pg_value: object):
    node = et_def_pb2.Node(id=nid, name=f"coll{nid}", type=et_def_pb2.COMM_COLL_NODE)
    node.data_deps.append(dep)
    _attr(node, "is_cpu_op", "bool_val", False)
    _attr(node, "comm_type", "int64_val", ctype)
    _attr(node, "comm_size", "int64_val", 1024)
    _attr(node, "pg_name", pg_kind, pg_value)
    return node


def astra_breaking_trace(tmp_path: Path) -> Path:
    """Two identical ranks: a COMP node of 0 ops over 64 bytes, an all-reduce whose pg_name is
    an int64, a broadcast. Written with mlc-chakra's own encoder."""
    out = tmp_path / "hand"
    out.mkdir()
    comp = et_def_pb2.Node(id=0, name="copy", type=et_def_pb2.COMP_NODE)
    _attr(comp, "is_cpu_op", "bool_val", False)
    _attr(comp, "num_ops", "int64_val", 0)
    _attr(comp, "tensor_size", "uint64_val", 64)
    nodes = [
        comp,
        _collective(1, 0, et_def_pb2.ALL_REDUCE, "int64_val", 1),
        _collective(2, 1, et_def_pb2.BROADCAST, "string_val", "1"),
    ]
    for rank in range(2):
        with (out / f"w.{rank}.et").open("wb") as f:
            protolib.encodeMessage(f, et_def_pb2.GlobalMetadata(version="0.0.4"))
            for node in nodes:
                protolib.encodeMessage(f, node)
    (out / "w.json").write_text(json.dumps({"1": [0, 1]}))
    return out


def test_validate_enforces_astra_sim_rules_by_default(tmp_path):
    out = astra_breaking_trace(tmp_path)
    report = validate_trace(out)
    found = {(v.check, v.rank, v.node) for v in report.errors}
    for rank in (0, 1):
        assert ("roofline", rank, 0) in found
        assert ("attr-type", rank, 1) in found  # pg_name stored as int64
        assert ("collective-type", rank, 2) in found  # BROADCAST
    roofline = next(v for v in report.errors if v.check == "roofline" and v.rank == 0)
    assert roofline.message.startswith("w.0.et: node 0: ")
    assert "num_ops 0 and tensor_size 64" in roofline.message
    assert "ASTRA-sim rule" in roofline.message
    relaxed = validate_trace(out, consumer="chakra")
    assert relaxed.ok, [v.message for v in relaxed.errors]
    assert {v.check for v in relaxed.warnings} >= {"roofline", "attr-type", "collective-type"}


def test_cli_consumer_flag(tmp_path, capsys):
    out = astra_breaking_trace(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out)])
    assert exit_info.value.code == 1
    text = capsys.readouterr().out
    assert "INVALID" in text and "roofline" in text and "BROADCAST" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out), "--json"])
    assert exit_info.value.code == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert errors["roofline"] == 2 and errors["collective-type"] == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out), "--consumer", "chakra"])
    assert exit_info.value.code == 0
    assert "valid:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out), "--consumer", "ns-3"])
    assert exit_info.value.code == 2
    assert "--consumer=ns-3: must be one of astra-sim, chakra" in capsys.readouterr().err


def test_validate_workload_checks_the_roofline_rule():
    layout = Layout({"tp": 2}, group_axes=(("tp",),))
    cls = RankClass(index=0, stage=0, nodes=(
        NodeTemplate(id=0, name="gemm", type=NodeType.COMP, num_ops=100, tensor_size=64),
        NodeTemplate(id=1, name="copy", type=NodeType.COMP, num_ops=0, tensor_size=64),
        NodeTemplate(id=2, name="free", type=NodeType.COMP, num_ops=0, tensor_size=0),
    ))  # fmt: skip
    workload = workload_from_classes(layout, [cls])
    report = validate_workload(workload)
    assert {(v.check, v.node) for v in report.errors} == {("roofline", 1)}
    assert validate_workload(workload, consumer="chakra").ok
