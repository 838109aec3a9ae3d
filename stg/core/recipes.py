"""Low-precision training recipes: the number format of the GEMMs of a ``--dtype fp8``
training run and how the scales of its operands are found (``--low_precision_recipe``).

A recipe quantizes the three operands of a linear layer, the input ``X``, the weight ``W``
and the output gradient ``dY``, each into two copies: the *rowwise* copy, scaled along the
reduction dimension of the forward (``Y = X·Wᵀ``) or input-gradient (``dX = dY·W``) GEMM,
and the *columnwise* copy for the other GEMM that reads it (``dW = dYᵀ·X`` reads ``X`` and
``dY`` along the token dimension; the input gradient reads ``W`` along its output
dimension). Transformer Engine calls these the two *usages* of a quantized tensor
(``transformer_engine/pytorch/tensor/quantized_tensor.py``, ``set_usage``); on Blackwell one
per-tensor scaled fp8 tensor serves both (:data:`NON_TN_FP8_GEMM_ARCHS`). Sources, by
recipe:

- ``delayed``: TE ``recipe.DelayedScaling`` (:mod:`stg.core.fp8` models it; the GEMM node
  carries the cast-transpose as ``fp8_quantize``): one fp32 scale per tensor from the amax
  history, so the cast needs no pass of its own to find it. Its weight copies are
  ``tensorwise``'s (both are ``Float8Tensor``: the fp8 data, its transpose, one fp32
  ``scale_inv``; :mod:`stg.core.fp8`).
- ``tensorwise``: TE ``recipe.Float8CurrentScaling`` (``Float8CurrentScalingQuantizer``:
  ``nvte_compute_amax``, then ``nvte_compute_scale_from_amax``, then the cast-transpose), as
  torchao's ``Float8LinearConfig`` ``tensorwise`` recipe: one fp32 scale per tensor from the
  tensor's own amax, found by a reduction over the whole tensor before the cast (the input is
  read twice).
- ``rowwise``: torchao's float8 ``rowwise`` recipe (``Float8LinearRecipeName.ROWWISE``:
  axiswise scaling of every GEMM operand along its reduction dimension, fp32 scales, rounded
  down to powers of two), as torchtitan compiles it (torchao 0.18
  ``float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``; ``float8_ops.py``,
  ``addmm_float8_unwrapped``; docs/notes/torchao-float8-linear.md):

  - each copy is its own compiled kernel that finds the scales along its axis and casts, one
    read of the bf16 tensor each (``hp_tensor_to_float8_dynamic`` with ``axiswise_dim`` -1
    for the rowwise copy, 0 for the columnwise one, the latter in the backward from the
    kept bf16 input, :attr:`Recipe.keeps_bf16_input`): ``cast`` and ``columnwise_cast``;
  - the input-gradient and weight-gradient GEMMs run without fast accumulation
    (``Float8LinearConfig``: ``gemm_config_grad_input`` and ``gemm_config_grad_weight``
    default to ``use_fast_accum=False``), which ``addmm_float8_unwrapped`` runs as the
    tensorwise cuBLAS GEMM with unit scales followed by ``output *= a_inverse_scale *
    b_inverse_scale``: a ``rescale`` kernel over both outputs (:data:`RESCALE_BYTES`);
  - torchtitan gathers a sequence-parallel input in bf16 for this recipe (its float8
    tensor-parallel styles take tensorwise scaling only: ``enable_float8_tensorwise_tp``
    in ``parallelize.py``), so the casts read the gathered rows
    (:attr:`Recipe.gathers_quantized`).
- ``blockwise``: DeepSeek-V3 technical report (arXiv 2412.19437), section 3.3.2: activations
  and gradients in 1x128 tiles, weights in 128x128 blocks, one fp32 scale each, as TE's
  ``recipe.Float8BlockScaling`` runs it (``x_block_scaling_dim=1``, ``w_block_scaling_dim=2``,
  block length 128; ``quantize_transpose_vector_blockwise``,
  ``quantize_transpose_square_blockwise``): a block's amax is found in the kernel that casts
  it, both copies from one read.
- ``mxfp8``: OCP Microscaling Formats (MX) Specification v1.0 (2023), section 5: 32-element
  blocks with one E8M0 (8-bit) scale, E4M3 elements; TE ``recipe.MXFP8BlockScaling``, whose
  ``quantize_mxfp8`` kernel writes the rowwise and columnwise copies from one read; weights
  use the same 1x32 blocks along each copy's reduction dimension.
- ``nvfp4``: NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149),
  section 4: E2M1 elements with one E4M3 scale per 16 elements and one fp32 scale per tensor;
  activations and gradients in 1x16 blocks, weights in 16x16 blocks (2D, so both copies share
  one block grid); a 16x16 random Hadamard transform (RHT) on the inputs of the
  weight-gradient GEMM (the columnwise copies of ``X`` and ``dY``); stochastic rounding (SR) of
  the gradients. As Transformer Engine 2.9 runs it (``recipe.NVFP4BlockScaling``:
  ``fp4_quant_fwd_inp`` RHT, ``fp4_quant_fwd_weight`` 2D, ``fp4_quant_bwd_grad`` RHT and SR;
  ``NVFP4Quantizer::quantize_impl`` in ``pytorch/csrc/quantizer.cpp``):

  - the per-tensor amax is a reduction over the whole tensor before the cast
    (``nvte_compute_amax``); with the RHT, ``nvte_hadamard_transform_amax`` finds the amax of
    the input and that of the transformed transpose in that one read, the transform on tensor
    cores (``wmma`` m16n16k16 bf16);
  - without the RHT one kernel writes both copies from one read (``nvte_quantize_v2``); with it
    the rowwise copy is cast alone, and the columnwise copy by a second kernel that reads the
    input again, transforms it on tensor cores and casts it
    (``nvte_hadamard_transform_cast_fusion_columnwise``) where the input is bf16 of rows a
    multiple of 64 and columns a multiple of 128, or else by the transform alone
    (``nvte_hadamard_transform``, writing a bf16 transposed copy) and a cast of that copy;
  - stochastic rounding rounds four elements with one 32-bit random word
    (``cvt.rs.satfinite.e2m1x4.f32``) drawn from Philox4x32-10 (cuRANDDx, ``PhiloxRounds<10>``;
    ``util/nvfp4_transpose.cuh``, ``hadamard_transform_cast_fusion.cu``): its cost is the
    random-number generation, integer ops in the casts, no bytes;
  - the 2D weight scales are stored as 1D ones, one E4M3 per 1x16 of each copy, the 16 rows of
    a block holding the same value (``NVFP4Quantizer::get_scale_shape`` does not depend on
    ``with_2d_quantization``; ``nvfp4_transpose_kernel_2D`` writes ``cols / 16`` scales per
    row), so 2D scaling moves the bytes of 1D scaling;
  - ``NVTE_NVFP4_DISABLE_RHT`` and ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING`` (the recipe's
    ``disable_rht``, ``disable_stochastic_rounding``) turn the RHT and SR off:
    :func:`training_recipe`.

  The GEMMs run at the system's fp4 peak.

Every quantize kernel reads the 16-bit input and writes what the recipe's definition says
(elements and scales), so its bytes follow from the tensor's rows and columns alone
(:func:`quantize_kernels`). A weight is quantized in the first micro-batch of an iteration
and its copies reused after (TE's ``is_first_microbatch``, passed by Megatron-LM). What a
linear layer keeps of its input for the backward is :meth:`Recipe.saved_input_bytes`.

Layers kept in bf16 (``--first_last_layers_bf16``): Megatron-LM (``--first-last-layers-bf16``,
``--num-layers-at-start-in-bf16``, ``--num-layers-at-end-in-bf16``, defaults off, 1 and 1;
``megatron/training/arguments.py`` and ``megatron/core/fp8_utils.py``
``is_first_last_bf16_layer`` at core_v0.15.0) runs the first and last layers of the stack
outside the quantization context, as the NVFP4 paper keeps a few blocks, mostly the last ones,
in BF16 (arXiv 2509.25149, section 4.1). Megatron refuses it under delayed scaling (its layers
then share one autocast, ``transformer_config.py``). Such a layer is a block kind of its own,
:func:`bf16_kind` of the model's, built in bf16 (:func:`split_bf16_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from stg.core.quantization import DTYPE_BITS
from stg.errors import UserError

DEFAULT_RECIPE = "delayed"

RECIPE_ATTR = "low_precision_recipe"
"""String attribute of the GEMM and quantize nodes of a recipe other than ``delayed``: the
recipe's name (it decides the tensor cores a GEMM needs)."""
QUANTIZE_KERNEL_ATTR = "quantize_kernel"
"""String attribute of a recipe's quantize node: ``amax`` (a reduction that finds the scales
before the cast), ``cast`` (writes the quantized copies and their scales; only the rowwise copy
where the recipe transforms the columnwise one or casts it apart), ``columnwise_cast`` (finds
the scales of the columnwise copy and writes it: :attr:`Recipe.axiswise_casts`), ``hadamard``
(the transform alone, writing a bf16 transposed copy), ``hadamard_cast`` (writes the
transformed columnwise copy and its scales, transforming it on the way unless a ``hadamard``
kernel did) or ``rescale`` (scales the outputs of the backward GEMMs,
:attr:`Recipe.rescales_backward`)."""
QUANTIZE_COLS_ATTR = "quantize_cols"
"""Integer attribute of the amax and cast nodes of torchao's recipes (``tensorwise``,
``rowwise``): the columns of the quantized tensor (along the forward's reduction dimension),
on which the rate of a cast that ``torch.compile`` builds depends
(:data:`stg.perf.kernel_time.COMPILED_CAST_ELEMENTS_PER_SM_CLOCK`)."""
RESCALE_BYTES = 2 + 2 + 4 + 4
"""Bytes per output element of torchao's rescale of a GEMM run with unit scales
(``output *= a_inverse_scale * b_inverse_scale``): the bf16 output read and written, and
the fp32 outer product of the two scale vectors written and read, which inductor builds apart
from the product since the GEMM between them is an extern kernel. The H100 measurement
(tests/data/kernels/h100-float8-linear.jsonl less the bare GEMMs and casts of
h100-gemm-graph.jsonl) leaves 1.9 ms for Llama 3 8B's ``wq`` (a [98304, 4096] input
gradient): 12 bytes per element at the streaming 2.98 TB/s are 1.6 ms, 4 bytes (a fused
multiply) 0.5 ms (docs/notes/torchao-float8-linear.md)."""
HADAMARD_FLOPS_ATTR = "hadamard_flops"
"""Integer attribute of a quantize node that runs a Hadamard transform: the FLOPs of it among
``num_ops``, which Transformer Engine runs on tensor cores."""
QUANTIZE_OPERAND_ATTR = "quantize_operand"
"""String attribute of a recipe's quantize node: the GEMM operand it quantizes, ``input``,
``weight`` or ``grad_output`` (a weight's copies are cached after the first micro-batch)."""
OPERANDS = ("input", "weight", "grad_output")

HADAMARD_FLOPS_PER_ELEMENT = 2 * 16
"""A 16-point random Hadamard transform is a dense 16x16 matrix product per 16 elements: 16
multiply-adds per element (arXiv 2509.25149, section 4.2)."""
FUSED_HADAMARD_ROWS, FUSED_HADAMARD_COLS = 64, 128
"""Transformer Engine 2.9 transforms and casts a columnwise copy in one kernel where the bf16
input's rows are a multiple of 64 and its columns of 128 (``quantizer.cpp``,
``eligible_for_rht_cast_fusion``)."""
PHILOX_ROUNDS = 10
"""Rounds of the Philox4x32 generator that stochastic rounding draws from (TE 2.9:
``curanddx::PhiloxRounds<10>``)."""
PHILOX_ROUND_OPS = 10
"""Integer ops of one Philox4x32 round: two 32x32-bit multiplies each giving a high and a low
word (four instructions), four XORs and the two-word key bump (Salmon et al., "Parallel Random
Numbers: As Easy as 1, 2, 3", SC 2011: Philox; Random123's ``philox4x32round``)."""
ELEMENTS_PER_PHILOX = 4 * 4
"""Elements rounded with one Philox4x32 call: four 32-bit words, one per four elements
(``cvt.rs.satfinite.e2m1x4.f32``; TE 2.9 ``nvfp4_transpose.cuh``, ``get_rbits``)."""

SOURCE_BYTES = 2
"""The quantized tensors are bf16 before the cast (the autocast dtype, :mod:`stg.core.fp8`)."""

NON_TN_FP8_GEMM_ARCHS = frozenset({"blackwell"})
"""Architectures whose fp8 GEMMs read an operand in either layout, so that one per-tensor
scaled fp8 tensor serves both usages: Transformer Engine's ``is_non_tn_fp8_gemm_supported``
(compute capability 10.x, 11.x or 13.0 and up; stg's ``blackwell`` systems are B200, B300,
GB200 and GB300, 10.0 and 10.3; the RTX parts, 12.x, are not among them). There TE's
``Float8Quantizer`` and ``Float8CurrentScalingQuantizer`` write no transpose
(``pytorch/csrc/quantizer.cpp``, ``with_transpose = columnwise_usage &&
!nvte_is_non_tn_fp8_gemm_supported()``) and ``Float8TensorStorage.update_usage`` drops it, at
v2.9 (70f5366) and v2.18 (27486e0); TE docs, low_precision_training/fp8_current_scaling,
"Transpose handling": "The rowwise and columnwise tensors share the same physical memory
layout". Block scales are laid along one dimension, so a block-scaled tensor keeps both
copies everywhere (TE docs, mxfp8 and nvfp4, "Handling transposes"; blockwise on Blackwell
keeps its two fp8 copies and converts only their scales to MXFP8's for each GEMM,
``convert_block_scaling_to_mxfp8_tensor`` in ``pytorch/csrc/extensions/gemm.cpp``)."""


@dataclass(frozen=True)
class Blocks:
    """The scale grid of a quantized copy: one scale per ``rows x cols`` block, ``cols`` along
    the copy's reduction dimension (``cols`` 0: a whole row); ``None`` in place of a
    :class:`Blocks` means one scale for the whole tensor."""

    rows: int
    cols: int

    def count(self, rows: int, cols: int) -> int:
        """Scales of a copy of ``rows`` rows whose reduction dimension holds ``cols``."""
        along = -(-cols // self.cols) if self.cols else 1
        return -(-rows // self.rows) * along


@dataclass(frozen=True)
class Recipe:
    """A low-precision training recipe (see the module docstring)."""

    name: str
    dtype: str
    """the GEMM operands' element dtype (fp8 E4M3/E5M2, fp4 E2M1)"""
    activation: Blocks | None
    """scale blocks of the input and output-gradient copies (None: one per tensor)"""
    weight: Blocks | None
    """scale blocks of the weight copies"""
    scale_bits: int
    tensor_scale_bits: int = 0
    """a second-level scale per copy (NVFP4's fp32 tensor scale)"""
    amax_reads: int = 0
    """full reads of the input by reductions that find scales before the cast: one per tensor
    amax, one per axis of axiswise scaling (0: found in the casting kernel)"""
    cast_reads: int = 1
    """reads of the input by the casts (1: one kernel writes both copies)"""
    hadamard: bool = False
    """a random Hadamard transform on the weight-gradient GEMM's inputs"""
    stochastic_rounding: bool = False
    """the output gradient's copies are rounded stochastically"""
    tp_amax_reduction: bool = False
    """the tensor amax of a sequence-parallel input or output gradient is all-reduced (MAX)
    over the tensor-parallel group before the cast, so that every rank scales its rows alike
    (TE ``module/linear.py``, ``_customize_quantizers_float8_current_scaling`` and
    ``_customize_quantizers_nvfp4``: ``with_amax_reduction`` on the input quantizer of a
    column-parallel and the output-gradient quantizer of a row-parallel linear)"""
    keeps_bf16_input: bool = False
    """a linear layer keeps its bf16 input for the backward and quantizes it again there
    (torchao's float8 linear, ``matmul_with_hp_or_float8_args.forward``:
    ``ctx.save_for_backward(input_hp, weight_hp_t)``, pytorch/ao at 7ca1bfb); otherwise
    Transformer Engine keeps a quantized copy instead (:meth:`saved_input_bytes`)"""
    gathers_quantized: bool = True
    """a sequence-parallel all-gather of a GEMM input (or a row-parallel GEMM's output
    gradient) moves the quantized rows, cast on this rank's rows before it (Transformer
    Engine; torchtitan's float8 tensor parallelism under tensorwise scaling); otherwise the
    gather moves bf16 and the linear casts the gathered rows (torchtitan under rowwise)"""
    axiswise_casts: bool = False
    """each copy is cast by a kernel of its own that finds its scales along its axis (torchao
    compiled by inductor): ``cast`` and ``columnwise_cast``, one read each, at the measured
    rate of such compiled casts"""
    rescales_backward: bool = False
    """the backward GEMMs run with unit scales and a ``rescale`` kernel multiplies their
    outputs by the scales (torchao's axiswise GEMMs without fast accumulation)"""
    torchao: bool = False
    """torchao's float8 linear runs this recipe too (``Float8LinearRecipeName``; torchtitan's
    float8 converter): under ``torch.compile`` inductor builds its casts, whose nodes carry
    :data:`QUANTIZE_COLS_ATTR`; the other recipes are Transformer Engine's kernels alone"""
    gathered_norm_output_copies: int = 1
    """quantized copies of a fused norm-and-linear's norm output (the QKV and MLP inputs) that
    TE keeps for the backward where sequence parallelism gathers it: TE 2.9
    ``module/layernorm_linear.py`` drops the rowwise usage only of MXFP8 and blockwise
    tensors or without the gather, and quantizes tensor-scaled fp8 in the rowwise usage alone
    for the gather, so NVFP4 keeps both"""

    @property
    def element_bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    def blocks(self, operand: str) -> Blocks | None:
        return self.weight if operand == "weight" else self.activation

    def copy_bytes(self, rows: int, cols: int) -> int:
        """Bytes of the two quantized copies (rowwise and columnwise) of a tensor."""
        return 2 * -(-rows * cols * self.element_bits // 8)

    def copy_scale_bytes(self, operand: str, rows: int, cols: int, *, columnwise: bool) -> int:
        """Bytes of the block scales and the second-level tensor scale of one copy of
        ``operand`` (a recipe that casts its copies apart: block scales, :attr:`hadamard`)."""
        blocks = self.blocks(operand)
        assert blocks is not None
        scales = blocks.count(cols, rows) if columnwise else blocks.count(rows, cols)
        return -(-scales * self.scale_bits // 8) + self.tensor_scale_bits // 8

    def scale_bytes(self, operand: str, rows: int, cols: int) -> int:
        """Bytes of the scales of both copies of ``operand`` of ``rows x cols`` (``cols``
        along the forward's reduction dimension): a per-tensor scale is shared by both copies
        (TE's ``scale_inv``); block scales are kept per copy, the columnwise copy's blocks
        running along the rows."""
        blocks = self.blocks(operand)
        if blocks is None:
            scales = 1
        else:
            scales = blocks.count(rows, cols) + blocks.count(cols, rows)
        tensor = 2 * self.tensor_scale_bits // 8
        return -(-scales * self.scale_bits // 8) + tensor

    def gathered_bytes(self, operand: str, rows: int, cols: int) -> int:
        """Bytes of the rowwise copy of ``operand`` and its block scales, as a sequence-parallel
        all-gather moves this rank's quantized rows (Transformer Engine gathers the quantized
        tensor, ``gather_along_first_dim``; a per-tensor scale is known on every rank)."""
        data = -(-rows * cols * self.element_bits // 8)
        blocks = self.blocks(operand)
        if blocks is None:
            return data
        return data + -(-blocks.count(rows, cols) * self.scale_bits // 8)

    def shares_usages(self, arch: str | None) -> bool:
        """Whether one quantized tensor serves both usages on a GPU of ``arch``: per-tensor
        scaled fp8 on an architecture of :data:`NON_TN_FP8_GEMM_ARCHS` (``None``: a GPU whose
        fp8 GEMMs take the TN layout alone, as Hopper's)."""
        return self.dtype == "fp8" and self.weight is None and arch in NON_TN_FP8_GEMM_ARCHS

    def cached_weight_copies(self, *, param: bool = False, arch: str | None = None) -> int:
        """Quantized copies of a weight's elements a rank caches besides its stored weight:
        the rowwise and the columnwise copy, or one where they are one tensor
        (:meth:`shares_usages`); with ``param`` (fp8 weights) the stored weight is the rowwise
        copy and is not counted."""
        copies = 1 if self.shares_usages(arch) else 2
        return copies - 1 if param else copies

    def weight_bytes_per_element(self, *, param: bool = False, arch: str | None = None) -> float:
        """:func:`weight_copy_bytes` per weight element where the weight's dimensions divide
        its blocks, less the scales that do not grow with the elements (one per tensor, one
        per row: about 0.1 % of the copies of a 4096 x 4096 weight), on a GPU of ``arch``
        (:meth:`cached_weight_copies`)."""
        copies = self.cached_weight_copies(param=param, arch=arch) * self.element_bits / 8
        blocks = self.weight
        if blocks is None or not blocks.cols:
            return copies
        return copies + 2 * self.scale_bits / 8 / (blocks.rows * blocks.cols)

    def saved_input_bytes(self, copies: int = 1) -> float:
        """Bytes per element of a linear layer's input kept from the forward for its
        weight-gradient GEMM: the bf16 input where :attr:`keeps_bf16_input`, else ``copies``
        quantized copies of it with their block scales, and not the bf16 input (TE 2.9
        ``module/linear.py``: ``inputmat.update_usage(rowwise_usage=False,
        columnwise_usage=True)``, or the rowwise usage alone for tensor-scaled fp8 gathered
        by sequence parallelism; ``module/grouped_linear.py`` likewise). An activation
        block's scales are as many in the columnwise copy (its blocks run along the tokens);
        a per-tensor scale is left out."""
        if self.keeps_bf16_input:
            return SOURCE_BYTES
        per_copy = self.element_bits / 8
        blocks = self.activation
        if blocks is not None and blocks.cols:
            per_copy += self.scale_bits / 8 / (blocks.rows * blocks.cols)
        return copies * per_copy

    def transformed(self, operand: str) -> bool:
        """Whether the columnwise copy of ``operand`` is Hadamard-transformed (it feeds the
        weight-gradient GEMM: the input and the output gradient)."""
        return self.hadamard and operand != "weight"

    def rounds_stochastically(self, operand: str) -> bool:
        """Whether the copies of ``operand`` are rounded stochastically (the gradients)."""
        return self.stochastic_rounding and operand == "grad_output"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("delayed", "fp8", None, None, scale_bits=32),
        Recipe(
            "tensorwise",
            "fp8",
            None,
            None,
            scale_bits=32,
            amax_reads=1,
            tp_amax_reduction=True,
            torchao=True,
        ),
        Recipe(
            "rowwise",
            "fp8",
            Blocks(1, 0),
            Blocks(1, 0),
            scale_bits=32,
            keeps_bf16_input=True,
            gathers_quantized=False,
            axiswise_casts=True,
            rescales_backward=True,
            torchao=True,
        ),
        Recipe("blockwise", "fp8", Blocks(1, 128), Blocks(128, 128), scale_bits=32),
        Recipe("mxfp8", "fp8", Blocks(1, 32), Blocks(1, 32), scale_bits=8),
        Recipe(
            "nvfp4",
            "fp4",
            Blocks(1, 16),
            Blocks(1, 16),  # 16x16 values, stored per 1x16 (module docstring)
            scale_bits=8,
            tensor_scale_bits=32,
            amax_reads=1,
            hadamard=True,
            stochastic_rounding=True,
            tp_amax_reduction=True,
            gathered_norm_output_copies=2,
        ),
    )
}
"""The recipes by the name ``--low_precision_recipe`` gives them."""


def training_recipe(
    name: str, *, disable_rht: bool = False, disable_stochastic_rounding: bool = False
) -> Recipe:
    """The recipe ``name`` with the random Hadamard transform and stochastic rounding turned
    off where asked, as Transformer Engine's ``NVTE_NVFP4_DISABLE_RHT`` and
    ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING`` do (``recipe.NVFP4BlockScaling``)."""
    recipe = RECIPES[name]
    return replace(
        recipe,
        hadamard=recipe.hadamard and not disable_rht,
        stochastic_rounding=recipe.stochastic_rounding and not disable_stochastic_rounding,
    )


@dataclass(frozen=True)
class QuantizeKernel:
    """One memory-bound kernel of a recipe's quantization of one tensor."""

    kind: str
    """``amax``, ``cast``, ``columnwise_cast``, ``hadamard``, ``hadamard_cast`` or
    ``rescale`` (:data:`QUANTIZE_KERNEL_ATTR`)"""
    tensor_size: int
    """bytes read and written"""
    num_ops: int
    hadamard_flops: int = 0
    """the Hadamard transform's FLOPs among ``num_ops`` (on tensor cores)"""
    cols: int = 0
    """the quantized tensor's columns where torchao runs the recipe
    (:data:`QUANTIZE_COLS_ATTR`; 0: Transformer Engine's kernels alone)"""


def random_bit_ops(elements: int) -> int:
    """Integer ops of the Philox4x32-10 calls that round ``elements`` stochastically."""
    return -(-elements // ELEMENTS_PER_PHILOX) * PHILOX_ROUNDS * PHILOX_ROUND_OPS


def fused_hadamard_cast(rows: int, cols: int) -> bool:
    """Whether Transformer Engine transforms and casts the columnwise copy of a bf16 tensor of
    ``rows x cols`` in one kernel (:data:`FUSED_HADAMARD_ROWS`)."""
    return rows % FUSED_HADAMARD_ROWS == 0 and cols % FUSED_HADAMARD_COLS == 0


def quantize_kernels(
    recipe: Recipe,
    operand: str,
    rows: int,
    cols: int,
    rescaled: int = 0,
    copies: str = "both",
) -> list[QuantizeKernel]:
    """The kernels that quantize a bf16 ``operand`` of ``rows x cols`` (``cols`` along the
    forward's reduction dimension) into the recipe's two copies, in their order: a reduction
    reading the input per :attr:`Recipe.amax_reads` (none for ``delayed`` and block scalings),
    then the cast, which reads it per :attr:`Recipe.cast_reads` and writes both copies and
    their scales. Where the recipe transforms the columnwise copy (:meth:`Recipe.transformed`),
    the amax pass transforms it too, the cast writes the rowwise copy alone and a
    ``hadamard_cast`` kernel (after a ``hadamard`` one where :func:`fused_hadamard_cast` does
    not hold) the columnwise copy. Where the recipe casts each copy apart
    (:attr:`Recipe.axiswise_casts`), a ``cast`` writes the rowwise copy and a
    ``columnwise_cast`` the columnwise one, each reading the input (only the one ``copies``
    names where it is ``rowwise`` or ``columnwise``); with
    :attr:`Recipe.rescales_backward`, an output gradient's kernels end with the ``rescale`` of
    the ``rescaled`` output elements of its backward GEMMs (:data:`RESCALE_BYTES` each). One
    op per element read, the transform's multiply-adds (:attr:`QuantizeKernel.hadamard_flops`)
    and stochastic rounding's random-number generation (:func:`random_bit_ops`, per copy
    written)."""
    elements = rows * cols
    read = SOURCE_BYTES * elements
    if recipe.axiswise_casts:
        copy = recipe.copy_bytes(rows, cols) // 2
        kernels = [
            QuantizeKernel(
                kind,
                read + copy + recipe.copy_scale_bytes(operand, rows, cols, columnwise=columnwise),
                elements,
                cols=cols,
            )
            for kind, columnwise in (("cast", False), ("columnwise_cast", True))
            if copies == "both" or (copies == "columnwise") == columnwise
        ]
        if recipe.rescales_backward and rescaled:
            kernels.append(QuantizeKernel("rescale", RESCALE_BYTES * rescaled, rescaled))
        return kernels
    transformed = recipe.transformed(operand)
    hadamard = HADAMARD_FLOPS_PER_ELEMENT * elements if transformed else 0
    rounding = random_bit_ops(elements) if recipe.rounds_stochastically(operand) else 0
    kernels = []
    torchao = cols if recipe.torchao else 0
    if recipe.amax_reads:
        kernels.append(
            QuantizeKernel(
                "amax",
                recipe.amax_reads * read,
                recipe.amax_reads * elements + hadamard,
                hadamard,
                torchao,
            )
        )
    if not transformed:
        written = recipe.copy_bytes(rows, cols) + recipe.scale_bytes(operand, rows, cols)
        kernels.append(
            QuantizeKernel(
                "cast",
                recipe.cast_reads * read + written,
                recipe.cast_reads * elements + 2 * rounding,
                cols=torchao,
            )
        )
        return kernels
    copy = recipe.copy_bytes(rows, cols) // 2
    rowwise = copy + recipe.copy_scale_bytes(operand, rows, cols, columnwise=False)
    columnwise = copy + recipe.copy_scale_bytes(operand, rows, cols, columnwise=True)
    kernels.append(QuantizeKernel("cast", read + rowwise, elements + rounding))
    if fused_hadamard_cast(rows, cols):
        kernels.append(
            QuantizeKernel(
                "hadamard_cast", read + columnwise, elements + hadamard + rounding, hadamard
            )
        )
    else:
        kernels.append(QuantizeKernel("hadamard", 2 * read, hadamard, hadamard))
        kernels.append(QuantizeKernel("hadamard_cast", read + columnwise, elements + rounding))
    return kernels


def weight_copy_bytes(recipe: Recipe, rows: int, cols: int, *, param: bool = False) -> int:
    """Bytes a rank keeps per weight of ``rows x cols`` besides its stored weight: both
    quantized copies and their scales (cached across the micro-batches of an iteration), or
    with ``param`` (fp8 weights, :data:`PARAM_GATHER_RECIPES`) the scales and the columnwise
    copy alone, the rowwise copy being the stored weight. These are the copies of a GPU whose
    fp8 GEMMs take the TN layout alone (Hopper); where one copy serves both usages
    (:meth:`Recipe.shares_usages`) a rank keeps :meth:`Recipe.cached_weight_copies` of them."""
    copies = recipe.copy_bytes(rows, cols) // (2 if param else 1)
    return copies + recipe.scale_bytes("weight", rows, cols)


def cached_weight_bytes(
    recipe: Recipe, rows: int, cols: int, *, param: bool = False, arch: str | None = None
) -> int:
    """:func:`weight_copy_bytes` as a rank of a GPU of ``arch`` keeps them: the
    :meth:`Recipe.cached_weight_copies` of the weight's elements and all its scales. Where one
    per-tensor scaled fp8 tensor serves both usages (:meth:`Recipe.shares_usages`: TE's
    ``Float8Tensor`` on sm100 keeps no transpose, ``Float8TensorStorage.update_usage``) its one
    fp32 ``scale_inv`` stays whole; the stored fp8 weight (``param``) is that tensor, so it
    caches no copy but its scale."""
    copies = recipe.cached_weight_copies(param=param, arch=arch)
    return copies * (recipe.copy_bytes(rows, cols) // 2) + recipe.scale_bytes("weight", rows, cols)


PARAM_GATHER_RECIPES = ("tensorwise", "blockwise", "mxfp8")
"""Recipes whose weights Megatron-LM keeps in fp8 and all-gathers in fp8
(``--fp8-param-gather`` with ``--fp8-recipe`` tensorwise, blockwise or mxfp8; torchtitan's
fp8 FSDP all-gather, ``enable_fsdp_float8_all_gather``, takes tensorwise only). The gather
moves the rowwise copy and its scales."""

FP8_ATTENTION_SCALING: dict[str, str] = {
    "delayed": "fp8",
    "tensorwise": "fp8",
    "mxfp8": "mxfp8",
    "nvfp4": "fp8",
}
"""The recipes under which Transformer Engine runs its fused attention in fp8 (``fp8_dpa``),
and the scaling of that attention: per-tensor under delayed scaling (TE pull request #768, TE
1.6) and current scaling (#2012, TE 2.8), block-scaled MXFP8 under ``MXFP8BlockScaling``
(#2719, 2026-04), and per-tensor current scaling under ``NVFP4BlockScaling``, which takes
``fp8_dpa`` with ``NVTE_DPA_FP8_RECIPE=Float8CurrentScaling`` (NVIDIA-NeMo/Megatron-Bridge pull
request #5394). torchao's ``rowwise`` and the ``blockwise`` recipe have no fp8 attention."""

FP8_ATTENTION_CAST_KERNELS = 4
"""Cast kernels around an fp8 attention node: forward Q, K and V in and the output out,
backward the output gradient in and dQ, dK and dV out (Transformer Engine's fp8 DPA without
``fp8_mha``: "cast BF16 input to FP8, FP8 DPA, cast output to BF16", TE pull request #768)."""


def gathered_weight_bytes(recipe: Recipe, elements: int) -> int:
    """Bytes of ``elements`` weight elements all-gathered in the recipe's format: the
    elements and, for block scales, one scale per block (a per-tensor scale is found by an
    amax all-reduce of its own, left out)."""
    data = -(-elements * recipe.element_bits // 8)
    blocks = recipe.weight
    if blocks is None or not blocks.cols:
        return data
    return data + -(-elements * recipe.scale_bits // (8 * blocks.rows * blocks.cols))


BF16_KIND_SUFFIX = "_bf16"
"""The block kind of a layer kept in bf16 is the model's kind with this suffix."""

Function = TypeVar("Function")


def bf16_kind(kind: str) -> str:
    """The block kind of a layer of ``kind`` kept in bf16."""
    return kind + BF16_KIND_SUFFIX


def model_kind(kind: str) -> tuple[str, bool]:
    """The model's block kind of a layer kind, and whether the layer is kept in bf16
    (:func:`bf16_kind`)."""
    if kind.endswith(BF16_KIND_SUFFIX):
        return kind[: -len(BF16_KIND_SUFFIX)], True
    return kind, False


def split_bf16_layers(
    runs: Sequence[tuple[str, Function, int]], first: int, last: int
) -> tuple[tuple[str, Function, int], ...]:
    """The runs ``(kind, block function, count)`` of a stack with its first ``first`` and last
    ``last`` layers as runs of :func:`bf16_kind` (same block function): a layer of global
    index ``i`` of ``L`` when ``i < first`` or ``i >= L - last``. Unchanged for (0, 0)."""
    if not first and not last:
        return tuple(runs)
    if not runs:
        raise UserError(
            "first_last_layers_bf16: the model has no layer stack whose first and last layers "
            "could be kept in bf16 (leave it off)"
        )
    for kind, _, _ in runs:
        if model_kind(kind)[1]:
            raise UserError(
                f"first_last_layers_bf16: the model's block kind {kind!r} ends in "
                f"{BF16_KIND_SUFFIX!r}, which names the layers kept in bf16"
            )
    total = sum(count for _, _, count in runs)
    out: list[tuple[str, Function, int]] = []
    start = 0
    for kind, function, count in runs:
        head = min(max(first - start, 0), count)  # layers [0, head) of the run: the first ones
        tail = min(max(total - last - start, head), count)  # [tail, count): the last ones
        for name, n in (
            (bf16_kind(kind), head),
            (kind, tail - head),
            (bf16_kind(kind), count - tail),
        ):
            if not n:
                continue
            if out and out[-1][0] == name:
                out[-1] = (name, function, out[-1][2] + n)
            else:
                out.append((name, function, n))
        start += count
    return tuple(out)


__all__ = [
    "BF16_KIND_SUFFIX",
    "DEFAULT_RECIPE",
    "FP8_ATTENTION_CAST_KERNELS",
    "FP8_ATTENTION_SCALING",
    "HADAMARD_FLOPS_ATTR",
    "NON_TN_FP8_GEMM_ARCHS",
    "OPERANDS",
    "PARAM_GATHER_RECIPES",
    "QUANTIZE_COLS_ATTR",
    "QUANTIZE_KERNEL_ATTR",
    "QUANTIZE_OPERAND_ATTR",
    "RECIPES",
    "RECIPE_ATTR",
    "RESCALE_BYTES",
    "Blocks",
    "QuantizeKernel",
    "Recipe",
    "bf16_kind",
    "cached_weight_bytes",
    "gathered_weight_bytes",
    "model_kind",
    "quantize_kernels",
    "split_bf16_layers",
    "training_recipe",
    "weight_copy_bytes",
]
