"""The ``nvfp4`` training recipe's random Hadamard transform (RHT) and stochastic rounding (SR)
as Transformer Engine 2.9 runs them (``recipe.NVFP4BlockScaling``; ``NVFP4Quantizer::
quantize_impl`` in ``pytorch/csrc/quantizer.cpp``), and ``--nvfp4_disable_rht`` /
``--nvfp4_disable_stochastic_rounding`` (TE's ``NVTE_NVFP4_DISABLE_RHT``,
``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING``).

The closed forms are written from those definitions: the RHT (a 16x16 matrix product per 16
elements, arXiv 2509.25149 section 4.2) on the columnwise copies of the input and the output
gradient, found in the amax pass and applied by a second cast kernel that reads the input again
(one fused kernel where rows divide by 64 and columns by 128, else a transform kernel writing a
bf16 copy and a cast of it); SR on the gradient's copies, one Philox4x32-10 call (10 rounds of
10 integer ops) per 16 elements of each copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_low_precision_recipes import CLI, LLAMA, ROWS, SITES, TP, D

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system
from stg.trace.reader import read_metadata

HADAMARD = 2 * 16  # FLOPs per element: 16 multiply-adds
PHILOX = 10 * 10  # ops per Philox4x32-10 call: 10 rounds of 2 mulhilo (4), 4 XOR, 2 key adds
LAST = {"cast", "hadamard_cast"}


def _kernels(operand: str, r: int, c: int, rht: bool = True, sr: bool = True) -> Iterator[tuple]:
    """(kind, bytes, num_ops, hadamard FLOPs) of the kernels quantizing ``operand``, in order."""
    n = r * c
    copy = n // 2 + n // 16 + 4  # half-byte elements, an E4M3 per 16, an fp32 tensor scale
    transformed = rht and operand != "weight"
    h = HADAMARD * n if transformed else 0
    rounding = -(-n // 16) * PHILOX if sr and operand == "grad_output" else 0
    yield "amax", 2 * n, n + h, h
    if not transformed:
        yield "cast", 2 * n + 2 * copy, n + 2 * rounding, 0
        return
    yield "cast", 2 * n + copy, n + rounding, 0
    if r % 64 == 0 and c % 128 == 0:
        yield "hadamard_cast", 2 * n + copy, n + h + rounding, h
    else:
        yield "hadamard", 2 * n + 2 * n, h, h
        yield "hadamard_cast", 2 * n + copy, n + rounding, 0


def _nodes(**given: Any) -> dict[str, Any]:
    options = GenerateOptions(**{**LLAMA, "low_precision_recipe": "nvfp4", **given})
    workload = build_workload(options, load_registry(autoload=False))
    return {n.name: n for n in workload.ranks[0].nodes()}


def _quantize_nodes(nodes: dict[str, Any], prefix: str = "mb0/layer0/") -> dict[tuple, Any]:
    return {
        (n.attrs["quantize_operand"], name.rsplit("/", 1)[1].split(".", 1)[0],
         n.attrs["quantize_kernel"]): n
        for name, n in nodes.items()
        if name.startswith(prefix) and "quantize_kernel" in n.attrs
    }  # fmt: skip


@pytest.mark.parametrize(("rht", "sr"), [(1, 1), (0, 1), (1, 0), (0, 0)])
def test_quantize_kernels_follow_transformer_engine(rht: int, sr: int) -> None:
    nodes = _nodes(nvfp4_disable_rht=not rht, nvfp4_disable_stochastic_rounding=not sr)
    found = {
        key: (n.tensor_size, n.num_ops, n.attrs.get("hadamard_flops", 0))
        for key, n in _quantize_nodes(nodes).items()
    }
    expected = {
        (operand, op, kind): (nbytes, ops, flops)
        for (operand, op), (r, c) in SITES.items()
        for kind, nbytes, ops, flops in _kernels(operand, r, c, rht, sr)
    }
    assert found == expected


def test_kernels_of_a_site_run_in_order_and_the_gemms_wait_for_the_last() -> None:
    nodes = _nodes()
    by_id = {n.id: name for name, n in nodes.items()}

    def deps(name: str) -> set[str]:
        return {by_id[d] for d in nodes[name].data_deps}

    # the QKV input, sequence-parallel: amax, its all-reduce, the two casts, then the gather
    at = "mb0/layer0/fwd/q."
    assert at + "amax_all_reduce_input" in deps(at + "cast_input")
    assert at + "cast_input" in deps(at + "hadamard_cast_input")
    gather = "mb0/layer0/fwd/all_gather_tp:attention_norm"
    assert at + "hadamard_cast_input" in deps(gather)
    # the output projection's gradient: both backward GEMMs wait for the transformed copy
    grad = "mb0/layer0/bwd/attn_out."
    assert grad + "cast_grad_output" in deps(grad + "hadamard_cast_grad_output")
    for gemm in ("grad_wo", "grad_context"):
        assert grad + "hadamard_cast_grad_output" in deps(grad + gemm)


def test_shapes_the_fused_kernel_does_not_take_get_a_transform_kernel() -> None:
    # dff 1600: this rank's 800 columns are no multiple of 128 (TE's
    # eligible_for_rht_cast_fusion), so the down-projection's input and the up-projections'
    # output gradients are transformed into a bf16 copy first
    f = 1600 // TP
    nodes = _quantize_nodes(_nodes(dff=1600))
    sites = {**SITES, ("input", "down"): (ROWS, f), ("grad_output", "gate"): (ROWS, f),
             ("grad_output", "up"): (ROWS, f), ("weight", "gate"): (f, D),
             ("weight", "up"): (f, D), ("weight", "down"): (D, f)}  # fmt: skip
    found = {key: (n.tensor_size, n.num_ops) for key, n in nodes.items()}
    expected = {
        (operand, op, kind): (nbytes, ops)
        for (operand, op), (r, c) in sites.items()
        for kind, nbytes, ops, _ in _kernels(operand, r, c)
    }
    assert found == expected
    assert {op for _, op, kind in found if kind == "hadamard"} == {"down", "gate", "up"}


def _time(node: Any, system: Any) -> float:
    return compute_time(node, system, "fp8")


def test_the_transform_runs_on_tensor_cores() -> None:
    # TE's transform kernels are wmma / UMMA bf16 products: an amax pass that transforms the
    # tensor takes its memory time, not its 33 ops per element at the SIMT rate
    b200 = load_system("b200-180g")
    amax = _nodes()["mb0/layer0/bwd/down.amax_grad_output"]
    assert amax.attrs["hadamard_flops"] == HADAMARD * ROWS // TP * D
    memory = memory_bound_time(b200.gpu, amax.tensor_size, "quantize")
    assert amax.num_ops / b200.gpu.rate("fp32") > memory  # it would be compute-bound on SIMT
    assert _time(amax, b200) == pytest.approx(memory + b200.kernel_overhead)


def _kernel_time(system: Any, nbytes: int, ops: int, flops: int) -> float:
    gpu = system.gpu
    seconds = max(
        memory_bound_time(gpu, nbytes, "quantize"),
        (ops - flops) / gpu.rate("fp32"),
        flops / gpu.rate("bf16"),
    )
    return seconds + system.kernel_overhead


def _modelled(system: Any, rht: bool = True, sr: bool = True) -> float:
    """Seconds of one layer's quantize kernels from the closed forms."""
    return sum(
        _kernel_time(system, nbytes, ops, flops)
        for (operand, _), (r, c) in SITES.items()
        for _, nbytes, ops, flops in _kernels(operand, r, c, rht, sr)
    )


@pytest.mark.parametrize(("rht", "sr"), [(False, True), (True, False)])
def test_turning_a_technique_off_moves_the_time_by_its_kernels(rht: bool, sr: bool) -> None:
    b200 = load_system("b200-180g")
    full = _quantize_nodes(_nodes())
    off = _quantize_nodes(
        _nodes(nvfp4_disable_rht=not rht, nvfp4_disable_stochastic_rounding=not sr)
    )
    change = sum(_time(n, b200) for n in full.values()) - sum(_time(n, b200) for n in off.values())
    assert change == pytest.approx(_modelled(b200) - _modelled(b200, rht, sr), rel=1e-12)
    if not rht:  # a second read and launch per transformed tensor
        assert change > 0


def test_the_predicted_iteration_moves_by_the_transform_kernels() -> None:
    # one layer, one micro-batch: the quantize kernels lie on the critical path
    from stg.predictors.time import predict_time

    def predicted(**given: Any) -> tuple[float, float]:
        options = GenerateOptions(**{**LLAMA, "low_precision_recipe": "nvfp4", **given})
        workload = build_workload(options, load_registry(autoload=False))
        report = predict_time(workload, "b200-180g", explain=True)
        return report["explain"]["breakdown_s"]["compute: quantize"], report["iteration_time_s"]

    (quantize, total), (quantize_off, total_off) = (
        predicted(),
        predicted(nvfp4_disable_rht=True),
    )
    b200 = load_system("b200-180g")
    modelled = _modelled(b200) - _modelled(b200, rht=False)
    assert quantize - quantize_off == pytest.approx(modelled, rel=1e-9)
    assert total - total_off == pytest.approx(modelled, rel=1e-9)


def _generate(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["generate", *CLI, "--low_precision_recipe", "nvfp4", *extra,
              "--output_dir", str(out)])  # fmt: skip
    assert done.value.code == 0
    return out


def test_the_options_are_recorded_only_when_on(tmp_path: Path) -> None:
    options = json.loads(read_metadata(_generate(tmp_path) / "workload.0.et")["attrs"]["options"])
    assert "nvfp4_disable_rht" not in options
    out = _generate(tmp_path / "off", "--nvfp4_disable_rht", "true",
                    "--nvfp4_disable_stochastic_rounding", "true")  # fmt: skip
    options = json.loads(read_metadata(out / "workload.0.et")["attrs"]["options"])
    assert options["nvfp4_disable_rht"] is True
    assert options["nvfp4_disable_stochastic_rounding"] is True


@pytest.mark.parametrize("option", ["nvfp4_disable_rht", "nvfp4_disable_stochastic_rounding"])
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_the_options_need_the_nvfp4_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, recipe: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", *CLI, "--low_precision_recipe", recipe, f"--{option}", "true",
              "--output_dir", str(tmp_path / "out")])  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {option} ") and err.count("\n") == 1
    assert "it needs low_precision_recipe one of nvfp4" in err
    assert not (tmp_path / "out").exists()
