"""The memory predictor against Korthikanti's and ZeRO's closed forms and published points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.core.layout import Layout
from stg.core.workload import RankClass, RankGraph, Workload
from stg.errors import UserError
from stg.predictors.memory import (
    activation_bytes_per_layer,
    analytic_memory,
    count_parameters,
    in_flight_layers,
    in_flight_micro_batches,
    model_state_bytes,
    predict_memory,
    stage_memory,
    total_parameters,
)

GROUNDTRUTH = Path(__file__).resolve().parents[1].parent / "shared/data/groundtruth-dev.json"


def entries(metric: str) -> list[dict]:
    if not GROUNDTRUTH.exists():
        pytest.skip(f"{GROUNDTRUTH} not present")
    data = json.loads(GROUNDTRUTH.read_text())
    return [e for e in data["entries"] if e["metric"] == metric]


def gpt(**kw: object) -> dict:
    """GPT option dict (F = 4h, a = kv) with the given overrides; unfused attention and
    dropout 0.1 (hidden and attention), as Korthikanti et al. (2022) assume."""
    h = kw.pop("dmodel", 6144)
    options = {
        "model": "gpt",
        "dmodel": h,
        "dff": 4 * h,
        "head": 64,
        "kvhead": 64,
        "num_stacks": 48,
        "seq": 2048,
        "dvocal": 51200,
        "batch": 4,
        "micro_batch": 4,
        "dtype": "bf16",
        "tpsp": False,
        "attention": "unfused",
        "dropout": 0.1,
    }
    options.update(kw)
    if "head" in kw and "kvhead" not in kw:
        options["kvhead"] = kw["head"]
    return options


def model_options(entry: dict, **kw: object) -> dict:
    m, p = entry["model"], entry["parallel"]
    return gpt(
        dmodel=m["hidden"],
        dff=m["ffn_hidden"],
        head=m["heads"],
        num_stacks=m["layers"],
        seq=m["seq_len"],
        dvocal=m["vocab"],
        tp=p.get("tp", 1),
        pp=p.get("pp", 1),
        dp=p.get("dp", 1),
        batch=p.get("global_batch", 1),
        micro_batch=p.get("micro_batch"),
        virtual_stages=p.get("pipeline_interleaving", 1),
        **{"tie_embeddings": True, **kw},  # Megatron-LM's GPT shares the embedding and head
    )


# --- activations: closed forms ------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_activation_closed_forms(t: int, b: int) -> None:
    s, h, a = 2048, 6144, 64
    base = gpt(tp=t, batch=b, micro_batch=b)
    sbh = s * b * h
    cases = {
        ("none", False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True): sbh / t * (34 + 5 * a * s / h),
        ("selective", False): sbh * (10 + 24 / t),
        ("selective", True): 34 * sbh / t,
        ("full", False): 2 * sbh,
        ("full", True): 2 * sbh / t,
    }
    for (recompute, tpsp), expected in cases.items():
        got = activation_bytes_per_layer({**base, "activation_recompute": recompute, "tpsp": tpsp})
        assert got == pytest.approx(expected, rel=1e-12), (recompute, tpsp)
    if t == 1:
        assert activation_bytes_per_layer(base) == pytest.approx(sbh * (34 + 5 * a * s / h))


def test_activation_b_is_per_replica_and_cp_divides_sequence() -> None:
    one = activation_bytes_per_layer(gpt(batch=8, micro_batch=8, dp=2))
    assert one == pytest.approx(activation_bytes_per_layer(gpt(batch=4, micro_batch=4)))
    full = activation_bytes_per_layer(gpt(activation_recompute="full", sp=4))
    assert full == pytest.approx(2 * 2048 / 4 * 4 * 6144)


def test_fp32_activations_double_the_16bit_tensors() -> None:
    full16 = activation_bytes_per_layer(gpt(activation_recompute="full"))
    full32 = activation_bytes_per_layer(gpt(activation_recompute="full", dtype="fp32"))
    assert full32 == 2 * full16


def test_llama_activations_count_gqa_and_swiglu() -> None:
    o = gpt(model="llama", dmodel=4096, dff=11008, head=32, kvhead=8, tp=2, batch=1, micro_batch=1)
    s, b, h, f, a, kv, t = 2048, 1, 4096, 11008, 32, 8, 2
    expected = 2 * s * b * (4 * h + (2 * h + 2 * h * kv / a + 3 * f) / t + a * s / t)
    assert activation_bytes_per_layer(o) == pytest.approx(expected)


@pytest.mark.parametrize("seq", [1024, 8192])
def test_fused_attention_keeps_no_s_squared_terms(seq: int) -> None:
    # one GPU, Llama 3 8B shapes: fused attention (the default) keeps Q, K, V, the output and
    # 4 bytes of softmax statistics per query row and head; unfused adds the score matrix
    o = gpt(model="llama", dmodel=4096, dff=14336, head=32, kvhead=8, seq=seq, batch=1,
            micro_batch=1, attention="fused")
    s, b, h, f, a, kv = seq, 1, 4096, 14336, 32, 8
    linear = 2 * s * b * (4 * h + 2 * h + 2 * h * kv / a + 3 * f)
    fused = activation_bytes_per_layer(o)
    assert fused == pytest.approx(linear + 4 * a * s * b)
    unfused = activation_bytes_per_layer({**o, "attention": "unfused"})
    assert unfused - fused == pytest.approx(2 * a * s * s * b - 4 * a * s * b)


# --- pipeline: in-flight micro-batches ----------------------------------------------------------


def test_in_flight_layers_per_schedule() -> None:
    p, m, layers = 4, 8, 5
    assert [in_flight_layers(i, layers, p, m, "1f1b") for i in range(p)] == [20, 15, 10, 5]
    assert in_flight_layers(0, layers, p, 2, "1f1b") == 10  # fewer micro-batches than stages
    assert in_flight_layers(3, layers, p, m, "gpipe") == 40
    v = 3
    first = in_flight_layers(0, 6, p, m, "1f1b", chunks=v)
    assert first == pytest.approx(6 * p * (1 + (p - 1) / (p * v)))


def _held_at_peak(order: list[tuple[str, int, int]], chunks: int) -> tuple[int, int]:
    """(most chunk-micro-batches held, most of them in the first chunk while that many are
    held), replaying one stage's schedule order."""
    held = [0] * chunks
    best = (0, 0)
    for direction, _, chunk in order:
        held[chunk] += 1 if direction == "F" else -1
        best = max(best, (sum(held), held[0]))
    return best


@pytest.mark.parametrize("p", [1, 2, 4, 7])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 5])
def test_interleaved_in_flight_counts_replay_the_schedule(p: int, v: int, groups: int) -> None:
    from stg.core.schedules import interleaved

    m = p * groups
    for stage in range(p):
        chunks_held, first_chunk = _held_at_peak(interleaved(stage, p, m, v), v)
        assert in_flight_layers(stage, v, p, m, "interleaved", chunks=v) == chunks_held
        assert in_flight_micro_batches(stage, p, m, "interleaved", chunks=v) == first_chunk


def test_interleaved_embedding_mask_counts_the_first_chunk() -> None:
    # GPT-530B of Korthikanti: p = 35, v = 3, m = 280: chunk 0 of stage 0 holds 70
    # micro-batches at the peak (the 1F1B count p = 35 would halve the embedding's mask)
    assert in_flight_micro_batches(0, 35, 280, "interleaved", chunks=3) == 70
    o = gpt(pp=4, num_stacks=8, batch=16, micro_batch=1, tp=2, tpsp=False,
            pipeline_schedule="interleaved", virtual_stages=2)
    first = analytic_memory(o)[0]
    per_layer = activation_bytes_per_layer(o)
    sbh = 2048 * 1 * 6144
    held_chunks = in_flight_layers(0, 2, 4, 16, "interleaved", chunks=2)
    mask = in_flight_micro_batches(0, 4, 16, "interleaved", chunks=2) * sbh
    assert first.activations == pytest.approx(per_layer * held_chunks + mask)


def test_first_stage_holds_per_layer_times_total_layers() -> None:
    o = gpt(pp=4, num_stacks=48, batch=32, micro_batch=4, tpsp=True, tp=8)
    stages = analytic_memory(o)
    per_layer = activation_bytes_per_layer(o)
    sbh = 2048 * 4 * 6144
    embedding_mask = 4 * sbh / 8  # 1-byte dropout mask after the embedding, 4 in flight
    assert stages[0].activations == pytest.approx(per_layer * 48 + embedding_mask)
    assert stages[1].activations == pytest.approx(per_layer * 12 * 3)


# --- model state ----------------------------------------------------------------------------


def test_megatron_18_bytes_and_zero_stages() -> None:
    psi, nd, k = 1000.0, 8, 12
    base = model_state_bytes(psi)
    assert base.weights + base.gradients + base.optimizer == 18 * psi
    totals = []
    for stage in range(4):
        st = model_state_bytes(psi, grad_bytes=2, zero=stage, shard=nd)
        totals.append(st.weights + st.gradients + st.optimizer)
    assert totals == [
        pytest.approx((2 + 2 + k) * psi),
        pytest.approx(4 * psi + k * psi / nd),
        pytest.approx(2 * psi + (2 + k) * psi / nd),
        pytest.approx((2 + 2 + k) * psi / nd),
    ]


def test_published_zero_points() -> None:
    for entry in entries("model_state_memory_per_gpu"):
        psi = entry["model"]["params_billion"] * 1e9
        st = model_state_bytes(
            psi, grad_bytes=2, zero=entry["parallel"]["zero_stage"], shard=entry["parallel"]["dp"]
        )
        got = (st.weights + st.gradients + st.optimizer) / 1e9
        assert got == pytest.approx(entry["value"], abs=entry["tolerance_abs"]), entry["id"]


def test_zero_through_options_uses_dp_times_sp() -> None:
    o = gpt(dp=4, sp=2, zero=2, mixed_precision=True, grad_reduce_dtype="bf16", batch=8,
            micro_batch=8)
    mem = stage_memory(o, stage=0, parameters=800, layers=1, has_embedding=False, has_head=False)
    assert (mem.weights, mem.gradients, mem.optimizer) == (1600, 200, 1200)
    fsdp = stage_memory(
        {**o, "weight_sharded": True, "zero": 0},
        stage=0, parameters=800, layers=1, has_embedding=False, has_head=False,
    )
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (200, 200, 1200)


def test_published_megatron_model_state_points() -> None:
    for entry in entries("memory_params_grads_optimizer_per_gpu"):
        o = model_options(entry, mixed_precision=True)
        layers_only = count_parameters(o)[0].layer_parameters  # "embeddings excluded"
        mem = stage_memory(
            o, stage=1, parameters=layers_only, layers=0, has_embedding=False, has_head=False
        )
        got = (mem.weights + mem.gradients + mem.optimizer) / 2**30
        assert got == pytest.approx(entry["value"], rel=entry["tolerance_rel"]), entry["id"]


def test_published_activation_ratios() -> None:
    techniques = {
        "sequence_parallel": {"tpsp": True},
        "selective_recompute": {"activation_recompute": "selective"},
        "sequence_parallel+selective_recompute": {
            "tpsp": True,
            "activation_recompute": "selective",
        },
        "full_recompute": {"activation_recompute": "full"},
    }
    checked = 0
    for entry in entries("activation_memory_relative_to_baseline"):
        base = model_options(entry)
        ratio = activation_bytes_per_layer(
            {**base, **techniques[entry["parallel"]["recompute"]]}
        ) / activation_bytes_per_layer(base)
        assert 100 * ratio == pytest.approx(entry["value"], abs=entry["tolerance_abs_points"])
        checked += 1
    assert checked == 16


# --- parameters --------------------------------------------------------------------------------


def test_gpt_parameters_match_narayanan_formula() -> None:
    for entry in entries("parameter_count"):
        o = model_options(entry)
        m = entry["model"]
        h, layers, v, s = m["hidden"], m["layers"], m["vocab"], m["seq_len"]
        formula = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
        assert total_parameters(o) == pytest.approx(formula + 2 * h, rel=1e-12)  # + final norm
        assert total_parameters(o) / 1e9 == pytest.approx(entry["value"], abs=0.05), entry["id"]


def test_llama2_7b_parameters() -> None:
    o = gpt(model="llama", dmodel=4096, dff=11008, head=32, kvhead=32, num_stacks=32,
            dvocal=32000)
    assert total_parameters(o) == 6_738_415_616


def test_parameters_are_split_over_tp_and_pp() -> None:
    o = gpt(tp=4, pp=4, num_stacks=10)
    stages = count_parameters(o)
    assert [s.layers for s in stages] == [3, 3, 2, 2]
    assert stages[0].embedding_parameters == 51200 * 6144 // 4 + 2048 * 6144
    assert stages[3].head_parameters == 51200 * 6144 // 4 + 2 * 6144
    one_layer = 12 * 6144**2 + 13 * 6144
    per_rank = stages[0].layer_parameters / 3
    assert one_layer / 4 < per_rank < one_layer / 4 + 6 * 6144  # norms and some biases replicated


# --- the predictor on a workload -----------------------------------------------------------------


def test_predict_memory_reads_rank_class_facts() -> None:
    o = gpt(tp=2, pp=2, batch=8, micro_batch=2, mixed_precision=True)
    layout = Layout({"tp": 2, "pp": 2})
    classes = [
        RankClass(
            index=i,
            stage=i,
            nodes=(),
            facts={"parameters": 1_000_000 * (i + 1), "layers": 24, "has_embedding": i == 0,
                   "has_head": i == 1, "micro_batches": 4, "weight_dtype": "bf16",
                   "grad_dtype": "fp32"},
        )
        for i in range(2)
    ]
    ranks = tuple(RankGraph(r, classes[layout.stage(r)], layout) for r in range(4))
    workload = Workload(ranks, {}, layout, {"options": o})
    report = predict_memory(workload, "a100-80g")
    assert [c["ranks"] for c in report["classes"]] == [2, 2]
    c0, c1 = report["classes"]
    assert c0["weights"] + c0["gradients"] + c0["optimizer"] == 18_000_000
    assert c1["weights"] + c1["gradients"] + c1["optimizer"] == 36_000_000
    expected = stage_memory(o, stage=0, parameters=1_000_000, layers=24, has_embedding=True,
                            has_head=False)
    assert c0["activations"] == round(expected.activations)
    assert report["peak_bytes"] == max(c0["peak"], c1["peak"])
    assert report["fits"] is (report["peak_bytes"] <= 80 * 2**30)
    json.dumps(report)


def test_predict_memory_needs_options() -> None:
    layout = Layout({"dp": 1})
    workload = Workload((RankGraph(0, RankClass(0, 0, ()), layout),), {}, layout, {})
    with pytest.raises(UserError, match="generation options"):
        predict_memory(workload)


def test_bad_recompute_is_a_user_error() -> None:
    with pytest.raises(UserError, match="allowed: none, selective, selective_op, full"):
        activation_bytes_per_layer(gpt(activation_recompute="sometimes"))


@pytest.mark.parametrize(
    ("model", "pp", "tp"), [("gpt", 2, 2), ("gpt", 3, 1), ("llama", 1, 2), ("llama", 3, 2)]
)
def test_analytic_parameters_match_generated_facts(model: str, pp: int, tp: int) -> None:
    from stg.core.options import GenerateOptions
    from stg.core.pipeline import build_workload
    from stg.host.registry import load_registry

    o = GenerateOptions(
        model=model, dmodel=256, dff=1024 if model == "gpt" else 704, head=8,
        kvhead=8 if model == "gpt" else 2, num_stacks=5, seq=128, dvocal=1000, batch=4,
        micro_batch=2, dp=2, tp=tp, pp=pp,
    )
    workload = build_workload(o, load_registry(autoload=False))
    facts = [(c.facts["parameters"], c.facts["layers"]) for c in workload.rank_classes]
    assert facts == [(s.total, s.layers) for s in count_parameters(o)]
