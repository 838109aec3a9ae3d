"""Low-precision training recipes (``--low_precision_recipe``, stg/core/recipes.py).

Each recipe quantizes the input, the weight and the output gradient of every linear layer of a
``--dtype fp8`` training run into a rowwise and a columnwise copy; the kernels that do it are
memory-bound nodes of the trace whose bytes follow from the recipe's definition. The closed
forms below are written from the definitions (Transformer Engine's recipes, torchao's float8
recipes, DeepSeek-V3's report, the OCP MX specification, NVIDIA's NVFP4 paper), not from
stg's code, and compared with what the written rank files hold.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time, gemm_scaling
from stg.perf.kernel_time import (
    RECIPE_GEMM_SPEED,
    gemm_time,
    memory_bound_time,
    recipe_gemm_speed,
    scaled_gemm_time,
)
from stg.perf.system import load_system
from stg.trace.reader import read_metadata, read_nodes
from stg.trace.validate import validate_trace

B, S, D, F, HEADS, KV, TP = 2, 1024, 512, 1536, 8, 4, 2
LLAMA = {"model": "llama", "dmodel": D, "dff": F, "head": HEADS, "kvhead": KV, "seq": S,
         "dvocal": 1024, "num_stacks": 1, "batch": B, "micro_batch": B,
         "mixed_precision": True, "causal": True, "dtype": "fp8", "tp": TP}  # fmt: skip
CLI = ["--model", "llama", "--dmodel", str(D), "--dff", str(F), "--head", str(HEADS),
       "--kvhead", str(KV), "--seq", str(S), "--dvocal", "1024", "--num_stacks", "1",
       "--batch", str(B), "--micro_batch", str(B), "--mixed_precision", "true",
       "--causal", "true", "--dtype", "fp8", "--tp", str(TP)]  # fmt: skip

ROWS, LOCAL = B * S, B * S // TP  # tokens; this rank's tokens under sequence parallelism
HD = D // HEADS
SITES = {
    # (operand, forward op): (rows, cols), cols along the forward's reduction dimension.
    # Inputs: the QKV and gate/up inputs once, this rank's rows (sequence parallelism).
    ("input", "q"): (LOCAL, D),
    ("input", "attn_out"): (ROWS, D // TP),
    ("input", "gate"): (LOCAL, D),
    ("input", "down"): (ROWS, F // TP),
    # Weights as the GEMM reads them: this rank's columns.
    ("weight", "q"): (D // TP, D),
    ("weight", "k"): (KV * HD // TP, D),
    ("weight", "v"): (KV * HD // TP, D),
    ("weight", "attn_out"): (D, D // TP),
    ("weight", "gate"): (F // TP, D),
    ("weight", "up"): (F // TP, D),
    ("weight", "down"): (D, F // TP),
    # Output gradients, cols = the forward GEMM's output features.
    ("grad_output", "q"): (ROWS, D // TP),
    ("grad_output", "k"): (ROWS, KV * HD // TP),
    ("grad_output", "v"): (ROWS, KV * HD // TP),
    ("grad_output", "attn_out"): (LOCAL, D),
    ("grad_output", "gate"): (ROWS, F // TP),
    ("grad_output", "up"): (ROWS, F // TP),
    ("grad_output", "down"): (LOCAL, D),
}


GEMMS = [rc for (operand, _), rc in SITES.items() if operand == "weight"]


def _blocks(rows: int, cols: int, block_rows: int, block_cols: int) -> int:
    """Scales of both copies for blocks of ``block_rows x block_cols`` (the dims here divide)."""
    return 2 * (rows // block_rows) * (cols // block_cols)


# Each recipe's kernels: {kind: bytes} for one bf16 tensor of rows x cols (2 bytes per element
# read), from its definition.
def tensorwise(operand: str, r: int, c: int) -> dict[str, int]:
    # TE Float8CurrentScaling / torchao tensorwise: amax over the tensor (a read), then the
    # cast-transpose (a read, two 1-byte copies) and one fp32 scale
    n = r * c
    return {"amax": 2 * n, "cast": 2 * n + 2 * n + 4}


def rowwise(operand: str, r: int, c: int) -> dict[str, int]:
    # torchao rowwise, compiled: each copy by a kernel of its own that reduces along its axis
    # and casts (one read each), a 1-byte copy and an fp32 scale per row of it (r for the
    # rowwise copy, c for the columnwise one)
    n = r * c
    return {"cast": 2 * n + n + 4 * r, "columnwise_cast": 2 * n + n + 4 * c}


# torchao's rowwise linear as torchtitan runs it (torchao 0.18 float8_linear.py,
# float8_ops.py; torchtitan parallelize.py): the sequence-parallel gathers move bf16 and the
# linear casts the gathered rows; its input's columnwise copy is cast in the backward from the
# kept bf16 input, before the first weight-gradient GEMM (of the last GEMM of a module: v,
# up); its backward GEMMs run with unit scales, then a rescale reads and writes each bf16
# output and writes and reads the fp32 product of the scales (12 bytes per element)
ROWWISE_SITES = {
    **SITES,
    ("input", "q"): (ROWS, D),
    ("input", "gate"): (ROWS, D),
    ("grad_output", "attn_out"): (ROWS, D),
    ("grad_output", "down"): (ROWS, D),
}
ROWWISE_WGRAD_FIRST = {"q": "v", "gate": "up", "attn_out": "attn_out", "down": "down"}
GEMM_KN = {  # (k, n) of each forward GEMM
    "q": (D, D // TP),
    "k": (D, KV * HD // TP),
    "v": (D, KV * HD // TP),
    "attn_out": (D // TP, D),
    "gate": (D, F // TP),
    "up": (D, F // TP),
    "down": (F // TP, D),
}


def rowwise_expected() -> Counter[tuple[str, str, str]]:
    expected: Counter[tuple[str, str, str]] = Counter()
    for (operand, op), (r, c) in ROWWISE_SITES.items():
        kinds = rowwise(operand, r, c)
        if operand == "input":
            expected[operand, op, "cast"] += kinds["cast"]
            expected[operand, ROWWISE_WGRAD_FIRST[op], "columnwise_cast"] += kinds[
                "columnwise_cast"
            ]
            continue
        for kind, nbytes in kinds.items():
            expected[operand, op, kind] += nbytes
        if operand == "grad_output":
            k, n = GEMM_KN[op]
            expected[operand, op, "rescale"] += 12 * (ROWS * k + n * k)
    return expected


def blockwise(operand: str, r: int, c: int) -> dict[str, int]:
    # DeepSeek-V3 3.3.2: 1x128 tiles (activations, gradients), 128x128 blocks (weights), fp32
    # scales; both copies from one read
    n = r * c
    scales = _blocks(r, c, 128, 128) if operand == "weight" else _blocks(r, c, 1, 128)
    return {"cast": 2 * n + 2 * n + 4 * scales}


def mxfp8(operand: str, r: int, c: int) -> dict[str, int]:
    # OCP MX v1.0: 32-element blocks, one E8M0 byte each, along each copy's reduction dim
    n = r * c
    return {"cast": 2 * n + 2 * n + _blocks(r, c, 1, 32)}


def nvfp4(operand: str, r: int, c: int) -> dict[str, int]:
    # arXiv 2509.25149 as Transformer Engine 2.9 runs it: half-byte E2M1 elements, an E4M3
    # byte per 16 elements of each copy (a weight's 16x16 block scales are stored per 1x16), an
    # fp32 tensor scale per copy, after a pass for the tensor amax. A weight's copies come from
    # one read; an input's or gradient's rowwise copy is cast alone, and its columnwise copy,
    # Hadamard-transformed, by a second kernel that reads the input again (these shapes fit
    # the fused transform-and-cast kernel)
    n = r * c
    copy = n // 2 + n // 16 + 4
    if operand == "weight":
        return {"amax": 2 * n, "cast": 2 * n + 2 * copy}
    return {"amax": 2 * n, "cast": 2 * n + copy, "hadamard_cast": 2 * n + copy}


CLOSED_FORMS: dict[str, Callable[[str, int, int], dict[str, int]]] = {
    "tensorwise": tensorwise,
    "rowwise": rowwise,
    "blockwise": blockwise,
    "mxfp8": mxfp8,
    "nvfp4": nvfp4,
}


def _generate(tmp_path: Path, recipe: str, *extra: str) -> Path:
    out = tmp_path / recipe
    with pytest.raises(SystemExit) as done:
        main(["generate", *CLI, "--low_precision_recipe", recipe, *extra, "--output_dir", str(out)])
    assert done.value.code == 0
    return out


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_quantize_nodes_in_the_written_trace_follow_the_recipe(tmp_path: Path, recipe: str) -> None:
    out = _generate(tmp_path, recipe)
    assert validate_trace(out).ok
    nodes = read_nodes(out / "workload.0.et")
    found: Counter[tuple[str, str, str]] = Counter()
    for n in nodes:
        if "quantize_kernel" in n.attrs:
            op = n.name.rsplit("/", 1)[1].split(".", 1)[0]
            found[n.attrs["quantize_operand"], op, n.attrs["quantize_kernel"]] += n.tensor_size
            assert n.attrs["low_precision_recipe"] == recipe
    expected = Counter()
    for (operand, op), (r, c) in SITES.items():
        for kind, nbytes in CLOSED_FORMS[recipe](operand, r, c).items():
            expected[operand, op, kind] += nbytes
    assert found == (rowwise_expected() if recipe == "rowwise" else expected)
    options = json.loads(read_metadata(out / "workload.0.et")["attrs"]["options"])
    assert options["low_precision_recipe"] == recipe
    # current and block scalings keep no amax history: no delayed-scaling reductions
    assert not any(n.name.endswith("fp8_amax_all_reduce") for n in nodes)


def test_official_reader_decodes_the_quantize_nodes(tmp_path: Path) -> None:
    et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
    protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")
    out = _generate(tmp_path, "nvfp4")
    handle = protolib.openFileRd(str(out / "workload.0.et"))
    assert protolib.decodeMessage(handle, et_def.GlobalMetadata())
    kinds = Counter()
    while True:
        node = et_def.Node()
        if not protolib.decodeMessage(handle, node):
            break
        attrs = {a.name: a for a in node.attr}
        if "quantize_kernel" in attrs:
            assert node.type == et_def.COMP_NODE
            assert attrs["tensor_size"].uint64_val > 0 and attrs["num_ops"].int64_val > 0
            kinds[attrs["quantize_kernel"].string_val] += 1
    handle.close()
    transformed = sum(operand != "weight" for operand, _ in SITES)
    assert kinds == {"amax": len(SITES), "cast": len(SITES), "hadamard_cast": transformed}


def _nodes(**given: Any) -> dict[str, Any]:
    options = GenerateOptions(**{**LLAMA, **given})
    workload = build_workload(options, load_registry(autoload=False))
    return {n.name: n for n in workload.ranks[0].nodes()}


@pytest.mark.parametrize(
    ("recipe", "system", "dtype"),
    [
        ("tensorwise", "h100-80g", "fp8"),
        ("rowwise", "h100-80g", "fp8"),
        ("blockwise", "h100-80g", "fp8"),
        ("mxfp8", "b200-180g", "fp8"),
        ("nvfp4", "b200-180g", "fp4"),
    ],
)
def test_gemm_runs_at_the_format_peak(recipe: str, system: str, dtype: str) -> None:
    nodes = _nodes(low_precision_recipe=recipe)
    gpu = load_system(system)
    for name in ("mb0/layer0/fwd/gate", "mb0/layer0/bwd/down.grad_w2"):
        node = nodes[name]
        batch, m, n, k = node.attrs["gemm"]
        assert node.dtype == dtype
        if dtype == "fp8":  # the recipe's scales (scaled_gemm_time: tests/test_rowwise_gemm.py)
            gemm = scaled_gemm_time(gpu.gpu, m, n, k, gemm_scaling(node, recipe), batch)
        else:
            gemm = gemm_time(gpu.gpu, m, n, k, dtype, batch) / recipe_gemm_speed(gpu.arch, recipe)
        assert compute_time(node, gpu, "fp8") == pytest.approx(gemm + gpu.kernel_overhead)
        # no faster than the format's peak
        assert compute_time(node, gpu, "fp8") >= 2 * batch * m * n * k / gpu.gpu.rate(dtype)
    # a compute-bound GEMM runs at the format's peak (a tile's fixed overhead aside): on a
    # B200 fp8 takes about half, fp4 about a quarter of bf16's time
    big = 8192
    ratio = gemm_time(gpu.gpu, big, big, big, dtype) / gemm_time(gpu.gpu, big, big, big, "bf16")
    assert ratio == pytest.approx(gpu.peak("bf16") / gpu.peak(dtype), rel=0.1)


SCALED = Path(__file__).parent / "data" / "kernels" / "h200-scaled.jsonl"
H100_SCALED = Path(__file__).parent / "data" / "kernels" / "h100-scaled.jsonl"


def _large_model_gemms(path: Path) -> list[dict]:
    """The measured cases of a ``*-scaled.jsonl`` file that the recipe speeds come from: the
    model-shape GEMMs with every side >= 4096, each under every scaling."""
    cases = [json.loads(line).get("extra") for line in path.read_text().splitlines()]
    return [
        e
        for e in cases
        if e and "tflops" in e and e["family"] == "model" and min(e["m"], e["k"], e["n"]) >= 4096
    ]


def _speed_ratios(path: Path) -> list[dict[str, float]]:
    """Per large model-shape GEMM of ``path``: each scaling's rate over tensorwise's."""
    rates: dict[tuple[str, int, int, int], dict[str, float]] = {}
    for e in _large_model_gemms(path):
        rates.setdefault((e["role"], e["m"], e["k"], e["n"]), {})[e["scaling"]] = e["tflops"]
    return [{s: r[s] / r["tensorwise"] for s in r} for r in rates.values()]


def _median_model_errors(path: Path, system_name: str) -> dict[str, float]:
    """Per scaling, the median error of the fp8 GEMM model under the recipe's scales
    (:func:`scaled_gemm_time`) over the large model-shape GEMMs of ``path``."""
    system = load_system(system_name)
    errors: dict[str, list[float]] = {}
    for e in _large_model_gemms(path):
        predicted_ms = scaled_gemm_time(system.gpu, e["m"], e["n"], e["k"], e["scaling"]) * 1e3
        errors.setdefault(e["scaling"], []).append(predicted_ms / e["median_ms"] - 1)
    return {s: sorted(v)[len(v) // 2] for s, v in errors.items()}


def test_recipe_gemm_speeds_are_the_h200_medians() -> None:
    """The Hopper entries of RECIPE_GEMM_SPEED are the medians they cite: the model-shape
    GEMMs with every side >= 4096, each scaling's rate over tensorwise's on the same shape."""
    big = _speed_ratios(SCALED)
    assert len(big) == 27
    for recipe, speed in RECIPE_GEMM_SPEED["hopper"].items():
        ratios = sorted(r[recipe] for r in big)
        assert ratios[len(ratios) // 2] == pytest.approx(speed, abs=5e-4)
    # the block scales cost more than the row scales, which cost little
    assert RECIPE_GEMM_SPEED["hopper"]["blockwise"] < RECIPE_GEMM_SPEED["hopper"]["rowwise"] < 1
    # not measured elsewhere: no change (Blackwell runs block scales natively)
    assert recipe_gemm_speed("blackwell", "blockwise") == 1.0
    assert recipe_gemm_speed("hopper", "tensorwise") == 1.0


def test_recipe_gemm_time_against_the_h200_measurement() -> None:
    """The GEMM model with the recipe speeds against every large model-shape GEMM of the H200
    set: each scaling's median error within 10 %, and within 3 points of tensorwise's (the
    block scales' cost is the recipe's; without it blockwise would be 12 % further off)."""
    h200 = load_system("h200-141g")
    median = _median_model_errors(SCALED, "h200-141g")
    assert set(median) == {"tensorwise", "rowwise", "blockwise"}
    for scaling in ("rowwise", "blockwise"):
        assert abs(median[scaling]) < 0.10
        assert median[scaling] == pytest.approx(median["tensorwise"], abs=0.03)
    # a blockwise GEMM of the workload is priced at that speed
    nodes = {r: _nodes(low_precision_recipe=r) for r in ("tensorwise", "blockwise")}
    gate = [nodes[r]["mb0/layer0/fwd/gate"] for r in ("tensorwise", "blockwise")]
    batch, m, n, k = gate[1].attrs["gemm"]
    extra = compute_time(gate[1], h200, "fp8") - compute_time(gate[0], h200, "fp8")
    assert extra == pytest.approx(
        gemm_time(h200.gpu, m, n, k, "fp8", batch)
        * (1 / RECIPE_GEMM_SPEED["hopper"]["blockwise"] - 1),
        rel=1e-6,
    )


def test_quantize_node_time_and_cached_weights() -> None:
    nodes = _nodes(low_precision_recipe="mxfp8", batch=4)
    b200 = load_system("b200-180g")
    cast = nodes["mb0/layer0/fwd/gate.cast_input"]
    assert compute_time(cast, b200, "fp8") == pytest.approx(
        memory_bound_time(b200.gpu, cast.tensor_size, "quantize") + b200.kernel_overhead
    )
    # a weight's copies are cast in the first micro-batch and reused after it
    assert compute_time(nodes["mb0/layer0/fwd/gate.cast_weight"], b200, "fp8") > 0
    assert compute_time(nodes["mb1/layer0/fwd/gate.cast_weight"], b200, "fp8") == 0
    # an fp8 recipe on a GPU without fp8 tensor cores: bf16 GEMMs, nothing quantized
    tensorwise = _nodes(low_precision_recipe="tensorwise")
    a100 = load_system("a100-80g")
    assert compute_time(tensorwise["mb0/layer0/fwd/gate.cast_input"], a100, "fp8") == 0
    gate = tensorwise["mb0/layer0/fwd/gate"]
    _, m, n, k = gate.attrs["gemm"]
    assert compute_time(gate, a100, "fp8") == pytest.approx(
        gemm_time(a100.gpu, m, n, k, "bf16") + a100.kernel_overhead
    )


def test_gemms_wait_for_their_casts() -> None:
    nodes = _nodes(low_precision_recipe="blockwise")
    by_id = {n.id: n.name for n in nodes.values()}
    deps = {by_id[d] for d in nodes["mb0/layer0/fwd/up"].data_deps}
    assert {"mb0/layer0/fwd/gate.cast_input", "mb0/layer0/fwd/up.cast_weight"} <= deps
    wgrad = {by_id[d] for d in nodes["mb0/layer0/bwd/down.grad_w2"].data_deps}
    assert "mb0/layer0/bwd/down.cast_grad_output" in wgrad


@pytest.mark.parametrize(
    ("recipe", "system", "message"),
    [
        ("nvfp4", "h100-80g", "needs block-scaled tensor cores, which system 'h100-80g'"),
        ("nvfp4", "mi355x-288g", "systems that have them: b200-180g, b300-288g, gb200-nvl72"),
        ("mxfp8", "mi300x-192g", "mi355x-288g"),
    ],
)
def test_a_system_without_the_format_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, system: str, message: str
) -> None:
    out = _generate(tmp_path, recipe)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["predict", str(out), "--system", system, "--predictor", "time"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_the_memory_predictor_refuses_a_format_the_system_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the trace and from its options, as the time predictor does (it answered)."""
    out = _generate(tmp_path, "mxfp8")
    from_options = [*CLI, "--low_precision_recipe", "mxfp8"]
    for source, system, code in (
        ([str(out)], "h100-80g", 2),
        (from_options, "h100-80g", 2),
        ([str(out)], "b200-180g", 0),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main(["predict", *source, "--system", system, "--predictor", "memory"])
        err = capsys.readouterr().err
        assert (done.value.code or 0) == code, err
        if code:
            assert err.count("\n") == 1
            assert "low_precision_recipe=mxfp8 needs block-scaled tensor cores" in err


def test_nvfp4_without_an_fp4_peak_is_refused() -> None:
    from stg.errors import UserError
    from stg.perf.costs import recipe_gemm_dtype

    b200 = load_system("b200-180g")
    fp8_only = type(b200)(**{**vars(b200), "peak_flops": {
        k: v for k, v in b200.peak_flops.items() if k != "fp4"}})  # fmt: skip
    with pytest.raises(UserError, match="has no fp4 peak; systems with one: b200-180g"):
        recipe_gemm_dtype(fp8_only, "nvfp4", "fp4")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--low_precision_recipe", "fp8"], "must be one of delayed, tensorwise, rowwise"),
        (["--low_precision_recipe", "mxfp8", "--dtype", "bf16"], "give dtype=fp8"),
        (["--low_precision_recipe", "nvfp4", "--phase", "decode", "--dtype", "fp8"],
         "is a training option"),
    ],
)  # fmt: skip
def test_bad_recipe_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", *given, "--output_dir", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_the_default_recipe_is_todays_delayed_scaling() -> None:
    default = GenerateOptions(**LLAMA)
    assert default.low_precision_recipe == "delayed"
    assert "low_precision_recipe" not in default.recorded()
    mxfp8 = GenerateOptions(**LLAMA, low_precision_recipe="mxfp8")
    assert mxfp8.recorded()["low_precision_recipe"] == "mxfp8"
    nodes = _nodes()
    assert not any("quantize_kernel" in n.attrs for n in nodes.values())
    assert any("fp8_quantize" in n.attrs for n in nodes.values())


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_memory_keeps_16_bit_weights_and_the_quantized_copies(recipe: str) -> None:
    from stg.predictors.memory import predict_memory

    options = GenerateOptions(**LLAMA, low_precision_recipe=recipe)
    workload = build_workload(options, load_registry(autoload=False))
    report = predict_memory(workload, "b200-180g")["classes"][0]
    copies = weights = 0
    for (operand, _), (r, c) in SITES.items():
        if operand == "weight":  # what the recipe's cast writes: less its bf16 reads
            reads = 2 if recipe == "rowwise" else 1  # torchao rowwise: a cast per copy
            written = CLOSED_FORMS[recipe](operand, r, c)
            copies += written["cast"] + written.get("columnwise_cast", 0) - reads * 2 * r * c
            weights += 1
    if recipe == "tensorwise":
        # on Blackwell one per-tensor scaled fp8 copy serves both usages (Transformer Engine
        # v2.9 and v2.18 pytorch/csrc/quantizer.cpp, Float8CurrentScalingQuantizer::
        # create_tensor: no transpose where nvte_is_non_tn_fp8_gemm_supported()): the
        # workload's two copies halve, their one fp32 scale_inv each stays whole
        copies = (copies - 4 * weights) // 2 + 4 * weights
    assert report["weights"] == 2 * report["parameters"] + copies
    delayed = build_workload(GenerateOptions(**LLAMA), load_registry(autoload=False))
    assert "low_precision_weight_bytes" not in delayed.rank_classes[0].facts


def _gathers(**given: Any) -> dict[str, int]:
    nodes = _nodes(tp=1, dp=4, batch=4, micro_batch=4, weight_sharded=True, **given)
    return {
        name: n.comm_size
        for name, n in nodes.items()
        if n.comm_type is not None and n.comm_type.name == "ALL_GATHER"
    }


def test_fsdp_gathers_bf16_weights_or_fp8_ones_with_fp8_param_gather() -> None:
    # a bf16 run gathers 2 bytes per element: the elements of each gather
    elements = {name: n // 2 for name, n in _gathers(dtype="bf16").items()}
    layer = [name for name in elements if "/layer0/" in name]
    assert layer and any("/embedding/" in name for name in elements)
    for recipe in ("delayed", "tensorwise"):
        bf16 = _gathers(low_precision_recipe=recipe)
        assert bf16 == {name: 2 * n for name, n in elements.items()}, recipe
    # Megatron's --fp8-param-gather: the TE modules' weights in fp8 with their E8M0 scales
    # (one byte per 32 elements); the embedding and the output layer stay bf16
    fp8 = _gathers(low_precision_recipe="mxfp8", fp8_param_gather=True)
    for name, n in elements.items():
        assert fp8[name] == (n + -(-n // 32) if name in layer else 2 * n), name


def test_fp8_param_gather_keeps_fp8_weights_in_memory() -> None:
    from stg.predictors.memory import predict_memory

    given = {"tp": 1, "dp": 4, "batch": 4, "micro_batch": 4, "weight_sharded": True}
    options = GenerateOptions(**{**LLAMA, **given}, low_precision_recipe="blockwise",
                              fp8_param_gather=True)  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    shard = workload.rank_classes[0].facts["shard_parameters"]
    report = predict_memory(workload, "h100-80g")["classes"][0]
    # fp8 weights (the shard); beside them each whole GEMM weight's columnwise copy and the
    # fp32 scales of both copies' 128x128 blocks
    copies = sum(r * c + 4 * _blocks(r, c, 128, 128) for r, c in (
        (D, D), (KV * HD, D), (KV * HD, D), (D, D), (F, D), (F, D), (D, F)))  # fmt: skip
    assert report["weights"] == shard + copies


def test_fp8_param_gather_needs_fsdp_and_an_fp8_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for given in (
        ["--low_precision_recipe", "nvfp4", "--weight_sharded", "true"],
        ["--low_precision_recipe", "mxfp8"],
    ):
        with pytest.raises(SystemExit) as done:
            main(["generate", "--dtype", "fp8", *given, "--fp8_param_gather", "true",
                  "--output_dir", str(tmp_path / "out")])  # fmt: skip
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "weight_sharded=true and low_precision_recipe one of tensorwise" in err


def test_explain_names_the_quantize_nodes() -> None:
    from stg.predictors.time import predict_time

    options = GenerateOptions(**LLAMA, low_precision_recipe="mxfp8")
    workload = build_workload(options, load_registry(autoload=False))
    report = predict_time(workload, "b200-180g", explain=True)
    parts = report["explain"]["breakdown_s"]
    assert parts["compute: quantize"] > 0
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=1e-9)


@pytest.mark.parametrize(
    ("recipe", "per_element"),
    [
        ("delayed", 1),
        ("tensorwise", 1),
        ("blockwise", 1 + 4 / 128),  # an fp32 scale per 1x128 tile
        ("mxfp8", 1 + 1 / 32),  # an E8M0 byte per 32 elements
        ("nvfp4", 1 / 2 + 1 / 16),  # half-byte elements, an E4M3 byte per 16
    ],
)
def test_sequence_parallel_gathers_move_the_quantized_rows(recipe: str, per_element: float) -> None:
    nodes = _nodes(low_precision_recipe=recipe)
    by_id = {n.id: n.name for n in nodes.values()}
    # the last kernel of the quantization: nvfp4's columnwise cast of the transformed copy
    last = "hadamard_cast" if recipe == "nvfp4" else "cast"
    for name, cast in (
        ("mb0/layer0/fwd/all_gather_tp:attention_norm", f"mb0/layer0/fwd/q.{last}_input"),
        ("mb0/layer0/bwd/all_gather_tp:grad_output", f"mb0/layer0/bwd/down.{last}_grad_output"),
    ):
        gather = nodes[name]
        assert gather.comm_size == LOCAL * D * per_element
        if recipe != "delayed":  # it gathers what the cast wrote
            assert cast in {by_id[d] for d in gather.data_deps}


def test_rowwise_gathers_bf16_and_casts_the_gathered_rows() -> None:
    # torchtitan's float8 tensor parallelism takes tensorwise scaling only
    # (parallelize.py: enable_float8_tensorwise_tp); under rowwise the sequence-parallel
    # gathers move bf16 and torchao's linear casts the gathered rows
    nodes = _nodes(low_precision_recipe="rowwise", activation_recompute="full")
    by_id = {n.id: n.name for n in nodes.values()}
    for name, cast in (
        ("mb0/layer0/fwd/all_gather_tp:attention_norm", "mb0/layer0/fwd/q.cast_input"),
        ("mb0/layer0/bwd/all_gather_tp:grad_output", "mb0/layer0/bwd/down.cast_grad_output"),
    ):
        assert nodes[name].comm_size == LOCAL * D * 2
        assert name in {by_id[d] for d in nodes[cast].data_deps}
        assert nodes[cast].tensor_size == 3 * ROWS * D + 4 * ROWS
    # the input's columnwise copy is cast once, in the backward (from the kept bf16 input),
    # before its first weight-gradient GEMM; a recomputed forward casts the rowwise copy again
    casts = [n for n in nodes if n.endswith("columnwise_cast_input") and "/layer0/" in n]
    assert sorted(casts) == [
        "mb0/layer0/bwd/attn_out.columnwise_cast_input",
        "mb0/layer0/bwd/down.columnwise_cast_input",
        "mb0/layer0/bwd/up.columnwise_cast_input",
        "mb0/layer0/bwd/v.columnwise_cast_input",
    ]
    assert "mb0/layer0/recompute/q.cast_input" in nodes
    wgrad = {by_id[d] for d in nodes["mb0/layer0/bwd/v.grad_wv"].data_deps}
    assert "mb0/layer0/bwd/v.columnwise_cast_input" in wgrad


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_current_scaling_all_reduces_the_amax_of_gathered_rows(recipe: str) -> None:
    nodes = _nodes(low_precision_recipe=recipe)
    by_id = {n.id: n.name for n in nodes.values()}
    reductions = {
        name.rsplit("/", 1)[1]: n
        for name, n in nodes.items()
        if n.comm_type is not None and n.comm_type.name == "ALL_REDUCE" and "/layer0/" in name
    }
    if recipe not in ("tensorwise", "nvfp4"):  # block scales are local to a rank's rows
        assert not reductions
        return
    # TE: the input of a column-parallel and the output gradient of a row-parallel linear
    assert set(reductions) == {
        "q.amax_all_reduce_input",
        "gate.amax_all_reduce_input",
        "attn_out.amax_all_reduce_grad_output",
        "down.amax_all_reduce_grad_output",
    }
    tp_group = nodes["mb0/layer0/fwd/all_gather_tp:attention_norm"].comm_group
    for name, node in reductions.items():
        assert node.comm_size == 4 and node.comm_group == tp_group
        op, operand = name.split(".amax_all_reduce_")
        cast = next(n for n in nodes.values() if n.name.endswith(f"/{op}.cast_{operand}"))
        assert node.name in {by_id[d] for d in cast.data_deps}


def _collectives(kind: str, **given: Any) -> dict[str, Any]:
    nodes = _nodes(**given)
    return {
        name: n
        for name, n in nodes.items()
        if n.comm_type is not None and n.comm_type.name == kind and "/layer0/" in name
    }


def test_collectives_outside_the_quantized_tensors_move_bf16() -> None:
    # every recipe's sequence-parallel reduce-scatters move the GEMM outputs, bf16: the bytes
    # of a bf16 run
    bf16 = _collectives("REDUCE_SCATTER", dtype="bf16")
    assert bf16
    for name in ("delayed", "mxfp8"):
        recipe = _collectives("REDUCE_SCATTER", low_precision_recipe=name)
        assert {k: n.comm_size for k, n in recipe.items()} == {
            k: n.comm_size for k, n in bf16.items()
        }, name


MOE = {"model": "moe", "dp": 2, "ep": 2, "tp": 1, "batch": 8, "micro_batch": 4}


def test_fp8_dispatch_sends_the_tokens_in_the_recipe_format() -> None:
    # DeepSeek-V3 3.3.3: the tokens before the up-projections and the gradients before the
    # down-projection's backward travel in fp8 (1x128 tiles, fp32 scales); combines bf16
    elements = {
        name: replace(node, comm_size=node.comm_size // 2)
        for name, node in _collectives("ALL_TO_ALL", **MOE, dtype="bf16").items()
    }
    dispatched = {"layer0/fwd/all_to_all_ep:dispatch",
                  "layer0/bwd/all_to_all_ep:combine.grad_expert_down_1"}  # fmt: skip
    in_micro_batch = {name.split("/", 1)[1] for name in elements}
    assert dispatched < in_micro_batch and len(in_micro_batch) == 4
    bf16 = _collectives("ALL_TO_ALL", **MOE, low_precision_recipe="blockwise")
    fp8 = _collectives("ALL_TO_ALL", **MOE, low_precision_recipe="blockwise", fp8_dispatch=True)
    for name, node in elements.items():
        assert bf16[name].comm_size == 2 * node.comm_size
        n = node.comm_size
        fp8_bytes = n + 4 * n // 128  # an fp32 scale per 128 elements
        assert fp8[name].comm_size == (
            fp8_bytes if name.split("/", 1)[1] in dispatched else 2 * n
        ), name


def test_fp8_dispatch_needs_experts_and_a_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for given in (["--low_precision_recipe", "blockwise"], ["--ep", "2", "--model", "moe"]):
        with pytest.raises(SystemExit) as done:
            main(["generate", "--dtype", "fp8", *given, "--fp8_dispatch", "true",
                  "--output_dir", str(tmp_path / "out")])  # fmt: skip
        assert done.value.code == 2
        assert "it needs ep > 1 and low_precision_recipe one of" in capsys.readouterr().err


def test_fp4_gemms_read_half_a_byte_per_operand_element() -> None:
    fp8, fp4 = _nodes(), _nodes(low_precision_recipe="nvfp4")
    mxfp8 = _nodes(low_precision_recipe="mxfp8")
    for name in ("mb0/layer0/fwd/q", "mb0/layer0/bwd/down.grad_w2"):
        batch, m, n, k = fp8[name].attrs["gemm"]
        assert fp4[name].tensor_size == fp8[name].tensor_size - batch * (m * k + k * n) // 2
        assert mxfp8[name].tensor_size == fp8[name].tensor_size


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_memory_from_options_alone_agrees_with_the_workload(recipe: str) -> None:
    # a trace read back (or options without a workload) gets the copies from the options,
    # from each weight's rows and columns: the same bytes, every scale counted
    from stg.predictors.memory import predict_analytic, predict_memory

    options = GenerateOptions(**LLAMA, low_precision_recipe=recipe)
    workload = build_workload(options, load_registry(autoload=False))
    built = predict_memory(workload, "b200-180g")["classes"][0]
    alone = predict_analytic(options, "b200-180g")["classes"][0]
    assert built["weights"] == alone["weights"]


def test_eager_quantize_kernels_pay_the_host_time_of_an_op() -> None:
    from stg.perf.costs import EAGER_OP_HOST_S

    nodes = _nodes(low_precision_recipe="tensorwise", profile="eager", batch=4)
    h100 = load_system("h100-80g")
    amax = nodes["mb0/layer0/fwd/q.amax_input"]
    assert compute_time(amax, h100, "fp8") < EAGER_OP_HOST_S  # a small kernel
    assert compute_time(amax, h100, "fp8", profile="eager") == EAGER_OP_HOST_S
    cached = nodes["mb1/layer0/fwd/q.cast_weight"]  # reused, as under Megatron
    assert compute_time(cached, h100, "fp8", profile="eager") == 0


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_an_indexer_without_weights_is_no_linear_to_quantize(recipe: str) -> None:
    """DeepSeek-V3.2's lightning indexer scores queries against keys with an einsum that reads
    no weight: no Transformer Engine linear, so no quantize site (it raised StopIteration)."""
    from stg.core.options import resolve_model

    registry = load_registry(autoload=False)
    given = dict(model="deepseek-v3.2-exp", ep=2, num_stacks=2, batch=2, seq=256, dtype="fp8",
                 mixed_precision=True, low_precision_recipe=recipe)  # fmt: skip
    values, _ = resolve_model(given, registry)
    options = GenerateOptions(**values)
    assert build_workload(options, registry).ranks[0].nodes()


def test_hopper_recipe_speeds_hold_on_an_h100() -> None:
    """The same measurement on an H100 (h100-scaled.jsonl, taken after the H200's constants
    were set, PyTorch 2.11.0, CUDA 13.0): each recipe's median speed over tensorwise is within
    0.01 of the H200's, and the fp8 GEMM model with those speeds prices the 27 large
    model-shape GEMMs of each scaling within 3 % (median)."""
    big = _speed_ratios(H100_SCALED)
    assert len(big) == 27
    for recipe, speed in RECIPE_GEMM_SPEED["hopper"].items():
        ratios = sorted(r[recipe] for r in big)
        assert ratios[len(ratios) // 2] == pytest.approx(speed, abs=0.01)
    median = _median_model_errors(H100_SCALED, "h100-80g")
    assert set(median) == {"tensorwise", "rowwise", "blockwise"}
    for scaling, error in median.items():
        assert abs(error) < 0.03, scaling
