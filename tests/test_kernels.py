"""Kernel-aware prediction (stg.perf.kernels), the precision plan search, and the int8 plugin."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.precision import load_plan
from stg.core.quantities import parse_size
from stg.core.workload import Node, NodeType
from stg.errors import UserError
from stg.explore.precision_search import RISK, plan_ops, search_precision
from stg.host.records import Kernel, RecordError
from stg.host.registry import load_registry
from stg.perf.kernels import KernelTable
from stg.perf.system import System, load_system
from stg.predictors.memory import activation_bytes_per_layer, planned_activation_delta
from stg.predictors.time import compute_time, predict_time

TF = 1e12
INT8 = Kernel(name="toy-int8", op_class="einsum", dtype="int8", speedup=2.0, cast_alpha=1e-9,
              cast_beta=1e-6, bytes_per_element=1.0)
# a realistic int8 GEMM on A100: 0.9 x the int8 roofline, memory-bound casts (5 B per element)
A100_INT8 = Kernel(name="a100-int8", op_class="einsum", dtype="int8", speedup=0.9,
                   cast_alpha=5 / (2039e9 * 0.8), cast_beta=4e-6, bytes_per_element=1.0)
# 7B-class layers: the size quantized kernels are for (cost of building does not depend on it)
DIMS = dict(dvocal=32000, dmodel=4096, dff=16384, seq=2048, head=32, kvhead=32, num_stacks=2,
            batch=2, micro_batch=1)
ARGS = ["--dvocal", "32000", "--dmodel", "4096", "--dff", "16384", "--seq", "2048", "--head",
        "32", "--kvhead", "32", "--num_stacks", "2", "--batch", "2", "--micro_batch", "1"]


def flat_system() -> System:
    base = load_system("a100-80g")
    return replace(
        base,
        peak_flops={"fp32": TF, "tf32": TF, "bf16": 2 * TF, "fp16": 2 * TF, "fp8": 2 * TF,
                    "int8": 4 * TF},
        compute_efficiency={"gemm": 1.0, "attention": 1.0, "other": 1.0},
        hbm_bandwidth=1e12,
        memory_efficiency=1.0,
        kernel_overhead=0.0,
    )


def node(name: str, dtype: str, num_ops: int, tensor_size: int) -> Node:
    return Node(id=1, name=name, type=NodeType.COMP, num_ops=num_ops, tensor_size=tensor_size,
                dtype=dtype)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


# -- the pure cost model ----------------------------------------------------------------------


def test_kernels_price_nodes_by_precision() -> None:
    system = flat_system()
    table = KernelTable.build([INT8], system.name)
    gemm = node("mb0/layer0/fwd/fc1", "int8", 8 * 10**12, 10**9)  # intensity 8000: gemm
    # without a kernel an int8 matmul is dequantized and runs at the bf16 peak (2 TF)
    assert compute_time(gemm, system) == pytest.approx(4.0)
    assert compute_time(gemm, system, kernels=KernelTable()) == pytest.approx(4.0)
    # with it: the int8 peak (4 TF) times the kernel's speedup 2
    assert compute_time(gemm, system, kernels=table) == pytest.approx(1.0)
    # casts: alpha * elements + beta with the kernel, the memory roofline without
    cast = node("mb0/layer0/fwd/fc1.cast_ln2", "int8", 10**6, 3 * 10**6)
    assert compute_time(cast, system, kernels=table) == pytest.approx(1e-9 * 1e6 + 1e-6)
    assert compute_time(cast, system) == pytest.approx(3e-6)
    # other dtypes and bf16 matmuls are untouched
    bf16 = node("mb0/layer0/fwd/fc1", "bf16", 8 * 10**12, 10**9)
    assert compute_time(bf16, system, kernels=table) == compute_time(bf16, system) == 4.0


def test_kernel_choice_is_per_system_and_checked() -> None:
    generic = Kernel(name="any-int8", op_class="gemm", dtype="int8", speedup=1.5)
    pinned = Kernel(name="a100-int8", op_class="einsum", dtype="int8", speedup=1.8,
                    systems=("a100-80g",))
    assert KernelTable.build([pinned, generic], "a100-80g").get("gemm", "int8") is pinned
    assert KernelTable.build([pinned, generic], "h100-80g").get("gemm", "int8") is generic
    assert not KernelTable.build([pinned], "h100-80g")
    for bad, message in [
        (dict(op_class="conv"), "op_class 'conv' must be one of"),
        (dict(speedup=float("inf")), "speedup must be a finite number"),
        (dict(cast_alpha=-1.0), "cast_alpha must be a number >= 0"),
        (dict(bytes_per_element=0), "bytes_per_element must be > 0"),
        (dict(systems="a100-80g"), "systems must be a tuple"),
    ]:
        with pytest.raises(RecordError, match=message):
            Kernel(**{"name": "k", "op_class": "einsum", "dtype": "int8", **bad})


def test_memory_of_planned_saved_tensors() -> None:
    o = GenerateOptions(**DIMS, tp=2, tpsp=False)
    table = KernelTable.build([INT8], "a100-80g")
    sbh = 2048 * 1 * 4096  # s * b * h, replicated without sequence parallelism
    fc1 = replace(o, precision=(("fc1", "int8"),))
    # fc1's saved input (the MLP input) in 1 byte instead of 2
    assert planned_activation_delta(fc1, kernels=table) == -sbh
    assert activation_bytes_per_layer(fc1, kernels=table) == activation_bytes_per_layer(o) - sbh
    # q alone needs an int8 copy beside the bf16 QKV input that k and v read
    assert planned_activation_delta(replace(o, precision=(("q", "int8"),)), kernels=table) == sbh
    # without a kernel the op computes in bf16 from the original: no change
    assert planned_activation_delta(fc1) == 0
    # full recompute saves only the layer input
    full = replace(fc1, activation_recompute="full")
    assert planned_activation_delta(full, kernels=table) == 0


# -- the plugin distribution ------------------------------------------------------------------


def test_plugin_is_installed_and_listed(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    try:
        metadata.distribution("stg-int8-kernels")
    except metadata.PackageNotFoundError:
        pytest.fail("install the example plugin: pip install -e plugins/stg-int8-kernels")
    code, out, err = run(capsys, "plugins", "list", "--json")
    assert code == 0, err
    text = json.dumps(json.loads(out))
    assert "stg-int8-kernels" in text and "int8-gemm-a100" in text and "fp8-gemm-h100" in text


def test_plugin_changes_the_prediction_of_an_int8_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    with_plugin = load_registry()
    without = load_registry(autoload=False)
    assert "int8-gemm-a100" in with_plugin.kernels and not list(without.kernels)
    plan = (("fc1", "int8"), ("fc2", "int8"), ("q", "int8"), ("k", "int8"), ("v", "int8"))

    def seconds(registry: object, precision: tuple[tuple[str, str], ...]) -> float:
        options = GenerateOptions(**DIMS, tp=2, precision=precision)
        workload = build_workload(options, registry)
        return predict_time(workload, "a100-80g", kernels=list(registry.kernels))[
            "iteration_time_s"
        ]

    default = seconds(with_plugin, ())
    assert seconds(without, ()) == default  # the default plan: identical with or without
    assert seconds(with_plugin, plan) < 0.9 * default  # int8 GEMMs with the plugin
    assert seconds(without, plan) > default  # without it: dequantize + bf16, casts are overhead


# -- the search -------------------------------------------------------------------------------


def test_search_finds_a_faster_plan_only_with_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    system = load_system("a100-80g")
    options = GenerateOptions(**DIMS, tp=2)
    registry = load_registry(autoload=False)
    plain = search_precision(options, registry, system, budget=80 * 2**30)
    assert plain.best.plan == () and plain.speedup == 1.0 and not plain.candidates
    found = search_precision(options, registry, system, budget=80 * 2**30, kernels=[A100_INT8])
    assert found.speedup > 1.1 and found.best.time_s < found.baseline.time_s
    ops = dict(found.best.plan)
    assert set(ops.values()) == {"int8"} and {"fc1", "fc2"} <= set(ops)
    assert set(ops) <= set(plan_ops(build_workload(options, registry)))
    # each applied step made the iteration faster, and every op name appears once
    times = [found.baseline.time_s] + [s.time_s for s in found.steps]
    assert times == sorted(times, reverse=True)
    assert sum(len(s.op.split("+")) for s in found.steps) == len(ops)
    # deterministic
    again = search_precision(options, registry, system, budget=80 * 2**30, kernels=[A100_INT8])
    assert again.as_dict() == found.as_dict()


def test_search_lowers_precision_to_fit_a_budget() -> None:
    system = load_system("a100-80g")
    registry = load_registry(autoload=False)
    # activations dominate: no recompute, 8 micro-batches of 1F1B in flight on stage 0
    options = GenerateOptions(**{**DIMS, "batch": 8, "micro_batch": 1}, pp=2)
    free = search_precision(options, registry, system, budget=1e15, kernels=[A100_INT8])
    assert free.best.peak_bytes < free.baseline.peak_bytes
    budget = (free.baseline.peak_bytes + free.best.peak_bytes) / 2
    tight = search_precision(options, registry, system, budget=budget, kernels=[A100_INT8])
    assert tight.baseline.peak_bytes > budget >= tight.best.peak_bytes
    with pytest.raises(UserError, match="no plan fits"):
        search_precision(options, registry, system, budget=free.best.peak_bytes / 2,
                         kernels=[A100_INT8])


def test_risk_order_and_sizes() -> None:
    assert RISK["fp32"] < RISK["bf16"] < RISK["fp8"] < RISK["int8"]
    assert parse_size("40GiB", "--memory-budget") == 40 * 2**30
    assert parse_size("40GB", "--memory-budget") == 40e9
    assert parse_size("4e10", "--memory-budget") == 4e10
    assert parse_size(" 512 mib ", "--memory-budget") == 512 * 2**20
    for bad in ("40XB", "", "GiB", "-1GB", "0"):
        with pytest.raises(UserError, match="--memory-budget"):
            parse_size(bad, "--memory-budget")


# -- command line -----------------------------------------------------------------------------


def test_plan_precision_writes_the_plan_generate_reads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    out = tmp_path / "plan.json"
    code, stdout, err = run(capsys, "plan", "precision", *ARGS, "--tp", "2",
                            "--memory-budget", "40GiB", "--out", out, "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["speedup"] > 1.1 and result["best"]["fits"]
    assert result["best"]["iteration_time_s"] < result["baseline"]["iteration_time_s"]
    plan = load_plan(out)
    assert dict(plan) == result["plan"]["ops"] and "fc1" in dict(plan)
    # the plan file drives generate and predict
    code, stdout, err = run(capsys, "predict", *ARGS, "--tp", "2", "--precision_plan", out,
                            "--json")
    assert code == 0, err
    assert json.loads(stdout)["time"]["iteration_time_s"] == pytest.approx(
        result["best"]["iteration_time_s"]
    )
    code, _, err = run(capsys, "generate", *ARGS, "--precision_plan", out, "--output_dir",
                       tmp_path / "gen", "--format", "json")
    assert code == 0, err
    text = (tmp_path / "gen" / "workload.0.json").read_text()
    assert ".cast_" in text and '"int8"' in text
    # the rich report names the before/after times and the speedup
    code, stdout, err = run(capsys, "plan", "precision", *ARGS, "--out", tmp_path / "p2.json")
    assert code == 0, err
    assert "predicted speedup" in stdout and "default" in stdout and "found" in stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-budget", "40 parsecs"], "--memory-budget '40 parsecs' is not a size"),
        (["--dtypes", "bf16,int4"], "--dtypes: unknown dtype 'int4'"),
        (["--memory-budget", "1MiB"], "no plan fits"),
        (["--system", "nope"], "unknown system 'nope'"),
    ],
)
def test_plan_precision_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "plan.json"
    code, out_text, err = run(capsys, "plan", "precision", "--num_stacks", "2", "--out", out, *args)
    assert code == 2 and out_text == "" and message in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_generate_predict_and_print_gpu_vram(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    small = ["--dmodel", "256", "--dff", "1024", "--head", "8", "--kvhead", "8", "--seq", "128",
             "--dvocal", "1000", "--num_stacks", "4", "--batch", "8", "--micro_batch", "2",
             "--tp", "2", "--pp", "2"]
    code, out, err = run(capsys, "predict", *small, "--system", "h100-80g", "--json")
    assert code == 0, err
    expected = json.loads(out)
    code, out, err = run(capsys, "generate", *small, "--output_dir", tmp_path / "a",
                         "--predict", "--system", "h100-80g", "--print_gpu_vram", "true")
    assert code == 0, err
    seconds = expected["time"]["iteration_time_s"]
    assert "predicted iteration time (h100-80g)" in err and f"{seconds * 1e3:.3f} ms" in err
    peak = int(expected["memory"]["peak_bytes"])
    assert "predicted peak memory per GPU" in err and f"{peak:,} B" in err
    # --print_gpu_vram: the memory predictor's table on stdout, one row per stage
    assert "memory per rank in GiB on h100-80g" in out
    for row in expected["memory"]["classes"]:
        assert f"{row['peak'] / 2**30:.2f}" in out
    code, out, err = run(capsys, "generate", *small, "--output_dir", tmp_path / "b")
    assert code == 0 and "predicted" not in err and out == ""
    code, out, err = run(capsys, "generate", *small, "--output_dir", tmp_path / "c",
                         "--predict", "--system", "nope")
    assert code == 2 and "unknown system 'nope'" in err and not (tmp_path / "c").exists()


def test_a_tiny_memory_budget_is_printed_as_given() -> None:
    from stg.explore.precision_search import format_bytes

    assert format_bytes(1) == "1 B"
    assert format_bytes(5 * 2**20) == "5.00 MiB"
    assert format_bytes(38.21 * 2**30) == "38.21 GiB"
