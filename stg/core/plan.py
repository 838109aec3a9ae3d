"""The parallel plan: degrees checked against the model, and layers assigned to stages.

Layers are split over the ``pp · virtual_stages`` model chunks as evenly as possible; when the
division is not exact the first ``num_stacks mod chunks`` chunks get one layer more. The
embedding runs on the first chunk (stage 0) and the LM head and loss on the last chunk (the
last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from stg.core.layout import AXES, parse_rank_order
from stg.core.options import GenerateOptions, OptionError
from stg.core.precision import DTYPE_BYTES
from stg.core.quantization import FORMAT_ONLY
from stg.core.routing import ROUTINGS

MAX_TAG = 500_000_000
RECOMPUTE = {
    "none": "none",
    "false": "none",
    "selective": "selective",
    "full": "full",
    "true": "full",
}


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees, micro-batching and the layer split of one run."""

    options: GenerateOptions
    degrees: dict[str, int]
    micro_batches: int
    chunks_per_stage: int
    layers_per_chunk: tuple[int, ...]
    recompute: str

    @property
    def precision(self) -> dict[str, str]:
        """Dtypes of the working weights and activations, the gradients (as accumulated and
        reduced), the master weights and the optimizer states. With mixed precision Megatron
        keeps fp32 master weights, main gradients and Adam states."""
        o = self.options
        mixed = o.mixed_precision
        grad = o.grad_reduce_dtype or ("fp32" if mixed else o.dtype)
        return {
            "weight": o.dtype,
            "grad": grad,
            "master": "fp32" if mixed else o.dtype,
            "optimizer": "fp32" if mixed else o.dtype,
        }

    @property
    def stages(self) -> int:
        return self.degrees["pp"]

    @property
    def active_axes(self) -> frozenset[str]:
        return frozenset(a for a, d in self.degrees.items() if d > 1)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Axes that split the batch: data parallelism, and expert parallelism outside experts."""
        return ("dp", "ep")

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """Axes that split the sequence of the residual stream between layers."""
        return ("sp", "tp") if self.options.tpsp else ("sp",)

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """Axes over which ZeRO-1/2 shard gradients and optimizer states and FSDP (ZeRO-3) also
        the weights, as one flat padded buffer per part: the data-parallel ranks that hold
        the same weights, dp and sp (context-parallel ranks hold the same weights too, as
        Megatron's distributed optimizer and FSDP shard over its dp-cp group). The ep ranks
        keep their own copies of the non-expert shards (their gradients are all-reduced over
        ep), as in hybrid sharding."""
        return ("dp", "sp")

    @property
    def zero_degree(self) -> int:
        """How many ways ZeRO / FSDP split a part's flat buffer (1 without ZeRO or FSDP)."""
        o = self.options
        if not (o.zero or o.weight_sharded):
            return 1
        return prod(self.degrees[a] for a in self.zero_axes)

    @property
    def chunks(self) -> int:
        return self.stages * self.chunks_per_stage

    def chunk_layers(self, chunk: int) -> range:
        """Global indices of the layers of model chunk ``chunk`` (0 .. chunks-1)."""
        start = sum(self.layers_per_chunk[:chunk])
        return range(start, start + self.layers_per_chunk[chunk])

    def chunk_stage(self, chunk: int) -> int:
        return chunk % self.stages


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise OptionError(message)


def _check_phase(o: GenerateOptions) -> None:
    """The options of the serving phases (prefill, decode, mixed) against each other."""
    phases = GenerateOptions.PHASES
    _require(o.phase in phases, f"phase={o.phase!r} must be one of {', '.join(phases)}")

    def positive(name: str, value: object) -> None:
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{name}={value} must be a positive integer",
        )

    if o.phase == "training":
        for name, default in (
            ("context", None),
            ("steps", 1),
            ("kv_dtype", None),
            ("prefill_batch", 0),
            ("chunk", None),
            ("prefill_context", 0),
        ):
            value = getattr(o, name)
            _require(
                value == default,
                f"{name}={value} applies to the serving phases; allowed with it: "
                "--phase prefill, decode or mixed",
            )
        return
    training_only = (
        ("zero", o.zero != 0),
        ("weight_sharded", o.weight_sharded),
        ("mixed_precision", o.mixed_precision),
        ("activation_recompute", RECOMPUTE.get(str(o.activation_recompute).lower()) != "none"),
        ("grad_reduce_dtype", o.grad_reduce_dtype is not None),
        ("virtual_stages", o.virtual_stages != 1),
        ("amax_history", o.amax_history != GenerateOptions.amax_history),
    )
    for name, given in training_only:
        _require(
            not given,
            f"{name}={getattr(o, name)} is a training option; phase={o.phase} has no "
            "backward, gradients or optimizer (leave it unset)",
        )
    _require(
        o.kv_dtype is None or o.kv_dtype in DTYPE_BYTES,
        f"kv_dtype={o.kv_dtype!r} must be one of {', '.join(DTYPE_BYTES)}",
    )
    positive("steps", o.steps)
    _require(
        o.steps == 1 or o.phase == "decode",
        f"steps={o.steps} applies to phase=decode only (one iteration of {o.phase})",
    )
    if o.phase != "prefill":
        positive("context", o.context if o.context is not None else o.seq)
        _require(
            o.sp == 1,
            f"sp={o.sp} is not allowed with phase={o.phase}: context parallelism splits a "
            "prompt (phase=prefill); a decoding sequence has one new token",
        )
    else:
        _require(
            o.context is None,
            f"context={o.context} applies to phase=decode or mixed; a prefill writes the "
            "cache of its --seq prompt tokens",
        )
    if o.phase == "mixed":
        positive("prefill_batch", o.prefill_batch)
        positive("chunk", o.chunk if o.chunk is not None else o.seq)
        _require(
            isinstance(o.prefill_context, int) and o.prefill_context >= 0,
            f"prefill_context={o.prefill_context} must be a non-negative integer",
        )
        _require(
            o.micro_batch is None,
            f"micro_batch={o.micro_batch} is not allowed with phase=mixed: one continuously "
            "batched iteration runs all its requests at once (leave it unset)",
        )
        replicas = o.dp * o.ep
        _require(
            o.prefill_batch % replicas == 0,
            f"dp·ep={replicas} must divide prefill_batch={o.prefill_batch} "
            "(each replica serves whole requests)",
        )
    else:
        for name, default in (("prefill_batch", 0), ("chunk", None), ("prefill_context", 0)):
            value = getattr(o, name)
            _require(
                value == default, f"{name}={value} applies to phase=mixed only (not {o.phase})"
            )


def make_plan(o: GenerateOptions) -> ParallelPlan:
    """Check the options against each other and derive the plan; raise OptionError otherwise."""
    _check_phase(o)
    degrees = {"dp": o.dp, "tp": o.tp, "sp": o.sp, "pp": o.pp, "ep": o.ep}
    for axis in AXES:
        _require(
            isinstance(degrees[axis], int) and degrees[axis] >= 1,
            f"{axis}={degrees[axis]} must be a positive integer",
        )
    for name in (
        "dvocal",
        "dmodel",
        "dff",
        "batch",
        "seq",
        "head",
        "kvhead",
        "num_stacks",
        "experts",
        "kexperts",
    ):
        value = getattr(o, name)
        _require(
            isinstance(value, int) and value >= 1, f"{name}={value} must be a positive integer"
        )
    allowed_micro = f"allowed: a positive divisor of batch={o.batch}, or -1 (the whole batch)"
    _require(
        o.micro_batch is None or (isinstance(o.micro_batch, int) and o.micro_batch >= 1),
        f"micro_batch={o.micro_batch} is not allowed; {allowed_micro}",
    )
    micro_batch = o.batch if o.micro_batch is None else o.micro_batch
    _require(
        o.batch % micro_batch == 0,
        f"micro_batch={micro_batch} must divide batch={o.batch}; {allowed_micro}",
    )
    replicas = o.dp * o.ep
    _require(
        micro_batch % replicas == 0,
        f"dp·ep={replicas} must divide micro_batch={micro_batch} "
        "(each data-parallel replica needs whole samples)",
    )
    if o.dhead is None:  # the head size is dmodel / head
        _require(o.dmodel % o.head == 0, f"head={o.head} must divide dmodel={o.dmodel}")
    else:
        _require(
            isinstance(o.dhead, int) and not isinstance(o.dhead, bool) and o.dhead >= 1,
            f"dhead={o.dhead} must be a positive integer (or unset: dmodel/head)",
        )
    for name in ("shared_experts", "dense_layers", "dense_dff", "q_lora_rank", "kv_lora_rank",
                 "drope", "mtp_depth"):  # fmt: skip
        value = getattr(o, name)
        least = 0 if name in ("shared_experts", "dense_layers", "mtp_depth") else 1
        _require(
            value is None
            or (isinstance(value, int) and not isinstance(value, bool) and value >= least),
            f"{name}={value} must be an integer >= {least} (or unset)",
        )
    _require(o.head % o.kvhead == 0, f"kvhead={o.kvhead} must divide head={o.head}")
    _require(o.head % o.tp == 0, f"tp={o.tp} must divide head={o.head}")
    _require(o.dff % o.tp == 0, f"tp={o.tp} must divide dff={o.dff}")
    _require(o.dvocal % o.tp == 0, f"tp={o.tp} must divide dvocal={o.dvocal}")
    seq_split = o.sp * (o.tp if o.tpsp else 1)
    what = "tp·sp" if o.tpsp and o.tp > 1 else "sp"
    _require(o.seq % seq_split == 0, f"{what}={seq_split} must divide seq={o.seq}")
    _require(o.virtual_stages >= 1, f"virtual_stages={o.virtual_stages} must be a positive integer")
    chunks = o.pp * o.virtual_stages
    _require(
        chunks <= o.num_stacks,
        f"pp={o.pp}"
        + (f"·virtual_stages={o.virtual_stages}" if o.virtual_stages > 1 else "")
        + f" must not exceed num_stacks={o.num_stacks}",
    )
    _require(
        o.attention in GenerateOptions.ATTENTION,
        f"attention={o.attention!r} must be one of {', '.join(GenerateOptions.ATTENTION)}",
    )
    _require(
        isinstance(o.dropout, int | float)
        and not isinstance(o.dropout, bool)
        and 0 <= o.dropout < 1,
        f"dropout={o.dropout!r} must be a rate in [0, 1) (0: no dropout)",
    )
    _require(
        isinstance(o.amax_history, int) and not isinstance(o.amax_history, bool)
        and o.amax_history >= 1,
        f"amax_history={o.amax_history!r} must be a positive integer (Transformer Engine's "
        "amax history length per fp8 tensor; default 1024)",
    )
    _require(
        o.profile in GenerateOptions.PROFILES,
        f"profile={o.profile!r} must be one of {', '.join(GenerateOptions.PROFILES)}",
    )
    recompute = RECOMPUTE.get(str(o.activation_recompute).lower())
    _require(
        recompute is not None,
        f"activation_recompute={o.activation_recompute!r} must be one of none, selective, full",
    )
    _require(o.dtype in DTYPE_BYTES, f"dtype={o.dtype!r} must be one of {', '.join(DTYPE_BYTES)}")
    formats = [f"{op}: {value}" for op, value in o.precision if value in FORMAT_ONLY]
    _require(
        o.inference or not formats,
        f"precision plan entry {formats[0] if formats else ''} names a serving weight format "
        f"(phase prefill, decode, mixed); a training plan names dtypes: {', '.join(DTYPE_BYTES)}",
    )
    _require(
        o.grad_reduce_dtype is None or o.grad_reduce_dtype in DTYPE_BYTES,
        f"grad_reduce_dtype={o.grad_reduce_dtype!r} must be one of {', '.join(DTYPE_BYTES)}",
    )
    _require(
        o.zero in (0, 1, 2, 3),
        f"zero={o.zero} is not allowed; allowed: 0, 1, 2, 3 (3 = weight_sharded=true)",
    )
    _require(
        not (o.zero and o.weight_sharded),
        f"zero={o.zero} cannot be combined with weight_sharded "
        "(which already shards everything, ZeRO-3)",
    )
    allowed = GenerateOptions.RESHARD_AFTER_FORWARD
    _require(
        o.reshard_after_forward in allowed,
        f"reshard_after_forward={o.reshard_after_forward!r} must be one of {', '.join(allowed)}",
    )
    _require(
        o.reshard_after_forward == "default" or o.weight_sharded,
        f"reshard_after_forward={o.reshard_after_forward} is FSDP's policy for gathered "
        "weights: it needs weight_sharded=true (or zero=3)",
    )
    _require(
        not o.overlap_param_gather or o.zero in (1, 2),
        f"overlap_param_gather=true needs the distributed optimizer's parameter all-gather: "
        f"zero={o.zero}{' (weight_sharded)' if o.weight_sharded else ''} is not allowed; "
        "allowed: zero=1 or zero=2",
    )
    _require(
        not o.overlap_param_gather or o.dp * o.sp > 1,
        "overlap_param_gather=true needs dp·sp > 1 (with one replica there is no parameter "
        "all-gather to overlap)",
    )
    _require(
        not o.tp_comm_overlap or (o.tp > 1 and o.tpsp),
        f"tp_comm_overlap=true overlaps sequence parallelism's all-gathers and reduce-scatters "
        f"with their GEMMs: tp={o.tp}, tpsp={str(o.tpsp).lower()} is not allowed; "
        "allowed: tp > 1 with tpsp=true",
    )
    _require(
        not o.tp_comm_overlap or o.profile == "megatron",
        f"tp_comm_overlap=true is Transformer Engine's userbuffers overlap: profile={o.profile} "
        "is not allowed; allowed: profile=megatron",
    )
    _require(o.kexperts <= o.experts, f"kexperts={o.kexperts} must not exceed experts={o.experts}")
    _require(o.capacity_factor > 0, f"capacity_factor={o.capacity_factor} must be positive")
    _require(
        o.moe_routing in ROUTINGS,
        f"moe_routing={o.moe_routing!r} must be one of {', '.join(ROUTINGS)}",
    )
    _require(
        o.moe_routing == "capacity" or o.capacity_factor == 1,
        f"capacity_factor={o.capacity_factor} caps tokens only under moe_routing=capacity: "
        "moe_routing=dropless drops no token; allowed: capacity_factor=1 with dropless",
    )
    if o.virtual_stages > 1:
        _require(
            o.pipeline_schedule == "interleaved",
            f"virtual_stages={o.virtual_stages} needs pipeline_schedule=interleaved",
        )
    if o.pipeline_schedule == "interleaved":
        _require(o.pp > 1, "pipeline_schedule=interleaved needs pp > 1")
        m = o.batch // micro_batch
        _require(
            m % o.pp == 0,
            f"pipeline_schedule=interleaved needs the number of micro-batches ({m}) "
            f"divisible by pp={o.pp}",
        )
    parse_rank_order(o.rank_order)
    m = o.batch // micro_batch
    _require(
        2 * m * chunks < MAX_TAG, f"too many micro-batches ({m}) for send/recv tags below {MAX_TAG}"
    )
    base, extra = divmod(o.num_stacks, chunks)
    layers = tuple(base + (1 if c < extra else 0) for c in range(chunks))
    _require(prod(degrees.values()) >= 1, "world size must be positive")
    return ParallelPlan(o, degrees, m, o.virtual_stages, layers, recompute)
