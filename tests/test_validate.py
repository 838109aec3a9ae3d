"""stg.trace.validate and `stg validate`: valid traces pass, each kind of corruption is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from formats_samples import pipeline_workload, workload_from_classes

from stg.cli import main
from stg.core.layout import Layout
from stg.core.workload import CollectiveType, Node, NodeTemplate, NodeType, RankClass
from stg.emitters import chakra_v001 as chakra_v001_emitter
from stg.emitters import chakra_v004 as chakra_v004_emitter
from stg.emitters import json_trace as json_trace_emitter
from stg.errors import UserError
from stg.trace import chakra_v004
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import format_comm_groups, frame, write_workload

AR = CollectiveType.ALL_REDUCE
AG = CollectiveType.ALL_GATHER


def comp(i: int, *deps: int, ctrl: tuple[int, ...] = ()) -> Node:
    return Node(id=i, name=f"c{i}", type=NodeType.COMP, data_deps=deps, ctrl_deps=ctrl,
                num_ops=10, tensor_size=4)


def coll(i: int, group: int, size: int = 64, ctype: CollectiveType = AR, *deps: int) -> Node:
    return Node(id=i, name=f"ar{i}", type=NodeType.COMM_COLL, data_deps=deps, comm_type=ctype,
                comm_size=size, comm_group=group)


def send(i: int, rank: int, dst: int, tag: int = 1, size: int = 8) -> Node:
    return Node(id=i, name=f"s{i}", type=NodeType.COMM_SEND, comm_src=rank, comm_dst=dst,
                comm_tag=tag, comm_size=size)


def recv(i: int, rank: int, src: int, tag: int = 1, size: int = 8) -> Node:
    return Node(id=i, name=f"r{i}", type=NodeType.COMM_RECV, comm_src=src, comm_dst=rank,
                comm_tag=tag, comm_size=size)


def write_trace(tmp_path: Path, ranks: list[list[Node]], groups: dict | None = None) -> Path:
    out = tmp_path / "t"
    out.mkdir(exist_ok=True)
    for rank, nodes in enumerate(ranks):
        (out / f"w.{rank}.et").write_bytes(chakra_v004.encode_nodes(nodes))
    (out / "w.json").write_text(format_comm_groups(groups if groups is not None else {1: (0, 1)}))
    return out


def good_ranks() -> list[list[Node]]:
    return [
        [comp(0), coll(1, 1, 64, AR, 0), send(2, 0, 1), comp(3, 1, ctrl=(2,))],
        [comp(0), coll(1, 1, 64, AR, 0), recv(2, 1, 0), comp(3, 1, 2)],
    ]


def checks(path: Path) -> set[str]:
    return {v.check for v in validate_trace(path).errors}


@pytest.mark.parametrize(
    "emitter",
    [chakra_v004_emitter.EMITTER, chakra_v001_emitter.EMITTER, json_trace_emitter.EMITTER],
)
def test_generated_workloads_are_valid(tmp_path: Path, emitter: object) -> None:
    workload = pipeline_workload(tp=2, pp=2, dp=2)
    assert validate_workload(workload).ok
    write_workload(workload, emitter, tmp_path / "out", "workload")
    v001 = emitter is chakra_v001_emitter.EMITTER
    for target in ("out", "out/workload", f"out/workload.%d{emitter.extension}"):
        report = validate_trace(tmp_path / target, consumer="chakra" if v001 else "astra-sim")
        assert report.ok, report.violations
        assert (report.ranks, report.nodes) == (8, 40)


def test_astra_sim_does_not_read_v001(tmp_path: Path) -> None:
    """ASTRA-sim's feeder fails on a v0.0.1 trace ("Node 0 in ctrl_dep graph, but not found
    in index"): one schema violation for ASTRA-sim, a warning for other Chakra readers."""
    write_workload(pipeline_workload(tp=2), chakra_v001_emitter.EMITTER, tmp_path, "workload")
    report = validate_trace(tmp_path)
    (violation,) = report.errors
    assert violation.check == "schema"
    assert violation.message == (
        "workload.0.et: the trace is Chakra v0.0.1 (ASTRA-sim rule: ASTRA-sim reads the Chakra "
        "v0.0.4 schema only; convert it with `stg convert SOURCE DEST --to v0.0.4`)"
    )
    chakra = validate_trace(tmp_path, consumer="chakra")
    assert chakra.ok and [v.check for v in chakra.warnings] == ["schema"]


def test_hand_built_trace_is_valid(tmp_path: Path) -> None:
    report = validate_trace(write_trace(tmp_path, good_ranks()))
    assert report.ok and report.violations == []


def test_truncated_file(tmp_path: Path) -> None:
    out = write_trace(tmp_path, good_ranks())
    data = (out / "w.1.et").read_bytes()
    (out / "w.1.et").write_bytes(data[:-5])
    report = validate_trace(out)
    (v,) = [v for v in report.errors if v.check == "file"]
    assert v.rank == 1 and "truncated record" in v.message and "w.1.et" in v.message


def test_dangling_dep(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[0][3] = comp(3, 1, 42)
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert (v.check, v.rank, v.node) == ("dangling-dep", 0, 3)
    assert "data dep 42" in v.message


def test_unmatched_receive(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[1][2] = recv(2, 1, 0, tag=2)
    report = validate_trace(write_trace(tmp_path, ranks))
    assert {v.check for v in report.errors} == {"unmatched-recv", "unmatched-send"}
    (v,) = [v for v in report.errors if v.check == "unmatched-recv"]
    assert (v.rank, v.node) == (1, 2) and "deadlock" in v.message


def test_size_is_part_of_the_match(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[1][2] = recv(2, 1, 0, size=16)
    assert checks(write_trace(tmp_path, ranks)) == {"unmatched-recv", "unmatched-send"}


def test_mismatched_collective_sequence(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[1][1] = coll(1, 1, 128, AR, 0)
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert v.check == "collective-mismatch"
    assert "ALL_REDUCE of 128 bytes" in v.message and "ALL_REDUCE of 64 bytes" in v.message
    ranks[1][1] = coll(1, 1, 64, AG, 0)
    assert checks(write_trace(tmp_path, ranks)) == {"collective-mismatch"}
    ranks[1][1] = comp(1, 0)
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert "missing" in v.message


def test_duplicate_id(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[0].append(comp(3, 0))
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert (v.check, v.node) == ("duplicate-id", 3)


def test_cycle(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[0][0] = comp(0, 3)
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert v.check == "cycle" and "0 -> 1 -> 3 -> 0" in v.message


def test_long_chain_needs_no_recursion(tmp_path: Path) -> None:
    nodes = [comp(0)] + [comp(i, i - 1) for i in range(1, 20_000)]
    path = tmp_path / "chain.0.et"
    path.write_bytes(chakra_v004.encode_nodes(nodes))
    assert validate_trace(path).ok


def test_repeated_dep(tmp_path: Path) -> None:
    ranks = good_ranks()
    ranks[0][3] = comp(3, 1, ctrl=(1,))
    (v,) = validate_trace(write_trace(tmp_path, ranks)).errors
    assert v.check == "repeated-dep" and "parent 1 twice" in v.message


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({2: (0, 1)}, "group 1 is used by rank 0 but not defined"),
        ({1: (0, 1), 2: (1,)}, "group 2 has 1 member(s)"),
        ({1: (1, 0)}, "must be sorted"),
        ({1: (0, 1, 5)}, "outside 0..1"),
        ({0: (0, 1), 1: (0, 1)}, "group id 0 must be >= 1"),
    ],
)
def test_comm_group_file(tmp_path: Path, groups: dict, message: str) -> None:
    out = write_trace(tmp_path, good_ranks())
    (out / "w.json").write_text(json.dumps({str(k): list(v) for k, v in groups.items()}))
    report = validate_trace(out)
    assert any(v.check == "comm-group" and message in v.message for v in report.errors), (
        report.errors
    )


def test_comm_group_file_keys_and_presence(tmp_path: Path) -> None:
    out = write_trace(tmp_path, good_ranks())
    (out / "w.json").write_text('{"g1": [0, 1]}')
    assert any("decimal group id" in v.message for v in validate_trace(out).errors)
    (out / "w.json").unlink()
    assert any("is missing" in v.message for v in validate_trace(out).errors)


def test_attribute_kinds_and_comm_fields(tmp_path: Path) -> None:
    out = write_trace(tmp_path, good_ranks())
    node = pb4.Node(id=0, name="c0", type=pb4.COMP_NODE)
    for name, kind, value in (("is_cpu_op", "bool_val", False), ("num_ops", "uint64_val", 10),
                              ("tensor_size", "uint64_val", 4)):
        attr = node.attr.add(name=name)
        setattr(attr, kind, value)
    meta = pb4.GlobalMetadata(version="0.0.4").SerializeToString()
    body = b"".join(chakra_v004.encode_node(n) for n in good_ranks()[0][1:])
    (out / "w.0.et").write_bytes(frame(meta) + frame(node.SerializeToString()) + body)
    (v,) = validate_trace(out).errors
    assert (v.check, v.node) == ("attr-type", 0)
    assert "num_ops is uint64_val, must be int64_val" in v.message
    ranks = good_ranks()
    ranks[0][2] = send(2, 0, 1, tag=600_000_000)
    ranks[1][2] = recv(2, 1, 0, tag=600_000_000)
    assert checks(write_trace(tmp_path, ranks)) == {"comm-field"}


def test_missing_rank_file(tmp_path: Path) -> None:
    out = write_trace(tmp_path, [*good_ranks(), [comp(0)]])
    (out / "w.1.et").unlink()
    with pytest.raises(UserError, match=r"2 of 3 rank files present; missing rank 1$"):
        validate_trace(out)


def test_validate_workload_finds_problems() -> None:
    layout = Layout({"tp": 2}, group_axes=(("tp",),))
    bad = RankClass(index=0, stage=0, nodes=(
        NodeTemplate(id=0, name="a", type=NodeType.COMP, data_deps=(1,)),
        NodeTemplate(id=1, name="b", type=NodeType.COMP, data_deps=(0,)),
        NodeTemplate(id=2, name="r", type=NodeType.COMM_RECV, peer_stage=0, comm_tag=1),
    ))
    report = validate_workload(workload_from_classes(layout, [bad]))
    found = {v.check for v in report.errors}
    assert "cycle" in found and "comm-field" in found  # a recv from itself


def test_unusable_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        validate_trace(tmp_path / "nothing")
    with pytest.raises(UserError, match="no rank files"):
        validate_trace(tmp_path)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = write_trace(tmp_path, good_ranks())
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out)])
    assert exit_info.value.code == 0
    assert "valid: 2 ranks, 8 nodes" in capsys.readouterr().out
    ranks = good_ranks()
    ranks[1][2] = recv(2, 1, 0, tag=2)
    out = write_trace(tmp_path, ranks)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out), "--json"])
    assert exit_info.value.code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["errors"]["unmatched-recv"] == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_cross_rank_deadlock_of_sends(tmp_path: Path) -> None:
    ranks = [
        [recv(0, 0, 1, tag=1), Node(id=1, name="s", type=NodeType.COMM_SEND, data_deps=(0,),
                                    comm_src=0, comm_dst=1, comm_tag=2, comm_size=8)],
        [recv(0, 1, 0, tag=2), Node(id=1, name="s", type=NodeType.COMM_SEND, data_deps=(0,),
                                    comm_src=1, comm_dst=0, comm_tag=1, comm_size=8)],
    ]
    report = validate_trace(write_trace(tmp_path, ranks, {}))
    assert {v.check for v in report.errors} == {"deadlock"}
    assert "recv 0 waits for send 1 of rank 1, which cannot run" in report.errors[0].message


def test_cross_rank_deadlock_through_a_collective(tmp_path: Path) -> None:
    ranks = [
        [recv(0, 0, 1), coll(1, 1, 64, AR, 0)],
        [coll(0, 1, 64, AR), Node(id=1, name="s", type=NodeType.COMM_SEND, data_deps=(0,),
                                  comm_src=1, comm_dst=0, comm_tag=1, comm_size=8)],
    ]
    report = validate_trace(write_trace(tmp_path, ranks))
    assert [v.check for v in report.errors] == ["deadlock", "deadlock"]
    assert any("collective 0 waits for the other members" in v.message for v in report.errors)
    ranks[0] = [coll(0, 1, 64, AR), recv(1, 0, 1, 1, 8)]
    assert validate_trace(write_trace(tmp_path, ranks)).ok


def test_validate_workload_finds_deadlock() -> None:
    layout = Layout({"pp": 2})
    stage0 = RankClass(index=0, stage=0, nodes=(
        NodeTemplate(id=0, name="r", type=NodeType.COMM_RECV, peer_stage=1, comm_tag=1),
        NodeTemplate(id=1, name="s", type=NodeType.COMM_SEND, peer_stage=1, comm_tag=2,
                     data_deps=(0,)),
    ))
    stage1 = RankClass(index=1, stage=1, nodes=(
        NodeTemplate(id=0, name="r", type=NodeType.COMM_RECV, peer_stage=0, comm_tag=2),
        NodeTemplate(id=1, name="s", type=NodeType.COMM_SEND, peer_stage=0, comm_tag=1,
                     data_deps=(0,)),
    ))
    report = validate_workload(workload_from_classes(layout, [stage0, stage1]))
    assert {v.check for v in report.errors} == {"deadlock"}
