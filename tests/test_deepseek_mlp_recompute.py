"""Megatron-LM's ``mlp`` selective recompute (``--recompute_modules mlp``) of DeepSeek: the
dense MLP of the first ``dense_layers`` layers runs again in the recompute phase before each
dense layer's backward (FLOPs read from the written files against its closed form), and the MoE
layers, shared experts included, re-run nothing (Megatron sets ``recompute_mlp`` only where
the layer's MLP is not an ``MoELayer``); the bytes the memory predictor no longer keeps
against the closed form and the graph's own saved tensors, the predictors agreeing; the
combination with ``mla_up_proj``; a stack of MoE layers only refuses the module in one line;
without it DeepSeek's traces keep their bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner
from workload_checks import DEEPSEEK_UP_PROJ_OPS as UP_OPS
from workload_checks import generate_args, trace_digest

from stg.cli import app
from stg.core.lowering import Binder
from stg.core.modelinfo import saved_activations
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_parts, build_workload, symbol_values
from stg.core.plan import make_plan
from stg.core.workload import NodeType, Phase, node_op, node_part, node_phase
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.models import deepseek, llama
from stg.predictors.analytical import predict_options
from stg.predictors.memory import (
    activation_bytes_per_layer,
    analytic_memory,
    mla_up_proj_bytes,
    predict_memory,
)
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes
from stg.trace.validate import validate_trace

REGISTRY = load_registry(autoload=False)
TINY = dict(
    model="deepseek", dvocal=64, dmodel=32, dff=16, head=4, kvhead=4, dhead=8, seq=16,
    num_stacks=4, experts=4, kexperts=2, shared_experts=1, dense_layers=2, dense_dff=48,
    q_lora_rank=12, kv_lora_rank=16, drope=4, batch=4,
)  # fmt: skip
MLP_OPS = {"all_gather_tp:ffn_norm", "gate", "up", "swiglu", "down", "reduce_scatter_tp:down"}
"""What mlp re-runs in a dense layer under tp 2 with sequence parallelism: the gather of the
norm's output (the module's input), the SwiGLU's GEMMs and product and the down projection's
reduce-scatter, as Llama's (tests/test_recompute_modules.py for GPT's)."""
MLP_GEMMS = ("gate", "up", "down")
DENSE = {"layer0", "layer1"}


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**TINY, **kw})  # type: ignore[arg-type]


def selective(*modules: str, **kw: object) -> GenerateOptions:
    return options(activation_recompute="selective", recompute_modules=modules, **kw)


def cli_args(**kw: object) -> list[str]:
    """``stg generate`` with TINY and ``kw``."""
    return generate_args(TINY, **kw)


def dense_mlp_bytes(o: GenerateOptions, silu_output: bool = False) -> float:
    """The dense MLP's own tensors, per layer and micro-batch (2-byte activations): gate, up
    and their product, 3·s·b·F_dense/t (eager also keeps the SiLU output: 4)."""
    s, b, t = o.seq, o.micro_batch or o.batch, o.tp
    return 2 * (4 if silu_output else 3) * s * b * o.dense_dff / t


def test_the_dense_mlp_runs_again_in_the_written_files(tmp_path: Path) -> None:
    """Per dense layer and micro-batch (B samples, t = 2): the three GEMMs once more,
    3·2·B·s·h·F_dense/t, the SwiGLU product (4 FLOPs per element of its s·F_dense/t), the
    gather and the reduce-scatter; in the recompute phase of the dense layers only, as much
    as their forward ran. The MoE layers (routed and shared experts) re-run nothing."""
    o = selective("mlp", tp=2, micro_batch=2)
    out = tmp_path / "out"
    args = cli_args(tp=2, micro_batch=2, activation_recompute="selective",
                    recompute_modules=("mlp",))  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert validate_trace(out).ok
    nodes = read_nodes(out / "workload.0.et")
    again = [n for n in nodes if node_phase(n) is Phase.RECOMPUTE]
    assert {node_op(n) for n in again} == MLP_OPS
    assert {str(node_part(n)) for n in again} == DENSE  # not layer2, layer3: MoE
    B, s, h, F, t, m = 2, o.seq, o.dmodel, o.dense_dff, 2, o.micro_batches
    L = len(DENSE)
    gemms = sum(n.num_ops for n in again if "gemm" in (n.attrs or {}))
    assert gemms == L * m * 3 * 2 * B * s * h * F // t
    forward = [
        n
        for n in nodes
        if node_phase(n) is Phase.FORWARD and node_op(n) in MLP_GEMMS and str(node_part(n)) in DENSE
    ]
    assert gemms == sum(n.num_ops for n in forward)
    others = sum(
        n.num_ops for n in again if n.type is NodeType.COMP and "gemm" not in (n.attrs or {})
    )
    assert others == L * m * llama.SWIGLU_FLOPS * B * s * F // t
    collectives = [n for n in again if n.type is NodeType.COMM_COLL]
    assert len(collectives) == 2 * L * m


def test_the_predictors_agree_and_count_the_recomputed_flops() -> None:
    """mlp adds exactly the recomputed dense MLPs' FLOPs; the time predictors agree within
    3 %; the memory predictor reads the same peaks from the workload and from options, lower
    on the stage that holds the dense layers and the same on the stage of MoE layers only."""
    kernels = list(REGISTRY.kernels)
    plan = dict(tp=2, pp=2, dp=2, batch=8)
    base = selective("core_attn", **plan)
    o = selective("core_attn", "mlp", **plan)
    workloads = {k: build_workload(v, REGISTRY) for k, v in (("base", base), ("mlp", o))}

    def flops(workload: object) -> int:
        return sum(
            n.num_ops
            for g in workload.ranks  # type: ignore[attr-defined]
            for n in g.nodes()
            if n.type is NodeType.COMP
        )

    recomputed = [
        n
        for g in workloads["mlp"].ranks
        for n in g.nodes()
        if node_phase(n) is Phase.RECOMPUTE and node_op(n) in MLP_OPS
    ]
    assert recomputed and {str(node_part(n)) for n in recomputed} == DENSE
    added = flops(workloads["mlp"]) - flops(workloads["base"])
    assert added == sum(n.num_ops for n in recomputed)
    dag = predict_time(workloads["mlp"], "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=REGISTRY, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.03
    slower = predict_time(workloads["base"], "h100-80g", kernels=kernels)
    assert dag["iteration_time_s"] > slower["iteration_time_s"]
    report = predict_memory(workloads["mlp"], "h100-80g")
    peaks = {c["stage"]: c["peak"] for c in report["classes"]}
    for memory in analytic_memory(o):
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-9)
    kept = {m.stage: m.peak for m in analytic_memory(base)}
    assert [c.facts["layer_kinds"] for c in workloads["mlp"].rank_classes] == [
        {"dense": 2},
        {"moe": 2},
    ]
    assert peaks[0] < kept[0]
    assert peaks[1] == pytest.approx(kept[1], rel=1e-12)


@pytest.mark.parametrize("profile", ["megatron", "eager"])
@pytest.mark.parametrize("tpsp", [True, False])
def test_freed_bytes_follow_the_closed_form(tpsp: bool, profile: str) -> None:
    """Per dense layer and micro-batch: gate, up and their product, 3·s·b·F_dense·2/t (eager
    keeps the SiLU output too); its input, the norm's output, stays (the checkpoint's input).
    An MoE layer frees nothing. Other modules' savings add."""
    o = selective("core_attn", "mlp", tp=2, tpsp=tpsp, profile=profile)
    core = replace(o, recompute_modules=("core_attn",))
    expected = dense_mlp_bytes(o, silu_output=profile == "eager")

    def freed(x: GenerateOptions, kind: str) -> float:
        return activation_bytes_per_layer(core, kind=kind) - activation_bytes_per_layer(
            x, kind=kind
        )

    assert freed(o, "dense") == pytest.approx(expected)
    assert freed(o, "moe") == 0
    norms = replace(o, recompute_modules=("core_attn", "layernorm"))
    both = replace(o, recompute_modules=("core_attn", "layernorm", "mlp"))
    for kind in ("dense", "moe"):
        alone = freed(norms, kind)
        assert alone > 0
        assert freed(both, kind) == pytest.approx(alone + (expected if kind == "dense" else 0))


@pytest.mark.parametrize("tp", [1, 2])
def test_freed_bytes_are_what_the_graph_no_longer_keeps(tp: int) -> None:
    """Without sequence parallelism the predictor's bytes are the tensors that the layer's
    backward reads and that ops tagged mlp make (one rank's shard of each): the dense MLP's
    gate, up and product; none in an MoE layer, whose shared experts are not tagged."""
    o = selective("mlp", tp=tp, tpsp=False)
    plan = make_plan(o)
    binder = Binder(symbol_values(o), plan.degrees, plan.axis_parts)
    parts = build_parts(REGISTRY.models.get("deepseek"), plan)
    core = replace(o, recompute_modules=("core_attn",))
    for kind, names in (("dense", {"gate", "up", "swiglu"}), ("moe", set())):
        part = parts.blocks[kind].part
        made = [
            t
            for t in saved_activations(part)
            if t.producer is not None and deepseek.MLP in t.producer.tags
        ]
        assert {t.producer.name for t in made} == names, kind  # type: ignore[union-attr]
        freed = activation_bytes_per_layer(core, kind=kind) - activation_bytes_per_layer(
            replace(o, recompute_modules=("core_attn", "mlp")), kind=kind
        )
        assert sum(map(binder.nbytes, made)) == freed, kind
    assert not any(deepseek.MLP in op.tags for op in parts.blocks["moe"].part.forward)


def test_with_mla_up_proj_both_modules_run_again(tmp_path: Path) -> None:
    """``mla_up_proj,mlp``: the dense layers re-run their up-projections and their MLP, the
    MoE layers their up-projections only; the bytes freed add."""
    out = tmp_path / "out"
    args = cli_args(tp=2, activation_recompute="selective",
                    recompute_modules=("mla_up_proj", "mlp"))  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    nodes = read_nodes(out / "workload.0.et")
    again: dict[str, set[str]] = {}
    for n in nodes:
        if node_phase(n) is Phase.RECOMPUTE:
            again.setdefault(str(node_part(n)), set()).add(node_op(n))
    assert again == {
        "layer0": UP_OPS | MLP_OPS,
        "layer1": UP_OPS | MLP_OPS,
        "layer2": UP_OPS,
        "layer3": UP_OPS,
    }
    o = selective("core_attn", "mla_up_proj", "mlp", tp=2)
    core = replace(o, recompute_modules=("core_attn",))
    for kind, mlp in (("dense", dense_mlp_bytes(o)), ("moe", 0)):
        assert activation_bytes_per_layer(o, kind=kind) == pytest.approx(
            activation_bytes_per_layer(core, kind=kind) - mla_up_proj_bytes(o) - mlp
        )


SIZES = ["--num_stacks", "2", "--dmodel", "32", "--dff", "16", "--head", "4", "--kvhead", "4",
         "--seq", "16", "--dvocal", "64", "--batch", "4"]  # fmt: skip
ALL_MOE = [
    # Qwen3-MoE's layout: every layer MoE (the built-in moe model, no dense layers)
    ["--model", "moe", "--experts", "4", "--kexperts", "2", *SIZES],
    # DeepSeek without dense layers
    cli_args(dense_layers=0)[1:],
]


@pytest.mark.parametrize("args", ALL_MOE, ids=["moe", "deepseek-dense_layers-0"])
def test_a_stack_of_moe_layers_only_refuses_the_module(tmp_path: Path, args: list[str]) -> None:
    """No layer has a dense MLP: stg generate refuses mlp in one line (exit 2), and so do
    the memory predictor (stg predict, from options) and its analytic form."""
    chosen = ["--activation_recompute", "selective", "--recompute_modules", "core_attn,mlp"]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", *args, *chosen, "--output_dir", str(out)])
    assert result.exit_code == 2, result.output
    model = args[args.index("--model") + 1]
    assert (
        f"recompute_modules=core_attn,mlp: model {model} has no mlp module in its layers"
        in " ".join(result.output.split())
    )
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()
    predicted = CliRunner().invoke(
        app,
        ["predict", "--predictor", "memory", "--system", "h100-80g", *args, *chosen],
    )
    assert predicted.exit_code == 2, predicted.output
    assert "has no dense MLP module" in " ".join(predicted.output.split())
    assert len(predicted.output.strip().splitlines()) == 1
    for o in (
        GenerateOptions(model="moe", experts=4, kexperts=2, activation_recompute="selective",
                        recompute_modules=("mlp",)),
        selective("mlp", dense_layers=0),
        selective("mlp", num_stacks=1),  # one layer: an MoE one (one MoE layer at least)
    ):  # fmt: skip
        with pytest.raises(
            UserError, match=r"recompute_modules=mlp: a \w+ layer of \w+ has no dense MLP"
        ):
            analytic_memory(o)


PLANS: list[dict[str, object]] = [
    {},
    dict(tp=2),
    dict(tp=2, activation_recompute="selective"),
    dict(tp=2, pp=2, activation_recompute="full"),
    dict(tp=2, activation_recompute="selective", recompute_modules=("core_attn", "layernorm")),
    dict(tp=2, activation_recompute="selective", recompute_modules=("mla_up_proj",)),
    dict(tp=2, dtype="fp8", activation_recompute="selective"),
    dict(dp=2, weight_sharded=True, activation_recompute="selective"),
]  # fmt: skip


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: ",".join(f"{k}={p[k]}" for k in p) or "-")
def test_without_the_module_the_tag_changes_no_byte(
    plan: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek's traces are the same bytes whether its dense MLP carries the tag or a tag
    nothing reads: the tag alone changes nothing unless mlp is chosen."""
    o = options(**plan)
    tagged = trace_digest(o, REGISTRY, tmp_path / "tagged")
    monkeypatch.setattr(deepseek, "MLP", "not_a_recompute_module")
    assert trace_digest(o, REGISTRY, tmp_path / "untagged") == tagged


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_without_the_module_the_written_trace_reruns_no_mlp(recompute: str, tmp_path: Path) -> None:
    """No recompute: no node of the recompute phase at all; selective recompute of the
    default module (core_attn): the attention core only, no MLP op."""
    out = tmp_path / "out"
    args = cli_args(tp=2, activation_recompute=recompute)
    result = CliRunner().invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    again = [n for n in read_nodes(out / "workload.0.et") if node_phase(n) is Phase.RECOMPUTE]
    if recompute == "none":
        assert again == []
    else:
        assert again and not {node_op(n) for n in again} & MLP_OPS
