"""The options of one generation run, with the original STG's names and defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from stg.errors import UnknownNameError, UserError
from stg.host.records import MODEL_OPTIONS

if TYPE_CHECKING:
    from stg.host.registry import Registry


class OptionError(UserError):
    """An impossible option value: the message names the option and the allowed values."""


MODEL_ALIASES: dict[str, str] = {"dense": "gpt"}
"""Model names of the original STG that name a registered model: ``dense``, its default,
is the default GPT model. (Its ``debug`` is a preset: ``stg.models.presets``.)"""


UNSET_OPTIONS: tuple[str, ...] = (
    "dhead",
    "shared_experts",
    "dense_layers",
    "dense_dff",
    "q_lora_rank",
    "kv_lora_rank",
    "drope",
    "mtp_depth",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "ep_layout",
    "etp",
    "recompute_method",
    "recompute_num_layers",
    "norm_type",
    *MODEL_OPTIONS,
)
"""Options whose default ``None`` means "unset" (each model says what that means): a
workload's metadata leaves them out when unset, so traces that do not use them keep their
bytes."""


class ReadOptions(Mapping[str, Any]):
    """A run's options as the mapping a model reads (``b.options``, ``stack(options)``),
    remembering which were read."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._values[key]

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


MODEL_READ_SWITCHES = ("moe_sort_by_expert",)
"""Switches that only some models' layers read (a mixture of experts' dispatch), checked as
:data:`MODEL_OPTIONS` are but not settable by a preset."""


def check_options_read(options: ReadOptions, model: str) -> None:
    """Refuse an option of :data:`MODEL_OPTIONS` or :data:`MODEL_READ_SWITCHES` that is set
    but that no part of ``model`` read: it would do nothing. Those a preset filled in
    (``preset_fills``) are left alone."""
    filled = options._values.get("preset_fills") or ()
    for name in (*MODEL_OPTIONS, *MODEL_READ_SWITCHES):
        value = options._values.get(name)
        if name in filled:
            continue
        if value is not None and value is not False and name not in options.read:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise OptionError(
                f"{name}={shown} does not apply to model {model!r}: none of its layers reads it "
                "(leave it unset)"
            )


@dataclass(frozen=True)
class PresetUse:
    """What a named preset (:class:`stg.host.records.Preset`) contributed to a run's options.

    ``values`` are the options taken from the preset (``model`` first, then its dimensions
    that were not given); ``overridden`` maps each dimension of the preset that an explicit
    option replaced to ``(preset value, given value)``; ``padded`` maps ``dvocal`` to
    ``(published, padded, multiple)`` where the preset pads its vocabulary as Megatron-LM
    does (``Preset.vocab_divisible_by``).
    """

    name: str
    qualified: str
    source: str
    values: Mapping[str, Any]
    overridden: Mapping[str, tuple[Any, Any]]
    padded: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: name, qualified (``dist:name``), source, values, overridden, padded."""
        return {
            "name": self.name,
            "qualified": self.qualified,
            "source": self.source,
            "values": dict(self.values),
            "overridden": {
                key: {"preset": preset, "given": given}
                for key, (preset, given) in self.overridden.items()
            },
            "padded": {
                key: {"published": published, "padded": padded, "multiple": multiple}
                for key, (published, padded, multiple) in self.padded.items()
            },
        }


def resolve_model(
    values: Mapping[str, Any], registry: Registry
) -> tuple[dict[str, Any], PresetUse | None]:
    """``values`` (the GenerateOptions fields that were given) with ``model`` resolved.

    A registered model (name, alias or ``dist:name``) stays as it is, ``dense`` becomes
    ``gpt`` (:data:`MODEL_ALIASES`), and a preset's name (``llama3-8b``, ``debug``) becomes
    its model, its dimensions filling the fields that were not given. Returns the values and
    what a preset contributed (None without one). An unknown name is an
    :class:`~stg.errors.UnknownNameError` listing the models and the presets.
    """
    given = dict(values)
    name = given.get("model")
    if not isinstance(name, str):
        return given, None
    if name in MODEL_ALIASES:
        given["model"] = MODEL_ALIASES[name]
        return given, None
    try:
        registry.models.check(name)  # imported only when it is built
        return given, None  # a model template: the name stays
    except UnknownNameError:
        pass
    try:
        entry = registry.presets.lookup(name)
    except UnknownNameError:
        raise UnknownNameError(
            f"unknown model {name!r}; allowed: models {', '.join(registry.models.names())}; "
            f"presets {', '.join(registry.presets.names()) or '(none)'}" + registry.failures_note()
        ) from None
    preset = entry.item
    try:
        registry.models.check(preset.model)
    except UnknownNameError:
        raise UnknownNameError(
            f"preset {name!r} ({entry.qualified}) builds model {preset.model!r}, which is not "
            f"registered; allowed: {', '.join(registry.models.names())}" + registry.failures_note()
        ) from None
    taken = {"model": preset.model}
    taken.update((k, v) for k, v in preset.dims.items() if k not in given)
    overridden = {k: (v, given[k]) for k, v in preset.dims.items() if k in given and given[k] != v}
    padded: dict[str, tuple[int, int, int]] = {}
    tp = given.get("tp", 1)
    if preset.vocab_divisible_by and "dvocal" in taken and isinstance(tp, int) and tp >= 1:
        # Megatron-LM's _vocab_size_with_padding: a multiple of make-vocab-size-divisible-by·tp
        multiple = preset.vocab_divisible_by * tp
        published = int(taken["dvocal"])
        taken["dvocal"] = -(-published // multiple) * multiple
        padded["dvocal"] = (published, taken["dvocal"], multiple)
    given.update(taken)
    filled = tuple(k for k in taken if k in MODEL_OPTIONS)
    if filled:
        given["preset_fills"] = filled
    use = PresetUse(entry.name, entry.qualified, preset.source, taken, overridden, padded)
    return given, use


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``stg generate`` needs to build a workload.

    Field names are the original STG's command-line options (underscored). ``precision`` is
    a per-op precision plan, ``((op name pattern, dtype), ...)`` (see :mod:`stg.core.precision`;
    ``--precision_plan FILE`` on the command line). Sizes are global:
    ``batch`` samples per iteration, ``micro_batch`` samples per micro-batch over all replicas
    (``None``, or ``-1`` as in the original STG, means one micro-batch: the whole batch).
    ``zero=3`` means ``weight_sharded=True`` (it is stored as that, with ``zero=0``).
    ``optimizer`` is ``adam`` (the default) or ``muon``: Megatron-Core's Muon, which
    orthogonalizes each weight matrix with ``muon_ns_steps`` Newton-Schulz iterations (Adam
    for embeddings, output layers and non-matrix weights); with ``zero`` 1 or 2 it is
    Megatron's layer-wise distributed Muon (:mod:`stg.core.muon`).
    ``attention`` is how the attention core runs: ``fused`` (one FlashAttention-class kernel
    forward and one backward, no score matrix in memory; every current stack) or ``unfused``
    (scores, softmax and context as separate kernels through memory). ``profile`` names how the
    training stack executes, for predictors: ``megatron`` (Megatron-LM / Transformer Engine: fused
    kernels, asynchronous launches), ``eager`` (eager PyTorch: one kernel per op, each paying the
    host's launch cost, the loss on fp32 logits) or ``compiled`` (PyTorch under ``torch.compile``,
    as torchtitan's ``--training.compile``: fused kernels as Megatron's, attention by SDPA's
    backend, FlashAttention-2 up to Hopper) or ``torchtitan`` (torchtitan's Llama in eager PyTorch
    without autocast, as at pytorch/torchtitan 1ea476e9f: fused kernels where it has them, its
    unfused elementwise ops as the kernels they are, :mod:`stg.core.torchtitan`; ``norm_type`` is
    then its ``model.norm_type``, ``fused_rmsnorm`` by default or ``rmsnorm``, RMSNorm as separate
    fp32 ops). ``eager_loss`` (``compiled`` only) runs the loss outside the compiled region, as
    eager PyTorch's ``F.cross_entropy`` on an fp32 copy of the logits (its kernels and its
    memory as under ``eager``), as torchtitan did before it compiled its loss (``train.py`` at
    pytorch/torchtitan 9dec370 leaves ``loss_fn`` uncompiled: "compiling loss function causes
    CUDA errors, turning off for now"; ``torchtitan/components/loss.py`` at 2887250 compiles
    it with the model). ``dropout`` is the training dropout rate p of
    the models whose architecture has dropout (GPT, BERT, RoBERTa): hidden dropout after the
    attention projection and after the MLP (Megatron's fused bias-dropout-add), on the
    embedding, and on the attention probabilities (Megatron's ``--hidden-dropout`` and
    ``--attention-dropout``, both 0.1 in GPT-3-style runs); 0 (the default) builds no dropout
    op. Models that train without dropout (Llama, MoE, DeepSeek) refuse p > 0. ``dhead`` is
    the size of one attention head;
    ``None`` means ``dmodel / head`` (Qwen3 sets it apart: 128 with dmodel 2048 and 32 heads).
    ``model`` is a registered model; a preset's name is resolved before (:func:`resolve_model`).

    ``phase`` is ``training`` (one training iteration, the default) or a serving phase
    (:mod:`stg.core.inference`): ``prefill`` (``batch`` prompts of ``seq`` tokens, forward
    only, writing the KV cache), ``decode`` (``steps`` steps of one new token for each of
    ``batch`` sequences against a KV cache of ``context`` tokens, default ``seq``, growing by
    one per step) or ``mixed`` (one continuously batched iteration: ``prefill_batch``
    requests prefill a chunk of ``chunk`` tokens, default ``seq``, after ``prefill_context``
    tokens already cached, beside ``batch`` requests decoding against ``context`` tokens).
    ``kv_dtype`` is the KV cache's dtype (default ``dtype``; fp8 or int8 quantise it).

    The options of :data:`UNSET_OPTIONS` (``None``: unset) are read by the models that have
    such parts: ``shared_experts`` (experts every token uses, beside the routed ones),
    ``dense_layers`` and ``dense_dff`` (the first layers of a stack of MoE layers are dense,
    with this FFN size), and multi-head latent attention's ``q_lora_rank`` and
    ``kv_lora_rank`` (the ranks of the query and key/value compressions) and ``drope`` (the
    decoupled RoPE dimension of a query head and of the key shared by the heads);
    ``mtp_depth``: multi-token prediction modules after the head (DeepSeek-V3: 1; unset: none).
    Attention that is not full causal (Llama-family models, ``--causal true``):
    ``attention_window`` (each query sees its latest W keys: sliding window) or
    ``attention_chunk`` (the keys of its own chunk: chunked local attention), on every layer
    or, with ``full_attention_every`` k, on all but every k-th layer (gpt-oss: window 128,
    k 2; Llama 4: chunk 8192, k 4); ``attention_sinks`` gives each head a learned sink logit
    (gpt-oss); ``attention_output_gate`` gates the attention output by a sigmoid of another
    projection of the layer input (Qwen3-Next's gated attention). Hybrid stacks (the
    ``hybrid`` model) take ``layer_pattern``, one letter per layer
    (:mod:`stg.models.hybrid`), ``mlp_activation`` (``swiglu``, or ``relu2``:
    Nemotron-H's squared-ReLU MLP), with Mamba-2's ``ssm_state``, ``ssm_heads``,
    ``ssm_head_dim``, ``ssm_groups`` and ``ssm_chunk`` and gated DeltaNet's
    ``linear_key_heads``, ``linear_value_heads`` and ``linear_head_dim``. DeepSeek's sparse
    attention (DSA, DeepSeek-V3.2): ``index_topk`` keys per query picked by a lightning
    indexer of ``index_heads`` heads of ``index_head_dim``. ``tie_embeddings`` shares one
    matrix between the word embedding and the LM head (MPT, Gemma, Llama 3.2 1B/3B): one
    weight with pp 1; with pp > 1 a copy on the last stage whose gradient, and the
    embedding's, are all-reduced over the first and last stage, as Megatron-LM's embedding
    group does (:data:`stg.core.layout.PIPELINE_ENDS`).
    ``amax_history`` is the length of Transformer Engine's amax history of every fp8 tensor
    (``DelayedScaling.amax_history_len``, default 1024): a training run with fp8 GEMMs under
    the ``megatron`` profile carries TE's delayed-scaling bookkeeping (:mod:`stg.core.fp8`),
    whose update kernel reads and writes those histories.
    ``low_precision_recipe`` is how a ``dtype`` fp8 training run quantizes its GEMMs
    (:mod:`stg.core.recipes`): ``delayed`` (Transformer Engine's delayed scaling, the
    default), ``tensorwise``, ``rowwise``, ``blockwise``, ``mxfp8`` or ``nvfp4`` (GEMMs in
    fp4). ``fp8_param_gather`` (Megatron-LM's ``--fp8-param-gather``) keeps the weights of such
    a run in fp8 and gathers them in fp8 under FSDP (``weight_sharded``), instead of bf16.
    ``fp8_dispatch`` sends a mixture of experts' tokens (and, backward, the down-projection's
    output gradients) to the experts in the recipe's format, as DeepSeek-V3 trains, instead
    of bf16. ``fp8_attention`` (Megatron-LM's ``--fp8-dot-product-attention``, Transformer
    Engine's ``fp8_dpa``) runs the fused attention core of such a run in fp8 too: cuDNN's fp8
    kernel (per-tensor scales; block-scaled MXFP8 under the ``mxfp8`` recipe) at its measured
    speed over bf16 (:data:`stg.perf.kernel_time.FP8_ATTENTION_SPEED`), with the casts of Q, K,
    V and the output (backward: of the output gradient and dQ, dK, dV) around it
    (:func:`stg.core.lowering.fp8_attention_ops`; the ``megatron`` profile and the
    ``delayed``, ``tensorwise``, ``mxfp8`` or ``nvfp4`` recipe). ``moe_sort_by_expert`` adds
    the copies of Megatron-core's alltoall token dispatcher, which put the rows an
    expert-parallel all-to-all brings in local-expert order and back
    (:func:`stg.models.moe.sorted_by_expert`; needs ``ep`` > 1, the ``megatron`` profile and a
    model with experts). ``moe_dispatcher`` is the library that runs the
    expert-parallel all-to-alls (:data:`stg.core.routing.DISPATCHERS`): ``alltoall`` (NCCL's
    all-to-all, the default), ``deepep`` or ``hybridep``, which send a token once per
    destination rank and node at their kernels' measured rates
    (:mod:`stg.perf.ep_dispatch`; needs ``ep`` > 1 and a model with experts); ``moe_gate``
    is where a token's experts fall for that deduplication (:data:`stg.core.routing.GATES`):
    ``random`` (the default) or ``consecutive`` (NeMo AutoModel's fake balanced gate).
    ``nvfp4_disable_rht`` and ``nvfp4_disable_stochastic_rounding`` turn off the ``nvfp4``
    recipe's random Hadamard transform and stochastic rounding, as Transformer Engine's
    ``NVTE_NVFP4_DISABLE_RHT`` and ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING`` do
    (:func:`stg.core.recipes.training_recipe`).
    ``first_last_layers_bf16`` (Megatron-LM's ``--first-last-layers-bf16``) keeps the first
    ``num_layers_at_start_in_bf16`` and the last ``num_layers_at_end_in_bf16`` layers of the
    stack (Megatron's defaults: 1 and 1) of such a run out of the recipe: their GEMMs run in
    bf16, with no quantize nodes and no quantized weight copies (:attr:`bf16_layers`).
    ``megatron_fsdp`` makes ``weight_sharded`` Megatron-LM's FSDP (Megatron-FSDP,
    ``--use-megatron-fsdp``) instead of PyTorch's FSDP2: its parameters are views into the
    gathered buckets and its gradients live in its reduce-scatter buffers
    (``megatron_fsdp/param_and_grad_buffer.py``: ``p.data`` set to the bucket's items), so
    FSDP2's copy kernels around the collectives (``fsdp_copy_out``, ``fsdp_copy_in``) do not
    run.
    ``reshard_after_forward`` is FSDP2's (``fully_shard``) policy for the gathered weights of
    ``weight_sharded`` runs, with torchtitan's values (``fsdp_reshard_after_forward``):
    ``always`` frees them after a layer's forward (gathered again before its backward),
    ``never`` keeps them until the backward, ``default`` is ``never`` with pipeline
    parallelism and ``always`` without (:attr:`reshards_after_forward`).
    How the ``num_stacks`` layers are split over the ``pp · virtual_stages`` model chunks
    (:func:`stg.core.plan.chunk_layer_counts`): by default as evenly as possible, the first
    chunks one layer longer where the division is not exact. Megatron-LM's options choose
    otherwise: ``decoder_first_pipeline_num_layers`` and ``decoder_last_pipeline_num_layers``
    (the layers of the first and last stage, the others split evenly over the middle
    stages), ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split`` (the embedding, the head and loss each count as a
    layer in an even split); ``pipeline_layers`` lists the layers of every chunk, in chunk
    order (chunk c runs on stage c mod pp), where the first and last may be 0: the
    embedding or the head alone on its stage. ``pipeline_flushes`` runs an iteration's
    micro-batches as that many pipeline schedules in turn, each filled and drained and
    ending with its gradient reductions (and FSDP's reshard), then the optimizer step:
    PyTorch-native gradient accumulation under pipeline parallelism (torchtitan's trainer and
    NeMo AutoModel call the schedule's ``step`` once per accumulation step); 1 (the default)
    is one schedule, as Megatron-LM runs it.
    Expert parallelism has two layouts (``ep_layout``). ``multiply`` (the default, stg's
    meaning from the start): ``ep`` is a mesh axis of its own that multiplies the world
    (``dp·tp·sp·pp·ep`` ranks); outside the experts its ranks are data-parallel replicas
    (the batch splits over ``dp·ep``) and the experts split their FFN over ``tp``.
    ``fold`` (Megatron-LM's MoE parallel folding, ``--expert-model-parallel-size`` with
    ``--expert-tensor-parallel-size``): the world is ``dp·tp·sp·pp`` and the experts see the
    same ranks of a stage as ``etp·ep·edp`` (expert tensor, expert, expert data
    parallelism; ``edp = dp·tp·sp / (ep·etp)``), numbered in ``rank_order`` (where ``tp``,
    ``ep`` and ``dp`` stand) as the dense ``tp, sp, dp`` are, so an expert-parallel group
    may span tensor-, context- and data-parallel ranks. ``etp`` (default ``tp``, as
    Megatron) splits each expert's FFN; giving it implies ``fold``. See
    :func:`stg.core.layout.fold_mesh`.
    ``cp_comm_type`` is how context parallelism (``sp``) moves keys and values, Megatron's
    ``--cp-comm-type``: ``p2p`` (a ring overlapped with the attention steps, the default) or
    ``all_gather`` (:func:`stg.core.lowering.context_parallel_attention`); under torchtitan's
    profiles (``compiled``, ``torchtitan``) ``all_gather`` is PyTorch's own context parallelism
    with its all-gather rotation (:mod:`stg.core.torch_context_parallel`).
    ``attention_backend`` is which fused attention kernel the training stack runs, Megatron-LM's
    ``--attention-backend`` (Transformer Engine's ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN``):
    ``auto`` (the stack's own choice per architecture,
    :data:`stg.perf.kernel_time.ATTENTION_CHOICE`), ``flash`` (the flash-attn package:
    FlashAttention-2; Composable Kernel's on AMD) or ``fused`` (the vendor library: cuDNN;
    AITER on AMD). Every fused attention node then carries it
    (:mod:`stg.core.attention_backend`).
    Full recompute (``activation_recompute=full``) checkpoints every layer on its own unless
    Megatron-LM's ``recompute_method`` and ``recompute_num_layers`` say otherwise
    (:meth:`stg.core.plan.ParallelPlan.layer_recompute`): ``uniform`` cuts each model chunk
    into groups of ``recompute_num_layers`` layers (the last may be shorter) and keeps only
    each group's input, the whole group recomputed before its backward; ``block`` recomputes
    the first ``recompute_num_layers`` layers of each model chunk, one checkpoint per layer,
    and keeps every activation of the others. Selective recompute re-runs the modules of
    ``recompute_modules`` (Megatron-LM's ``--recompute-modules``; empty: ``core_attn``, the
    attention core, as Megatron's default): ``mlp`` (the dense MLP, from its input; in a
    stack of dense and MoE layers that of the dense layers only, as Megatron-LM, which
    recomputes no ``MoELayer`` under it: :data:`stg.models.deepseek.MLP`),
    ``layernorm`` (the norms, whose outputs are not kept), ``mla_up_proj`` (multi-head
    latent attention's latent norms, up-projections and RoPE, whose outputs, the per-head
    query, key and value, are not kept: :data:`stg.models.deepseek.UP_PROJ`).
    ``selective_op`` is torchtitan's op-level selective checkpointing
    (``selective_ac_option = "op"``): each layer re-runs every op but the attention core and
    the odd-numbered matmuls, whose outputs it keeps, and the sequence-parallel all-gathers
    (:func:`stg.core.lowering.op_checkpoint_recomputes`).
    ``cpu_offloading_num_layers`` (Megatron-LM's ``--cpu-offloading-num-layers``; 0, the
    default, is off) copies the saved activations of the first N layers to host memory after
    each layer's forward and back before its backward, on a copy stream beside the compute
    (Transformer Engine's ``get_cpu_offload_context``): see :mod:`stg.core.offload`.
    ``placement`` maps ranks to the device groups of a hybrid cluster, as runs
    ``((group, ranks), ...)`` in rank order (empty: one device kind); each group's ranks run
    the precision plan's entries for that group (:func:`stg.core.precision.plan_for_group`).
    """

    model: str = "gpt"
    dvocal: int = 32000
    dmodel: int = 8192
    dff: int = 28672
    batch: int = 64
    micro_batch: int | None = None
    seq: int = 1024
    head: int = 64
    kvhead: int = 8
    dhead: int | None = None
    num_stacks: int = 80
    experts: int = 8
    kexperts: int = 2
    capacity_factor: float = 1.0
    moe_routing: str = "capacity"
    moe_sort_by_expert: bool = False
    moe_dispatcher: str = "alltoall"
    moe_gate: str = "random"
    moe_dispatcher_sms: int | None = None
    shared_experts: int | None = None
    dense_layers: int | None = None
    dense_dff: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    drope: int | None = None
    mtp_depth: int | None = None
    attention_window: int | None = None
    attention_chunk: int | None = None
    full_attention_every: int | None = None
    attention_sinks: bool | None = None
    attention_output_gate: bool | None = None
    layer_pattern: str | None = None
    mlp_activation: str | None = None
    ssm_state: int | None = None
    ssm_heads: int | None = None
    ssm_head_dim: int | None = None
    ssm_groups: int | None = None
    ssm_chunk: int | None = None
    linear_key_heads: int | None = None
    linear_value_heads: int | None = None
    linear_head_dim: int | None = None
    index_topk: int | None = None
    index_heads: int | None = None
    index_head_dim: int | None = None
    tie_embeddings: bool | None = None
    dp: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1
    ep_layout: str | None = None
    etp: int | None = None
    tpsp: bool = True
    weight_sharded: bool = False
    zero: int = 0
    optimizer: str = "adam"
    muon_ns_steps: int = 5
    reshard_after_forward: str = "default"
    cp_comm_type: str = "p2p"
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    overlap_moe_ep_comm: bool = False
    activation_recompute: str = "none"
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ()
    cpu_offloading_num_layers: int = 0
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_layers: tuple[int, ...] = ()
    pipeline_flushes: int = 1
    mixed_precision: bool = False
    dtype: str = "bf16"
    grad_reduce_dtype: str | None = None
    causal: bool = False
    attention: str = "fused"
    attention_backend: str = "auto"
    dropout: float = 0.0
    profile: str = "megatron"
    norm_type: str | None = None
    precision: tuple[tuple[str, str], ...] = ()
    amax_history: int = 1024
    low_precision_recipe: str = "delayed"
    fp8_param_gather: bool = False
    fp8_dispatch: bool = False
    fp8_attention: bool = False
    eager_loss: bool = False
    nvfp4_disable_rht: bool = False
    nvfp4_disable_stochastic_rounding: bool = False
    megatron_fsdp: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    placement: tuple[tuple[str, int], ...] = ()
    rank_order: str = "tp,sp,ep,dp,pp"
    phase: str = "training"
    context: int | None = None
    steps: int = 1
    kv_dtype: str | None = None
    prefill_batch: int = 0
    chunk: int | None = None
    prefill_context: int = 0
    format: str = "chakra-v0.0.4"
    output_dir: str = "generated"
    output_name: str = "workload.%d.et"
    preset_fills: tuple[str, ...] = field(
        default=(), compare=False, repr=False, metadata={"internal": True}
    )
    """The options of :data:`stg.host.records.MODEL_OPTIONS` a preset filled in (not given):
    one of them that the chosen layers do not read (a preset's ``ssm_state`` under a
    ``layer_pattern`` without Mamba layers) is left unused, not refused
    (:func:`check_options_read`). Set by :func:`resolve_model`; not an option of the command
    line, not recorded."""

    ATTENTION = ("fused", "unfused")
    ATTENTION_BACKENDS = ("auto", "flash", "fused")
    RECOMPUTE_METHODS = ("uniform", "block")
    RECOMPUTE_MODULES: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "core_attn": "core_attention",
            "mlp": "mlp",
            "layernorm": "layernorm",
            "mla_up_proj": "mla_up_proj",
        }
    )
    """Megatron-LM's ``--recompute-modules`` names that stg builds, and the op tag of each
    (:meth:`stg.core.symbolic.GraphBuilder.tag`)."""
    EP_LAYOUTS = ("multiply", "fold")
    RESHARD_AFTER_FORWARD = ("default", "always", "never")
    CP_COMM_TYPES = ("p2p", "all_gather")
    PROFILES = ("megatron", "eager", "compiled", "torchtitan")
    PHASES = ("training", "prefill", "decode", "mixed")
    OVERLAP_FIELDS = ("overlap_param_gather", "tp_comm_overlap", "overlap_moe_ep_comm")
    """Overlap options (read by the time predictor; ``overlap_moe_ep_comm`` is laid out in the
    trace's dependencies); left out of a trace's metadata while off, so traces generated without
    them keep their bytes."""
    INFERENCE_FIELDS = (
        "phase",
        "context",
        "steps",
        "kv_dtype",
        "prefill_batch",
        "chunk",
        "prefill_context",
    )
    """Fields of the inference phases (:mod:`stg.core.inference`); a training run leaves
    them out of its trace metadata, so training traces keep their bytes."""

    def __post_init__(self) -> None:
        # the original STG's spelling of "the whole batch"; same options, same workload
        if self.micro_batch == -1:
            object.__setattr__(self, "micro_batch", None)
        if isinstance(self.pipeline_layers, list):  # as a trace's metadata records it
            object.__setattr__(self, "pipeline_layers", tuple(self.pipeline_layers))
        if self.recompute_modules is None:  # "none named", as for the other optional fields
            object.__setattr__(self, "recompute_modules", ())
        elif isinstance(self.recompute_modules, list):
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        elif isinstance(self.recompute_modules, str):  # "core_attn,mlp", as on the CLI
            names = tuple(m.strip() for m in self.recompute_modules.split(",") if m.strip())
            object.__setattr__(self, "recompute_modules", names)
        # ZeRO-3 shards weights, gradients and optimizer states: what weight_sharded does
        if self.zero == 3:
            object.__setattr__(self, "zero", 0)
            object.__setattr__(self, "weight_sharded", True)
        # serving runs tensor parallelism with all-reduces (vLLM, TensorRT-LLM): Megatron's
        # sequence parallelism inside tp is a training memory saving, and a decode step's one
        # token per sequence cannot be split anyway
        if self.phase in self.PHASES[1:]:
            object.__setattr__(self, "tpsp", False)

    @property
    def inference(self) -> bool:
        """Whether this run is a serving phase (prefill, decode, mixed), not training."""
        return self.phase != "training"

    @property
    def micro_batches(self) -> int:
        """m = batch / micro_batch."""
        return self.batch // (self.micro_batch or self.batch)

    @property
    def ep_folded(self) -> bool:
        """Whether expert parallelism folds over the dense ranks (``ep_layout=fold``, or
        ``etp`` given without a layout) instead of multiplying the world."""
        if self.ep_layout is None:
            return self.etp is not None
        return self.ep_layout == "fold"

    @property
    def expert_tp(self) -> int:
        """How many ways each routed expert's FFN is split: ``etp`` (default ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def data_replicas(self) -> int:
        """How many ways the batch is split outside the experts: ``dp·ep`` (multiply) or
        ``dp`` (fold)."""
        return self.dp if self.ep_folded else self.dp * self.ep

    @property
    def expert_dp(self) -> int:
        """Expert data parallelism, the ranks of a stage that hold the same experts' shards:
        ``dp·sp`` (multiply; tp splits the experts) or ``dp·tp·sp / (ep·etp)`` (fold)."""
        if self.ep_folded:
            return self.dp * self.tp * self.sp // (self.ep * self.expert_tp)
        return self.dp * self.sp

    @property
    def world_size(self) -> int:
        if self.ep_folded:
            return self.dp * self.tp * self.sp * self.pp
        return self.dp * self.tp * self.sp * self.pp * self.ep

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    PIPELINE_SPLIT_FIELDS = (
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "pipeline_layers",
    )
    """How layers are split over pipeline stages where not as evenly as possible (with
    ``decoder_first_pipeline_num_layers`` and ``decoder_last_pipeline_num_layers``, unset by
    default: :func:`stg.core.plan.chunk_layer_counts`)."""
    OFF_UNRECORDED = (
        "placement",
        "dropout",
        "recompute_modules",
        "fp8_param_gather",
        "fp8_dispatch",
        "fp8_attention",
        "eager_loss",
        "moe_sort_by_expert",
        "moe_dispatcher_sms",
        "nvfp4_disable_rht",
        "nvfp4_disable_stochastic_rounding",
        "megatron_fsdp",
        "first_last_layers_bf16",
        "cpu_offloading_num_layers",
        *OVERLAP_FIELDS,
        *PIPELINE_SPLIT_FIELDS,
    )
    """Options left out of a trace's metadata while off (unset, 0 or false), so that traces
    generated without them keep the bytes they had before the option existed."""

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP frees a layer's gathered weights after its forward:
        ``reshard_after_forward`` resolved as torchtitan does (``default``: not under
        pipeline parallelism, whose per-micro-batch all-gathers it avoids)."""
        if self.reshard_after_forward == "default":
            return self.pp == 1
        return self.reshard_after_forward == "always"

    @property
    def te_delayed_scaling(self) -> bool:
        """Whether Transformer Engine's delayed scaling runs: a training run under the
        ``megatron`` profile whose matmuls may run in fp8 (``dtype`` fp8, or a precision plan
        naming fp8) under the default recipe. It turns the amax bookkeeping of
        :mod:`stg.core.fp8` on."""
        return (
            not self.inference
            and self.profile == "megatron"
            and (self.dtype == "fp8" or any(dtype == "fp8" for _, dtype in self.precision))
            and self.low_precision_recipe == "delayed"
        )

    @property
    def runs_eager_loss(self) -> bool:
        """Whether the loss is eager PyTorch's ``F.cross_entropy`` on an fp32 copy of the
        logits, its kernels and its memory: under ``eager``, under ``torchtitan`` (whose
        ``train.py`` computes it outside any compiled region: pytorch/torchtitan 1ea476e9f and
        9dec370, ``loss_fn``) and under ``compiled`` with ``eager_loss``."""
        return self.profile in ("eager", "torchtitan") or self.eager_loss

    BF16_LAYER_COUNTS = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
    """The layer counts of ``first_last_layers_bf16``, read (and recorded) only with it."""

    @property
    def bf16_layers(self) -> tuple[int, int]:
        """(first, last) layers of the stack kept in bf16 under a low-precision recipe: a
        layer of global index ``i`` of ``L`` is when ``i < first`` or ``i >= L - last``
        (Megatron-LM ``fp8_utils.is_first_last_bf16_layer``); (0, 0) without
        ``first_last_layers_bf16``."""
        if not self.first_last_layers_bf16:
            return (0, 0)
        return (self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16)

    def recorded(self) -> dict[str, object]:
        """The options a trace's metadata records: where the files go is not part of the
        workload (same options, same bytes anywhere); unset options, options that are off
        (:attr:`OFF_UNRECORDED`), ``reshard_after_forward``, ``cp_comm_type`` and
        ``attention_backend`` at their defaults, ``low_precision_recipe`` at its default
        (``delayed``), the layer counts of ``first_last_layers_bf16`` without it,
        ``amax_history`` without TE's delayed scaling (:attr:`te_delayed_scaling`),
        ``moe_routing``, ``moe_dispatcher`` and ``moe_gate`` at their defaults, the other
        kind of run's fields (inference fields in training, overlap fields in serving)
        are left out."""
        other = self.OVERLAP_FIELDS if self.inference else self.INFERENCE_FIELDS
        return {
            k: v
            for k, v in self.as_dict().items()
            if k not in {"output_dir", "output_name", "preset_fills", *other}
            and not (k in UNSET_OPTIONS and v is None)
            and not (k in self.OFF_UNRECORDED and not v)
            and not (k == "amax_history" and not self.te_delayed_scaling)
            and not (k == "reshard_after_forward" and v == "default")
            and not (k == "cp_comm_type" and v == "p2p")
            and not (k == "attention_backend" and v == "auto")
            and not (k == "low_precision_recipe" and v == "delayed")
            and not (k in self.BF16_LAYER_COUNTS and not self.first_last_layers_bf16)
            and not (k == "moe_routing" and v == "capacity")
            and not (k == "moe_dispatcher" and v == "alltoall")
            and not (k == "moe_gate" and v == "random")
            and not (k == "pipeline_flushes" and v == 1)
            and not (k == "optimizer" and v == "adam")
            and not (k == "muon_ns_steps" and self.optimizer != "muon")
        }
