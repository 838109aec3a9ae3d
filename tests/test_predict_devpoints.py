"""Every development point of ../shared/data/groundtruth-dev.json against its own tolerance.

Each point is spelled as a user spells it: the options of ``stg generate`` / ``stg predict``
(GenerateOptions) and the figure of stg's report that the publication means
(docs/generation.md, "Reproducing published points"):

- ``parameter_count`` (Narayanan et al. Table 1): all parameters of the model, Megatron's
  count (the LM head tied to the word embedding), :func:`total_parameters`.
- ``memory_params_grads_optimizer_per_gpu`` (Korthikanti et al. Figure 1): 18 bytes per
  parameter of the first stage's *transformer layers* on one GPU, embeddings excluded (the
  entries' ``check``). stg's first stage also holds the word and position embeddings, which
  the figure leaves out; a stage that holds neither embedding nor head (a middle stage) is
  exactly the published figure.
- ``activation_memory_relative_to_baseline`` (Korthikanti Figure 7): activations of one
  transformer layer with the technique over those of the TP-only baseline (no sequence
  parallelism, no recompute), with unfused attention and dropout 0.1 as in the paper; on a
  middle stage the ratio of the stages' activations is the same number. The first stage adds
  the embedding's dropout mask, the last the LM head's inputs and logits: not in the figure.
- ``model_state_memory_per_gpu`` (ZeRO's worked example): Ψ = 7.5e9 parameters, 16-bit
  weights and gradients, fp32 Adam (K = 12), ZeRO stage over N_d = dp = 64.
- ``iteration_time`` (Korthikanti Table 5): the generated workload (unfused attention, as in
  2022, and ``--dropout 0.1``: Megatron's GPT runs train with hidden and attention dropout
  0.1) through the time predictor on the a100-80g preset. The table judges them against the
  published 5 %; the test holds them to :data:`ITERATION_TIME_GUARD` until the time model meets
  that. GPT-530B and GPT-1T take about a minute each (millions of nodes); all other points
  are closed forms (milliseconds).

A published figure cannot be checked more finely than it is printed: where half a unit of its
last digit exceeds the entry's tolerance (the parameter counts are printed to 0.1 billion),
that half unit is the pass band. The accuracy table is printed at the end of the run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.memory import (
    RankMemory,
    activation_bytes_per_layer,
    count_parameters,
    predict_analytic,
    stage_memory,
    total_parameters,
)
from stg.predictors.time import predict_time

GROUNDTRUTH = Path(__file__).resolve().parents[1].parent / "shared/data/groundtruth-dev.json"
TABLE_TITLE = "development points (../shared/data/groundtruth-dev.json)"
GIB = 2**30


def all_entries() -> list[dict]:
    if not GROUNDTRUTH.exists():
        return []
    return json.loads(GROUNDTRUTH.read_text())["entries"]


def entries(metric: str) -> list[dict]:
    return [e for e in all_entries() if e["metric"] == metric]


# --- judging and the table -------------------------------------------------------------------


def printed_resolution(value: float) -> float:
    """Half a unit of the last printed digit of a published value (1.7 -> 0.05)."""
    exponent = Decimal(repr(value)).as_tuple().exponent
    return 0.5 * 10.0 ** int(exponent)


def judge(entry: dict, predicted: float) -> tuple[str, str, bool]:
    """(error, tolerance, passed) of ``predicted`` against the entry's own tolerance."""
    value = entry["value"]
    resolution = printed_resolution(value)
    if "tolerance_rel" in entry:
        band = entry["tolerance_rel"] * abs(value)
        error = f"{100 * (predicted / value - 1):+.2f}%"
        tolerance = f"±{100 * entry['tolerance_rel']:g}%"
    elif "tolerance_abs_points" in entry:
        band = entry["tolerance_abs_points"]
        error = f"{predicted - value:+.2f} pt"
        tolerance = f"±{band:g} pt"
    else:
        band = entry["tolerance_abs"]
        error = f"{predicted - value:+.3f}"
        tolerance = f"±{band:g}"
    if resolution > band:
        band = resolution
        tolerance += f" (printed ±{resolution:g})"
    return error, tolerance, abs(predicted - value) <= band * (1 + 1e-9)


HEADER = (
    f"{'id':<52} {'metric':<38} {'published':>12} {'predicted':>12} {'error':>9} "
    f"{'tolerance':<22} pass"
)


def row(entry: dict, predicted: float | None, error: str, tolerance: str, verdict: str) -> str:
    shown = "-" if predicted is None else f"{predicted:.5g}"
    return (
        f"{entry['id']:<52} {entry['metric']:<38} {entry['value']:>12.5g} {shown:>12} "
        f"{error:>9} {tolerance:<22} {verdict}"
    )


def record(report_row: Callable[..., None], entry: dict, predicted: float) -> bool:
    """Judge ``predicted``, put its row in the accuracy table, and say whether it passed."""
    error, tolerance, passed = judge(entry, predicted)
    blanks = [(e["id"], row(e, None, "", "", "not run")) for e in all_entries()]
    line = row(entry, predicted, error, tolerance, "yes" if passed else "NO")
    report_row(TABLE_TITLE, HEADER, blanks, entry["id"], line, passed)
    return passed


def check(report_row: Callable[..., None], entry: dict, predicted: float) -> None:
    error, tolerance, _ = judge(entry, predicted)
    assert record(report_row, entry, predicted), (
        f"{entry['id']}: predicted {predicted:.6g} {entry['unit']}, published {entry['value']}"
        f" ({error}, tolerance {tolerance})"
    )


# --- spellings -------------------------------------------------------------------------------


def narayanan_options(entry: dict) -> GenerateOptions:
    m, p = entry["model"], entry["parallel"]
    return GenerateOptions(
        model="gpt",
        dmodel=m["hidden"],
        dff=m["ffn_hidden"],
        head=m["heads"],
        kvhead=m["heads"],
        num_stacks=m["layers"],
        seq=m["seq_len"],
        dvocal=m["vocab"],
        batch=p["global_batch"],
        dp=p["dp"],
        tp=p["tp"],
        pp=p["pp"],
        tie_embeddings=True,  # Megatron-LM's GPT shares the embedding with the LM head
    )


MEGATRON_GPT_DROPOUT = 0.1
"""The dropout these GPT runs trained with: Megatron-LM's GPT-3-style configurations use
``--hidden-dropout 0.1 --attention-dropout 0.1`` (its defaults), and Korthikanti's
activation formula counts their 1-byte masks (the 34 = 10 + 24 and the 5 of 5·a·s/h)."""


def korthikanti_options(entry: dict, **technique: object) -> GenerateOptions:
    """Korthikanti's configuration (his Table 3) as stg options: fp16 mixed precision, TP-only
    baseline (no sequence parallelism, no recompute), unfused attention and dropout 0.1 (the
    paper's)."""
    m, p = entry["model"], entry["parallel"]
    chunks = p["pipeline_interleaving"]
    values: dict[str, object] = {
        "model": "gpt",
        "dmodel": m["hidden"],
        "dff": m["ffn_hidden"],
        "head": m["heads"],
        "kvhead": m["heads"],
        "num_stacks": m["layers"],
        "seq": m["seq_len"],
        "dvocal": m["vocab"],
        "batch": p["global_batch"],
        "micro_batch": p["micro_batch"] * p["dp"],
        "dp": p["dp"],
        "tp": p["tp"],
        "pp": p["pp"],
        "virtual_stages": chunks,
        "pipeline_schedule": "interleaved" if chunks > 1 else "1f1b",
        "tpsp": False,
        "activation_recompute": "none",
        "mixed_precision": True,
        "dtype": "fp16",
        "attention": "unfused",
        "dropout": MEGATRON_GPT_DROPOUT,
    }
    values.update(technique)
    return GenerateOptions(**values)  # type: ignore[arg-type]


TECHNIQUES: dict[str, dict[str, object]] = {
    "sequence_parallel": {"tpsp": True},
    "selective_recompute": {"activation_recompute": "selective"},
    "sequence_parallel+selective_recompute": {"tpsp": True, "activation_recompute": "selective"},
    "full_recompute": {"activation_recompute": "full"},
}


def middle_stage(report: dict) -> dict | None:
    """A stage of the memory report that holds neither the embedding nor the head."""
    classes = report["classes"]
    return classes[1] if len(classes) > 2 else None


def state_bytes(memory: RankMemory | dict) -> float:
    """Weights, gradients and optimizer states of a RankMemory or a report's class."""
    if isinstance(memory, dict):
        return float(memory["weights"] + memory["gradients"] + memory["optimizer"])
    return memory.weights + memory.gradients + memory.optimizer


# --- the points ------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", entries("parameter_count"), ids=lambda e: e["id"])
def test_parameter_count(entry: dict, report_row: Callable) -> None:
    check(report_row, entry, total_parameters(narayanan_options(entry)) / 1e9)


@pytest.mark.parametrize(
    "entry", entries("memory_params_grads_optimizer_per_gpu"), ids=lambda e: e["id"]
)
def test_korthikanti_model_state(entry: dict, report_row: Callable) -> None:
    o = korthikanti_options(entry)
    first = count_parameters(o)[0]
    layers_only = stage_memory(
        o,
        stage=0,
        parameters=first.layer_parameters,
        layers=first.layers,
        has_embedding=False,
        has_head=False,
    )
    predicted = state_bytes(layers_only)
    middle = middle_stage(predict_analytic(o))
    if middle is not None:  # what `stg predict --json` reports for a middle stage
        assert state_bytes(middle) == pytest.approx(predicted, abs=8)
    check(report_row, entry, predicted / GIB)


@pytest.mark.parametrize(
    "entry", entries("activation_memory_relative_to_baseline"), ids=lambda e: e["id"]
)
def test_korthikanti_activation_ratio(entry: dict, report_row: Callable) -> None:
    baseline = korthikanti_options(entry)
    technique = korthikanti_options(entry, **TECHNIQUES[entry["parallel"]["recompute"]])
    ratio = activation_bytes_per_layer(technique) / activation_bytes_per_layer(baseline)
    middle, middle_base = (middle_stage(predict_analytic(o)) for o in (technique, baseline))
    if middle is not None and middle_base is not None:
        assert middle["activations"] / middle_base["activations"] == pytest.approx(ratio, rel=1e-9)
    check(report_row, entry, 100 * ratio)


@pytest.mark.parametrize("entry", entries("model_state_memory_per_gpu"), ids=lambda e: e["id"])
def test_zero_model_state(entry: dict, report_row: Callable) -> None:
    p = entry["parallel"]
    o = GenerateOptions(
        dp=p["dp"],
        batch=p["dp"],
        zero=p["zero_stage"],
        mixed_precision=True,
        dtype="fp16",
        grad_reduce_dtype="fp16",
    )
    psi = round(entry["model"]["params_billion"] * 1e9)
    memory = stage_memory(o, stage=0, parameters=psi, layers=0, has_embedding=False, has_head=False)
    check(report_row, entry, state_bytes(memory) / 1e9)


# --- iteration time (Korthikanti Table 5) --------------------------------------------------------


def options_of(entry: dict) -> GenerateOptions:
    m, p = entry["model"], entry["parallel"]
    chunks = p["pipeline_interleaving"]
    return GenerateOptions(
        model="gpt",
        dmodel=m["hidden"],
        dff=m["ffn_hidden"],
        head=m["heads"],
        kvhead=m["heads"],
        num_stacks=m["layers"],
        seq=m["seq_len"],
        dvocal=m["vocab"],
        batch=p["global_batch"],
        micro_batch=p["micro_batch"] * p["dp"],
        dp=p["dp"],
        tp=p["tp"],
        pp=p["pp"],
        virtual_stages=chunks,
        pipeline_schedule="interleaved" if chunks > 1 else "1f1b",
        activation_recompute="full",
        tpsp=p.get("sequence_parallel", False),
        mixed_precision=True,
        dtype="fp16",
        attention="unfused",  # Megatron-LM in 2022: no FlashAttention yet
        dropout=MEGATRON_GPT_DROPOUT,
    )


ITERATION_TIME_GUARD = 0.10
"""The band the iteration-time points are held to until the time model meets the published
5 %: the accuracy table judges them against 5 % (and says NO where they miss it); this test
keeps them from drifting further."""


@pytest.mark.slow  # the full replay of up to 280 micro-batches on 35 stages
@pytest.mark.parametrize("entry", entries("iteration_time"), ids=lambda e: e["id"])
def test_table5_iteration_time(entry: dict, report_row: Callable) -> None:
    workload = build_workload(options_of(entry), load_registry(autoload=False))
    predicted = predict_time(workload, "a100-80g")["iteration_time_s"]
    record(report_row, entry, predicted)
    assert predicted == pytest.approx(entry["value"], rel=ITERATION_TIME_GUARD), (
        f"{entry['id']}: predicted {predicted:.3f} s, published {entry['value']} s"
    )


def test_every_entry_is_covered() -> None:
    if not GROUNDTRUTH.exists():
        pytest.skip(f"{GROUNDTRUTH} not present")
    covered = {
        "parameter_count",
        "memory_params_grads_optimizer_per_gpu",
        "activation_memory_relative_to_baseline",
        "model_state_memory_per_gpu",
        "iteration_time",
    }
    assert {e["metric"] for e in all_entries()} <= covered
