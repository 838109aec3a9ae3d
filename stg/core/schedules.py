"""Built-in pipeline schedules: 1F1B (default), GPipe and interleaved 1F1B.

A schedule orders one stage's steps ``(direction, micro_batch, chunk)``; lowering turns the
order into ctrl deps so that a simulator follows it. Chunks are the model pieces a stage holds
(more than one only with virtual stages).
"""

from __future__ import annotations

from stg import hookimpl
from stg.host.records import PipelineSchedule

Step = tuple[str, int, int]


def one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """Non-interleaved 1F1B (PipeDream-Flush, Megatron's default): stage ``i`` runs
    ``min(stages - i - 1, m)`` warm-up forwards, then alternates one forward and one backward,
    then drains the remaining backwards."""
    warmup = min(stages - stage - 1, micro_batches)
    order: list[Step] = [("F", mb, 0) for mb in range(warmup)]
    for mb in range(warmup, micro_batches):
        order.append(("F", mb, 0))
        order.append(("B", mb - warmup, 0))
    order.extend(("B", mb, 0) for mb in range(micro_batches - warmup, micro_batches))
    return order


def gpipe(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """GPipe: every forward, then every backward (in reverse micro-batch order, as the
    activations of the last micro-batch are the freshest)."""
    return [("F", mb, 0) for mb in range(micro_batches)] + [
        ("B", mb, 0) for mb in reversed(range(micro_batches))
    ]


def interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> list[Step]:
    """Interleaved 1F1B (Narayanan et al. 2021): each stage holds ``chunks`` model chunks and
    runs micro-batches in groups of ``stages`` per chunk. Needs ``micro_batches % stages == 0``."""
    total = micro_batches * chunks
    group = stages * chunks

    def forward_step(k: int) -> Step:
        chunk = (k % group) // stages
        return ("F", (k // group) * stages + k % stages, chunk)

    def backward_step(k: int) -> Step:
        chunk = chunks - 1 - (k % group) // stages
        return ("B", (k // group) * stages + k % stages, chunk)

    if micro_batches == stages:
        warmup = total
    else:
        warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order: list[Step] = [forward_step(k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(forward_step(warmup + k))
        order.append(backward_step(k))
    order.extend(backward_step(k) for k in range(total - warmup, total))
    return order


def ep_overlap_groups(order: list[Step]) -> list[tuple[Step, ...]]:
    """A stage's ``order`` as Megatron-core runs it under ``--overlap-moe-expert-parallel-comm``
    (``combined_1f1b.py`` and ``schedules.py``, NVIDIA/Megatron-LM at d98e8a6): one more
    warm-up forward than the schedule has (``get_pp_rank_microbatches``: "one extra micro-batch
    forward step before the 1f1b stages ... to ensure the forward and backward computations are
    independent"; with pp = 1, micro-batch 0's forward alone), then each steady-state forward
    paired with the backward the schedule runs next, as one combined step ``(F, B)``, then the
    remaining backwards alone. Forwards and backwards keep their own order."""
    forwards = [s for s in order if s[0] == "F"]
    backwards = [s for s in order if s[0] == "B"]
    # the schedule's warm-up forwards and the forward its steady state starts with
    alone = next((i for i, s in enumerate(order) if s[0] == "B"), len(order))
    paired = min(len(forwards) - alone, len(backwards))
    groups: list[tuple[Step, ...]] = [(f,) for f in forwards[:alone]]
    groups.extend((forwards[alone + k], backwards[k]) for k in range(paired))
    groups.extend((b,) for b in backwards[paired:])
    return groups


@hookimpl
def stg_register_parallelisms(register):  # type: ignore[no-untyped-def]
    register(
        PipelineSchedule(
            "1f1b", one_f_one_b, "1F1B (PipeDream-Flush): warm-up, steady 1F1B, cool-down"
        )
    )
    register(PipelineSchedule("gpipe", gpipe, "GPipe: all forwards, then all backwards"))
    register(
        PipelineSchedule(
            "interleaved",
            interleaved,
            "interleaved 1F1B over --virtual_stages model chunks per stage (Megatron)",
            supports_chunks=True,
        )
    )
