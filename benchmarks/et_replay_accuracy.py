"""How close the replay-calibrated prediction of a real PyTorch trace comes to its measured step.

    python benchmarks/et_replay_accuracy.py [--rounds 3] [--steps 10] [--out result.json]

On the shipped CPU trace ``tests/data/pytorch_et/mlp_et.json`` (one training step of a
two-layer MLP recorded by ``scripts/record_pytorch_et.py``), on this machine:

- **measured**: the same step (model, batch, data, SGD, one CPU thread), run here under
  torch.profiler (Kineto) for ``--steps`` steps after two warm-up steps; the median of the
  ``ProfilerStep#`` durations. The ExecutionTraceObserver stays off: it serialises every
  operator's arguments while the step runs, which the shipped Kineto file's step includes
  (printed for reference);
- **predicted**: ``stg bench replay`` of the trace's operators (``-w 3 -i 10``), ``stg bench
  calibrate``, ``stg convert --from pytorch``, then ``stg predict --predictor time
  --calibration``: the step as the sum of its measured operators.

**Allocator.** PyTorch's CPU tensors come from glibc's malloc, which serves a large block
(at least its mmap threshold, 128 KiB) with fresh pages that fault on first touch, and raises
that threshold as blocks are freed. A replay loop, which frees and asks for the same sizes
over and over, soon gets its output from the warm heap; the training step, whose many live
sizes are returned between steps, keeps paying the page faults. So both the step and the
replay run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc's default, fixed: ``mallopt``'s
documented effect of setting it is that the dynamic raise stops), under which each large
output faults in both, as in the job; ``--default-allocator`` runs both without it.

Each round measures, then predicts, so both see much the same load on the machine; the
figure is the median over the rounds of ``predicted / measured - 1``, with the range of the
rounds (another job's load during one of a round's two windows shifts it by tens of percent
on a shared machine). This is an end-to-end check of the replay path: nothing of it feeds
back into a constant of stg.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "pytorch_et" / "mlp_et.json"
KINETO = ROOT / "tests" / "data" / "pytorch_et" / "mlp_kineto.json"


def _recorder() -> Any:
    """scripts/record_pytorch_et.py, which built the shipped trace's model."""
    path = ROOT / "scripts" / "record_pytorch_et.py"
    spec = importlib.util.spec_from_file_location("record", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profiler_steps_us(path: Path) -> list[float]:
    """The ``ProfilerStep#`` durations (µs) of a Kineto trace."""
    events = json.loads(path.read_text())["traceEvents"]
    return [
        float(e["dur"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]


def measure_step(steps: int, scratch: Path) -> float:
    """Median Kineto step (s) of the shipped trace's training step, run here."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    record = _recorder()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = record._mlp(record.HIDDEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    data = torch.randn(record.BATCH, record.HIDDEN)
    target = torch.randn(record.BATCH, record.HIDDEN)
    kineto = scratch / "steps_kineto.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=2, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(kineto)),
    ) as prof:
        for _ in range(steps + 2):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(data), target).backward()
            optimizer.step()
            prof.step()
    return statistics.median(profiler_steps_us(kineto)) * 1e-6


def _stg(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stg", *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"stg {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def predict_step(scratch: Path) -> dict[str, Any]:
    """The replay-calibrated prediction of the shipped trace (s) and the table's coverage."""
    results, table = scratch / "ops.jsonl", scratch / "calibration.json"
    _stg("bench", "replay", str(TRACE), "-o", str(results), "-w", "3", "-i", "10")
    _stg("bench", "calibrate", str(results), "-o", str(table))
    _stg("convert", str(TRACE), str(scratch / "trace" / "mlp"), "--to", "v0.0.4", "--force")
    trace = str(scratch / "trace" / "mlp")
    report = json.loads(
        _stg("predict", trace, "--predictor", "time", "--calibration", str(table), "--json")
    )["time"]
    return {"seconds": report["iteration_time_s"], "calibration": report["calibration"]}


FIXED_THRESHOLD = "131072"
"""glibc's default M_MMAP_THRESHOLD (128 KiB, malloc/malloc.c DEFAULT_MMAP_THRESHOLD_MIN),
set explicitly so that it stays there (mallopt(3): setting it disables the dynamic raise)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="also write the result as JSON here")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's mmap threshold dynamic (see the module docstring)",
    )
    args = parser.parse_args()
    if not args.default_allocator and os.environ.get("MALLOC_MMAP_THRESHOLD_") != FIXED_THRESHOLD:
        # glibc reads it at start-up: run again with it, for this process and the stg ones
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": FIXED_THRESHOLD}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="stg-et-accuracy-") as tmp:
        scratch = Path(tmp)
        for index in range(args.rounds):
            measured = measure_step(args.steps, scratch)
            predicted = predict_step(scratch)
            error = predicted["seconds"] / measured - 1
            rounds.append({"measured_s": measured, "predicted_s": predicted["seconds"],
                           "error": error})  # fmt: skip
            print(
                f"round {index}: measured {measured * 1e3:.2f} ms, predicted "
                f"{predicted['seconds'] * 1e3:.2f} ms, error {error:+.1%} "
                f"(measured kernels: {predicted['calibration']['flops_share']['measured']:.1%} "
                "of FLOPs)"
            )
    shipped = profiler_steps_us(KINETO)
    errors = [r["error"] for r in rounds]
    result = {
        "trace": str(TRACE.relative_to(ROOT)),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "dynamic"),
        "rounds": rounds,
        "median_error": statistics.median(errors),
        "error_range": [min(errors), max(errors)],
        "shipped_kineto_step_s": [s * 1e-6 for s in shipped],
    }
    print(
        f"median error {result['median_error']:+.1%} over {len(rounds)} rounds (from "
        f"{min(errors):+.1%} to {max(errors):+.1%}; MALLOC_MMAP_THRESHOLD_ "
        f"{result['malloc_mmap_threshold']}); the shipped Kineto step (recorded with the "
        f"ExecutionTraceObserver on) was {shipped[0] / 1e3:.2f} ms"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
