"""``--profile compiled``: PyTorch under ``torch.compile`` as torchtitan runs it. Elementwise
chains are fused as under the megatron profile; attention goes through SDPA with torchtitan's
backend order (FlashAttention-2, cuDNN's first only on Blackwell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.core.options import GenerateOptions
from stg.core.plan import make_plan
from stg.core.workload import NodeTemplate, NodeType
from stg.errors import UserError
from stg.perf.costs import attention_impl, compute_time
from stg.perf.system import load_system

DATA = Path(__file__).parent / "data"
RUNS = DATA / "runs" / "cluster_runs.json"
KERNELS = DATA / "kernels" / "h200-attention.jsonl"


@pytest.mark.parametrize(
    ("system", "kernel"),
    [("h100-80g", "flash2"), ("h200-141g", "flash2"), ("a100-80g", "flash2"),
     ("l40s-48g", "flash2"), ("b200-180g", "cudnn"), ("mi300x-192g", "ck")],
)  # fmt: skip
def test_compiled_attention_is_torchtitans_sdpa_backend(system: str, kernel: str) -> None:
    assert attention_impl("compiled", load_system(system)) == kernel


def _attention_node(backward: bool = False) -> NodeTemplate:
    batch, heads, seq, head_dim = 2, 32, 8192, 128
    return NodeTemplate(
        id=0,
        name="core_attention",
        type=NodeType.COMP,
        num_ops=4 * batch * heads * seq * seq * head_dim // 2,
        tensor_size=4 * batch * seq * heads * head_dim * 2,
        dtype="bf16",
        attrs={
            "op": "core_attention",
            "attention": (batch, heads, seq, seq, head_dim, True, backward),
        },
    )


def test_compiled_attention_on_hopper_is_slower_than_megatrons_cudnn() -> None:
    """On an H200 torchtitan's SDPA runs FlashAttention-2, which the H100 data puts at about
    0.54 of cuDNN's fused attention (328 against 613 TFLOP/s forward, d 128)."""
    system = load_system("h200-141g")
    node = _attention_node()
    compiled = compute_time(node, system, profile="compiled")
    megatron = compute_time(node, system, profile="megatron")
    assert compiled == pytest.approx(compute_time(node, system, profile="torchtitan"))
    assert compiled / megatron == pytest.approx(0.822 / 0.440, rel=0.02)


def test_compiled_attention_on_an_h200_as_measured() -> None:
    """The Trainy rows' attention (2 x 8,192 tokens, 32 heads of 128, causal) as SDPA's flash
    backend ran it on an H200 (tests/data/kernels/h200-attention.jsonl): 3.25 ms forward,
    9.48 ms backward; cuDNN's, which the megatron profile prices, ran 1.74 and 5.31."""
    rows = [json.loads(line) for line in KERNELS.read_text().splitlines()]
    system = load_system("h200-141g")
    shape = {"b": 2, "heads": 32, "seq": 8192, "head_dim": 128, "causal": True}
    measured = {
        row["extra"]["backend"]: row["extra"]
        for row in rows
        if "extra" in row and all(row["extra"].get(k) == v for k, v in shape.items())
    }
    for backward, field in ((False, "median_fwd_ms"), (True, "median_bwd_ms")):
        node = _attention_node(backward)
        compiled = compute_time(node, system, profile="compiled") * 1e3
        megatron = compute_time(node, system, profile="megatron") * 1e3
        assert compiled == pytest.approx(measured["flash"][field], rel=0.05)
        assert megatron == pytest.approx(measured["cudnn"][field], rel=0.10)


def test_compiled_fuses_as_megatron_does() -> None:
    """A forward bias add runs in its consumer's kernel under both fused profiles; eager
    PyTorch pays an op for it."""
    system = load_system("h100-80g")
    bias = NodeTemplate(
        id=0, name="fc1_bias", type=NodeType.COMP, num_ops=1 << 24, tensor_size=1 << 26,
        dtype="bf16", attrs={"op": "fc1_bias"},
    )  # fmt: skip
    assert compute_time(bias, system, profile="compiled") == 0.0
    assert compute_time(bias, system, profile="megatron") == 0.0
    assert compute_time(bias, system, profile="eager") > 0.0


def test_profile_is_validated_with_its_allowed_values() -> None:
    assert make_plan(GenerateOptions(model="llama", profile="compiled"))
    with pytest.raises(UserError, match="megatron, eager, compiled"):
        make_plan(GenerateOptions(model="llama", profile="inductor"))


COMPILE_SWITCHES = ("--training.compile on", "enable_compile True")
"""How a run's assumptions say it compiled its blocks: torchtitan's flag, NeMo AutoModel's
``distributed.enable_compile``."""


def test_torch_compile_rows_use_the_compiled_profile() -> None:
    """A published run whose assumptions say it ran ``torch.compile`` (:data:`COMPILE_SWITCHES`)
    is predicted under ``compiled``; the others (compile off) are not."""
    entries = json.loads(RUNS.read_text())["entries"]
    compiled = [
        e
        for e in entries
        if any(switch in a for a in e["assumptions"] for switch in COMPILE_SWITCHES)
    ]
    assert compiled
    for entry in compiled:
        assert entry["options"].get("profile") == "compiled", entry["id"]
    for entry in entries:
        if entry not in compiled:
            assert entry["options"].get("profile", "megatron") != "compiled", entry["id"]
