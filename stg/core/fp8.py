"""Transformer Engine's delayed-scaling bookkeeping of fp8 GEMMs: which modules keep amax
histories, how big the buffers are, and what the reduction and the update move.

Facts (read from NVIDIA/TransformerEngine 2.x, ``transformer_engine/pytorch``; the same
logic is in 1.x ``fp8.py``):

- Each TE module with fp8 GEMMs (``Linear``, ``LayerNormLinear``, ``GroupedLinear``,
  ``DotProductAttention``) keeps a forward ``amax_history`` of shape ``(amax_history_len,
  3·num_gemms)`` (input, weight, output of each GEMM) and a backward one of shape
  ``(amax_history_len, 2·num_gemms)`` (grad_output, grad_input), fp32, and one fp32 scale per
  column (``module/base.py``, ``num_fp8_tensors``; docs ``fp8_delayed_scaling.rst``).
  ``num_gemms`` is 1 for a linear layer (Megatron fuses Q, K and V into one, and gate and up),
  the local experts for a grouped linear, 3 for DotProductAttention.
- Every module registers row 0 of its histories in one process-wide buffer per direction
  (``FP8GlobalStateManager.add_fp8_tensors_to_global_buffer``). A reduction
  (``reduce_and_update_fp8_tensors``) concatenates all of them (``torch.cat``), all-reduces
  the fp32 buffer with MAX over the amax reduction group (skipped when the group has one
  rank), then rolls every history and recomputes every scale in one fused multi-tensor kernel
  (``tex.fused_amax_and_scale_update_after_reduction``;
  ``common/recipe/delayed_scaling.cu``, ``kernel_bulk``).
- When (``quantization.py``, ``module/linear.py``, ``distributed.py``): forward, at the exit
  of the outermost ``autocast`` with gradients enabled (``autocast_exit``); Megatron-LM wraps a
  model chunk's whole transformer block in one autocast under delayed scaling
  (``transformer_block.py``, ``use_outer_quantization_context``): once per micro-batch and
  chunk. Backward, at the end of the backward of the first fp8 module of that autocast
  (``is_first_fp8_module``), i.e. when the chunk's backward is done: once per micro-batch and
  chunk. Under full recomputation (``te_checkpoint``, TE >= 2.3) the recompute forward of each
  checkpointed segment runs in its own autocast, so its exit reduces the forward buffer again,
  and each fp8 module recomputed there is marked first (the flag is restored in the recompute
  phase), so the backward of every such module reduces the backward buffer.
- Group: Megatron's ``get_amax_reduction_group(with_context_parallel=True)``, the
  tensor x data x context parallel ranks (``parallel_state.py``; passed as ``fp8_group`` by
  ``fp8_utils.get_fp8_context``); with ``--tp-only-amax-red`` the tensor x context parallel
  ranks. Never across pipeline stages.
- Weights (TE 2.9, ``module/linear.py`` and ``module/base.py`` ``get_weight_workspace``;
  ``tensor/float8_tensor.py``): the parameters stay bf16 (Megatron-LM's ``Float16Module``
  unless ``--fp8-param-gather``). A linear layer quantizes its weight with the
  delayed-scaling ``Float8Quantizer`` in the first micro-batch (Megatron passes
  ``is_first_microbatch``) and caches the ``Float8Tensor`` in ``_fp8_workspaces`` for the
  others: the fp8 data for the forward GEMM, its fp8 transpose for the input-gradient GEMM
  (columnwise usage; dropped where ``nvte_is_non_tn_fp8_gemm_supported``, sm100 to sm119 and
  sm130 up, kept on Hopper and Ada) and one fp32 ``scale_inv``. The memory predictor counts them
  (``Recipe.copy_bytes`` and ``Recipe.scale_bytes`` of :mod:`stg.core.recipes`' ``delayed``).
- Overlap: none. The all-reduce is synchronous (``reduce_tensor_across_group_op_max``,
  ``async_op=False``) and the update kernel that follows it reads its result, so the
  compute stream waits for it (TE's fp8 attention under context parallelism requires this
  reduction, ``reduce_amax``, and keeps its per-step amaxes local).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stg.core.symbolic import Dim, Op, Tensor

AMAX_HISTORY_DEFAULT = 1024
"""``DelayedScaling.amax_history_len``'s default (TE 1.x and 2.x; Megatron-LM's own default
is 1, its FP8 examples pass ``--fp8-amax-history-len 1024``)."""

FORWARD_TENSORS_PER_GEMM = 3
"""input, weight, output (TE ``module/base.py``)"""
BACKWARD_TENSORS_PER_GEMM = 2
"""grad_output, grad_input"""
DOT_PRODUCT_ATTENTION_GEMMS = 3
"""``DotProductAttention.init_fp8_metadata(num_gemms=3)``"""

AMAX_BYTES = 4
"""an amax, a history entry and a scale are fp32"""

AMAX_AXES = ("dp", "ep", "sp", "tp")
"""The amax reduction group: Megatron's tensor x data x context parallel group. stg's ``ep``
ranks are data-parallel ranks of the dense part (Megatron carves expert parallelism out of
data parallelism), ``sp`` is context parallelism."""
MODEL_PARALLEL_AMAX_AXES = ("sp", "tp")
"""Megatron's ``--tp-only-amax-red`` group: tensor x context parallel ranks."""

QUANTIZE_ATTR = "fp8_quantize"
"""Integer node attribute of an fp8 GEMM of a workload computing in fp8: the elements that
Transformer Engine casts and transposes into fp8 (with their amax) right before it, by a
kernel of their own (:func:`quantize_elements`); absent where a precision plan's cast nodes
do it or nothing is cast (the module's other GEMMs)."""
QUANTIZE_BYTES_PER_ELEMENT = 4
"""``cast_transpose``: one bf16 read (2 bytes), the fp8 copy and its transpose written
(1 + 1); the amax is reduced on the way (``common/transpose/cast_transpose.cu``)."""

AUTOCAST_DTYPE = "bf16"
"""The dtype of everything outside the fp8 GEMMs (``fp8_autocast`` inside bf16 autocast;
Megatron's ``--bf16``), and of the output layer."""
AUTOCAST_BYTES = 2

CONCAT = "fp8_amax_concat"
ALL_REDUCE = "fp8_amax_all_reduce"
UPDATE = "fp8_scale_update"
NODE_NAMES = (CONCAT, ALL_REDUCE, UPDATE)
"""Node names (the last path component) of one reduction: concatenation of the amaxes, the
all-reduce, the fused history and scale update."""


@dataclass(frozen=True)
class Fp8Module:
    """A Transformer Engine module with fp8 GEMMs: the forward einsums it runs (``ops``, by
    name) and its ``num_gemms``."""

    ops: frozenset[str]
    gemms: int


def _source(t: Tensor) -> int:
    """The tensor an operand was cast, gathered or viewed from (its identity)."""
    while t.producer is not None and (
        t.producer.kind in ("collective", "view") or ".cast_" in t.producer.name
    ):
        t = t.producer.inputs[0]
    t = t.storage or t
    return id(t.base or t)


def te_modules(
    forward: Iterable[Op], local_dim: Callable[[Dim, frozenset[str]], int], dtype: str = "fp8"
) -> tuple[Fp8Module, ...]:
    """The TE modules of a part's forward whose GEMMs run in ``dtype`` (fp8), in forward order.

    Einsums that read the same activation are one module (Megatron's fused QKV and gate/up
    linears); the attention core's einsums are one ``DotProductAttention`` (3 GEMMs); an
    einsum over local experts is a grouped linear of one GEMM per local expert."""
    groups: dict[object, list[Op]] = {}
    for op in forward:
        if op.kind != "einsum" or op.inputs[0].dtype != dtype:
            continue
        if "core_attention" in op.tags:
            group: object = "core_attention"
        else:
            group = tuple(sorted(_source(t) for t in op.inputs if t.kind != "weight"))
        groups.setdefault(group, []).append(op)
    modules = []
    for group, ops in groups.items():
        if group == "core_attention":
            names = frozenset(op.name for op in ops) | {"core_attention"}
            modules.append(Fp8Module(names, DOT_PRODUCT_ATTENTION_GEMMS))
            continue
        gemms = 1
        for op in ops:
            for t in op.inputs:
                if t.kind != "weight":
                    continue
                for d, axes in zip(t.dims, t.sharding.dims, strict=True):
                    if d.name == "experts":
                        gemms = max(gemms, local_dim(d, axes))
        modules.append(Fp8Module(frozenset(op.name for op in ops), gemms))
    return tuple(modules)


def amax_buffer_elements(gemms: int, backward: bool) -> int:
    """fp32 amaxes a reduction all-reduces for ``gemms`` fp8 GEMMs on a rank."""
    return gemms * (BACKWARD_TENSORS_PER_GEMM if backward else FORWARD_TENSORS_PER_GEMM)


def concat_bytes(elements: int) -> int:
    """``torch.cat`` of the amaxes into one buffer: each read and written once."""
    return 2 * AMAX_BYTES * elements


def update_bytes(elements: int, history: int) -> int:
    """What the fused update kernel moves per reduction: for each fp8 tensor it reads the
    reduced amax and ``history - 1`` history entries, writes ``history`` entries (the rolled
    history) and the new scale (``kernel_bulk``, ``delayed_scaling.cu``)."""
    return AMAX_BYTES * elements * (2 * history + 1)


def update_ops(elements: int, history: int) -> int:
    """One max per history entry and one division per scale."""
    return elements * (history + 1)


def quantize_elements(
    module: Fp8Module,
    forward: Iterable[Op],
    backward: Iterable[Op],
    numel: Callable[[Tensor], int],
) -> dict[str, int]:
    """Elements that Transformer Engine quantizes (cast, transpose, amax) right before the
    GEMMs of ``module``, by the name of the op that waits for them: the module's input before
    its first forward GEMM, and each forward GEMM's output gradient before the first backward
    GEMM of that op (this rank's rows, before a sequence-parallel gather). None where the
    input already comes from a cast (a precision plan's ``.cast_`` nodes price that) or for
    the attention core (bf16 unless ``fp8_dpa``)."""
    if "core_attention" in module.ops:
        return {}
    gemms = [op for op in forward if op.kind == "einsum" and op.name in module.ops]
    if not gemms:
        return {}
    activation = local_source(next(t for t in gemms[0].inputs if t.kind != "weight"))
    if activation.producer is not None and ".cast_" in activation.producer.name:
        return {}
    out = {gemms[0].name: numel(activation)}
    for op in gemms:
        first = next(
            (b for b in backward if b.kind == "einsum" and b.name.split(".grad_", 1)[0] == op.name),
            None,
        )
        read = {id(local_source(t)) for t in op.inputs}
        inputs = first.inputs if first else ()
        grads = [local_source(t) for t in inputs if id(local_source(t)) not in read]
        if grads:
            out[first.name] = numel(grads[0])  # type: ignore[union-attr]
    return out


def local_source(t: Tensor) -> Tensor:
    """The tensor a GEMM operand was gathered or viewed from: sequence parallelism gathers the
    rows that TE quantized locally, in fp8."""
    while t.producer is not None and t.producer.kind in ("collective", "view"):
        t = t.producer.inputs[0]
    return t


def _unviewed(t: Tensor) -> Tensor:
    """The tensor a GEMM operand is a view of (a gathered one stays gathered)."""
    while t.producer is not None and t.producer.kind == "view":
        t = t.producer.inputs[0]
    return t


@dataclass(frozen=True)
class QuantizeSite:
    """Where a recipe quantizes one GEMM operand: right before op ``before``, for the GEMMs
    ``consumers`` (op names), the bf16 ``tensor`` of ``rows x cols`` (``cols`` along the
    forward's reduction dimension)."""

    operand: str
    before: str
    consumers: tuple[str, ...]
    tensor: Tensor
    rows: int
    cols: int
    rescaled: int = 0
    """an output gradient's: the elements its backward GEMMs write (input and weight
    gradients), which a recipe that rescales them reads (:attr:`Recipe.rescales_backward`)"""
    copies: str = "both"
    """the copies cast here: ``both``, or ``rowwise`` (the forward's) or ``columnwise`` (the
    weight gradient's, cast in the backward from the kept bf16 input)"""


GemmShape = Callable[["Op"], tuple[int, int, int, int]]


def quantize_sites(
    module: Fp8Module,
    forward: Sequence[Op],
    backward: Sequence[Op],
    numel: Callable[[Tensor], int],
    shape: GemmShape,
    gathered: bool = True,
    input_copies_apart: bool = False,
) -> list[QuantizeSite]:
    """The operands a low-precision recipe (:mod:`stg.core.recipes`) quantizes for the GEMMs
    of ``module`` (a TE linear module of a training part computing in fp8, :func:`te_modules`):
    its input once, this
    rank's rows before a sequence-parallel gather (Megatron's fused QKV and gate/up read one
    input), or the gathered rows where the recipe gathers bf16 (``gathered`` false,
    :attr:`stg.core.recipes.Recipe.gathers_quantized`); each GEMM's weight as the GEMM reads
    it (gathered, under FSDP); each GEMM's output gradient before its first backward GEMM,
    with the elements of the input and weight gradients its backward GEMMs write. With
    ``input_copies_apart`` (torchao's linear, which keeps its bf16 input and casts it along
    the tokens in the backward) the input's rowwise copy is cast in the forward and its
    columnwise copy before the first weight-gradient GEMM that reads it. None for the
    attention core (bf16)."""
    source = local_source if gathered else _unviewed
    if "core_attention" in module.ops:
        return []
    gemms = [
        op
        for op in forward
        if op.kind == "einsum"
        and op.name in module.ops
        and any(t.kind == "weight" for t in op.inputs)  # a TE linear's GEMM, not an indexer's
    ]
    if not gemms:
        return []
    first = gemms[0]
    x = source(next(t for t in first.inputs if t.kind != "weight"))
    _, _, _, k = shape(first)
    rows = numel(x) // k
    consumers = tuple(g.name for g in gemms)
    if not input_copies_apart:
        sites = [QuantizeSite("input", first.name, consumers, x, rows, k)]
    else:
        sites = [QuantizeSite("input", first.name, consumers, x, rows, k, copies="rowwise")]
        names = set(consumers)
        kept = local_source(x)
        wgrads = [
            b.name
            for b in backward
            if b.kind == "einsum"
            and b.name.split(".grad_", 1)[0] in names
            and any(local_source(t) is kept for t in b.inputs)
        ]
        if wgrads:
            sites.append(
                QuantizeSite("input", wgrads[0], tuple(wgrads), x, rows, k, copies="columnwise")
            )
    for op in gemms:
        batch, m, n, k = shape(op)
        weight = next(t for t in op.inputs if t.kind == "weight")
        sites.append(QuantizeSite("weight", op.name, (op.name,), weight, numel(weight) // k, k))
        grads = [
            b for b in backward if b.kind == "einsum" and b.name.split(".grad_", 1)[0] == op.name
        ]
        if not grads:
            continue
        read = {id(local_source(t)) for t in op.inputs}
        dy = [source(t) for t in grads[0].inputs if id(local_source(t)) not in read]
        if dy:
            sites.append(
                QuantizeSite(
                    "grad_output",
                    grads[0].name,
                    tuple(b.name for b in grads),
                    dy[0],
                    numel(dy[0]) // n,
                    n,
                    batch * m * k + n * k,
                )
            )
    return sites


def native_fp8_gemms(ops: Iterable[Op]) -> frozenset[str]:
    """Names of the einsums of ``ops`` that compute in fp8 on operands that no precision plan
    cast (a workload computing in fp8 throughout)."""
    return frozenset(
        op.name
        for op in ops
        if op.kind == "einsum"
        and op.inputs[0].dtype == "fp8"
        and not any(t.producer is not None and ".cast_" in t.producer.name for t in op.inputs)
    )
