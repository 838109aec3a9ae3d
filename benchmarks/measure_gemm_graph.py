"""Time bf16 and fp8 GEMMs eagerly and inside a CUDA graph, to separate per-call from per-wave cost.

    python benchmarks/measure_gemm_graph.py --out DIR [--prefix h200] [--quick]

Writes ``PREFIX-gemm-graph.jsonl`` in PARAM's result format (the first line describes the
machine and the method, the last the finish time). Each case is one GEMM ``[m, k] x [k, n]``
in three forms: ``torch.mm`` in bf16, and ``torch._scaled_mm`` with fp8 e4m3 operands and a bf16
output under tensorwise scales (one fp32 scale per operand) and rowwise scales (one per row of
A and per column of B, torchao's ``rowwise`` recipe). Each form is timed twice, back to back:

- ``eager``: ``reps`` calls launched from Python between two CUDA events (the host's launch
  cost shows wherever it exceeds the kernel's time, as it does in an eager step);
- ``graph``: the same ``reps`` calls captured in one CUDA graph and replayed (no host time),
  as in a compiled or graph-captured step.

The cases are ``smallk`` (a grid of short reductions, where fp8's extra cost per GEMM over bf16
was seen, docs/notes/gemm-skinny-shapes.md) and ``torchtitan``: the separate projections
(``wq``, ``wk``/``wv``, ``wo``, ``w1``/``w3``, ``w2``) of Llama 3 8B and 70B as torchtitan's
tensor parallelism runs them, forward, input gradient and weight gradient, at the tokens per
rank of tests/data/runs/cluster_runs.json's tt2506 rows (local batch x 8,192 tokens, tp 8 with
sequence parallelism) and an 8B FSDP rank (2 x 8,192 tokens, tp 1). Then ``quantize``: the
fp8 casts of those operands as ``torch.compile`` builds them (tensorwise, rowwise along each
axis), timed eagerly. A 20 s burn of large GEMMs
first brings the GPU to its sustained clock (../shared/data/kernels/README.md on power state).
Needs PyTorch and a CUDA GPU with fp8 (Hopper or later).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_back_to_back

WARMUP = 3
ITERATIONS = 10
MIN_EVENT_MS = 1.0
"""Calls per event pair are chosen so that one timed interval lasts at least this long."""

MAX_REPS = 50

TIMING = {
    "warmup": WARMUP,
    "iterations": ITERATIONS,
    "min_event_ms": MIN_EVENT_MS,
    "max_reps": MAX_REPS,
}
"""How :func:`stg.bench.runner.time_back_to_back` times each call eagerly."""

FORMS = ("bf16", "fp8_tensorwise", "fp8_rowwise")

# name: (hidden, ffn, heads, kv heads, head dim) from each model's config.json
MODELS = {
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
}

RUNS = (("llama3-8b", 8, 12 * 8192), ("llama3-70b", 8, 16 * 8192), ("llama3-8b", 1, 2 * 8192))
"""(model, tp, tokens per rank): tt2506's 8B (local batch 12) and 70B (local batch 16), and an
8B FSDP rank of local batch 2."""


def torchtitan_cases() -> list[tuple[str, int, int, int]]:
    """(role, m, k, n) of each distinct projection GEMM of :data:`RUNS`."""
    cases: list[tuple[str, int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    for model, tp, tokens in RUNS:
        hidden, ffn, heads, kv, dhead = MODELS[model]
        matrices = {
            "wq": (hidden, heads * dhead // tp),
            "wk_wv": (hidden, kv * dhead // tp),
            "wo": (heads * dhead // tp, hidden),
            "w1_w3": (hidden, ffn // tp),
            "w2": (ffn // tp, hidden),
        }
        for matrix, (k_in, n_out) in matrices.items():
            role = f"{model}/tp{tp}/t{tokens}/{matrix}"
            for kind, shape in (
                ("fwd", (tokens, k_in, n_out)),
                ("dgrad", (tokens, n_out, k_in)),
                ("wgrad", (n_out, tokens, k_in)),
            ):
                if shape not in seen:
                    seen.add(shape)
                    cases.append((f"{role}/{kind}", *shape))
    return cases


def smallk_cases(quick: bool) -> list[tuple[str, int, int, int]]:
    ms = (8192,) if quick else (8192, 32768)
    ns = (1024, 4096) if quick else (1024, 4096, 14336)
    ks = (128, 512) if quick else (128, 256, 512, 1024, 2048)
    return [("", m, k, n) for m in ms for k in ks for n in ns]


def _spec(dtype: str, shape: list[int]) -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "shape": shape, "requires_grad": False}


def gemm_call(torch: Any, form: str, m: int, k: int, n: int) -> Callable[[], Any]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if form == "bf16":
        b = b_nk.t().contiguous()
        return lambda a=a, b=b: torch.mm(a, b)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b_nk.to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt's fp8 GEMM needs
    del a, b_nk
    if form == "fp8_tensorwise":
        sa = sb = torch.ones((), device="cuda")
    else:
        sa = torch.rand(m, 1, device="cuda", dtype=torch.float32).add_(0.5)
        sb = torch.rand(1, n, device="cuda", dtype=torch.float32).add_(0.5)
    return lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def time_graph(torch: Any, fn: Callable[[], Any], reps: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(WARMUP + ITERATIONS)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return [s.elapsed_time(e) / reps for s, e in events]


QUANTIZE_SHAPES = ((98304, 4096), (98304, 1792), (98304, 512), (98304, 128), (16384, 14336))
"""[tokens, features] of the tt2506 8B rank's GEMM operands, and an FSDP rank's fc2 input."""


def quantize_calls(torch: Any) -> dict[str, Callable[[Any], Any]]:
    """torch.compile'd fp8 casts as torchao's Float8Linear finds them: tensorwise (one amax of the
    whole tensor), rowwise along the last dimension (one scale per row) and along the first (one
    per column, the weight gradient's operand)."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max

    def tensorwise(x: Any) -> Any:
        scale = top / x.abs().amax().float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-top, top).to(fp8), scale

    def rowwise(x: Any) -> Any:
        scale = top / x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-top, top).to(fp8), scale

    def colwise(x: Any) -> Any:
        scale = top / x.abs().amax(dim=0, keepdim=True).float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-top, top).to(fp8), scale

    return {
        name: torch.compile(fn)
        for name, fn in (("tensorwise", tensorwise), ("rowwise", rowwise), ("colwise", colwise))
    }


def quantize(torch: Any, lines: list[dict[str, Any]]) -> None:
    calls = quantize_calls(torch)
    for rows, cols in QUANTIZE_SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        for name, call in calls.items():
            try:
                fn = lambda call=call, x=x: call(x)  # noqa: E731
                for _ in range(3):
                    fn()
                times, reps = time_back_to_back(torch, fn, **TIMING)
            except Exception as error:  # recorded: inductor could not build the cast
                print(f"quantize {name} {rows}x{cols}: {str(error).splitlines()[0][:200]}")
                continue
            median = statistics.median(times[WARMUP:])
            lines.append(
                {
                    "op_name": f"compiled_fp8_cast_{name}",
                    "id": f"0|0|{len(lines) - 1}",
                    "config": {"build": None, "input": {"args": [_spec("bfloat16", [rows, cols])]}},
                    "metric": {
                        "forward": {"warmup.time": times[:WARMUP], "measure.time": times[WARMUP:]}
                    },
                    "extra": {
                        "family": "quantize",
                        "scaling": name,
                        "rows": rows,
                        "cols": cols,
                        "mode": "eager",
                        "median_ms": median,
                        "bytes_read_once": rows * cols * 2,
                        "gbps_read_once": rows * cols * 2 / median / 1e6,
                        "reps_per_event": reps,
                    },
                }
            )
        del x


def burn(torch: Any, seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ends = time.time() + seconds
    while time.time() < ends:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke test)")
    parser.add_argument("--burn", type=float, default=20.0, help="seconds of warm-up load")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_gemm_graph.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    burn(torch, args.burn)
    head = {
        "run_options": {
            "family": "gemm-graph",
            "warmup": WARMUP,
            "iteration": ITERATIONS,
            "device": "cuda",
            "exec_mode": "continuous_events and cuda_graph (see extra.mode)",
            "cuda_l2_cache": "on",
            "backward": False,
            "tf32_default": False,
            "burn_s": args.burn,
        },
        "sys_info": {
            "python_version": sys.version.split()[0],
            "cuda": torch.version.cuda,
            "cuda_device_name": torch.cuda.get_device_name(0),
            "cuda_device_property": str(torch.cuda.get_device_properties(0)),
            "pytorch_version": torch.__version__,
        },
        "start_time": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    lines: list[dict[str, Any]] = [head]
    cases = [("torchtitan", *case) for case in torchtitan_cases()]
    cases += [("smallk", *case) for case in smallk_cases(args.quick)]
    for index, (family, role, m, k, n) in enumerate(cases):
        for form in FORMS:
            try:
                fn = gemm_call(torch, form, m, k, n)
                eager, reps = time_back_to_back(torch, fn, **TIMING)
            except RuntimeError as error:  # recorded: the form is refused for this shape
                print(f"{role or (m, k, n)} {form}: {str(error).splitlines()[0][:200]}")
                continue
            for mode in ("eager", "graph"):
                times = eager if mode == "eager" else time_graph(torch, fn, reps)
                measured = times[WARMUP:]
                median = statistics.median(measured)
                dtype = "bfloat16" if form == "bf16" else "float8_e4m3fn"
                lines.append(
                    {
                        "op_name": "torch.mm" if form == "bf16" else "torch._scaled_mm",
                        "id": f"0|0|{len(lines) - 1}",
                        "config": {
                            "build": None,
                            "input": {
                                "args": [_spec(dtype, [m, k]), _spec(dtype, [k, n])],
                                "kwargs": {} if form == "bf16" else {"scaling": form[4:]},
                            },
                        },
                        "metric": {
                            "forward": {
                                "warmup.time": times[:WARMUP],
                                "measure.time": measured,
                            }
                        },
                        "extra": {
                            "family": family,
                            "role": role,
                            "m": m,
                            "k": k,
                            "n": n,
                            "form": form,
                            "mode": mode,
                            "median_ms": median,
                            "tflops": 2.0 * m * n * k / median / 1e9,
                            "reps_per_event": reps,
                        },
                    }
                )
            del fn
        if index % 10 == 0:
            print(f"{index}/{len(cases)}", flush=True)
    quantize(torch, lines)
    lines.append({"finish_time": datetime.datetime.now().isoformat(timespec="seconds")})
    path = args.out / f"{args.prefix}-gemm-graph.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {path} ({len(lines) - 2} timings)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
