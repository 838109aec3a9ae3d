"""The ``serving`` predictor: time to first token, time per output token and throughput of a
serving workload (``stg generate --phase prefill|decode|mixed``), and its memory.

Time comes from the ``time`` predictor's replay of the workload (the same kernel models:
GEMMs by shape with their memory roofline, fused attention with the bytes of the KV cache it
reads as a floor, alpha-beta collectives). The breakdown prices every compute kernel of one
rank with the same models and files it by what bounds it: a GEMM whose operand bytes take
longer at HBM bandwidth than its FLOPs at the sustained tensor-core rate is reading weights;
an attention kernel bound the same way is reading the KV cache; a kernel bound by its FLOPs is
compute; norms, activations and other elementwise kernels are elementwise. Communication is
the rest of the step: exposed collectives, sends and the waits they cause.

The memory-bandwidth bound of a step is the bytes it must read divided by the HBM bandwidth
of the data sheet: every weight once per micro-batch and the KV cache once
(``weights + KV``), per pipeline stage; a decode step cannot be faster. Of a mixture's routed
experts only those the step's tokens reach count (the workload's ``weight_read_bytes``: serving
engines run no expert that receives no token).

Memory per rank: the weights, the KV cache at its largest (after the last step), and the
activations of the largest op of the largest step; the largest batch (at the given lengths)
and the longest context (at the given batch) that fit follow from the KV cache per sequence
and per token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import stg
from stg.api import (
    Calibration,
    GenerateOptions,
    KernelTable,
    NodeType,
    Predictor,
    System,
    Workload,
    kernel_table,
    load_system,
    normalize_dtype,
)
from stg.errors import UserError
from stg.predictors.time import compute_time, predict_time

PHASES = ("prefill", "decode", "mixed")


def _options(workload: Workload) -> dict[str, Any]:
    options = dict(workload.metadata.get("options") or {}) if workload.metadata else {}
    phase = options.get("phase", "training")
    if phase not in PHASES:
        raise UserError(
            f"the serving predictor needs a serving workload (--phase {'|'.join(PHASES)}); "
            f"this one is phase={phase}"
        )
    return options


def _sequences(options: dict[str, Any]) -> int:
    """Sequences served at once (all replicas): decoding ones, plus prefilling ones (mixed)."""
    return int(options["batch"]) + int(options.get("prefill_batch") or 0)


def _bandwidth_bound(workload: Workload, system: System) -> dict[str, Any]:
    """Seconds a step needs just to read weights and KV cache at HBM bandwidth, per step."""
    classes = workload.rank_classes
    steps = len(classes[0].facts["kv_cache_bytes_per_step"])
    per_step = []
    for step in range(steps):
        stage_s = []
        one_pass_s = 0.0
        for rc in classes:
            m = int(rc.facts["micro_batches"])
            weights = int(rc.facts.get("weight_read_bytes", rc.facts["weight_bytes"]))
            kv = int(rc.facts["kv_cache_bytes_per_step"][step])
            stage_s.append((m * weights + kv) / system.hbm_bandwidth)
            one_pass_s += (weights + kv / m) / system.hbm_bandwidth
        # stages work on different micro-batches at once, but one micro-batch passes them all
        per_step.append(max(max(stage_s), one_pass_s))
    first = classes[0].facts
    return {
        "bound_s_per_step": per_step,
        "weight_bytes_per_rank": int(first["weight_bytes"]),
        "kv_bytes_per_rank_per_step": [int(v) for v in first["kv_cache_bytes_per_step"]],
        "hbm_bandwidth": system.hbm_bandwidth,
    }


def _is_bytes_bound(node: Any, system: System, dtype: str) -> bool:
    """Whether a kernel's bytes take longer at HBM bandwidth than its FLOPs at the rate its
    kernel model uses (the sustained tensor-core rate)."""
    gpu = system.gpu
    bytes_s = node.tensor_size / gpu.hbm_bandwidth
    computed = normalize_dtype(node.dtype or dtype)
    if computed not in gpu.peak_flops:  # a weight format run weight-only (no fp4 cores)
        computed = normalize_dtype(dtype)
    flops_s = node.num_ops / gpu.rate(computed)
    return bytes_s >= flops_s


def breakdown(
    workload: Workload,
    system: System,
    step_time: float,
    *,
    kernels: KernelTable | None = None,
    calibration: Calibration | None = None,
) -> dict[str, float]:
    """One rank's step split into weights-read, KV-read, compute, elementwise and
    communication (see the module docstring); seconds per run (all steps)."""
    options = dict(workload.metadata.get("options") or {})
    dtype = str(options.get("dtype") or "bf16")
    profile = str(options.get("profile") or "megatron")
    best: dict[str, float] | None = None
    for rc in workload.rank_classes:
        split = {"weights_read_s": 0.0, "kv_read_s": 0.0, "compute_s": 0.0, "elementwise_s": 0.0}
        for node in rc.nodes:
            if node.type is not NodeType.COMP:
                continue
            seconds = compute_time(node, system, dtype, kernels, profile, calibration)
            attrs = node.attrs or {}
            if "attention" in attrs:
                bound = _is_bytes_bound(node, system, dtype)
                split["kv_read_s" if bound else "compute_s"] += seconds
            elif "gemm" in attrs:
                bound = _is_bytes_bound(node, system, dtype)
                split["weights_read_s" if bound else "compute_s"] += seconds
            else:
                split["elementwise_s"] += seconds
        if best is None or sum(split.values()) > sum(best.values()):
            best = split
    assert best is not None
    best["communication_s"] = max(0.0, step_time - sum(best.values()))
    return best


def predict_serving(
    workload: Workload,
    system: System | str = "a100-80g",
    *,
    kernels: KernelTable | Iterable[Any] | None = None,
    calibration: Calibration | None = None,
    explain: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """Serving figures of a prefill, decode or mixed workload (see the module docstring)."""
    options = _options(workload)
    system = load_system(system)
    table = kernel_table(kernels, system.name)
    timed = predict_time(workload, system, kernels=table, calibration=calibration)
    total = float(timed["iteration_time_s"])
    phase = options["phase"]
    batch = int(options["batch"])
    steps = int(options.get("steps") or 1)
    bound = _bandwidth_bound(workload, system)
    report: dict[str, Any] = {
        "predictor": "serving",
        "system": system.name,
        "phase": phase,
        "time_s": total,
        "batch": batch,
        "memory_bandwidth_bound_s": sum(bound["bound_s_per_step"]) / len(bound["bound_s_per_step"]),
        "bandwidth": bound,
        "mfu": timed["mfu"],
    }
    if phase == "prefill":
        seq = int(options["seq"])
        report["ttft_s"] = total
        report["prefill_tokens_per_s"] = batch * seq / total if total else 0.0
        report["tokens_per_s"] = report["prefill_tokens_per_s"]
    elif phase == "decode":
        tpot = total / steps
        report["steps"] = steps
        report["context"] = int(options.get("context") or options["seq"])
        report["time_per_output_token_s"] = tpot
        report["tokens_per_s"] = batch / tpot if tpot else 0.0
        report["tokens_per_s_per_sequence"] = 1 / tpot if tpot else 0.0
    else:
        chunk = int(options.get("chunk") or options["seq"])
        prefill_batch = int(options["prefill_batch"])
        report["iteration_s"] = total
        report["time_per_output_token_s"] = total
        report["prefill_tokens"] = prefill_batch * chunk
        report["tokens_per_s"] = (prefill_batch * chunk + batch) / total if total else 0.0
        report["output_tokens_per_s"] = batch / total if total else 0.0
    if explain:
        split = breakdown(workload, system, total, kernels=table, calibration=calibration)
        report["explain"] = {"per_step_s": {k: v / steps for k, v in split.items()}}
    return report


# ---------------------------------------------------------------------------------------------
# Memory


def serving_memory(workload: Workload, system: System | str = "a100-80g") -> dict[str, Any]:
    """Memory per rank of a serving workload: weights, KV cache, activations; the largest
    batch and the longest context that fit (the ``memory`` predictor's report for the
    serving phases)."""
    options = _options(workload)
    system = load_system(system)
    capacity = system.hbm_capacity
    layout = {k: options[k] for k in ("dp", "ep", "ep_layout", "etp") if k in options}
    replicas = GenerateOptions(**layout).data_replicas  # dp·ep, or dp where ep folds
    sequences = _sequences(options) // replicas  # per rank (tp, pp and sp ranks share them)
    phase = options["phase"]
    if phase == "prefill":
        longest = int(options["seq"])
    elif phase == "decode":
        longest = int(options.get("context") or options["seq"]) + int(options.get("steps") or 1)
    else:
        longest = max(
            int(options.get("context") or options["seq"]) + 1,
            int(options.get("prefill_context") or 0) + int(options.get("chunk") or options["seq"]),
        )
    classes = []
    max_batch = max_context = None
    for rc in workload.rank_classes:
        f = rc.facts
        weights = int(f["weight_bytes"])
        kv = int(f["kv_cache_bytes"])
        activations = int(f["activation_bytes"])
        peak = weights + kv + activations
        ranks = [g.rank for g in workload.ranks if g.rank_class.index == rc.index]
        free = capacity - weights
        per_sequence = (kv + activations) / sequences
        batch_fit = int(free // per_sequence) * replicas if per_sequence > 0 else 0
        if phase == "prefill":  # a longer prompt holds more cache and more activations
            per_token = (kv + activations) / longest
            context_fit = int(free // per_token) if per_token else 0
        else:  # a decode step's activations do not grow with the context
            per_token = sequences * kv / (sequences * longest) if kv else 0.0
            context_fit = int((free - activations) // per_token) if per_token else 0
        max_batch = batch_fit if max_batch is None else min(max_batch, batch_fit)
        max_context = context_fit if max_context is None else min(max_context, context_fit)
        classes.append(
            {
                "class": rc.index,
                "stage": rc.stage,
                "ranks": len(ranks),
                "first_rank": min(ranks),
                "parameters": int(f["parameters"]),
                "weights": weights,
                "gradients": 0,
                "optimizer": 0,
                "kv_cache": kv,
                "activations": activations,
                "buffers": 0,
                "peak": peak,
                "fits": peak <= capacity,
            }
        )
    peak = max(c["peak"] for c in classes)
    return {
        "predictor": "memory",
        "system": system.name,
        "phase": phase,
        "capacity_bytes": capacity,
        "peak_bytes": peak,
        "fits": peak <= capacity,
        "max_batch": max_batch,
        "max_context": max_context,
        "classes": classes,
    }


@stg.hookimpl
def stg_register_predictors(register: Any) -> None:
    register(
        Predictor(
            name="serving",
            predict=predict_serving,
            description="serving phases: time to first token, time per output token, "
            "tokens/s, the memory-bandwidth bound; --explain splits weights-read, KV-read, "
            "compute, communication",
        )
    )


__all__ = ["breakdown", "predict_serving", "serving_memory"]
