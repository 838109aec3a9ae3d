"""Measure what a host synchronisation costs on a GPU, and the host time of the launches after it.

    python benchmarks/measure_host_sync.py --out DIR [--prefix h200]

Writes ``PREFIX-host-sync.jsonl`` (plain JSON lines; the first line describes the machine),
kernel-level measurements for docs/notes/moe-host-sync.md:

- ``sync_gap``: the GPU idle time of one synchronisation as Megatron-Core's alltoall token
  dispatcher makes it (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: a side
  stream waits on the compute stream, copies the per-expert counts to the host with
  ``non_blocking=True``, records an event; the host waits on that event, then launches the
  next kernel): from the end of the last queued kernel to the start of the next one, with the
  host relaunching at once.
- ``launch_host``: host time per call of an op while the GPU is busy (its queue is kept
  non-empty by a long ``torch.cuda._sleep``, so no call waits for the GPU): a 1 MiB bf16 add,
  the same add on tensors that require gradients (autograd recording), and an fp8
  (e4m3, tensorwise scales, bf16 out) ``torch._scaled_mm`` of one Qwen3-30B-A3B expert's
  fc1 at 2,048 rows ([2048, 2048] x [2048, 1536]).
- ``post_sync_sequence``: a stand-in for what the host launches after the sync, one grouped
  linear of 16 local experts under fp8 current scaling as eager PyTorch ops (per expert:
  amax, scale, cast to fp8, ``torch._scaled_mm``), timed on the GPU from the sync to its end
  (``synced``) and, the same sequence queued behind a long kernel so that the host is ahead
  (``queued``): their difference is the time the sync exposes for this sequence.

Medians over ``REPEATS`` after warm-ups. Needs PyTorch and a CUDA GPU with fp8 (Hopper).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda

REPEATS = 20
LAUNCHES = 100
SLEEP_CYCLES = 60_000_000  # ~30 ms at Hopper's ~2 GHz: longer than LAUNCHES host calls
EXPERTS = 16  # Qwen3-30B-A3B's 128 experts over ep 8
ROWS, DMODEL, FC1 = 2048, 2048, 1536  # rows per local expert at 4096 tokens x top-8 / 16


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def sync_gap_us(torch: Any) -> list[float]:
    """GPU idle microseconds across one dispatcher-style sync, REPEATS times."""
    side = torch.cuda.Stream()
    counts = torch.randint(0, 4096, (128,), device="cuda", dtype=torch.int64)
    small = torch.zeros(1024, device="cuda")
    gaps = []
    for i in range(REPEATS + 3):
        torch.cuda._sleep(SLEEP_CYCLES // 10)
        drained = torch.cuda.Event(enable_timing=True)
        drained.record()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            counts.to("cpu", non_blocking=True)
            copied = side.record_event()
        copied.synchronize()
        resumed = torch.cuda.Event(enable_timing=True)
        resumed.record()
        small.add_(1)
        torch.cuda.synchronize()
        if i >= 3:
            gaps.append(drained.elapsed_time(resumed) * 1e3)
    return gaps


def host_us_per_call(torch: Any, call: Any) -> list[float]:
    """Host microseconds per call of ``call`` with the GPU busy, REPEATS batches of LAUNCHES."""
    per_call = []
    for i in range(REPEATS + 3):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(LAUNCHES):
            call()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        if i >= 3:
            per_call.append(elapsed / LAUNCHES * 1e6)
    return per_call


def expert_operands(torch: Any) -> tuple[list[Any], list[Any], Any]:
    """Per expert: bf16 rows and an fp8 weight (column-major, as cuBLASLt takes B); a scale."""
    rows = [torch.randn(ROWS, DMODEL, device="cuda", dtype=torch.bfloat16) for _ in range(EXPERTS)]
    weights = [
        torch.randn(FC1, DMODEL, device="cuda").to(torch.float8_e4m3fn).t() for _ in range(EXPERTS)
    ]
    one = torch.ones((), device="cuda")
    return rows, weights, one


def grouped_linear(torch: Any, rows: list[Any], weights: list[Any], one: Any) -> None:
    """Per expert: current scaling's amax, scale and cast, then the fp8 GEMM."""
    for x, w in zip(rows, weights, strict=True):
        amax = x.abs().amax()
        scale = 448.0 / amax.float()
        q = (x * scale).to(torch.float8_e4m3fn)
        torch._scaled_mm(q, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def post_sync_us(torch: Any, synced: bool) -> list[float]:
    """GPU microseconds of the grouped linear after a sync (``synced``) or queued behind a
    long kernel (the host ahead), REPEATS times."""
    rows, weights, one = expert_operands(torch)
    times = []
    for i in range(REPEATS + 3):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES // 5)  # ~6 ms: longer than the host's launches
        if synced:
            torch.cuda.current_stream().synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        grouped_linear(torch, rows, weights, one)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return times


def summary(name: str, values: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "measurement": name,
        "median_us": round(statistics.median(values), 2),
        "min_us": round(min(values), 2),
        "max_us": round(max(values), 2),
        "repeats": len(values),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--prefix", default="h200")
    args = parser.parse_args(argv)
    try:
        torch = require_cuda("measure_host_sync.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    lines: list[dict[str, Any]] = [
        {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
        }
    ]
    lines.append(summary("sync_gap", sync_gap_us(torch)))
    a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    lines.append(summary("launch_host", host_us_per_call(torch, lambda: a + b), op="add"))
    ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
    lines.append(
        summary("launch_host", host_us_per_call(torch, lambda: ga + gb), op="add_autograd")
    )
    rows, weights, one = expert_operands(torch)
    q = rows[0].to(torch.float8_e4m3fn)

    def gemm() -> None:
        torch._scaled_mm(q, weights[0], scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    lines.append(
        summary("launch_host", host_us_per_call(torch, gemm), op="scaled_mm_fp8_2048x2048x1536")
    )
    for synced in (True, False):
        lines.append(
            summary(
                "post_sync_sequence",
                post_sync_us(torch, synced),
                when="synced" if synced else "queued",
                experts=EXPERTS,
                shape=[ROWS, DMODEL, FC1],
            )
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.prefix}-host-sync.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
