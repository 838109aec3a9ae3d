"""`stg predict --profile eager` against one-GPU training steps measured on an H200: dense
models and mixtures of experts (tests/data/eager/h200-eager-steps.jsonl and
h200-eager-moe-steps.jsonl; the same mixtures on an H100, h100-eager-moe-steps.jsonl;
``benchmarks/eager_step.py``; the experts by ``torch._grouped_mm``, routed by
``index_select`` and ``index_add_``).

End-to-end points: no constant comes from them. Besides each step, the table shows its
per-token part, the 8,192-token step less the 1,024-token one: the fixed part of a step is
mostly the optimizer and the weights' casts, the per-token part the layers' kernels, where a
mixture's routing and expert GEMMs are. The guard is on the mixtures' per-token parts: within
10 % on average and 15 % each (the dense models' per-token parts reach 3-6 % on Llama; a
mixture adds kernels the model prices coarsely: its SwiGLU over strided halves of the fused
gate-and-up output, the router's top-k and sort). Before the experts were priced as grouped
GEMMs and the routing as eager PyTorch runs it, Qwen3-30B-A3B's and OLMoE's were 20 % and 26 %
too fast; before the fp32 expert weights' copies to bf16 (and their gradients' back) were
priced, the 1,024-token steps were 11-19 % too fast.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from stg.cli import main

EAGER = Path(__file__).resolve().parent / "data" / "eager"
FILES = {
    "dense": "h200-eager-steps.jsonl",
    "moe": "h200-eager-moe-steps.jsonl",
    "h100-moe": "h100-eager-moe-steps.jsonl",
}


def _rows(kind: str) -> list[dict]:
    lines = (EAGER / FILES[kind]).read_text().splitlines()
    return [row for row in map(json.loads, lines) if not row.get("oom")]


def _predict(capsys: pytest.CaptureFixture[str], options: list[str]) -> float:
    with pytest.raises(SystemExit) as info:
        main(["predict", *options, "--predictor", "time", "--json"])
    out, err = capsys.readouterr()
    assert info.value.code in (0, None), err
    return json.loads(out)["time"]["iteration_time_s"]


def _table(
    capsys: pytest.CaptureFixture[str], kind: str
) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """Lines of the table, each step's error and each model's per-token error."""
    lines = [f"{'model':<18}{'tokens':>7}{'measured':>10}{'predicted':>11}{'error':>8}"]
    steps: dict[tuple[str, int], tuple[float, float]] = {}
    errors = {}
    for row in _rows(kind):
        predicted = _predict(capsys, row["stg_options"])
        key = (row["model"], row["tokens"])
        steps.setdefault(key, (row["step_s"], predicted))  # a repeated step: the first
        error = predicted / row["step_s"] - 1
        errors[f"{row['model']}@{row['tokens']}"] = error
        lines.append(
            f"{row['model']:<18}{row['tokens']:>7}{row['step_s'] * 1e3:>8.1f}ms"
            f"{predicted * 1e3:>9.1f}ms{error:>+8.1%}"
        )
    lines.append("per token (8,192-token step less the 1,024-token one):")
    per_token = {}
    for (model, tokens), (measured, predicted) in steps.items():
        if tokens != 8192 or (model, 1024) not in steps:
            continue
        first_measured, first_predicted = steps[(model, 1024)]
        measured -= first_measured
        predicted -= first_predicted
        per_token[model] = predicted / measured - 1
        lines.append(
            f"{model:<18}{'':>7}{measured * 1e3:>8.1f}ms{predicted * 1e3:>9.1f}ms"
            f"{per_token[model]:>+8.1%}"
        )
    return lines, errors, per_token


@pytest.mark.parametrize(("kind", "gpu"), [("moe", "H200"), ("h100-moe", "H100")])
def test_eager_moe_steps(
    capsys: pytest.CaptureFixture[str],
    report_table: Callable[[str, list[str]], None],
    kind: str,
    gpu: str,
) -> None:
    """The H100's steps were measured after the model was set (nothing was changed to meet
    them): within 6 % each, 2 % on average; per token -7 % to +3 %."""
    lines, errors, per_token = _table(capsys, kind)
    report_table(
        f"Eager one-GPU {gpu} steps, mixtures of experts: stg predict --profile eager", lines
    )
    assert set(per_token) == {"qwen3-30b-a3b-4l", "olmoe-1b-7b-8l", "mixtral-8x7b-2l"}
    assert statistics.mean(abs(e) for e in per_token.values()) <= 0.10, per_token
    assert all(abs(e) <= 0.15 for e in per_token.values()), per_token
    # the whole steps: with the expert weights' casts priced (stg.perf.eager) within 11 %
    # (at 1,024 tokens they were 11-19 % too fast without); the dense models' fixed part is
    # too fast by up to 30 % (h200-eager-steps.jsonl)
    assert all(abs(e) < 0.15 for e in errors.values()), errors


def test_eager_dense_steps_on_the_h200(
    capsys: pytest.CaptureFixture[str], report_table: Callable[[str, list[str]], None]
) -> None:
    lines, errors, per_token = _table(capsys, "dense")
    report_table("Eager one-GPU H200 steps, dense: stg predict --profile eager", lines)
    # as the H100's (test_predict_eager_steps.py): from 4k tokens the GPU bounds the step
    assert all(abs(e) < 0.25 for key, e in errors.items() if not key.endswith("@1024")), errors
    assert all(abs(e) < 0.40 for e in errors.values()), errors
    assert all(abs(e) < 0.30 for e in per_token.values()), per_token
