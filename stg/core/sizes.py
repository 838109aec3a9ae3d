"""How large a workload will be, known before it is built: nodes, memory and disk.

:func:`estimate_size` counts the node templates that lowering will emit for every pipeline
stage from the bound model parts (one block per kind of layer: cheap whatever the number of
layers) and the plan (micro-batches, chunks, decode steps), without lowering anything;
:func:`check_size` refuses, with one line, a workload that would not fit in the memory this
process can still take, or that has more nodes than a given limit.

The count follows :func:`stg.core.lowering.lower_stage` (and, for serving phases,
:func:`stg.core.inference.lower_inference_stage`): every micro-batch runs each chunk of a
stage forward and backward once, whatever the order of the schedule. Where the builder adds a
node only in some cases (a pipeline transfer, an fp8 amax reduction) the count assumes it
does, so the estimate is an upper bound within a few percent.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from stg.core.lowering import BoundPart, ModelParts
from stg.core.muon import MuonMatrices, node_count
from stg.core.options import GenerateOptions
from stg.core.plan import ParallelPlan, make_plan, recompute_tags
from stg.core.precision import normalize_plan, plan_for_group
from stg.errors import UserError

if TYPE_CHECKING:
    from stg.host.registry import Registry

# Calibration (measured on CPython 3.11, x86-64): the peak resident set (ru_maxrss) of one
# process before and after building a workload, writing its chakra-v0.0.4 files and running
# the time predictor on it, divided by its node templates, was 1,030 bytes (llama, 128
# layers, dp 2, pp 2, 64 micro-batches: 345,092 templates); tracemalloc's peak of the same
# over ten plans (gpt, llama, moe; dp/tp/pp/ep up to 4, ZeRO-3, full and selective
# recompute, fp8, interleaving, decode and prefill) gave 720-1,000 bytes per template, the
# ranks' share 240-480 bytes per rank (gpt, 2 layers, dp up to 4,096, tp 8), and the rank
# files 43-58 bytes per node in v0.0.1. chakra-v0.0.4 and json rank files, with the typed
# attributes as int64 codes and the op left to the name (stg.core.workload), took 160-168 and
# 366-397 bytes per node: benchmarks/trace_size.py (gpt 8 layers dp2 tp2 pp2 8 micro-batches,
# llama3-8b 4 layers dp2 tp2 pp2 in bf16 and fp8) and the same summary of stg generate for
# moe (ep 2, tp 2), gpt under ZeRO-3 with full recompute, and llama3-8b decode and prefill.
# The constants below are those, rounded up by about a quarter.
BYTES_PER_TEMPLATE = 1300
"""Memory of one node template of a rank class while the workload is built, its rank files
written or its time predicted (the template, its name, deps and attributes, the writer's
encoding, the predictor's replay)."""
BYTES_PER_RANK = 600
"""Memory of one rank of the workload (its graph view, layout entries, comm groups)."""
DISK_BYTES_PER_NODE = {"chakra-v0.0.4": 210, "chakra-v0.0.1": 72, "json": 500}
"""Bytes one node takes in a rank file, per format (another emitter: the largest)."""
AMAX_NODES = 3
"""Nodes of one fp8 amax reduction: concatenation, all-reduce, history and scale update."""


@dataclass(frozen=True)
class WorkloadSize:
    """The estimated size of a workload: ``nodes`` over every rank (what its rank files hold),
    ``templates`` held in memory (one set per rank class), and the bytes these take."""

    nodes: int
    templates: int
    ranks: int
    memory_bytes: int
    disk_bytes: int


def estimate_size(
    options: GenerateOptions, registry: Registry, parts: ModelParts | None = None
) -> WorkloadSize:
    """The size of the workload of ``options``, from its plan and bound model parts
    (``parts``: :func:`stg.core.pipeline.detached_parts` of options that differ at most in
    the batch, where known; else built); raises what
    :func:`stg.core.pipeline.validate_options` raises on bad options."""
    from stg.core.validation import validate_options

    plan = validate_options(options, registry)
    if parts is not None:  # detached parts: one variant, training (parts_detach)
        return _sized(options, plan, _stage_templates(parts, plan), 1)
    model = registry.models.get(options.model)
    variants = _precision_variants(options)
    per_stage = [0] * plan.stages
    for precision in variants:
        o = replace(options, precision=precision, placement=())
        variant_plan = plan if o == options else make_plan(o)
        if o.inference:
            counts = _inference_templates(model, variant_plan)
        else:
            counts = _training_templates(model, variant_plan, bool(options.placement))
        per_stage = [max(a, b) for a, b in zip(per_stage, counts, strict=True)]
    return _sized(options, plan, per_stage, len(variants))


def _sized(
    options: GenerateOptions, plan: ParallelPlan, per_stage: list[int], variants: int
) -> WorkloadSize:
    """The size of a workload of ``per_stage`` templates per stage, one set per variant."""
    ranks = options.world_size
    nodes = sum(per_stage) * (ranks // plan.stages)
    templates = sum(per_stage) * variants
    disk = DISK_BYTES_PER_NODE.get(options.format, max(DISK_BYTES_PER_NODE.values()))
    return WorkloadSize(
        nodes=nodes,
        templates=templates,
        ranks=ranks,
        memory_bytes=templates * BYTES_PER_TEMPLATE + ranks * BYTES_PER_RANK,
        disk_bytes=nodes * disk,
    )


def _precision_variants(options: GenerateOptions) -> list[tuple[tuple[str, str], ...]]:
    """The precision plans the ranks run: one per device group's plan (hybrid), else one."""
    precision = normalize_plan(options.precision)
    if not options.placement:
        return [precision]
    return list(dict.fromkeys(plan_for_group(precision, g) for g, _ in options.placement))


def _training_templates(model: object, plan: ParallelPlan, hybrid: bool) -> list[int]:
    """Node templates of each stage of a training iteration (see the module docstring)."""
    from stg.core.pipeline import build_parts

    return _stage_templates(build_parts(model, plan, hybrid), plan)  # type: ignore[arg-type]


def _stage_templates(parts: ModelParts, plan: ParallelPlan) -> list[int]:
    """:func:`_training_templates` of model parts bound already."""
    o = plan.options
    m = plan.micro_batches
    fp8 = o.te_delayed_scaling and _has_fp8(parts)
    full = plan.recompute == "full"
    modules = recompute_tags(o)

    def forward(bp: BoundPart) -> int:
        return len(bp.forward)

    def backward(bp: BoundPart, recompute: str) -> int:
        nodes = len(bp.repeated_before_backward(recompute, modules)) + len(bp.backward)
        if fp8 and full and bp.fp8_gemms:  # a recomputed layer reduces per fp8 module
            nodes += AMAX_NODES * (1 + len(bp.fp8_module_ends()))
        return nodes

    def once(bp: BoundPart, recompute: str) -> int:
        return len(bp.reduce) + len(bp.update) - fsdp_skipped(bp, recompute)

    pipelined = plan.stages > 1

    def fsdp_skipped(bp: BoundPart, recompute: str) -> int:
        """FSDP collectives of one part that lowering leaves out of the m micro-batches
        counted above: the weight gathers while its weights stay gathered and, under pipeline
        parallelism, the gradient reduce-scatters of all but the last micro-batch (with
        ``always`` the gathers that a preceding backward makes unnecessary still count: a
        bound)."""
        gathers = sum(1 for op in bp.forward if "weight_gather" in op.tags)
        repeated = sum(
            1
            for op in bp.repeated_before_backward(recompute, modules)
            if "weight_gather" in op.tags
        )
        reduces = sum(1 for op in bp.backward if "weight_grad_reduce" in op.tags)
        skipped = (m - 1) * reduces if pipelined else 0
        if not o.reshards_after_forward:
            skipped += m * repeated + ((m - 1) * gathers if pipelined else 0)
        return skipped

    counts = [1] * plan.stages  # the optimizer step
    replicated: set[int] = set()  # stages with one tp all-reduce of replicated gradients
    muon: list[list[MuonMatrices]] = [[] for _ in range(plan.stages)]  # Muon's, per stage
    for chunk in range(plan.chunks):
        stage = plan.chunk_stage(chunk)
        first, last = chunk == 0, chunk == plan.chunks - 1
        per_mb = 0
        for kind, layers in _chunk_kinds(plan, parts, chunk):
            bp = parts.blocks.get(kind, parts.block)
            per_mb += layers * (forward(bp) + backward(bp, plan.recompute))
            counts[stage] += layers * once(bp, plan.recompute)
            if layers:
                muon[stage] += bp.muon
            if layers and bp.tp_replicated_reduce:
                replicated.add(stage)
        for end, bp in ((first, parts.embedding), (last, parts.head)):
            if end:
                per_mb += forward(bp) + backward(bp, "none")
                counts[stage] += once(bp, "none")
                muon[stage] += bp.muon  # a head's matrices beside its output layer (MTP)
                if bp.tp_replicated_reduce:
                    replicated.add(stage)
        per_mb += 2 * ((not first) + (not last))  # receives and sends, forward and backward
        if fp8:
            per_mb += 2 * AMAX_NODES  # the forward and the backward amax reduction
        per_mb += 2 * o.cpu_offloading_num_layers  # an offloaded layer's two host copies
        counts[stage] += m * per_mb
    for stage in replicated:
        counts[stage] += 1
    for stage, matrices in enumerate(muon):
        counts[stage] += node_count(matrices)
    return counts


def _inference_templates(model: object, plan: ParallelPlan) -> list[int]:
    """Node templates of each stage of a serving run: every step runs each micro-batch
    forward through the stage (one step is bound to count them: the others are alike)."""
    from stg.core.inference import build_steps

    o = plan.options
    steps = o.steps if o.phase == "decode" else 1
    probe = plan if steps == 1 else replace(plan, options=replace(o, steps=1))
    parts = build_steps(model, probe)[0].parts  # type: ignore[arg-type]
    counts = []
    for stage in range(plan.stages):
        first, last = stage == 0, stage == plan.chunks - 1
        per_mb = sum(
            layers * len(parts.blocks.get(kind, parts.block).forward)
            for kind, layers in _chunk_kinds(plan, parts, stage)
        )
        per_mb += len(parts.embedding.forward) if first else 0
        per_mb += len(parts.head.forward) if last else 0
        per_mb += 4  # activations in and out, sampled tokens back to the first stage
        counts.append(steps * plan.micro_batches * per_mb)
    return counts


def _chunk_kinds(plan: ParallelPlan, parts: ModelParts, chunk: int) -> list[tuple[str, int]]:
    """``(kind, layers)`` of the layers of one model chunk."""
    layers = plan.chunk_layers(chunk)
    kinds = parts.layer_kinds
    runs = kinds.runs() if hasattr(kinds, "runs") else [(k, 1) for k in kinds]
    out: list[tuple[str, int]] = []
    start = 0
    for kind, count in runs:
        overlap = min(layers.stop, start + count) - max(layers.start, start)
        if overlap > 0:
            out.append((kind, overlap))
        start += count
    return out


def _has_fp8(parts: ModelParts) -> bool:
    bound = (parts.embedding, parts.head, *parts.blocks.values())
    return any(bp.fp8_gemms for bp in bound)


# -- what this process can still take ---------------------------------------------------------


def available_memory() -> int:
    """Bytes this process can still allocate: the machine's available memory
    (``MemAvailable``), bounded by a cgroup's memory limit and the address-space limit
    (``ulimit -v``) where they are lower."""
    limits = [_mem_available()]
    cgroup = _cgroup_room()
    if cgroup is not None:
        limits.append(cgroup)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - _virtual_size()))
    return min(limits)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """The room left under this process's cgroup v2 memory limit, or None without one."""
    try:
        base = Path("/sys/fs/cgroup")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _virtual_size() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# -- refusing ---------------------------------------------------------------------------------


class WorkloadTooLarge(UserError):
    """A workload that would not fit in memory, or has more nodes than allowed."""


def check_size(
    size: WorkloadSize,
    max_nodes: int | None = None,
    available: int | None = None,
    *,
    option: str | None = "--max-nodes",
) -> None:
    """Raise :class:`WorkloadTooLarge` (one line: what it needs, what there is, what to
    lower) when ``size`` needs more than ``available`` bytes of memory (default: what this
    process can still take) or has more than ``max_nodes`` nodes; ``option`` names the
    command's option that sets ``max_nodes`` (None: the command has none)."""
    room = available_memory() if available is None else available
    over_memory = size.memory_bytes > room
    over_nodes = max_nodes is not None and size.nodes > max_nodes
    if not (over_memory or over_nodes):
        return
    if option is None:
        allowed = "what fits in memory"
    elif max_nodes is None:
        allowed = f"at most {option} N nodes (default N: what fits in memory)"
    else:
        allowed = f"at most {option} {max_nodes:,} nodes and what fits in memory"
    raise WorkloadTooLarge(
        f"this workload needs about {format_count(size.nodes)} nodes "
        f"(~{format_size(size.memory_bytes)} in memory, ~{format_size(size.disk_bytes)} on "
        f"disk); this machine has {format_size(room)} available; allowed: {allowed} — lower "
        "--num_stacks, the number of micro-batches (--batch / --micro_batch), the decode "
        "--steps or the ranks"
    )


def format_count(n: int) -> str:
    """``12,345`` below a million, ``4.1e+12`` above."""
    return f"{n:,}" if n < 1_000_000 else f"{n:.2g}"


def format_size(size: float) -> str:
    """``310 TiB``, ``22 GiB``, ``512 B``: two significant digits in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" or size >= 10 else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


__all__ = [
    "WorkloadSize",
    "WorkloadTooLarge",
    "available_memory",
    "check_size",
    "estimate_size",
]
