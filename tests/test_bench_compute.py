"""``stg bench compute``: PARAM configs run on the CPU with PyTorch, PARAM's result lines.

The result files must have the fields PARAM writes (checked on PARAM's own files in
../shared/data/param too), plus what stg adds; bad configs give one line per failing case;
a missing PyTorch is one line naming the extra.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch  # the bench extra, which CI installs (README's second command)
from typer.testing import CliRunner

from stg.bench.results import read_results
from stg.cli import app

PARAM = Path(__file__).resolve().parents[2] / "shared" / "data" / "param"
GEN = "PyTorch:DefaultDataGenerator"
HINT = "pip install 'symbolic-tensor-graph[bench]'"


def _t(dtype: str, shape: list[Any], **extra: Any) -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "shape": shape, **extra}


def _op(inputs: list[dict[str, Any]], **info: Any) -> dict[str, Any]:
    return {"input_data_generator": GEN, "config": [{"input": inputs}], **info}


def _run(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "240"})


def check_param_lines(lines: list[dict[str, Any]], *, finished: bool = True) -> None:
    """The layout of PARAM's result files (PARAM.md 1.4)."""
    setup, *rest = lines
    assert isinstance(setup["run_options"], dict) and isinstance(setup["sys_info"], dict)
    assert isinstance(setup["start_time"], str)
    cases = [x for x in rest if "op_name" in x]
    assert cases
    for case in cases:
        assert isinstance(case["op_name"], str) and isinstance(case["id"], str)
        assert set(case["config"]) == {"build", "input"}
        if "error" in case:  # stg's line for a case that failed (PARAM aborts instead)
            assert isinstance(case["error"], str) and case["metric"] == {}
            continue
        assert isinstance(case["config"]["input"]["args"], list)
        assert set(case["metric"]) <= {"forward", "backward"} and "forward" in case["metric"]
        for metric in case["metric"].values():
            assert {"warmup.time", "measure.time"} <= set(metric)
            for key, values in metric.items():
                assert key.endswith((".time", ".memory")), key
                assert all(isinstance(v, int | float) and v >= 0 for v in values)
    if finished:
        assert "finish_time" in rest[-1]


@pytest.mark.parametrize("name", sorted(p.name for p in PARAM.glob("*.jsonl")))
def test_the_layout_check_accepts_params_own_files(name: str) -> None:
    lines = [json.loads(x) for x in (PARAM / name).read_text().splitlines() if x.strip()]
    result = read_results(PARAM / name)
    check_param_lines(lines, finished=result.finished)
    assert result.finished == (name != "h100-param_aten_ops.jsonl")
    if not result.finished:
        assert result.warnings == [
            f"{PARAM / name} is incomplete (no finish line: the run stopped early); "
            "using its 4 cases"
        ]


def _config() -> dict[str, Any]:
    rng = {"__range__": ["shape"]}
    schema = "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"
    return {
        "torch.mm": _op([{"args": [_t("float", [64, 32]), _t("float", [32, 16])]}]),
        "torch.bmm": _op(
            [{"args": [_t("float", [2, [8, 9, 1], 4], **rng), _t("float", [2, 4, 8])]}],
            input_iterator="RangeConfigIterator",
        ),
        "torch.nn.Linear": {
            "build_data_generator": GEN,
            "input_data_generator": GEN,
            "config": [
                {
                    "build": [{"args": [{"type": "int", "value": 32}, {"type": "int", "value": 8}],
                               "kwargs": {"bias": {"type": "bool", "value": False}}}],
                    "input": [{"args": [_t("float", [4, 32])]}],
                }
            ],
        },
        "aten::add_": {
            "build_data_generator": GEN,
            "input_data_generator": GEN,
            "config": [
                {
                    "build": [{"args": [{"type": "str", "value": schema}]}],
                    "input": [{"args": [_t("float", [4, 4]), _t("float", [4, 4]),
                                        {"type": "int", "value": 1}]}],
                }
            ],
        },
        "torch.nn.functional.scaled_dot_product_attention": _op(
            [{"args": [_t("float", [1, 2, 16, 8])] * 3,
              "kwargs": {"is_causal": {"type": "bool", "value": True}}}]
        ),
        "torch.nn.functional.layer_norm": _op(
            [{"args": [_t("float", [8, 16]),
                       {"type": "genericlist", "value": [{"type": "int", "value": 16}]}]}]
        ),
    }  # fmt: skip


def test_compute_writes_params_result_lines_with_work_and_rates(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(_config()))
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "-w", "2", "-i", "5", "-b",
                   "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    check_param_lines(lines)
    assert lines[0]["run_options"]["pass_type"] == "ExecutionPass.BACKWARD"
    assert lines[0]["sys_info"]["pytorch_version"] == torch.__version__
    assert lines[-1]["cases"] == 7 and lines[-1]["failed"] == 0
    cases = {(x["op_name"], x["id"]): x for x in lines if "op_name" in x}
    assert sorted(cases) == [
        ("aten::add_", "0|0|0"),
        ("torch.bmm", "0|0|0_0"),
        ("torch.bmm", "0|0|0_1"),
        ("torch.mm", "0|0|0"),
        ("torch.nn.Linear", "0|0|0"),
        ("torch.nn.functional.layer_norm", "0|0|0"),
        ("torch.nn.functional.scaled_dot_product_attention", "0|0|0"),
    ]
    mm = cases[("torch.mm", "0|0|0")]
    assert [len(mm["metric"]["forward"][k]) for k in ("warmup.time", "measure.time")] == [2, 5]
    extra = mm["extra"]
    times = mm["metric"]["forward"]["measure.time"]
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    assert extra["median_ms"] == pytest.approx(statistics.median(times))
    assert extra["iqr_ms"] == pytest.approx(q3 - q1)
    assert extra["flops"] == 2 * 64 * 16 * 32
    assert extra["bytes"] == (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert extra["gemm"] == [1, 64, 16, 32]
    assert extra["tflops"] == pytest.approx(extra["flops"] / (extra["median_ms"] * 1e-3) / 1e12)
    assert extra["gbps"] == pytest.approx(extra["bytes"] / (extra["median_ms"] * 1e-3) / 1e9)
    assert extra["flops_bwd"] == 2 * extra["flops"] and extra["median_bwd_ms"] > 0
    assert cases[("torch.bmm", "0|0|0_1")]["extra"]["gemm"] == [2, 9, 8, 4]
    assert cases[("torch.nn.Linear", "0|0|0")]["extra"]["gemm"] == [1, 4, 8, 32]
    sdpa = cases[("torch.nn.functional.scaled_dot_product_attention", "0|0|0")]["extra"]
    assert sdpa["attention"] == [1, 2, 16, 16, 8, 1]
    assert sdpa["flops"] == 4 * 2 * 16 * 16 * 8 / 2
    assert sdpa["flops_bwd"] == 2.5 * sdpa["flops"]
    norm = cases[("torch.nn.functional.layer_norm", "0|0|0")]["extra"]
    assert (norm["op_class"], norm["bytes"]) == ("norm", 2 * 8 * 16 * 4)
    # PARAM's in-place trap: the tensors are made without gradients, and the line says so
    inplace = cases[("aten::add_", "0|0|0")]
    assert [a.get("requires_grad") for a in inplace["config"]["input"]["args"][:2]] == [False] * 2
    assert "backward" not in inplace["metric"]
    assert inplace["extra"]["note"] == "backward skipped: the op works in place"
    assert "torch.nn.functional.scaled_dot_product_attention" in result.stdout
    assert result.stderr.strip() == f"7 of 7 cases measured, 0 failed; results in {out}"


def test_result_lines_feed_back_as_configs(tmp_path: Path) -> None:
    """As with PARAM, each case line's config is a materialized config that runs again."""
    (tmp_path / "c.json").write_text(json.dumps({"torch.bmm": _config()["torch.bmm"]}))
    first = tmp_path / "r1.jsonl"
    assert _run(["bench", "compute", str(tmp_path / "c.json"), "-w", "0", "-i", "1",
                 "-o", str(first)]).exit_code == 0  # fmt: skip
    cases = [json.loads(x) for x in first.read_text().splitlines() if '"op_name"' in x]
    again = {"torch.bmm": _op([c["config"]["input"] for c in cases])}
    (tmp_path / "again.json").write_text(json.dumps(again))
    second = tmp_path / "r2.jsonl"
    assert _run(["bench", "compute", str(tmp_path / "again.json"), "-w", "0", "-i", "1",
                 "-o", str(second)]).exit_code == 0  # fmt: skip
    redone = [json.loads(x) for x in second.read_text().splitlines() if '"op_name"' in x]
    assert [c["config"] for c in redone] == [c["config"] for c in cases]


def test_failing_cases_are_one_line_each_and_the_run_goes_on(tmp_path: Path) -> None:
    config = {
        "torch.mm": _op([{"args": [_t("float", [4, 5]), _t("float", [6, 7])]},
                         {"args": [_t("float", [4, 5]), _t("float", [5, 7])]}]),
        "torch.nope": _op([{"args": [_t("float", [4])]}]),
        "torch.add": _op([{"args": [_t("float", [4, [1, 0, 1]], __range__=["shape"])]}],
                         input_iterator="RangeConfigIterator"),
    }  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(config))
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "-i", "2", "-o", str(out)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0] == (
        "error: torch.mm|0|0|0: mat1 and mat2 shapes cannot be multiplied (4x5 and 6x7)"
    )
    assert errors[1].startswith("error: torch.nope|0|0|0: unknown operator 'torch.nope'; allowed: ")
    assert "torch.mm, torch.mul" in errors[1] and errors[1].endswith(
        "or aten::NAME with its schema as the build argument"
    )
    assert errors[2] == (
        "error: torch.add|0|0|0_?: config[0].input[0].args[0].shape[1]: bad macro: range "
        "[1, 0, 1] needs min <= max and step > 0"
    )
    assert len(errors) == 3
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    check_param_lines(lines)
    cases = [x for x in lines if "op_name" in x]
    assert [("error" in c) for c in cases] == [True, False, True, True]
    assert cases[1]["extra"]["flops"] == 2 * 4 * 7 * 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "config '{p}' is not JSON: Expecting property name enclosed in double quotes at "
              "line 1 column 2"),
        ("{}", "config '{p}' has no operator to run"),
        ('{"ops": {"fc1": "int8"}}', "config '{p}' has no operator to run: every entry (ops) "
         "lacks an input_data_generator, which PARAM needs to run an operator"),
    ],
)  # fmt: skip
def test_an_unusable_config_is_exit_2_and_writes_nothing(
    tmp_path: Path, text: str, message: str
) -> None:
    config = tmp_path / "c.json"
    config.write_text(text)
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(config), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "error: " + message.format(p=config)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_a_missing_torch_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"torch.mm": _config()["torch.mm"]}))
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "-o", str(out)])
    assert result.exit_code == 2
    assert (
        result.stderr == f"error: stg bench compute needs torch, which is not installed: {HINT}\n"
    )
    assert not out.exists()
    comms = _run(["bench", "comms", "-o", str(tmp_path / "n.json")])
    assert comms.exit_code == 2
    assert comms.stderr == f"error: stg bench comms needs torch, which is not installed: {HINT}\n"


def test_a_missing_matplotlib_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"torch.mm": _config()["torch.mm"]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "--plot", "p.png",
                   "-o", str(tmp_path / "r.jsonl")])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr == f"error: --plot needs matplotlib, which is not installed: {HINT}\n"


def test_device_without_cuda(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"torch.mm": _config()["torch.mm"]}))
    out = tmp_path / "r.jsonl"
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "--device", "cuda",
                   "-i", "2", "-o", str(out)])  # fmt: skip
    if torch.cuda.is_available():  # the same command works unchanged on a GPU
        assert result.exit_code == 0, result.output
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert lines[1]["metric"]["forward"]["measure.gpu.memory"][0] > 0
    else:
        assert result.exit_code == 2
        assert result.stderr == "error: --device cuda: no CUDA device is available\n"
        assert not out.exists()


def test_roofline_plot(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(_config()))
    plot = tmp_path / "roof.png"
    result = _run(["bench", "compute", str(tmp_path / "c.json"), "-i", "2", "--plot", str(plot),
                   "-o", str(tmp_path / "r.jsonl")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "r.jsonl", "roof.png"]


PLUGIN = """
import stg
from stg.api import BenchOp


def triple(x):
    return x * 3


@stg.hookimpl
def stg_register_bench_ops(register):
    register(BenchOp(name="mylib.triple", function=triple, op_class="stream",
                     nbytes=lambda config: 2 * 4 * config["input"]["args"][0]["shape"][0]))
"""


def test_a_plugin_registers_an_operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "stg_triple.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    (tmp_path / "c.json").write_text(
        json.dumps({"mylib.triple": _op([{"args": [_t("float", [1000])]}])})
    )
    out = tmp_path / "r.jsonl"
    result = _run(["-p", "stg_triple", "bench", "compute", str(tmp_path / "c.json"),
                   "-i", "3", "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    case = json.loads(out.read_text().splitlines()[1])
    assert case["op_name"] == "mylib.triple" and case["extra"]["bytes"] == 8000
    assert case["extra"]["op_class"] == "stream" and case["extra"]["gbps"] > 0
    listing = _run(["-p", "stg_triple", "plugins", "list", "--json"])
    plugins = {p["name"]: p for p in json.loads(listing.stdout)["plugins"]}
    assert plugins["stg_triple"]["registers"] == {"bench_ops": ["mylib.triple"]}
    assert "torch.mm" in plugins["stg.bench.ops"]["registers"]["bench_ops"]


def test_a_malformed_operator_record_is_refused_at_load_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stg_badop.py").write_text(PLUGIN.replace('op_class="stream"', 'op_class="fast"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    listing = _run(["-p", "stg_badop", "plugins", "list", "--json"])
    (failure,) = json.loads(listing.stdout)["failures"]
    assert failure["error"] == (
        "stg_register_bench_ops: RecordError: bench operator 'mylib.triple': op_class 'fast' "
        "must be one of gemm, attention, stream, norm, softmax, other"
    )
