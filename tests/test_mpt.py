"""MPT: ALiBi on the attention scores (no position embedding), no biases, LayerNorms without
bias, tied embeddings. FLOPs and bytes from the written traces against closed forms, the
parameters against the released configurations; the traces validate, decode and feed."""

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
from stg.predictors.memory import count_parameters
from stg.trace.reader import read_nodes

REGISTRY = load_registry(autoload=False)
MPT = dict(
    model="mpt", dvocal=256, dmodel=64, dff=256, head=4, kvhead=4, seq=64, num_stacks=2,
    batch=2, causal=True, tie_embeddings=True,
)  # fmt: skip
B, S, H, A, D, F, V = 2, 64, 64, 4, 16, 256, 256
BF16 = 2


def generate(tmp_path: Path, **kw: object) -> Path:
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out)]
    for key, value in {**MPT, **kw}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def layer_ops(out: Path, phase: str = "fwd") -> dict[str, object]:
    prefix = f"mb0/layer0/{phase}/"
    return {
        n.name.removeprefix(prefix): n
        for n in read_nodes(out / "workload.0.et")
        if n.name.startswith(prefix)
    }


def test_alibi_runs_in_the_fused_attention_kernel(tmp_path: Path) -> None:
    """Fused: the kernel's FLOPs are the causal Q·Kᵀ and P·V (half the s² pairs), the
    softmax (5) and the ALiBi bias (2) per score; its bytes are Q, K, V, the output and the
    softmax statistics: the bias moves nothing."""
    ops = layer_ops(generate(tmp_path))
    core = ops["core_attention"]
    scores = B * A * S * S
    assert core.num_ops == 2 * 2 * scores * D // 2 + (5 + 2) * scores
    tokens = B * S * A * D
    assert core.tensor_size == BF16 * 4 * tokens + 4 * B * A * S
    assert not any(name.startswith("alibi") for name in ops)


def test_alibi_unfused_is_a_kernel_over_the_scores(tmp_path: Path) -> None:
    ops = layer_ops(generate(tmp_path, attention="unfused"))
    scores = B * A * S * S
    assert ops["alibi"].num_ops == 2 * scores
    assert ops["alibi"].tensor_size == BF16 * 2 * scores  # the scores read, then written
    backward = layer_ops(generate(tmp_path / "b", attention="unfused"), "bwd")
    # the gradient passes the add unchanged: a free node, one op per element it writes (the
    # floor of a zero-cost node, which ASTRA-sim's roofline needs: docs/generation.md)
    assert backward["alibi.grad_scores"].num_ops == scores


def test_no_biases_and_no_position_embedding() -> None:
    o = GenerateOptions(**MPT)  # type: ignore[arg-type]
    counts = model_parameters(REGISTRY.models.get("mpt"), o, symbol_values(o))
    layer = 4 * H * A * D + 2 * H * F + 2 * H  # Q, K, V, O; up, down; two LayerNorm weights
    assert counts["parameters"] == V * H + 2 * layer + H  # tied: the embedding once
    untied = GenerateOptions(**{**MPT, "tie_embeddings": None})  # type: ignore[arg-type]
    assert (
        model_parameters(REGISTRY.models.get("mpt"), untied, symbol_values(untied))["parameters"]
        == counts["parameters"] + V * H
    )


@pytest.mark.parametrize(("name", "expected"), [("mpt-7b", 6_649_286_656),
                                                ("mpt-30b", 29_957_200_896)])  # fmt: skip
def test_presets_count_the_released_configurations(name: str, expected: int) -> None:
    o = GenerateOptions(**resolve_model({"model": name}, REGISTRY)[0])
    counts = model_parameters(REGISTRY.models.get("mpt"), o, symbol_values(o))
    h, f, layers = o.dmodel, o.dff, o.num_stacks
    assert f == 4 * h  # expansion_ratio 4
    assert counts["parameters"] == 50432 * h + layers * (12 * h * h + 2 * h) + h == expected


def test_pipelined_mpt_keeps_a_copy_and_reduces_it_over_the_embedding_group() -> None:
    o = GenerateOptions(**{**MPT, "pp": 2, "dp": 2, "batch": 4})  # type: ignore[arg-type]
    workload = build_workload(o, REGISTRY)
    last = workload.rank_classes[-1]
    assert last.facts["has_head"]
    names = [n.name for n in last.nodes]
    assert any("grad_all_reduce_pp_ends" in name for name in names)
    first = workload.rank_classes[0]
    assert any("grad_all_reduce_pp_ends" in n.name for n in first.nodes)
    # the copy: the last stage holds V·h more than its layers and final norm
    assert last.facts["parameters"] == (4 * H * A * D + 2 * H * F + 2 * H) + H + V * H
    analytic = count_parameters(o)
    assert analytic[0].embedding_parameters == V * H  # no position embedding
    for cls in workload.rank_classes:
        assert cls.facts["parameters"] == analytic[cls.stage].total


def test_mpt_traces_validate_decode_and_feed(tmp_path: Path) -> None:
    out = generate(tmp_path, tp=2, pp=2)
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    assert_ranks_decode_and_feed(out)
    result = runner.invoke(app, ["feed", str(out), "--json"])
    assert result.exit_code == 0, result.output


def test_mpt_refuses_dropout(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", "mpt-7b", "--num_stacks", "2", "--dropout", "0.1",
              "--output_dir", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: mpt trains without dropout: dropout=0.1 is not allowed; allowed: 0"
    ]
