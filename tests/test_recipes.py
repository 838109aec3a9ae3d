"""Training recipes as real runs do them (issue 24, item 2).

- Context parallelism: Megatron-LM cuts the sequence into 2·cp chunks and gives rank i chunks
  i and 2cp-1-i, so every rank computes 1/cp of the causal attention, its diagonal blocks
  included. Doubling the context together with cp doubles a rank's attention, not 4x.
"""

from __future__ import annotations

import functools
import math

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import ATTENTION_BLOCK_ROWS
from stg.perf.system import load_system

# --- context parallelism: load-balanced causal attention ------------------------------------

GPT = dict(model="gpt", dvocal=1024, dmodel=1024, dff=4096, head=16, kvhead=16, num_stacks=2)
LLAMA = dict(model="llama", dvocal=1024, dmodel=1024, dff=2816, head=16, kvhead=4, num_stacks=2)
B = 2


@functools.cache
def attention_nodes(model: str, seq: int, cp: int) -> dict[str, object]:
    """Layer 0's fused attention nodes (forward, backward) of every rank class."""
    dims = GPT if model == "gpt" else LLAMA
    o = GenerateOptions(**dims, seq=seq, batch=B, micro_batch=B, sp=cp, causal=True)
    w = build_workload(o, load_registry(autoload=False))
    nodes = {}
    for rank in range(w.world_size):
        for n in w.ranks[rank].nodes():
            if n.name in ("mb0/layer0/fwd/core_attention", "mb0/layer0/bwd/core_attention.grad"):
                nodes[(rank, n.name.rsplit("/", 1)[-1])] = n
    return nodes


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("cp", [2, 4])
def test_causal_attention_flops_are_total_over_cp_per_rank(model: str, cp: int) -> None:
    """The causal attention core of one layer (fwd + bwd; VALIDATION.md's 12·B·s²·h/2 plus
    the softmax) summed over the cp ranks is the one-rank total; each rank holds 1/cp of it."""
    s = 2048
    whole = attention_nodes(model, s, 1)
    total = whole[(0, "core_attention")].num_ops + whole[(0, "core_attention.grad")].num_ops
    nodes = attention_nodes(model, s, cp)
    per_rank = [
        nodes[(r, "core_attention")].num_ops + nodes[(r, "core_attention.grad")].num_ops
        for r in range(cp)
    ]
    assert per_rank == [total // cp] * cp
    assert total % cp == 0


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("backward", [False, True])
def test_doubling_context_with_cp_doubles_attention_time(model: str, backward: bool) -> None:
    """cp 2 at 2s costs a rank about twice the attention time of cp 1 at s (the work is
    (2s)²/2/2 = s² against s²/2), not four times (full key blocks for the rank's queries)."""
    system = load_system("h100-80g")
    name = "core_attention.grad" if backward else "core_attention"
    one = compute_time(attention_nodes(model, 4096, 1)[(0, name)], system)
    for rank in range(2):
        two = compute_time(attention_nodes(model, 8192, 2)[(rank, name)], system)
        # about 2x (less by the per-block overheads, which do not grow); 4x before
        assert 1.7 < two / one < 2.1


def test_load_balanced_share_prices_blocks_up_to_the_diagonal() -> None:
    """A rank's share is q_blocks·(kv_blocks + 1)/2 blocks of work: 1/cp of the whole causal
    triangle n(n + 1)/2 with its diagonal, so cp ranks together do what one rank does."""
    system = load_system("h100-80g")
    s, cp = 8192, 4
    n = s // ATTENTION_BLOCK_ROWS
    one = attention_nodes("gpt", s, 1)[(0, "core_attention")]
    share = attention_nodes("gpt", s, cp)[(0, "core_attention")]
    assert share.attrs["causal_split"] == cp
    assert "causal_split" not in one.attrs
    blocks_share = (n // cp) * (n + 1) / 2
    assert blocks_share * cp == n * (n + 1) / 2
    overhead = system.kernel_overhead
    ratio = (compute_time(share, system) - overhead) / (compute_time(one, system) - overhead)
    # equal work per block; only the per-wave overheads and wave rounding differ
    assert ratio == pytest.approx(1 / cp, rel=0.03)
    assert math.isclose(ratio * cp, 1.0, rel_tol=0.03)
