"""Megatron's overlap options in the time replay, each against its closed form:
``--overlap_param_gather`` (the distributed optimizer's parameter all-gathers before the next
iteration's forward) and ``--tp_comm_overlap`` (userbuffers: sequence parallelism's
collectives pipelined in chunks with their GEMMs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stg.cli import main
from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import (
    ROLE_ATTR,
    CollectiveType,
    NodeTemplate,
    NodeType,
    RankClass,
    RankGraph,
    Role,
    Workload,
)
from stg.host.registry import load_registry
from stg.perf.kernel_time import gemm_time
from stg.perf.system import load_system
from stg.predictors.time import (
    TP_OVERLAP_PIPELINE_SPLITS,
    USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE,
    USERBUFFERS_SMS,
    chunked_overlap_time,
    collective_time,
    contended_system,
    group_shape,
    predict_time,
    problem_from_workload,
    replay,
)

H100 = load_system("h100-80g")
# links without a kind contend with nothing: the gathers' effect alone
PLAIN_H100 = dataclasses.replace(
    H100, network=tuple(dataclasses.replace(d, link=None) for d in H100.network)
)

ZERO1 = GenerateOptions(
    model="llama",
    dmodel=1024,
    dff=4096,
    head=16,
    kvhead=16,
    num_stacks=2,
    seq=4096,
    batch=4,
    micro_batch=2,
    dvocal=1024,
    dp=2,
    zero=1,
)


def _gathers(unit_result: object) -> dict[str, int]:
    nodes = unit_result.unit.nodes  # type: ignore[attr-defined]
    return {
        n.name.split("/", 1)[0]: i
        for i, n in enumerate(nodes)
        if n.type is NodeType.COMM_COLL and "/all_gather_dp:" in n.name
    }


def test_param_gather_hides_behind_the_next_forward() -> None:
    workload = build_workload(ZERO1, load_registry(autoload=False))
    problem = problem_from_workload(workload, PLAIN_H100)
    off = replay(problem, PLAIN_H100)
    on = replay(problem, PLAIN_H100, overlap_param_gather=True)
    res_off, res_on = off.units[0], on.units[0]
    gathers = _gathers(res_off)
    assert set(gathers) == {"embedding", "layer0", "layer1", "head"}
    size = {p: res_off.unit.nodes[i].comm_size for p, i in gathers.items()}
    shape = group_shape([0, 1], PLAIN_H100)
    d = {p: collective_time(CollectiveType.ALL_GATHER, size[p], shape, PLAIN_H100) for p in size}
    for p, i in gathers.items():
        assert res_off.duration[i] == pytest.approx(d[p])
    # without the option the gathers follow the optimizer step, one after the other
    assert off.iteration_time == pytest.approx(max(res_off.end[i] for i in gathers.values()))
    step = next(i for i, n in enumerate(res_off.unit.nodes) if n.name == "optimizer_step")
    assert off.iteration_time == pytest.approx(res_off.end[step] + sum(d.values()))
    # with it, each gather ends before the first forward use of its part
    nodes = res_on.unit.nodes
    for part, i in gathers.items():
        first = min(
            res_on.start[k]
            for k, n in enumerate(nodes)
            if n.name.startswith("mb")
            and n.name.split("/")[1] == part
            and n.name.split("/")[2] != "bwd"
        )
        assert res_on.end[i] <= first + 1e-12
    # closed form: the iteration opens with the embedding's gather, and layer 0 waits for its
    # own beyond the embedding's lookup; layer 1's and the head's hide behind the forward
    lookup = sum(
        res_on.duration[k]
        for k, n in enumerate(nodes)
        if n.name.startswith("mb0/embedding/")
        and not n.name.startswith("mb0/embedding/bwd/")
        and res_on.kind[k] == 0
    )
    assert lookup > 0
    exposed = d["embedding"] + max(0.0, d["layer0"] - lookup)
    assert on.iteration_time == pytest.approx(off.iteration_time - sum(d.values()) + exposed)
    assert on.iteration_time < off.iteration_time - d["layer1"] - d["head"] + 1e-12


def _tp_workload(nodes: tuple[NodeTemplate, ...]) -> Workload:
    layout = Layout({"tp": 2}, group_axes=(("tp",),))
    rc = RankClass(0, 0, nodes)
    ranks = tuple(RankGraph(r, rc, layout) for r in range(2))
    return Workload(ranks, layout.comm_groups, layout, {})


def _gemm(node_id: int, name: str, m: int, n: int, k: int, deps: tuple[int, ...]) -> NodeTemplate:
    return NodeTemplate(
        node_id,
        name,
        NodeType.COMP,
        num_ops=2 * m * n * k,
        tensor_size=(m * k + k * n + m * n) * 2,
        dtype="bf16",
        data_deps=deps,
        attrs={"gemm": (1, m, n, k)},
    )


def _coll(node_id: int, name: str, kind: CollectiveType, size: int, deps: tuple[int, ...]):
    """A sequence-parallel collective over tp: its typed role says so (not its name)."""
    role = Role.TP_ALL_GATHER if kind is CollectiveType.ALL_GATHER else Role.TP_REDUCE_SCATTER
    return NodeTemplate(
        node_id,
        name,
        NodeType.COMM_COLL,
        data_deps=deps,
        comm_type=kind,
        comm_size=size,
        group_axes=("tp",),
        attrs={ROLE_ATTR: int(role)},
    )


@pytest.mark.parametrize("method", ["ring_exchange", "pipeline"])
def test_tp_comm_overlap_is_the_chunked_pipeline(method: str) -> None:
    m, n, k = 8192, 8192, 4096
    size = 2**30  # 1 GiB: longer than the GEMM on NVLink
    if method == "ring_exchange":  # the all-gather of the input, then the GEMM
        kind, chunks = CollectiveType.ALL_GATHER, 2  # one chunk per tp rank
        nodes = (
            _coll(0, "mb0/layer0/fwd/all_gather_tp:ln", kind, size, ()),
            _gemm(1, "mb0/layer0/fwd/fc1", m, n, k, (0,)),
        )
    else:  # the GEMM, then the reduce-scatter of its output
        kind, chunks = CollectiveType.REDUCE_SCATTER, TP_OVERLAP_PIPELINE_SPLITS
        nodes = (
            _gemm(0, "mb0/layer0/fwd/fc2", m, n, k, ()),
            _coll(1, "mb0/layer0/fwd/reduce_scatter_tp:fc2", kind, size, (0,)),
        )
    workload = _tp_workload(nodes)
    comm = collective_time(kind, size, group_shape([0, 1], H100), H100)
    free = gemm_time(H100.gpu, m, n, k) + H100.kernel_overhead
    beside = contended_system(
        H100, "nvlink", USERBUFFERS_SMS[method], USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE[method]
    )
    slowed = gemm_time(beside.gpu, m, n, k) + H100.kernel_overhead
    assert free <= slowed < comm
    if method == "pipeline":  # 16 SMs fewer: more waves
        assert slowed > free
    off = predict_time(workload, H100)["iteration_time_s"]
    assert off == pytest.approx(comm + free)
    on = predict_time(dataclasses.replace(workload, metadata=_meta(tp_comm_overlap=True)), H100)
    expected = max(slowed, comm) + min(slowed, comm) / chunks
    assert chunked_overlap_time(slowed, comm, chunks) == pytest.approx(expected)
    assert on["iteration_time_s"] == pytest.approx(expected)


def test_tp_comm_overlap_hides_a_short_collective_behind_its_gemm() -> None:
    m, n, k = 8192, 8192, 8192
    size = 2**22  # 4 MiB: far shorter than the GEMM
    nodes = (
        _coll(0, "mb0/layer0/fwd/all_gather_tp:ln", CollectiveType.ALL_GATHER, size, ()),
        _gemm(1, "mb0/layer0/fwd/fc1", m, n, k, (0,)),
    )
    workload = dataclasses.replace(_tp_workload(nodes), metadata=_meta(tp_comm_overlap=True))
    comm = collective_time(CollectiveType.ALL_GATHER, size, group_shape([0, 1], H100), H100)
    beside = contended_system(H100, "nvlink", 1, 2)
    slowed = gemm_time(beside.gpu, m, n, k) + H100.kernel_overhead
    assert comm < slowed
    assert predict_time(workload, H100)["iteration_time_s"] == pytest.approx(slowed + comm / 2)


def _meta(**options: object) -> dict[str, object]:
    return {"options": options}


def test_overlap_options_on_generated_llama_and_its_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    options = dataclasses.replace(ZERO1, tp=2, dmodel=512, dff=2048, head=8, kvhead=8, seq=1024)
    registry = load_registry(autoload=False)
    times = {}
    for opg in (False, True):
        for tpo in (False, True):
            o = dataclasses.replace(options, overlap_param_gather=opg, tp_comm_overlap=tpo)
            workload = build_workload(o, registry)
            recorded = workload.metadata["options"]
            # off: left out of the trace's metadata, so default traces keep their bytes
            assert ("overlap_param_gather" in recorded) == opg
            assert ("tp_comm_overlap" in recorded) == tpo
            times[opg, tpo] = predict_time(workload, H100)["iteration_time_s"]
    assert times[True, False] < times[False, False]
    assert times[False, True] < times[False, False]
    assert times[True, True] < min(times[True, False], times[False, True])
    # a trace records the options on, and stg predict applies them to it
    flags = [
        "--model", "llama", "--dmodel", "512", "--dff", "2048", "--head", "8", "--kvhead", "8",
        "--num_stacks", "2", "--seq", "1024", "--batch", "4", "--micro_batch", "2",
        "--dvocal", "1024", "--dp", "2", "--tp", "2", "--zero", "1",
        "--overlap_param_gather", "true", "--tp_comm_overlap", "true",
    ]  # fmt: skip
    out_dir = tmp_path / "trace"
    with pytest.raises(SystemExit) as info:
        main(["generate", *flags, "--output_dir", str(out_dir)])
    assert info.value.code in (0, None)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["predict", str(out_dir), "--system", "h100-80g", "--predictor", "time", "--json"])
    out, err = capsys.readouterr()
    assert info.value.code in (0, None), err
    assert json.loads(out)["time"]["iteration_time_s"] == pytest.approx(times[True, True])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--overlap_param_gather", "true"], "allowed: zero=1 or zero=2"),
        (["--overlap_param_gather", "true", "--weight_sharded", "true"], "zero=0 (weight_sharded)"),
        (["--overlap_param_gather", "true", "--zero", "1", "--dp", "1"], "needs dp·sp > 1"),
        (["--tp_comm_overlap", "true", "--tp", "1"], "allowed: tp > 1 with tpsp=true"),
        (["--tp_comm_overlap", "true", "--tpsp", "false"], "allowed: tp > 1 with tpsp=true"),
        (["--tp_comm_overlap", "true", "--profile", "eager"], "allowed: profile=megatron"),
        (
            ["--tp_comm_overlap", "true", "--predictor", "analytical"],
            "does not model tp_comm_overlap=true",
        ),
    ],
)
def test_bad_overlap_combinations_are_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    small = [
        "--model", "gpt", "--dmodel", "256", "--dff", "1024", "--head", "8", "--kvhead", "8",
        "--num_stacks", "2", "--seq", "128", "--dvocal", "1000", "--batch", "4", "--dp", "2",
        "--tp", "2",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(["predict", *small, *flags])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert not out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_forward_parts_are_each_nodes_forward_part() -> None:
    """:func:`stg.perf.replay.forward_parts` works each node's part out once per distinct set
    of raw attributes (the overlapped parameter gathers' rewiring): the same as asking each
    node, on a workload of every phase, recompute and part included."""
    from stg.perf.replay import forward_part, forward_parts, problem_from_workload

    options = GenerateOptions(
        model="llama", dmodel=64, dff=256, head=4, kvhead=2, seq=32, dvocal=128, num_stacks=4,
        pp=2, dp=2, micro_batch=2, batch=8, zero=1, overlap_param_gather=True,
        activation_recompute="selective",
    )  # fmt: skip
    problem = problem_from_workload(
        build_workload(options, load_registry(autoload=False)), load_system("h100-80g")
    )
    for unit in problem.units:
        parts = forward_parts(unit.nodes)
        assert parts == [forward_part(node) for node in unit.nodes]
        assert {"embedding", "layer0"} & set(parts) or {"layer2", "layer3"} & set(parts)
