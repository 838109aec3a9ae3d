"""Selective recompute of chosen modules (Megatron-LM's ``--recompute-modules``: core_attn,
mlp, layernorm; mla_up_proj in tests/test_mla_up_proj_recompute.py): the ops each re-runs
and their FLOPs read from the written files, the bytes the memory predictor keeps against
Korthikanti's per-tensor closed forms, and the predictors agreeing."""

from __future__ import annotations

from collections import Counter

import pytest
from typer.testing import CliRunner
from workload_checks import check_runs_to_completion

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType, Phase, node_op, node_part, node_phase
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options
from stg.predictors.memory import activation_bytes_per_layer, analytic_memory, predict_memory
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes
from stg.trace.validate import validate_trace

# GPT with F = 4h, unfused attention, no dropout: Korthikanti's s·b·h·(8 + 24/t + 2·a·s/(h·t))
SMALL = dict(
    model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=128, batch=8,
    micro_batch=4, num_stacks=2, attention="unfused",
)  # fmt: skip


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def selective(*modules: str, **kw: object) -> GenerateOptions:
    return options(activation_recompute="selective", recompute_modules=modules, **kw)


@pytest.mark.parametrize(
    ("modules", "ops", "gemm"),
    [
        # the attention core: q·k and p·v, 2·b·s²·h/t each
        (("core_attn",), {"scores", "softmax", "context"}, lambda b, s, h, f: 4 * b * s * s * h),
        # the MLP from its input: the sequence-parallel gather, fc1, GELU, fc2, its scatter
        (("mlp",), {"all_gather_tp:ln2", "fc1", "fc1_bias", "gelu", "fc2",
                    "reduce_scatter_tp:fc2", "fc2_bias"},
         lambda b, s, h, f: 2 * b * s * 2 * h * f),
        # the two norms, from their inputs
        (("layernorm",), {"ln1", "ln2"}, lambda b, s, h, f: 0),
    ],
)  # fmt: skip
def test_each_module_reruns_its_ops_in_the_written_files(tmp_path, modules, ops, gemm) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    args = [
        "--model", "gpt", "--dvocal", "1024", "--dmodel", "256", "--dff", "1024",
        "--head", "8", "--kvhead", "8", "--seq", "128", "--batch", "8", "--micro_batch",
        "4", "--num_stacks", "2", "--attention", "unfused", "--tp", "2",
        "--activation_recompute", "selective", "--recompute_modules", ",".join(modules),
    ]  # fmt: skip
    result = CliRunner().invoke(app, ["generate", *args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert validate_trace(out).ok
    o = selective(*modules, tp=2)
    b, s, h, f, t, m = 4, o.seq, o.dmodel, o.dff, 2, o.micro_batches
    nodes = read_nodes(out / "workload.0.et")
    again = [n for n in nodes if node_phase(n) is Phase.RECOMPUTE]
    by_layer: Counter[str] = Counter(str(node_part(n)) for n in again)
    assert set(by_layer) == {"layer0", "layer1"}
    assert {node_op(n) for n in again} == ops
    gemms = sum(n.num_ops for n in again if "gemm" in (n.attrs or {}))
    assert gemms == o.num_stacks * m * gemm(b, s, h, f) // t
    if modules == ("layernorm",):  # 7 FLOPs per element of this rank's s/t rows
        norms = sum(n.num_ops for n in again if n.type is NodeType.COMP)
        assert norms == o.num_stacks * m * 2 * 7 * b * s * h // t


@pytest.mark.parametrize("tp", [1, 2])
def test_kept_bytes_follow_korthikanti_per_module(tp: int) -> None:
    """Per layer and micro-batch, in units of s·b·h (2-byte activations, t = tp, sequence
    parallel): the norms' inputs and outputs 8/t' (t' = t with sequence parallelism, else
    1), Q, K, V and the projection input 8/t, the GELU's input and output 16/t, the scores
    2·a·s/(h·t). core_attn drops the scores, mlp the GELU's tensors (its input, a norm
    output, stays), layernorm the norms' outputs (4/t')."""
    o = options(tp=tp)
    s, b, h, a, t = o.seq, 4, o.dmodel, o.head, tp
    sbh = s * b * h
    norms, qkv, gelu, scores = 8 / t, 8 / t, 16 / t, 2 * a * s / (h * t)
    assert activation_bytes_per_layer(o) == pytest.approx(sbh * (norms + qkv + gelu + scores))
    cases = {
        ("core_attn",): norms + qkv + gelu,
        ("mlp",): norms + qkv + scores,
        ("layernorm",): norms / 2 + qkv + gelu + scores,
        ("core_attn", "mlp", "layernorm"): norms / 2 + qkv,
    }
    for modules, units in cases.items():
        got = activation_bytes_per_layer(selective(*modules, tp=tp))
        assert got == pytest.approx(sbh * units), modules
    # core_attn is what selective recompute always re-ran
    assert activation_bytes_per_layer(selective("core_attn", tp=tp)) == (
        activation_bytes_per_layer(options(tp=tp, activation_recompute="selective"))
    )


def test_core_attn_alone_is_selective_recompute_as_it_was() -> None:
    registry = load_registry()
    plain = build_workload(options(tp=2, activation_recompute="selective"), registry)
    named = build_workload(selective("core_attn", tp=2), registry)
    for a, b in zip(plain.rank_classes, named.rank_classes, strict=True):
        assert a.nodes == b.nodes


@pytest.mark.parametrize("modules", [("mlp",), ("layernorm", "mlp"), ("core_attn", "mlp")])
def test_predictors_agree_on_module_recompute(modules: tuple[str, ...]) -> None:
    registry = load_registry()
    kernels = list(registry.kernels)
    o = selective(*modules, tp=2, pp=2, dp=2, num_stacks=4, batch=16, model="llama", kvhead=4)
    workload = build_workload(o, registry)
    assert check_runs_to_completion(workload) == sum(len(g) for g in workload.ranks)
    dag = predict_time(workload, "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=registry, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.03
    assert fast["hardware_flops"] > fast["model_flops"]
    report = predict_memory(workload, "h100-80g")
    peaks = {c["stage"]: c["peak"] for c in report["classes"]}
    for memory in analytic_memory(o):
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--activation_recompute", "selective", "--recompute_modules", "core_attn,moe"],
         "recompute_modules=core_attn,moe: moe is not a module stg recomputes; allowed: "
         "core_attn, mlp, layernorm, mla_up_proj"),
        (["--activation_recompute", "full", "--recompute_modules", "mlp"],
         "activation_recompute=full is not allowed; allowed: activation_recompute=selective"),
        (["--model", "moe", "--activation_recompute", "selective", "--recompute_modules", "mlp"],
         "recompute_modules=mlp: model moe has no mlp module in its layers; allowed: "
         "core_attn, layernorm"),
        (["--activation_recompute", "selective", "--recompute_modules", "mla_up_proj"],
         "recompute_modules=mla_up_proj: model gpt has no mla_up_proj module in its layers; "
         "allowed: core_attn, mlp, layernorm"),
    ],
)  # fmt: skip
def test_impossible_modules_are_refused_with_one_line(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["generate", "--num_stacks", "2", "--dmodel", "256", "--dff", "512", "--head", "8",
         "--kvhead", "8", "--seq", "64", "--dvocal", "512", "--batch", "4", *args,
         "--output_dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_modules_off_are_not_recorded() -> None:
    assert "recompute_modules" not in options(activation_recompute="selective").recorded()
    assert selective("mlp").recorded()["recompute_modules"] == ("mlp",)


def test_a_sweep_spells_module_sets_with_plus() -> None:
    from stg.explore.space import values_of

    assert values_of("recompute_modules", "core_attn,core_attn+MLP") == [
        ("core_attn",),
        ("core_attn", "mlp"),
    ]
    assert values_of("recompute_modules", [["mlp", "layernorm"]]) == [("mlp", "layernorm")]
    assert GenerateOptions(recompute_modules="mlp,layernorm").recompute_modules == (  # type: ignore[arg-type]
        "mlp",
        "layernorm",
    )


def test_no_modules_named_is_the_default() -> None:
    """``recompute_modules=None`` from Python is no module named, as ``()`` is."""
    assert GenerateOptions(model="gpt", recompute_modules=None) == GenerateOptions(model="gpt")
