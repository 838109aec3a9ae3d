"""Measure a GPU's kernels the way the shared H100 kernel measurements were taken.

    python benchmarks/measure_kernels.py --out DIR [--prefix h200] [--quick]

Writes PARAM compute-benchmark result lines (PARAM.md section 1.4) with the same ``extra``
fields as ``data/kernels/`` (its README), so that the kernel sub-models of
``stg.perf.kernel_time`` can be tested on another GPU with the same code
(``tests/test_kernel_time.py`` reads every ``*-gemm.jsonl`` set it is given):

- ``PREFIX-gemm.jsonl``: ``torch.mm`` (bf16) and ``torch._scaled_mm`` (fp8 e4m3, bf16 out)
  over a grid (m, k, n in 256, 1024, 4096, 16384) and over the forward, input-gradient and
  weight-gradient GEMMs of GPT-3 175B and Llama 3 8B/70B layers at tp 1-8, 8k tokens;
- ``PREFIX-attention.jsonl``: scaled-dot-product attention, bf16, forward and backward, per
  backend (flash, cudnn, math), causal and not, head size 64 and 128;
- ``PREFIX-attention-gqa.jsonl`` (``--only gqa``): the same, causal, one sequence of 1k-8k
  tokens, at the head shapes of the one-GPU eager steps (``benchmarks/eager_step.py``:
  grouped-query heads through ``enable_gqa``, head sizes 64, 80 and 128), each under the
  backend SDPA picks by itself (``extra.backend`` ``default``, with ``extra.chosen`` the one
  ``torch._fused_sdp_choice`` names) and under flash and cuDNN forced;
- ``PREFIX-elementwise.jsonl``: memory-bound kernels over [rows, 8192] bf16 tensors;
- ``PREFIX-fusion.jsonl`` (plain JSON lines): what the shared set lacks: a fused
  scale + causal-mask + softmax (one kernel, as Megatron's ``ScaledUpperTriangMaskedSoftmax``;
  here compiled by ``torch.compile``) against eager ``torch.softmax``, and an fp8 cast with
  its amax (Transformer Engine's cast) eager and fused;
- ``PREFIX-grouped.jsonl``: the experts' GEMMs of a mixture of experts, bf16, as
  ``torch._grouped_mm`` (one kernel over every expert's rows) and ``torch.bmm`` (the same
  groups as one batched GEMM), for each local expert count and rows per expert of the
  Qwen3-30B-A3B, Qwen3-235B-A22B, OLMoE, Mixtral and DeepSeek-V3 shapes (gate and up fused:
  ``[rows, d] x [d, 2f]``; down: ``[rows, f] x [f, d]``);
- ``PREFIX-scaled.jsonl``: fp8 e4m3 GEMMs (``torch._scaled_mm``, bf16 out) under each scaling
  of the low-precision recipes of ``stg.core.recipes`` that Hopper's tensor cores run:
  ``tensorwise`` (one fp32 scale per operand), ``rowwise`` (one per row of A and column of B),
  ``blockwise`` (DeepSeek-V3's 1x128 tiles of A and 128x128 blocks of B, as the forward and
  input-gradient GEMMs) and ``blockwise_1x128`` (1x128 tiles of both, as the weight-gradient
  GEMM), over a grid (m, k, n in 1024, 4096, 16384) and the Llama 3 8B/70B layer GEMMs at tp 1
  and 8, 8k tokens; a scaling the installed PyTorch or cuBLAS refuses is a line with its error;
- ``PREFIX-clock.jsonl`` (plain JSON lines): the SM clock, power and temperature that
  ``nvidia-smi`` reads while a bf16 GEMM runs for 20 s (the sustained clock of
  ``stg.perf.system``'s ``sustained_clock_ghz``), with the GEMM's rate cold and hot.

The sweeps run after the 20 s of sustained GEMMs, so, like the shared set, they describe a
GPU in steady training. Timing: CUDA events around back-to-back calls (PARAM's
``continuous_events``), 3 warm-up and 10 measured iterations, several calls per event pair
for short kernels (``extra.reps_per_event``), randn inputs. Needs PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_back_to_back

WARMUP = 3
ITERATIONS = 10
MIN_EVENT_MS = 0.2

# Layer shapes (hidden, FFN, heads, key/value heads, head size, gated FFN) of the models whose
# GEMMs the shared H100 set measured.
MODELS = {
    "gpt3-175b": (12288, 49152, 96, 96, 128, False),
    "llama3-8b": (4096, 14336, 32, 8, 128, True),
    "llama3-70b": (8192, 28672, 64, 8, 128, True),
}


def _smi() -> str:
    try:
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class Bench:
    def __init__(self, torch: Any, out: Path, prefix: str) -> None:
        self.torch = torch
        self.out = out
        self.prefix = prefix
        props = torch.cuda.get_device_properties(0)
        self.sys_info = {
            "python_version": sys.version.split()[0],
            "cuda_available": True,
            "cuda": torch.version.cuda,
            "cuda_device_name": torch.cuda.get_device_name(0),
            "cuda_device_property": str(props),
            "cudnn": torch.backends.cudnn.version(),
            "pytorch_version": torch.__version__,
        }

    def header(self, family: str, backward: bool) -> dict[str, Any]:
        return {
            "run_options": {
                "family": family,
                "warmup": WARMUP,
                "iteration": ITERATIONS,
                "device": "cuda",
                "exec_mode": "continuous_events",
                "cuda_l2_cache": "on",
                "backward": backward,
                "tf32_default": False,
            },
            "sys_info": self.sys_info,
            "start_time": datetime.datetime.now().isoformat(timespec="seconds"),
        }

    def time_calls(self, fn: Callable[[], Any], reps: int | None = None) -> tuple[list, list, int]:
        """Warm-up and measured per-call times (ms), and the calls per event pair."""
        times, reps = time_back_to_back(
            self.torch,
            fn,
            warmup=WARMUP,
            iterations=ITERATIONS,
            min_event_ms=MIN_EVENT_MS,
            reps=reps,
        )
        return times[:WARMUP], times[WARMUP:], reps

    def write(self, name: str, lines: list[dict[str, Any]]) -> None:
        path = self.out / f"{self.prefix}-{name}.jsonl"
        lines = [*lines, {"finish_time": datetime.datetime.now().isoformat(timespec="seconds")}]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"wrote {path} ({len(lines) - 2} cases)", flush=True)


def _spec(dtype: str, shape: list[int], grad: bool = False) -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "shape": shape, "requires_grad": grad}


def _model_gemms(tokens: int) -> list[tuple[str, int, int, int]]:
    shapes = []
    for name, (hidden, ffn, heads, kv, dhead, gated) in MODELS.items():
        for tp in (1, 2, 4, 8):
            matrices = {
                "qkv": (hidden, (heads + 2 * kv) * dhead // tp),
                "proj": (heads * dhead // tp, hidden),
                "fc1": (hidden, (2 if gated else 1) * ffn // tp),
                "fc2": (ffn // tp, hidden),
            }
            for matrix, (k_in, n_out) in matrices.items():
                role = f"{name}/tp{tp}/t{tokens}/{matrix}"
                shapes.append((f"{role}/fwd", tokens, k_in, n_out))
                shapes.append((f"{role}/dgrad", tokens, n_out, k_in))
                shapes.append((f"{role}/wgrad", k_in, tokens, n_out))
    return shapes


def gemms(bench: Bench, quick: bool) -> None:
    torch = bench.torch
    sizes = (256, 1024, 4096) if quick else (256, 1024, 4096, 16384)
    cases: list[tuple[str, str, int, int, int]] = [("reference", "", 8192, 8192, 8192)]
    cases += [("grid", "", m, k, n) for m in sizes for k in sizes for n in sizes]
    cases += [("model", role, m, k, n) for role, m, k, n in _model_gemms(4096 if quick else 8192)]
    lines = [bench.header("gemm", False)]
    one = torch.ones((), device="cuda")
    for index, (family, role, m, k, n) in enumerate(cases):
        for dtype in ("bfloat16", "float8_e4m3fn"):
            if family == "reference" and dtype != "bfloat16":
                continue
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            if dtype == "bfloat16":
                op = "torch.mm"
                b = b_nk.t().contiguous()
                fn = lambda a=a, b=b: torch.mm(a, b)  # noqa: E731
            else:
                op = "torch._scaled_mm"
                a8 = a.to(torch.float8_e4m3fn)
                b = b_nk.to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt's fp8 GEMM needs
                b8 = b
                fn = lambda a=a8, b=b8: torch._scaled_mm(  # noqa: E731
                    a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                )
            warm, measured, reps = bench.time_calls(fn)
            median = statistics.median(measured)
            flops = 2.0 * m * n * k
            width = 2 if dtype == "bfloat16" else 1
            nbytes = (m * k + k * n) * width + m * n * 2
            lines.append(
                {
                    "op_name": op,
                    "id": f"0|0|{len(lines) - 1}",
                    "config": {
                        "build": None,
                        "input": {
                            "args": [_spec(dtype, [m, k]), _spec(dtype, [k, n])],
                            "kwargs": {},
                        },
                    },
                    "metric": {"forward": {"warmup.time": warm, "measure.time": measured}},
                    "extra": {
                        "family": family,
                        "role": role,
                        "m": m,
                        "k": k,
                        "n": n,
                        "dtype": dtype,
                        "tf32": False,
                        "flops": flops,
                        "bytes": nbytes,
                        "median_ms": median,
                        "tflops": flops / median / 1e9,
                        "gbps": nbytes / median / 1e6,
                        "reps_per_event": reps,
                    },
                }
            )
            del a, b, b_nk, fn
        if index % 20 == 0:
            print(f"gemm {index}/{len(cases)} {_smi()}", flush=True)
    bench.write("gemm", lines)


FP8 = "float8_e4m3fn"
SCALINGS = ("tensorwise", "rowwise", "blockwise", "blockwise_1x128")


def _scales(torch: Any, scaling: str, m: int, k: int, n: int, outer_major: bool) -> tuple:
    """fp32 scales of A [m, k] and B [k, n] for ``scaling``; block scales laid out with the
    outer dimension's stride 1 where ``outer_major`` (the layout cuBLAS's block-scaled fp8
    GEMM on Hopper asks for), else row-major."""

    def make(rows: int, cols: int) -> Any:
        if outer_major:
            return torch.rand(cols, rows, device="cuda", dtype=torch.float32).add_(0.5).t()
        return torch.rand(rows, cols, device="cuda", dtype=torch.float32).add_(0.5)

    blocks = -(-k // 128)
    if scaling == "tensorwise":
        one = torch.ones((), device="cuda")
        return one, one
    if scaling == "rowwise":
        return make(m, 1).contiguous(), make(1, n).contiguous()
    if scaling == "blockwise":
        return make(m, blocks), make(blocks, -(-n // 128))
    return make(m, blocks), make(blocks, n)


def scaled(bench: Bench, quick: bool) -> None:
    """fp8 GEMMs under each recipe scaling (see the module docstring)."""
    torch = bench.torch
    sizes = (1024, 4096) if quick else (1024, 4096, 16384)
    cases: list[tuple[str, str, int, int, int]] = [("reference", "", 8192, 8192, 8192)]
    cases += [("grid", "", m, k, n) for m in sizes for k in sizes for n in sizes]
    cases += [
        ("model", role, m, k, n)
        for role, m, k, n in _model_gemms(4096 if quick else 8192)
        if role.split("/")[0] in ("llama3-8b", "llama3-70b")
        and role.split("/")[1] in ("tp1", "tp8")
    ]
    lines = [bench.header("scaled", False)]
    for index, (family, role, m, k, n) in enumerate(cases):
        a8 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        b8 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).t()
        for scaling in SCALINGS:
            extra: dict[str, Any] = {"family": family, "role": role, "m": m, "k": k, "n": n}
            extra |= {"dtype": "float8_e4m3fn", "scaling": scaling}
            measured: list = []
            warm: list = []
            errors = []
            for outer_major in (True, False) if scaling.startswith("blockwise") else (False,):
                sa, sb = _scales(torch, scaling, m, k, n, outer_major)
                fn = lambda a=a8, b=b8, sa=sa, sb=sb: torch._scaled_mm(  # noqa: E731
                    a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                )
                try:
                    fn()
                    torch.cuda.synchronize()
                    warm, measured, reps = bench.time_calls(fn)
                except Exception as error:  # recorded: the scaling is refused
                    errors.append(
                        f"{'outer-major' if outer_major else 'row-major'} scales: "
                        f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                    )
                    continue
                extra["scale_layout"] = "outer-major" if outer_major else "row-major"
                break
            if errors:
                extra["errors"] = errors
            if measured:
                median = statistics.median(measured)
                flops = 2.0 * m * n * k
                extra |= {
                    "flops": flops,
                    "median_ms": median,
                    "tflops": flops / median / 1e9,
                    "reps_per_event": reps,
                }
            lines.append(
                {
                    "op_name": "torch._scaled_mm",
                    "id": f"0|0|{len(lines) - 1}",
                    "config": {
                        "build": None,
                        "input": {
                            "args": [_spec(FP8, [m, k]), _spec(FP8, [k, n])],
                            "kwargs": {"scaling": scaling},
                        },
                    },
                    "metric": {"forward": {"warmup.time": warm, "measure.time": measured}},
                    "extra": extra,
                }
            )
        del a8, b8
        if index % 10 == 0:
            print(f"scaled {index}/{len(cases)} {_smi()}", flush=True)
    bench.write("scaled", lines)


# name: (hidden, expert FFN) from each model's config.json
EXPERT_SHAPES = {
    "qwen3-30b-a3b": (2048, 768),
    "qwen3-235b-a22b": (4096, 1536),
    "olmoe-1b-7b": (2048, 1024),
    "mixtral-8x7b": (4096, 14336),
    "deepseek-v3": (7168, 2048),
}


def grouped(bench: Bench, quick: bool) -> None:
    """Expert GEMMs: ``torch._grouped_mm`` and ``torch.bmm`` over equal groups."""
    torch = bench.torch
    lines = [bench.header("grouped", False)]
    groups_list = (4, 16) if quick else (1, 4, 8, 16, 64)
    rows_list = (256, 2048) if quick else (64, 256, 1024, 4096, 16384)
    for name, (d, f) in EXPERT_SHAPES.items():
        for groups in groups_list:
            for rows in rows_list:
                for matrix, k, n in (("fc1", d, 2 * f), ("fc2", f, d)):
                    if groups * rows * max(k, n) * 2 > 8 * 2**30 or groups * k * n * 2 > 8 * 2**30:
                        continue
                    a = torch.randn(groups * rows, k, device="cuda", dtype=torch.bfloat16)
                    # [groups, n, k] used transposed (column-major), as torchtitan's experts
                    w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16).mT
                    offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
                    a3 = a.view(groups, rows, k)
                    impls = {
                        "torch._grouped_mm": lambda a=a, w=w, o=offsets: torch._grouped_mm(
                            a, w, offs=o
                        ),
                        "torch.bmm": lambda a3=a3, w=w: torch.bmm(a3, w),
                    }
                    for op, fn in impls.items():
                        try:
                            warm, measured, reps = bench.time_calls(fn)
                        except RuntimeError as error:
                            print(f"skip {op} {name} g{groups} r{rows}: {str(error)[:80]}")
                            continue
                        median = statistics.median(measured)
                        flops = 2.0 * groups * rows * k * n
                        nbytes = 2 * (groups * rows * k + groups * k * n + groups * rows * n)
                        lines.append(
                            {
                                "op_name": op,
                                "id": f"0|0|{len(lines) - 1}",
                                "config": {
                                    "build": None,
                                    "input": {
                                        "args": [
                                            _spec("bfloat16", [groups * rows, k]),
                                            _spec("bfloat16", [groups, k, n]),
                                        ],
                                        "kwargs": {"groups": groups},
                                    },
                                },
                                "metric": {
                                    "forward": {"warmup.time": warm, "measure.time": measured}
                                },
                                "extra": {
                                    "family": "grouped",
                                    "role": f"{name}/{matrix}",
                                    "groups": groups,
                                    "m": rows,
                                    "k": k,
                                    "n": n,
                                    "dtype": "bfloat16",
                                    "flops": flops,
                                    "bytes": nbytes,
                                    "median_ms": median,
                                    "tflops": flops / median / 1e9,
                                    "reps_per_event": reps,
                                },
                            }
                        )
                    del a, w, a3, impls
            torch.cuda.empty_cache()
        print(f"grouped {name} done {_smi()}", flush=True)
    bench.write("grouped", lines)


def _time_sdpa(
    bench: Bench, forward: Callable[[], Any], grad: Any, inputs: tuple[Any, ...]
) -> tuple[list, list, list, list]:
    """Warm-up and measured ms of an SDPA call ``forward`` alone and with its backward (the
    output's gradient ``grad``, the ``inputs``' gradients cleared each time), one call per
    event pair; a RuntimeError where the backend does not take the shape."""

    def both() -> None:
        out = forward()
        for t in inputs:
            t.grad = None
        out.backward(grad)

    warm_f, fwd, _ = bench.time_calls(forward, reps=1)
    warm_b, fb, _ = bench.time_calls(both, reps=1)
    return warm_f, fwd, warm_b, fb


def _sdpa_line(
    index: int,
    args: list[dict[str, Any]],
    kwargs: dict[str, Any],
    timings: tuple[list, list, list, list],
    flops: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One PARAM result line of an SDPA call from its warm-up and measured times forward and
    forward + backward (ms); the backward's are those less the forward's median, and its
    FLOPs 2.5 times the forward's."""
    warm_f, fwd, warm_b, both = timings
    median_f = statistics.median(fwd)
    median_b = statistics.median(both) - median_f
    return {
        "op_name": "torch.nn.functional.scaled_dot_product_attention",
        "id": f"0|0|{index}",
        "config": {"build": None, "input": {"args": args, "kwargs": kwargs}},
        "metric": {
            "forward": {"warmup.time": warm_f, "measure.time": fwd},
            "backward": {
                "warmup.time": [t - median_f for t in warm_b],
                "measure.time": [t - median_f for t in both],
            },
        },
        "extra": {
            **extra,
            "flops_fwd": flops,
            "flops_bwd": 2.5 * flops,
            "median_fwd_ms": median_f,
            "median_bwd_ms": median_b,
            "tflops_fwd": flops / median_f / 1e9,
            "tflops_bwd": 2.5 * flops / median_b / 1e9,
        },
    }


def attention(bench: Bench, quick: bool) -> None:
    torch = bench.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    seqs = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    tokens = 16384
    lines = [bench.header("attention", True)]
    for backend, kernel in backends.items():
        for head_dim, heads in ((128, 32), (64, 32)):
            for seq in seqs:
                if backend == "math" and seq > 4096:
                    continue  # the s x s scores of the math path: tens of GB
                for causal in (True, False):
                    b = max(1, tokens // seq)
                    q, k, v = (
                        torch.randn(
                            b,
                            heads,
                            seq,
                            head_dim,
                            device="cuda",
                            dtype=torch.bfloat16,
                            requires_grad=True,
                        )
                        for _ in range(3)
                    )
                    grad = torch.randn(b, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

                    def forward(q=q, k=k, v=v, causal=causal, kernel=kernel):
                        with sdpa_kernel([kernel]):
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal
                            )

                    try:
                        timings = _time_sdpa(bench, forward, grad, (q, k, v))
                    except RuntimeError as error:  # a backend that does not take this shape
                        print(f"skip {backend} d{head_dim} s{seq}: {str(error)[:80]}")
                        torch.cuda.empty_cache()
                        continue
                    lines.append(
                        _sdpa_line(
                            len(lines) - 1,
                            [_spec("bfloat16", [b, heads, seq, head_dim], True)] * 3,
                            {"is_causal": {"type": "bool", "value": causal}},
                            timings,
                            4.0 * b * heads * seq * seq * head_dim * (0.5 if causal else 1.0),
                            {
                                "backend": backend,
                                "b": b,
                                "heads": heads,
                                "seq": seq,
                                "head_dim": head_dim,
                                "causal": causal,
                            },
                        )
                    )
                    del q, k, v, grad
                    torch.cuda.empty_cache()
        print(f"attention {backend} done {_smi()}", flush=True)
    bench.write("attention", lines)


# (heads, key/value heads, head size) of the eager steps' models (benchmarks/eager_step.py)
GQA_SHAPES = {
    "llama-1b": (32, 8, 64),
    "llama-3b": (24, 8, 128),
    "gpt-1.3b": (16, 16, 128),
    "gpt-2.7b": (32, 32, 80),
    "qwen3-30b-a3b": (32, 4, 128),
    "llama3-8b": (32, 8, 128),
}
SDPA_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
"""``torch._fused_sdp_choice``'s return values (``torch.nn.attention.SDPBackend``)."""


def attention_gqa(bench: Bench, quick: bool) -> None:
    """Causal SDPA of one sequence at the eager steps' head shapes: SDPA's own choice, flash
    and cuDNN (``extra.kv_heads`` the key/value heads, ``enable_gqa`` where fewer)."""
    torch = bench.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    seqs = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
    lines = [bench.header("attention", True)]
    for model, (heads, kv, head_dim) in GQA_SHAPES.items():
        for seq in seqs:
            q = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (
                torch.randn(1, kv, seq, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2)
            )
            for t in (q, k, v):
                t.requires_grad_(True)
            grad = torch.randn_like(q)
            gqa = kv != heads
            chosen = SDPA_BACKEND_NAMES.get(
                int(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)), "other"
            )
            for backend in ("default", *forced):

                def forward(q=q, k=k, v=v, gqa=gqa, backend=backend):
                    own = backend == "default"  # SDPA's own choice
                    with nullcontext() if own else sdpa_kernel([forced[backend]]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True, enable_gqa=gqa
                        )

                try:
                    timings = _time_sdpa(bench, forward, grad, (q, k, v))
                except RuntimeError as error:  # a backend that does not take this shape
                    print(f"skip {backend} {model} s{seq}: {str(error)[:80]}", flush=True)
                    continue
                lines.append(
                    _sdpa_line(
                        len(lines) - 1,
                        [
                            _spec("bfloat16", [1, heads, seq, head_dim], True),
                            *[_spec("bfloat16", [1, kv, seq, head_dim], True)] * 2,
                        ],
                        {
                            "is_causal": {"type": "bool", "value": True},
                            "enable_gqa": {"type": "bool", "value": gqa},
                        },
                        timings,
                        4.0 * heads * seq * seq * head_dim * 0.5,
                        {
                            "model": model,
                            "backend": backend,
                            "chosen": chosen,
                            "b": 1,
                            "heads": heads,
                            "kv_heads": kv,
                            "seq": seq,
                            "head_dim": head_dim,
                            "causal": True,
                        },
                    )
                )
            del q, k, v, grad
            torch.cuda.empty_cache()
        print(f"attention-gqa {model} done {_smi()}", flush=True)
    bench.write("attention-gqa", lines)


def elementwise(bench: Bench, quick: bool) -> None:
    torch = bench.torch
    F = torch.nn.functional
    cols = 8192
    ops: dict[str, tuple[int, Callable[..., Any]]] = {
        "torch.add": (2, lambda x, y: torch.add(x, y)),
        "torch.mul": (2, lambda x, y: torch.mul(x, y)),
        "torch.nn.functional.gelu": (1, lambda x: F.gelu(x, approximate="tanh")),
        "torch.nn.functional.silu": (1, F.silu),
        "torch.nn.functional.dropout": (1, lambda x: F.dropout(x, 0.1, True)),
        "torch.nn.functional.layer_norm": (1, lambda x: F.layer_norm(x, (cols,))),
        "torch.nn.functional.rms_norm": (1, lambda x: F.rms_norm(x, (cols,))),
        "torch.softmax": (1, lambda x: torch.softmax(x, -1)),
        "torch.Tensor.copy_": (1, None),
    }
    rows_list = (1024, 65536) if quick else (64, 1024, 8192, 32768, 65536)
    lines = [bench.header("elementwise", True)]
    for op, (arity, fn) in ops.items():
        for rows in rows_list:
            dtype = torch.bfloat16
            inputs = [
                torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=fn is not None)
                for _ in range(arity)
            ]
            if fn is None:
                target = torch.empty(rows, cols, device="cuda", dtype=dtype)
                forward = lambda x=inputs[0], t=target: t.copy_(x)  # noqa: E731
            else:
                forward = lambda fn=fn, inputs=inputs: fn(*inputs)  # noqa: E731
            warm_f, fwd, reps = bench.time_calls(forward)
            median_f = statistics.median(fwd)
            median_b = None
            metric: dict[str, Any] = {"forward": {"warmup.time": warm_f, "measure.time": fwd}}
            if fn is not None:
                grad = torch.randn(rows, cols, device="cuda", dtype=dtype)

                def both(forward=forward, grad=grad, inputs=inputs):
                    for x in inputs:
                        x.grad = None
                    forward().backward(grad)

                warm_b, fb, _ = bench.time_calls(both)
                median_b = statistics.median(fb) - median_f
                metric["backward"] = {
                    "warmup.time": [t - median_f for t in warm_b],
                    "measure.time": [t - median_f for t in fb],
                }
            nbytes = (arity + 1) * rows * cols * 2
            lines.append(
                {
                    "op_name": op,
                    "id": f"0|0|{len(lines) - 1}",
                    "config": {
                        "build": None,
                        "input": {
                            "args": [_spec("bfloat16", [rows, cols], fn is not None)] * arity,
                            "kwargs": {},
                        },
                    },
                    "metric": metric,
                    "extra": {
                        "rows": rows,
                        "cols": cols,
                        "dtype": "bfloat16",
                        "bytes_fwd": nbytes,
                        "median_fwd_ms": median_f,
                        "median_bwd_ms": median_b,
                        "gbps_fwd": nbytes / median_f / 1e6,
                        "reps_per_event": reps,
                    },
                }
            )
            del inputs, forward
            torch.cuda.empty_cache()
    bench.write("elementwise", lines)


def _onepass_softmax(torch: Any) -> Callable[[Any, float], Any]:
    """Scale + causal mask + softmax over [batch, s, s] bf16 scores as Megatron's fused kernel
    does it: one program per row holds the whole row (up to 4,096 values) on chip, so the
    forward reads the scores once and writes the probabilities once, and the backward reads
    the probabilities and their gradient once and writes one gradient (a Triton kernel)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(x_ptr, y_ptr, cols, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        query = row % cols
        offsets = tl.arange(0, BLOCK)
        inside = offsets < cols
        x = tl.load(x_ptr + row * cols + offsets, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(inside & (offsets <= query), x * scale, float("-inf"))
        e = tl.exp(x - tl.max(x, 0))
        tl.store(y_ptr + row * cols + offsets, (e / tl.sum(e, 0)).to(tl.bfloat16), mask=inside)

    @triton.jit
    def backward_kernel(y_ptr, dy_ptr, dx_ptr, cols, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < cols
        y = tl.load(y_ptr + row * cols + offsets, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * cols + offsets, mask=inside, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, 0)) * scale
        tl.store(dx_ptr + row * cols + offsets, dx.to(tl.bfloat16), mask=inside)

    class OnePass(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, scale: float) -> Any:
            cols = x.shape[-1]
            y = torch.empty_like(x)
            block = triton.next_power_of_2(cols)
            forward_kernel[(x.numel() // cols,)](x, y, cols, scale, BLOCK=block, num_warps=8)
            ctx.save_for_backward(y)
            ctx.scale = scale
            return y

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            (y,) = ctx.saved_tensors
            cols = y.shape[-1]
            dx = torch.empty_like(y)
            block = triton.next_power_of_2(cols)
            backward_kernel[(y.numel() // cols,)](
                y, dy.contiguous(), dx, cols, ctx.scale, BLOCK=block, num_warps=8
            )
            return dx, None

    def run(x: Any, scale: float) -> Any:
        return OnePass.apply(x, scale)

    return run


def fusion(bench: Bench, quick: bool) -> None:
    """Fused scale + causal mask + softmax (one kernel) and fp8 casts with their amax."""
    torch = bench.torch
    rows: list[dict[str, Any]] = []

    def masked_softmax(x, scale):
        s = x.shape[-1]
        mask = torch.ones(s, s, device=x.device, dtype=torch.bool).triu(1)
        return torch.softmax((x.float() * scale).masked_fill(mask, float("-inf")), -1).to(x.dtype)

    compiled = torch.compile(masked_softmax, dynamic=False)
    onepass = _onepass_softmax(torch)
    seqs = (1024, 2048) if quick else (1024, 2048, 4096)
    for seq in seqs:
        batch_heads = max(1, 2**30 // (seq * seq * 2))  # about 1 GiB of bf16 scores
        x = torch.randn(
            batch_heads, seq, seq, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        grad = torch.randn_like(x)
        elements = x.numel()
        reference = masked_softmax(x.detach().float(), 0.125)
        (reference_grad,) = torch.autograd.grad(masked_softmax(x, 0.125), x, grad)
        for name, fn in (("eager", masked_softmax), ("fused", compiled), ("onepass", onepass)):
            forward = lambda fn=fn, x=x: fn(x, 0.125)  # noqa: E731
            error = (forward().float() - reference).abs().max().item()
            (gradient,) = torch.autograd.grad(forward(), x, grad)
            grad_error = (gradient.float() - reference_grad.float()).abs().max().item()

            def both(forward=forward, x=x, grad=grad):
                x.grad = None
                forward().backward(grad)

            _, fwd, _ = bench.time_calls(forward)
            _, fb, _ = bench.time_calls(both)
            median_f = statistics.median(fwd)
            median_b = statistics.median(fb) - median_f
            rows.append(
                {
                    "kernel": f"scale_mask_softmax/{name}",
                    "shape": [batch_heads, seq, seq],
                    "max_abs_error_vs_fp32": error,
                    "grad_max_abs_error_vs_eager": grad_error,
                    "dtype": "bfloat16",
                    # the least a fused kernel moves: read x, write y (fwd); read y, dy, write dx
                    "bytes_fwd": 4 * elements,
                    "bytes_bwd": 6 * elements,
                    "median_fwd_ms": median_f,
                    "median_bwd_ms": median_b,
                    "gbps_fwd": 4 * elements / median_f / 1e6,
                    "gbps_bwd": 6 * elements / median_b / 1e6,
                }
            )
        del x, grad
        torch.cuda.empty_cache()

    def cast_amax(x, scale):
        amax = x.abs().amax().float()
        return (x.float() * scale).to(torch.float8_e4m3fn), amax

    compiled_cast = torch.compile(cast_amax, dynamic=False)
    scale = torch.ones((), device="cuda")
    for rows_n in (8192,) if quick else (1024, 8192, 65536):
        x = torch.randn(rows_n, 8192, device="cuda", dtype=torch.bfloat16)
        for name, fn in (
            ("eager", cast_amax),
            ("fused", compiled_cast),
            ("cast-only", lambda x, s: x.to(torch.float8_e4m3fn)),
        ):
            forward = lambda fn=fn, x=x: fn(x, scale)  # noqa: E731
            _, fwd, reps = bench.time_calls(forward)
            median = statistics.median(fwd)
            rows.append(
                {
                    "kernel": f"fp8_cast_amax/{name}",
                    "shape": [rows_n, 8192],
                    "dtype": "bfloat16->float8_e4m3fn",
                    "bytes_fwd": 3 * x.numel(),  # read 2 bytes, write 1 per element
                    "median_fwd_ms": median,
                    "gbps_fwd": 3 * x.numel() / median / 1e6,
                    "reps_per_event": reps,
                }
            )
        del x
    path = bench.out / f"{bench.prefix}-fusion.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {path}", flush=True)
    for row in rows:
        print(
            f"  {row['kernel']:<28}{row['shape']!s:<22}fwd {row['gbps_fwd']:8.0f} GB/s"
            + (f"  bwd {row['gbps_bwd']:8.0f} GB/s" if "gbps_bwd" in row else "")
        )


def clock(bench: Bench, seconds: float) -> None:
    """A bf16 GEMM cold, then for ``seconds`` with nvidia-smi sampled, then hot."""
    torch = bench.torch
    rows: list[dict[str, Any]] = []
    m, k, n = 8192, 8192, 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    def rate(state: str) -> None:
        _, measured, _ = bench.time_calls(lambda: torch.mm(a, b), reps=1)
        median = statistics.median(measured)
        rows.append(
            {
                "state": state,
                "m": m,
                "k": k,
                "n": n,
                "fill": "randn",
                "ms": median,
                "tflops": 2 * m * n * k / median / 1e9,
                "smi_after": _smi(),
            }
        )

    rate("cold")
    samples: list[str] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_smi())
            time.sleep(1.0)

    thread = threading.Thread(target=sample)
    thread.start()
    end = time.time() + seconds
    batches: list[float] = []
    while time.time() < end:
        start, stop_event = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        for _ in range(50):
            torch.mm(a, b)
        stop_event.record()
        torch.cuda.synchronize()
        batches.append(start.elapsed_time(stop_event) / 50)
    stop.set()
    thread.join()
    hot = statistics.median(batches[len(batches) // 2 :])
    rows.append(
        {
            "state": "hot (sustained, last half)",
            "m": m,
            "k": k,
            "n": n,
            "fill": "randn",
            "ms": hot,
            "tflops": 2 * m * n * k / hot / 1e9,
            "smi_after": _smi(),
        }
    )
    rate("after")
    clocks = [float(s.split(",")[0].split()[0]) for s in samples if s and "MHz" in s]
    rows.append(
        {
            "state": "sustained",
            "seconds": seconds,
            "samples": samples,
            "sm_clock_mhz_median_last_half": statistics.median(clocks[len(clocks) // 2 :])
            if clocks
            else None,
        }
    )
    path = bench.out / f"{bench.prefix}-clock.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(
        f"wrote {path}: cold {rows[0]['tflops']:.0f} TFLOP/s, hot {rows[1]['tflops']:.0f}, "
        f"sustained SM clock {rows[-1]['sm_clock_mhz_median_last_half']} MHz",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke test)")
    parser.add_argument("--only", default="clock,fusion,gemm,attention,elementwise")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_kernels.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(torch, args.out, args.prefix)
    steps = {
        "clock": lambda: clock(bench, args.seconds),
        "fusion": lambda: fusion(bench, args.quick),
        "gemm": lambda: gemms(bench, args.quick),
        "attention": lambda: attention(bench, args.quick),
        "gqa": lambda: attention_gqa(bench, args.quick),
        "elementwise": lambda: elementwise(bench, args.quick),
        "grouped": lambda: grouped(bench, args.quick),
        "scaled": lambda: scaled(bench, args.quick),
    }
    for step in args.only.split(","):
        started = time.time()
        steps[step]()
        print(f"{step}: {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
