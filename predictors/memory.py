"""The ``memory`` predictor: bytes per GPU for weights, gradients, optimizer states and activations.

Model state (mixed-precision Adam, Rajbhandari et al. 2020; Megatron-LM):

- weights in the compute dtype (``e_w`` bytes), gradients in ``e_g`` bytes (Megatron keeps fp32
  main gradients: ``e_g`` = 4, hence its 18 bytes per parameter; ZeRO's accounting uses 16-bit
  gradients: 16 bytes), optimizer ``K`` bytes: fp32 master weights and two fp32 moments
  (K = 12) with mixed precision, two moments in the weight dtype (K = 2·e_w) without;
- ZeRO-1 shards the optimizer, ZeRO-2 also the gradients, ZeRO-3 / FSDP (``weight_sharded``)
  also the weights, over N_d = dp·sp ranks (the ranks that hold the same weights). As in
  FSDP, DeepSpeed and Megatron's distributed optimizer (and as ``stg generate`` does), each
  unit (the embedding, every layer, the head) is one flat buffer padded to a multiple of N_d,
  so a rank holds ``ceil(Ψ_unit / N_d)`` elements of each unit: the closed forms above up to
  fewer than N_d padding elements per unit, for any N_d.

Activations (Korthikanti et al. 2022, section 4), per layer and micro-batch, derived per stored
tensor so that the published closed forms come out exactly for GPT (F = 4h, 16-bit activations,
1-byte dropout masks: ``dropout`` > 0, as those runs trained) with unfused attention
(``attention="unfused"``, as in 2022):
``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with TP, ``/t`` for the first term
with sequence parallelism, no ``5·a·s/h`` term with selective recompute, ``2·s·b·h`` (``/t``
with SP) with full recompute. Without dropout (``dropout`` = 0, the default) the masks
and the dropout output go: ``s·b·h·(8 + 24/t + 2·a·s/(h·t))``. Llama-style models (SwiGLU,
RMSNorm, GQA, no dropout) store the gate, up and product tensors of the MLP and K/V of
``kv`` heads, and no dropout masks.
With fused attention (the default: FlashAttention-class kernels) no score, probability or
dropout-mask matrix is kept, only 4 bytes (fp32 log-sum-exp) per query row and head: the
``5·a·s/h`` term becomes ``4·a/h``. Context parallelism (``sp``) divides the sequence of
every stored tensor; the attention
scores of a rank are its ``s/sp`` queries against all ``s`` keys.

In-flight micro-batches on stage i of p with m micro-batches: GPipe m, 1F1B min(p - i, m),
interleaved 1F1B with v chunks ``min(2(p - i - 1) + (v - 1)·p + 1, m·v)`` chunks of L/(p·v)
layers (Korthikanti's first-stage factor 1 + (p - 1)/(p·v); all m·v when m = p, as Megatron
then runs every forward first). The embedding's tensors (GPT's dropout mask, with dropout)
count the micro-batches its chunk, the first, holds: up to about 2p with interleaving, not p.

These are the figures of the whole stage. Published per-layer figures (Korthikanti's Figure 7
ratios, his Figure 1 model state "embeddings excluded") compare with
:func:`activation_bytes_per_layer` and the layer parameters of :func:`count_parameters`, or
with a stage that holds neither the embedding nor the head (docs/generation.md,
"Reproducing published points").

Execution profiles (``--profile``): the figures above are what Megatron-LM's fused kernels
keep; eager PyTorch (``eager``) keeps what each op's autograd formula saves, which adds the
norms' fp32 per-row statistics and each SwiGLU's SiLU output (:func:`activation_bytes_per_layer`).
A precision plan's fp8 GEMMs that run natively (a GPU with fp8 tensor cores,
:func:`stg.api.native_fp8`, as Transformer Engine runs them) save their inputs in 1 byte
(:func:`planned_activation_delta`) and keep fp8 weight copies, counted with the weights
(:func:`fp8_weight_copy_bytes`). A low-precision recipe (``--low_precision_recipe``, its
default, delayed scaling, included: :func:`te_autocast`) keeps 16-bit weights and, beside them,
each GEMM weight's two quantized copies with their scales (:func:`recipe_weight_copy_bytes`;
one on Blackwell for per-tensor scaled fp8, whose one copy serves both usages), which a
generated workload states per stage (the fact ``low_precision_weight_bytes``, both copies
whatever the GPU: :func:`stated_weight_copy_bytes`; the options give delayed scaling's), for
the layers it quantizes (not those
``first_last_layers_bf16`` keeps in bf16). Transformer
Engine's ``--dtype fp8`` layers (:func:`te_autocast`) keep their activations in bf16 and each
linear layer's input as the recipe's quantized copy (:func:`quantized_input_delta`).

Recompute of some layers only (``recompute_method``, :func:`recompute_layer_bytes`): a
recomputed unit (one layer, or a uniform group) keeps its first layer's input, any other
layer all of its activations; the unit being recomputed holds all of its layers' activations
(a buffer).

Buffers: the working set that exists only transiently at the peak: with full recompute the full
activations of the one layer being recomputed; with selective recompute that layer's attention
scores; where PyTorch's own context parallelism runs the attention, plus one layer's gathered
K/V, fp32 merges or fp32 gradients, whichever pass holds more (:func:`torch_cp_buffers`); on
the last stage, the larger of that and the cross entropy's transient (eager: its backward's
fp32 gradients, :data:`EAGER_CROSS_ENTROPY_TRANSIENT`; Megatron: the 16-bit logits beside the
loss's fp32 copy, :data:`MEGATRON_CROSS_ENTROPY_TRANSIENT`); with ZeRO-3 / FSDP the gathered
weights of the two largest units (the one in use and the one prefetched; the embedding and the
LM head are units of their own, :func:`fsdp_unit_parameters`) and, when larger than the
transients above, the largest unit's gradients with FSDP2's reduce-scatter input in the reduce
dtype (``foreach_reduce`` copies them in before it frees them;
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). No allocator fragmentation is
added (docs/prediction.md, "The caching allocator").

Eager PyTorch (``profile`` eager, :func:`eager_peak`) peaks at the larger of two moments:
the start of the backward, without gradients in a step of one micro-batch (``zero_grad``
sets them to None), and the optimizer step, with the gradients and the square roots of the
second moments that the default foreach AdamW allocates, without activations or autocast's
16-bit weight casts.

FSDP2 (``weight_sharded``) as PyTorch runs it (:func:`fsdp_unsharded_state`): with
``reshard_after_forward`` resolved to never (the default under pipeline parallelism, as in
torchtitan) a rank holds the gathered weights of its whole stage from their forward to their
backward (under pipeline parallelism for the whole step), counted with the weights instead of
the two-layer buffer; under pipeline parallelism PyTorch's pipelining also accumulates the
gradients of every micro-batch unsharded and reduce-scatters them after the last one, so the
unsharded gradients of the stage count with the gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from itertools import groupby
from typing import Any

import stg
from stg.api import (
    DTYPE_BYTES,
    RECIPES,
    TORCH_ALL_GATHER,
    GenerateOptions,
    KernelTable,
    Predictor,
    System,
    bf16_kind,
    cached_weight_bytes,
    check_capacity,
    check_offload,
    check_runs_on,
    chunk_layer_counts,
    device_of,
    expert_capacity,
    expert_zero_degree,
    group_of_rank,
    held_activation_peak,
    is_hybrid,
    kernel_table,
    load_system,
    lowered_cp_comm_type,
    model_kind,
    muon_part_parameters,
    native_fp8,
    normalize_dtype,
    precision_of,
    recompute_units,
)
from stg.errors import UnknownNameError, UserError
from stg.predictors import _workload_cache as workload_cache

MASK_BYTES = 1
FUSED_STATS_BYTES = 4
"""What a fused attention kernel (FlashAttention, cuDNN) keeps for its backward besides Q, K, V
and the output: one fp32 log-sum-exp per query row and head (FlashAttention-2, Dao 2023)."""
ADAM_MIXED_K = 12

# Eager PyTorch (``--profile eager``): one kernel per op, each keeping what its autograd formula
# saves (tools/autograd/derivatives.yaml; a tensor needed only for the gradient of an input
# that does not require grad is not saved: ``guard_for`` in tools/autograd/gen_variable_type.py).
LAYERNORM_STATS_BYTES = 8
"""Per row, what ``native_layer_norm`` saves besides its input: ``result1`` (mean) and
``result2`` (rstd), fp32 for 16-bit and fp32 inputs alike (the accumulate type)."""
RMSNORM_STATS_BYTES = 4
"""Per row, what ``_fused_rms_norm`` (``F.rms_norm``'s CUDA kernel) saves besides its input:
``result1`` (rstd), fp32."""
EAGER_CROSS_ENTROPY_TRANSIENT = 8
"""Bytes per logit that eager PyTorch's cross-entropy backward allocates while the fp32
log-probabilities (4 bytes per logit, saved by ``_log_softmax`` as ``result`` and by
``nll_loss_forward`` as ``self``) are still held: ``nll_loss_backward``'s dense fp32 gradient
of the log-probabilities (4) and ``_log_softmax_backward_data``'s fp32 gradient of the logits
(4), live together while the latter runs. The loss runs in fp32 (autocast's fp32 list has
``cross_entropy``, ``log_softmax`` and ``nll_loss``; Hugging Face upcasts the logits)."""
MEGATRON_CROSS_ENTROPY_TRANSIENT = 2
"""Bytes per logit that Megatron-LM's vocabulary-parallel cross entropy holds beside its fp32
logits (4 bytes per logit, kept for the backward as the softmax) when the LM head computes in
a 16-bit (or fp8) dtype: ``VocabParallelCrossEntropy.calculate_logits_max``
(megatron/core/tensor_parallel/cross_entropy.py, the fused and unfused losses alike) upcasts
with ``.float()``, a copy made while the output layer's 16-bit logits are held; in the
backward the fp32 gradient, computed in place in the softmax, is cast back to the 16-bit
dtype by the copy's backward for the LM head's GEMMs. Either way 2 bytes per logit beside the
fp32 ones, at the head, before any layer's recompute. fp32 logits need no copy."""

# Transformer Engine's fp8 GEMMs on a GPU with fp8 tensor cores (stg.perf.costs.native_fp8).
FP8_WEIGHT_COPY_BYTES = 2
"""Bytes per weight element of a planned fp8 GEMM that Transformer Engine keeps besides the
16-bit weight on Hopper and Ada: its fp8 copy for the forward GEMM (rowwise usage) and the fp8
transpose for the input-gradient GEMM (columnwise usage), held as a second, physically
transposed tensor (TE docs, features/low_precision_training/performance_considerations:
"Handling transposes", Table 2, and "Memory usage"; NVIDIA/TransformerEngine issue #1261);
half of it on Blackwell, whose fp8 GEMMs read the one copy in either layout
(``stg.core.recipes.NON_TN_FP8_GEMM_ARCHS``). Megatron passes ``is_first_microbatch``, so TE
casts once per iteration and caches them."""


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[normalize_dtype(dtype)]


def as_options(options: Mapping[str, Any] | GenerateOptions) -> GenerateOptions:
    """GenerateOptions from an option dict (``Workload.metadata["options"]``); unknown keys
    are ignored, missing ones take the defaults."""
    if isinstance(options, GenerateOptions):
        return options
    names = {f.name for f in fields(GenerateOptions)}
    return GenerateOptions(**{k: v for k, v in options.items() if k in names})


@lru_cache(maxsize=256)
def model_family(model: str) -> str:
    """``llama`` (SwiGLU, RMSNorm, no dropout: also the built-in ``moe`` and ``deepseek``) or
    ``gpt`` (GELU MLP, LayerNorm, dropout)."""
    name = model.lower().split(":")[-1]
    llama = ("llama", "mistral", "qwen", "moe", "deepseek")
    return "llama" if any(word in name for word in llama) else "gpt"


def has_dropout(o: GenerateOptions) -> bool:
    """Whether the layers keep dropout masks: a GPT-family model trained with ``--dropout``
    > 0 (Llama-family models refuse it)."""
    return bool(o.dropout) and model_family(o.model) == "gpt" and not o.inference


def is_moe(o: GenerateOptions) -> bool:
    """Routed experts in the MoE layers (the built-in ``moe`` and ``deepseek``)."""
    name = o.model.lower().split(":")[-1]
    return name.startswith("moe") or name == "deepseek"


def is_mpt(o: GenerateOptions) -> bool:
    """MPT (the built-in ``mpt``): GPT's layout without biases or position embeddings."""
    return o.model.lower().split(":")[-1] == "mpt"


def is_mla(o: GenerateOptions) -> bool:
    """Multi-head latent attention (the built-in ``deepseek``)."""
    return o.model.lower().split(":")[-1] == "deepseek"


def has_output_gate(o: GenerateOptions) -> bool:
    """Whether each attention layer gates its output (``--attention_output_gate true``,
    Qwen3-Next's gated attention: models/llama.py ``attention``): a projection ``gate_proj``
    of the layer input (``w_gate``, ``dmodel kvhead qgroup dhead``, as large as the query's,
    column parallel over tp) and the product ``output_gate`` of the attention's output with
    its sigmoid, the output projection's input. Llama-family attention only (``llama``,
    ``moe``); other models refuse the option."""
    return bool(o.attention_output_gate) and model_family(o.model) == "llama" and not is_mla(o)


def is_eager(o: GenerateOptions) -> bool:
    """Whether the stack runs eager PyTorch (``--profile eager``), not Megatron-LM with
    Transformer Engine (``megatron``, the default) or fused kernels of ``torch.compile``
    (``compiled``), whose activations are counted as Megatron's."""
    if o.profile not in GenerateOptions.PROFILES:
        allowed = ", ".join(GenerateOptions.PROFILES)
        raise UserError(f"profile={o.profile!r}; allowed: {allowed}")
    return o.profile == "eager"


def norm_stats_bytes(o: GenerateOptions) -> int:
    """fp32 bytes per row that one norm keeps besides its input under the profile: eager
    PyTorch's LayerNorm (GPT family) 8, RMSNorm (Llama family) 4. The megatron profile
    leaves them out, as Korthikanti's accounting does (Apex's and TE's norms keep the same
    mean and rstd: 8 bytes per row against 34h bytes)."""
    if not is_eager(o):
        return 0
    return RMSNORM_STATS_BYTES if model_family(o.model) == "llama" else LAYERNORM_STATS_BYTES


def head_size(o: GenerateOptions) -> int:
    """dhead: ``--dhead``, else dmodel / head."""
    return o.dhead or o.dmodel // o.head


def dense_layer_count(o: GenerateOptions) -> int:
    """The dense layers that ``deepseek`` and ``moe`` stack before their MoE layers:
    ``min(dense_layers, num_stacks - 1)``; none in other models."""
    return max(0, min(o.dense_layers or 0, o.num_stacks - 1)) if is_moe(o) else 0


SPAN_KINDS = {"local": "block", "global": "block", "dense_global": "dense"}
"""The block kinds of a stack whose attention alternates a window or chunk with full
attention (``--full_attention_every``: models/llama.py ``local_global_stack``, models/moe.py
``stack``), each as the kind the closed forms price: the span masks scores and changes no
weight, and the activations counted here do not depend on it."""


def closed_form_kind(o: GenerateOptions, kind: str | None) -> tuple[str, bool]:
    """The kind the closed forms price for a layer of block ``kind`` (:data:`SPAN_KINDS`; None:
    the model's MoE or only layer), and whether the layer is kept in bf16
    (:func:`stg.api.model_kind`)."""
    if not kind:
        return ("moe" if is_mla(o) else "block"), False
    base, bf16_layer = model_kind(kind)
    return SPAN_KINDS.get(base, base), bf16_layer


def layer_kinds(o: GenerateOptions) -> list[str]:
    """The block kind of every layer, as the built-in models stack them: ``deepseek``'s and
    ``moe``'s first ``min(dense_layers, num_stacks - 1)`` layers are ``dense``, the others
    ``moe`` (deepseek) or ``block`` (models/deepseek.py, models/moe.py); every layer of other
    models is ``block``. With ``full_attention_every`` k (and a window or chunk) ``llama``'s
    and ``moe``'s k-th, 2k-th, ... layers are ``global``, the others ``local`` (a dense one
    ``dense_global`` or ``dense``: :data:`SPAN_KINDS`). A layer that ``first_last_layers_bf16``
    keeps out of the recipe is of the bf16 kind of its own (:func:`stg.api.bf16_kind`), as stg
    generate names it (the kinds of :func:`stg.api.muon_part_parameters` and of the workload's
    ``layer_kinds`` facts)."""
    dense = dense_layer_count(o)
    kinds = ["dense"] * dense + ["moe" if is_mla(o) else "block"] * (o.num_stacks - dense)
    if alternating_spans(o):
        every = o.full_attention_every or 0
        spans = ["global" if (i + 1) % every == 0 else "local" for i in range(o.num_stacks)]
        swapped = {"local": "dense", "global": "dense_global"}
        kinds = [swapped[k] if i < dense else k for i, k in enumerate(spans)]
    first, last = o.bf16_layers
    if not first and not last:
        return kinds
    total = len(kinds)
    return [bf16_kind(k) if i < first or i >= total - last else k for i, k in enumerate(kinds)]


def alternating_spans(o: GenerateOptions) -> bool:
    """Whether ``o``'s stack alternates ``local`` and ``global`` layers: ``full_attention_every``
    with a window or chunk, in ``llama`` and ``moe`` (not deepseek's latent attention, not
    the GPT family, whose stacks take no span)."""
    return (
        bool(o.full_attention_every)
        and bool(o.attention_window or o.attention_chunk)
        and model_family(o.model) == "llama"
        and not is_mla(o)
    )


def stage_layer_kinds(o: GenerateOptions) -> list[dict[str, int]]:
    """Layers of each kind on every pipeline stage: ``pp · virtual_stages`` chunks of the
    stack in order (:func:`stg.api.chunk_layer_counts`), chunk c on stage c mod pp, as stg
    generate places them."""
    kinds = layer_kinds(o)
    stages: list[dict[str, int]] = [{} for _ in range(o.pp)]
    start = 0
    for chunk, size in enumerate(chunk_layer_counts(o)):
        counts = stages[chunk % o.pp]
        for kind, run in groupby(kinds[start : start + size]):  # runs of one kind
            counts[kind] = counts.get(kind, 0) + len(list(run))
        start += size
    return stages


def replicas(o: GenerateOptions) -> int:
    return o.data_replicas


def micro_batch_size(o: GenerateOptions) -> int:
    """b: samples per data-parallel replica per micro-batch."""
    global_micro = o.micro_batch or o.batch
    if global_micro % replicas(o):
        raise UserError(f"micro_batch={global_micro} must be divisible by dp*ep={replicas(o)}")
    return global_micro // replicas(o)


# ---------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class StageParameters:
    """Weight elements held by one rank of a pipeline stage."""

    stage: int
    layers: int
    layer_parameters: int
    """parameters of all this stage's layers held by one rank"""
    embedding_parameters: int
    head_parameters: int
    kinds: tuple[tuple[str, int], ...] = ()
    """(block kind, layers) on this stage"""

    @property
    def total(self) -> int:
        return self.layer_parameters + self.embedding_parameters + self.head_parameters


def layers_per_stage(layers: int, pp: int) -> list[int]:
    """Layers split as evenly as possible; the first ``layers % pp`` stages get one more."""
    if layers < pp:
        raise UserError(f"pp={pp} must not exceed num_stacks={layers}")
    base, extra = divmod(layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def mla_parameters_per_rank(o: GenerateOptions) -> int:
    """Multi-head latent attention's parameters held by one TP rank (d = dhead, r = drope,
    c = kv_lora_rank, q = q_lora_rank, a heads): replicated W_DQ (h·q) and its norm (q),
    W_DKV (h·(c + r)) and its norm (c); split over t by heads W_UQ and W_QR (q·a·(d + r);
    h·a·(d + r) without query compression), W_UK and W_UV (2·c·a·d), W_O (a·d·h)."""
    h, a, t = o.dmodel, o.head, o.tp
    d = head_size(o)
    r = o.drope if o.drope is not None else d // 2
    c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
    replicated = h * (c + r) + c
    source = h
    if o.q_lora_rank is not None:
        replicated += h * o.q_lora_rank + o.q_lora_rank
        source = o.q_lora_rank
    split = source * a * (d + r) + 2 * c * a * d + a * d * h
    return replicated + split // t


def mtp_depth(o: GenerateOptions) -> int:
    """DeepSeek's multi-token prediction modules (``--mtp_depth``; 0 for other models)."""
    return (o.mtp_depth or 0) if is_mla(o) else 0


def mtp_parameters_per_rank(o: GenerateOptions) -> int:
    """Multi-token prediction's parameters on one rank of the last stage: the copy of the
    embedding (V·h/t) and, per module, its two input norms and output norm (3h), the
    projection from 2h to h (replicated) and one MoE layer."""
    depth = mtp_depth(o)
    if not depth:
        return 0
    h = o.dmodel
    per_module = 3 * h + 2 * h * h + layer_parameters_per_rank(o, "moe")
    return o.dvocal * h // o.tp + depth * per_module


def layer_parameters_per_rank(o: GenerateOptions, kind: str | None = None) -> int:
    """Parameters of one transformer layer (of block ``kind``) held by one TP rank.

    GPT: QKV (3h² + 3h), projection (h² + h), MLP (2hF + F + h), two LayerNorms (4h), with
    a·d in place of h for the heads' width under ``--dhead``;
    column-parallel weights and biases are split by t, row-parallel biases and norms are
    replicated: 12h² + 13h over all TP ranks for F = 4h. Llama: Q and O h·a·d, K and V
    h·kv·d (d = dhead: h/a unless ``--dhead``), SwiGLU 3hF, two RMSNorms (2h), no biases;
    with ``--attention_output_gate`` the gate projection ``w_gate``, h·a·d more
    (:func:`has_output_gate`), with ``--attention_sinks`` a sink logit per head (a).
    MoE layers (``moe``, ``deepseek``) hold E/ep routed experts' SwiGLUs (3hF each, split
    by etp: t unless ep folds), the router h·E (replicated) and ``shared_experts`` shared
    SwiGLUs of F (split by t); their ``dense`` layers a SwiGLU of ``dense_dff``; DeepSeek's
    attention is :func:`mla_parameters_per_rank`. ``kind`` None: the model's MoE (or only) layer.
    """
    h, f, t = o.dmodel, o.dff, o.tp
    kind = closed_form_kind(o, kind)[0]
    if model_family(o.model) == "llama":
        d = head_size(o)
        if is_mla(o):
            attention = mla_parameters_per_rank(o)
        else:
            # wq and wo; wk and wv; the output gate's w_gate (gate_proj), as large as wq
            gates = 1 if has_output_gate(o) else 0
            attention = ((2 + gates) * h * o.head * d + 2 * h * o.kvhead * d) // t
            if o.attention_sinks:  # softmax's learned sink logit per head (models/llama.py)
                attention += o.head // t
        if kind == "dense":
            mlp = 3 * h * (o.dense_dff or f) // t
        elif is_moe(o):
            shared = o.shared_experts or 0
            routed = (o.experts // o.ep) * 3 * h * f // o.expert_tp
            mlp = routed + h * o.experts + shared * 3 * h * f // t
        else:
            mlp = 3 * h * f // t
        return attention + mlp + 2 * h
    width = o.head * head_size(o)  # a·d: h unless --dhead
    if is_mpt(o):  # no biases, LayerNorm weights only
        return (4 * h * width + 2 * h * f) // t + 2 * h
    experts_per_rank = o.experts // o.ep if is_moe(o) else 1
    attention = (3 * h * width + 3 * width) // t + width * h // t + h
    mlp = experts_per_rank * ((2 * h * f + f) // t + h)
    return attention + mlp + 4 * h


def routed_parameters_per_rank(o: GenerateOptions, kind: str | None = None) -> int:
    """The routed experts' parameters of one layer (of block ``kind``) held by one rank:
    E/ep SwiGLUs of 3hF split by etp (none in dense layers and models)."""
    kind = closed_form_kind(o, kind)[0]
    if kind == "dense" or not is_moe(o) or model_family(o.model) != "llama":
        return 0
    return (o.experts // o.ep) * 3 * o.dmodel * o.dff // o.expert_tp


def count_parameters(options: Mapping[str, Any] | GenerateOptions) -> list[StageParameters]:
    """Analytical parameter counts per rank of each pipeline stage (for GPT and Llama).

    GPT: vocabulary-parallel word embedding (V·h/t) and learned positions (s·h; none for MPT,
    whose layers also have no biases) on the first stage; final LayerNorm (2h; h for MPT) on
    the last. Llama: final RMSNorm (h), no position embedding. Both: an LM head of V·h/t on the
    last stage as stg generates it; with ``tie_embeddings`` (Megatron's GPT default, MPT) the
    embedding's at pp 1, a copy on the last stage when pp > 1.
    """
    o = as_options(options)
    h, v, t = o.dmodel, o.dvocal, o.tp
    llama = model_family(o.model) == "llama"
    stages = []
    kinds = stage_layer_kinds(o)
    per_layer: dict[str, int] = {}  # a layer of each kind, as every stage holds it
    for stage, counts in enumerate(kinds):
        layers = sum(counts.values())
        first, last = stage == 0, stage == o.pp - 1
        embedding = 0
        head = 0
        if first:
            embedding = v * h // t + (0 if llama or is_mpt(o) else o.seq * h)
        if last:
            head = h if llama or is_mpt(o) else 2 * h
            if not o.tie_embeddings or o.pp > 1:  # tied: the embedding's at pp 1
                head += v * h // t
            head += mtp_parameters_per_rank(o)
        for kind in counts:
            if kind not in per_layer:
                per_layer[kind] = layer_parameters_per_rank(o, kind)
        held = sum(per_layer[kind] * n for kind, n in counts.items())
        stages.append(StageParameters(stage, layers, held, embedding, head, tuple(counts.items())))
    return stages


def total_parameters(options: Mapping[str, Any] | GenerateOptions) -> int:
    """All parameters of the model (one copy), from :func:`count_parameters` with tp = pp = 1."""
    o = as_options(options)
    single = GenerateOptions(**{**o.as_dict(), "tp": 1, "pp": 1, "dp": 1, "sp": 1, "ep": 1})
    return count_parameters(single)[0].total


# ---------------------------------------------------------------------------------------------
# Activations


def activation_bytes_per_layer(
    options: Mapping[str, Any] | GenerateOptions,
    *,
    recompute: str | None = None,
    kernels: KernelTable | None = None,
    kind: str | None = None,
    system: System | None = None,
) -> float:
    """Bytes one rank stores for one layer (of block ``kind``, see
    :func:`layer_parameters_per_rank`) and one micro-batch between forward and backward.

    With a precision plan (``options.precision``) the matmul inputs saved for the backward
    pass are stored as :func:`planned_activation_delta` says (``system``: the GPU, for fp8
    GEMMs that run natively on it). Llama-family layers store, in
    the activation dtype: the inputs of both norms, of the attention and of the MLP (4sbh,
    split by t under sequence parallelism), Q, K, V and the projection input (s·b·d·(2a +
    2kv), split by t) and the MLP's gate, up and product (3sbF/t); with
    ``--attention_output_gate`` (:func:`has_output_gate`) also the inputs of the gate's
    product, the attention's output and the gate projection's output (2s·b·a·d/t, the gated
    product being the projection input), under no and selective recompute alike (the gate is
    outside the attention core that ``core_attn`` recomputes). Multi-head latent
    attention stores instead Q, its RoPE part, K, the RoPE key copied to every head, V and the
    projection input (s·b·a·(4d + 2r)/t: the key the attention kernel reads is
    ``[head, d + r]``, as Megatron-LM materialises it) and, replicated over tp, its latents:
    the query compression before
    and after its norm (2sbq), the KV latent with the RoPE key before and after its norm
    and RoPE (2sb(c + r)). An MoE layer stores, per routed token slot (E·C/(dp·ep) of them,
    C = ceil(k·tokens·capacity_factor/E): k·sb·capacity_factor when balanced; under
    ``moe_routing`` dropless the expected most loaded expert's load, ``expert_capacity``), the
    dispatched token and the expert's output (2h, replicated over tp) and gate, up and
    product (3F/t); the router's logits and gates (2sbE); and the shared experts' gate, up
    and product (3·shared·sbF/t).

    That is what Megatron-LM's fused kernels keep (``profile`` megatron). Eager PyTorch
    (``profile`` eager) keeps what each op's autograd formula saves: the same tensors (a bias
    add, a residual add and RoPE's products with the cos/sin tables save none; GELU saves its
    input, the bias-add output, where Megatron's fused bias-GELU saves the GEMM output;
    dropout a bool mask), plus each norm's fp32 per-row statistics
    (:func:`norm_stats_bytes`) and, for every SwiGLU, the SiLU output that the product
    ``silu(gate) * up`` saves beside ``up`` (sbF/t more; Megatron's fused SwiGLU keeps only
    gate and up)."""
    o = as_options(options)
    recompute = recompute or o.activation_recompute
    if recompute not in ("none", "selective", "selective_op", "full"):
        raise UserError(
            f"activation_recompute={recompute!r}; allowed: none, selective, selective_op, full"
        )
    b = micro_batch_size(o)
    s_local = o.seq / o.sp
    h, f, a, t = o.dmodel, o.dff, o.head, o.tp
    stats = norm_stats_bytes(o)  # validates the profile
    e = activation_element_bytes(o)
    sp_divisor = t if (o.tpsp and t > 1) else 1
    sbh = s_local * b * h
    sb = s_local * b
    if recompute == "full":  # Megatron's and torch.utils.checkpoint's: the layer input
        return e * sbh / sp_divisor
    if recompute == "selective_op":
        return op_checkpoint_layer_bytes(o, kind)
    llama = model_family(o.model) == "llama"
    k = o.kexperts if is_moe(o) else 1
    layer_kind = kind
    kind = closed_form_kind(o, kind)[0]
    # eager: silu(gate) * up, MulBackward0 saves both factors (both require grad): the SiLU
    # output is kept beside up (and gate, which SiluBackward0 saves as its input)
    silu_output = e if is_eager(o) else 0
    mlp: float | None = None  # a dense MLP module's own tensors (recompute_modules mlp)
    if llama:
        d = head_size(o)
        # two RMSNorm inputs, QKV input, MLP input; eager: the two norms' rstd rows
        replicated = e * 4 * sbh + stats * 2 * sb
        if is_mla(o):
            r = o.drope if o.drope is not None else d // 2
            c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
            sharded = e * sb * a * (4 * d + 2 * r)
            latents = 2 * (o.q_lora_rank or 0) + 2 * (c + r)
            replicated += e * sb * latents * sp_divisor  # whole sequence on every tp rank
            latent_norms = 1 + (1 if o.q_lora_rank else 0)  # kv_norm (and q_norm)
            replicated += stats * sb * latent_norms * sp_divisor
        else:
            sharded = e * sb * d * (2 * a + 2 * o.kvhead)
            if has_output_gate(o):
                # output_gate = context * sigmoid(gate_proj): its backward reads both inputs,
                # the attention's output and the gate projection's output (a·d each; the
                # gated product is the projection input counted above, the gate
                # projection's input is the QKV input)
                sharded += e * sb * d * 2 * a
        if kind == "dense":
            mlp = (3 * e + silu_output) * sb * (o.dense_dff or f) / t
            sharded += (3 * e + silu_output) * sb * (o.dense_dff or f)
        elif is_moe(o):
            # Megatron-LM recomputes no MoE layer under mlp (transformer_layer.py: not an
            # MoELayer): nothing freed here where the dense layers carry the module
            mlp = 0 if dense_layer_count(o) else None
            tokens = (o.micro_batch or o.batch) * o.seq
            capacity = expert_capacity(o, tokens)
            slots = o.experts * capacity / (o.ep * o.expert_dp)  # this rank's routed slots
            sharded += (3 * e + silu_output) * slots * f * (t / o.expert_tp)
            replicated += e * slots * 2 * h * sp_divisor + e * 2 * sb * o.experts
            shared = o.shared_experts or 0
            sharded += (3 * e + silu_output) * shared * sb * f
        else:
            mlp = (3 * e + silu_output) * sb * f / t
            sharded += (3 * e + silu_output) * sb * f
        scores = e * a * s_local * o.seq * b
    else:
        masks = MASK_BYTES if has_dropout(o) else 0
        # two LayerNorm inputs, QKV input, MLP input (16-bit), two hidden dropout masks;
        # eager: the two norms' mean and rstd rows
        replicated = e * 4 * sbh + masks * 2 * sbh + stats * 2 * sb
        # Q, K, V, projection input; GELU input and output
        width = a * head_size(o)  # a·d: h unless --dhead
        sharded = e * s_local * b * width * 4 + k * e * 2 * s_local * b * f
        # the GELU's input and output, and the MLP's dropout mask
        mlp = k * e * 2 * s_local * b * f / t + masks * sbh / sp_divisor
        # softmax output; with dropout also its mask and output
        scores = (2 * e + masks if masks else e) * a * s_local * o.seq * b
    total = replicated / sp_divisor + sharded / t
    modules = set(o.recompute_modules or ("core_attn",)) if recompute == "selective" else set()
    if "mlp" in modules:
        if mlp is None:
            raise UserError(
                f"recompute_modules=mlp: a {kind} layer of {o.model} has no dense MLP module"
            )
        total -= mlp
    if "layernorm" in modules:  # the two norms' outputs (the attention's and MLP's inputs)
        total -= e * 2 * sbh / sp_divisor
    if "mla_up_proj" in modules:
        if not is_mla(o):
            raise UserError(
                f"recompute_modules=mla_up_proj: a {kind} layer of {o.model} has no multi-head "
                "latent attention"
            )
        total -= mla_up_proj_bytes(o)
    if o.precision and modules - {"core_attn"}:
        raise UserError(
            f"recompute_modules={','.join(sorted(modules))} with a precision plan: the memory "
            "predictor models the plan's saved inputs under core_attn recompute only"
        )
    if recompute == "none" or "core_attn" not in modules:
        if o.attention == "unfused":
            total += scores / t
        else:  # a fused kernel keeps only the fp32 log-sum-exp of each query row and head
            total += FUSED_STATS_BYTES * a * s_local * b / t
    if o.precision:
        total += planned_activation_delta(o, recompute, kernels, system=system)
    return total + quantized_input_delta(o, recompute, layer_kind)


def mla_up_proj_bytes(o: GenerateOptions) -> float:
    """Bytes per layer and micro-batch that Megatron-LM's ``mla_up_proj`` selective recompute
    does not keep, of those :func:`activation_bytes_per_layer` counts for multi-head latent
    attention. Megatron runs the latents' norms, the up-projections and RoPE
    (``qkv_up_proj_and_rope_apply``) in a ``CheckpointWithoutOutput``: its forward runs under
    ``torch.no_grad`` (its linear layers save nothing, not even their quantized inputs:
    :func:`quantized_input_delta`) and, once core attention's forward has consumed them, the
    storages of its outputs, query, key and value, are freed; they are refilled by the
    recompute before the attention's backward (megatron/core/transformer/
    multi_latent_attention.py and tensor_parallel/random.py, NVIDIA/Megatron-LM d98e8a6). Not
    kept then: Q and K with their RoPE parts, and V (s·b·a·(3d + 2r)/t, unless
    ``fp8_attention``, whose
    attention saves fp8 copies of its own, which stay), the two latents after their norms
    (s·b·(q + c), whole sequence as counted; the query's stays where the lightning indexer
    reads it, ``index_topk``), eager's norm statistics and, without a sequence-parallel
    gather (whose gathered copy the attention keeps, as Megatron's checkpoint keeps the
    gathered key input), the rotated shared RoPE key (s·b·r). The checkpoint keeps its
    inputs, the latents before their norms, which stay counted."""
    b = micro_batch_size(o)
    sb = o.seq / o.sp * b
    t = o.tp
    sp_divisor = t if (o.tpsp and t > 1) else 1
    e = activation_element_bytes(o)
    d = head_size(o)
    r = o.drope if o.drope is not None else d // 2
    c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
    query = 0 if o.index_topk else (o.q_lora_rank or 0)
    rope_key = r if sp_divisor == 1 else 0
    norms = 1 + (1 if o.q_lora_rank else 0)
    freed = e * sb * (c + query + rope_key) + norm_stats_bytes(o) * sb * norms
    if not o.fp8_attention:
        freed += e * sb * o.head * (3 * d + 2 * r) / t
    return freed


def op_checkpoint_closed_form(o: GenerateOptions, kind: str | None = None) -> bool:
    """Whether :func:`op_checkpoint_layer_bytes` describes a layer of block ``kind``: a Llama
    dense layer with fused attention and no precision plan. The others' figure comes from
    their graph (the workload's fact ``op_checkpoint_layer_bytes``,
    :func:`stg.core.pipeline.op_checkpoint_saved_bytes`, which equals the closed form where
    both apply)."""
    kind = closed_form_kind(o, kind)[0] if kind else kind
    if model_family(o.model) != "llama" or is_mla(o) or is_moe(o) or kind == "moe":
        return False
    return o.attention != "unfused" and not o.precision


def op_checkpoint_layer_bytes(o: GenerateOptions, kind: str | None = None) -> float:
    """Bytes one rank keeps for one layer and micro-batch under torchtitan's op-level selective
    checkpointing (``activation_recompute=selective_op``):
    the checkpointed layer's input and the outputs its policy saves, those of the odd-numbered
    matmuls (Q, V, the MLP's gate and down projections: s·b·(d·(a + kv) + F)/t and sbh) and of
    the flash-attention kernel (its output, s·b·a·d/t, and the fp32 log-sum-exp). Modelled for
    Llama-family dense layers with fused attention and no precision plan (torchtitan's models).
    With ``--attention_output_gate`` the gate projection is the fourth matmul: the odd ones are
    then Q, V, the output projection and the MLP's up projection, whose outputs are as large
    as those above (sbh for the output projection's, as the down projection's; sbF/t for up's,
    as gate's); the gate projection and the sigmoid product run again, so the figure holds."""
    kind = closed_form_kind(o, kind)[0] if kind else kind
    if model_family(o.model) != "llama" or is_mla(o) or is_moe(o) or kind == "moe":
        raise UserError(
            f"activation_recompute=selective_op: the memory of {o.model}'s layers under "
            "torchtitan's op-level checkpointing is not modelled; allowed: Llama-family dense "
            "models (or activation_recompute none, selective, full)"
        )
    if o.attention == "unfused" or o.precision:
        raise UserError(
            "activation_recompute=selective_op is modelled with fused attention and no precision "
            "plan (torchtitan's): leave attention and precision at their defaults"
        )
    b = micro_batch_size(o)
    sb = o.seq / o.sp * b
    e = dtype_bytes(o.dtype)
    t = o.tp
    sp_divisor = t if (o.tpsp and t > 1) else 1
    d = head_size(o)
    f = (o.dense_dff or o.dff) if kind == "dense" else o.dff
    replicated = e * 2 * sb * o.dmodel  # the layer's input, the down projection's output
    sharded = e * sb * (d * (2 * o.head + o.kvhead) + f)
    return replicated / sp_divisor + sharded / t + FUSED_STATS_BYTES * o.head * sb / t


def recompute_layer_bytes(
    o: GenerateOptions,
    stage: int,
    kernels: KernelTable | None = None,
    system: System | None = None,
) -> tuple[float, float]:
    """Under ``recompute_method`` (:func:`stg.api.recompute_units`): the bytes the layers of
    stage ``stage`` keep per micro-batch (over every chunk of the stage, as layers of one
    chunk would), and the largest unit recomputed at once. A recomputed unit keeps its
    first layer's input (:func:`activation_bytes_per_layer` under full recompute) and, while
    it runs again, holds every activation of its layers; a layer not recomputed keeps all
    of its activations."""
    kinds = layer_kinds(o)

    def per_layer(kind: str, mode: str) -> float:
        return activation_bytes_per_layer(
            o, recompute=mode, kernels=kernels, kind=kind, system=system
        )

    kept = largest = 0.0
    for unit_stage, mode, layers in recompute_units(o):
        if unit_stage != stage:
            continue
        if mode == "full":
            kept += per_layer(kinds[layers.start], "full")
            largest = max(largest, sum(per_layer(kinds[i], "none") for i in layers))
        else:
            kept += sum(per_layer(kinds[i], mode) for i in layers)
    return kept, largest


def offloaded_activations(
    o: GenerateOptions,
    per_kind: Mapping[str, float],
    layer_runs: Sequence[Sequence[Any]] | None = None,
) -> float:
    """The layers' saved activations on the device at their peak under CPU activation
    offload (``cpu_offloading_num_layers``, one stage, one micro-batch in flight): the
    first N layers' copies are freed once offloaded and come back before their backward, as
    Transformer Engine schedules them (:func:`stg.api.held_activation_peak`: (L - N) layers'
    when every layer keeps the same); ``per_kind``: one layer's bytes of each block kind;
    ``layer_runs``: the stack's kinds in layer order as runs ``(kind, count)`` (the
    workload's fact; default: :func:`layer_kinds`)."""
    check_offload(o)
    order = (
        layer_kinds(o)
        if layer_runs is None
        else [str(kind) for kind, count in layer_runs for _ in range(int(count))]
    )
    if not set(order) >= set(per_kind):
        raise UserError(
            f"the options alone do not say the order of the {', '.join(sorted(per_kind))} "
            f"layers of {o.model}, which CPU offload's peak depends on: predict from its "
            "built workload (the fact layer_runs), or cpu_offloading_num_layers=0"
        )
    return held_activation_peak([per_kind[kind] for kind in order], o.cpu_offloading_num_layers)


def te_autocast(o: GenerateOptions) -> bool:
    """Whether Transformer Engine runs the layers of a ``--dtype fp8`` training run: under
    the ``megatron`` profile without a precision plan, with any low-precision recipe (its
    default, delayed scaling, included). Its GEMMs quantize their operands; everything else
    computes and is kept in the autocast dtype, bf16 (Megatron-LM's ``--bf16`` around
    ``fp8_autocast``; stg generate counts those kernels in bf16 too)."""
    return not o.inference and o.dtype == "fp8" and not o.precision and not is_eager(o)


def activation_element_bytes(o: GenerateOptions) -> int:
    """Bytes per element of the activations a layer keeps: bf16 under
    :func:`te_autocast` (the linear layers' quantized inputs are
    :func:`quantized_input_delta`), else the workload's dtype."""
    return DTYPE_BYTES["bf16"] if te_autocast(o) else dtype_bytes(o.dtype)


def quantized_input_delta(o: GenerateOptions, recompute: str, kind: str | None = None) -> float:
    """Bytes per layer (of block ``kind``) and micro-batch that the linear layers' saved
    inputs change under :func:`te_autocast` against bf16 copies: each keeps
    ``Recipe.saved_input_bytes`` per element (a quantized copy with its block scales, not the
    bf16 input; torchao's ``rowwise`` keeps the bf16 input), at the element counts of
    :func:`activation_bytes_per_layer`. Where the modules come from (Megatron-LM
    ``gpt_layer_specs.py`` and ``moe_module_specs.py``, core_v0.15.0, Transformer Engine
    backend): the QKV and dense MLP inputs are a fused norm-and-linear's norm output
    (:attr:`Recipe.gathered_norm_output_copies` under sequence parallelism); multi-head
    latent attention's norm output is read by two linear layers (the query's and the KV
    down-projection), each keeping a copy, and its up-projections fuse the latents' norms;
    an MoE layer's norm output stays bf16 for the router (a torch linear) and gets a copy
    for the shared experts, its routed experts (grouped linears) keep their dispatched tokens
    and SwiGLU products quantized. A fused attention kernel keeps its bf16 output beside the
    projection's copy. None for a layer kept in bf16 (``first_last_layers_bf16``), under
    full recompute (only the layer input is kept) and ``selective_op`` (torchtitan's)."""
    if not te_autocast(o) or recompute in ("full", "selective_op"):
        return 0.0
    kind, bf16_layer = closed_form_kind(o, kind)
    if bf16_layer:
        return 0.0
    recipe = RECIPES[o.low_precision_recipe]
    one = recipe.saved_input_bytes()
    e = activation_element_bytes(o)
    b = micro_batch_size(o)
    t = o.tp
    sp_divisor = t if (o.tpsp and t > 1) else 1
    sb = o.seq / o.sp * b
    sbh = sb * o.dmodel
    norm_output = recipe.saved_input_bytes(
        recipe.gathered_norm_output_copies if sp_divisor > 1 else 1
    )
    modules = set(o.recompute_modules or ("core_attn",)) if recompute == "selective" else set()
    fused_output = o.attention != "unfused" and "core_attn" not in modules
    d = head_size(o)
    # (elements, bytes per element kept, bf16 copy kept too)
    inputs: list[tuple[float, float, bool]] = []
    if is_mla(o):
        c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
        inputs.append((sbh / sp_divisor, 2 * one, False))  # the query's and KV down-projections
        # the up-projections' quantized inputs, which mla_up_proj's forward (no grad) drops
        if "mla_up_proj" not in modules:
            inputs.append((sb * c, one, False))  # the KV latent after its norm
            if o.q_lora_rank:
                inputs.append((sb * o.q_lora_rank, one, False))  # the query latent after its norm
    elif "layernorm" not in modules:
        inputs.append((sbh / sp_divisor, norm_output, False))  # QKV input
    # the projection's input; gated (has_output_gate) it is output_gate's product, which no
    # other backward reads: its bf16 copy goes (the attention's output, which the product's
    # backward keeps, is counted in activation_bytes_per_layer)
    inputs.append((sb * o.head * d / t, one, fused_output and not has_output_gate(o)))
    llama = model_family(o.model) == "llama"
    if llama and is_moe(o) and kind != "dense":
        tokens = (o.micro_batch or o.batch) * o.seq
        slots = o.experts * expert_capacity(o, tokens) / (o.ep * o.expert_dp)
        shared = o.shared_experts or 0
        inputs.append((slots * o.dmodel, one, False))  # dispatched tokens
        inputs.append((slots * o.dff / o.expert_tp, one, False))  # SwiGLU products
        if shared:
            inputs.append((sbh / sp_divisor, one, True))  # the router's bf16 input beside
            inputs.append((shared * sb * o.dff / t, one, False))
    elif "mlp" not in modules:
        if "layernorm" not in modules:
            inputs.append((sbh / sp_divisor, norm_output, False))  # MLP input
        ffn = (o.dense_dff or o.dff) if kind == "dense" else o.dff
        k = o.kexperts if is_moe(o) and not llama else 1
        inputs.append((k * sb * ffn / t, one, False))  # the down-projection's (fc2's) input
    return sum(n * (kept + (e if bf16 else 0) - e) for n, kept, bf16 in inputs)


def _saved_matmul_inputs(
    o: GenerateOptions, recompute: str
) -> list[tuple[float, tuple[str, ...], bool]]:
    """(elements, consuming matmuls, also kept for a non-matmul backward) of each tensor that
    :func:`activation_bytes_per_layer` counts as a matmul input (per layer and micro-batch)."""
    b = micro_batch_size(o)
    s_local = o.seq / o.sp
    t = o.tp
    sp_divisor = t if (o.tpsp and t > 1) else 1
    sbh = s_local * b * o.dmodel
    sbw = s_local * b * o.head * head_size(o)  # a·d per token: sbh unless --dhead
    llama = model_family(o.model) == "llama"
    moe = o.model.lower().startswith("moe")
    k = o.kexperts if moe else 1
    kv_fraction = o.kvhead / o.head if llama else 1.0
    prefix = "expert_" if moe else ""
    # a fused attention kernel's backward reads its output O (FlashAttention-2 and cuDNN:
    # rowsum(dO * O)), the projection's input: that keeps its 16-bit copy beside any cast
    # one (TE's docs name this case: "the attention output which is saved anyway")
    fused_output = recompute == "none" and o.attention != "unfused"
    # --attention_output_gate: gate_proj reads the QKV input too, and the projection's input
    # is output_gate's product, kept for no other backward (the attention's output and the
    # gate, which the product's backward reads, are no matmul's inputs)
    gated = has_output_gate(o)
    saved = [
        (sbh / sp_divisor, ("q", "k", "v", "gate_proj") if gated else ("q", "k", "v"), False),
        (sbw / t, ("scores",), False),
        (kv_fraction * sbw / t, ("scores",), False),
        (kv_fraction * sbw / t, ("context",), False),
        (sbw / t, ("attn_out",), fused_output and not gated),
    ]
    sbf = k * s_local * b * o.dff / t
    scores = o.head * s_local * o.seq * b / t
    if llama:
        saved += [
            (sbh / sp_divisor, (f"{prefix}gate", f"{prefix}up"), False),
            (sbf, (f"{prefix}down",), False),
        ]
        if recompute == "none" and o.attention == "unfused":
            # the softmax output feeds the context matmul and its backward
            saved.append((scores, ("context",), True))
    else:
        saved += [
            (sbh / sp_divisor, ("fc1",), False),
            (sbf, ("fc2",), False),
        ]
        if recompute == "none" and o.attention == "unfused":
            # the dropout output feeds only the context matmul; without dropout the softmax
            # output feeds it and the softmax backward
            saved.append((scores, ("context",), not has_dropout(o)))
    return saved


def runs_natively(
    op_class: str, dtype: str, kernels: KernelTable | None, system: System | None
) -> bool:
    """Whether an op planned in ``dtype`` runs in it (and so saves its input cast to it): a
    registered kernel (:mod:`stg.perf.kernels`), or an fp8 GEMM on a GPU with fp8 tensor
    cores, as Transformer Engine runs it (:func:`stg.api.native_fp8`)."""
    table = kernels if kernels is not None else KernelTable()
    if table.native(op_class, dtype):
        return True
    return system is not None and native_fp8(system, op_class, normalize_dtype(dtype))


def planned_activation_delta(
    options: Mapping[str, Any] | GenerateOptions,
    recompute: str | None = None,
    kernels: KernelTable | None = None,
    *,
    system: System | None = None,
) -> float:
    """Bytes per layer and micro-batch that a precision plan adds (negative: saves).

    A saved matmul input is stored once per distinct precision its consumers run in: an
    op that runs natively in a planned precision (:func:`runs_natively`: a kernel plugin, or
    an fp8 GEMM on ``system`` when it has fp8 tensor cores) saves its cast input
    (``bytes_per_element`` of its kernel; 1 byte for fp8: Transformer Engine keeps the fp8
    transpose of the input for the weight-gradient GEMM on Hopper and Ada, the fp8 data on
    Blackwell, and not the 16-bit input: TE docs, performance_considerations, "Memory
    usage"; NVIDIA/TransformerEngine issue #1764); other consumers, and a non-matmul
    backward that needs the original, keep the tensor in the activation dtype. So ``fc1``
    in int8 halves the MLP input, ``q`` alone in int8 stores the QKV input twice, and
    ``attn_out`` in fp8 behind fused attention adds 1 byte per element (the kernel's
    backward keeps its 16-bit output). With full recompute only the layer input is saved:
    no change.
    """
    o = as_options(options)
    recompute = recompute or o.activation_recompute
    if not o.precision or recompute == "full":
        return 0.0
    table = kernels if kernels is not None else KernelTable()
    e = dtype_bytes(o.dtype)
    delta = 0.0
    for elements, consumers, keep_original in _saved_matmul_inputs(o, recompute):
        stored: dict[str, float] = {o.dtype: e} if keep_original else {}
        for op in consumers:
            dtype = precision_of(o.precision, op) or o.dtype
            kind = "attention" if op in ("scores", "context") else "gemm"
            if dtype == o.dtype or not runs_natively(kind, dtype, table, system):
                stored[o.dtype] = e
            else:
                stored[dtype] = table.bytes_per_element(kind, dtype)
        delta += elements * (sum(stored.values()) - e)
    return delta


def gemm_weights_per_rank(o: GenerateOptions, kind: str | None = None) -> dict[str, float]:
    """Weight elements of each GEMM of one layer (of block ``kind``) on one TP rank, by op
    name (the einsums of the built-in models); their sum is
    :func:`layer_parameters_per_rank` less the norms and biases."""
    h, f, a, t = o.dmodel, o.dff, o.head, o.tp
    d = head_size(o)
    kind = closed_form_kind(o, kind)[0]
    if model_family(o.model) != "llama":
        width = a * d
        return {
            "q": h * width / t, "k": h * width / t, "v": h * width / t,
            "attn_out": width * h / t, "fc1": h * f / t, "fc2": f * h / t,
        }  # fmt: skip
    weights: dict[str, float]
    if is_mla(o):
        r = o.drope if o.drope is not None else d // 2
        c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
        source = o.q_lora_rank or h
        weights = {
            "kv_latent": h * (c + r),
            "q": source * a * d / t,
            "q_rope": source * a * r / t,
            "k": c * a * d / t,
            "v": c * a * d / t,
        }
        if o.q_lora_rank:
            weights["q_down"] = h * o.q_lora_rank
    else:
        weights = {"q": h * a * d / t, "k": h * o.kvhead * d / t, "v": h * o.kvhead * d / t}
        if has_output_gate(o):  # the output gate's projection of the layer input
            weights["gate_proj"] = h * a * d / t
    weights["attn_out"] = a * d * h / t
    if kind == "dense":
        ffn = o.dense_dff or f
        weights.update(dict.fromkeys(("gate", "up", "down"), h * ffn / t))
    elif is_moe(o):
        weights["router"] = h * o.experts
        experts = (o.experts // o.ep) * h * f / o.expert_tp
        weights.update(dict.fromkeys(("expert_gate", "expert_up", "expert_down"), experts))
        shared = o.shared_experts or 0
        if shared:
            names = ("shared_gate", "shared_up", "shared_down")
            weights.update(dict.fromkeys(names, shared * h * f / t))
    else:
        weights.update(dict.fromkeys(("gate", "up", "down"), h * f / t))
    return weights


def gemm_weight_shapes_per_rank(
    o: GenerateOptions, kind: str | None = None
) -> dict[str, tuple[int, int]]:
    """``(rows, cols)`` of each GEMM weight of one layer (of block ``kind``) on one rank, by
    op name, ``cols`` along the forward's reduction dimension, as a low-precision recipe
    quantizes it (``stg.core.fp8.quantize_sites``: a grouped GEMM's local experts are one
    tensor of their stacked rows, the router is one of them); their products are
    :func:`gemm_weights_per_rank`."""
    h, f, a, t = o.dmodel, o.dff, o.head, o.tp
    d = head_size(o)
    kind = closed_form_kind(o, kind)[0]
    if model_family(o.model) != "llama":
        width = a * d // t
        return {
            "q": (width, h), "k": (width, h), "v": (width, h),
            "attn_out": (h, width), "fc1": (f // t, h), "fc2": (h, f // t),
        }  # fmt: skip
    shapes: dict[str, tuple[int, int]]
    if is_mla(o):
        r = o.drope if o.drope is not None else d // 2
        c = o.kv_lora_rank if o.kv_lora_rank is not None else 4 * d
        source = o.q_lora_rank or h
        shapes = {
            "kv_latent": (c + r, h),
            "q": (a * d // t, source),
            "q_rope": (a * r // t, source),
            "k": (a * d // t, c),
            "v": (a * d // t, c),
        }
        if o.q_lora_rank:
            shapes["q_down"] = (o.q_lora_rank, h)
    else:
        shapes = {"q": (a * d // t, h), "k": (o.kvhead * d // t, h), "v": (o.kvhead * d // t, h)}
        if has_output_gate(o):  # the output gate's projection of the layer input
            shapes["gate_proj"] = (a * d // t, h)
    shapes["attn_out"] = (h, a * d // t)
    if kind == "dense":
        ffn = (o.dense_dff or f) // t
        shapes.update({"gate": (ffn, h), "up": (ffn, h), "down": (h, ffn)})
    elif is_moe(o):
        shapes["router"] = (o.experts, h)
        local, ffn = o.experts // o.ep, f // o.expert_tp
        shapes.update(
            {"expert_gate": (local * ffn, h), "expert_up": (local * ffn, h),
             "expert_down": (local * h, ffn)}
        )  # fmt: skip
        shared = (o.shared_experts or 0) * f // t
        if shared:
            shapes.update({"shared_gate": (shared, h), "shared_up": (shared, h),
                           "shared_down": (h, shared)})  # fmt: skip
    else:
        shapes.update({"gate": (f // t, h), "up": (f // t, h), "down": (h, f // t)})
    return shapes


def fp8_weight_copy_bytes(
    o: GenerateOptions,
    kinds: Mapping[str, int],
    system: System | None,
    *,
    has_head: bool = False,
    kernels: KernelTable | None = None,
) -> float:
    """Bytes of Transformer Engine's fp8 weight copies on one rank: every GEMM the plan puts
    in fp8 on a GPU with fp8 tensor cores keeps :data:`FP8_WEIGHT_COPY_BYTES` per weight
    element beside its 16-bit weight (half on Blackwell), for each of the ``kinds`` layers
    (and the LM head's ``logits`` GEMM, V·h/t, with ``has_head``). One copy per layer:
    Megatron caches it across micro-batches; an eager loop with one micro-batch in flight
    holds one too. A kernel plugin's fp8 GEMM (in ``kernels``) replaces Transformer Engine's:
    its record prices the saved inputs (``bytes_per_element``) and declares no weight
    copies."""
    if not o.precision or system is None or not native_fp8(system, "gemm", "fp8"):
        return 0.0
    if kernels is not None and kernels.get("gemm", "fp8") is not None:
        return 0.0

    def fp8(op: str) -> bool:
        dtype = precision_of(o.precision, op)
        return dtype is not None and normalize_dtype(dtype) == "fp8"

    elements = sum(
        n * sum(w for op, w in gemm_weights_per_rank(o, kind).items() if fp8(op))
        for kind, n in kinds.items()
    )
    if has_head and fp8("logits"):
        elements += o.dvocal * o.dmodel / o.tp
    delayed = RECIPES[GenerateOptions.low_precision_recipe]  # TE's default recipe
    copies = delayed.cached_weight_copies(arch=system.arch)
    return FP8_WEIGHT_COPY_BYTES * copies // delayed.cached_weight_copies() * elements


def in_flight_layers(
    stage: int, layers: int, pp: int, micro_batches: int, schedule: str, chunks: int = 1
) -> float:
    """Layer-micro-batches whose activations stage ``stage`` holds at its peak."""
    schedule = schedule.lower()
    if schedule == "gpipe":
        return float(layers * micro_batches)
    if chunks > 1:
        warmup = _interleaved_warmup(stage, pp, micro_batches, chunks)
        held_chunks = min(warmup + 1, micro_batches * chunks)
        return layers / chunks * held_chunks
    return float(layers * min(pp - stage, micro_batches))


def _interleaved_warmup(stage: int, pp: int, micro_batches: int, chunks: int) -> int:
    """Warm-up forwards (chunk-micro-batches) of interleaved 1F1B on ``stage``, as Megatron-LM
    (and :mod:`stg.core.schedules`) run it: all of them when m = p, else
    ``min(2(p - i - 1) + (v - 1)·p, m·v)``."""
    total = micro_batches * chunks
    if micro_batches == pp:
        return total
    return min(2 * (pp - stage - 1) + (chunks - 1) * pp, total)


def in_flight_micro_batches(
    stage: int, pp: int, micro_batches: int, schedule: str, chunks: int = 1
) -> int:
    """Micro-batches whose first-chunk tensors (the embedding's, on stage 0) stage ``stage``
    holds at its peak. With interleaved 1F1B forwards run in groups of p micro-batches per
    chunk and the first chunk's backwards come last, so its count keeps growing until its
    first backward, after ``(v - 1)·p`` backwards: the chunk-0 forwards among the first
    ``warm-up + (v - 1)·p + 1`` forwards (70, not p = 35, for GPT-530B's v = 3, m = 280)."""
    if schedule.lower() == "gpipe":
        return micro_batches
    if chunks > 1:
        forwards = min(
            _interleaved_warmup(stage, pp, micro_batches, chunks) + (chunks - 1) * pp + 1,
            micro_batches * chunks,
        )
        groups, rest = divmod(forwards, pp * chunks)
        return groups * pp + min(rest, pp)
    return min(pp - stage, micro_batches)


# ---------------------------------------------------------------------------------------------
# Model state


@dataclass(frozen=True)
class ModelState:
    weights: float
    gradients: float
    optimizer: float


def model_state_bytes(
    parameters: float,
    *,
    weight_bytes: int = 2,
    grad_bytes: int = 4,
    optimizer_bytes: int = ADAM_MIXED_K,
    zero: int = 0,
    shard: int = 1,
    sharded: float | None = None,
) -> ModelState:
    """Weights, gradients and optimizer states of ``parameters`` elements under ZeRO ``zero``.

    Defaults are Megatron's mixed precision (2 + 4 + 12 = 18 bytes per parameter); with
    ``grad_bytes=2`` and ZeRO over N_d = ``shard`` ranks this is Rajbhandari et al.'s
    (2 + 2 + K)Ψ, 4Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d and (2 + 2 + K)Ψ/N_d. ``sharded`` is the
    number of elements of one rank's ZeRO shard when it is not Ψ/N_d exactly: the padded flat
    shard ``Σ ceil(Ψ_unit / N_d)`` over the units (:func:`padded_shard`).
    """
    if zero not in (0, 1, 2, 3):
        raise UserError(f"zero={zero}; allowed: 0, 1, 2, 3")
    part = parameters / shard if sharded is None else sharded
    weights = weight_bytes * (part if zero >= 3 else parameters)
    gradients = grad_bytes * (part if zero >= 2 else parameters)
    optimizer = optimizer_bytes * (part if zero >= 1 else parameters)
    return ModelState(weights, gradients, optimizer)


def padded_shard(units: Iterable[int], shard: int) -> int:
    """Elements one rank holds of the flat buffers of ``units`` (parameters per unit), each
    padded to a multiple of ``shard`` ranks and split evenly: ``Σ ceil(unit / shard)``."""
    return sum(-(-int(u) // shard) for u in units)


def runs_recipe(o: GenerateOptions) -> bool:
    """Whether a low-precision recipe quantizes the GEMMs of this training run: one named
    (``--low_precision_recipe``), or the default, delayed scaling, under
    :func:`te_autocast`."""
    if o.inference:
        return False
    return o.low_precision_recipe != GenerateOptions.low_precision_recipe or te_autocast(o)


def recipe_weight_dtype(o: GenerateOptions) -> str:
    """The dtype a training run stores its weights in: bf16 under a low-precision recipe
    (:func:`runs_recipe`, delayed scaling included), fp8 with ``fp8_param_gather``, else
    ``dtype``. Megatron-LM keeps its parameters in bf16 (``Float16Module`` under ``--bf16``,
    which ``--fp8-format`` runs inside) unless ``--fp8-param-gather`` builds them in fp8
    (``fp8_model_init``; ``megatron/training/training.py``, ``megatron/core/fp8_utils.py``
    at core_v0.15.0); Transformer Engine's modules quantize them into copies beside them."""
    if runs_recipe(o) and not o.fp8_param_gather:
        return "bf16"
    return o.dtype


def recipe_weight_copy_bytes(
    o: GenerateOptions, kinds: Mapping[str, int], arch: str | None = None
) -> float:
    """Bytes of a low-precision recipe's quantized weight copies and scales on one rank of a
    GPU of ``arch``, from the options: every GEMM weight of the ``kinds`` layers
    (:func:`gemm_weight_shapes_per_rank`; the output layer and the layers that
    ``first_last_layers_bf16`` keeps in bf16 have none) keeps what a generated workload
    states per stage (the fact ``low_precision_weight_bytes``, :func:`stated_weight_copy_bytes`),
    :func:`stg.api.cached_weight_bytes`: its quantized copies (both usages', or one where a
    per-tensor scaled fp8 tensor serves both, on Blackwell, ``Recipe.shares_usages``; the
    columnwise one alone with ``fp8_param_gather``) and all its scales, each block's rounded
    up: Transformer Engine's ``Float8Tensor`` one fp32 ``scale_inv``, its block-scaled
    tensors (``Float8BlockwiseQTensor``, ``MXFP8Tensor``, ``NVFP4Tensor``) one scale per block
    and copy, torchao's rowwise scaling one fp32 scale per row of each copy
    (:mod:`stg.core.recipes`). Under delayed scaling, whose GEMM nodes carry their casts
    (:mod:`stg.core.fp8`), no workload states them: this is its figure from any source."""
    if not runs_recipe(o):
        return 0.0
    recipe = RECIPES[o.low_precision_recipe]
    # delayed scaling takes no fp8_param_gather (PARAM_GATHER_RECIPES)
    param = o.fp8_param_gather and o.low_precision_recipe != GenerateOptions.low_precision_recipe
    return float(
        sum(
            n
            * sum(
                cached_weight_bytes(recipe, rows, cols, param=param, arch=arch)
                for rows, cols in gemm_weight_shapes_per_rank(o, kind).values()
            )
            for kind, n in kinds.items()
            if not model_kind(kind)[1]  # layers kept in bf16 quantize nothing
        )
    )


def stated_weight_copy_bytes(
    o: GenerateOptions, stated: float, arch: str | None, scales: float | None = None
) -> float:
    """A workload's ``low_precision_weight_bytes`` on a GPU of ``arch``. The workload states
    the copies of both usages (what a GPU whose fp8 GEMMs take the TN layout alone keeps,
    ``stg.core.recipes.weight_copy_bytes``) and, as ``low_precision_weight_scale_bytes``
    (``scales``), the scales among them, whatever GPU it is predicted for; where one
    per-tensor scaled fp8 tensor serves both usages (Blackwell, ``Recipe.shares_usages``) the
    copies are those of ``Recipe.cached_weight_copies`` and the scales stay whole
    (:func:`stg.api.cached_weight_bytes`, as :func:`recipe_weight_copy_bytes` counts them). A
    workload that states no scales (written before they were stated) is scaled whole by the
    ratio of the recipe's bytes per element."""
    recipe = RECIPES[o.low_precision_recipe]
    if not recipe.shares_usages(arch):
        return stated
    param = o.fp8_param_gather
    if scales is None:
        both = recipe.weight_bytes_per_element(param=param)
        return stated * recipe.weight_bytes_per_element(param=param, arch=arch) / both
    kept = recipe.cached_weight_copies(param=param, arch=arch)
    return (stated - scales) * kept / recipe.cached_weight_copies(param=param) + scales


def precision_bytes(
    o: GenerateOptions, weight_dtype: str | None = None, grad_dtype: str | None = None
) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter for these options."""
    e_w = dtype_bytes(weight_dtype or recipe_weight_dtype(o))
    if grad_dtype is None:
        grad_dtype = o.grad_reduce_dtype or ("fp32" if o.mixed_precision else o.dtype)
    e_g = dtype_bytes(grad_dtype)
    k = ADAM_MIXED_K if o.mixed_precision else 2 * e_w
    return e_w, e_g, k


def muon_state(
    o: GenerateOptions, state: ModelState, k: int, zero: int, held: float, shared: float
) -> ModelState:
    """``state`` with Muon's matrices (``--optimizer muon``): ``held`` matrix elements on the
    rank, ``shared`` its share of them whose state it keeps under ZeRO (the layer-wise
    distributed optimizer). Each keeps one moment (its momentum) where Adam keeps two: a
    third of the mixed-precision ``k`` (fp32 master weights and two moments) less, or half
    of the moments alone without mixed precision."""
    if o.optimizer != "muon" or not held:
        return state
    saved = k / 3 if o.mixed_precision else k / 2
    return replace(state, optimizer=state.optimizer - saved * (shared if zero >= 1 else held))


def zero_stage(o: GenerateOptions) -> int:
    return 3 if o.weight_sharded else o.zero


def fsdp_unit_parameters(
    o: GenerateOptions, kinds: Mapping[str, int], *, has_embedding: bool, has_head: bool
) -> list[int]:
    """Parameters per rank of each FSDP unit of a stage that gathers and reduces on its own
    (stg's units, as torchtitan wraps Llama: every layer, the embedding, the final norm with
    the LM head): one entry per kind of layer held, the embedding and the head where held."""
    h, v, t = o.dmodel, o.dvocal, o.tp
    llama = model_family(o.model) == "llama"
    units = [layer_parameters_per_rank(o, kind) for kind, n in kinds.items() if n]
    bare = llama or is_mpt(o)  # no position embedding, no norm bias
    if has_embedding:
        units.append(v * h // t + (0 if bare else o.seq * h))
    if has_head:
        units.append((h if bare else 2 * h) + (v * h // t if bare or o.pp > 1 else 0))
    return units


def fsdp_unsharded_state(o: GenerateOptions) -> tuple[bool, bool]:
    """Whether FSDP keeps (the whole stage's) gathered weights until their backward, and
    whether it accumulates unsharded gradients over the micro-batches: the first when
    ``reshard_after_forward`` resolves to never, the second under pipeline parallelism
    (``torch.distributed.pipelining`` turns gradient sync and resharding after backward off
    until the last micro-batch). Both false without FSDP over more than one rank."""
    if not o.weight_sharded or o.dp * o.sp == 1:
        return False, False
    return not o.reshards_after_forward, o.pp > 1


# ---------------------------------------------------------------------------------------------
# Per stage


@dataclass(frozen=True)
class RankMemory:
    """Memory of one rank (of a rank class) in bytes."""

    stage: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def peak(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers


def stage_memory(
    options: Mapping[str, Any] | GenerateOptions,
    *,
    stage: int,
    parameters: int,
    layers: int,
    has_embedding: bool,
    has_head: bool,
    weight_dtype: str | None = None,
    grad_dtype: str | None = None,
    kernels: KernelTable | None = None,
    sharded_parameters: float | None = None,
    kinds: Mapping[str, int] | None = None,
    saved_bytes: float | None = None,
    head_bytes: float | None = None,
    system: System | None = None,
    layer_bytes: Mapping[str, float] | None = None,
    weight_copies: float | None = None,
    muon_parameters: tuple[float, float] = (0, 0),
    weight_copy_scales: float | None = None,
    op_checkpoint_bytes: Mapping[str, float] | None = None,
    layer_runs: Sequence[Sequence[Any]] | None = None,
) -> RankMemory:
    """The memory of one rank of pipeline stage ``stage`` whose model replica holds
    ``parameters`` weights; ``sharded_parameters`` is its padded ZeRO / FSDP shard of them
    (default ``parameters / N_d``); ``kinds`` its ``layers`` by block kind (default: all of
    the model's MoE or only kind). ``saved_bytes``: what a model without a layer stack (a
    convolutional network) keeps per micro-batch between forward and backward, as its
    generated graph says (the closed forms here are a transformer's); ``head_bytes``: what
    a head without vocabulary logits (a classifier, a span head) keeps, from the graph too
    (the closed form here is an LM head's). ``system``: the GPU, which decides whether a
    planned fp8 GEMM runs natively (its saved input in 1 byte, and Transformer Engine's fp8
    weight copies, :func:`fp8_weight_copy_bytes`, counted with the weights).
    ``layer_bytes``: what one layer of each of these kinds keeps per micro-batch, from the
    graph, for layers that are not a transformer's (Mamba-2, gated DeltaNet, hybrid).
    ``weight_copies``: the quantized weight copies and scales of a low-precision recipe
    (``--low_precision_recipe``), from the graph, counted with the weights as ``system``
    keeps them (:func:`stated_weight_copy_bytes`; default: from the options,
    :func:`recipe_weight_copy_bytes`), ``weight_copy_scales`` the scales among them (the fact
    ``low_precision_weight_scale_bytes``). ``muon_parameters``: the matrix elements that
    ``--optimizer muon`` updates, held and this rank's share of them (one state where Adam
    keeps two, :func:`muon_state`). ``op_checkpoint_bytes``: under
    ``activation_recompute=selective_op``, what one layer of each kind keeps, from the graph
    (the fact ``op_checkpoint_layer_bytes``), for the layers without a closed form
    (:func:`op_checkpoint_closed_form`). ``layer_runs``: the stack's block kinds in layer
    order (the fact, for CPU offload; :func:`offloaded_activations`)."""
    o = as_options(options)
    terms = _stage_terms(
        o,
        muon_parameters=muon_parameters,
        parameters=parameters,
        layers=layers,
        has_embedding=has_embedding,
        has_head=has_head,
        weight_dtype=weight_dtype,
        grad_dtype=grad_dtype,
        kernels=kernels,
        sharded_parameters=sharded_parameters,
        kinds=kinds,
        saved_bytes=saved_bytes,
        head_bytes=head_bytes,
        system=system,
        layer_bytes=layer_bytes,
        weight_copies=weight_copies,
        weight_copy_scales=weight_copy_scales,
        activations=_LayerActivations(o, kernels, system, op_checkpoint_bytes)
        if op_checkpoint_bytes
        else None,
        layer_runs=layer_runs,
    )
    return _stage_memory(o, stage, terms)


@dataclass(slots=True)
class _StageTerms:
    """What :func:`stage_memory` finds of a stage that does not depend on which stage it is
    (stages that hold the same layers, ends and shard share them; never changed once made)."""

    parameters: int
    has_embedding: bool
    has_head: bool
    kernels: KernelTable | None
    system: System | None
    kinds: Mapping[str, int]
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    zero: int
    shard: int
    state: ModelState
    keeps_weights: bool
    accumulates_grads: bool
    unsharded_weights: float
    unsharded_grads: float
    weight_copies: float
    saved_bytes: float | None
    per_kind: Mapping[str, float]
    offloaded: float | None
    """the activations left on the GPU under CPU offloading (None: no offloading)"""
    sp_divisor: int
    sbh: float
    head: float
    head_transient: float
    recompute_buffer: float | None
    """the largest recomputed layer's buffer (None: found per stage, or none)"""
    torch_cp: float
    """what PyTorch's context parallelism holds beside one layer's attention
    (:func:`torch_cp_buffers`)"""
    units: list[int]
    weights: float
    """the weights' bytes (with the fp8 and the recipe's weight copies)"""
    activations: _LayerActivations


def _stage_terms(
    o: GenerateOptions,
    *,
    parameters: int,
    layers: int,
    has_embedding: bool,
    has_head: bool,
    weight_dtype: str | None,
    grad_dtype: str | None,
    kernels: KernelTable | None,
    sharded_parameters: float | None,
    kinds: Mapping[str, int] | None,
    saved_bytes: float | None,
    head_bytes: float | None,
    system: System | None,
    layer_bytes: Mapping[str, float] | None,
    weight_copies: float | None,
    activations: _LayerActivations | None = None,
    muon_parameters: tuple[float, float] = (0, 0),
    weight_copy_scales: float | None = None,
    layer_runs: Sequence[Sequence[Any]] | None = None,
) -> _StageTerms:
    layer_activations = activations or _LayerActivations(o, kernels, system)
    if not kinds:
        kinds = {"moe" if is_mla(o) else "block": layers} if layers else {}
    e_w, e_g, k = precision_bytes(o, weight_dtype, grad_dtype)
    arch = system.arch if system is not None else None
    if weight_copies is None:
        weight_copies = recipe_weight_copy_bytes(o, kinds, arch)
    else:
        weight_copies = stated_weight_copy_bytes(o, weight_copies, arch, weight_copy_scales)
    zero = zero_stage(o)
    shard = o.dp * o.sp
    state = model_state_bytes(
        parameters,
        weight_bytes=e_w,
        grad_bytes=e_g,
        optimizer_bytes=k,
        zero=zero,
        shard=shard,
        sharded=sharded_parameters,
    )
    state = muon_state(o, state, k, zero, *muon_parameters)
    keeps_weights, accumulates_grads = fsdp_unsharded_state(o)
    unsharded_weights = e_w * parameters if keeps_weights else 0
    unsharded_grads = e_g * parameters if accumulates_grads else 0
    common = dict(
        activations=layer_activations,
        parameters=parameters,
        has_embedding=has_embedding,
        has_head=has_head,
        kernels=kernels,
        system=system,
        kinds=kinds,
        weight_bytes=e_w,
        grad_bytes=e_g,
        optimizer_bytes=k,
        zero=zero,
        shard=shard,
        state=state,
        keeps_weights=keeps_weights,
        accumulates_grads=accumulates_grads,
        unsharded_weights=unsharded_weights,
        unsharded_grads=unsharded_grads,
        weight_copies=weight_copies,
    )
    if saved_bytes is not None:
        return _StageTerms(
            **common,
            saved_bytes=saved_bytes,
            per_kind={},
            offloaded=None,
            sp_divisor=1,
            sbh=0.0,
            head=0.0,
            head_transient=0.0,
            recompute_buffer=None,
            torch_cp=0.0,
            units=[],
            weights=state.weights + weight_copies + unsharded_weights,
        )
    graph = layer_bytes or {}
    per_kind = {
        kind: graph[kind] if kind in graph else layer_activations.bytes(kind) for kind in kinds
    }
    offloaded = None
    if o.cpu_offloading_num_layers and kinds:
        offloaded = offloaded_activations(o, per_kind, layer_runs)
    b = micro_batch_size(o)
    e = activation_element_bytes(o)
    t = o.tp
    sp_divisor = t if (o.tpsp and t > 1) else 1
    sb = o.seq / o.sp * b
    sbh = sb * o.dmodel
    logits = sb * o.dvocal / t  # this rank's share of the vocabulary
    head = 0.0
    head_transient = 0.0
    if has_head:
        # final norm input (eager: and its per-row statistics) and LM-head input (1 byte
        # when the plan runs the LM head in fp8 natively), fp32 logits for the cross entropy
        head_input: float = e
        if o.precision:
            dtype = precision_of(o.precision, "logits")
            if dtype and dtype != o.dtype and runs_natively("gemm", dtype, kernels, system):
                head_input = (kernels or KernelTable()).bytes_per_element("gemm", dtype)
        stats = norm_stats_bytes(o) * sb
        head = (e + head_input) * sbh / sp_divisor + stats / sp_divisor + 4 * logits
        if head_bytes is not None:
            head = head_bytes
        elif o.runs_eager_loss:
            head_transient = EAGER_CROSS_ENTROPY_TRANSIENT * logits
        elif o.dtype != "fp32":
            head_transient = MEGATRON_CROSS_ENTROPY_TRANSIENT * logits
        # each multi-token prediction module: its MoE layer, the inputs of its three norms
        # and of its projection (2h), and its own final norm, LM-head input and logits
        modules = mtp_depth(o)
        if modules:
            moe_layer = layer_activations.bytes("moe")
            head += modules * (moe_layer + head)
            head += modules * (e * 4 * sbh + 3 * stats) / sp_divisor
    recompute_buffer = None
    if not o.recompute_method:
        recompute_buffer = _recompute_buffer(o, kinds, per_kind, layer_activations)
    units = fsdp_unit_parameters(o, kinds, has_embedding=has_embedding, has_head=has_head)
    fp8_copies = fp8_weight_copy_bytes(o, kinds, system, has_head=has_head, kernels=kernels)
    return _StageTerms(
        **common,
        saved_bytes=None,
        per_kind=per_kind,
        offloaded=offloaded,
        sp_divisor=sp_divisor,
        sbh=sbh,
        head=head,
        head_transient=head_transient,
        recompute_buffer=recompute_buffer,
        torch_cp=torch_cp_buffers(o).peak if kinds else 0.0,
        units=units,
        weights=state.weights + fp8_copies + weight_copies + unsharded_weights,
    )


class _LayerActivations:
    """:func:`activation_bytes_per_layer` of one run's options on one system, per block kind
    and recompute, found once (the stages of a run share them)."""

    def __init__(
        self,
        o: GenerateOptions,
        kernels: KernelTable | None,
        system: System | None,
        op_checkpoint: Mapping[str, float] | None = None,
    ) -> None:
        self.o, self.kernels, self.system = o, kernels, system
        self.op_checkpoint = op_checkpoint or {}
        """per block kind, what op-level checkpointing keeps of a layer, from the graph (the
        workload's fact ``op_checkpoint_layer_bytes``): for the layers whose closed form
        :func:`op_checkpoint_layer_bytes` lacks"""
        self.known: dict[tuple[str, str | None], float] = {}

    def bytes(self, kind: str, recompute: str | None = None) -> float:
        key = (kind, recompute)
        if key not in self.known:
            if (
                (recompute or self.o.activation_recompute) == "selective_op"
                and kind in self.op_checkpoint
                and not op_checkpoint_closed_form(self.o, kind)
            ):
                self.known[key] = float(self.op_checkpoint[kind])
            else:
                self.known[key] = activation_bytes_per_layer(
                    self.o, recompute=recompute, kernels=self.kernels, kind=kind, system=self.system
                )
        return self.known[key]


def _recompute_buffer(
    o: GenerateOptions,
    kinds: Mapping[str, int],
    per_kind: Mapping[str, float],
    activations: _LayerActivations,
) -> float | None:
    """The largest layer recomputed: all its activations (full), its attention scores or what
    op-level checkpointing does not keep (None: no layer is recomputed)."""
    if not (kinds and o.activation_recompute in ("full", "selective", "selective_op")):
        return None
    partial = o.activation_recompute in ("selective", "selective_op")
    return max(
        activations.bytes(kind, "none") - (per_kind[kind] if partial else 0) for kind in kinds
    )


TORCH_CP_SOURCE = "torch/distributed/tensor/experimental/_attention.py"
"""PyTorch's context parallelism, read at pytorch/pytorch 0123248 (the stored version; its
``_templated_ring_attention`` and ``_templated_ring_attention_backward`` loops are the ones
that :mod:`stg.core.torch_context_parallel` reads at 1963fc8, December 2024)."""


@dataclass(frozen=True)
class TorchCPBuffers:
    """What PyTorch's own context parallelism (:data:`TORCH_CP_SOURCE`) allocates beside one
    layer's attention, bytes per rank, each tensor counted from its allocation to its last
    use (as Inductor frees the buffers of a compiled block; eager Python would hold the
    backward's previous K/V gradient, another ``kv_grad / 2``, until it rebinds it):

    - ``gathered_kv``: ``_AllGatherRotater``'s ``all_gather_tensor`` of ``torch.cat`` of the
      rank's K and V at the queries' heads, ``cp`` times them, held until the last SDPA call
      (once in the forward, again in the backward: the autograd saves only the local K, V);
    - ``merged_output``: the forward's ``_SDPAMerger``: the running fp32 output and
      log-sum-exp, the merge's new pair written beside them (out of place) and the call's
      output (activation dtype) and fp32 log-sum-exp that it reads;
    - ``query_grad``: the backward's fp32 dQ accumulator (``torch.zeros_like(query,
      dtype=accum_dtype)``, ``convert_to_f32``);
    - ``kv_grad``: the fp32 K/V gradient in flight around the ring: the buffer sent
      (``torch.cat`` of the accumulated dK, dV, the all-to-all's input until its wait) and
      the one received (``ft_c.permute_tensor``'s output), during each SDPA backward call.

    The rank's own K/V concatenation (the gather's input) is freed at call 1's wait, before
    either peak."""

    gathered_kv: float
    merged_output: float
    query_grad: float
    kv_grad: float

    @property
    def forward(self) -> float:
        """Alive at a forward merge."""
        return self.gathered_kv + self.merged_output

    @property
    def backward(self) -> float:
        """Alive at a backward SDPA call after the first."""
        return self.gathered_kv + self.query_grad + self.kv_grad

    @property
    def peak(self) -> float:
        """The larger pass: a layer's buffer beside its recompute (the backward's in
        practice: the K/V gradient in flight outweighs the merges)."""
        return max(self.forward, self.backward)


NO_TORCH_CP = TorchCPBuffers(0.0, 0.0, 0.0, 0.0)


def runs_torch_cp(o: GenerateOptions) -> bool:
    """Whether stg generate writes the layers' attention as PyTorch's context parallelism
    (:func:`stg.api.lowered_cp_comm_type`): ``sp`` > 1 under torchtitan's profiles with
    ``cp_comm_type`` all_gather, causal attention load-balanced over an even number of local
    queries, on layers without a window, chunk or top-k mask (some layers have none with
    ``full_attention_every``)."""
    if o.sp <= 1 or lowered_cp_comm_type(o.profile, o.cp_comm_type) != TORCH_ALL_GATHER:
        return False
    masked = bool(o.attention_window or o.attention_chunk) and not o.full_attention_every
    return bool(o.causal) and not masked and not o.index_topk and (o.seq // o.sp) % 2 == 0


def torch_cp_buffers(o: GenerateOptions) -> TorchCPBuffers:
    """:class:`TorchCPBuffers` of one layer of ``o`` (all zero where :func:`runs_torch_cp`
    is false). Per rank: ``b`` sequences of ``s/cp`` tokens, ``a/t`` query heads (torchtitan
    hands SDPA K and V after ``repeat_kv``), query/key head dim ``d`` (MLA: ``d + r``, its
    RoPE part) and value head dim ``d``, activation dtype ``e`` bytes; with ``N_k``, ``N_v``
    the elements of one such K and V and ``R = b·(a/t)·s/cp`` log-sum-exp rows:
    ``gathered_kv = cp·(N_k + N_v)·e``, ``merged_output = (8 + e)·N_v + 12·R``,
    ``query_grad = 4·N_k``, ``kv_grad = 2·4·(N_k + N_v)``."""
    if not runs_torch_cp(o):
        return NO_TORCH_CP
    e = activation_element_bytes(o)
    d = head_size(o)
    d_qk = d + ((o.drope if o.drope is not None else d // 2) if is_mla(o) else 0)
    rows = micro_batch_size(o) * (o.head // o.tp) * (o.seq // o.sp)
    n_k, n_v = rows * d_qk, rows * d
    f32 = DTYPE_BYTES["fp32"]  # _ContextParallelOptions.convert_to_f32 = True
    return TorchCPBuffers(
        gathered_kv=o.sp * (n_k + n_v) * e,
        merged_output=(2 * f32 + e) * n_v + 3 * f32 * rows,
        query_grad=f32 * n_k,
        kv_grad=2 * f32 * (n_k + n_v),
    )


def _stage_memory(o: GenerateOptions, stage: int, terms: _StageTerms) -> RankMemory:
    """The memory of one rank of pipeline stage ``stage`` from its :class:`_StageTerms`: the
    micro-batches in flight are those of one pipeline schedule (``pipeline_flushes`` of them
    run in turn)."""
    m = o.micro_batches // o.pipeline_flushes
    state = terms.state
    if terms.saved_bytes is not None:
        held = in_flight_micro_batches(stage, o.pp, m, o.pipeline_schedule, o.virtual_stages)
        return RankMemory(
            stage=stage,
            parameters=terms.parameters,
            weights=terms.weights,
            gradients=state.gradients + terms.unsharded_grads,
            optimizer=state.optimizer,
            activations=held * terms.saved_bytes,
            buffers=0.0,
        )
    kinds, per_kind = terms.kinds, terms.per_kind
    activations = sum(
        per_kind[kind] * in_flight_layers(stage, n, o.pp, m, o.pipeline_schedule, o.virtual_stages)
        for kind, n in kinds.items()
    )
    if terms.offloaded is not None:
        activations = terms.offloaded
    kernels, system = terms.kernels, terms.system
    granular = recompute_layer_bytes(o, stage, kernels, system) if o.recompute_method else None
    if granular is not None:
        per_micro_batch, _ = granular
        held_layers = in_flight_layers(stage, 1, o.pp, m, o.pipeline_schedule, o.virtual_stages)
        activations = held_layers * per_micro_batch
    held = in_flight_micro_batches(stage, o.pp, m, o.pipeline_schedule, o.virtual_stages)
    if terms.has_embedding and has_dropout(o):
        activations += held * MASK_BYTES * terms.sbh / terms.sp_divisor  # embedding dropout mask
    if terms.has_head:
        activations += (m if o.pipeline_schedule.lower() == "gpipe" else 1) * terms.head
    buffers = 0.0
    if granular is not None:
        buffers += granular[1]
    else:
        recompute_buffer = terms.recompute_buffer
        if recompute_buffer is None and o.recompute_method:
            recompute_buffer = _recompute_buffer(o, kinds, per_kind, terms.activations)
        if recompute_buffer is not None:
            buffers += recompute_buffer
    # PyTorch's context parallelism: its gathered K/V, merges and fp32 gradients beside the
    # attention of the layer being run (or recomputed) and its activations
    buffers += terms.torch_cp
    # the cross entropy's transients (eager: its backward's fp32 gradients; Megatron: the
    # 16-bit logits or their gradient beside the fp32 ones) come with every activation held;
    # a layer's recompute comes later, after the head has freed its logits
    buffers = max(buffers, terms.head_transient)
    units, zero = terms.units, terms.zero
    e_w, e_g = terms.weight_bytes, terms.grad_bytes
    if zero == 3 and terms.shard > 1 and units and not terms.accumulates_grads:
        # FSDP2 reduces a unit's gradients by copying them, cast to the reduce dtype, into one
        # reduce-scatter input (foreach_reduce), freeing them only after the copy: the largest
        # unit's gradients in the weight dtype and its reduce-scatter input live together
        # after that unit's backward, when the loss's transients are gone. (Under pipeline
        # parallelism the reductions wait for the last micro-batch, past the activations' peak.)
        buffers = max(buffers, max(units) * (e_w + e_g))
    if zero == 3 and units and not terms.keeps_weights:
        # the gathered weights of the unit in use and of the one prefetched
        buffers += e_w * sum(sorted(units)[-2:])
    memory = RankMemory(
        stage=stage,
        parameters=terms.parameters,
        weights=terms.weights,
        gradients=state.gradients + terms.unsharded_grads,
        optimizer=state.optimizer,
        activations=activations,
        buffers=buffers,
    )
    if is_eager(o):
        memory = eager_peak(o, memory, state, terms.optimizer_bytes, e_w, terms.accumulates_grads)
    return memory


def eager_peak(
    o: GenerateOptions,
    memory: RankMemory,
    state: ModelState,
    optimizer_bytes: int,
    weight_bytes: int,
    accumulates_grads: bool,
) -> RankMemory:
    """The larger of eager PyTorch's two peaks, each with what is alive then:

    - the start of the backward (the loss's transients): ``memory`` less the gradients where
      the step has one micro-batch, since ``Optimizer.zero_grad`` frees them
      (``set_to_none=True``, its default since PyTorch 2.0) and autograd's AccumulateGrad
      allocates each only when the backward produces it (several micro-batches accumulate
      into gradients the first one allocated; a layer's recompute runs once the gradients
      of the layers after it exist, so with recompute all of them count, a bound);
    - the optimizer step: the gradients, the optimizer states and the master weights, no
      activations and, with mixed precision, no 16-bit weights (autocast's casts live from
      the forward until the backward frees them), plus the second moments' square roots
      that PyTorch's default AdamW (``foreach``, the default for parameters on a GPU,
      DTensor shards included) allocates as one list beside the states:
      ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` in
      ``torch/optim/adam.py`` ``_multi_tensor_adam`` (PyTorch 2.13), in the parameters'
      dtype (fp32 master weights with mixed precision), one element per optimized one.
    """
    no_recompute = str(o.activation_recompute).lower() in ("none", "false")
    one_pass = o.micro_batches == 1 and not accumulates_grads and no_recompute
    backward = replace(memory, gradients=0.0) if one_pass else memory
    moments = 4 if o.mixed_precision else weight_bytes
    casts = state.weights if o.mixed_precision else 0.0
    step = replace(
        memory,
        weights=memory.weights - casts,
        activations=0.0,
        buffers=state.optimizer / optimizer_bytes * moments,
    )
    return step if step.peak > backward.peak else backward


def analytic_memory(
    options: Mapping[str, Any] | GenerateOptions,
    kernels: KernelTable | None = None,
    system: System | None = None,
    muon: Mapping[str, tuple[int, float]] | None = None,
) -> list[RankMemory]:
    """Memory per stage from options alone (parameters from :func:`count_parameters`; with
    ZeRO / FSDP the embedding, every layer and the head are padded flat buffers) on
    ``system`` (None: no native fp8); ``muon``: per part (``embedding``, ``head``, a block
    kind) the Muon matrix elements a rank holds and its share of them
    (:func:`stg.api.muon_part_parameters`)."""
    o = as_options(options)
    shard = o.dp * o.sp
    # where ep folds over dp or sp, ZeRO shards a layer's routed experts fewer ways, in a
    # flat buffer of their own (stg.core.lowering: one buffer per shard degree)
    expert_shard = expert_zero_degree(o) if o.ep_folded and zero_stage(o) else shard

    shards: dict[str, int] = {}

    def layer_shard(kind: str) -> int:
        if kind not in shards:
            routed = routed_parameters_per_rank(o, kind) if expert_shard != shard else 0
            dense = layer_parameters_per_rank(o, kind) - routed
            shards[kind] = padded_shard([dense], shard) + padded_shard(
                [routed] if routed else [], expert_shard
            )
        return shards[kind]

    sharded = bool(zero_stage(o))
    # stages that hold the same layers, ends and shard share what does not depend on which
    # stage they are (every stage between the first and the last of an even split)
    alike: dict[tuple[Any, ...], _StageTerms] = {}
    activations = _LayerActivations(o, kernels, system)
    out = []
    for p in count_parameters(o):
        has_embedding, has_head = p.stage == 0, p.stage == o.pp - 1
        sharded_parameters = (
            padded_shard([p.embedding_parameters, p.head_parameters], shard)
            + sum(layer_shard(kind) * n for kind, n in p.kinds)
            if sharded
            else None
        )
        matrices = [(kind, n) for kind, n in p.kinds]
        matrices += [("embedding", 1)] if has_embedding else []
        matrices += [("head", 1)] if has_head else []
        held = tuple(
            sum((muon or {}).get(part, (0, 0))[i] * n for part, n in matrices) for i in (0, 1)
        )
        key = (p.total, p.layers, has_embedding, has_head, sharded_parameters, p.kinds, held)
        if key not in alike:
            alike[key] = _stage_terms(
                o,
                parameters=p.total,
                layers=p.layers,
                has_embedding=has_embedding,
                has_head=has_head,
                weight_dtype=None,
                grad_dtype=None,
                kernels=kernels,
                sharded_parameters=sharded_parameters,
                kinds=dict(p.kinds),
                saved_bytes=None,
                head_bytes=None,
                system=system,
                layer_bytes=None,
                weight_copies=None,
                activations=activations,
                muon_parameters=held,
            )
        out.append(_stage_memory(o, p.stage, alike[key]))
    return out


# ---------------------------------------------------------------------------------------------
# The predictor


_RANK_MEMORY_FIELDS = tuple(f.name for f in fields(RankMemory))


def _rank_memory_dict(memory: RankMemory) -> dict[str, Any]:
    # its fields are numbers: no deep copy (dataclasses.asdict) needed
    out: dict[str, Any] = {}
    for name in _RANK_MEMORY_FIELDS:
        value = getattr(memory, name)
        out[name] = round(value) if isinstance(value, float) else value
    out["peak"] = round(memory.peak)
    return out


def predict_memory(
    workload: Any,
    system: System | str = "a100-80g",
    *,
    kernels: KernelTable | Iterable[Any] | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Peak memory per rank class of a generated workload (needs ``metadata["options"]``);
    ``kernels`` (Kernel records) say what a precision plan's saved tensors occupy."""
    system = load_system(system)
    table = kernel_table(kernels, system.name)
    options = workload.metadata.get("options") if workload.metadata else None
    if not options:
        raise UserError(
            "the memory predictor needs the generation options (a workload built by "
            "stg generate options, not a bare trace)"
        )
    if options.get("phase", "training") != "training":  # prefill, decode, mixed
        from stg.predictors.serving import serving_memory

        return serving_memory(workload, system)
    o = as_options(options)
    check_runs_on(o, system)
    check_capacity(system, len(workload.ranks))
    if is_hybrid(system):
        return _hybrid_memory(workload, system, o, kernels)
    classes = []
    for rank_class in workload.rank_classes:
        memory = _class_memory(o, rank_class, table, system)
        ranks = [g.rank for g in workload.ranks if g.rank_class.index == rank_class.index]
        entry = {"class": rank_class.index, "ranks": len(ranks), "first_rank": min(ranks)}
        entry.update(_rank_memory_dict(memory))
        entry["fits"] = memory.peak <= system.hbm_capacity
        classes.append(entry)
    return _memory_report(classes, system)


def _class_memory(
    o: GenerateOptions, rank_class: Any, table: KernelTable, system: System
) -> RankMemory:
    facts = rank_class.facts
    for key in ("parameters", "layers", "has_embedding", "has_head"):
        if key not in facts:
            raise UserError(f"rank class {rank_class.index} lacks the fact {key!r}")
    if "precision" in facts:  # a device group's own precision plan (hybrid clusters)
        o = replace(o, precision=tuple(tuple(e) for e in facts["precision"]))
    sharded = facts.get("shard_parameters")
    weight_dtype = facts.get("weight_dtype")
    if runs_recipe(o):
        # the workload's weight tensors, and so its fact, are fp8 under delayed scaling (a
        # graph computing in fp8); the recipe keeps 16-bit weights beside its copies
        weight_dtype = recipe_weight_dtype(o)
    return stage_memory(
        o,
        stage=rank_class.stage,
        parameters=int(facts.get("replica_parameters", facts["parameters"])),
        layers=int(facts["layers"]),
        has_embedding=bool(facts["has_embedding"]),
        has_head=bool(facts["has_head"]),
        weight_dtype=weight_dtype,
        grad_dtype=facts.get("grad_dtype"),
        kernels=table,
        sharded_parameters=int(sharded) if sharded is not None else None,
        kinds=facts.get("layer_kinds"),
        saved_bytes=facts.get("activation_bytes") if facts.get("stackless") else None,
        head_bytes=facts.get("head_activation_bytes"),
        system=system,
        layer_bytes=facts.get("layer_activation_bytes"),
        weight_copies=facts.get("low_precision_weight_bytes"),
        weight_copy_scales=facts.get("low_precision_weight_scale_bytes"),
        muon_parameters=(
            float(facts.get("muon_parameters", 0)),
            float(facts.get("muon_shard_parameters", 0)),
        ),
        op_checkpoint_bytes=facts.get("op_checkpoint_layer_bytes"),
        layer_runs=facts.get("layer_runs"),
    )


def _hybrid_memory(
    workload: Any, system: System, o: GenerateOptions, kernels: Any
) -> dict[str, Any]:
    """Peak memory per (rank class, device group), each against its group's capacity (kernels
    apply by device name)."""
    items = kernels if isinstance(kernels, KernelTable) else list(kernels or ())
    classes = []
    for rank_class in workload.rank_classes:
        by_group: dict[str, list[int]] = {}
        for g in workload.ranks:
            if g.rank_class.index == rank_class.index:
                by_group.setdefault(str(group_of_rank(system, g.rank)), []).append(g.rank)
        for group, ranks in by_group.items():
            device = device_of(system, ranks[0])
            memory = _class_memory(o, rank_class, kernel_table(items, device.name), device)
            entry = {
                "class": rank_class.index,
                "ranks": len(ranks),
                "first_rank": min(ranks),
                "group": group,
                "device": device.name,
                "capacity_bytes": device.hbm_capacity,
            }
            entry.update(_rank_memory_dict(memory))
            entry["fits"] = memory.peak <= device.hbm_capacity
            classes.append(entry)
    report = _memory_report(classes, system)
    report["fits"] = all(c["fits"] for c in classes)
    groups: dict[str, dict[str, Any]] = {}
    for c in classes:
        g = groups.setdefault(
            c["group"],
            {"device": c["device"], "capacity_bytes": c["capacity_bytes"], "peak_bytes": 0},
        )
        g["peak_bytes"] = max(g["peak_bytes"], c["peak"])
        g["fits"] = g["peak_bytes"] <= g["capacity_bytes"]
    report["groups"] = groups
    return report


def predict_analytic(
    options: Mapping[str, Any] | GenerateOptions,
    system: System | str = "a100-80g",
    *,
    kernels: KernelTable | Iterable[Any] | None = None,
    registry: Any = None,
) -> dict[str, Any]:
    """The memory report from options alone (parameters counted by :func:`count_parameters`),
    for traces that record their options but not the per-stage facts; ``registry``: the
    model's, which ``--optimizer muon`` needs (its weight matrices, from the bound parts)."""
    system = load_system(system)
    o = as_options(options)
    if o.inference:
        raise UserError(
            f"the memory of a phase={o.phase} trace needs its per-rank facts: give the options "
            "of stg generate instead of a trace"
        )
    check_runs_on(o, system)
    table = kernel_table(kernels, system.name)
    classes = []
    ranks_per_stage = o.world_size // o.pp
    muon = None
    if o.optimizer == "muon":
        if registry is None:
            raise UserError(
                "optimizer=muon: the memory predictor needs the model (a registry) to find "
                "the weight matrices Muon updates"
            )
        muon = muon_part_parameters(o, registry)
    for memory in analytic_memory(o, table, system, muon):
        entry: dict[str, Any] = {
            "class": memory.stage,
            "ranks": ranks_per_stage,
            "first_rank": None,
        }
        entry.update(_rank_memory_dict(memory))
        entry["fits"] = memory.peak <= system.hbm_capacity
        classes.append(entry)
    return _memory_report(classes, system)


def predict_memory_options(
    options: Mapping[str, Any] | GenerateOptions,
    system: System | str = "a100-80g",
    *,
    kernels: KernelTable | Iterable[Any] | None = None,
    registry: Any = None,
    workload: Any = None,
    max_nodes: int | None = None,
) -> dict[str, Any]:
    """The memory report of ``options`` without building their workload where the options
    say all it needs (:func:`predict_analytic`: a training run on one kind of GPU whose model
    has a layer stack; the same peaks as :func:`predict_memory` of the built workload). A
    serving phase, a hybrid cluster or a model without a layer stack needs the per-rank facts
    of the workload: ``workload`` where given (built from ``options``), else it is built
    (with ``registry``; at most ``max_nodes`` nodes where given)."""
    system = load_system(system)
    o = as_options(options)
    if workload is not None:
        return predict_memory(workload, system, kernels=kernels)
    if registry is None or _from_options_alone(o, system, registry):
        return predict_analytic(o, system, kernels=kernels, registry=registry)
    from stg.api import build_workload, check_size, estimate_size

    check_size(
        estimate_size(o, registry),
        max_nodes=max_nodes,
        option="--max-nodes" if max_nodes is not None else None,
    )
    return predict_memory(build_workload(o, registry), system, kernels=kernels)


CLOSED_FORM_MODELS = frozenset({"gpt", "llama", "moe", "deepseek", "mpt"})
"""The built-in models whose embedding, layers and head the closed forms here describe (a
preset resolves to one: ``llama3-8b`` is ``llama``): tests/test_memory_closed_forms.py checks
their parameters and peaks against their built workloads. Another model's (BERT's and
RoBERTa's heads, Mamba-2, gated DeltaNet, hybrid stacks, a plugin's) are read from its
built workload."""


def _from_options_alone(o: GenerateOptions, system: System, registry: Any) -> bool:
    if o.inference or is_hybrid(system) or not closed_forms_apply(o, registry):
        return False
    return workload_cache.layer_kinds(o, registry) > 0


def closed_forms_apply(options: Mapping[str, Any] | GenerateOptions, registry: Any) -> bool:
    """Whether the closed forms describe the memory of the run ``options`` describe: its model
    is one of :data:`CLOSED_FORM_MODELS` (:func:`closed_form_model`) and, under op-level
    checkpointing (``activation_recompute=selective_op``), each of its layers has the closed
    form :func:`op_checkpoint_layer_bytes` (:func:`op_checkpoint_closed_form`); else what the
    layers keep comes from the workload the options build."""
    o = as_options(options)
    if not closed_form_model(o.model, registry):
        return False
    return o.activation_recompute != "selective_op" or all(
        op_checkpoint_closed_form(o, kind) for kind in layer_kinds(o)
    )


def closed_form_model(name: str, registry: Any) -> bool:
    """Whether the closed forms describe model ``name`` (:data:`CLOSED_FORM_MODELS`, or a
    preset of one: ``llama3-8b`` builds ``llama``)."""
    if name in CLOSED_FORM_MODELS:
        return True
    try:
        return str(registry.presets.lookup(name).item.model) in CLOSED_FORM_MODELS
    except UnknownNameError:  # not a preset (another model's name, alias or dist:name)
        return False


def _memory_report(classes: list[dict[str, Any]], system: System) -> dict[str, Any]:
    peak = max(c["peak"] for c in classes)
    return {
        "predictor": "memory",
        "system": system.name,
        "capacity_bytes": system.hbm_capacity,
        "peak_bytes": peak,
        "fits": peak <= system.hbm_capacity,
        "classes": classes,
    }


@stg.hookimpl
def stg_register_predictors(register: Any) -> None:
    register(
        Predictor(
            name="memory",
            predict=predict_memory,
            predict_options=predict_memory_options,
            needs="options",
            description="analytical peak memory per rank: weights, gradients, optimizer "
            "states (ZeRO), activations (Korthikanti) and buffers",
        )
    )


__all__ = [
    "TORCH_CP_SOURCE",
    "RankMemory",
    "StageParameters",
    "TorchCPBuffers",
    "activation_bytes_per_layer",
    "analytic_memory",
    "closed_form_model",
    "closed_forms_apply",
    "count_parameters",
    "fp8_weight_copy_bytes",
    "gemm_weights_per_rank",
    "in_flight_layers",
    "in_flight_micro_batches",
    "model_state_bytes",
    "padded_shard",
    "planned_activation_delta",
    "predict_analytic",
    "predict_memory",
    "predict_memory_options",
    "recipe_weight_copy_bytes",
    "recipe_weight_dtype",
    "runs_natively",
    "runs_recipe",
    "runs_torch_cp",
    "stage_memory",
    "stated_weight_copy_bytes",
    "torch_cp_buffers",
    "total_parameters",
]
