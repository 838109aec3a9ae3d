"""Megatron-LM's ``mla_up_proj`` selective recompute (``--recompute_modules mla_up_proj``) of
multi-head latent attention: the latents' norms, the up-projections and RoPE run again in the
recompute phase before each layer's backward, whose attention reads what they recompute
(FLOPs read from the written files against their closed forms); the bytes the memory
predictor no longer keeps against its closed form and against the graph's own saved
tensors; other models refuse the module in one line; without it DeepSeek's traces keep
their bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner
from workload_checks import DEEPSEEK_UP_PROJ_OPS as UP_OPS
from workload_checks import generate_args, trace_digest

from stg.api import RECIPES
from stg.cli import app
from stg.core.lowering import Binder
from stg.core.modelinfo import saved_activations
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_parts, build_workload, symbol_values
from stg.core.plan import make_plan
from stg.core.workload import NodeType, Phase, node_op, node_part, node_phase
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.models import deepseek
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
    num_stacks=3, experts=4, kexperts=2, shared_experts=1, dense_layers=1, dense_dff=48,
    q_lora_rank=12, kv_lora_rank=16, drope=4, batch=4,
)  # fmt: skip
UP_GEMMS = ("q", "q_rope", "k", "v")


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**TINY, **kw})  # type: ignore[arg-type]


def up_proj(*modules: str, **kw: object) -> GenerateOptions:
    return options(
        activation_recompute="selective", recompute_modules=(*modules, "mla_up_proj"), **kw
    )


def cli_args(**kw: object) -> list[str]:
    """``stg generate`` with TINY and ``kw``."""
    return generate_args(TINY, **kw)


def test_the_up_projections_run_again_in_the_written_files(tmp_path: Path) -> None:
    """Per layer and micro-batch (B samples, t = 2): the up-projection GEMMs once more,
    2·B·s·(q·a·(d + r) + 2·c·a·d)/t, the latents' norms (4 FLOPs per element of this rank's
    s/t rows), RoPE of the query (3 per element of its heads) and of the shared key (its
    s/t rows), its copy to this rank's heads (one op per element), and the two gathers; in
    the recompute phase of every layer."""
    o = up_proj(tp=2, micro_batch=2)
    out = tmp_path / "out"
    args = cli_args(tp=2, micro_batch=2, activation_recompute="selective",
                    recompute_modules=("mla_up_proj",))  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert validate_trace(out).ok
    nodes = read_nodes(out / "workload.0.et")
    again = [n for n in nodes if node_phase(n) is Phase.RECOMPUTE]
    assert {node_op(n) for n in again} == UP_OPS
    assert {str(node_part(n)) for n in again} == {f"layer{i}" for i in range(o.num_stacks)}
    B, s, a, t, m, L = 2, o.seq, o.head, 2, o.micro_batches, o.num_stacks
    d, r, c, q = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    gemms = sum(n.num_ops for n in again if "gemm" in (n.attrs or {}))
    assert gemms == L * m * 2 * B * s * (q * a * (d + r) + 2 * c * a * d) // t
    forward = [n for n in nodes if node_phase(n) is Phase.FORWARD and node_op(n) in UP_GEMMS]
    assert gemms == sum(n.num_ops for n in forward)
    others = sum(
        n.num_ops for n in again if n.type is NodeType.COMP and "gemm" not in (n.attrs or {})
    )
    rows = B * s // t
    copy = B * s * (a // t) * r  # the gathered RoPE key copied to this rank's heads
    assert others == L * m * (4 * rows * (q + c) + 3 * B * s * (a // t) * r + 3 * rows * r + copy)
    gathers = [n for n in again if n.type is NodeType.COMM_COLL]
    assert len(gathers) == 2 * L * m


def test_the_attention_backward_reads_the_recomputed_query_key_and_value() -> None:
    """The recompute starts once the layer's gradient has arrived (after the next layer's
    backward), and the attention's backward reads the recomputed Q, its RoPE part, K and V,
    not the forward's."""
    workload = build_workload(up_proj(tp=2), REGISTRY)
    nodes = list(workload.ranks[0].nodes())
    by_id = {n.id: n for n in nodes}
    core = next(n for n in nodes if n.name == "mb0/layer1/bwd/core_attention.grad")
    read = {by_id[i].name for i in core.data_deps}
    recomputed = {f"mb0/layer1/recompute/{op}" for op in ("q", "rope_q", "k", "v")}
    assert recomputed <= read
    assert not {f"mb0/layer1/fwd/{op}" for op in ("q", "rope_q", "k", "v")} & read
    first = next(n for n in nodes if n.name.startswith("mb0/layer1/recompute/"))
    waits = [by_id[i] for i in (*first.data_deps, *first.ctrl_deps)]
    assert any(node_phase(n) is Phase.BACKWARD and node_part(n) == "layer2" for n in waits)


def test_the_predictors_agree_and_count_the_recomputed_flops() -> None:
    """The time predictors agree within 3 %; mla_up_proj adds exactly the recomputed nodes'
    FLOPs; the memory predictor reads the same peaks from the workload and from options."""
    kernels = list(REGISTRY.kernels)
    plan = dict(tp=2, pp=2, dp=2, num_stacks=4, batch=8)
    base = options(activation_recompute="selective", recompute_modules=("core_attn",), **plan)
    o = up_proj("core_attn", **plan)
    workloads = {k: build_workload(v, REGISTRY) for k, v in (("base", base), ("up", o))}

    def flops(workload: object, phase: Phase | None = None) -> int:
        return sum(
            n.num_ops
            for g in workload.ranks  # type: ignore[attr-defined]
            for n in g.nodes()
            if n.type is NodeType.COMP and (phase is None or node_phase(n) is phase)
        )

    recomputed = [
        n
        for g in workloads["up"].ranks
        for n in g.nodes()
        if node_phase(n) is Phase.RECOMPUTE and node_op(n) in UP_OPS
    ]
    assert recomputed
    assert flops(workloads["up"]) - flops(workloads["base"]) == sum(n.num_ops for n in recomputed)
    dag = predict_time(workloads["up"], "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=REGISTRY, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.03
    slower = predict_time(workloads["base"], "h100-80g", kernels=kernels)
    assert dag["iteration_time_s"] > slower["iteration_time_s"]
    report = predict_memory(workloads["up"], "h100-80g")
    peaks = {c["stage"]: c["peak"] for c in report["classes"]}
    for memory in analytic_memory(o):
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-9)
    lower = {m.stage: m.peak for m in analytic_memory(base)}
    assert all(peaks[stage] < lower[stage] for stage in peaks)


@pytest.mark.parametrize("tpsp", [True, False])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_freed_bytes_follow_the_closed_form(tpsp: bool, kind: str) -> None:
    """Per layer and micro-batch (2-byte activations, t = 2): Q and K with their RoPE parts,
    and V, s·b·a·(3d + 2r)/t, and the two normalised latents, s·b·(q + c) (whole sequence, as the
    predictor counts the latents); the rotated RoPE key, s·b·r, too where no
    sequence-parallel gather keeps a copy of it. Other modules' savings add."""
    o = up_proj("core_attn", tp=2, tpsp=tpsp)
    s, b, a, t = o.seq, o.batch, o.head, 2
    d, r, c, q = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    expected = 2 * (s * b * a * (3 * d + 2 * r) / t + s * b * (q + c + (0 if tpsp else r)))
    assert mla_up_proj_bytes(o) == pytest.approx(expected)
    core = replace(o, recompute_modules=("core_attn",))
    saved = activation_bytes_per_layer(core, kind=kind) - activation_bytes_per_layer(o, kind=kind)
    assert saved == pytest.approx(expected)
    both = replace(o, recompute_modules=("core_attn", "layernorm", "mla_up_proj"))
    norms = activation_bytes_per_layer(core, kind=kind) - activation_bytes_per_layer(
        replace(o, recompute_modules=("core_attn", "layernorm")), kind=kind
    )
    assert activation_bytes_per_layer(both, kind=kind) == pytest.approx(
        activation_bytes_per_layer(core, kind=kind) - expected - norms
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_freed_bytes_are_what_the_graph_no_longer_keeps(tp: int) -> None:
    """Without sequence parallelism the predictor's bytes are the tensors that the layer's
    backward reads and that ops tagged mla_up_proj make (one rank's shard of each); the
    latent's slices, which Megatron's checkpoint takes as inputs, are not tagged."""
    for kind in ("dense", "moe"):
        o = up_proj(tp=tp, tpsp=False)
        plan = make_plan(o)
        binder = Binder(symbol_values(o), plan.degrees, plan.axis_parts)
        part = build_parts(REGISTRY.models.get("deepseek"), plan).blocks[kind].part
        made = [
            t
            for t in saved_activations(part)
            if t.producer is not None and deepseek.UP_PROJ in t.producer.tags
        ]
        names = {t.producer.name: t for t in made}  # type: ignore[union-attr]
        assert set(names) == {
            "q_norm", "q", "q_rope", "rope_q", "kv_norm", "rope_k", "k", "v", "k_rope_expand"
        }  # fmt: skip
        # the graph keeps RoPE's input for its backward; the closed forms do not count it
        # (Megatron's RoPE saves only its cos/sin tables)
        del names["q_rope"]
        assert sum(map(binder.nbytes, names.values())) == mla_up_proj_bytes(o), kind


def test_fp8_drops_the_quantized_latents_and_fp8_attention_keeps_its_copies() -> None:
    """Under Transformer Engine's fp8 the up-projections' forward runs without gradients, so
    their quantized inputs (the normalised latents' copies) go with the bf16 latents; with
    fp8_attention the attention saves fp8 copies of Q, K and V of its own, which stay: only
    the latents are freed then. The lightning indexer reads the query latent: it stays."""
    plain = up_proj("core_attn", tp=2, dtype="fp8", low_precision_recipe="mxfp8")
    core = replace(plain, recompute_modules=("core_attn",))
    s, b, a, t = plain.seq, plain.batch, plain.head, 2
    d, r, c, q = plain.dhead, plain.drope, plain.kv_lora_rank, plain.q_lora_rank
    one = RECIPES["mxfp8"].saved_input_bytes()
    heads = 2 * s * b * a * (3 * d + 2 * r) / t

    def saved(o: GenerateOptions) -> float:
        kept = activation_bytes_per_layer(replace(o, recompute_modules=("core_attn",)))
        return kept - activation_bytes_per_layer(o)

    assert saved(plain) == pytest.approx(heads + one * s * b * (q + c))
    assert activation_bytes_per_layer(core) > activation_bytes_per_layer(plain)
    fp8_attention = replace(plain, fp8_attention=True)
    assert saved(fp8_attention) == pytest.approx(one * s * b * (q + c))
    indexer = up_proj("core_attn", tp=2, index_topk=4, causal=True)
    assert saved(indexer) == pytest.approx(heads + 2 * s * b * c)


def test_a_model_without_latent_attention_refuses_the_module(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["generate", "--model", "llama", "--num_stacks", "2", "--dmodel", "256", "--dff", "512",
         "--head", "8", "--kvhead", "8", "--seq", "64", "--dvocal", "512", "--batch", "4",
         "--activation_recompute", "selective", "--recompute_modules", "core_attn,mla_up_proj",
         "--output_dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert (
        "recompute_modules=core_attn,mla_up_proj: model llama has no mla_up_proj module in its "
        "layers; allowed: core_attn, mlp, layernorm" in " ".join(result.output.split())
    )
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()
    gpt = GenerateOptions(
        model="gpt", activation_recompute="selective", recompute_modules=("mla_up_proj",)
    )
    with pytest.raises(UserError, match="has no multi-head latent attention"):
        analytic_memory(gpt)


PLANS: list[dict[str, object]] = [
    {},
    dict(tp=2),
    dict(tp=2, activation_recompute="selective"),
    dict(tp=2, pp=2, activation_recompute="full"),
    dict(tp=2, dtype="fp8", activation_recompute="selective",
         recompute_modules=("core_attn", "layernorm")),
    dict(q_lora_rank=None, tp=2, sp=2, activation_recompute="selective"),
    dict(dp=2, weight_sharded=True, activation_recompute="selective"),
]  # fmt: skip


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: ",".join(f"{k}={p[k]}" for k in p) or "-")
def test_without_the_module_the_tag_changes_no_byte(
    plan: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek's traces are the same bytes whether its up-projections carry the tag or a tag
    nothing reads: the tag alone changes nothing unless mla_up_proj is chosen."""
    o = options(**plan)
    tagged = trace_digest(o, REGISTRY, tmp_path / "tagged")
    monkeypatch.setattr(deepseek, "UP_PROJ", "not_a_recompute_module")
    assert trace_digest(o, REGISTRY, tmp_path / "untagged") == tagged


def test_the_module_adds_recompute_nodes_and_leaves_the_forward_alone() -> None:
    base = build_workload(options(tp=2, activation_recompute="selective"), REGISTRY)
    up = build_workload(up_proj("core_attn", tp=2), REGISTRY)
    for a, b in zip(base.ranks, up.ranks, strict=True):
        before = [(n.name, n.num_ops, n.tensor_size) for n in a.nodes()]
        after = [(n.name, n.num_ops, n.tensor_size) for n in b.nodes()]
        added = {name for name, _, _ in after} - {name for name, _, _ in before}
        assert added and all("/recompute/" in name for name in added)
        assert [x for x in after if x[0] not in added] == before


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks"), [("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)]
)
@pytest.mark.parametrize("modules", [("mla_up_proj",), ("mla_up_proj", "mlp"), ("mlp",)])
def test_recomputed_modules_replay_periodically_as_the_whole(
    schedule: str, pp: int, chunks: int, modules: tuple[str, ...]
) -> None:
    """With DeepSeek's modules recomputed, the time predictor's periodic replay of a workload
    lowered for a few micro-batches gives the iteration of every micro-batch replayed
    (within 1e-9)."""
    from stg.predictors.time import predict_time_options

    registry = load_registry(autoload=False)
    options = GenerateOptions(
        model="deepseek", dmodel=256, dff=128, dense_dff=512, head=4, kvhead=4, dhead=32,
        experts=8, kexperts=2, seq=128, dvocal=512, dense_layers=1, mixed_precision=True,
        causal=True, dp=4, ep=4, ep_layout="fold", pp=pp, virtual_stages=chunks,
        pipeline_schedule=schedule, num_stacks=5 if pp == 4 else 4, batch=4 * 32,
        micro_batch=4, activation_recompute="selective", recompute_modules=modules,
    )  # fmt: skip
    fast = predict_time_options(options, "h100-80g", registry=registry)
    whole = predict_time_options(options, "h100-80g", registry=registry, exact=True)
    assert fast["replay"]["kind"] == "periodic"
    assert fast["replay"]["lowered_micro_batches"] < options.micro_batches
    assert fast["iteration_time_s"] == pytest.approx(whole["iteration_time_s"], rel=1e-9)
