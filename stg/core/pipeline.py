"""The generation pipeline: options -> plan -> model parts -> lowered stages -> Workload."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from stg.core.attention_backend import runs_fused_attention, with_attention_backend
from stg.core.dtensor import (
    DTENSOR_PROFILES,
    with_replicated_grads_reduced_first,
    with_sequence_parallel_copies,
)
from stg.core.fp8 import AMAX_AXES, AUTOCAST_DTYPE, MODEL_PARALLEL_AMAX_AXES
from stg.core.layout import PIPELINE_ENDS, Layout
from stg.core.lowering import (
    Binder,
    BoundPart,
    LayerKinds,
    ModelParts,
    RunPlans,
    bind_part,
    lower_stage,
)
from stg.core.options import GenerateOptions, OptionError, ReadOptions, check_options_read
from stg.core.plan import ParallelPlan, make_plan
from stg.core.precision import (
    DTYPE_BYTES,
    PrecisionPlan,
    PrecisionPlanWarning,
    normalize_plan,
    plan_for_group,
    plan_groups,
    unmatched_patterns,
)
from stg.core.recipes import DEFAULT_RECIPE, model_kind, split_bf16_layers, training_recipe
from stg.core.routing import DISPATCHER_ATTR, NCCL_DISPATCHER, expert_capacity
from stg.core.torch_context_parallel import lowered_cp_comm_type
from stg.core.torchtitan import NORM_TYPES, with_fp32_cross_entropy, with_torchtitan_kernels
from stg.core.validation import validate_options
from stg.core.workload import CollectiveType, NodeType, RankGraph, Workload, node_micro_batch
from stg.errors import UserError
from stg.host.records import Model, PipelineSchedule

if TYPE_CHECKING:
    from stg.core.symbolic import Part
    from stg.host.registry import Registry

Progress = Callable[[str, int, int], None]


def symbol_values(options: GenerateOptions) -> dict[Any, int]:
    """Integer values of the standard dimension symbols for one run."""
    from stg.core.symbolic import (
        Capacity,
        Dff,
        DffDense,
        DHead,
        Dmodel,
        DRope,
        Dvocal,
        Experts,
        Head,
        KExperts,
        KVHead,
        KVLora,
        MicroBatch,
        QLora,
        Seq,
        SharedExperts,
    )

    micro_batch = options.micro_batch or options.batch
    tokens = micro_batch * options.seq
    capacity = expert_capacity(options, tokens)
    values = {
        MicroBatch: micro_batch,
        Seq: options.seq,
        Dmodel: options.dmodel,
        Dff: options.dff,
        Head: options.head,
        KVHead: options.kvhead,
        Dvocal: options.dvocal,
        Experts: options.experts,
        KExperts: options.kexperts,
        Capacity: capacity,
    }
    if options.dhead is not None:
        values[DHead] = options.dhead
    for symbol, value in (
        (QLora, options.q_lora_rank),
        (KVLora, options.kv_lora_rank),
        (DRope, options.drope),
        (DffDense, options.dense_dff),
        (SharedExperts, options.shared_experts),
    ):
        if value is not None:
            values[symbol] = value
    return values


def build_parts(model: Model, plan: ParallelPlan, hybrid: bool = False) -> ModelParts:
    """Build, differentiate and bind the embedding, block and head of ``model``; ``hybrid``:
    for device groups that run different precision plans (their gradient collectives must be
    the same: a cast weight's gradient is reduced with the weight's, in its bucket)."""
    # the symbolic core (sympy) loads here: lowering parts bound already does not need it
    from stg.core.autodiff import build_backward, build_grad_reduction
    from stg.core.symbolic import GraphBuilder, Part, Tensor

    o = plan.options
    binder = Binder(symbol_values(o), plan.degrees, plan.axis_parts)
    bound: dict[str, BoundPart] = {}
    precision = plan.precision
    zero_axes = plan.zero_axes if o.zero in (1, 2) else ()
    read = ReadOptions(o.as_dict())
    runs = split_bf16_layers(model.layer_runs(read), *o.bf16_layers)
    stackless = not runs  # no layer stack: the head receives the embedding's output
    functions = {"embedding": model.embedding, "head": model.head}
    functions.update((kind, function) for kind, function, _ in runs)
    for name, function in functions.items():
        b = GraphBuilder(
            name,
            active_axes=plan.active_axes,
            data_axes=plan.data_axes,
            seq_axes=plan.seq_axes,
            dtype=AUTOCAST_DTYPE if o.first_last_layers_bf16 and model_kind(name)[1] else o.dtype,
            grad_dtype=precision["grad"],
            shard_weights_over=plan.zero_axes if o.weight_sharded else (),
            precision=normalize_plan(o.precision),
            options=read,
            axis_parts=plan.axis_parts or None,
        )
        b.weight_grads_through_casts = hybrid
        if name == "embedding":
            x = None
        elif stackless:
            body = bound["embedding"].part.output
            assert body is not None
            x = b.input("x", body.dims, _shard_of(body))
        else:
            x = b.residual_input()
        # every layer's ops carry the tag "block", and their kind's name where it differs
        tags = (name,) if name in ("embedding", "head", "block") else ("block", name)
        with b.tag(*tags):
            result = function(b, x)
        if not isinstance(result, Tensor):
            what = "the loss" if name == "head" else "its output activation"
            part = name if name in ("embedding", "head", "block") else f"the {name!r} block"
            raise UserError(
                f"model {model.name!r}: {part}() must return {what} (a Tensor), got {result!r}"
            )
        if name == "head":
            build_backward(b, seed=None, loss=result)
            seed = None
        else:
            if b.part.output is None:
                b.output(result)
            seed = b.input("grad_output", b.part.output.dims, _shard_of(b.part.output))  # type: ignore[union-attr]
            seed.kind = "grad"
            build_backward(b, seed=seed)
        build_grad_reduction(b, zero_axes)
        bound[name] = bind_part(
            b.part,
            binder,
            seed,
            shard_degree=plan.zero_degree,
            shard_axes=plan.mesh_axes(plan.zero_axes),
            fused_attention=o.attention == "fused",
            # a whole network in one part: its gradients reduced in DDP's buckets
            gradient_buckets=stackless and plan.zero_degree == 1,
            cp_comm_type=lowered_cp_comm_type(o.profile, o.cp_comm_type),
            recipe=training_recipe(
                o.low_precision_recipe,
                disable_rht=o.nvfp4_disable_rht,
                disable_stochastic_rounding=o.nvfp4_disable_stochastic_rounding,
            ),
            param_gather=o.fp8_param_gather,
            fp8_dispatch=o.fp8_dispatch,
            fp8_attention=o.fp8_attention,
            fsdp2_copies=not o.megatron_fsdp,
            moe_dispatcher=o.moe_dispatcher,
            kexperts=o.kexperts,
            moe_gate=o.moe_gate,
            muon=o.optimizer == "muon",
            moe_dispatcher_sms=o.moe_dispatcher_sms,
        )
        bound[name] = with_attention_backend(bound[name], o.attention_backend)
        if o.profile in DTENSOR_PROFILES and (o.micro_batch or o.batch) // o.data_replicas > 1:
            bound[name] = with_sequence_parallel_copies(bound[name], binder)
        if o.profile in DTENSOR_PROFILES and o.weight_sharded and not o.megatron_fsdp:
            bound[name] = with_replicated_grads_reduced_first(bound[name], binder)
        if o.profile == "torchtitan":
            bound[name] = with_torchtitan_kernels(bound[name], binder, o.norm_type or NORM_TYPES[0])
        elif o.runs_eager_loss:  # torchtitan's kernels, above, include its loss's
            bound[name] = with_fp32_cross_entropy(bound[name], binder)
    check_options_read(read, model.name)
    if o.fp8_attention and not any(map(runs_fused_attention, bound.values())):
        raise OptionError(
            f"fp8_attention=true does not apply to model {model.name!r} with attention="
            f"{o.attention}: none of its layers runs fused attention (leave it false)"
        )
    if o.attention_backend != "auto" and not any(map(runs_fused_attention, bound.values())):
        raise OptionError(
            f"attention_backend={o.attention_backend} does not apply to model {model.name!r}: "
            "none of its layers runs fused attention (leave it auto)"
        )
    for switch in ("fp8_dispatch", "overlap_moe_ep_comm"):
        if getattr(o, switch) and not any(map(_dispatches_to_experts, bound.values())):
            raise OptionError(
                f"{switch}=true does not apply to model {model.name!r}: none of its layers "
                "sends tokens to experts over an all-to-all (leave it false)"
            )
    if o.moe_dispatcher != NCCL_DISPATCHER and not any(map(_routes_experts, bound.values())):
        raise OptionError(
            f"moe_dispatcher={o.moe_dispatcher} does not apply to model {model.name!r}: none "
            "of its layers sends tokens to experts over an all-to-all (leave it alltoall)"
        )
    if stackless:
        bound["block"] = bind_part(Part("block"), binder, None)
    facts: dict[str, object] = {}
    head = bound["head"].part
    if not any(d.name == "dvocal" for op in head.forward for d in op.output.dims):
        # a head without logits over the vocabulary (a classifier, a span head): the memory
        # predictor's closed form of an LM head does not apply, the graph says what it keeps
        facts["head_activation_bytes"] = saved_bytes(head, binder)
    if stackless:
        # no layer stack, so no closed form of a layer's activations: the predictors read
        # what this model saves between forward and backward, per micro-batch and rank
        facts["stackless"] = True
        facts["activation_bytes"] = sum(
            saved_bytes(bound[name].part, binder) for name in ("embedding", "head")
        )
    graph_kinds = {
        kind: layer_saved_bytes(bound[kind].part, binder, fused=o.attention == "fused")
        for kind, _, _ in runs
        if any(GRAPH_MEMORY_TAG in op.tags for op in bound[kind].part.forward)
    }
    if graph_kinds:
        # layers that are not a transformer's attention and MLP (state-space, linear
        # attention, hybrid layers): the memory predictor reads what their graph keeps
        facts["layer_activation_bytes"] = graph_kinds
    if o.cpu_offloading_num_layers and runs:
        # the stack's block kinds in layer order (one stage: CPU offload runs without
        # pipelining), for the offload peak of a stack whose order the options do not say
        facts["layer_runs"] = tuple((kind, count) for kind, _, count in runs)
    if plan.recompute == "selective_op" and runs:
        # what op-level checkpointing keeps of each layer, for the layers whose closed form
        # the memory predictor lacks (all but Llama's dense ones, which it equals)
        facts["op_checkpoint_layer_bytes"] = {
            kind: op_checkpoint_saved_bytes(bound[kind].part, binder, fused=o.attention == "fused")
            for kind, _, _ in runs
        }
    master, state, grad = (DTYPE_BYTES[precision[k]] for k in ("master", "optimizer", "grad"))
    # Adam reads and writes the master weights and both moments and reads the gradient; with
    # mixed precision it also writes the 16-bit working copy of the weights.
    # a low-precision recipe keeps 16-bit weights beside its quantized copies (fp8 ones
    # with fp8_param_gather)
    weight_dtype = o.dtype
    if o.low_precision_recipe != DEFAULT_RECIPE and not o.fp8_param_gather:
        weight_dtype = AUTOCAST_DTYPE
    per_param = (
        2 * master + 4 * state + grad + (DTYPE_BYTES[weight_dtype] if o.mixed_precision else 0)
    )
    layer_kinds = LayerKinds((kind, count) for kind, _, count in runs)
    _check_recompute_modules(o, [bound[kind] for kind, _, _ in runs])
    _check_planned_recompute_modules(
        o, plan, [kind for kind, _, _ in runs if kind not in graph_kinds]
    )
    offloaded = {
        kind: layer_saved_bytes(bound[kind].part, binder, fused=o.attention == "fused")
        for kind, _, _ in runs
        if o.cpu_offloading_num_layers
    }
    return ModelParts(
        bound["embedding"],
        bound[layer_kinds[0]] if layer_kinds else bound["block"],
        bound["head"],
        blocks={kind: bound[kind] for kind, _, _ in runs},
        layer_kinds=layer_kinds,
        saved_layer_bytes=offloaded,
        optimizer_bytes_per_param=int(per_param),
        optimizer_dtype=precision["optimizer"],
        facts={
            "weight_dtype": weight_dtype,
            "grad_dtype": precision["grad"],
            "master_dtype": precision["master"],
            "optimizer_dtype": precision["optimizer"],
            "zero": 3 if o.weight_sharded else o.zero,
            "recompute": plan.recompute,
            **facts,
        },
    )


def _check_planned_recompute_modules(
    o: GenerateOptions, plan: ParallelPlan, closed_form_kinds: list[str]
) -> None:
    """Refuse a precision plan beside selective recompute of modules other than the attention
    core in layers whose memory the closed forms price (not their graph): the memory
    predictor models a plan's saved matmul inputs (cast copies beside the 16-bit ones) under
    ``core_attn`` recompute only, so such a run would write a trace that no prediction
    takes."""
    modules = sorted(set(o.recompute_modules) - {"core_attn"})
    if o.precision and plan.recompute == "selective" and modules and closed_form_kinds:
        raise OptionError(
            f"recompute_modules={','.join(o.recompute_modules)} with a precision plan: the "
            f"saved inputs of the plan's ops are modelled under core_attn recompute only (the "
            f"{', '.join(closed_form_kinds)} layers of model {o.model}); allowed: "
            "recompute_modules=core_attn, or no --precision_plan"
        )


def _check_recompute_modules(o: GenerateOptions, blocks: list[BoundPart]) -> None:
    """Every module of ``recompute_modules`` is built by the model's layers (a name that
    re-runs nothing is refused)."""
    for module in o.recompute_modules:
        tag = GenerateOptions.RECOMPUTE_MODULES[module]
        if not any(tag in op.tags for bp in blocks for op in bp.forward):
            built = [
                name
                for name, t in GenerateOptions.RECOMPUTE_MODULES.items()
                if any(t in op.tags for bp in blocks for op in bp.forward)
            ]
            raise OptionError(
                f"recompute_modules={','.join(o.recompute_modules)}: model {o.model} has no "
                f"{module} module in its layers; allowed: {', '.join(built) or '(none)'}"
            )


def _fp8_signature(parts: ModelParts) -> tuple[object, ...]:
    """The fp8 modules of every part of a precision variant (equal for variants whose amax
    buffers match)."""
    blocks = tuple(sorted((kind, bp.fp8_modules) for kind, bp in parts.blocks.items()))
    return (parts.embedding.fp8_modules, parts.block.fp8_modules, blocks, parts.head.fp8_modules)


def saved_bytes(part: Part, binder: Binder) -> int:
    """Bytes of the tensors one rank keeps from a part's forward for its backward."""
    from stg.core.modelinfo import saved_activations

    return sum(binder.nbytes(t) for t in saved_activations(part))


GRAPH_MEMORY_TAG = "graph_memory"
"""Tag of a layer's ops whose saved activations the memory predictor takes from the graph
(:func:`layer_saved_bytes`) instead of a transformer layer's closed forms."""


def layer_saved_bytes(part: Part, binder: Binder, fused: bool) -> int:
    """Bytes one rank keeps from a layer's forward for its backward; with ``fused`` attention
    the score and probability matrices (and a dropout's mask) inside the attention core are
    not kept (the fused kernel recomputes them from Q, K, V, its fp32 log-sum-exp per query
    row and head, and its RNG state). An input gathered over tp (sequence parallelism) is
    kept as this rank's shard and gathered again in the backward (Megatron-LM core 0.20.0's
    ``LinearWithGradAccumulationAndAsyncCommunication`` and Transformer Engine v2.10's
    ``Linear`` save the local input under ``sequence_parallel``)."""
    from stg.core.modelinfo import saved_activations

    kept = saved_activations(part)
    tp = binder.mesh_axes("tp")

    def nbytes(t: Any) -> int:
        gather = t.producer
        if (
            tp
            and gather is not None
            and gather.kind == "collective"
            and gather.collective is CollectiveType.ALL_GATHER
            and gather.axes == tp
        ):
            return binder.nbytes(gather.inputs[0])
        return binder.nbytes(t)

    if not fused:
        return sum(nbytes(t) for t in kept)
    return _kept_bytes(part, binder, kept, nbytes, core_only=False)


def _kept_bytes(
    part: Part, binder: Binder, kept: list[Any], nbytes: Callable[[Any], int], core_only: bool
) -> int:
    """:func:`layer_saved_bytes` of ``kept`` under fused attention (``core_only``: of the
    tensors the attention core makes alone)."""
    core = [op for op in part.forward if "core_attention" in op.tags]
    produced = _core_tensors(part)
    read_outside = {id(t.base or t) for op in part.forward if op not in core for t in op.inputs}
    scores = next((op.output for op in core if op.kind == "einsum"), None)
    total = 0
    for t in kept:
        if core_only and id(t) not in produced:
            continue
        if id(t) in produced and id(t) not in read_outside:
            continue  # scores, probabilities, dropout masks: only the fused kernel reads them
        total += nbytes(t)
        if id(t) in produced and scores is not None:  # the output, and its log-sum-exp rows
            keys = binder.local_dim(scores.dims[-1], scores.sharding.dims[-1])
            total += 4 * binder.numel(scores) // keys
    return total


def _core_tensors(part: Part) -> set[int]:
    """Ids of the tensors a layer's attention core makes (its outputs and masks)."""
    core = [op for op in part.forward if "core_attention" in op.tags]
    return {id(op.output) for op in core} | {id(op.mask) for op in core if op.mask}


def op_checkpoint_saved_bytes(part: Part, binder: Binder, fused: bool) -> int:
    """Bytes one rank keeps from a layer's forward for its backward under torchtitan's
    op-level selective checkpointing (``activation_recompute=selective_op``), from the graph:
    what :func:`stg.core.lowering.op_checkpoint_recomputes` does not run again. The layer's
    input; the output of each odd-numbered matmul (einsums outside the attention core, in
    forward order, counted from 1), or where a reduce-scatter over tp follows it (a
    row-parallel GEMM under sequence parallelism) that reduce-scatter's output, this rank's
    shard; and what the backward of the attention core, which is not recomputed, reads of the
    tensors the core makes (fused: its output and fp32 log-sum-exp rows; unfused: its score
    or probability matrix, mask and output, as :func:`layer_saved_bytes` counts them). For a
    Llama dense layer this is the memory predictor's closed form (``op_checkpoint_layer_bytes``:
    input, Q, V, attention output and log-sum-exp, gate and down projection); it prices the
    layers of other models (MoE, latent attention, GPT's, BERT's) the same way, and a
    precision plan's dtypes, which the closed form does not take."""
    from stg.core.modelinfo import saved_activations

    tp = binder.mesh_axes("tp")
    scattered: dict[int, Any] = {}
    for op in part.forward:
        if (
            tp
            and op.kind == "collective"
            and op.collective is CollectiveType.REDUCE_SCATTER
            and op.axes == tp
        ):
            scattered[id(op.inputs[0].base or op.inputs[0])] = op.output
    total = sum(binder.nbytes(t) for t in part.inputs if t.kind == "input")
    matmuls = 0
    for op in part.forward:
        if op.kind != "einsum" or "core_attention" in op.tags:
            continue
        matmuls += 1
        if matmuls % 2 == 1:
            total += binder.nbytes(scattered.get(id(op.output), op.output))
    kept = saved_activations(part)
    if not fused:
        made = _core_tensors(part)
        return total + sum(binder.nbytes(t) for t in kept if id(t) in made)
    return total + _kept_bytes(part, binder, kept, binder.nbytes, core_only=True)


def _shard_of(t: Any) -> dict[str, Any]:
    return {d.name: axes for d, axes in zip(t.dims, t.sharding.dims, strict=True)}


def _warn_unknown_plan_ops(options: GenerateOptions, parts: ModelParts) -> None:
    """Warn (:class:`PrecisionPlanWarning`) about plan entries that match no matmul."""
    known = sorted(
        {
            op.name
            for bound in (parts.embedding, *parts.blocks.values(), parts.head)
            for op in bound.part.forward
            if op.kind == "einsum"
        }
    )
    for pattern in unmatched_patterns(normalize_plan(options.precision), known):
        warnings.warn(
            PrecisionPlanWarning(
                f"precision plan: op {pattern!r} matches no op of model {options.model!r} "
                f"and is ignored; known ops: {', '.join(known)}"
            ),
            stacklevel=3,
        )


SPLIT_AXES = frozenset({"tp", "sp", "ep"})
"""Mesh axes whose collectives sit inside every layer: their groups must not mix devices."""


def _device_group_plans(options: GenerateOptions) -> tuple[list[str], dict[str, PrecisionPlan]]:
    """The device group of every rank (empty without a placement) and the one-group precision
    plan each group runs (see :func:`stg.core.precision.plan_for_group`)."""
    precision = normalize_plan(options.precision)
    named = plan_groups(precision)
    if not options.placement:
        if named:
            raise OptionError(
                f"the precision plan names device groups ({', '.join(named)}) but the run has "
                "none: give a hybrid --system file with those groups (or --placement)"
            )
        return [], {}
    rank_groups = [name for name, count in options.placement for _ in range(count)]
    if len(rank_groups) != options.world_size:
        raise OptionError(
            f"placement={','.join(f'{n}:{c}' for n, c in options.placement)} places "
            f"{len(rank_groups)} ranks, but the run has {options.world_size} "
            + ("(dp x tp x sp x pp)" if options.ep_folded else "(dp x tp x sp x pp x ep)")
        )
    known = list(dict.fromkeys(rank_groups))
    unknown = [g for g in named if g not in known]
    if unknown:
        raise OptionError(
            f"the precision plan names device group {unknown[0]!r}, which holds no rank; "
            f"groups of this run: {', '.join(known)}"
        )
    return rank_groups, {g: plan_for_group(precision, g) for g in known}


def _check_within_device_group(
    axes: tuple[str, ...],
    members: tuple[int, ...],
    rank_groups: list[str],
    split_axes: frozenset[str] = SPLIT_AXES,
) -> None:
    """A group of split axes only (a tp, sp, ep group or their product) must sit in one device
    group. A group that also spans dp or pp (the dp x tp all-reduce of sequence-parallel norm
    gradients, fp8's amax group) joins device groups by design: the split groups inside it
    are checked on their own."""
    split = sorted(split_axes & set(axes))
    if not split or not set(axes) <= split_axes:
        return
    kinds = sorted({rank_groups[m] for m in members})
    if len(kinds) > 1:
        raise OptionError(
            f"the {'/'.join(split)} group of ranks {members[0]}..{members[-1]} spans device "
            f"groups {' and '.join(kinds)}; tensor, sequence and expert parallelism run "
            "within one device group: choose degrees (and --rank_order) so that each group "
            "holds whole tp x sp x ep groups"
        )


def _dispatches_to_experts(part: Any) -> bool:
    """Whether a bound part moves tokens over an all-to-all (a mixture's expert dispatch):
    what ``fp8_dispatch`` quantizes and ``overlap_moe_ep_comm`` hides."""
    return any(
        op.type is NodeType.COMM_COLL and op.comm_type is CollectiveType.ALL_TO_ALL
        for op in part.forward
    )


def _routes_experts(part: Any) -> bool:
    """Whether a bound part has an expert-parallel all-to-all that ``moe_dispatcher`` marked."""
    return any(DISPATCHER_ATTR in dict(op.attrs) for op in part.forward)


def parts_detach(options: GenerateOptions) -> bool:
    """Whether one set of bound parts is all a build of ``options`` lowers (no device groups,
    which take a set per precision variant; no serving phase; no precision plan, whose
    patterns are checked against the symbolic graph on every build): what
    :func:`detached_parts` keeps."""
    return not (options.inference or options.placement or options.precision)


def detached_parts(options: GenerateOptions, registry: Registry) -> ModelParts | None:
    """The bound parts that :func:`build_workload` lowers for ``options``, without the
    symbolic parts they were bound from: what a caller keeps (a pickle) to build the same
    model's workloads again with ``parts``, where lowering imports no symbolic core (sympy).
    None where a build takes more than these parts (:func:`parts_detach`)."""
    if not parts_detach(options):
        return None
    plan = validate_options(options, registry)
    parts = build_parts(registry.models.get(options.model), plan)
    detached: dict[int, BoundPart] = {}

    def detach(bp: BoundPart) -> BoundPart:
        found = detached.get(id(bp))
        if found is None:
            found = detached[id(bp)] = replace(bp, part=None)
        return found

    return replace(
        parts,
        embedding=detach(parts.embedding),
        block=detach(parts.block),
        head=detach(parts.head),
        blocks={kind: detach(bp) for kind, bp in parts.blocks.items()},
    )


def _precision_variants(
    options: GenerateOptions,
) -> tuple[list[str], dict[str, PrecisionPlan], list[PrecisionPlan]]:
    """Each rank's device group, each group's plan, and the distinct plans (the one plan
    without device groups)."""
    rank_groups, group_plans = _device_group_plans(options)
    variants = list(dict.fromkeys(group_plans.values())) or [normalize_plan(options.precision)]
    return rank_groups, group_plans, variants


def _variant_parts(
    options: GenerateOptions,
    plan: ParallelPlan,
    variants: list[PrecisionPlan],
    rank_groups: list[str],
    registry: Registry,
) -> list[ModelParts]:
    """The bound parts of each precision variant of ``options`` (one per device group's plan,
    or the one plan), warning about plan entries that match no matmul."""
    model = registry.models.get(options.model)
    variant_parts = []
    for precision in variants:
        o = replace(options, precision=precision, placement=())
        parts = build_parts(model, plan if o == options else make_plan(o), bool(rank_groups))
        if precision:
            _warn_unknown_plan_ops(o, parts)
        variant_parts.append(parts)
    return variant_parts


def check_precision_plan(options: GenerateOptions, registry: Registry) -> None:
    """Warn (:class:`PrecisionPlanWarning`) about the entries of a training run's precision
    plan that match no matmul of its model, as :func:`build_workload` does, without lowering:
    for predictors that read the options alone (the memory predictor's closed forms)."""
    if options.precision and not options.inference:
        rank_groups, _, variants = _precision_variants(options)
        _variant_parts(
            options, validate_options(options, registry), variants, rank_groups, registry
        )


def build_workload(
    options: GenerateOptions,
    registry: Registry,
    progress: Progress | None = None,
    *,
    lowered_micro_batches: int | None = None,
    parts: ModelParts | None = None,
) -> Workload:
    """Build the workload of one training iteration (or, with ``options.phase``, of a serving
    run: :mod:`stg.core.inference`) for every rank.

    ``lowered_micro_batches``: lower only the first that many micro-batches of the iteration
    (a predictor that replays a pipeline's fill, a few periods and its drain, and adds the
    other periods): every stage's schedule keeps its steps of those micro-batches, in order,
    which must be the schedule's own order for that many micro-batches (else ValueError);
    the rest (parameters, the optimizer, the metadata's options and ``micro_batches``) is the
    whole iteration's, and the metadata records ``lowered_micro_batches``.

    ``parts``: :func:`detached_parts` of these options (of a build before), lowered as they
    are: the symbolic core is not run (ValueError where ``detached_parts`` gives none)."""
    # hundreds of thousands of nodes, none in a reference cycle: the cyclic collector would
    # only scan them, again and again as they pile up
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_workload(options, registry, progress, lowered_micro_batches, parts)
    finally:
        if enabled:
            gc.enable()


def _build_workload(
    options: GenerateOptions,
    registry: Registry,
    progress: Progress | None,
    lowered_micro_batches: int | None,
    given: ModelParts | None = None,
) -> Workload:
    plan = validate_options(options, registry)
    if given is not None and not parts_detach(options):
        raise ValueError("bound parts are lowered as given only where detached_parts gives some")
    if options.inference:  # prefill, decode, mixed: forward only, with a KV cache
        from stg.core.inference import build_inference_workload

        return build_inference_workload(options, plan, registry.models.get(options.model), progress)
    schedule: PipelineSchedule = registry.schedules.get(options.pipeline_schedule)
    rank_groups, group_plans, variants = _precision_variants(options)
    variant_parts = (
        [given]
        if given is not None
        else _variant_parts(options, plan, variants, rank_groups, registry)
    )
    amax_axes = AMAX_AXES
    if len({_fp8_signature(parts) for parts in variant_parts}) > 1:
        # device groups whose fp8 GEMMs differ cannot share an amax buffer across data
        # parallelism: each reduces within its tensor x context parallel group (Megatron's
        # --tp-only-amax-red), which stays inside one device group
        amax_axes = MODEL_PARALLEL_AMAX_AXES
    stages = plan.stages
    flushes = options.pipeline_flushes
    orders = [
        flushed_order(schedule, s, stages, plan.micro_batches, plan.chunks_per_stage, flushes)
        for s in range(stages)
    ]
    if lowered_micro_batches is not None:
        orders = _prefix_orders(schedule, plan, orders, lowered_micro_batches, flushes)
    total_steps = sum(len(o) for o in orders) * len(variant_parts)
    done = 0
    classes = []
    run_plans: RunPlans = {}
    class_axes: list[set[tuple[str, ...]]] = []  # each class's group axes
    for stage in range(stages):

        def tick() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress("lowering", done, total_steps)

        for k, parts in enumerate(variant_parts):
            axes_here: set[tuple[str, ...]] = set()
            cls = lower_stage(
                stage, plan, parts, orders[stage], tick, amax_axes, run_plans, axes_here
            )
            if rank_groups:  # one class per (precision variant, stage)
                names = [g for g, p in group_plans.items() if p == variants[k]]
                cls = replace(
                    cls,
                    index=k * stages + stage,
                    facts={**cls.facts, "precision": variants[k], "device_groups": names},
                )
            classes.append(cls)
            class_axes.append(axes_here)
    if len(variant_parts) > 1:
        order = sorted(range(len(classes)), key=lambda i: classes[i].index)
        classes = [classes[i] for i in order]
        class_axes = [class_axes[i] for i in order]
    used_axes: list[tuple[str, ...]] = []
    stage_axes = class_axes
    for axes_here in class_axes:
        for axes in sorted(axes_here):
            if axes not in used_axes:
                used_axes.append(axes)
    layout = Layout(plan.degrees, plan.rank_order, tuple(used_axes))
    variant_of = [0] * layout.world_size
    if len(variant_parts) > 1:
        variant_of = [variants.index(group_plans[g]) for g in rank_groups]
    ranks = tuple(
        RankGraph(r, classes[variant_of[r] * stages + layout.stage(r)], layout)
        for r in range(layout.world_size)
    )
    # each group's members once (not once per member rank): linear in the number of ranks;
    # a member of a group found along some axes has that group's id (Layout numbers each
    # group whole), so it is not looked up again, except along the pipeline ends, where
    # ranks off the ends have no group
    groups: dict[int, tuple[int, ...]] = {}
    grouped: dict[tuple[str, ...], set[int]] = {}  # axes -> the members of their groups found
    for graph in ranks:
        for axes in stage_axes[graph.rank_class.stage]:
            found = grouped.get(axes)
            if found is not None and graph.rank in found:
                continue
            gid = layout.group_id(graph.rank, axes)
            if gid not in groups:
                groups[gid] = layout.members(graph.rank, axes)
                if PIPELINE_ENDS not in axes:
                    grouped.setdefault(axes, set()).update(groups[gid])
                if rank_groups:
                    _check_within_device_group(
                        axes, groups[gid], rank_groups, plan.mesh_axes(SPLIT_AXES | {"etp"})
                    )
    metadata: dict[str, Any] = {
        "generator": "stg",
        "options": options.recorded(),
        "micro_batches": plan.micro_batches,
        "layers_per_chunk": list(plan.layers_per_chunk),
    }
    if lowered_micro_batches is not None:
        metadata["lowered_micro_batches"] = lowered_micro_batches
    return Workload(ranks, dict(sorted(groups.items())), layout, metadata)


def flushed_order(
    schedule: PipelineSchedule,
    stage: int,
    stages: int,
    micro_batches: int,
    chunks: int,
    flushes: int = 1,
) -> list[Any]:
    """Stage ``stage``'s order of ``micro_batches`` micro-batches run as ``flushes`` schedules
    in turn (``pipeline_flushes``): the schedule's order of ``micro_batches / flushes``, then
    the same for the next ones."""
    if flushes == 1:
        return schedule.order(stage, stages, micro_batches, chunks)
    each = micro_batches // flushes
    one = schedule.order(stage, stages, each, chunks)
    return [(d, mb + f * each, c) for f in range(flushes) for d, mb, c in one]


def _prefix_orders(
    schedule: PipelineSchedule,
    plan: ParallelPlan,
    orders: list[list[Any]],
    keep: int,
    flushes: int = 1,
) -> list[list[Any]]:
    """Each stage's order restricted to its first ``keep`` micro-batches, where that is the
    order of ``keep`` micro-batches (:func:`flushed_order`: never a part of several
    schedules in turn; see :func:`build_workload`)."""
    if not 0 < keep <= plan.micro_batches:
        raise ValueError(f"cannot lower {keep} of {plan.micro_batches} micro-batches")
    out = []
    for stage, order in enumerate(orders):
        prefix = [step for step in order if step[1] < keep]
        own = flushed_order(schedule, stage, plan.stages, keep, plan.chunks_per_stage, flushes)
        if [tuple(step) for step in own] != [tuple(step) for step in prefix]:
            raise ValueError(
                f"schedule {schedule.name!r}: its order for {keep} micro-batches is not the "
                f"first {keep} of its order for {plan.micro_batches} (stage {stage})"
            )
        out.append(prefix)
    return out


def name_in_micro_batch(node: Any, micro_batch: int) -> str:
    """The name lowering gives the alike of ``node`` (a node of a micro-batch: its
    ``micro_batch`` attribute) in another micro-batch: generated names start with
    ``mb<micro-batch>/``. Other names are returned as they are."""
    prefix = f"mb{node_micro_batch(node)}/"
    if not node.name.startswith(prefix):
        return node.name
    return f"mb{micro_batch}/{node.name[len(prefix) :]}"
