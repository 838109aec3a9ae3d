"""PyTorch execution traces in: the shipped traces (scripts/record_pytorch_et.py, on the CPU)
converted through mlc-chakra into Chakra v0.0.4, validated, predicted; their operators
replayed PARAM-style into results that calibrate the prediction."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_bench_compute import check_param_lines
from typer.testing import CliRunner

from stg.bench.et_replay import data_spec, replay_config
from stg.cli import app
from stg.core.workload import CollectiveType, NodeType
from stg.trace.aten import Tensor, gemm_shape, is_view, op_work, tensors
from stg.trace.pytorch_et import host_trace_work, load_host_trace
from stg.trace.reader import iter_nodes, read_metadata

DATA = Path(__file__).parent / "data" / "pytorch_et"
MLP = DATA / "mlp_et.json"
HIDDEN, BATCH = 1024, 256  # scripts/record_pytorch_et.py's defaults, which recorded the files


def _run(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "240"})


def test_schema_records_tell_views_gemms_and_tensors() -> None:
    assert is_view("aten::t(Tensor(a) self) -> Tensor(a)")
    assert is_view(
        "aten::expand(Tensor(a) self, SymInt[] size, *, bool implicit=False) -> Tensor(a)"
    )
    assert not is_view(
        "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"
    )
    assert not is_view("aten::mm(Tensor self, Tensor mat2) -> Tensor")
    f = [Tensor("float", 4, (8,)), Tensor("float", 4, (32, 16)), Tensor("float", 4, (16, 8))]
    assert gemm_shape("addmm", f) == (1, 32, 8, 16)
    assert gemm_shape("mm", f[1:]) == (1, 32, 8, 16)
    assert gemm_shape("linear", [Tensor("float", 4, (2, 3, 16)), Tensor("float", 4, (8, 16))]) == (
        1,
        6,
        8,
        16,
    )
    assert gemm_shape("mm", [f[1], f[1]]) is None  # inner dimensions differ
    listed = tensors(
        ["GenericList[Tensor(float),Tensor(c10::BFloat16)]", "Int"], [[[2, 3], [4]], []]
    )
    assert listed == [Tensor("float", 4, (2, 3)), Tensor("bfloat16", 2, (4,))]
    work = op_work("aten::relu(Tensor self) -> Tensor", [f[1]], [f[1]])
    assert (work.kind, work.nbytes, work.elements, work.flops) == (
        "memory",
        2 * 32 * 16 * 4,
        512,
        0,
    )
    assert (
        op_work("aten::mm(Tensor self, Tensor mat2) -> Tensor", f[1:], []).flops == 2 * 32 * 8 * 16
    )


def test_the_top_level_operators_of_the_shipped_step() -> None:
    """aten::linear is the operator (its aten::t and aten::addmm run inside it); the backward
    matmuls sit under autograd functions, which are not operators."""
    work = host_trace_work(load_host_trace(MLP))
    gemms = sorted(
        (w.gemm, work.schemas[i].split("(")[0]) for i, w in work.ops.items() if w.kind == "gemm"
    )
    assert gemms == sorted(
        [((1, BATCH, HIDDEN, HIDDEN), "aten::linear")] * 2
        + [((1, BATCH, HIDDEN, HIDDEN), "aten::mm"), ((1, HIDDEN, HIDDEN, BATCH), "aten::mm"),
           ((1, HIDDEN, HIDDEN, BATCH), "aten::mm")]
    )  # fmt: skip
    assert not work.collectives and not work.groups
    names = {work.schemas[i].split("(")[0] for i in work.ops}
    assert "aten::addmm" not in names and "aten::clamp_min" not in names  # inside linear, relu


def test_convert_validate_and_predict_the_mlp(tmp_path: Path) -> None:
    result = _run(["convert", str(MLP), str(tmp_path / "out" / "mlp"), "--to", "v0.0.4"])
    assert result.exit_code == 0, result.output
    rank = tmp_path / "out" / "mlp.0.et"
    assert result.stdout == f"{rank}\n"
    nodes = list(iter_nodes(rank))
    gemms = [n for n in nodes if "gemm" in n.attrs]
    assert len(gemms) == 5 and all(n.type is NodeType.COMP for n in nodes)
    assert sum(n.num_ops for n in gemms) == 5 * 2 * BATCH * HIDDEN * HIDDEN
    assert {n.dtype for n in gemms} == {"fp32"}
    assert json.loads(read_metadata(rank)["attrs"]["options"]) == {
        "dtype": "fp32",
        "profile": "eager",
    }
    again = tmp_path / "again"
    assert _run(["convert", str(MLP), str(again / "mlp"), "--to", "v0.0.4"]).exit_code == 0
    assert (again / "mlp.0.et").read_bytes() == rank.read_bytes()  # same input, same bytes
    rerun = _run(["convert", str(MLP), str(again / "mlp"), "--to", "v0.0.4"])
    assert rerun.exit_code == 0  # the same conversion again is fine
    other = _run(["convert", str(DATA / "ddp_et.%d.json"), str(again / "mlp"), "--to", "v0.0.4"])
    assert other.exit_code == 2 and other.stderr.startswith(
        f"error: {again} already holds a different trace (mlp.0.et"
    )
    one_rank = _run(["convert", str(DATA / "ddp_et.0.json"), str(tmp_path / "d" / "ddp"),
                     "--to", "v0.0.4"])  # fmt: skip
    assert one_rank.exit_code == 2
    assert one_rank.stderr == (
        "error: process group '0' of the trace spans ranks 0-1, but 1 host trace was given; "
        "give one per rank (a pattern with %d)\n"
    )
    assert not (tmp_path / "d").exists()
    valid = _run(["validate", str(tmp_path / "out" / "mlp")])
    assert valid.exit_code == 0, valid.output
    predicted = _run(["predict", str(tmp_path / "out" / "mlp"), "--predictor", "time", "--json"])
    assert predicted.exit_code == 0, predicted.output
    time = json.loads(predicted.stdout)["time"]
    assert time["iteration_time_s"] > 0 and time["ranks"][0]["flops"] > 0
    everything = _run(["predict", str(tmp_path / "out" / "mlp")])
    assert everything.exit_code == 2
    assert everything.stderr.startswith("error: the memory predictor needs generation options;")


def test_convert_the_two_gloo_ranks_with_their_all_reduce(tmp_path: Path) -> None:
    result = _run(
        ["convert", str(DATA / "ddp_et.%d.json"), str(tmp_path / "ddp"), "--to", "v0.0.4"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "ddp.json").read_text()) == {"1": [0, 1]}
    for rank in (0, 1):
        nodes = list(iter_nodes(tmp_path / f"ddp.{rank}.et"))
        reduces = [n for n in nodes if n.comm_type is CollectiveType.ALL_REDUCE]
        # DDP's one gradient bucket: both 64x64 weights and both biases, fp32
        assert [(n.type, n.comm_size, n.comm_group) for n in reduces] == [
            (NodeType.COMM_COLL, 4 * (2 * 64 * 64 + 2 * 64), 1)
        ]
    # BROADCAST is a valid Chakra collective that ASTRA-sim does not simulate
    assert _run(["validate", str(tmp_path / "ddp"), "--consumer", "chakra"]).exit_code == 0
    predicted = _run(["predict", str(tmp_path / "ddp"), "--predictor", "time", "--json"])
    assert predicted.exit_code == 0, predicted.output
    ranks = json.loads(predicted.stdout)["time"]["ranks"]
    assert len(ranks) == 2 and all(r["communication_s"] > 0 for r in ranks)


def test_kineto_goes_through_chakras_trace_link(tmp_path: Path) -> None:
    out = tmp_path / "mlp"
    result = _run(["convert", str(MLP), str(out), "--to", "v0.0.4",
                   "--kineto", str(DATA / "mlp_kineto.json")])  # fmt: skip
    if importlib.util.find_spec("et_replay") is not None:  # mlc-chakra's linker can run
        assert result.exit_code == 0, result.output
        nodes = list(iter_nodes(tmp_path / "mlp.0.et"))
        assert any(n.runtime > 0 for n in nodes)
        assert _run(["validate", str(out)]).exit_code == 0
        events = json.loads((DATA / "mlp_kineto.json").read_text())["traceEvents"]
        step = max(e["dur"] for e in events if e.get("name", "").startswith("ProfilerStep"))
        # each recorded microsecond counts once: exclusive times, an operator's inclusive one
        assert 0.9 * step <= sum(n.runtime for n in nodes) <= 1.01 * step
    else:
        assert result.exit_code == 2
        assert result.stderr == (
            "error: --kineto: mlc-chakra's trace linker imports PARAM's et_replay package, "
            "which is not installed (it is not on PyPI; mlc-chakra's error names its source); "
            "convert the host trace alone, without --kineto\n"
        )
        assert list(tmp_path.iterdir()) == []


def test_pytorch_conversion_errors_are_one_line(tmp_path: Path) -> None:
    not_et = tmp_path / "x.json"
    not_et.write_text('{"a": 1}')
    bad = _run(["convert", str(not_et), str(tmp_path / "o"), "--to", "v0.0.4", "--from", "pytorch"])
    assert bad.exit_code == 2
    assert bad.stderr.startswith(f"error: {not_et} is not a PyTorch execution trace")
    json_target = _run(["convert", str(MLP), str(tmp_path / "o"), "--to", "json"])
    assert json_target.exit_code == 2 and json_target.stderr.startswith(
        "error: --to json: a PyTorch trace converts to v0.0.4"
    )
    missing = _run(["convert", str(tmp_path / "r.%d.json"), str(tmp_path / "o"), "--to",
                    "v0.0.4", "--from", "pytorch"])  # fmt: skip
    assert missing.exit_code == 2 and "no file for rank 0" in missing.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_data_specs_of_recorded_arguments() -> None:
    assert data_spec("Tensor(c10::BFloat16)", [2, 3], [1, 2, 0, 6, 2, "cpu"]) == {
        "type": "tensor",
        "dtype": "bfloat16",
        "shape": [2, 3],
        "requires_grad": False,
    }
    assert data_spec("GenericList[Int,Int]", [[], []], [4, 5]) == {
        "type": "genericlist",
        "value": [{"type": "int", "value": 4}, {"type": "int", "value": 5}],
    }
    assert data_spec("ScalarType", [], 15) == {"type": "dtype", "value": "bfloat16"}
    assert data_spec("None", [], "<None>") == {"type": "none"}


def test_replay_calibrates_the_prediction_of_the_trace(tmp_path: Path) -> None:
    """et_replay's path: the trace's operators measured, calibrated, and the trace predicted
    with its own measured kernels: every FLOP of the step priced from a measurement."""
    config, results = tmp_path / "ops.json", tmp_path / "ops.jsonl"
    replay = _run(["bench", "replay", str(MLP), "--config", str(config), "--out", str(results),
                   "-w", "0", "-i", "1"])  # fmt: skip
    assert replay.exit_code == 0, replay.output
    made = json.loads(config.read_text())
    assert replay_config(MLP).config == made
    assert {"aten::linear", "aten::mm", "aten::relu", "aten::mse_loss", "aten::add_"} <= set(made)
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    check_param_lines(lines)
    assert len([x for x in lines if "op_name" in x]) == replay_config(MLP).cases
    calibration = tmp_path / "cal.json"
    assert _run(["bench", "calibrate", str(results), "-o", str(calibration)]).exit_code == 0
    assert _run(["convert", str(MLP), str(tmp_path / "mlp"), "--to", "v0.0.4"]).exit_code == 0
    predicted = _run(["predict", str(tmp_path / "mlp"), "--predictor", "time",
                      "--calibration", str(calibration), "--json"])  # fmt: skip
    assert predicted.exit_code == 0, predicted.output
    report = json.loads(predicted.stdout)["time"]
    coverage = report["calibration"]
    assert coverage["analytical"] == 0 and coverage["by_class"]["gemm"]["measured"] == 5
    assert coverage["flops_share"]["measured"] > 0.99
    table = json.loads(calibration.read_text())
    measured = sum(
        e["seconds"] for e in table["entries"] if e["op_class"] == "gemm" and e["op"] == "aten::mm"
    )
    assert report["iteration_time_s"] > measured  # every top-level operator counts
    # the config runs unchanged as a PARAM config in stg bench compute
    again = _run(["bench", "compute", str(config), "-w", "0", "-i", "1", "-o",
                  str(tmp_path / "again.jsonl")])  # fmt: skip
    assert again.exit_code == 0, again.output


def test_replay_of_the_distributed_trace_leaves_its_collectives_out(tmp_path: Path) -> None:
    made = replay_config(DATA / "ddp_et.0.json")
    assert made.cases > 0 and not any(name.startswith("c10d::") for name in made.config)


def test_replay_needs_an_output_and_a_device(tmp_path: Path) -> None:
    none = _run(["bench", "replay", str(MLP)])
    assert none.exit_code == 2
    assert (
        none.stderr
        == "error: give --config FILE (the PARAM config), --out FILE (run it), or both\n"
    )
    if not torch.cuda.is_available():
        cuda = _run(["bench", "replay", str(MLP), "-o", str(tmp_path / "r.jsonl"), "-d", "cuda"])
        assert cuda.exit_code == 2
        assert cuda.stderr == "error: --device cuda: no CUDA device is available\n"
        assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replay_on_a_gpu(tmp_path: Path) -> None:
    result = _run(["bench", "replay", str(MLP), "-o", str(tmp_path / "r.jsonl"), "-d", "cuda",
                   "-w", "1", "-i", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output


def test_a_collective_of_no_known_group_is_one_line(tmp_path: Path) -> None:
    """Without its process-group record the trace cannot say where the all-reduce goes: the
    conversion stops with one line, while the replay (compute only) does not need it."""
    trace = json.loads((DATA / "ddp_et.0.json").read_text())
    trace["nodes"] = [n for n in trace["nodes"] if n["name"] != "## process_group:init ##"]
    source = tmp_path / "ddp_et.json"
    source.write_text(json.dumps(trace))
    result = _run(["convert", str(source), str(tmp_path / "out" / "ddp"), "--to", "v0.0.4"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: node ")
    assert result.stderr.endswith(
        " is a collective, but the trace records no process group (## process_group:init ##); "
        "stg tells a collective's group only where the job has exactly one\n"
    )
    assert not (tmp_path / "out").exists()
    assert replay_config(source).cases == replay_config(DATA / "ddp_et.0.json").cases
