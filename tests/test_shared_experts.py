"""Shared experts and dense layers beside routed experts: the ``moe`` template's
``--shared_experts`` and ``--dense_layers``/``--dense_dff`` (GLM-4.5) and the hybrid stack's
``E`` (with shared experts) and ``-`` (of ``dense_dff``) letters (Llama 4, Qwen3-Next).
FLOPs and bytes from the written traces against closed forms, parameters and memory from
the memory predictor against the graph; the traces validate, decode and feed."""

from __future__ import annotations

from pathlib import Path

import pytest
from consumers import assert_ranks_decode_and_feed
from typer.testing import CliRunner

from stg.cli import app
from stg.core.modelinfo import model_parameters
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload, symbol_values
from stg.host.registry import load_registry
from stg.predictors.memory import count_parameters, predict_analytic, predict_memory
from stg.trace.reader import read_nodes

REGISTRY = load_registry(autoload=False)
MOE = dict(
    model="moe", dvocal=256, dmodel=64, dff=32, head=4, kvhead=2, seq=64, num_stacks=3,
    batch=2, experts=4, kexperts=2, shared_experts=2, dense_layers=1, dense_dff=96,
)  # fmt: skip
HYBRID = dict(
    model="hybrid", dvocal=256, dmodel=64, dff=32, dense_dff=96, head=4, kvhead=2, seq=64,
    num_stacks=4, batch=2, experts=4, kexperts=2, shared_experts=1, layer_pattern="*-*E",
)  # fmt: skip
BF16 = 2
SWIGLU = 5


def generate(tmp_path: Path, **kw: object) -> Path:
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out)]
    for key, value in kw.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def forward_ops(out: Path, layer: int) -> dict[str, object]:
    prefix = f"mb0/layer{layer}/fwd/"
    return {
        n.name.removeprefix(prefix): n
        for n in read_nodes(out / "workload.0.et")
        if n.name.startswith(prefix)
    }


def test_moe_dense_layers_and_shared_experts_match_closed_forms(tmp_path: Path) -> None:
    """Layer 0 is dense (a SwiGLU of dense_dff); layers 1-2 add n shared SwiGLU experts of
    dff to the routed ones: 2·T·h·n·f FLOPs per projection, 5·T·n·f for the product."""
    out = generate(tmp_path, **MOE)
    tokens, h, f, n, dense = 2 * 64, 64, 32, 2, 96
    layer0 = forward_ops(out, 0)
    assert "router" not in layer0 and "shared_gate" not in layer0
    for op in ("gate", "up", "down"):
        assert layer0[op].num_ops == 2 * tokens * h * dense
    assert layer0["swiglu"].num_ops == SWIGLU * tokens * dense
    for layer in (1, 2):
        ops = forward_ops(out, layer)
        for op in ("shared_gate", "shared_up", "shared_down"):
            assert ops[op].num_ops == 2 * tokens * h * n * f
        assert ops["shared_swiglu"].num_ops == SWIGLU * tokens * n * f
        assert ops["shared_sum"].num_ops == tokens * h
        # bytes: the input, the n experts' weight and the output, 16-bit
        read_write = tokens * h + n * h * f + tokens * n * f
        assert ops["shared_gate"].tensor_size == BF16 * read_write
        assert "expert_gate" in ops  # the routed experts are still there
    backward = {
        n.name.split("/")[-1]: n.num_ops
        for n in read_nodes(out / "workload.0.et")
        if n.name.startswith("mb0/layer1/bwd/") and "shared_" in n.name
    }
    # every shared projection's backward: its input's and its weight's gradients
    assert sum(v for k, v in backward.items() if not k.startswith("shared_swiglu")) == 2 * 3 * (
        2 * tokens * h * n * f
    )


def test_moe_stack_kinds_and_parameters() -> None:
    o = GenerateOptions(**MOE)
    workload = build_workload(o, REGISTRY)
    assert workload.ranks[0].rank_class.facts["layer_kinds"] == {"dense": 1, "block": 2}
    counts = model_parameters(REGISTRY.models.get("moe"), o, symbol_values(o))
    h, f, v, a, kv, d = 64, 32, 256, 4, 2, 16
    attention = 2 * h * a * d + 2 * h * kv * d
    dense = attention + 3 * h * 96 + 2 * h
    moe = attention + h * 4 + 2 * 3 * h * f + 2 * h  # router, 2 shared experts, norms
    ends = 2 * v * h + h
    assert counts["parameters"] == ends + dense + 2 * (moe + 4 * 3 * h * f)
    assert counts["active_parameters"] == ends + dense + 2 * (moe + 2 * 3 * h * f)


def test_local_global_moe_stack_with_dense_layers() -> None:
    """With --full_attention_every the first dense_layers layers keep their attention kind."""
    o = GenerateOptions(**{**MOE, "num_stacks": 4, "dense_layers": 2, "causal": True,
                           "attention_chunk": 16, "full_attention_every": 2})  # fmt: skip
    kinds = build_workload(o, REGISTRY).ranks[0].rank_class.facts["layer_kinds"]
    assert kinds == {"dense": 1, "dense_global": 1, "local": 1, "global": 1}


@pytest.mark.parametrize(
    ("name", "plan"),
    [
        ("glm-4.5", dict(tp=2, ep=2, pp=2)),
        ("glm-4.5-air", dict(ep=2, pp=2)),
        (None, dict(tp=2, ep=2, pp=2, **MOE)),
    ],
)
def test_memory_predictor_counts_what_the_generator_builds(name: str | None, plan: dict) -> None:
    """The predictor's closed forms for the moe template's shared experts and dense layers
    give every stage's parameters and memory as the graph does."""
    replicas = plan.get("ep", 1)
    given = {"num_stacks": 4, "seq": 160, "batch": 4 * replicas, "micro_batch": replicas,
             **plan, **({"model": name} if name else {})}  # fmt: skip
    o = GenerateOptions(**resolve_model(given, REGISTRY)[0])
    workload = build_workload(o, REGISTRY)
    analytic = count_parameters(o)
    for cls in workload.rank_classes:
        assert cls.facts["parameters"] == analytic[cls.stage].total, cls.stage
        assert cls.facts["layer_kinds"] == dict(analytic[cls.stage].kinds)
    by_file = predict_memory(workload, "h100-80g")["classes"]
    by_options = predict_analytic(o, "h100-80g")["classes"]
    for a, b in zip(by_file, by_options, strict=True):
        for key in ("weights", "gradients", "optimizer", "activations", "buffers"):
            assert a[key] == b[key], key


def test_hybrid_moe_letters_take_shared_experts_and_dense_dff(tmp_path: Path) -> None:
    """``-`` is a SwiGLU of dense_dff, ``E`` routed experts of dff plus the shared one
    (Llama 4 Maverick's pattern, in small)."""
    out = generate(tmp_path, **HYBRID)
    tokens, h, f, dense = 2 * 64, 64, 32, 96
    mlp = forward_ops(out, 1)
    assert mlp["gate"].num_ops == 2 * tokens * h * dense
    assert mlp["swiglu"].num_ops == SWIGLU * tokens * dense
    moe = forward_ops(out, 3)
    assert moe["shared_gate"].num_ops == 2 * tokens * h * f
    assert moe["expert_gate"].num_ops == 2 * 4 * 64 * h * f  # 4 experts of 64 slots each
    o = GenerateOptions(**HYBRID)
    counts = model_parameters(REGISTRY.models.get("hybrid"), o, symbol_values(o))
    attention = 2 * h * 4 * 16 + 2 * h * 2 * 16 + h
    routed = 4 * 3 * h * f
    moe_layer = h * 4 + 3 * h * f + h  # router, one shared expert, the norm
    ends = 2 * 256 * h + h
    fixed = ends + 2 * attention + (3 * h * dense + h) + moe_layer
    assert counts["parameters"] == fixed + routed
    assert counts["active_parameters"] == fixed + 2 * 3 * h * f


@pytest.mark.parametrize(
    "kw",
    [
        dict(MOE, tp=2, pp=2, ep=2, batch=4, micro_batch=2),
        dict(HYBRID, tp=2, pp=2),
    ],
)
def test_traces_validate_decode_and_feed(tmp_path: Path, kw: dict) -> None:
    out = generate(tmp_path, **kw)
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    ranks = sorted(out.glob("workload.*.et"))
    assert len(ranks) == kw.get("tp", 1) * kw.get("pp", 1) * kw.get("ep", 1)
    assert_ranks_decode_and_feed(out)
    result = runner.invoke(app, ["feed", str(out), "--json"])
    assert result.exit_code == 0, result.output


def test_unset_options_keep_the_stack_of_one_kind() -> None:
    o = GenerateOptions(**{**MOE, "shared_experts": None, "dense_layers": None})
    workload = build_workload(o, REGISTRY)
    assert workload.ranks[0].rank_class.facts["layer_kinds"] == {"block": 3}
    names = {n.name.split("/")[-1] for n in workload.ranks[0].nodes()}
    assert not any(name.startswith("shared_") for name in names)
