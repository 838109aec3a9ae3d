"""Dropout (``--dropout P``): the nodes in the written traces against closed forms, the masks
in the memory predictor, the pricing of the time predictor, and the refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time, memory_kind
from stg.perf.system import load_system
from stg.predictors.memory import activation_bytes_per_layer, analytic_memory
from stg.testing import check_model
from stg.trace.reader import read_nodes
from stg.trace.validate import validate_trace

# b = micro-batch per replica, s, h, a heads, t = tp, L layers, m micro-batches
B, S, H, A, T, L, M = 2, 16, 32, 4, 2, 2, 2
DIMS = dict(dvocal=64, dmodel=H, dff=4 * H, head=A, kvhead=A, seq=S, num_stacks=L, batch=B * M)
E = 2  # bf16


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    return int(info.value.code or 0), capsys.readouterr().err


def generate(capsys, out: Path, **options: object) -> Path:
    flags = [f"--{k}={v}" for k, v in {**DIMS, "micro_batch": B, "tp": T, **options}.items()]
    code, err = run(capsys, "generate", "--model", "gpt", *flags, "--output_dir", out)
    assert code == 0, err
    return out


def dropout_totals(path: Path) -> dict[str, tuple[int, int]]:
    """(num_ops, tensor_size) summed over rank 0's dropout nodes, forward and backward."""
    totals = {"fwd": [0, 0], "bwd": [0, 0]}
    for node in read_nodes(next(path.glob("*.0.et"))):
        if "dropout" not in node.name.rsplit("/", 1)[-1].split(".", 1)[0]:
            continue
        if "context.grad" in node.name:  # the context GEMM's gradient w.r.t. the dropout output
            continue
        way = "bwd" if ".grad" in node.name else "fwd"
        totals[way][0] += node.num_ops
        totals[way][1] += node.tensor_size
    return {k: (v[0], v[1]) for k, v in totals.items()}


@pytest.mark.parametrize("tpsp", [True, False])
def test_dropout_nodes_match_closed_forms(capsys, tmp_path: Path, tpsp: bool) -> None:
    out = generate(capsys, tmp_path / "out", dropout=0.1, attention="unfused", tpsp=tpsp)
    sp = T if tpsp else 1
    hidden = B * S * H // sp  # embedding dropout and the two bias-dropout-adds of a layer
    probs = B * (A // T) * S * S  # the attention probabilities
    elements = M * (hidden + L * (2 * hidden + probs))
    # forward: 3 FLOPs per element (draw vs p, mask, scale); reads x, writes y and a 1-byte
    # mask. backward: 2 FLOPs (mask, scale); reads dy and the mask, writes dx
    assert dropout_totals(out) == {
        "fwd": (3 * elements, (2 * E + 1) * elements),
        "bwd": (2 * elements, (2 * E + 1) * elements),
    }
    report = validate_trace(out)
    assert report.ok, report.violations


def test_fused_attention_keeps_its_dropout_inside_the_kernel(capsys, tmp_path: Path) -> None:
    out = generate(capsys, tmp_path / "out", dropout=0.1, tpsp=False)
    names = {node.name.rsplit("/", 1)[-1] for node in read_nodes(next(out.glob("*.0.et")))}
    assert "attn_out_bias_dropout" in names and "fc2_bias_dropout" in names
    assert not any(name.startswith("attn_dropout") for name in names)
    hidden = B * S * H
    elements = M * (hidden + L * 2 * hidden)
    assert dropout_totals(out)["fwd"] == (3 * elements, (2 * E + 1) * elements)


def test_default_builds_no_dropout_and_keeps_the_metadata(capsys, tmp_path: Path) -> None:
    plain = generate(capsys, tmp_path / "plain", attention="unfused")
    zero = generate(capsys, tmp_path / "zero", attention="unfused", dropout=0)
    assert dropout_totals(plain) == {"fwd": (0, 0), "bwd": (0, 0)}
    for path in plain.iterdir():
        assert path.read_bytes() == (zero / path.name).read_bytes()


def test_encoders_have_dropout() -> None:
    for model in ("bert", "roberta"):
        workload = check_model(model, dropout=0.1, attention="unfused")
        names = {node.name.rsplit("/", 1)[-1] for node in workload.ranks[0].nodes()}
        assert {"embedding_dropout", "attn_dropout", "fc2_bias_dropout"} <= names, model


@pytest.mark.parametrize("model", ["llama", "moe", "deepseek"])
def test_models_without_dropout_refuse_it(model: str) -> None:
    with pytest.raises(UserError, match=r"trains without dropout: dropout=0\.1 .*allowed: 0"):
        check_model(model, dropout=0.1)


@pytest.mark.parametrize("value", ["1.0", "-0.1", "x"])
def test_bad_rate_is_one_line(capsys, tmp_path: Path, value: str) -> None:
    code, err = run(capsys, "generate", "--dropout", value, "--output_dir", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1 and "dropout" in err, err
    assert not (tmp_path / "o").exists()


# --- memory ---------------------------------------------------------------------------------


def korthikanti(**kw: object) -> GenerateOptions:
    s, b, h, a = 2048, 1, 12288, 96
    values: dict[str, object] = dict(
        model="gpt", dmodel=h, dff=4 * h, head=a, kvhead=a, seq=s, batch=b, num_stacks=4,
        dtype="fp16", attention="unfused", tpsp=False,
    )  # fmt: skip
    return GenerateOptions(**{**values, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("t", [1, 8])
def test_memory_counts_masks_only_with_dropout(t: int) -> None:
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    with_dropout = activation_bytes_per_layer(korthikanti(tp=t, dropout=0.1))
    without = activation_bytes_per_layer(korthikanti(tp=t))
    # Korthikanti's s·b·h·(10 + 24/t + 5·a·s/(h·t)): the masks and the dropout output included
    assert with_dropout == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    # without dropout: no hidden masks (2sbh), no probability mask and dropout output (3as²b/t)
    assert without == pytest.approx(sbh * (8 + 24 / t + 2 * a * s / (h * t)))
    fused = dict(attention="fused")
    assert activation_bytes_per_layer(
        korthikanti(tp=t, dropout=0.1, **fused)
    ) - activation_bytes_per_layer(korthikanti(tp=t, **fused)) == pytest.approx(2 * sbh)


def test_memory_of_the_embedding_mask_follows_the_option() -> None:
    o = korthikanti(pp=2, batch=2, micro_batch=1)  # 2 micro-batches of 1 sample
    first = analytic_memory(o)[0].activations
    first_dropout = analytic_memory(replace(o, dropout=0.1))[0].activations
    layers = 2 * 2  # two layers on stage 0, two micro-batches in flight (1F1B, pp 2)
    per_layer = activation_bytes_per_layer(replace(o, dropout=0.1))
    per_layer -= activation_bytes_per_layer(o)
    embedding_mask = 2 * 2048 * 12288  # 1 byte per element, two micro-batches in flight
    assert first_dropout - first == pytest.approx(layers * per_layer + embedding_mask)


# --- time -----------------------------------------------------------------------------------


def test_time_prices_dropout_as_memory_bound_kernels() -> None:
    system = load_system("a100-80g")
    o = GenerateOptions(**DIMS, micro_batch=B, tp=T, dropout=0.1, attention="unfused")
    nodes = {n.name: n for n in build_workload(o, load_registry(autoload=False)).ranks[0].nodes()}
    fused = nodes["mb0/layer0/fwd/attn_out_bias_dropout"]
    elements = fused.num_ops // 3
    # megatron: bias-dropout-add is one kernel, the residual add's plus the mask it writes
    assert compute_time(fused, system, profile="megatron") == pytest.approx(
        memory_bound_time(system.gpu, elements, "stream")
    )
    # eager: its own kernel at the measured dropout rate, at least the host's time per op
    eager = compute_time(fused, system, profile="eager")
    kernel = memory_bound_time(system.gpu, fused.tensor_size, "dropout") + system.kernel_overhead
    assert eager == pytest.approx(max(kernel, 27.7e-6))
    probs = nodes["mb0/layer0/fwd/attn_dropout"]
    assert memory_kind(probs.name) == "dropout"
    assert compute_time(probs, system, profile="megatron") == pytest.approx(
        memory_bound_time(system.gpu, probs.tensor_size, "dropout") + system.kernel_overhead
    )
    grad = nodes["mb0/layer0/bwd/attn_dropout.grad_softmax"]
    assert memory_kind(grad.name) == "stream"
    assert compute_time(grad, system, profile="megatron") == pytest.approx(
        memory_bound_time(system.gpu, grad.tensor_size, "stream") + system.kernel_overhead
    )


def test_the_backward_keeps_the_masks() -> None:
    from stg.core.modelinfo import build_unsharded, saved_activations

    registry = load_registry(autoload=False)
    saved = {}
    for rate in (0.0, 0.1):
        o = GenerateOptions(**DIMS, attention="unfused", dropout=rate)
        part = build_unsharded(registry.models.get("gpt"), "block", o)
        saved[rate] = {t.name: t.dtype for t in saved_activations(part)}
    masks = {name: dtype for name, dtype in saved[0.1].items() if name.endswith(".mask")}
    assert masks == {
        f"{op}.mask": "int8" for op in ("attn_dropout", "attn_out_bias_dropout", "fc2_bias_dropout")
    }
    assert not any(name.endswith(".mask") for name in saved[0.0])
