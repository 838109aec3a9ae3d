"""Measure the GPU time of the ops torchtitan ran as eager PyTorch at 1ea476e9f.

    python benchmarks/measure_torchtitan_ops.py --out DIR [--prefix h100]

Writes ``PREFIX-torchtitan-ops.jsonl`` (JSON lines; the first line describes the machine):
kernel-level measurements of the element-wise work that torchtitan's Llama
(``torchtitan/models/llama/model.py`` and ``models/norms.py`` at 1ea476e9f, the commit of the
tt2408 rows in tests/data/runs/cluster_runs.json) runs outside its GEMMs and SDPA, each as
that source writes it, forward and backward, at the shapes of those rows (local batch x
sequence tokens per GPU):

- ``rotary``: ``apply_rotary_emb`` on q and k (``.float()``, ``view_as_complex``, a complex
  multiply by ``freqs_cis``, ``view_as_real``, ``type_as``);
- ``repeat_kv``: ``repeat_kv`` of k and v (``expand`` then ``reshape``, which copies) where
  there are fewer kv heads than heads;
- ``swiglu``: ``F.silu(a) * b`` on the two up-projections' outputs;
- ``rmsnorm``: the unfused ``RMSNorm`` (``x.float()``, ``pow``, ``mean``, ``rsqrt``, the
  products, ``type_as``, the weight);
- ``logits_loss``: ``Transformer.forward``'s ``self.output(h).float()`` and the
  ``cross_entropy`` of ``train.py`` on the fp32 logits.

With ``--kernels``, ``PREFIX-torchtitan-kernels.jsonl`` instead: each op's forward and backward
at the Llama 3 8B shapes under ``torch.profiler`` (input shapes recorded), one row per aten op
and input shapes with its self device microseconds per call (the kernels it launched itself)
and its calls per run: what each eager kernel of those ops costs on its own.

Each row gives the bytes the op's tensors take by definition (what a memory-bound model
prices) and the median GPU milliseconds of its forward and of its backward over ``REPEATS``
runs after warm-ups, timed with CUDA events behind a long ``torch.cuda._sleep`` so that the
host is ahead and only GPU time is measured. Needs PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_host_sync import cpu_model

from stg.bench import MissingDependencyError, require_cuda

REPEATS = 10
SLEEP_CYCLES = 20_000_000  # ~10 ms at ~2 GHz: the host queues the op behind it

CASES: dict[str, dict[str, int]] = {
    # tokens per GPU = local batch x seq of the tt2408 rows; dims of torchtitan's
    # models/llama/__init__.py at 1ea476e9f (ffn from its multiple_of/ffn_dim_multiplier rule)
    "llama3-8b": dict(tokens=8192, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama2-13b": dict(tokens=8192, dim=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000),
    "llama3-70b": dict(tokens=8192, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "llama2-70b": dict(tokens=4096, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
}


def gpu_ms(torch: Any, run: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """GPU milliseconds of ``run(*args)`` queued behind a sleep kernel (the host ahead), and
    what it returned."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    value = run(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), value


def time_op(
    torch: Any, make: Callable[[], tuple[list[Any], Callable[..., Any]]]
) -> tuple[float, float]:
    """Median forward and backward GPU milliseconds of the op ``make`` returns (its inputs,
    which require gradients, and a function of them)."""
    forward, backward = [], []
    for repeat in range(REPEATS + 3):
        inputs, fn = make()
        f_ms, out = gpu_ms(torch, fn, *inputs)
        result = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(r) if r.dim() else None for r in result]
        b_ms, _ = gpu_ms(torch, torch.autograd.backward, result, grads)
        if repeat >= 3:
            forward.append(f_ms)
            backward.append(b_ms)
    return statistics.median(forward), statistics.median(backward)


def profile_op(
    torch: Any, make: Callable[[], tuple[list[Any], Callable[..., Any]]]
) -> list[dict[str, Any]]:
    """Per aten op and input shapes: self device microseconds per call of the op's forward
    and backward, profiled over ``REPEATS`` runs after warm-ups."""

    def once(inputs: list[Any], fn: Callable[..., Any]) -> None:
        out = fn(*inputs)
        result = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(r) if r.dim() else None for r in result]
        torch.autograd.backward(result, grads)

    for _ in range(3):
        once(*make())
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(REPEATS):
            once(*make())
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::") or e.self_device_time_total <= 0:
            continue
        rows.append(
            {
                "aten": e.key,
                "input_shapes": str(e.input_shapes),
                "calls_per_run": e.count / REPEATS,
                "self_device_us_per_call": e.self_device_time_total / e.count,
            }
        )
    return rows


def measure(
    torch: Any, name: str, case: dict[str, int], kernels: bool = False
) -> list[dict[str, Any]]:
    """The rows of one model's shapes (``kernels``: per aten op, :func:`profile_op`)."""
    bf16, dev = torch.bfloat16, "cuda"
    t, d, h, kv, f, v = (case[k] for k in ("tokens", "dim", "heads", "kv_heads", "ffn", "vocab"))
    hd = d // h
    F = torch.nn.functional

    def leaf(*shape: int, dtype: Any = bf16) -> Any:
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    angles = torch.rand(t, hd // 2, device=dev) * 6.283
    freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, t, 1, hd // 2)

    def rotary(xq: Any, xk: Any) -> tuple[Any, Any]:
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    def repeat(xk: Any, xv: Any) -> tuple[Any, Any]:
        n_rep = h // kv

        def one(x: Any) -> Any:
            bs, slen, heads, dim = x.shape
            return (
                x[:, :, :, None, :]
                .expand(bs, slen, heads, n_rep, dim)
                .reshape(bs, slen, heads * n_rep, dim)
            )

        return one(xk), one(xv)

    weight = torch.ones(d, device=dev, dtype=bf16, requires_grad=True)

    def rmsnorm(x: Any) -> Any:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        return y.type_as(x) * weight

    labels = torch.randint(0, v, (t,), device=dev)

    def logits_loss(logits: Any) -> Any:
        return F.cross_entropy(logits.float(), labels)

    ops: list[tuple[str, Callable[[], tuple[list[Any], Callable[..., Any]]], int]] = [
        # bytes by definition: each tensor the op reads or writes once, at its width
        (
            "rotary",
            lambda: ([leaf(1, t, h, hd), leaf(1, t, kv, hd)], rotary),
            (h + kv) * t * hd * (2 + 4 + 4 + 2),
        ),
        ("swiglu", lambda: ([leaf(t, f), leaf(t, f)], lambda a, b: F.silu(a) * b), 3 * t * f * 2),
        ("rmsnorm", lambda: ([leaf(t, d)], rmsnorm), t * d * (2 + 4 + 4 + 2 + 2)),
        ("logits_loss", lambda: ([leaf(t, v)], logits_loss), t * v * (2 + 4)),
    ]
    if kv < h:
        ops.insert(
            1,
            (
                "repeat_kv",
                lambda: ([leaf(1, t, kv, hd), leaf(1, t, kv, hd)], repeat),
                2 * t * hd * (kv + h) * 2,
            ),
        )
    rows = []
    for op, make, nbytes in ops:
        if kernels:
            rows += [{"model": name, "op": op, **r} for r in profile_op(torch, make)]
            continue
        fwd, bwd = time_op(torch, make)
        timed = {"forward_ms": fwd, "backward_ms": bwd}
        rows.append({"model": name, "op": op, **case, "bytes": nbytes, **timed})
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    parser.add_argument("--kernels", action="store_true", help="per aten op, Llama 3 8B only")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_torchtitan_ops.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "source": "benchmarks/measure_torchtitan_ops.py",
    }
    what = "kernels" if args.kernels else "ops"
    cases = {"llama3-8b": CASES["llama3-8b"]} if args.kernels else CASES
    with (args.out / f"{args.prefix}-torchtitan-{what}.jsonl").open("w") as out:
        out.write(json.dumps(machine) + "\n")
        for name, case in cases.items():
            for row in measure(torch, name, case, args.kernels):
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
