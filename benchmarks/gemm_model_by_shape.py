"""Price every GEMM of a kernel measurement set with stg's model and tabulate stg/measured by
shape class.

    python benchmarks/gemm_model_by_shape.py [--data ../shared/data/kernels/h100-gemm.jsonl]
        [--system h100-80g] [--cases]

Each case is priced as ``tests/test_kernel_time.py`` prices it (``gemm_time`` on the preset's
GPU at its sustained clock; fp8 with a 16-bit output), which is what the time predictor charges
a GEMM node before its launch cost. A ratio below 1 is a prediction too fast. Classes:
``memory-bound`` (arithmetic intensity 2mnk / bytes below the ridge, the preset's GEMM rate over
its streaming bandwidth), ``skinny`` (min(m, n, k) <= 256), ``small k`` (k <= 1024). Cases
whose measured time is under 25 us are left out (an eager call costs about 12 us of host time
whatever its size: the shared data's README), and the grid's dtype sweep and the layer shapes
are reported apart (``family``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path

from stg.perf.kernel_time import DTYPE_BYTES, Gpu, gemm_time
from stg.perf.system import load_system

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "float": "fp32"}
HOST_BOUND_S = 25e-6
SHARED_KERNELS = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
DEFAULT_DATA = SHARED_KERNELS / "h100-gemm.jsonl"


def _dtype(extra: dict) -> str:
    return "tf32" if extra["dtype"] == "float" and extra["tf32"] else DTYPES[extra["dtype"]]


def _moved_bytes(m: int, n: int, k: int, dtype: str) -> float:
    width = DTYPE_BYTES[dtype]
    return (m * k + k * n) * width + m * n * max(width, 2)


def priced_cases(path: Path, gpu: Gpu) -> list[dict]:
    """The cases of ``path`` with their shape, dtype, measured and predicted seconds."""
    out = []
    for line in path.read_text().splitlines():
        case = json.loads(line)
        if "extra" not in case or "metric" not in case:
            continue
        e = case["extra"]
        dtype = _dtype(e)
        m, n, k = e["m"], e["n"], e["k"]
        ridge = gpu.rate(dtype) / (gpu.hbm_bandwidth * gpu.stream_efficiency)
        out.append(
            {
                "family": e["family"],
                "role": e.get("role", ""),
                "dtype": dtype,
                "m": m,
                "n": n,
                "k": k,
                "measured": e["median_ms"] * 1e-3,
                "predicted": gemm_time(gpu, m, n, k, dtype),
                "memory_bound": 2 * m * n * k / _moved_bytes(m, n, k, dtype) < ridge,
            }
        )
    return out


def _row(label: str, cases: Iterable[dict]) -> str:
    ratios = sorted(c["predicted"] / c["measured"] for c in cases)
    if not ratios:
        return f"{label:<46}{0:>5}"
    lo, hi = ratios[0], ratios[-1]
    p10 = ratios[int(0.1 * (len(ratios) - 1))]
    p90 = ratios[int(0.9 * (len(ratios) - 1))]
    median = statistics.median(ratios)
    return f"{label:<46}{len(ratios):>5}{median:>8.3f}{p10:>7.3f}{p90:>7.3f}{lo:>7.3f}{hi:>7.3f}"


def classes(cases: list[dict]) -> dict[str, list[dict]]:
    """The shape classes of the table, each with its cases."""
    groups: dict[str, list[dict]] = {}
    for c in cases:
        if c["measured"] < HOST_BOUND_S:
            continue
        family = "layers" if c["family"] == "model" else c["family"]
        skinny = min(c["m"], c["n"], c["k"]) <= 256
        keys = [f"{c['dtype']} {family} all"]
        bound = "memory-bound" if c["memory_bound"] else "compute"
        keys.append(f"{c['dtype']} {family} {bound}")
        if skinny:
            keys.append(f"{c['dtype']} {family} skinny (min side <= 256)")
            side = "k" if c["k"] <= 256 else "m or n"
            keys.append(f"{c['dtype']} {family} skinny, {side} <= 256")
        if c["k"] <= 1024:
            keys.append(f"{c['dtype']} {family} k <= 1024")
            keys.append(f"{c['dtype']} {family} k = {c['k']}")
        if not skinny and c["k"] > 1024 and not c["memory_bound"]:
            keys.append(f"{c['dtype']} {family} none of these")
        for key in keys:
            groups.setdefault(key, []).append(c)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--system", default="h100-80g")
    parser.add_argument("--cases", action="store_true", help="also list every case of the classes")
    args = parser.parse_args()
    gpu = load_system(args.system).gpu
    cases = priced_cases(args.data, gpu)
    print(f"stg/measured of {args.data.name} on {args.system} (< 1: predicted too fast)")
    print(f"{'class':<46}{'n':>5}{'median':>8}{'p10':>7}{'p90':>7}{'min':>7}{'max':>7}")
    for label, group in sorted(classes(cases).items()):
        print(_row(label, group))
    if args.cases:
        for c in sorted(cases, key=lambda c: c["predicted"] / c["measured"]):
            if c["measured"] < HOST_BOUND_S:
                continue
            print(
                f"{c['dtype']:<5}{c['family']:<10}{c['role']:<30}{c['m']:>7}{c['n']:>7}{c['k']:>7}"
                f"{c['measured'] * 1e6:>10.1f}{c['predicted'] / c['measured']:>8.3f}"
                f"{' mem' if c['memory_bound'] else ''}"
            )


if __name__ == "__main__":
    main()
