"""Activations that ranks exchange in an fp8 training run travel in bf16.

Transformer Engine quantizes only the inputs of its fp8 GEMMs. The expert-parallel all-to-all
moves Megatron's permuted hidden states, which TE's GroupedLinear quantizes only after they
arrive, and the context-parallel exchange moves K and V for the attention core, which runs in
bf16 (stg/core/lowering.py, ``_recipe_collectives``, cites the sources). Before, stg sent both
at one byte per element, half what the recipes send.
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import MICRO_BATCH_ATTR, CollectiveType, NodeType, node_role
from stg.host.registry import load_registry

MOE = {"model": "moe", "dmodel": 256, "dff": 128, "head": 4, "kvhead": 2, "seq": 256,
       "dvocal": 512, "num_stacks": 1, "experts": 8, "kexperts": 2, "ep": 4, "dp": 4,
       "ep_layout": "fold", "batch": 4, "micro_batch": 4, "mixed_precision": True,
       "causal": True}  # fmt: skip
LLAMA_CP = {"model": "llama", "dmodel": 256, "dff": 512, "head": 4, "kvhead": 2, "seq": 1024,
            "dvocal": 512, "num_stacks": 1, "sp": 2, "batch": 1, "micro_batch": 1,
            "mixed_precision": True, "causal": True}  # fmt: skip


def _collectives(options: dict[str, Any], dtype: str) -> dict[str, Any]:
    workload = build_workload(GenerateOptions(**options, dtype=dtype), load_registry())
    return {n.name: n for n in workload.ranks[0].nodes() if n.type is NodeType.COMM_COLL}


EXCHANGES = (CollectiveType.ALL_TO_ALL, CollectiveType.ALL_GATHER, CollectiveType.REDUCE_SCATTER)


def _exchanges(options: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The activations one rank's micro-batches exchange: the all-to-alls, and the
    context-parallel ring's gathers and reduce-scatters (there is no tensor or sequence
    parallelism here), by their typed attributes; no bookkeeping (amax) reductions."""
    return {
        name: node
        for name, node in _collectives(options, dtype).items()
        if MICRO_BATCH_ATTR in node.attrs
        and node_role(node) is None
        and node.comm_type in EXCHANGES
    }


@pytest.mark.parametrize("options", [MOE, LLAMA_CP], ids=["expert-all-to-all", "context"])
def test_fp8_training_exchanges_the_bytes_of_bf16(options: dict[str, Any]) -> None:
    fp8, bf16 = _exchanges(options, "fp8"), _exchanges(options, "bf16")
    assert fp8 and fp8.keys() == bf16.keys()
    for name, node in fp8.items():
        assert node.comm_size == bf16[name].comm_size, name
        assert node.dtype == bf16[name].dtype, name


def test_tensor_parallel_gathers_stay_fp8() -> None:
    """TE gathers a sequence-parallel GEMM input after quantizing it: that stays one byte;
    the output layer, no TE module, gathers the final norm's output in bf16."""
    options = {**LLAMA_CP, "sp": 1, "tp": 2}
    fp8, bf16 = _collectives(options, "fp8"), _collectives(options, "bf16")
    gathers = [n for n in fp8 if "all_gather_tp:" in n and "/fwd/" in n]
    assert any("/layer0/" in n for n in gathers) and any("/head/" in n for n in gathers)
    for name in gathers:
        half = 2 if "/layer0/" in name else 1
        assert fp8[name].comm_size * half == bf16[name].comm_size, name
