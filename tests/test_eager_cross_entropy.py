"""The eager profile's loss: ``F.cross_entropy(logits.float())`` as the kernels it runs.

An eager training script (``benchmarks/eager_step.py``, line ``F.cross_entropy(logits.float()
...)``) and Hugging Face's causal language models cast the bf16 logits to fp32 before the
loss, so the loss is three memory-bound kernels forward (the fp32 copy, ``_log_softmax``,
``nll_loss_forward``) and three backward (``nll_loss_backward``, ``_log_softmax_backward_data``,
the copy back to bf16) over the logits, not one pass over the bf16 logits. For a 151,936-word
vocabulary at 8,192 tokens that is 45 GB of traffic a step, about 11 ms on an H200, where stg
had priced 1.8 ms.
"""

from __future__ import annotations

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.torchtitan import EAGER_KERNEL_BYTES_ATTR, EAGER_KERNELS_ATTR
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system

TOKENS, VOCAB = 4096, 32000
LLAMA = dict(
    model="llama", dmodel=1024, dff=2816, head=8, kvhead=8, seq=TOKENS, dvocal=VOCAB,
    num_stacks=1, batch=1, mixed_precision=True, dtype="bf16", causal=True,
)  # fmt: skip


def _loss_nodes(profile: str) -> list:
    options = GenerateOptions(**LLAMA, profile=profile)
    nodes = build_workload(options, load_registry(autoload=False)).ranks[0].nodes()
    return [n for n in nodes if n.name.split("/")[-1].startswith("cross_entropy")]


def test_the_loss_runs_on_fp32_logits() -> None:
    forward, backward = _loss_nodes("eager")
    n = TOKENS * VOCAB
    f32, bf16, row = 4 * n, 2 * n, TOKENS * (4 + 8)
    assert forward.attrs[EAGER_KERNELS_ATTR] == ("convert:fp32", "log_softmax:fp32", "stream:fp32")
    assert forward.attrs[EAGER_KERNEL_BYTES_ATTR] == (bf16 + f32, 2 * f32, row + 8)
    assert backward.attrs[EAGER_KERNELS_ATTR] == (
        "stream:fp32",
        "log_softmax_backward:fp32",
        "convert:bf16",
    )
    assert backward.attrs[EAGER_KERNEL_BYTES_ATTR] == (f32 + row, 3 * f32, f32 + bf16)
    h200 = load_system("h200-141g")
    for node in (forward, backward):
        kinds, sizes = node.attrs[EAGER_KERNELS_ATTR], node.attrs[EAGER_KERNEL_BYTES_ATTR]
        kernels = zip(kinds, sizes, strict=True)
        expected = sum(
            memory_bound_time(h200.gpu, nbytes, kind.split(":")[0], kind.split(":")[1])
            + h200.kernel_overhead
            for kind, nbytes in kernels
        )
        assert compute_time(node, h200, "bf16", profile="eager") == pytest.approx(expected)


def test_a_fused_loss_keeps_its_one_pass() -> None:
    """Megatron's fused cross-entropy keeps one node of its own bytes."""
    nodes = _loss_nodes("megatron")
    assert nodes
    for node in nodes:
        assert EAGER_KERNELS_ATTR not in (node.attrs or {})
