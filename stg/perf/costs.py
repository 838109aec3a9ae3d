"""What one node costs: the price of a compute node (kernel models of
:mod:`stg.perf.kernel_time`, kernel tables, calibration) and of a collective or a send
(:mod:`stg.perf.comm_time`: NCCL's algorithms and protocols per network dimension) on a
:class:`~stg.perf.system.System`.

Shared by the DAG ``time`` predictor, which replays these costs over the multi-rank graph,
and the closed-form ``analytical`` predictor, which composes them per layer and stage; both
reach them through :mod:`stg.api`. (Moved here unchanged from ``predictors/time.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from stg.core.attention_backend import ATTENTION_BACKEND_ATTR
from stg.core.dropout import DROPOUT_FLOPS
from stg.core.fp8 import QUANTIZE_ATTR, QUANTIZE_BYTES_PER_ELEMENT
from stg.core.muon import LAUNCHES_ATTR, SHARE_ATTR
from stg.core.quantization import WEIGHT_FORMATS
from stg.core.recipes import (
    FP8_ATTENTION_CAST_KERNELS,
    HADAMARD_FLOPS_ATTR,
    NON_TN_FP8_GEMM_ARCHS,
    QUANTIZE_COLS_ATTR,
    QUANTIZE_KERNEL_ATTR,
    QUANTIZE_OPERAND_ATTR,
    RECIPE_ATTR,
    RECIPES,
)
from stg.core.routing import ACTIVE_EXPERTS_ATTR
from stg.core.torchtitan import EAGER_KERNEL_BYTES_ATTR, EAGER_KERNELS_ATTR
from stg.core.workload import (
    MICRO_BATCH_ATTR,
    PHASE_ATTR,
    STEP_ATTR,
    CollectiveType,
    Phase,
    Role,
    node_role,
)
from stg.errors import UserError
from stg.perf import comm_time
from stg.perf.calibration import Calibration
from stg.perf.eager import eager_time
from stg.perf.ep_dispatch import check_arch, dispatch_phases, routed
from stg.perf.kernel_time import (
    DTYPE_BYTES,
    MEMORY_KERNEL_SPEED,
    attention_kernel_for,
    attention_time,
    compiled_cast_time,
    gemm_time,
    grouped_gemm_time,
    memory_bound_time,
    memory_kind,
    recipe_gemm_speed,
    scaled_gemm_time,
    scatter_add_time,
)
from stg.perf.kernels import KernelTable, is_cast, kernel_name
from stg.perf.system import PRESETS, System, host_link_bandwidth, normalize_dtype, op_class

WIDE_DTYPES = frozenset({"fp32", "tf32"})
NO_KERNELS = KernelTable()

FUSED_PROFILES = frozenset({"megatron", "compiled"})
"""Profiles whose elementwise chains run fused: Megatron-LM's and Transformer Engine's fused
kernels, or Inductor's Triton kernels under ``torch.compile`` (``compiled``), priced alike
(:func:`megatron_fused_time`, :func:`megatron_softmax_kind`); their attention kernels differ
(:func:`attention_impl`)."""

EAGER_OP_HOST_S = 27.7e-6
"""Host time of one eager PyTorch op with autograd (dispatch, autograd bookkeeping, launch):
median forward time of the small (<= 1 MiB) elementwise cases with requires_grad inputs in
the H100 kernel measurements (data/kernels/h100-elementwise.jsonl), where the GPU is idle
most of the time. An eager step cannot issue kernels faster than this."""

EAGER_OPTIMIZER_PROFILES = frozenset({"eager", "torchtitan"})
"""Profiles whose optimizer is PyTorch's ``foreach`` AdamW (:data:`EAGER_ADAMW_BYTES_FACTOR`):
eager training scripts', and torchtitan's (``torch.optim.AdamW(..., foreach=True)``,
pytorch/torchtitan 1ea476e9f ``train.py:96-98``)."""

EAGER_ADAMW_BYTES_FACTOR = 80 / 28
"""Bytes PyTorch's default AdamW moves over a fused Adam's. ``torch.optim.AdamW`` (``foreach``,
PyTorch's default on GPUs) updates fp32 state in eight multi-tensor passes
(``torch/optim/adam.py``, ``_multi_tensor_adam``): weight decay ``mul_`` on the parameters
(8 B per parameter), ``lerp_`` of the first moment (12), ``mul_`` and ``addcmul_`` of the
second (8 + 12), ``sqrt`` into a temporary (8), its ``div_`` and ``add_`` (8 + 8), and the
``addcdiv_`` update (16): 80 B per parameter, where a fused Adam (Megatron's, apex's) reads
the parameter, gradient and both moments once and writes three of them: 28 B. The generated
``optimizer_step`` node counts the fused bytes; the eager profile prices this factor of them."""


EXPERT_GEMM_OPS = frozenset({"expert_gate", "expert_up", "expert_down"})
"""The ops of a mixture's routed experts (``models/moe.py``): batched GEMMs over the experts,
which eager PyTorch runs as one grouped GEMM each (``torch._grouped_mm``), their gradients
too (``expert_gate.grad_dispatch``, ``expert_gate.grad_w1``)."""

MOE_DISPATCH_OP = "dispatch"
MOE_COMBINE_OP = "combine"
MOE_GATES_OP = "router_topk"
MOE_OPS_PER_ROUTED_ELEMENT = {MOE_DISPATCH_OP: 1, MOE_COMBINE_OP: 2}
"""The ops ``models/moe.py`` declares per routed element (a token's row sent to one expert,
one value of it) for its dispatch (a copy; its token gradient: an add) and its combine (a
scale by the gate weight and an add), forward and backward: a node's routed elements are its
``num_ops`` over this."""


MOE_SORT_OPS = frozenset({"expert_sort", "expert_unsort"})
"""The copies ``models/moe.py`` declares under ``--moe_sort_by_expert`` (Megatron-core's
alltoall token dispatcher putting the routed rows in local-expert order and back)."""


def moe_sort_time(node: Any, system: System) -> float | None:
    """Seconds of a :data:`MOE_SORT_OPS` copy or of its gradient (a copy back), None for any
    other node: the rows read and written once at the streaming rate. A copy's gradient reads
    the output gradient and writes the input gradient; the generic backward node also counts
    the forward input, which the copy's backward does not read (a third of its bytes)."""
    base, _, grad_of = kernel_name(node).partition(".grad_")
    if base not in MOE_SORT_OPS:
        return None
    moved = node.tensor_size * 2 / 3 if grad_of else node.tensor_size
    return memory_bound_time(system.gpu, moved, "stream", node.dtype or "bf16")


def eager_moe_routing_time(node: Any, system: System) -> float | None:
    """Seconds of a mixture's dispatch or combine node (:data:`MOE_DISPATCH_OP`,
    :data:`MOE_COMBINE_OP` and their gradients) as eager PyTorch runs them
    (``benchmarks/eager_step.py``'s ``Experts``: rows sorted by expert), kernel by kernel; None
    for any other node, which is priced as usual. That includes the dispatch's gradient to
    the gates and the sum of the dispatched rows' two gradients, which stay generic
    memory-bound nodes although eager PyTorch runs neither (its dispatch only indexes by the
    gates; its fused gate-and-up GEMM concatenates the two gradients instead of adding them).

    - dispatch: ``index_select`` of the routed rows (each read and written, ``gather``);
    - its gradient to the tokens: ``index_add_`` of the routed rows' gradients into the
      tokens' (one atomic add per element, :func:`stg.perf.kernel_time.scatter_add_time`);
    - combine: the rows scaled by their gate weight (``row_scale``), then ``index_add_``;
    - its gradient to the rows: the tokens' gradient gathered per row (``gather``), scaled
      by the gate weight (``row_scale``);
    - its gradient to the gates: the gradient times the rows (read two, write one) and its
      sum over each row (read one), streaming.
    """
    op = kernel_name(node)
    base, _, grad_of = op.partition(".grad_")
    per_element = MOE_OPS_PER_ROUTED_ELEMENT.get(base)
    if per_element is None or (base == MOE_DISPATCH_OP and grad_of in (MOE_GATES_OP, "sum")):
        return None
    dtype = normalize_dtype(node.dtype or "bf16")
    routed = node.num_ops / per_element
    rows = routed * DTYPE_BYTES.get(dtype, 2)  # the routed rows' bytes
    gpu = system.gpu
    if base == MOE_DISPATCH_OP:
        if not grad_of:
            return memory_bound_time(gpu, 2 * rows, "gather", dtype)
        return max(scatter_add_time(gpu, routed, dtype), memory_bound_time(gpu, rows))
    if not grad_of:
        scaled = memory_bound_time(gpu, 2 * rows, "row_scale", dtype)
        return scaled + max(scatter_add_time(gpu, routed, dtype), memory_bound_time(gpu, rows))
    if grad_of == MOE_GATES_OP:
        return memory_bound_time(gpu, 4 * rows, "stream", dtype)
    gathered = memory_bound_time(gpu, 2 * rows, "gather", dtype)
    return gathered + memory_bound_time(gpu, 2 * rows, "row_scale", dtype)


def attention_impl(profile: str, system: System, backend: str = "auto") -> str:
    """The fused attention kernel a training stack runs on the system's architecture
    (:func:`stg.perf.kernel_time.attention_kernel_for`): Megatron with Transformer Engine uses
    cuDNN's fused attention on Hopper and Blackwell, FlashAttention-2 on Ampere, AITER's on AMD;
    eager PyTorch's SDPA (2.11) cuDNN's on compute capability 9.0 and 10.0 (Hopper, the B200 and
    GB200) and FlashAttention-2 elsewhere (Composable Kernel's on AMD); torchtitan's
    (``compiled``, and its eager Llama of 2024) FlashAttention-2 on all but Blackwell, where it
    prefers cuDNN's; a node's ``attention_backend`` (``flash``, ``fused``) overrides that
    choice."""
    return attention_kernel_for(system.arch, profile, backend, system.compute_capability)


def native_fp8(system: System, kind: str, dtype: str) -> bool:
    """Whether ``dtype`` is fp8 and the GPU has fp8 tensor cores (its fp8 peak exceeds its
    bf16 peak: Hopper and later), so that an fp8 GEMM runs natively, as cuBLAS and Transformer
    Engine run it, at the fp8 rate of the GEMM model; no kernel plugin is needed. Attention
    stays in 16 bits (Transformer Engine's default) unless its node says otherwise
    (``attention_dtype``: serving's FP8 attention, training's ``fp8_attention``)."""
    return dtype == "fp8" and kind == "gemm" and system.peak("fp8") > system.peak("bf16")


WEIGHT_ONLY_ARCHS = frozenset({"ampere", "ada", "hopper", "blackwell"})
"""Architectures whose GPUs run fp8 and fp4 weights weight-only where their tensor cores lack
the format: NVIDIA compute capability 8.0 and later, where vLLM's Marlin kernels dequantize the
weights in the GEMM and keep the activations in 16 bits (vLLM ``marlin_utils_fp8.py`` and
``marlin_utils_fp4.py``: ``is_fp8_marlin_supported``/``is_fp4_marlin_supported`` require
capability 80; an NVFP4 or FP8 checkpoint on an A100 or an fp4 one on an H100 runs so)."""


def serving_gemm_dtype(system: System, dtype: str, default_dtype: str) -> str:
    """The dtype a matmul of a serving weight format (:mod:`stg.core.quantization`) whose
    operands are ``dtype`` computes in on ``system``: ``dtype`` where the tensor cores have it
    (fp8: :func:`native_fp8`; fp4, fp6: a peak for it), else ``default_dtype`` (weight-only,
    as vLLM runs it: :data:`WEIGHT_ONLY_ARCHS`). Raises :class:`UserError` on a GPU that can
    do neither (Volta, Turing; fp4 on CDNA 3, whose ROCm stack has no weight-only kernel)."""
    if dtype == "fp8":
        native = _fp8_tensor_cores(system)
    elif dtype in ("fp6", "fp4"):
        native = dtype in system.peak_flops
    else:
        return dtype
    if native:
        return dtype
    if system.arch in WEIGHT_ONLY_ARCHS:
        return default_dtype
    have = {"fp8"} if _fp8_tensor_cores(system) else set()
    have |= {d for d in ("fp6", "fp4") if d in system.peak_flops}
    runs = [
        f.name
        for f in WEIGHT_FORMATS.values()
        if f.weight_dtype not in ("fp8", "fp4") or f.weight_dtype in have
    ]
    raise UserError(
        f"system {system.name!r} ({system.arch}) cannot run {dtype} weights: no {dtype} tensor "
        f"cores and no weight-only kernel (NVIDIA compute capability 8.0 and later); "
        f"weight formats it runs: {', '.join(runs)}"
    )


def _fp8_tensor_cores(system: System) -> bool:
    """Whether fp8 runs faster than both 16-bit formats (a GPU without fp8 tensor cores has
    its fp16 rate as its fp8 peak: Volta and Turing lack bf16 as well)."""
    return system.peak("fp8") > max(system.peak("bf16"), system.peak("fp16"))


def quantize_time(node: Any, system: System, default_dtype: str) -> float:
    """Time of a serving format's activation quantization (a node with ``quantize``): none
    where the GPU runs the format weight-only (:func:`serving_gemm_dtype`), else the bytes it
    writes (elements and scales) at the streaming rate and no launch of its own: vLLM's
    compilation passes fuse the fp8 and NVFP4 quantization into the kernel that produces the
    activation (``RMSNormQuantFusionPass``, ``ActivationQuantFusionPass`` for SiLU-and-mul;
    vLLM ``vllm/compilation``), as Transformer Engine fuses its fp8 casts."""
    target = normalize_dtype(node.attrs["quantize"])
    if serving_gemm_dtype(system, target, default_dtype) != target:
        return 0.0
    read = node.num_ops * DTYPE_WIDTH.get(normalize_dtype(default_dtype), 2)
    return memory_bound_time(system.gpu, max(node.tensor_size - read, 0), "stream", target)


DTYPE_WIDTH = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


FUSED_SOFTMAX_ROWS = (16, 4096)
"""Rows Megatron's fused scale-mask-softmax kernel takes (exclusive, inclusive): megatron-core
``FusedScaleMaskSoftmax.is_kernel_available`` requires fp16/bf16 input and ``16 < sk <= 4096``
(its CUDA kernel keeps a row in registers, one warp per row); outside that range Megatron runs
``torch.softmax`` after a separate scale and mask."""


def megatron_softmax_kind(row: int | None, dtype: str) -> str:
    """The memory-bound class of an attention softmax under the Megatron profile.

    Megatron fuses scale, mask and softmax into one kernel that holds each row on chip: one
    read of the scores and one write of the probabilities (forward), one read of the
    probabilities and their gradient and one write (backward). Such a one-pass kernel moves
    its bytes at the streaming rate: the fused scale + causal-mask + softmax that
    ``benchmarks/measure_kernels.py`` measures (one kernel, by ``torch.compile``, rows of 1,024
    bf16 scores) ran at 2.97 TB/s forward and 3.03 backward on an H100, 0.89 of its
    3.35 TB/s like a copy (tests/data/kernels/h100-fusion.jsonl). Rows the kernel does not
    take, and 32-bit scores, run PyTorch's softmax at its measured rate (``softmax``)."""
    low, high = FUSED_SOFTMAX_ROWS
    if row is not None and low < row <= high and DTYPE_WIDTH.get(dtype, 4) == 2:
        return "stream"
    return "softmax"


def megatron_fused_time(node: Any, system: System) -> float | None:
    """The time of a node that Megatron-LM / Transformer Engine fuse into a neighbour, or
    None for a node that runs as its own kernel. (The eager profile: :mod:`stg.perf.eager`.)

    - A forward bias add (``*_bias``: Megatron's ``bias_gelu`` and ``bias_dropout_add``
      fusions, and the GEMM epilogue of Transformer Engine's Linear for the QKV biases) costs
      nothing: the consumer kernel reads the bias vector along with its input.
    - A forward dropout between a bias and the residual add (``*_bias_dropout``: Megatron's
      ``bias_dropout_add_fused_train``) runs in the residual add's kernel, which then also
      writes the 1-byte mask: those bytes at the streaming rate. Its backward (the output
      gradient times the mask) is a kernel of its own, as are the attention-probability and
      embedding dropouts (Megatron's ``attention_dropout``, ``embedding_dropout``).
    - Transformer Engine's fp8 casts (``<op>.cast_<operand>`` into fp8): an activation is
      cast in the kernel that produces it (fused LayerNorm/GELU + cast, computing its amax
      on the way), which then writes 1 byte per element more; a weight is cast once per
      iteration (the first micro-batch) and cached. Gradient casts stay kernels.
    """
    name = kernel_name(node)
    if ".grad" not in name and name.split(".", 1)[0].endswith("_bias"):
        return 0.0
    if ".grad" not in name and name.endswith("_bias_dropout"):
        mask = node.num_ops // DROPOUT_FLOPS  # one 1-byte mask element per element
        return memory_bound_time(system.gpu, mask, "stream", node.dtype or "bf16")
    if not is_cast(name) or ".grad" in name:
        return None  # gradient casts: kernels (their forward dtype is not on the node)
    if normalize_dtype(node.dtype or "bf16") != "fp8":
        return None  # Transformer Engine's casts are fp8 ones; other casts are kernels
    operand = name.split(".cast_", 1)[1].split(".", 1)[0]
    if operand.startswith("w"):  # a weight: cast in the first micro-batch only
        if weight_cast_cached(node):
            return 0.0
        return None
    written = node.num_ops * DTYPE_WIDTH.get(normalize_dtype(node.dtype or "fp8"), 1)
    return memory_bound_time(system.gpu, written, "stream", node.dtype or "fp8")


def weight_cast_cached(node: Any) -> bool:
    """Whether Transformer Engine reuses a weight's fp8 copy cast earlier instead of casting
    it at this node: in every micro-batch but the first of a training iteration or serving
    step, and in every step of a run of several serving steps (the weights do not change).
    A node that declares neither (a foreign trace) casts."""
    attrs = getattr(node, "attrs", None) or {}
    if type(attrs.get(STEP_ATTR)) is int:  # node_step, inline: this runs per node
        return True
    micro_batch = attrs.get(MICRO_BATCH_ATTR)
    return type(micro_batch) is int and micro_batch != 0


def fp8_attention_cast_time(node: Any, system: System) -> float:
    """The casts around a training attention node run in fp8 (``fp8_attention``: its
    ``attention_casts`` bytes, :func:`stg.core.lowering.fp8_attention_ops`) at the measured rate
    of a fused fp8 cast with its amax (``quantize``), each of its
    :data:`~stg.core.recipes.FP8_ATTENTION_CAST_KERNELS` kernels with its launch; 0 for any
    other node."""
    attrs = getattr(node, "attrs", None) or {}
    casts = attrs.get("attention_casts")
    if type(casts) is not int or casts <= 0:
        return 0.0
    return (
        memory_bound_time(system.gpu, casts, "quantize")
        + FP8_ATTENTION_CAST_KERNELS * system.kernel_overhead
    )


def fp8_quantize_time(node: Any, system: System) -> float:
    """The time of the fp8 quantization that runs right before an fp8 GEMM node (its
    ``fp8_quantize`` elements, :data:`stg.core.fp8.QUANTIZE_ATTR`): Transformer Engine's
    cast-transpose with its amax, a kernel of its own, at the measured rate of a fused fp8
    cast with amax (``quantize``), writing no transpose on an architecture whose fp8 GEMMs take
    either layout (:data:`stg.core.recipes.NON_TN_FP8_GEMM_ARCHS`); 0 for a node without one.
    Part of the node's :func:`compute_time` where the GEMM runs natively in fp8."""
    attrs = getattr(node, "attrs", None) or {}
    quantized = attrs.get(QUANTIZE_ATTR)
    if type(quantized) is not int or quantized <= 0:
        return 0.0
    per_element = QUANTIZE_BYTES_PER_ELEMENT
    if system.arch in NON_TN_FP8_GEMM_ARCHS:
        per_element -= 1  # one fp8 tensor serves both usages: no transpose written
    nbytes = quantized * per_element
    return memory_bound_time(system.gpu, nbytes, "quantize") + system.kernel_overhead


BLOCK_SCALED_ARCHS: dict[str, frozenset[str]] = {
    "mxfp8": frozenset({"blackwell", "cdna4"}),
    "nvfp4": frozenset({"blackwell"}),
}
"""Architectures whose tensor cores take a block-scaled recipe's operands: NVIDIA Blackwell
(Transformer Engine runs ``MXFP8BlockScaling`` and ``NVFP4BlockScaling`` from compute
capability 10.0: ``check_mxfp8_support``, ``check_nvfp4_support``) and, for MXFP8, AMD CDNA 4
(MI355X matrix cores take the OCP MX formats with E8M0 scales, AMD CDNA 4 architecture white
paper, 2025; NVFP4's E4M3 block scales are NVIDIA's)."""


def check_runs_on(options: Any, system: System) -> None:
    """Raise :class:`UserError` where ``system``'s GPUs cannot run a training plan's
    low-precision recipe (:func:`recipe_gemm_dtype`) or its expert dispatcher
    (:func:`stg.perf.ep_dispatch.check_arch`), as the time predictor does on the nodes that
    use them: for a predictor that prices no kernel (``options``: a
    :class:`~stg.core.options.GenerateOptions`; a hybrid cluster's every device group)."""
    if options.inference:
        return
    first, last = options.bf16_layers
    recipe = RECIPES[options.low_precision_recipe]
    for device in [g.device for g in getattr(system, "groups", ())] or [system]:
        if options.dtype == "fp8" and first + last < options.num_stacks:
            recipe_gemm_dtype(device, recipe.name, recipe.dtype)
        if options.ep > 1:
            check_arch(options.moe_dispatcher, device)


def gemm_scaling(node: Any, recipe: str) -> str:
    """The scaling a recipe's fp8 GEMM node runs with: the recipe's, except torchao's ``rowwise``
    in the backward, whose input- and weight-gradient GEMMs are tensorwise cuBLAS GEMMs with
    unit scales, their outputs rescaled after (``addmm_float8_unwrapped``, torchao 0.18 and
    6243040: "The rowwise CUTLASS-based kernel is so slow without fast-accum that we'd rather
    use the tensorwise cuBLAS-based kernel"; the recipe's ``rescale_grad_output`` kernel);
    only its forward GEMM, recomputed or not, runs the rowwise kernel."""
    attrs = getattr(node, "attrs", None) or {}
    if recipe == "rowwise" and attrs.get(PHASE_ATTR) == Phase.BACKWARD:
        return "tensorwise"
    return recipe


def recipe_gemm_dtype(system: System, recipe: str, dtype: str) -> str:
    """The dtype an fp8 or fp4 GEMM of a low-precision training ``recipe``
    (:mod:`stg.core.recipes`) runs in on ``system``: ``dtype`` where the tensor cores take it
    (fp4: a peak for it), bf16 where an fp8 recipe meets a GPU without fp8 tensor cores (as
    the default recipe does). Raises :class:`UserError` for a block-scaled recipe (mxfp8,
    nvfp4) on an architecture without block-scaled tensor cores, or fp4 without an fp4 peak."""
    archs = BLOCK_SCALED_ARCHS.get(recipe)
    if archs is not None and system.arch not in archs:
        have = sorted(n for n, p in PRESETS.items() if p.get("arch") in archs)
        raise UserError(
            f"low_precision_recipe={recipe} needs block-scaled tensor cores, which system "
            f"{system.name!r} ({system.arch}) lacks; systems that have them: {', '.join(have)}"
        )
    if dtype == "fp4" and "fp4" not in system.peak_flops:
        have = sorted(n for n, p in PRESETS.items() if "fp4" in p.get("peak_tflops", {}))
        raise UserError(
            f"low_precision_recipe={recipe} runs its GEMMs in fp4, and system {system.name!r} "
            f"has no fp4 peak; systems with one: {', '.join(have)}"
        )
    if dtype == "fp8" and not _fp8_tensor_cores(system):
        return "bf16"
    return dtype


COMPILED_CAST_SCALING = {"amax": "tensorwise", "cast": "tensorwise"}
"""The measured compiled cast (:data:`stg.perf.kernel_time.COMPILED_CAST_ELEMENTS_PER_SM_CLOCK`)
that prices each quantize kernel of torchao's recipes under the ``compiled`` profile:
``tensorwise``'s amax pass and cast are the two kernels of one measured tensorwise cast;
``rowwise``'s casts are its ``cast`` (``rowwise``) and ``columnwise_cast`` (``colwise``).
Against the whole compiled float8 linear (tests/data/kernels/h100-float8-linear.jsonl less
its bare GEMMs, tests/test_float8_linear.py) these price the quantization of Llama 3 8B's and
70B's tp-8 linears at 0.90-1.50x of what it cost, a layer's at 0.99x and 1.02x (rowwise,
8B and 70B) and 1.05x and 1.24x (tensorwise; 70B's subtraction of its bare GEMMs is noisy
by up to 1.5 ms a linear: docs/notes/torchao-float8-linear.md)."""


def recipe_quantize_time(node: Any, system: System, profile: str = "megatron") -> float:
    """Time of a low-precision recipe's quantize kernel (a node with ``quantize_kernel``):
    its bytes at the measured rate of a fused cast with amax (``quantize``) and its launch,
    a per-tensor fp8 cast writing one copy, not the trace's two, where one tensor serves both
    usages (:meth:`stg.core.recipes.Recipe.shares_usages`: Blackwell); a kernel of torchao's
    recipes (a node with ``quantize_cols``) under the ``compiled`` profile, and any of
    ``rowwise``'s casts (torchao only), at the measured rate of inductor's casts for its
    columns (:func:`stg.perf.kernel_time.compiled_cast_time`, :data:`COMPILED_CAST_SCALING`),
    and torchao's ``rescale`` of the backward GEMMs' outputs as a streaming kernel;
    nothing where the GPU runs the recipe's GEMMs in bf16, or for a weight's copies after the
    first micro-batch (:func:`weight_cast_cached`: Transformer Engine caches them)."""
    attrs = node.attrs
    dtype = normalize_dtype(node.dtype or "fp8")
    if recipe_gemm_dtype(system, str(attrs.get(RECIPE_ATTR, "")), dtype) != dtype:
        return 0.0
    if attrs.get(QUANTIZE_OPERAND_ATTR) == "weight" and weight_cast_cached(node):
        return 0.0
    nbytes = node.tensor_size
    kind = attrs.get(QUANTIZE_KERNEL_ATTR)
    cols = attrs.get(QUANTIZE_COLS_ATTR)
    recipe = RECIPES.get(str(attrs.get(RECIPE_ATTR, "")))
    if recipe is not None and kind == "cast" and recipe.shares_usages(system.arch):
        # the trace states both copies; on this GPU the cast writes one (no transpose)
        nbytes -= -(-node.num_ops * recipe.element_bits // 8)
    axiswise = recipe is not None and recipe.axiswise_casts
    if type(cols) is int and cols > 0 and (axiswise or profile == "compiled"):
        if axiswise:  # each copy a compiled kernel of its own, whatever the profile
            scaling, kernels = ("colwise" if kind == "columnwise_cast" else "rowwise"), 1
        else:
            scaling, kernels = COMPILED_CAST_SCALING[str(kind)], 2
        seconds = compiled_cast_time(system.gpu, scaling, node.num_ops, nbytes, cols, kernels)
        return seconds + system.kernel_overhead
    if kind == "rescale":
        return memory_bound_time(system.gpu, nbytes, "stream") + system.kernel_overhead
    seconds = memory_bound_time(system.gpu, nbytes, "quantize")
    # a Hadamard transform's FLOPs on tensor cores (TE's wmma / UMMA kernels), its other ops
    # (one per element, stochastic rounding's random numbers) at the SIMT rate
    hadamard = int(attrs.get(HADAMARD_FLOPS_ATTR, 0))
    simt = (node.num_ops - hadamard) / system.gpu.rate("fp32")
    tensor = hadamard / system.gpu.rate("bf16")
    return max(seconds, simt, tensor) + system.kernel_overhead


def compute_time(
    node: Any,
    system: System,
    default_dtype: str = "bf16",
    kernels: KernelTable | None = None,
    profile: str = "megatron",
    calibration: Calibration | None = None,
) -> float:
    """Time of one compute node in seconds on ``system`` under execution ``profile``.

    A node that carries its kernel shape (generated traces) is priced by the kernel models of
    :mod:`stg.perf.kernel_time`: ``gemm`` = (batch, m, n, k) as a cuBLAS GEMM, ``attention``
    = (batch, heads, s_q, s_kv, head_dim, causal, backward) as the profile's fused attention
    kernel; other compute nodes are memory-bound kernels (streaming, normalisation, softmax)
    unless their FLOPs take longer at the sustained SIMT rate. A node without a shape (a
    foreign trace) gets the roofline with the system's ``compute_efficiency`` per op class.
    Each kernel then pays its launch: ``kernel_overhead`` of the system (Megatron), or at
    least the eager host time of the ops eager PyTorch dispatches for it (eager,
    :mod:`stg.perf.eager`, with autocast's copies).

    A matmul whose output is fp32 in a workload that computes in a narrower dtype is a
    narrow matmul accumulating into fp32 (Megatron's weight gradients into fp32 main
    gradients): it runs at the rate of the workload's compute dtype. Kernels (see
    :mod:`stg.perf.kernels`) price casts, divide a matmul's time by their speedup, and decide
    whether an fp8/int8 op runs natively or is priced in the workload's dtype.
    """
    if node.num_ops <= 0 and node.tensor_size <= 0:
        return getattr(node, "runtime", 0) * 1e-6
    if profile in EAGER_OPTIMIZER_PROFILES and node_role(node) is Role.OPTIMIZER_STEP:
        nbytes = node.tensor_size * EAGER_ADAMW_BYTES_FACTOR
        seconds = memory_bound_time(system.gpu, nbytes, "stream", node.dtype or "fp32")
        return max(seconds + system.kernel_overhead, EAGER_OP_HOST_S)
    eager_kernels = eager_kernels_time(node, system)
    if eager_kernels is not None:
        return eager_kernels
    if (getattr(node, "attrs", None) or {}).get("quantize") is not None:
        return quantize_time(node, system, default_dtype)
    if (getattr(node, "attrs", None) or {}).get(QUANTIZE_KERNEL_ATTR) is not None:
        seconds = recipe_quantize_time(node, system, profile)
        return max(seconds, EAGER_OP_HOST_S) if profile == "eager" and seconds else seconds
    launches = (getattr(node, "attrs", None) or {}).get(LAUNCHES_ATTR)
    if calibration is not None and launches is None:  # measured kernel times first
        # (stg bench calibrate; not for a node of many kernels in turn, priced per kernel below)
        measured = calibration.node_time(node, default_dtype)
        if measured is not None:
            return measured
    if profile == "eager":
        routing = eager_moe_routing_time(node, system)
        if routing is not None:
            return max(routing + system.kernel_overhead, EAGER_OP_HOST_S)
    table = kernels if kernels is not None else NO_KERNELS
    name = kernel_name(node)
    if table and node.dtype and is_cast(name):
        cast = table.cast_kernel(node.dtype)
        if cast is not None:
            return cast.cast_alpha * node.num_ops + cast.cast_beta
    if profile in FUSED_PROFILES:
        fused = megatron_fused_time(node, system)
        if fused is not None:
            return fused
        sort = moe_sort_time(node, system)
        if sort is not None:
            return sort + system.kernel_overhead
    attrs = getattr(node, "attrs", None) or {}
    gemm = attrs.get("gemm")
    attention = attrs.get("attention")
    stored_weight = gemm is not None and attrs.get("weight_dtype") is not None
    recipe = attrs.get(RECIPE_ATTR) if gemm is not None else None
    if stored_weight:
        node_dtype = normalize_dtype(node.dtype or default_dtype)
        dtype_override = serving_gemm_dtype(system, node_dtype, default_dtype)
    elif recipe is not None:
        node_dtype = normalize_dtype(node.dtype or default_dtype)
        dtype_override = recipe_gemm_dtype(system, str(recipe), node_dtype)
    kind = (
        "attention"
        if attention is not None
        else "gemm"
        if gemm is not None
        else op_class(name, node.num_ops, node.tensor_size)
    )
    if kind == "attention" and attention is None and memory_kind(name) == "softmax":
        kind = "other"  # unfused attention's softmax: a memory-bound kernel at its measured rate
    dtype = dtype_override if stored_weight or recipe is not None else node.dtype or default_dtype
    # fp8 attention where the tensor cores have fp8: serving's (FlashAttention-3, FlashInfer,
    # cuDNN, AITER read an fp8 KV cache and compute in fp8) and training's fp8_attention (TE's
    # fp8_dpa); other training attention stays in 16 bits
    fp8_attention = attrs.get("attention_dtype") == "fp8" and _fp8_tensor_cores(system)
    speedup = 1.0
    kernel = None
    if kind != "other":
        if dtype in WIDE_DTYPES and default_dtype not in WIDE_DTYPES:
            dtype = default_dtype
        kernel = table.get(kind, dtype)
        if kernel is not None:
            speedup = kernel.speedup
        elif (
            dtype != default_dtype
            and recipe is None
            and not table.native(kind, dtype)
            and not native_fp8(system, kind, dtype)
            and not fp8_attention
        ):
            dtype = default_dtype  # no native kernel: dequantize, compute in the workload dtype
    dtype = normalize_dtype(dtype)
    gpu = system.gpu
    if attention is not None and len(attention) >= 7:
        batch, heads, s_q, s_kv, head_dim, causal, backward = attention[:7]
        impl = attention_impl(profile, system, str(attrs.get(ATTENTION_BACKEND_ATTR, "auto")))
        if dtype not in ("bf16", "fp16", "fp8") or (
            dtype == "fp8" and kernel is None and not fp8_attention
        ):
            # Transformer Engine's DotProductAttention runs in 16 bits unless fp8_dpa is set
            # (an fp8 recipe quantizes the GEMMs): fp8 attention only from fp8_attention (the
            # node's attention_dtype) or a kernel plugin
            dtype = "bf16"
        seconds = (
            attention_time(
                gpu,
                impl,
                batch,
                heads,
                s_q,
                s_kv,
                head_dim,
                causal=bool(causal),
                backward=bool(backward),
                dtype=dtype,
                causal_split=int(attrs.get("causal_split", 1)),
                window=int(attrs.get("attention_window", 0)),
                chunk=int(attrs.get("attention_chunk", 0)),
                topk=int(attrs.get("attention_topk", 0)),
                fp8_scaling=str(attrs.get("attention_scaling", "fp8")),
            )
            / speedup
        )
        seconds += fp8_attention_cast_time(node, system)
        # a kernel cannot read its Q, K, V (a decode step's whole KV cache) faster than HBM
        seconds = max(seconds, memory_bound_time(gpu, node.tensor_size, "stream", dtype))
    elif gemm is not None and len(gemm) == 4:
        batch, m, n, k = gemm
        # a convolution (implicit GEMM) moves its tensor_size, not its window matrix
        # ... and a serving weight format's GEMM its weights at their stored width and scales
        nbytes = node.tensor_size if attrs.get("implicit_gemm") or stored_weight else None
        active = attrs.get(ACTIVE_EXPERTS_ATTR)
        if active is not None:  # a serving step's experts: those its tokens reach run, alone
            batch = min(batch, max(1, math.ceil(active)))
            nbytes = node.tensor_size
        scaled = recipe is not None and dtype == "fp8" and kernel is None
        if profile == "eager" and name.split(".", 1)[0] in EXPERT_GEMM_OPS and nbytes is None:
            seconds = grouped_gemm_time(gpu, batch, m, n, k, dtype) / speedup
            if scaled:
                seconds /= recipe_gemm_speed(system.arch, str(recipe))
        elif scaled:  # the recipe's scales: a tensorwise GEMM's speed, or rowwise's own kernel
            seconds = scaled_gemm_time(gpu, m, n, k, gemm_scaling(node, str(recipe)), batch, nbytes)
        elif attrs.get(LAUNCHES_ATTR, 1) > 1:  # one kernel per GEMM, in turn (Muon's)
            one = gemm_time(gpu, m, n, k, dtype) / speedup + system.kernel_overhead
            share = float(attrs.get(SHARE_ATTR, 1.0))
            seconds = share * int(attrs[LAUNCHES_ATTR]) * one - system.kernel_overhead
        else:
            seconds = gemm_time(gpu, m, n, k, dtype, batch, nbytes) / speedup
        if dtype == "fp8":
            seconds += fp8_quantize_time(node, system)
    elif kind == "other":
        simt = node.num_ops / gpu.rate("fp32") if node.num_ops > 0 else 0.0
        memory_class = memory_kind(name)
        if memory_class == "softmax" and profile in FUSED_PROFILES:
            memory_class = megatron_softmax_kind(attrs.get("row"), dtype)
        memory = memory_bound_time(gpu, node.tensor_size, memory_class, dtype)
        seconds = max(simt, memory)
        if LAUNCHES_ATTR in attrs:  # kernels in turn, each paying its launch (Muon's)
            runs = float(attrs.get(SHARE_ATTR, 1.0)) * int(attrs[LAUNCHES_ATTR])
            seconds += max(0.0, runs - 1) * system.kernel_overhead
    else:
        # the class's efficiency holds at the TDP's clock; a power limit lowers the clock
        rate = system.peak(dtype) * system.compute_efficiency[kind] * system.power_clock_scale
        flops = node.num_ops / (rate * speedup)
        memory = node.tensor_size / (system.hbm_bandwidth * system.memory_efficiency)
        seconds = max(flops, memory)
    seconds += system.kernel_overhead
    if profile == "eager":  # the ops eager PyTorch dispatches for the node (stg.perf.eager)
        seconds = eager_time(node, system, seconds, EAGER_OP_HOST_S)
    elif profile == "torchtitan":  # eager PyTorch: at least one op dispatched per node
        seconds = max(seconds, EAGER_OP_HOST_S)
    return seconds


def eager_kernels_time(node: Any, system: System) -> float | None:
    """Seconds of a node that lists the eager kernels it runs (:data:`EAGER_KERNELS_ATTR` and
    :data:`EAGER_KERNEL_BYTES_ATTR`, :mod:`stg.core.torchtitan`), None for any other node:
    each kernel its bytes at its class's streaming rate (:func:`memory_bound_time`) and its
    launch, or the eager host time of as many ops where that is longer."""
    attrs = getattr(node, "attrs", None) or {}
    kinds, sizes = attrs.get(EAGER_KERNELS_ATTR), attrs.get(EAGER_KERNEL_BYTES_ATTR)
    if not kinds and not sizes:
        return None
    if len(kinds or ()) != len(sizes or ()):
        raise UserError(
            f"node {getattr(node, 'name', '?')!r}: {EAGER_KERNELS_ATTR} and "
            f"{EAGER_KERNEL_BYTES_ATTR} must list the same kernels"
        )
    device = 0.0
    for entry, nbytes in zip(kinds, sizes, strict=True):
        kind, _, dtype = str(entry).partition(":")
        if kind not in MEMORY_KERNEL_SPEED:
            raise UserError(
                f"node {getattr(node, 'name', '?')!r}: eager kernel class {kind!r}; allowed: "
                f"{', '.join(MEMORY_KERNEL_SPEED)}"
            )
        seconds = memory_bound_time(system.gpu, nbytes, kind, normalize_dtype(dtype or "bf16"))
        device += seconds + system.kernel_overhead
    return max(device, len(sizes) * EAGER_OP_HOST_S)


def group_shape(ranks: Iterable[int], system: System) -> tuple[int, ...]:
    """Ranks a group spans along each network dimension (inner first).

    For dimension i: the largest number of distinct coordinates along i among members that
    share all outer coordinates (so an irregular group of 4 ranks over two nodes is 2 x 2).
    """
    coords = [system.coordinates(r) for r in ranks]
    shape = []
    for i in range(len(system.network)):
        buckets: dict[tuple[int, ...], set[int]] = {}
        for c in coords:
            buckets.setdefault(c[i + 1 :], set()).add(c[i])
        shape.append(max((len(v) for v in buckets.values()), default=1))
    return tuple(shape)


_COMM_KINDS = {
    CollectiveType.ALL_REDUCE: comm_time.Kind.ALL_REDUCE,
    CollectiveType.REDUCE_SCATTER: comm_time.Kind.REDUCE_SCATTER,
    CollectiveType.ALL_GATHER: comm_time.Kind.ALL_GATHER,
    CollectiveType.GATHER: comm_time.Kind.ALL_GATHER,
    CollectiveType.ALL_TO_ALL: comm_time.Kind.ALL_TO_ALL,
    CollectiveType.BROADCAST: comm_time.Kind.BROADCAST,
    CollectiveType.REDUCE: comm_time.Kind.REDUCE,
    CollectiveType.BARRIER: comm_time.Kind.BARRIER,
}


def collective_time(kind: CollectiveType, size: int, shape: Sequence[int], system: System) -> float:
    """Time of one collective (:func:`stg.perf.comm_time.collective_time`); ``size`` follows
    the Chakra convention (all-gather: this rank's input shard; reduce-scatter, all-reduce:
    the full buffer; all-to-all: this rank's buffer). A group of several GPUs of several nodes
    runs one of NCCL's algorithms over all of them; other groups spanning several network
    dimensions run hierarchically; each dimension takes the fastest of NCCL's ring, tree and
    (where declared) in-network reduction, and of its protocols (on a dimension with a
    ``link``; a plain alpha-beta link has the ring and the tree only)."""
    levels = tuple(comm_time.Level.of(d) for d in system.network)
    return comm_time.collective_time(
        _COMM_KINDS.get(kind, comm_time.Kind.ALL_REDUCE), size, shape, levels
    )


def collective_phases(
    kind: CollectiveType, size: int, shape: Sequence[int], system: System
) -> tuple[tuple[str, float, float], ...]:
    """:func:`collective_time` as the phases it runs, in order: ``(port, latency, transfer)``
    per network dimension (:func:`stg.perf.comm_time.collective_phases`), ``port`` naming the
    GPU's resource the phase's bytes cross (:func:`stg.perf.comm_time.port`: ``nvlink``,
    ``nic``, ...). The replay shares a port's bandwidth between the transfers that use it at
    the same time."""
    levels = tuple(comm_time.Level.of(d) for d in system.network)
    phases = comm_time.collective_phases(
        _COMM_KINDS.get(kind, comm_time.Kind.ALL_REDUCE), size, shape, levels
    )
    return tuple(
        (comm_time.port(levels[p.dimension], p.dimension), p.latency, p.transfer) for p in phases
    )


def expert_dispatch_time(
    attrs: Any, comm_size: int, dtype: str | None, shape: Sequence[int], system: System
) -> float | None:
    """Seconds of an expert-parallel all-to-all that DeepEP or HybridEP runs (its typed
    attributes ``attrs``: :func:`stg.perf.ep_dispatch.routed`) over a group of ``shape``
    (:func:`stg.perf.ep_dispatch.dispatch_phases`); None for any other collective, which
    :func:`collective_time` prices."""
    route = routed(attrs)
    if route is None:
        return None
    phases = dispatch_phases(route, comm_size, dtype, shape, system)
    return sum(latency + transfer for _, latency, transfer in phases)


def spanning_byte_rate(kind: CollectiveType, shape: Sequence[int], system: System) -> float | None:
    """Bytes/s each GPU moves while a collective over a group of several GPUs of each of
    several nodes runs one of NCCL's algorithms over all of them
    (:func:`stg.perf.comm_time.spanning_byte_rate`); ``None`` for other groups."""
    if kind not in _COMM_KINDS:
        return None
    levels = tuple(comm_time.Level.of(d) for d in system.network)
    return comm_time.spanning_byte_rate(_COMM_KINDS[kind], shape, levels)


def send_phases(size: int, dimension: int, system: System) -> tuple[tuple[str, float, float], ...]:
    """:func:`send_time` as one phase ``(port, latency, transfer)`` (none for a send to the
    same rank)."""
    if dimension < 0:
        return ()
    level = comm_time.Level.of(system.network[dimension])
    return ((comm_time.port(level, dimension), *comm_time.send_parts(size, level)),)


def tree_all_reduce_time(size: float, n: int, bandwidth: float, latency: float) -> float:
    """All-reduce over a pipelined binary tree (reduce up, broadcast down), as NCCL's tree
    algorithm: every rank moves the whole buffer twice, over 2·ceil(log2 n) latency hops. It
    beats the ring (2(n-1)/n·S/B + 2(n-1)·alpha) for small buffers on many ranks; each
    dimension takes the faster of the two, as NCCL chooses per message size."""
    return 2 * size / bandwidth + 2 * math.ceil(math.log2(n)) * latency


def link_dimension(src: int, dst: int, system: System) -> int:
    """The outermost network dimension on which two ranks differ (-1 for the same rank)."""
    a, b = system.coordinates(src), system.coordinates(dst)
    for i in range(len(a) - 1, -1, -1):
        if a[i] != b[i]:
            return i
    return -1


def send_time(size: int, dimension: int, system: System) -> float:
    """A point-to-point transfer over the outermost dimension on which the ranks differ."""
    if dimension < 0:
        return 0.0
    return comm_time.send_time(size, comm_time.Level.of(system.network[dimension]))


def host_copy_time(size: int, system: System) -> float:
    """A copy of ``size`` bytes between a GPU of ``system`` and host memory (CPU activation
    offload's MEM_STORE and MEM_LOAD nodes): the bytes at the host link's bandwidth per
    direction (:func:`stg.perf.system.host_link_bandwidth`, the GPU's PCIe from its data
    sheet). No latency is added: a pinned-memory ``cudaMemcpyAsync`` of megabytes is
    bandwidth-bound, and no data sheet gives one."""
    if size <= 0:
        return 0.0
    return size / host_link_bandwidth(system)
