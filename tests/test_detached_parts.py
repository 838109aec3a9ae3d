"""Bound parts detached from their symbolic graph (stg.core.pipeline.detached_parts): a
workload lowered from them, as the time predictor does from its cache on disk, is the one
built from the options, node for node."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, detached_parts
from stg.core.sizes import estimate_size
from stg.host.registry import load_registry

REGISTRY = load_registry()


def nodes_of(workload: Any) -> list[tuple[Any, ...]]:
    """Every field of every node template (a dataclass), its attributes by their repr."""
    out = []
    for rank_class in workload.rank_classes:
        for n in rank_class.nodes:
            fields = dataclasses.asdict(n)
            fields["attrs"] = sorted((k, repr(v)) for k, v in (n.attrs or {}).items())
            out.append(tuple(sorted(fields.items())))
    return out


CASES = [
    (dict(model="gpt", dmodel=256, dff=1024, head=4, kvhead=4, num_stacks=8, seq=128,
          dvocal=1000, tp=2, pp=4, dp=2, micro_batch=2, batch=32), 6),
    (dict(model="llama", dmodel=256, dff=1024, head=8, kvhead=4, num_stacks=4, seq=128,
          dvocal=1000, tp=2, pp=2, dp=2, micro_batch=2, batch=16, weight_sharded=True,
          activation_recompute="full"), 4),
    (dict(model="moe", dmodel=256, dff=512, head=4, kvhead=4, num_stacks=4, seq=128,
          dvocal=1000, pp=2, dp=4, ep=2, experts=8, kexperts=2, micro_batch=8, batch=64), 4),
    (dict(model="deepseek", dmodel=256, num_stacks=4, seq=128, pp=2, dp=2, ep=2,
          micro_batch=4, batch=32, optimizer="muon", zero=1), 3),
    (dict(model="gpt", dmodel=256, dff=1024, head=4, kvhead=4, num_stacks=8, seq=128,
          dvocal=1000, pp=4, micro_batch=1, batch=16, pipeline_schedule="interleaved",
          virtual_stages=2), 12),
    (dict(model="llama", dmodel=256, dff=1024, head=8, kvhead=8, num_stacks=4, seq=256,
          dvocal=1000, tp=2, sp=2, pp=2, micro_batch=1, batch=8, dtype="fp8",
          mixed_precision=True), 4),
]  # fmt: skip


@pytest.mark.parametrize(("options", "lowered"), CASES, ids=[c["model"] for c, _ in CASES])
def test_a_workload_lowered_from_detached_parts_is_the_built_one(
    options: dict[str, Any], lowered: int
) -> None:
    o = GenerateOptions(**options)
    parts = pickle.loads(pickle.dumps(detached_parts(o, REGISTRY)))  # as the cache keeps them
    assert all(bp.part is None for bp in (parts.embedding, parts.block, parts.head))
    whole = build_workload(o, REGISTRY)
    again = build_workload(o, REGISTRY, parts=parts)
    assert nodes_of(again) == nodes_of(whole)
    assert again.comm_groups == whole.comm_groups and again.metadata == whole.metadata
    cut = build_workload(o, REGISTRY, lowered_micro_batches=lowered, parts=parts)
    assert nodes_of(cut) == nodes_of(build_workload(o, REGISTRY, lowered_micro_batches=lowered))
    # the size estimate from the parts (of the options with another batch too) is the built one
    for batch in (o.batch, lowered * o.micro_batch):
        shorter = GenerateOptions(**{**options, "batch": batch})
        assert estimate_size(shorter, REGISTRY, parts) == estimate_size(shorter, REGISTRY)


@pytest.mark.parametrize(
    "extra",
    [{"precision": (("fc1", "fp8"),)}, {"phase": "decode", "context": 64}],
    ids=["precision plan", "serving"],
)
def test_no_detached_parts_where_a_build_needs_more(extra: dict[str, Any]) -> None:
    small = dict(model="gpt", dmodel=256, dff=1024, head=4, kvhead=4, num_stacks=2, seq=128,
                 dvocal=1000)  # fmt: skip
    o = GenerateOptions(**small, **extra)
    assert detached_parts(o, REGISTRY) is None
    parts = detached_parts(GenerateOptions(**small), REGISTRY)
    with pytest.raises(ValueError, match="detached_parts"):
        build_workload(o, REGISTRY, parts=parts)
