"""Published measurements of 2025-26 on the new presets, predicted: Blackwell training runs
(tests/data/runs/blackwell_runs.json: Megatron-Bridge on DGX B200, GB200 and GB300), AMD Instinct
training runs (tests/data/runs/amd_training_runs.json: Primus on MI325X), MI300X serving
latencies (tests/data/serving/mi300x_latency.json: AMD's vLLM results, OCI's Llama 3.1 405B FP8)
and B200 serving times per output token and to the first token
(tests/data/serving/blackwell_serving.json: SGLang's cookbook runs of DeepSeek-R1 and GLM-4.6).

The presets' peaks are the data sheets'; their sustained clocks, streaming and attention rates
come from published kernel-level measurements (tests/data/kernels/blackwell-published.jsonl,
cdna-published.jsonl), and nothing here is fitted to these points. Each point must predict and
stay within its ``guard``, a band that catches gross regressions, not an accuracy claim; the
tables with each error and the mean |error| go to the run's summary (the targets: 10 %
training, 15 % serving).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cluster_runs import DEFAULT_GUARD, HEADER, run_options, table_row

from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.explore.serve_profiles import engine_profile
from stg.host.registry import Registry, load_registry
from stg.predictors.serving import predict_serving
from stg.predictors.time import predict_time_options

DATA = Path(__file__).parent / "data"
BLACKWELL_DATA = json.loads((DATA / "runs" / "blackwell_runs.json").read_text())
BLACKWELL: list[dict] = BLACKWELL_DATA["entries"]
SLOW: list[dict] = BLACKWELL_DATA["slow_entries"]
"""Blackwell rows spelled but not predicted here: minutes each today (the file's field notes)."""
AMD: list[dict] = json.loads((DATA / "runs" / "amd_training_runs.json").read_text())["entries"]
TRAINING = [*BLACKWELL, *AMD]
SERVING: list[dict] = json.loads((DATA / "serving" / "mi300x_latency.json").read_text())["entries"]
BLACKWELL_SERVING: list[dict] = json.loads(
    (DATA / "serving" / "blackwell_serving.json").read_text()
)["entries"]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(autoload=False)


def summary(errors: dict[str, float]) -> str:
    magnitudes = [abs(e) for e in errors.values()]
    return (
        f"{len(errors)} points: mean |error| {100 * statistics.mean(magnitudes):.1f}%, "
        f"median |error| {100 * statistics.median(magnitudes):.1f}%, "
        f"mean signed {100 * statistics.mean(errors.values()):+.1f}%"
    )


STG_RECIPE = {"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
"""stg's ``low_precision_recipe`` for each fp8 recipe a row's source names (``fp8_recipe``)."""


def test_points_are_well_formed(registry: Registry) -> None:
    ids = [e["id"] for e in (*TRAINING, *SLOW, *SERVING, *BLACKWELL_SERVING)]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for entry in (*TRAINING, *SLOW):
        options = run_options(entry, registry)
        assert options.world_size == entry["gpus"], entry["id"]
        if options.dtype == "fp8":  # the source's recipe, named per row, is the one stg runs
            assert options.low_precision_recipe == STG_RECIPE[entry["fp8_recipe"]], entry["id"]
    for entry in SERVING:
        assert serving_options(entry, registry, "decode").world_size == entry["gpus"]
        engine_profile(entry.get("engine_profile", "none"))  # a known profile
    for entry in BLACKWELL_SERVING:
        assert serving_options(entry, registry, "decode").world_size == entry["gpus"]
        assert entry["metric"] in ("tpot_s", "ttft_s"), entry["id"]
        assert entry["metric"] == "tpot_s" or entry["options"]["batch"] == 1, entry["id"]
    for entry in (*TRAINING, *SLOW, *SERVING, *BLACKWELL_SERVING):
        assert entry["source"].startswith("https://") and entry["table"], entry["id"]
    left_out = " ".join(n["what"] + n["why"] for n in BLACKWELL_DATA["not_reproducible"])
    for entry in SLOW:  # each is listed by id among the rows left out, with its time
        assert entry["id"] in left_out, entry["id"]


def training_table(
    entries: list[dict], registry: Registry, target_note: str
) -> tuple[list[str], list[str]]:
    """Predict each training run as ``stg predict`` does: the table's lines (with the mean
    |error| and ``target_note``) and the lines of the runs outside their guard."""
    lines, errors, problems = [HEADER], {}, []
    predicted: dict[tuple[str, GenerateOptions], float] = {}
    """per system and plan: its iteration time (releases that ran one plan predict once)"""
    for entry in entries:
        options = run_options(entry, registry)
        key = (entry["system"], options)
        if key not in predicted:
            report = predict_time_options(
                options, entry["system"], registry=registry, kernels=list(registry.kernels)
            )
            predicted[key] = report["iteration_time_s"]
        line, errors[entry["id"]], passed = table_row(entry, options, predicted[key])
        lines.append(line)
        if not passed:
            problems.append(line)
    lines.append(f"{summary(errors)} ({target_note})")
    return lines, problems


@pytest.mark.slow  # about a minute: 405B plans on 128 and 256 GPUs
def test_blackwell_training_runs(registry: Registry, report_table: Callable[..., None]) -> None:
    lines, problems = training_table(
        BLACKWELL, registry, "target 10%; kernel rates from published measurements"
    )
    report_table("Blackwell training runs 2025 (tests/data/runs/blackwell_runs.json)", lines)
    assert not problems, "\n".join(problems)


def test_amd_training_runs(registry: Registry, report_table: Callable[..., None]) -> None:
    lines, problems = training_table(
        AMD, registry, "target 10%; MI325X clock from AMD's measured GEMMs"
    )
    report_table("AMD Instinct training runs 2026 (tests/data/runs/amd_training_runs.json)", lines)
    assert not problems, "\n".join(problems)


def test_amd_plans_fit_their_gpus(registry: Registry) -> None:
    """The AMD runs ran: each plan's peak per the memory predictor is within the preset's HBM."""
    memory = registry.predictors.get("memory")
    for entry in AMD:
        report = memory.predict_options(
            run_options(entry, registry),
            entry["system"],
            kernels=list(registry.kernels),
            registry=registry,
        )
        assert report["fits"], f"{entry['id']}: peak {report['peak_bytes'] / 2**30:.1f} GiB"


def serving_options(entry: dict, registry: Registry, phase: str) -> GenerateOptions:
    """The entry's prefill (``batch`` prompts of ``input`` tokens) or its mean decode step
    (context ``input + output/2``), with its precision plan."""
    values = {"model": entry["model"], **entry["options"], "seq": entry["input"]}
    if phase == "decode":
        values["context"] = entry["input"] + entry["output"] // 2
    values, _ = resolve_model(values, registry)
    plan = tuple(sorted(entry["plan"].items()))
    return GenerateOptions(**values, phase=phase, precision=plan)


def engine_idle_s(entry: dict) -> float:
    """The engine's GPU idle time over the run: one scheduler call per step (the prefill and
    ``output - 1`` decode steps), each costing the entry's engine profile's
    ``scheduler_overhead_s``."""
    profile = engine_profile(entry.get("engine_profile", "none"))
    return entry["output"] * profile.scheduler_overhead_s


def predicted_latency(entry: dict, registry: Registry) -> float:
    """TTFT + (output - 1) x TPOT + the engine's idle time (the data file's field notes)."""
    reports = {}
    for phase in ("prefill", "decode"):
        workload = build_workload(serving_options(entry, registry, phase), registry)
        reports[phase] = predict_serving(workload, entry["system"])
    tpot = reports["decode"]["time_per_output_token_s"]
    return reports["prefill"]["ttft_s"] + (entry["output"] - 1) * tpot + engine_idle_s(entry)


def test_engine_idle_time_follows_the_profile() -> None:
    """OCI's 2024 points ran vLLM's V0 engine: 128 steps of 4 ms idle each (vllm-0.6); AMD's
    vLLM 0.10.2 points name no profile and add nothing."""
    oci = next(e for e in SERVING if e["id"] == "oci-llama3.1-405b-fp8-tp8-bs1")
    amd = next(e for e in SERVING if e["id"] == "amd-vllm0102-llama3.1-70b-fp8-tp8-bs1")
    assert engine_idle_s(oci) == pytest.approx(128 * 4e-3)
    assert engine_idle_s(amd) == 0.0


@pytest.mark.slow  # about half a minute: 70B and 405B serving steps
def test_mi300x_serving_latencies(registry: Registry, report_table: Callable[..., None]) -> None:
    lines = [f"{'id':<40} {'published s':>11} {'predicted s':>11} {'error':>7} {'guard':>5} pass"]
    errors, problems = {}, []
    for entry in SERVING:
        predicted = predicted_latency(entry, registry)
        error = predicted / entry["value"] - 1
        guard = entry.get("guard", DEFAULT_GUARD)
        passed = abs(error) <= guard
        errors[entry["id"]] = error
        line = (
            f"{entry['id']:<40} {entry['value']:>11.3f} {predicted:>11.3f} "
            f"{100 * error:>+6.1f}% {100 * guard:>4.0f}% {'yes' if passed else 'NO'}"
        )
        lines.append(line)
        if not passed:
            problems.append(line)
    lines.append(
        summary(errors) + " (target 15%; MI300X clock from AMD's measured GEMMs; "
        "engine idle time from the row's engine profile)"
    )
    report_table("MI300X serving latencies (tests/data/serving/mi300x_latency.json)", lines)
    assert not problems, "\n".join(problems)


def predicted_serving_metric(entry: dict, registry: Registry) -> float:
    """A Blackwell serving point's metric as the data file's field notes define it: the mean
    TPOT at max-concurrency C, a decode step of C sequences at context input + output/2 plus
    the other C - 1 requests' prefills spread over output - 1 steps; or the TTFT, the prefill
    of one prompt."""
    one = {**entry, "options": {**entry["options"], "batch": 1}}
    prefill = build_workload(serving_options(one, registry, "prefill"), registry)
    ttft = predict_serving(prefill, entry["system"])["ttft_s"]
    if entry["metric"] == "ttft_s":
        return ttft
    decode = build_workload(serving_options(entry, registry, "decode"), registry)
    step = predict_serving(decode, entry["system"])["time_per_output_token_s"]
    concurrency = entry["options"]["batch"]
    return step + (concurrency - 1) * ttft / (entry["output"] - 1)


@pytest.mark.slow  # about half a minute: DeepSeek-V3 and GLM-4.5 steps
def test_blackwell_serving_points(registry: Registry, report_table: Callable[..., None]) -> None:
    head = f"{'id':<66} {'metric':>6} {'published':>9} {'predicted':>9} {'error':>7} {'guard':>5}"
    lines, problems = [head], []
    errors: dict[str, dict[str, float]] = {"tpot_s": {}, "ttft_s": {}}
    for entry in BLACKWELL_SERVING:
        predicted = predicted_serving_metric(entry, registry)
        error = predicted / entry["value"] - 1
        guard = entry.get("guard", DEFAULT_GUARD)
        errors[entry["metric"]][entry["id"]] = error
        line = (
            f"{entry['id']:<66} {entry['metric'][:4]:>6} {1e3 * entry['value']:>7.2f}ms "
            f"{1e3 * predicted:>7.2f}ms {100 * error:>+6.1f}% {100 * guard:>4.0f}%"
        )
        lines.append(line)
        if abs(error) > guard:
            problems.append(line)
    lines.append("TPOT: " + summary(errors["tpot_s"]) + " (target 15%)")
    lines.append(
        "TTFT: " + summary(errors["ttft_s"]) + " (the measured TTFT holds engine and client "
        "time stg does not model)"
    )
    report_table("B200 serving (tests/data/serving/blackwell_serving.json)", lines)
    assert not problems, "\n".join(problems)
