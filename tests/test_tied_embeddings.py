"""Tied input and output embeddings (``--tie_embeddings true``): one weight with pp 1; with
pp > 1 a copy on the last stage and the all-reduce of both gradients over the embedding
group (the first and last stage's ranks), as Megatron-LM keeps them. FLOPs unchanged,
parameters counted once; the traces validate, decode and feed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from consumers import assert_ranks_decode_and_feed
from typer.testing import CliRunner

from stg.cli import app
from stg.core.layout import PIPELINE_ENDS
from stg.core.modelinfo import model_parameters
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, symbol_values
from stg.core.workload import NodeType
from stg.host.registry import load_registry
from stg.predictors.memory import count_parameters, predict_analytic, predict_memory
from stg.trace.reader import read_nodes

REGISTRY = load_registry(autoload=False)
V, H = 256, 64
LLAMA = dict(
    model="llama", dvocal=V, dmodel=H, dff=128, head=4, kvhead=2, seq=64, num_stacks=3,
    batch=4, micro_batch=2, tp=2, dp=2,
)  # fmt: skip
GRAD_BYTES = 2  # bf16 gradients


def workload(**kw: object):  # type: ignore[no-untyped-def]
    return build_workload(GenerateOptions(**{**LLAMA, **kw}), REGISTRY)  # type: ignore[arg-type]


def flops(w, optimizer: bool = False) -> int:  # type: ignore[no-untyped-def]
    """The FLOPs of every rank's forward and backward nodes (``optimizer``: its step's)."""
    return sum(
        n.num_ops for g in w.ranks for n in g.nodes() if (n.name == "optimizer_step") == optimizer
    )


def reduces_wte(node, by_id) -> bool:  # type: ignore[no-untyped-def]
    """A collective of the embedding's or the LM head's weight gradient (alone, or in a bucket
    with other gradients, e.g. the final norm's under sequence parallelism)."""
    grads = (by_id[d] for d in node.data_deps)
    names = [node.name, *(g.name for g in grads if g.type is not NodeType.COMM_COLL)]
    return node.type is NodeType.COMM_COLL and any(
        "grad_wte" in name or "grad_lm_head" in name for name in names
    )


def wte_collectives(graph) -> list:  # type: ignore[no-untyped-def]
    by_id = {n.id: n for n in graph.nodes()}
    return [n for n in graph.nodes() if reduces_wte(n, by_id)]


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_parameters_count_the_matrix_once_and_flops_are_unchanged(model: str) -> None:
    kw = dict(LLAMA, model=model)
    counts = {}
    for tie in (None, True):
        o = GenerateOptions(**{**kw, "tie_embeddings": tie})  # type: ignore[arg-type]
        counts[tie] = model_parameters(REGISTRY.models.get(model), o, symbol_values(o))
    assert counts[None]["parameters"] - counts[True]["parameters"] == V * H
    for pp in (1, 2):
        tied, untied = (
            workload(model=model, pp=pp, tie_embeddings=True),
            workload(model=model, pp=pp),
        )
        assert flops(tied) == flops(untied)
        # Adam's 12 FLOPs per parameter: V·h/t fewer on each of the 4 ranks without a copy
        fewer = 12 * V * H // 2 * 4 if pp == 1 else 0
        assert flops(untied, optimizer=True) - flops(tied, optimizer=True) == fewer


def test_one_weight_without_pipeline_parallelism() -> None:
    """pp 1: the LM head reads the embedding's weight: V·h/t fewer parameters on the rank,
    no gradient reduction of its own (its gradient adds to the embedding's)."""
    untied, tied = workload(), workload(tie_embeddings=True)
    facts = [w.ranks[0].rank_class.facts["parameters"] for w in (untied, tied)]
    assert facts[0] - facts[1] == V * H // 2
    assert sorted(n.name for n in wte_collectives(untied.ranks[0])) == [
        "embedding/grad_all_reduce_dp:token_embedding.grad_wte",
        "head/grad_all_reduce_dp:2_tensors",  # with the final norm's (sequence parallel)
    ]
    assert [n.name for n in wte_collectives(tied.ranks[0])] == [
        "embedding/grad_all_reduce_dp:token_embedding.grad_wte"
    ]
    assert PIPELINE_ENDS not in json.dumps([n.name for n in tied.ranks[0].nodes()])
    # the head's gradient of the weight adds to the embedding's before the one reduction:
    # the all-reduce waits for it in every micro-batch
    nodes = {n.id: n for n in tied.ranks[0].nodes()}
    (reduce,) = wte_collectives(tied.ranks[0])
    waits = sorted(nodes[d].name for d in reduce.data_deps)
    assert waits == [
        f"mb{mb}/{part}" for mb in (0, 1)
        for part in ("embedding/bwd/token_embedding.grad_wte", "head/bwd/logits.grad_wte")
    ]  # fmt: skip


@pytest.mark.parametrize("pp", [2, 3])
def test_pipelined_copy_and_its_embedding_group_all_reduce(tmp_path: Path, pp: int) -> None:
    """pp > 1: the last stage holds a copy (as many parameters as an untied head); after
    each end's data-parallel all-reduce, one
    all-reduce of the gradient (V·h/t elements) over {first-stage rank, last-stage rank}
    with the same tp and dp coordinates. Middle stages have none."""
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out), "--tie_embeddings", "true", "--pp", str(pp)]
    args += [a for k, v in LLAMA.items() for a in (f"--{k}", str(v))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    groups = {int(k): v for k, v in json.loads((out / "workload.json").read_text()).items()}
    world = 4 * pp
    per_stage = world // pp
    for rank in range(world):
        stage = rank // per_stage
        nodes = list(read_nodes(out / f"workload.{rank}.et"))
        ends = [n for n in nodes if n.name.split("/")[-1].startswith("grad_all_reduce_pp_ends")]
        if stage not in (0, pp - 1):
            assert not ends
            continue
        (node,) = ends
        assert node.comm_size == V * H // 2 * GRAD_BYTES
        assert groups[node.comm_group] == [rank % per_stage, rank % per_stage + (pp - 1) * 4]
        # after the data-parallel all-reduce of the same gradient
        by_id = {n.id: n for n in nodes}
        dp = next(n for n in nodes if "grad_all_reduce_dp:" in n.name and reduces_wte(n, by_id))
        assert dp.id in node.data_deps
    tied = workload(pp=pp, tie_embeddings=True)
    untied = workload(pp=pp)
    for a, b in zip(tied.rank_classes, untied.rank_classes, strict=True):
        assert a.facts["parameters"] == b.facts["parameters"]  # the copy is a weight there


@pytest.mark.parametrize("pp", [1, 2])
def test_memory_predictor_counts_what_the_generator_builds(pp: int) -> None:
    o = GenerateOptions(**{**LLAMA, "pp": pp, "tie_embeddings": True})  # type: ignore[arg-type]
    w = build_workload(o, REGISTRY)
    analytic = count_parameters(o)
    for cls in w.rank_classes:
        assert cls.facts["parameters"] == analytic[cls.stage].total, cls.stage
    for a, b in zip(
        predict_memory(w, "h100-80g")["classes"],
        predict_analytic(o, "h100-80g")["classes"],
        strict=True,
    ):
        for key in ("weights", "gradients", "optimizer"):
            assert a[key] == b[key], key


def test_tied_traces_validate_decode_and_feed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out), "--tie_embeddings", "true", "--pp", "3"]
    args += [a for k, v in LLAMA.items() for a in (f"--{k}", str(v))]
    runner = CliRunner()
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    assert_ranks_decode_and_feed(out)
    result = runner.invoke(app, ["feed", str(out), "--json"])
    assert result.exit_code == 0, result.output
    # the time predictor prices the embedding group's all-reduce (a group of two ranks)
    result = runner.invoke(app, ["predict", str(out), "--system", "h100-80g"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(weight_sharded="true"), "tie_embeddings with weight_sharded \\(FSDP\\) is not"),
        (dict(model="bert", kvhead=4), "tie_embeddings=true does not apply to model 'bert'"),
        (dict(model="deepseek", mtp_depth=1, experts=4, kexperts=2, dhead=16),
         "tie_embeddings with mtp_depth is not built"),
    ],
)  # fmt: skip
def test_unmodelled_combinations_are_one_line(tmp_path: Path, kw: dict, message: str) -> None:
    args = ["generate", "--output_dir", str(tmp_path / "out"), "--tie_embeddings", "true"]
    for key, value in {**LLAMA, **kw}.items():
        args += [f"--{key}", str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


def test_llama32_presets_build_their_tied_embedding() -> None:
    """Llama 3.2 1B ties its embeddings (config.json tie_word_embeddings): the preset builds
    one matrix, 1.2358e9 parameters as the published 1.23B counts them."""
    from stg.core.options import resolve_model

    o = GenerateOptions(**resolve_model({"model": "llama3.2-1b"}, REGISTRY)[0])
    assert o.tie_embeddings
    counts = model_parameters(REGISTRY.models.get("llama"), o, symbol_values(o))
    h, v, kv, a, f = 2048, 128256, 8, 32, 8192
    layer = 2 * h * a * 64 + 2 * h * kv * 64 + 3 * h * f + 2 * h
    assert counts["parameters"] == v * h + 16 * layer + h == 1_235_814_400


def test_analytical_predictor_prices_the_embedding_group() -> None:
    """The analytical predictor finds the embedding group's members (first- and last-stage
    rank) and prices its all-reduce: the tied run takes no less than the untied one."""
    from stg.predictors.analytical import group_members, predict_options

    o = GenerateOptions(**{**LLAMA, "pp": 3, "tie_embeddings": True})  # type: ignore[arg-type]
    assert group_members((PIPELINE_ENDS,), o) == [0, 8]
    tied = predict_options(o, "h100-80g", registry=REGISTRY)["iteration_time_s"]
    untied = GenerateOptions(**{**LLAMA, "pp": 3})  # type: ignore[arg-type]
    assert tied >= predict_options(untied, "h100-80g", registry=REGISTRY)["iteration_time_s"]
