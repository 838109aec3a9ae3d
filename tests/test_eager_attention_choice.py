"""Eager PyTorch's attention on Hopper, against what PyTorch 2.11 chose and ran on an H100.

tests/data/kernels/h100-attention-gqa.jsonl (``benchmarks/measure_kernels.py --only gqa`` on a
lent H100, PyTorch 2.11.0+cu130, cuDNN 9.19): causal SDPA of one sequence at the head shapes of
the one-GPU eager steps (grouped-query heads through ``enable_gqa``, head sizes 64, 80 and 128),
under SDPA's own choice (``backend`` ``default``, with ``chosen`` the backend
``torch._fused_sdp_choice`` names) and under flash and cuDNN forced. The eager profile priced
FlashAttention-2 there, 1.5-2x the time of the cuDNN kernel that SDPA runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import attention_impl, compute_time
from stg.perf.kernel_time import attention_kernel_for, attention_time
from stg.perf.system import SystemDescriptionError, load_system

DATA = Path(__file__).resolve().parent / "data" / "kernels" / "h100-attention-gqa.jsonl"
CASES = [
    line["extra"]
    for line in map(json.loads, DATA.read_text().splitlines())
    if "extra" in line
]
H100 = load_system("h100-80g")
KERNELS = {"flash": "flash2", "cudnn": "cudnn"}
LONG = 4096
"""From this many tokens a call is the GPU's time; shorter ones wait on eager launches."""


def test_the_eager_profile_runs_what_sdpa_chose() -> None:
    chosen = {case["chosen"] for case in CASES}
    assert chosen == {"cudnn"}, chosen
    assert attention_kernel_for("hopper", "eager") == KERNELS["cudnn"]
    # torch.compile as torchtitan runs it, and torchtitan's eager Llama of 2024: flash
    assert attention_kernel_for("hopper", "compiled") == "flash2"
    assert attention_kernel_for("hopper", "torchtitan") == "flash2"


def _ratios(backend: str, backward: bool) -> list[float]:
    key = "median_bwd_ms" if backward else "median_fwd_ms"
    out = []
    for case in CASES:
        if case["backend"] != backend or case["seq"] < LONG:
            continue
        kernel = KERNELS.get(backend) or KERNELS[case["chosen"]]
        predicted = attention_time(
            H100.gpu,
            kernel,
            case["b"],
            case["heads"],
            case["seq"],
            case["seq"],
            case["head_dim"],
            causal=True,
            backward=backward,
        )
        out.append(predicted / (case[key] * 1e-3))
    return out


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("backend", ["default", "flash", "cudnn"])
def test_grouped_query_heads_cost_what_their_query_heads_do(backend: str, backward: bool) -> None:
    """The model prices a call by its query heads: grouped-query calls (3 to 8 query heads a
    key/value head) are within its error of the full-head ones, at every head size (the
    worst: forced FlashAttention-2 at head size 80 and 128, 4k tokens, 0.71-0.73)."""
    ratios = _ratios(backend, backward)
    assert len(ratios) == 12
    assert 0.90 < statistics.median(ratios) < 1.10, ratios
    assert 0.70 < min(ratios) and max(ratios) < 1.20, ratios


def test_sdpa_s_choice_is_cudnn_s_time_not_flash_s() -> None:
    """What eager SDPA runs takes cuDNN's time: 0.5-0.7 of FlashAttention-2's at 4k-8k tokens."""
    default = {
        (c["model"], c["seq"]): c["median_fwd_ms"] + c["median_bwd_ms"]
        for c in CASES
        if c["backend"] == "default" and c["seq"] >= LONG
    }
    flash = {
        (c["model"], c["seq"]): c["median_fwd_ms"] + c["median_bwd_ms"]
        for c in CASES
        if c["backend"] == "flash" and c["seq"] >= LONG
    }
    assert all(0.45 < default[k] / flash[k] < 0.75 for k in default), (default, flash)


def test_an_eager_step_prices_its_attention_as_cudnn() -> None:
    """A generated eager step's attention nodes on an H100 cost the cuDNN kernel's time."""
    options = GenerateOptions(
        model="llama", dmodel=2048, dff=8192, head=32, kvhead=8, seq=8192, dvocal=1000,
        num_stacks=1, batch=1, mixed_precision=True, dtype="bf16", causal=True,
        profile="eager",
    )  # fmt: skip
    nodes = list(build_workload(options, load_registry(autoload=False)).ranks[0].nodes())
    fused = [n for n in nodes if "attention" in (getattr(n, "attrs", None) or {})]
    assert len(fused) == 2
    for node in fused:
        backward = bool(node.attrs["attention"][6])
        cudnn = attention_time(
            H100.gpu, "cudnn", 1, 32, 8192, 8192, 64, causal=True, backward=backward
        )
        seconds = compute_time(node, H100, "bf16", profile="eager")
        assert seconds == pytest.approx(cudnn + H100.kernel_overhead, rel=0.02)


@pytest.mark.parametrize(
    ("system", "kernel"),
    [
        ("h100-80g", "cudnn"),
        ("h20-96g", "cudnn"),
        ("a100-80g", "flash2"),
        ("b200-180g", "cudnn"),
        ("gb200-nvl72", "cudnn"),
        ("b300-288g", "flash2"),
        ("gb300-nvl72", "flash2"),
        ("mi300x-192g", "ck"),
    ],
)
def test_the_eager_choice_follows_the_compute_capability(system: str, kernel: str) -> None:
    """PyTorch's rule (cuDNN first on compute capability 9.0 and 10.0) on each preset's
    capability (NVIDIA's CUDA GPUs page): a B300 or GB300 (10.3) runs FlashAttention-2."""
    assert attention_impl("eager", load_system(system)) == kernel


def test_a_blackwell_file_without_a_capability_keeps_the_architecture_s_entry(
    tmp_path: Path,
) -> None:
    preset = load_system("b200-180g").as_dict()
    assert preset["compute_capability"] == "10.0"
    del preset["compute_capability"]
    path = tmp_path / "blackwell.json"
    path.write_text(json.dumps(preset))
    assert attention_impl("eager", load_system(path)) == attention_kernel_for("blackwell", "eager")


@pytest.mark.parametrize("value", ["ten", 9.0, "9", "9.0.1"])
def test_a_compute_capability_is_a_major_minor_string(tmp_path: Path, value: object) -> None:
    preset = {**load_system("h100-80g").as_dict(), "compute_capability": value}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(SystemDescriptionError, match=r"compute_capability .* 'major\.minor'"):
        load_system(path)
