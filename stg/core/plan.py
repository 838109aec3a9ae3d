"""The parallel plan: degrees checked against the model, and layers assigned to stages.

Layers are split over the ``pp · virtual_stages`` model chunks as evenly as possible; when the
division is not exact the first ``num_stacks mod chunks`` chunks get one layer more, unless
Megatron-LM's uneven split options or an explicit list say otherwise
(:func:`chunk_layer_counts`). The embedding runs on the first chunk (stage 0) and the LM head
and loss on the last chunk (the last stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import prod

from stg.core.layout import (
    AXES,
    UNFOLDED_AXIS_PARTS,
    FoldedMesh,
    Layout,
    LayoutError,
    fold_mesh,
    parse_rank_order,
)
from stg.core.muon import OPTIMIZERS
from stg.core.options import GenerateOptions, OptionError
from stg.core.precision import DTYPE_BYTES
from stg.core.quantization import FORMAT_ONLY
from stg.core.recipes import DEFAULT_RECIPE, FP8_ATTENTION_SCALING, PARAM_GATHER_RECIPES, RECIPES
from stg.core.routing import DISPATCHERS, GATES, NCCL_DISPATCHER, RANDOM_GATE, ROUTINGS
from stg.core.torchtitan import NORM_TYPES

MAX_TAG = 500_000_000
RECOMPUTE = {
    "none": "none",
    "false": "none",
    "selective": "selective",
    "selective_op": "selective_op",
    "full": "full",
    "true": "full",
}


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees, micro-batching and the layer split of one run.

    ``degrees`` are those of the mesh axes, in ``rank_order`` (fastest first): ``AXES``, or
    with expert parallelism folded (``ep_layout=fold``) the finer axes of
    :func:`stg.core.layout.fold_mesh`, which ``axis_parts`` maps every named axis (``tp``,
    ``ep``, ``etp``, ...) to."""

    options: GenerateOptions
    degrees: dict[str, int]
    micro_batches: int
    chunks_per_stage: int
    layers_per_chunk: tuple[int, ...]
    recompute: str
    axis_parts: Mapping[str, frozenset[str]] = field(default_factory=dict)
    mesh_order: tuple[str, ...] = ()

    @property
    def rank_order(self) -> tuple[str, ...]:
        """The mesh axes, fastest-varying first."""
        return self.mesh_order or parse_rank_order(self.options.rank_order)

    def mesh_axes(self, names: Iterable[str]) -> frozenset[str]:
        """The mesh axes that the named axes are made of (``etp`` is ``tp`` unless folded)."""
        parts = self.axis_parts or UNFOLDED_AXIS_PARTS
        return frozenset(a for name in names for a in parts.get(name, (name,)))

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
        """Axes that split the batch: data parallelism, and expert parallelism outside experts
        (unless it folds over the dense axes)."""
        return ("dp",) if self.options.ep_folded else ("dp", "ep")

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """Axes that split the sequence of the residual stream between layers."""
        return ("sp", "tp") if self.options.tpsp else ("sp",)

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """Axes over which ZeRO-1/2 shard gradients and optimizer states and FSDP (ZeRO-3) also
        the weights, as one flat padded buffer per part: the data-parallel ranks that hold
        the same weights, dp and sp (context-parallel ranks hold the same weights too, as
        Megatron's distributed optimizer and FSDP shard over its dp-cp group). Under
        ``ep_layout=multiply`` the ep ranks keep their own copies of the non-expert shards
        (their gradients are all-reduced over ep), as in hybrid sharding. Routed experts are
        sharded over expert data parallelism instead (``edp``: dp·sp unless ep folds;
        :meth:`stg.core.symbolic.GraphBuilder._zero_axes_of`)."""
        return ("dp", "sp")

    @property
    def zero_degree(self) -> int:
        """How many ways ZeRO / FSDP split a part's flat buffer (1 without ZeRO or FSDP)."""
        o = self.options
        if not (o.zero or o.weight_sharded):
            return 1
        return prod(self.degrees[a] for a in self.mesh_axes(self.zero_axes))

    @property
    def chunks(self) -> int:
        return self.stages * self.chunks_per_stage

    def chunk_layers(self, chunk: int) -> range:
        """Global indices of the layers of model chunk ``chunk`` (0 .. chunks-1)."""
        start = sum(self.layers_per_chunk[:chunk])
        return range(start, start + self.layers_per_chunk[chunk])

    def chunk_stage(self, chunk: int) -> int:
        return chunk % self.stages

    def _place_in_chunk(self, layer: int) -> tuple[int, int, int]:
        """(the chunk that holds ``layer``, its first layer, ``layer``'s index in it)."""
        start = 0
        for chunk, count in enumerate(self.layers_per_chunk):
            if layer < start + count:
                return chunk, start, layer - start
            start += count
        raise IndexError(f"layer {layer} of a stack of {start}")

    def layer_recompute(self, layer: int) -> str:
        """How layer ``layer`` is recomputed: ``none``, ``selective`` or ``full``. Under
        ``recompute_method=block`` only the first ``recompute_num_layers`` layers of each
        model chunk are (Megatron-LM's ``TransformerBlock._checkpointed_forward``, where a
        chunk is one ``TransformerBlock``); under ``uniform`` every layer is, in groups
        (:meth:`recompute_group`)."""
        o = self.options
        if self.recompute != "full" or o.recompute_method != "block":
            return self.recompute
        _, _, index = self._place_in_chunk(layer)
        return "full" if index < (o.recompute_num_layers or 0) else "none"

    def recompute_group(self, layer: int) -> range:
        """The layers recomputed together with ``layer`` from one checkpointed input: under
        ``recompute_method=uniform`` the group of ``recompute_num_layers`` consecutive
        layers of its chunk that holds it (the chunk's last group may be shorter), else
        ``layer`` alone."""
        o = self.options
        if self.recompute != "full" or o.recompute_method != "uniform":
            return range(layer, layer + 1)
        size = o.recompute_num_layers or 1
        chunk, start, index = self._place_in_chunk(layer)
        first = start + index // size * size
        return range(first, min(first + size, start + self.layers_per_chunk[chunk]))


def _check_optimizer(o: GenerateOptions) -> None:
    _require(
        o.optimizer in OPTIMIZERS,
        f"optimizer={o.optimizer}; allowed: {', '.join(OPTIMIZERS)}",
    )
    _require(
        o.optimizer == "muon" or o.muon_ns_steps == GenerateOptions.muon_ns_steps,
        f"muon_ns_steps={o.muon_ns_steps} is Muon's: optimizer={o.optimizer} is not allowed; "
        "allowed: optimizer=muon",
    )
    _require(
        o.muon_ns_steps >= 1,
        f"muon_ns_steps={o.muon_ns_steps} must be at least 1 (Newton-Schulz iterations)",
    )
    _require(
        o.optimizer != "muon" or o.profile == "megatron",
        f"optimizer=muon is Megatron-Core's Muon: profile={o.profile} is not allowed; "
        "allowed: profile=megatron",
    )
    _require(
        o.optimizer != "muon" or not o.weight_sharded,
        "optimizer=muon orthogonalizes whole weight matrices, which FSDP / ZeRO-3 splits: "
        "weight_sharded=true (zero=3) is not allowed; allowed: zero 0, 1 or 2 (1 and 2: "
        "Megatron's layer-wise distributed Muon)",
    )


def _check_moe_ep_overlap(o: GenerateOptions) -> None:
    """``overlap_moe_ep_comm`` where Megatron-core allows it (``TransformerConfig``'s checks in
    megatron/core/transformer/transformer_config.py, NVIDIA/Megatron-LM at d98e8a6): expert
    parallelism, no full recompute, virtual pipeline stages (the interleaved schedule) with
    pp > 1; a training step (it pairs a forward with a backward)."""
    if not o.overlap_moe_ep_comm:
        return
    _require(
        not o.inference,
        f"overlap_moe_ep_comm=true pairs a training forward with a backward: phase={o.phase} "
        "is not allowed; allowed: phase=training",
    )
    _require(
        o.ep > 1,
        f"overlap_moe_ep_comm=true hides expert-parallel all-to-alls: ep={o.ep} is not allowed; "
        "allowed: ep > 1",
    )
    _require(
        o.activation_recompute != "full",
        "overlap_moe_ep_comm=true is not allowed with activation_recompute=full "
        "(Megatron-core refuses full recompute with it); allowed: none, selective",
    )
    _require(
        o.pp == 1 or o.pipeline_schedule == "interleaved",
        f"overlap_moe_ep_comm=true with pp={o.pp} needs virtual pipeline stages: "
        f"pipeline_schedule={o.pipeline_schedule} is not allowed; allowed: interleaved (or pp=1)",
    )


def _check_torchtitan(o: GenerateOptions) -> None:
    """``profile=torchtitan`` where stg holds what it runs (torchtitan's Llama trained in
    bf16, attention by SDPA: :mod:`stg.core.torchtitan`), and ``norm_type`` only with it."""
    if o.norm_type is not None:
        _require(
            o.profile == "torchtitan",
            f"norm_type={o.norm_type} is torchtitan's model.norm_type: profile={o.profile} is "
            "not allowed; allowed: profile=torchtitan",
        )
        _require(
            o.norm_type in NORM_TYPES,
            f"norm_type={o.norm_type!r} must be one of {', '.join(NORM_TYPES)}",
        )
    if o.profile != "torchtitan":
        return
    _require(
        o.model == "llama",
        f"profile=torchtitan prices torchtitan's Llama: model={o.model} is not allowed; "
        "allowed: model=llama (or a Llama preset)",
    )
    _require(
        not o.inference,
        f"profile=torchtitan is a training stack: phase={o.phase} is not allowed; "
        "allowed: phase=training",
    )
    _require(
        o.dtype == "bf16" and not o.precision,
        f"profile=torchtitan trains in bf16 (FSDP2 mixed precision, no float8): "
        f"dtype={o.dtype}{' with a precision plan' if o.precision else ''} is not allowed; "
        "allowed: dtype=bf16 without a precision plan",
    )
    _require(
        o.attention == "fused",
        f"profile=torchtitan runs attention by SDPA's fused kernels: attention={o.attention} "
        "is not allowed; allowed: attention=fused",
    )


def _check_moe_sort_by_expert(o: GenerateOptions) -> None:
    """``moe_sort_by_expert`` where it means something: the sort is Megatron-core's (the
    ``megatron`` profile), of the tokens an expert-parallel all-to-all brings (``ep > 1``)."""
    if not o.moe_sort_by_expert:
        return
    _require(
        o.ep > 1,
        f"moe_sort_by_expert=true sorts the tokens an expert-parallel all-to-all brings: "
        f"ep={o.ep} is not allowed; allowed: ep > 1",
    )
    _require(
        o.profile == "megatron",
        f"moe_sort_by_expert=true is Megatron-core's alltoall token dispatcher: "
        f"profile={o.profile} is not allowed; allowed: profile=megatron",
    )
    _require(
        o.moe_dispatcher == NCCL_DISPATCHER,
        f"moe_sort_by_expert=true is Megatron-core's alltoall token dispatcher: "
        f"moe_dispatcher={o.moe_dispatcher} (whose kernels permute the tokens themselves) is not "
        "allowed with it; allowed: moe_dispatcher=alltoall",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise OptionError(message)


def chunk_layer_counts(o: GenerateOptions) -> tuple[int, ...]:
    """The layers of each of the ``pp · virtual_stages`` model chunks, in chunk order (chunk
    c on stage c mod pp, its layers after those of chunk c - 1), as Megatron-LM splits them
    (``get_num_layers_to_build``):

    - ``pipeline_layers``: the list as given; the first and the last chunk may hold no layer
      (the embedding, or the head and loss, alone on their stage);
    - ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``: the first
      and last stage hold that many layers, the other stages split the rest evenly; each
      stage's layers split evenly over its ``virtual_stages`` chunks;
    - ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``:
      the embedding and the loss each count as one layer of an even split, so the first
      (last) chunk holds one layer less;
    - otherwise as evenly as possible, the first ``num_stacks mod chunks`` chunks one longer.

    Raises :class:`OptionError` (naming the option and what is allowed) where the split
    is impossible.
    """
    pp, v, layers = o.pp, o.virtual_stages, o.num_stacks
    for name, value in (("pp", pp), ("virtual_stages", v), ("num_stacks", layers)):
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{name}={value} must be a positive integer",
        )
    chunks = pp * v
    first, last = o.decoder_first_pipeline_num_layers, o.decoder_last_pipeline_num_layers
    account = o.account_for_embedding_in_pipeline_split or o.account_for_loss_in_pipeline_split
    given = [
        name
        for name, on in (
            ("pipeline_layers", bool(o.pipeline_layers)),
            ("decoder_first/last_pipeline_num_layers", first is not None or last is not None),
            ("account_for_embedding/loss_in_pipeline_split", account),
        )
        if on
    ]
    _require(
        len(given) <= 1,
        f"{' and '.join(given)} cannot be combined; allowed: one way to split the layers "
        "over pipeline stages",
    )
    if o.pipeline_layers:
        counts = tuple(o.pipeline_layers)
        text = ",".join(map(str, counts))
        _require(
            all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts),
            f"pipeline_layers={text} must list non-negative integers",
        )
        _require(
            len(counts) == chunks,
            f"pipeline_layers={text} lists {len(counts)} chunks; allowed: one layer count per "
            f"model chunk, pp·virtual_stages={chunks}",
        )
        _require(
            sum(counts) == layers,
            f"pipeline_layers={text} holds {sum(counts)} layers; allowed: counts that sum to "
            f"num_stacks={layers}",
        )
        _require(
            all(n >= 1 for n in counts[1:-1]),
            f"pipeline_layers={text} leaves a middle chunk without a layer; allowed: 0 only "
            "for the first chunk (the embedding alone) and the last (the head alone)",
        )
        return counts
    if first is not None or last is not None:
        _require(
            pp > 1,
            "decoder_first/last_pipeline_num_layers split layers over pipeline stages: "
            f"pp={pp} is not allowed; allowed: pp > 1",
        )
        per_stage: list[int | None] = [None] * pp
        for name, value, stage in (("first", first, 0), ("last", last, pp - 1)):
            if value is None:
                continue
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"decoder_{name}_pipeline_num_layers={value} must be a positive integer",
            )
            per_stage[stage] = value
        rest = layers - sum(n for n in per_stage if n is not None)
        middle = per_stage.count(None)
        _require(
            rest >= middle and (rest % middle == 0 if middle else rest == 0),
            f"decoder_first/last_pipeline_num_layers leave {rest} of num_stacks={layers} "
            f"layers for {middle} other stage(s); allowed: a remainder that those stages "
            "split evenly, at least one layer each",
        )
        stage_layers = [rest // middle if n is None else n for n in per_stage]
        _require(
            all(n % v == 0 for n in stage_layers),
            f"stages of {','.join(map(str, stage_layers))} layers do not split into "
            f"virtual_stages={v} equal chunks; allowed: layer counts per stage divisible by it",
        )
        return tuple(stage_layers[c % pp] // v for c in range(chunks))
    if account:
        extra = int(o.account_for_embedding_in_pipeline_split) + int(
            o.account_for_loss_in_pipeline_split
        )
        total = layers + extra
        counted = " and ".join(
            name
            for name, on in (
                ("embedding", o.account_for_embedding_in_pipeline_split),
                ("loss", o.account_for_loss_in_pipeline_split),
            )
            if on
        )
        below, above = total // chunks * chunks, -(-total // chunks) * chunks
        nearest = [n - extra for n in (below, above) if n - extra >= 1]
        _require(
            total % chunks == 0,
            f"num_stacks={layers} plus the {counted} counted as layers ({total}) must be "
            f"divisible by pp·virtual_stages={chunks}; allowed: num_stacks + {extra} a "
            f"multiple of {chunks} (e.g. {' or '.join(map(str, nearest))})",
        )
        counts_list = [total // chunks] * chunks
        counts_list[0] -= int(o.account_for_embedding_in_pipeline_split)
        counts_list[-1] -= int(o.account_for_loss_in_pipeline_split)
        _require(
            min(counts_list) >= 0 and all(n >= 1 for n in counts_list[1:-1]),
            f"num_stacks={layers} is too few layers to count the embedding and loss as "
            f"layers over pp·virtual_stages={chunks} chunks",
        )
        return tuple(counts_list)
    _require(
        chunks <= layers,
        f"pp={pp}"
        + (f"·virtual_stages={v}" if v > 1 else "")
        + f" must not exceed num_stacks={layers}",
    )
    base, extra_layers = divmod(layers, chunks)
    return tuple(base + (1 if c < extra_layers else 0) for c in range(chunks))


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
        ("low_precision_recipe", o.low_precision_recipe != DEFAULT_RECIPE),
        ("fp8_param_gather", o.fp8_param_gather),
        ("fp8_dispatch", o.fp8_dispatch),
        ("fp8_attention", o.fp8_attention),
        ("eager_loss", o.eager_loss),
        ("optimizer", o.optimizer != "adam"),
        ("megatron_fsdp", o.megatron_fsdp),
        ("first_last_layers_bf16", o.first_last_layers_bf16),
        # the measured rates are DeepEP's and HybridEP's high-throughput kernels (training);
        # serving runs their low-latency ones
        ("moe_dispatcher", o.moe_dispatcher != NCCL_DISPATCHER),
        ("pipeline_flushes", o.pipeline_flushes != 1),
    )
    for name, given in training_only:
        value = getattr(o, name)
        _require(
            not given,
            f"{name}={str(value).lower() if isinstance(value, bool) else value} is a training "
            f"option; phase={o.phase} has no backward, gradients or optimizer (leave it unset)",
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
        _require(
            o.prefill_batch != 0,
            "phase=mixed batches prompts being prefilled with the decoding requests: give "
            "--prefill_batch, the prompts per iteration (a positive integer)",
        )
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
        replicas = o.data_replicas
        _require(
            o.prefill_batch % replicas == 0,
            f"{'dp' if o.ep_folded else 'dp·ep'}={replicas} must divide "
            f"prefill_batch={o.prefill_batch} "
            "(each replica serves whole requests)",
        )
    else:
        for name, default in (("prefill_batch", 0), ("chunk", None), ("prefill_context", 0)):
            value = getattr(o, name)
            _require(
                value == default, f"{name}={value} applies to phase=mixed only (not {o.phase})"
            )


def _check_bf16_layers(o: GenerateOptions) -> None:
    """``first_last_layers_bf16`` and its layer counts, as Megatron-LM checks them
    (``transformer_config.py``, core_v0.15.0): not under delayed scaling, each count between 0
    and the layers per pipeline stage, ``num_stacks // pp``."""
    for name in GenerateOptions.BF16_LAYER_COUNTS:
        value = getattr(o, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{name}={value!r} must be an integer",
        )
        _require(
            o.first_last_layers_bf16 or value == getattr(GenerateOptions, name),
            f"{name}={value} counts the layers that first_last_layers_bf16 keeps in bf16: "
            "give first_last_layers_bf16=true",
        )
    if not o.first_last_layers_bf16:
        return
    _require(
        o.low_precision_recipe != DEFAULT_RECIPE,
        "first_last_layers_bf16 keeps layers out of a low-precision recipe: it needs "
        "low_precision_recipe one of "
        f"{', '.join(r for r in RECIPES if r != DEFAULT_RECIPE)} (Megatron-LM refuses it "
        "under delayed scaling)",
    )
    _require(
        not o.fp8_param_gather,
        "first_last_layers_bf16 with fp8_param_gather (bf16 weights in some layers, fp8 in "
        "the others) is not modelled: leave one of them off",
    )
    most = o.num_stacks // o.pp
    for name in GenerateOptions.BF16_LAYER_COUNTS:
        value = getattr(o, name)
        _require(
            0 <= value <= most,
            f"{name}={value} must be between 0 and the layers per pipeline stage, "
            f"num_stacks // pp = {most}",
        )


def _check_recompute_layers(o: GenerateOptions, recompute: str | None) -> None:
    """``recompute_method`` and ``recompute_num_layers`` against each other and the mode:
    both or neither, with ``activation_recompute=full`` (as Megatron-LM requires)."""
    methods = GenerateOptions.RECOMPUTE_METHODS
    method, layers = o.recompute_method, o.recompute_num_layers
    if method is None and layers is None:
        return
    _require(
        method is not None,
        f"recompute_num_layers={layers} needs recompute_method; allowed: {', '.join(methods)}",
    )
    _require(
        method in methods,
        f"recompute_method={method!r} must be one of {', '.join(methods)}",
    )
    _require(
        isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1,
        f"recompute_method={method} needs recompute_num_layers, a positive integer "
        f"(given: {layers})",
    )
    _require(
        recompute == "full",
        f"recompute_method={method} chooses the layers of full recompute: "
        f"activation_recompute={o.activation_recompute} is not allowed; allowed: "
        "activation_recompute=full",
    )


def _check_recompute_modules(o: GenerateOptions, recompute: str | None) -> None:
    """``recompute_modules``: known names, with ``activation_recompute=selective`` (as
    Megatron-LM requires)."""
    if not o.recompute_modules:
        return
    allowed = GenerateOptions.RECOMPUTE_MODULES
    text = ",".join(map(str, o.recompute_modules))
    unknown = [m for m in o.recompute_modules if m not in allowed]
    _require(
        not unknown,
        f"recompute_modules={text}: {', '.join(map(str, unknown))} is not a module stg "
        f"recomputes; allowed: {', '.join(allowed)}",
    )
    _require(
        recompute == "selective",
        f"recompute_modules={text} chooses what selective recompute re-runs: "
        f"activation_recompute={o.activation_recompute} is not allowed; allowed: "
        "activation_recompute=selective",
    )


def recompute_tags(o: GenerateOptions) -> frozenset[str]:
    """The op tags selective recompute re-runs: those of ``recompute_modules`` (empty: the
    attention core)."""
    modules = o.recompute_modules or ("core_attn",)
    return frozenset(GenerateOptions.RECOMPUTE_MODULES[m] for m in modules)


def _check_ep_layout(o: GenerateOptions) -> FoldedMesh | None:
    """The expert-parallel layout's options; the folded mesh under ``ep_layout=fold``."""
    layouts = GenerateOptions.EP_LAYOUTS
    _require(
        o.ep_layout is None or o.ep_layout in layouts,
        f"ep_layout={o.ep_layout!r} must be one of {', '.join(layouts)}",
    )
    _require(
        o.etp is None or (isinstance(o.etp, int) and not isinstance(o.etp, bool) and o.etp >= 1),
        f"etp={o.etp} must be a positive integer (or unset: tp)",
    )
    if not o.ep_folded:
        _require(
            o.etp is None,
            f"etp={o.etp} splits experts over ranks that ep folds over: ep_layout=multiply "
            "is not allowed with it; allowed: ep_layout=fold (or leave ep_layout unset)",
        )
        return None
    _require(
        o.experts % o.ep == 0,
        f"ep={o.ep} must divide experts={o.experts} (ep_layout=fold: each rank of an "
        "expert-parallel group holds whole experts)",
    )
    _require(
        o.dff % o.expert_tp == 0, f"etp={o.expert_tp} must divide dff={o.dff} (each expert's FFN)"
    )
    _require(
        o.tp == 1 or o.tpsp or o.inference,
        f"ep_layout=fold with tp={o.tp} needs sequence parallelism (tpsp=true), as "
        "Megatron-LM requires for MoE with tensor parallelism; allowed: tpsp=true, or tp=1",
    )
    degrees = {"dp": o.dp, "tp": o.tp, "sp": o.sp, "pp": o.pp}
    try:
        return fold_mesh(degrees, parse_rank_order(o.rank_order), o.expert_tp, o.ep)
    except LayoutError as exc:
        raise OptionError(str(exc)) from None


SIZES = ("dvocal", "dmodel", "dff", "batch", "seq", "head", "kvhead", "num_stacks", "experts",
         "kexperts")  # fmt: skip
"""The model's and the step's sizes: each a positive integer, whatever the parallel plan."""


def check_sizes(o: GenerateOptions) -> None:
    """What no parallel plan makes valid: the serving phase's options against each other and a
    size of :data:`SIZES` that is not a positive integer (the checks of :func:`make_plan`
    that read no degree; a search refuses them before trying plans)."""
    _check_phase(o)
    _check_sizes(o)


def _check_sizes(o: GenerateOptions) -> None:
    for name in SIZES:
        value = getattr(o, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{name}={value} must be a positive integer",
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
    _check_sizes(o)
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
    replicas = o.data_replicas
    _require(
        micro_batch % replicas == 0,
        f"{'dp' if o.ep_folded else 'dp·ep'}={replicas} must divide micro_batch={micro_batch} "
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
                 "drope", "mtp_depth", "attention_window", "attention_chunk",
                 "full_attention_every", "ssm_state", "ssm_heads", "ssm_head_dim", "ssm_groups",
                 "ssm_chunk", "linear_key_heads", "linear_value_heads",
                 "linear_head_dim", "index_topk", "index_heads",
                 "index_head_dim"):  # fmt: skip
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
    layers = chunk_layer_counts(o)
    _require(
        o.attention in GenerateOptions.ATTENTION,
        f"attention={o.attention!r} must be one of {', '.join(GenerateOptions.ATTENTION)}",
    )
    backends = GenerateOptions.ATTENTION_BACKENDS
    _require(
        o.attention_backend in backends,
        f"attention_backend={o.attention_backend!r} must be one of {', '.join(backends)}",
    )
    _require(
        o.attention_backend == "auto" or (o.attention == "fused" and o.phase == "training"),
        f"attention_backend={o.attention_backend} picks the fused attention kernel of a training "
        f"stack (Megatron's --attention-backend): it needs attention=fused and phase=training, "
        f"not attention={o.attention}, phase={o.phase}",
    )
    _require(
        isinstance(o.dropout, int | float)
        and not isinstance(o.dropout, bool)
        and 0 <= o.dropout < 1,
        f"dropout={o.dropout!r} must be a rate in [0, 1) (0: no dropout)",
    )
    _require(
        isinstance(o.amax_history, int)
        and not isinstance(o.amax_history, bool)
        and o.amax_history >= 1,
        f"amax_history={o.amax_history!r} must be a positive integer (Transformer Engine's "
        "amax history length per fp8 tensor; default 1024)",
    )
    _require(
        o.low_precision_recipe in RECIPES,
        f"low_precision_recipe={o.low_precision_recipe!r} must be one of {', '.join(RECIPES)}",
    )
    _require(
        o.low_precision_recipe == DEFAULT_RECIPE or (o.dtype == "fp8" and not o.precision),
        f"low_precision_recipe={o.low_precision_recipe} quantizes the GEMMs of a training run "
        "computing in fp8: give dtype=fp8 and no precision plan",
    )
    _require(
        not o.fp8_param_gather
        or (o.low_precision_recipe in PARAM_GATHER_RECIPES and o.weight_sharded),
        "fp8_param_gather keeps the weights in fp8 and gathers them so under FSDP: it needs "
        f"weight_sharded=true and low_precision_recipe one of {', '.join(PARAM_GATHER_RECIPES)}",
    )
    _require(
        not o.fp8_dispatch or (o.low_precision_recipe != DEFAULT_RECIPE and o.ep > 1),
        "fp8_dispatch sends a mixture of experts' tokens to the experts in the format of "
        "low_precision_recipe: it needs ep > 1 and low_precision_recipe one of "
        f"{', '.join(r for r in RECIPES if r != DEFAULT_RECIPE)}",
    )
    _require(
        not o.fp8_attention
        or (
            o.dtype == "fp8"
            and o.low_precision_recipe in FP8_ATTENTION_SCALING
            and o.profile == "megatron"
        ),
        "fp8_attention runs Transformer Engine's fused attention in fp8 (fp8_dpa): it needs "
        "dtype=fp8, profile=megatron and low_precision_recipe one of "
        f"{', '.join(FP8_ATTENTION_SCALING)}",
    )
    _require(
        not o.fp8_attention or o.attention_backend in ("auto", "fused"),
        f"fp8_attention runs cuDNN's fp8 fused attention: attention_backend="
        f"{o.attention_backend} is not allowed with it (FlashAttention has no fp8 training "
        "kernel); allowed: auto, fused",
    )
    _require(
        not o.fp8_attention or o.sp == 1,
        f"fp8_attention with context parallelism (sp={o.sp}) is not modelled yet: the ring's "
        "keys and values would move in fp8 and be cast once, not per step; allowed: sp=1",
    )
    for option, feature in (
        ("nvfp4_disable_rht", "hadamard"),
        ("nvfp4_disable_stochastic_rounding", "stochastic_rounding"),
    ):
        having = [name for name, recipe in RECIPES.items() if getattr(recipe, feature)]
        _require(
            not getattr(o, option) or o.low_precision_recipe in having,
            f"{option} turns off a part of the low_precision_recipe that "
            f"{o.low_precision_recipe} does not have: it needs low_precision_recipe one of "
            f"{', '.join(having)}",
        )
    _require(
        not o.megatron_fsdp or o.weight_sharded,
        "megatron_fsdp picks Megatron-LM's FSDP for the weight sharding: it needs "
        "weight_sharded=true (or zero=3)",
    )
    _check_bf16_layers(o)
    _require(
        o.profile in GenerateOptions.PROFILES,
        f"profile={o.profile!r} must be one of {', '.join(GenerateOptions.PROFILES)}",
    )
    recompute = RECOMPUTE.get(str(o.activation_recompute).lower())
    _require(
        recompute is not None,
        f"activation_recompute={o.activation_recompute!r} must be one of none, selective, "
        "selective_op, full",
    )
    _check_recompute_layers(o, recompute)
    _check_recompute_modules(o, recompute)
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
    _require(
        o.cp_comm_type in GenerateOptions.CP_COMM_TYPES,
        f"cp_comm_type={o.cp_comm_type!r} must be one of "
        f"{', '.join(GenerateOptions.CP_COMM_TYPES)}",
    )
    _require(
        o.cp_comm_type == "p2p" or o.sp > 1,
        f"cp_comm_type={o.cp_comm_type} is how context parallelism moves keys and values: "
        "it needs sp > 1",
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
    _check_optimizer(o)
    _require(
        not o.eager_loss or o.profile == "compiled",
        f"eager_loss=true runs the loss outside torch.compile's region: profile={o.profile} is "
        "not allowed; allowed: profile=compiled (eager and torchtitan always run it eagerly)",
    )
    _check_moe_ep_overlap(o)
    _check_moe_sort_by_expert(o)
    _check_torchtitan(o)
    folded = _check_ep_layout(o)
    _require(o.kexperts <= o.experts, f"kexperts={o.kexperts} must not exceed experts={o.experts}")
    _require(o.capacity_factor > 0, f"capacity_factor={o.capacity_factor} must be positive")
    _require(
        o.moe_dispatcher in DISPATCHERS,
        f"moe_dispatcher={o.moe_dispatcher!r} must be one of {', '.join(DISPATCHERS)}",
    )
    _require(
        o.moe_dispatcher == NCCL_DISPATCHER or o.ep > 1,
        f"moe_dispatcher={o.moe_dispatcher} runs the expert-parallel all-to-alls: "
        f"ep={o.ep} is not allowed; allowed: ep > 1 (or moe_dispatcher=alltoall)",
    )
    _require(
        o.moe_dispatcher_sms is None or o.moe_dispatcher != NCCL_DISPATCHER,
        f"moe_dispatcher_sms={o.moe_dispatcher_sms} is the SM budget of DeepEP's or "
        f"HybridEP's kernels: moe_dispatcher={o.moe_dispatcher} is not allowed with it; "
        "allowed: moe_dispatcher deepep or hybridep",
    )
    _require(
        o.moe_dispatcher_sms is None or o.moe_dispatcher_sms > 0,
        f"moe_dispatcher_sms={o.moe_dispatcher_sms} must be a positive number of SMs",
    )
    _require(o.moe_gate in GATES, f"moe_gate={o.moe_gate!r} must be one of {', '.join(GATES)}")
    _require(
        o.moe_gate == RANDOM_GATE or o.moe_dispatcher != NCCL_DISPATCHER,
        f"moe_gate={o.moe_gate} decides where DeepEP and HybridEP send a token: "
        f"moe_dispatcher={o.moe_dispatcher} is not allowed with it; allowed: deepep, hybridep",
    )
    _require(
        o.moe_gate == RANDOM_GATE or o.moe_routing == "capacity",
        f"moe_gate={o.moe_gate} loads every expert equally: moe_routing={o.moe_routing} is not "
        "allowed with it; allowed: capacity",
    )
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
    flushes = o.pipeline_flushes
    _require(
        flushes == 1 or (flushes > 1 and o.pp > 1 and (o.batch // micro_batch) % flushes == 0),
        f"pipeline_flushes={flushes} runs an iteration's micro-batches as that many pipeline "
        f"schedules: allowed: 1, or with pp > 1 a divisor of the {o.batch // micro_batch} "
        "micro-batches",
    )
    _require(
        flushes == 1 or not o.overlap_moe_ep_comm,
        f"pipeline_flushes={flushes} is PyTorch's gradient accumulation over pipeline "
        "schedules; overlap_moe_ep_comm is Megatron's combined 1F1B of one schedule: not "
        "allowed together",
    )
    if o.pipeline_schedule == "interleaved":
        _require(o.pp > 1, "pipeline_schedule=interleaved needs pp > 1")
        m = o.batch // micro_batch // flushes
        _require(
            m % o.pp == 0,
            f"pipeline_schedule=interleaved needs the number of micro-batches ({m}"
            f"{' a schedule' if flushes > 1 else ''}) divisible by pp={o.pp}",
        )
    parse_rank_order(o.rank_order)
    m = o.batch // micro_batch
    _require(
        2 * m * chunks < MAX_TAG, f"too many micro-batches ({m}) for send/recv tags below {MAX_TAG}"
    )
    _require(prod(degrees.values()) >= 1, "world size must be positive")
    if folded is None:
        return ParallelPlan(o, degrees, m, o.virtual_stages, layers, recompute)
    return ParallelPlan(
        o, folded.degrees, m, o.virtual_stages, layers, recompute, folded.axes, folded.rank_order
    )


def layout_of(o: GenerateOptions) -> Layout:
    """The placement of ``o``'s mesh on ranks (no communicators numbered): what predictors
    need to find a group's members (``layout.members(rank, axes)``) on a folded mesh too.
    Raises :class:`OptionError` on impossible options."""
    plan = make_plan(o)
    return Layout(plan.degrees, plan.rank_order)


def recompute_units(o: GenerateOptions) -> list[tuple[int, str, range]]:
    """The layer stack as the units recompute keeps and runs again, in layer order:
    ``(stage, mode, layers)``, where a ``full`` unit is recomputed as a whole from its
    first layer's checkpointed input (one layer, or a group under
    ``recompute_method=uniform``) and any other unit is one layer whose mode (``none`` or
    ``selective``) says what it keeps (:meth:`ParallelPlan.layer_recompute`). Raises
    :class:`OptionError` on impossible options."""
    plan = make_plan(o)
    units: list[tuple[int, str, range]] = []
    for chunk in range(plan.chunks):
        layers = plan.chunk_layers(chunk)
        layer = layers.start
        while layer < layers.stop:
            group = plan.recompute_group(layer)
            units.append((plan.chunk_stage(chunk), plan.layer_recompute(layer), group))
            layer = group.stop
    return units


def expert_zero_degree(o: GenerateOptions) -> int:
    """How many ways ZeRO / FSDP shard a routed expert's weights: over the expert data
    parallel ranks (``edp``, :attr:`GenerateOptions.expert_dp`), as Megatron's distributed
    optimizer does; ``dp·sp``, the dense weights' degree, unless ep folds."""
    return o.expert_dp
