"""The encoder templates (bert, bert-qa, roberta): bidirectional attention as the kernels and
the predictor see it, FLOPs summed from the written files (decoded by mlc-chakra) against
closed forms, and the CLI's generate, validate, predict and plan precision on them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner
from workload_checks import check_runs_to_completion, op_root

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType
from stg.host.registry import load_registry

runner = CliRunner()
REGISTRY = load_registry(autoload=False)
B, S, H, F, A, L, V = 8, 32, 64, 256, 4, 2, 512
SMALL = ["--dvocal", V, "--dmodel", H, "--dff", F, "--head", A, "--kvhead", A, "--seq", S]
SMALL += ["--num_stacks", L, "--batch", B]
SMALL = [str(x) for x in SMALL]
ENCODER_GEMMS = {"q", "k", "v", "attn_out", "fc1", "fc2"}


def official_flops(directory: Path) -> Counter[str]:
    """FLOPs of every COMP node of every rank file, by forward op, as mlc-chakra reads them."""
    flops: Counter[str] = Counter()
    for path in sorted(directory.glob("workload.*.et")):
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            while True:
                node = et_def_pb2.Node()
                if not protolib.decodeMessage(f, node):
                    break
                if node.type == et_def_pb2.COMP_NODE:
                    attrs = {a.name: a for a in node.attr}
                    flops[op_root(node.name)] += attrs["num_ops"].int64_val
    return flops


@pytest.mark.parametrize("model", ["bert", "roberta"])
def test_written_flops_match_the_encoder_closed_forms(tmp_path: Path, model: str) -> None:
    """Forward + two backward matmuls (3 passes) of every GEMM; the full s-by-s attention
    (bidirectional: twice a causal decoder's); the masked-LM head's dense and decoder."""
    out = tmp_path / "out"
    args = ["generate", "--model", model, *SMALL, "--dp", "2", "--attention", "unfused"]
    result = runner.invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0
    flops = official_flops(out)
    assert sum(flops[k] for k in ENCODER_GEMMS) == 6 * B * S * L * (4 * H * H + 2 * H * F)
    assert flops["scores"] + flops["context"] == 12 * B * S * S * L * H
    assert flops["mlm_dense"] == 6 * B * S * H * H
    assert flops["logits"] == 6 * B * S * H * V
    # the segment embedding is BERT's alone: a lookup (forward) and its scatter-add
    assert (flops["segment_embedding"] > 0) == (model == "bert")


def test_bert_base_flops_per_token_are_twice_the_parameters_plus_attention() -> None:
    """Forward FLOPs per token of BERT-base: 2 per weight of its matmuls plus 4·s·h per layer
    for the scores and context, within the memory-bound remainder (norms, GELU, biases)."""
    o = GenerateOptions(model="bert", dvocal=30522, dmodel=768, dff=3072, head=12, kvhead=12,
                        seq=512, num_stacks=12, batch=1, attention="unfused")  # fmt: skip
    w = build_workload(o, REGISTRY)
    forward = sum(
        n.num_ops for n in w.ranks[0].nodes() if n.type is NodeType.COMP and "/bwd/" not in n.name
        and n.name != "optimizer_step"
    )  # fmt: skip
    matmul_weights = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 768 * 768 + 30522 * 768
    closed = 512 * (2 * matmul_weights + 12 * 4 * 512 * 768)
    assert closed <= forward < closed * 1.02


def attention_kernels(model: str, **kw) -> list[tuple[int, ...]]:
    o = GenerateOptions(model=model, dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                        num_stacks=L, batch=B, **kw)  # fmt: skip
    w = build_workload(o, REGISTRY)
    return [n.attrs["attention"] for n in w.ranks[0].nodes() if "attention" in n.attrs]


def test_encoder_attention_is_bidirectional_for_kernels_and_predictor() -> None:
    """The fused kernel's shape says causal 0 and counts the whole score matrix: twice the
    matmul FLOPs of the same layer masked causally (GPT with --causal true)."""
    bert = attention_kernels("bert")
    gpt = attention_kernels("gpt", causal=True)
    assert bert and all(shape[5] == 0 for shape in bert)
    assert gpt and all(shape[5] == 1 for shape in gpt)
    assert [s[:5] for s in bert] == [s[:5] for s in gpt]

    def core(model: str, **kw) -> int:
        o = GenerateOptions(model=model, dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                            num_stacks=L, batch=B, **kw)  # fmt: skip
        nodes = build_workload(o, REGISTRY).ranks[0].nodes()
        return sum(n.num_ops for n in nodes if n.name.endswith("core_attention"))

    softmax = 5 * B * A * S * S  # per layer, not halved by the mask
    assert core("bert") == L * (4 * B * S * S * H + softmax)
    assert core("gpt", causal=True) == L * (2 * B * S * S * H + softmax)


def test_causal_encoder_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["generate", "--model", "bert", *SMALL, "--causal", "true", "--output_dir", str(out)]
    )
    assert result.exit_code == 2
    assert "bidirectional encoder: causal=true is not allowed; allowed: causal=false" in (
        result.output
    )
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("model", ["bert", "bert-qa", "roberta", "roberta-mc"])
def test_encoders_build_on_every_kind_of_parallelism(model: str) -> None:
    for kw in ({"dp": 2, "tp": 2}, {"pp": 2, "micro_batch": 4}, {"sp": 2, "zero": 1}):
        o = GenerateOptions(model=model, dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                            num_stacks=L, batch=B, **kw)  # fmt: skip
        assert check_runs_to_completion(build_workload(o, REGISTRY)) > 0


def test_bert_qa_head_is_the_squad_span_head() -> None:
    """Two logits per token (start, end): 6·B·s·h·2 FLOPs over the three passes."""
    o = GenerateOptions(model="bert-qa", dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                        num_stacks=L, batch=B)  # fmt: skip
    w = build_workload(o, REGISTRY)
    flops = Counter()
    for n in w.ranks[0].nodes():
        if n.type is NodeType.COMP:
            flops[op_root(n.name)] += n.num_ops
    assert flops["qa_outputs"] == 6 * B * S * H * 2
    assert "logits" not in flops and "mlm_dense" not in flops


def test_bert_base_predicts_and_plans_with_data_parallelism(tmp_path: Path) -> None:
    """Time and memory predicted for bert-base over dp 2; the precision planner names the
    encoder's matmuls."""
    base = ["--model", "bert-base", "--dp", "2", "--batch", "64", "--num_stacks", "2"]
    result = runner.invoke(app, ["predict", *base, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    text = json.dumps(report)
    assert "iteration" in text and "peak" in text
    plan = tmp_path / "plan.json"
    args = ["plan", "precision", *base, "--system", "h100-80g", "--dtypes", "bf16,int8"]
    result = runner.invoke(app, [*args, "--out", str(plan), "--json"])
    assert result.exit_code == 0, result.output
    planned, _ = json.JSONDecoder().raw_decode(result.output)  # "plan written to" follows
    candidates = {op for op, _ in planned["candidates"]}
    # every matmul of the encoder and its masked-LM head, by the names the model gives them
    assert candidates == ENCODER_GEMMS | {"mlm_dense", "logits"}


def test_bert_base_counts_as_the_released_checkpoint() -> None:
    """bert-base-uncased's encoder with its pooler holds 109,482,240 parameters (Hugging
    Face's BertModel); the template has no pooler (h² + h) and has the masked-LM head's
    dense layer and LayerNorm (h² + 3h) and decoder bias (V); its decoder weight, tied to
    the word embedding in the released model, is left out of the comparison."""
    from stg.core.modelinfo import model_parameters
    from stg.core.options import resolve_model
    from stg.core.pipeline import symbol_values

    values, _ = resolve_model({"model": "bert-base"}, REGISTRY)
    o = GenerateOptions(**values)
    counts = model_parameters(REGISTRY.models.get(o.model), o, symbol_values(o))
    h, vocab = 768, 30522
    released = 109_482_240 - (h * h + h) + (h * h + 3 * h) + vocab
    assert counts["parameters"] - vocab * h == released == 109_514_298


def test_bert_base_squad_counts_as_hugging_faces_question_answering_model() -> None:
    """BertForQuestionAnswering on bert-base-uncased: 108,893,186 parameters (the encoder
    without pooler, and the span head's 768·2 + 2)."""
    from stg.core.modelinfo import model_parameters
    from stg.core.options import resolve_model
    from stg.core.pipeline import symbol_values

    values, _ = resolve_model({"model": "bert-base-squad"}, REGISTRY)
    o = GenerateOptions(**values)
    # the position table holds seq rows: 384 here, 512 in the checkpoint
    counts = model_parameters(REGISTRY.models.get(o.model), o, symbol_values(o))
    assert counts["parameters"] + (512 - 384) * 768 == 108_893_186


def test_span_head_memory_comes_from_the_graph() -> None:
    """The memory predictor's LM-head closed form (norm and LM-head inputs, fp32 logits over
    the vocabulary) is for heads with vocabulary logits; a span head's saved tensors are the
    graph's: the encoder's output and the two logits per token."""
    from stg.predictors.memory import predict_memory

    def build(model: str):
        o = GenerateOptions(model=model, dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                            num_stacks=L, batch=B)  # fmt: skip
        return build_workload(o, REGISTRY)

    mlm, qa = build("bert"), build("bert-qa")
    assert "head_activation_bytes" not in mlm.rank_classes[0].facts
    head = qa.rank_classes[0].facts["head_activation_bytes"]
    # bf16: the head's input (read by the weight gradient), the logits before and after
    # their bias (read by the bias's gradient and by the loss)
    assert head == 2 * B * S * H + 2 * (2 * B * S * 2)
    lm_head = 2 * 2 * B * S * H + 4 * S * B * V
    (m,) = predict_memory(mlm)["classes"]
    (q,) = predict_memory(qa)["classes"]
    assert m["activations"] - q["activations"] == lm_head - head


def test_roberta_mc_head_scores_each_choice_from_the_first_token() -> None:
    """The pooler (h x h) and the score (h x 1) run on one token per sequence: 6·B·h² and
    6·B·h FLOPs over the three passes, whatever the sequence length."""
    o = GenerateOptions(model="roberta-mc", dvocal=V, dmodel=H, dff=F, head=A, kvhead=A, seq=S,
                        num_stacks=L, batch=B)  # fmt: skip
    flops: Counter[str] = Counter()
    for n in build_workload(o, REGISTRY).ranks[0].nodes():
        if n.type is NodeType.COMP:
            flops[op_root(n.name)] += n.num_ops
    assert flops["pooler"] == 6 * B * H * H
    assert flops["classifier"] == 6 * B * H
    assert "logits" not in flops and "segment_embedding" not in flops


def test_serving_phases_are_refused_for_encoders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for phase in ("prefill", "decode"):
        args = ["generate", "--model", "bert", *SMALL, "--phase", phase]
        result = runner.invoke(app, [*args, "--output_dir", str(out)])
        assert result.exit_code == 2, result.output
        assert f"not served token by token: phase={phase} is not allowed" in result.output
        assert not out.exists()
