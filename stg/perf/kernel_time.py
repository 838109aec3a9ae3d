"""How long one GPU kernel takes, from its shape: GEMMs, attention, memory-bound ops.

These are the sub-models of the time predictor. Each is a small physical model whose
constants come from a data sheet (peaks, SM counts, clocks, bandwidths: the system presets in
:mod:`stg.perf.system`) or from kernel-level measurements (the H100 measurements in PARAM's
result format that ship with this project's shared data, ``data/kernels/``; ``stg bench``
measures the same on a user's GPU). Nothing here is fitted to a training run.

**Clock.** Tensor-core kernels run at the power-capped clock of a GPU under sustained load,
not at the clock the data sheet's peak assumes: an H100 SXM at its 700 W cap runs dense
GEMMs at 1.32-1.49 GHz (mean 1.38 GHz, ``h100-data-effect.jsonl``, "hot" randn rows), while
its 989.4 TFLOP/s bf16 peak is 132 SMs x 4096 FLOP per clock x 1.83 GHz. Tensor-core rates
are therefore ``peak(dtype) · sustained_clock / peak_clock`` times a kernel's pipeline
efficiency at that clock. Plain fp32 (CUDA cores) does not reach the power cap and runs at
its data-sheet rate times its own efficiency.

**GEMM** ``C[m, n] = A[m, k] · B[k, n]`` (``batch`` of them): cuBLAS tiles C into CTA tiles
(128x256, 256x128, 128x128 or 64x128; it picks the fastest) and, when there are too few tiles
to fill the SMs and ``k`` is long, splits ``k`` (split-K, partial sums in fp32 reduced in a
second pass). Time = waves · (tile work / per-SM rate + per-tile overhead), where
waves = ceil(tiles / SMs) (wave quantisation), tile work = 2·tile_m·tile_n·k (tile
quantisation: a partial tile costs a whole one); bounded below by the memory roofline
(A and B read once at the streaming bandwidth, C written once at the slower rate of a GEMM's
epilogue).

**Attention.** Fused kernels (FlashAttention-2, cuDNN / FlashAttention-3 class) process the
query in blocks of 128 rows per CTA; a block's work is 4·128·kv·head_dim FLOPs forward
(kv = the keys it attends to: under causal masking the blocks up to the diagonal) and 2.5x
that backward (the backward recomputes the scores). Time = waves · (block work / per-SM rate
+ per-block overhead). A forward of fewer query blocks than SMs against a longer key/value
cache (a decode step) splits the keys over CTAs (split-KV, Flash-Decoding) and combines
their partial outputs in a second, memory-bound pass. Unfused attention (PyTorch's math
path: scores, softmax and dropout as separate kernels through HBM) is two batched GEMMs plus
the bytes its kernels move per score element.

**Memory-bound kernels** move their bytes at a measured fraction of the HBM bandwidth per
kernel class: streaming (add, mul, copy, GELU, SiLU), normalisation (LayerNorm, RMSNorm,
dropout) and softmax.

Launch costs are not part of a kernel's time here: an execution profile adds them (see the
time predictor).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

# ---------------------------------------------------------------------------------------------
# Kernel-level constants, each with its source. "H100 data" = the kernel measurements in
# data/kernels/ (PyTorch 2.11, CUDA 13.0, H100 SXM 80GB at its 700 W cap, sustained state).

GEMM_PIPE_EFFICIENCY = 0.88
"""Fraction of the clock-scaled tensor-core peak that cuBLAS reaches on large GEMMs: H100 data,
bf16 grid cases with m, n, k >= 4096, median 654 TFLOP/s, over 989.4 · 1.38/1.83 = 746."""

BLACKWELL_GEMM_PIPE_EFFICIENCY = 0.81
""":data:`GEMM_PIPE_EFFICIENCY` of Blackwell (B200, B300, GB200, GB300) at the preset's sustained
clock: 0.88 times the median, 0.918, of five published cuBLAS bf16 GEMMs on a B200 with every
side >= 4096 over the tile model at 0.88 (tests/data/kernels/blackwell-published.jsonl):
``torch.mm`` at 4096^3, 6144^3 and 8192^3, 1.41, 1.45 and 1.42 PFLOP/s (pytorch/ao pull request
#2427), 16384 x 6144 x 4096 at 1.51 (vllm-project/vllm pull request #19566, ``torch-bf16``) and
8192^3 at 1.61 (NVIDIA's Tilus tutorial, under Nsight Compute). The first four are short runs
(5 profiled iterations; Triton's benchmark harness) that a B200 starts at up to 1.965 GHz, above
the preset's clock (1.58 GHz after ~0.1 s back to back), so the sustained rate is, if anything,
lower. fp8 runs at twice the bf16 rate per clock, as the data sheet has it
(1.95-1.96x at 4096^3 in OpenXLA's sm_100 matmul table, the same file)."""

ARCH_GEMM_PIPE_EFFICIENCY: dict[str, float] = {"blackwell": BLACKWELL_GEMM_PIPE_EFFICIENCY}
"""GEMM pipeline efficiency per architecture where it is not :data:`GEMM_PIPE_EFFICIENCY`."""

CDNA3_FP8_GEMM_SPEED = 0.90
"""hipBLASLt's fp8 GEMMs on CDNA 3 reach 0.90 of twice the bf16 rate, not the data sheet's 2x:
AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (2025-02-28), Table 1, each GPU's
max-achievable fp8 over bf16 TFLOP/s, both shapes one wave of 304 macro tiles
(tests/data/kernels/cdna-published.jsonl): MI300X 1,273 / 708 = 1.798 (0.899 of 2x), MI325X
1,519 / 843 = 1.802 (0.901). The fp8 runs' median clocks were the higher (1,230 vs 1,207 and
1,464 vs 1,447 MHz): the shortfall is the fp8 pipeline's, not a lower clock."""

ARCH_DTYPE_GEMM_SPEED: dict[str, dict[str, float]] = {"cdna3": {"fp8": CDNA3_FP8_GEMM_SPEED}}
"""A dtype's GEMM rate per architecture relative to its data-sheet peak at the bf16 pipeline
efficiency, where measured to differ (elsewhere 1.0, the data sheet's ratio: a B200's fp8 ran
1.95-1.96x its bf16, tests/data/kernels/blackwell-published.jsonl)."""

FP32_SIMT_EFFICIENCY = 0.76
"""Fraction of the fp32 (CUDA-core) peak a large strict-fp32 GEMM reaches: H100 data, fp32
grid cases with all dimensions >= 4096, median 50.8 of 66.9 TFLOP/s."""

GEMM_TILE_OVERHEAD_S = 1.0e-6
"""Fixed cost of one wave of GEMM tiles (prologue filling the pipeline, epilogue writing C):
H100 data, bf16 grid cases with k <= 512, where it dominates."""

GEMM_OUTPUT_WRITE_SPEED: dict[str, float] = {"hopper": 2.35 / 2.98}
"""Rate at which a GEMM's epilogue writes C to HBM relative to a streaming kernel's bandwidth,
per architecture where measured (elsewhere 1.0). Hopper: the H100 data's bf16 grid GEMMs with
k = 128 (C is 98 % of the bytes) of >= 50 us (six shapes, 4096-16384 by 4096-16384), C bytes
over (measured - A and B at the streaming 2.98 TB/s): 2.28-2.41 TB/s, median 2.35. Checked on
what it was not fitted on: fp8 with k = 256 and C of >= 134 MB wrote 1.80-2.37 TB/s (H100
data); reading A or B dominates 128-column GEMMs that run at 2.8-3.0 TB/s (the streaming
rate)."""

GEMM_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128), (64, 128))
"""CTA tile shapes cuBLAS chooses among on Hopper and Ampere (CUTLASS's default tiles)."""

CDNA_GEMM_TILES: tuple[tuple[int, int], ...] = (*GEMM_TILES, (256, 192), (192, 256), (256, 256))
"""hipBLASLt's macro tiles on CDNA 3 and 4 add 192 and 256 sides ("common GPU tile sizes are
128, 192, and 256", "larger compute tiles (up to 256x256 on MI300X/MI325X)": AMD ROCm blog
'Measuring Max-Achievable FLOPs - Part 2', 2025-02)."""

ARCH_GEMM_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "cdna3": CDNA_GEMM_TILES,
    "cdna4": CDNA_GEMM_TILES,
}
"""Tile shapes per architecture where they are not :data:`GEMM_TILES`."""

SPLIT_K_MIN = 512
"""Smallest k slice of a split-K GEMM (cuBLAS does not split below a few pipeline stages)."""

STREAM_EFFICIENCY = 0.89
"""Fraction of HBM bandwidth reached by streaming kernels: H100 data, add/mul/copy/GELU on
>= 0.5 GB tensors, 2.95-3.0 of 3.35 TB/s."""

MEMORY_KERNEL_SPEED: dict[str, float] = {
    "stream": 1.0,
    "norm": 0.58 / 0.89,  # H100 data: layer_norm, rms_norm forward, 1.9-2.0 TB/s
    # H100 data: dropout forward at 0.5-1 GiB, counting its 1-byte mask (which PARAM's
    # bytes_fwd leaves out): 2.45 TB/s bf16, 2.53 fp32. Its backward (gradient times mask,
    # 5 bytes per bf16 element) runs at 3.0 TB/s: a streaming kernel.
    "dropout": 0.73 / 0.89,
    "softmax": 0.56 / 0.89,  # H100 data: softmax over 8192 columns, fp32, 1.88 TB/s
    # an fp8 cast that also reduces its amax (Transformer Engine's quantize kernels): one
    # fused cast + amax kernel over [65536, 8192] bf16 ran at 1.83 TB/s on an H100
    # (tests/data/kernels/h100-fusion.jsonl, fp8_cast_amax/fused; 0.55 of 3.35 TB/s), where
    # the cast alone streams at 2.99 TB/s
    "quantize": 1.83 / 3.35 / 0.89,
    # H200 data (tests/data/kernels/h200-moe-routing.jsonl, PyTorch 2.11): ``index_select`` of
    # 64k-262k rows of 2,048-4,096 values (a mixture's dispatch) moves each row read and
    # written at a median 3.81 TB/s, bf16 and fp32 alike, of the H200's 4.27 TB/s streaming
    "gather": 3.81 / (4.8 * 0.89),
    # the same data: ``y * w`` with one gate weight per row (``w`` of shape [rows, 1]), whose
    # broadcast PyTorch runs in its non-vectorized elementwise kernel: 1.66 TB/s bf16 (fp32
    # rows reach 2.69 TB/s; mixtures train their routing in 16 bits, so this is the figure)
    "row_scale": 1.66 / (4.8 * 0.89),
    # weight-streaming grouped GEMMs (see GROUPED_GEMM_COMPUTE_SPEED): torch._grouped_mm of 64
    # rows per group over 8-64 groups moving >= 400 MB, median 3.02 TB/s of A, B and C
    # (tests/data/kernels/h200-grouped.jsonl, 15 cases of five models' expert shapes)
    "grouped_gemm": 3.02 / (4.8 * 0.89),
    # eager PyTorch's kernels of torchtitan's Llama, each on its own at the Llama 3 8B shapes of
    # 8,192 tokens (tests/data/kernels/h100-torchtitan-kernels.jsonl: torch.profiler self
    # device time per aten call, PyTorch 2.11, H100 SXM at 3.35 TB/s; stg.core.torchtitan):
    # a contiguous bf16 <-> fp32 copy (aten::copy_ of [8192, 4096], [1, 8192, 32, 128] and
    # [8192, 128256]) moves 2.31-2.38 TB/s
    "convert": 2.32 / (3.35 * 0.89),
    # an fp32 product with a per-row vector (aten::mul of [8192, 4096] by [8192, 1]): 2.34 TB/s
    "broadcast": 2.34 / (3.35 * 0.89),
    # a bf16 product with a per-column vector (aten::mul of [8192, 4096] by the [4096] weight):
    # 1.49 TB/s; repeat_kv's copy of a source broadcast over the group (aten::copy_ into
    # [1, 8192, 8, 4, 128]) runs at 1.21 TB/s, which this prices 23 % fast
    "broadcast16": 1.49 / (3.35 * 0.89),
    # an fp32 mean over rows of 4,096 (aten::mean of [8192, 4096], dim -1): 2.46 TB/s
    "reduce": 2.46 / (3.35 * 0.89),
    # _log_softmax of fp32 rows of 128,256 logits: 5.55 ms for 8.4 GB, 1.51 TB/s; its backward
    # (_log_softmax_backward_data, three tensors): 5.70 ms for 12.6 GB, 2.21 TB/s
    "log_softmax": 1.51 / (3.35 * 0.89),
    "log_softmax_backward": 2.21 / (3.35 * 0.89),
}
"""Bandwidth of a memory-bound kernel class relative to a streaming kernel (forward; large
tensors). A system's streaming efficiency is its ``memory_efficiency``."""

SCATTER_ADD_ELEMENTS_PER_SM_CLOCK: dict[int, float] = {2: 0.487, 4: 0.586}
"""Elements per SM per clock (at the data sheet's peak clock) that PyTorch's ``index_add_``
adds into its target, by element width in bytes: one atomic add per element, bound by the
atomics' rate, not by HBM. H200 data (tests/data/kernels/h200-moe-routing.jsonl, PyTorch
2.11): 64k-262k rows of 2,048-4,096 values added into a zeroed [rows / k, d] tensor (k 2 or
8) ran at a median 118 G elements/s in bf16 (0.24 TB/s of source) and 142 G/s in fp32, on 132
SMs at 1.83 GHz; the same at every size. A streaming kernel would have moved those bytes in a
fifth (fp32) to a ninth (bf16) of the time."""

SOFTMAX_16BIT_ELEMENTS_PER_SM_CLOCK = 256e9 / (132 * 1.83e9)
"""PyTorch's softmax over 16-bit inputs is bound by its SMs, not by HBM: H100 data, bf16
softmax over 8192 columns, 1.02 TB/s forward = 256 G elements/s on 132 SMs at 1.83 GHz
(1.06 elements per SM per clock), its backward at the same element rate; the H200 (the same
132 SMs, 1.43x the bandwidth) ran it at 1.08 TB/s (tests/data/kernels/h200-elementwise.jsonl),
where a bandwidth-bound kernel would have gained 43 %. Rows of 32-bit values run at the
``softmax`` bandwidth share instead."""

COMPILED_CAST_ELEMENTS_PER_SM_CLOCK: dict[str, tuple[tuple[int, float], ...]] = {
    "rowwise": ((128, 0.153), (512, 0.606), (1792, 1.43), (4096, 3.45), (14336, 2.08)),
    "colwise": ((128, 0.407), (512, 0.920), (1792, 1.54), (4096, 3.12), (14336, 1.39)),
    "tensorwise": ((128, 0.517), (512, 1.24), (1792, 1.34), (4096, 3.19), (14336, 1.25)),
}
"""Elements per SM per clock (at the data sheet's peak clock) of an fp8 cast of a bf16 tensor
that ``torch.compile`` builds, by its scales (``rowwise``: one per row, ``colwise``: one per
column, ``tensorwise``: one, found by an amax pass before the cast, both kernels counted) and
the tensor's columns. These casts are bound by their SMs, not by HBM, at most shapes: the
H100 and the H200 (132 SMs each, 1.43x the bandwidth) ran them in the same time
(tests/data/kernels/h100-gemm-graph.jsonl and h200-gemm-graph.jsonl, family ``quantize``,
PyTorch 2.11: bf16 [98304, 128 | 512 | 1792 | 4096] and [16384, 14336]; the faster of the two
GPUs per shape, e.g. a rowwise cast of [98304, 128] 340 us on both, of [98304, 4096] 484 us on
the H200 and 498 us on the H100; a tensorwise one of [16384, 14336] 777 and 807 us). Between
the measured columns the rate is interpolated on log(columns), beyond them held; the time is
bounded below by the bytes at :data:`COMPILED_CAST_BANDWIDTH_SHARE`."""

COMPILED_CAST_BANDWIDTH_SHARE: dict[str, float] = {
    "rowwise": 1.0,
    "colwise": 0.586,
    "tensorwise": 1.0,
}
"""Share of the streaming bandwidth a compiled cast (see above) moves its bytes at where HBM
bounds it: the colwise cast of [98304, 4096] read and wrote 1.21 GB in 691 us on the H100
(0.586 of its 2.98 TB/s streaming) and in 534 us, its SM bound, on the H200; the tensorwise
cast of the same tensor (2.01 GB with its amax pass) took 674 us on the H100, 2.99 TB/s, the
streaming rate; no rowwise cast was bound by HBM on either GPU (streaming rate assumed)."""


def compiled_cast_time(
    gpu: Gpu, scaling: str, elements: int, nbytes: int, cols: int, kernels: int = 1
) -> float:
    """Seconds of one of the ``kernels`` kernels of a compiled fp8 cast with ``scaling``
    (``rowwise``, ``colwise``, ``tensorwise``) of ``elements`` bf16 values in rows of
    ``cols``, the kernel moving ``nbytes``: its share of the measured cast's SM-bound time
    (:data:`COMPILED_CAST_ELEMENTS_PER_SM_CLOCK`), or its bytes at the cast's bandwidth."""
    points = COMPILED_CAST_ELEMENTS_PER_SM_CLOCK[scaling]
    if cols <= points[0][0]:
        per_clock = points[0][1]
    elif cols >= points[-1][0]:
        per_clock = points[-1][1]
    else:
        (c0, r0), (c1, r1) = next(
            (a, b) for a, b in itertools.pairwise(points) if a[0] <= cols <= b[0]
        )
        f = math.log(cols / c0) / math.log(c1 / c0)
        per_clock = r0 + (r1 - r0) * f
    rate = gpu.sm_clocks_per_s * per_clock
    memory = nbytes / (
        gpu.hbm_bandwidth * gpu.stream_efficiency * COMPILED_CAST_BANDWIDTH_SHARE[scaling]
    )
    return max(elements / rate / kernels, memory)


GROUPED_GEMM_COMPUTE_SPEED = 0.956
"""Rate of a grouped GEMM (``torch._grouped_mm``: one CUTLASS kernel over every expert's rows)
over the tile model's cuBLAS rate where it is compute-bound: H200 data
(tests/data/kernels/h200-grouped.jsonl), the torch._grouped_mm cases of >= 1,024 rows per group
and >= 4,096 rows in all (133 cases: five models' expert shapes, 1-64 groups), median of
:func:`gemm_time` over the measured time 0.956. With few rows per group the kernel streams
every expert's weights instead, at the ``grouped_gemm`` bandwidth share."""

RECIPE_GEMM_SPEED: dict[str, dict[str, float]] = {
    "hopper": {"rowwise": 0.978, "blockwise": 0.880},
}
"""Rate of an fp8 GEMM under a low-precision recipe's scaling over the same GEMM with one
scale per operand (tensorwise, delayed), per architecture where measured: H200 data
(tests/data/kernels/h200-scaled.jsonl: ``torch._scaled_mm``, PyTorch 2.11.0, CUDA 13.0), the
Llama 3 8B/70B layer GEMMs at tp 1 and 8 and 8k tokens with every side >= 4096 (27 shapes),
each scaling timed right after the tensorwise one on the same operands; medians 0.978 with
one fp32 scale per row of A and column of B (torchao's rowwise) and 0.880 with DeepSeek-V3's
1x128 tiles of A and 128x128 blocks of B (cuBLAS applies the block scales in the main loop).
Elsewhere 1.0: Blackwell's tensor cores take block scales natively (MXFP8, NVFP4), and
Transformer Engine runs a blockwise recipe there through MXFP8 GEMMs (:mod:`stg.core.recipes`);
no such measurement of another architecture is at hand."""


def recipe_gemm_speed(arch: str, recipe: str) -> float:
    """:data:`RECIPE_GEMM_SPEED` of ``recipe`` on ``arch``: 1.0 where none is measured."""
    return RECIPE_GEMM_SPEED.get(arch, {}).get(recipe, 1.0)


ROWWISE_EPILOGUE_ELEMENTS_PER_SM_CLOCK: dict[str, float] = {"hopper": 3.79}
"""Elements of C per SM per clock (at the data sheet's peak clock) that the epilogue of an fp8
GEMM with rowwise scales (``torch._scaled_mm`` with one fp32 scale per row of A and per column
of B: torchao's ``rowwise``, which PyTorch runs through its own CUTLASS kernel, not cuBLAS)
applies the scales and writes C in bf16, per architecture where measured. Hopper: H100 and H200
data (tests/data/kernels/h100-gemm-graph.jsonl and h200-gemm-graph.jsonl,
benchmarks/measure_gemm_graph.py, PyTorch 2.11, CUDA graph timings), the rowwise GEMMs with
k = 128 of >= 30 us (14 shapes: 8192 and 32768 x 128 x 1024-14336, and the tp-8 ``wk``/``wv``
input gradients 98304 x 128 x 4096 and 131072 x 128 x 8192), C elements over (measured - A and B
streamed): 3.13-4.45, median 3.79 (H100 alone 3.77, H200 3.90), on 132 SMs at 1.83 GHz. C
leaves at 1.5-2.1 TB/s on both GPUs although the H200's HBM is 1.43x the H100's: the rate is
the SMs', not HBM's. Tensorwise scaling on the same shapes writes C at 2.0-3.2 TB/s (the
:data:`GEMM_OUTPUT_WRITE_SPEED` bound)."""


ATTENTION_BLOCK_ROWS = 128
"""Query rows per CTA of FlashAttention-2 and cuDNN's fused attention (block size Br)."""

ATTENTION_BACKWARD_WORK = 2.5
"""Backward over forward FLOPs of a fused attention kernel (it recomputes QK^T): FA2 paper,
and the flops_bwd field of the H100 data."""


@dataclass(frozen=True)
class AttentionKernel:
    """A fused attention kernel: pipeline efficiency at the sustained clock per head size
    (forward, backward) and the fixed cost of one wave of query blocks."""

    name: str
    efficiency: dict[int, tuple[float, float]]
    block_overhead_s: tuple[float, float]

    def efficiency_for(self, head_dim: int, backward: bool) -> float:
        sizes = sorted(self.efficiency)
        nearest = min(sizes, key=lambda d: (abs(d - head_dim), -d))
        return self.efficiency[nearest][1 if backward else 0]


# Hopper: H100 data, sequence >= 8192 (the saturated regime), medians over heads and masking,
# divided by the clock-scaled bf16 peak (746 TFLOP/s); backward rates count 2.5x the forward
# FLOPs. Overheads: the per-wave fixed cost that the short-sequence cases (512-2048) show.
# Ampere: FlashAttention-2 on an A100 SXM4 80GB (Dao, 2023, arXiv:2307.08691, sections 1 and
# 4.1: "up to 73% of the theoretical max throughput in the forward pass, and up to 63% ... in
# the backward pass", 230 TFLOP/s forward, over sequences of 512-16k, head size 64 and 128,
# with and without causal masking; tests/data/kernels/a100-published.jsonl). Those are short
# benchmark runs, as are the A100 GEMMs that reach the tile model's rate at the boost clock, so
# they are efficiencies at the boost clock, scaled to the sustained clock like GEMMs. d 128
# takes the maxima; d 64 keeps its earlier (0.65, 0.50): the paper's text gives no d 64 figure.
# cuDNN's fused attention is not faster there, so it gets the same figures. Overheads as
# measured on Hopper.
FUSED_ATTENTION: dict[str, dict[str, AttentionKernel]] = {
    "hopper": {
        "flash2": AttentionKernel(
            "flash2",
            # measured 293/273 (d 64) and 328/299 (d 128) TFLOP/s forward/backward
            {64: (0.393, 0.366), 128: (0.440, 0.401)},
            (1e-6, 16e-6),
        ),
        "cudnn": AttentionKernel(
            "cudnn",
            # measured 452/413 (d 64) and 613/491 (d 128) TFLOP/s forward/backward
            {64: (0.606, 0.554), 128: (0.822, 0.658)},
            (1e-6, 8e-6),
        ),
    },
    "ampere": {
        "flash2": AttentionKernel("flash2", {64: (0.65, 0.50), 128: (0.73, 0.63)}, (1e-6, 16e-6)),
        "cudnn": AttentionKernel("cudnn", {64: (0.65, 0.50), 128: (0.73, 0.63)}, (1e-6, 16e-6)),
    },
}
# Ada (L4, sm_89) runs FlashAttention-2 and cuDNN's fused attention like Ampere; no
# measurement of either on Ada at hand, so the Ampere fractions of peak apply.
FUSED_ATTENTION["ada"] = FUSED_ATTENTION["ampere"]
# Volta (V100, sm_70) and Turing (T4, sm_75) have no FlashAttention-2 or cuDNN fused attention
# kernel (FA2 needs sm_80; cuDNN's fused attention sm_80 as well): Megatron-LM runs attention
# unfused there (two batched GEMMs with the score matrix through memory). An empty table makes
# :func:`attention_time` price every fused request on them as unfused.
FUSED_ATTENTION["volta"] = {}
FUSED_ATTENTION["turing"] = {}
# Blackwell (B200, B300, GB200, GB300; sm_100), fractions of the peak at the sustained clock:
# - cudnn (cuDNN's fused attention, what Transformer Engine runs on sm_100): FlashAttention-4 is
#   "up to 1.3x faster than cuDNN 9.13" (Zadouri et al. 2026, arXiv:2603.05451;
#   together.ai/blog/flashattention-4), and ran b 4, s 8192, h 16, d 128 bf16 forward at 1,237
#   TFLOP/s on a B200 throttled to its sustained 1.58 GHz (flashinfer-ai/flashinfer pull request
#   #2899): cuDNN 1,237 / 1.3 of 148 SMs x 8,192 FLOP x 1.58 GHz. d 64 by cuDNN's own d 64 over
#   d 128 rate: about 1,150 TFLOP/s at d 64, sequence >= 8k (Dao-AILab/flash-attention pull
#   request #2605, its cuDNN column) against 1,605 / 1.3 at d 128 (FA4's paper).
# - flash2 (FlashAttention-2, PyTorch SDPA's flash backend: its sm_80 code on sm_100): cuDNN's
#   SDPA ran a 506k-token attention 2.86x faster (546.8 -> 191.2 ms, B200;
#   sgl-project/sglang pull request #33655), so cuDNN's fractions / 2.86.
# Each backward is its forward times the backward-over-forward ratio measured for cuDNN on Hopper
# (0.658/0.822 at d 128, 0.554/0.606 at d 64, H100 data), which cuDNN's own on a B200 matches
# within 5 % at d 128 (0.78-0.81, causal, 8k-32k; NVIDIA/cudnn-frontend's SDPA training
# benchmark, tests/data/kernels/blackwell-published.jsonl). Overheads as measured on Hopper.
_HOPPER_BACKWARD_RATIO = {64: 0.554 / 0.606, 128: 0.658 / 0.822}


def _with_hopper_backward(forward: dict[int, float]) -> dict[int, tuple[float, float]]:
    return {d: (f, f * _HOPPER_BACKWARD_RATIO[d]) for d, f in forward.items()}


FLASH4_B200_SUSTAINED_TFLOPS_D128 = 1237.0
B200_PEAK_AT_SUSTAINED_CLOCK_TFLOPS = 148 * 8192 * 1.58e9 / 1e12
FLASH4_OVER_CUDNN = 1.3
_CUDNN_D128 = FLASH4_B200_SUSTAINED_TFLOPS_D128 / FLASH4_OVER_CUDNN
_CUDNN_D64_OVER_D128 = 1150 / (1605 / FLASH4_OVER_CUDNN)
_BLACKWELL_CUDNN = {
    64: _CUDNN_D128 * _CUDNN_D64_OVER_D128 / B200_PEAK_AT_SUSTAINED_CLOCK_TFLOPS,
    128: _CUDNN_D128 / B200_PEAK_AT_SUSTAINED_CLOCK_TFLOPS,
}
FUSED_ATTENTION["blackwell"] = {
    "cudnn": AttentionKernel("cudnn", _with_hopper_backward(_BLACKWELL_CUDNN), (1e-6, 8e-6)),
    "flash2": AttentionKernel(
        "flash2",
        _with_hopper_backward({d: f / 2.86 for d, f in _BLACKWELL_CUDNN.items()}),
        (1e-6, 16e-6),
    ),
}
FP8_ATTENTION_SPEED: dict[str, dict[str, tuple[float, float]]] = {
    "10.0": {"fp8": (1.32, 1.30), "mxfp8": (1.22, 1.11)},
    "10.3": {"fp8": (1.59, 1.40), "mxfp8": (1.43, 1.07)},
}
"""cuDNN's fp8 fused attention over its bf16, forward and backward, per compute capability and
scaling: ``fp8`` (per-tensor E4M3 scales, Transformer Engine's delayed and current scaling) and
``mxfp8`` (E4M3 with one E8M0 scale per 32 elements, TE's ``MXFP8BlockScaling``). Each is the
median over causal and unmasked d 128 grouped-query attention at 8k, 16k and 32k tokens of
cuDNN 9.22's SDPA training benchmark on a GB200 (10.0) and a GB300 (10.3)
(NVIDIA/cudnn-frontend fb682ce, benchmark/sdpa_benchmark_training/results/llama3.1/;
tests/data/kernels/blackwell-published.jsonl, ``attention_pass``): a ratio of two rates of one
run, which no clock state changes. fp8 attention there runs at the bf16 kernel's rate times
this, not at twice it as the fp8 tensor-core peak would say: the softmax's exponentials do not
get faster with the MMA. A GPU without an entry (no measurement at hand) keeps the fp8 peak at
the bf16 kernel's efficiency."""


# CDNA 3 (MI300X, MI325X; gfx942) and CDNA 4 (MI355X; gfx950): AMD's fused attention is
# Composable Kernel's (``ck``: flash-attn's ROCm backend, PyTorch SDPA's) and AITER's hand-written
# assembly kernels (``aiter``: what Transformer Engine on ROCm and Megatron-LM's ROCm builds
# run); no separate figure for CK, which gets AITER's.
# - CDNA 3: AITER's forward reaches 480 TFLOP/s at d 128, causal (AMD-AGI/Primus-Turbo pull
#   request #43, a gfx942 build; taken as an MI300X's), of the MI300X's peak at its sustained
#   1.207 GHz (1,307.4 TFLOP/s x 1.207 / 2.1: the presets' MI300X clock); d 64 the same.
# - CDNA 4: on an MI355X the best kernels (AITER's assembly, HipKittens) run d 128 forward at
#   twice Mojo's 430 TFLOP/s (B 16, H 16, N 2048; HazyResearch, "HipKittens", 2025-11-09,
#   arXiv:2511.08083): 860 of 2,517 TFLOP/s, 0.34 (the MI355X preset keeps its data-sheet
#   clock); d 64 the same.
# Backward by the Hopper ratio, as for Blackwell.
AITER_GFX942_TFLOPS_D128 = 480.0
MI300X_PEAK_AT_SUSTAINED_CLOCK_TFLOPS = 1307.4 * 1.207 / 2.1
_CDNA3_FRACTION = AITER_GFX942_TFLOPS_D128 / MI300X_PEAK_AT_SUSTAINED_CLOCK_TFLOPS
_CDNA3_EFFICIENCY = _with_hopper_backward({64: _CDNA3_FRACTION, 128: _CDNA3_FRACTION})
_CDNA4_EFFICIENCY = _with_hopper_backward({64: 0.34, 128: 0.34})
FUSED_ATTENTION["cdna3"] = {
    "aiter": AttentionKernel("aiter", _CDNA3_EFFICIENCY, (1e-6, 16e-6)),
    "ck": AttentionKernel("ck", _CDNA3_EFFICIENCY, (1e-6, 16e-6)),
}
FUSED_ATTENTION["cdna4"] = {
    "aiter": AttentionKernel("aiter", _CDNA4_EFFICIENCY, (1e-6, 16e-6)),
    "ck": AttentionKernel("ck", _CDNA4_EFFICIENCY, (1e-6, 16e-6)),
}

ATTENTION_CHOICE: dict[str, dict[str, str]] = {
    arch: {"torchtitan": choice["eager"], **choice}
    for arch, choice in {
        "hopper": {
            "megatron": "cudnn",
            "eager": "cudnn",
            "compiled": "flash2",
            "torchtitan": "flash2",
        },
        "ampere": {"megatron": "flash2", "eager": "flash2", "compiled": "flash2"},
        "ada": {"megatron": "flash2", "eager": "flash2", "compiled": "flash2"},
        "blackwell": {"megatron": "cudnn", "eager": "flash2", "compiled": "cudnn"},
        "cdna3": {"megatron": "aiter", "eager": "ck", "compiled": "ck"},
        "cdna4": {"megatron": "aiter", "eager": "ck", "compiled": "ck"},
    }.items()
}
"""The fused attention kernel each training stack runs per architecture: Megatron-LM with
Transformer Engine runs cuDNN's fused attention on Hopper and Blackwell (TE's backend
preference on sm_90 and sm_100), FlashAttention-2 on Ampere and Ada, AITER's kernels on ROCm
(TE's ROCm fused attention); eager PyTorch's SDPA runs its flash backend (FlashAttention-2 on
NVIDIA, Composable Kernel's on ROCm), except on Hopper, where PyTorch puts cuDNN's first
(``check_prefer_cudnn_attention`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``:
cuDNN 9.9 or later on compute capability 9.0 and 10.0). Measured: with PyTorch 2.11.0+cu130
and cuDNN 9.19, ``torch._fused_sdp_choice`` names cuDNN for every causal head shape of the
eager steps on an H100, grouped-query heads included
(tests/data/kernels/h100-attention-gqa.jsonl, ``extra.chosen``), and a training step on an
H200 dispatched ``_scaled_dot_product_cudnn_attention`` (tests/data/eager/
h200-eager-op-counts.json). The same rule gives cuDNN on the B200 and GB200 (10.0) but not
the B300 and GB300 (10.3): where a system names its compute capability,
:func:`attention_kernel_for` applies the rule itself (:data:`SDPA_CUDNN_FIRST`), else it takes
the architecture's entry (Blackwell's FlashAttention-2). Volta and Turing have no fused kernel
(unfused).
torchtitan (``compiled``) calls SDPA under ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION,
MATH], set_priority=True)``, with ``CUDNN_ATTENTION`` put first only from compute capability
10.0 on (Blackwell: B200 and GB200 10.0, B300 and GB300 10.3)
(``torchtitan/models/attention.py``, ``ScaledDotProductAttention._init_backend``, at e7c0cae,
2025-06): FlashAttention-2 on Hopper too, SDPA's flash backend being FlashAttention-2 until
PyTorch 2.12's opt-in ``activate_flash_attention_impl`` (pytorch/pytorch issue #131309).
torchtitan's eager Llama of 2024 (``torchtitan``: ``F.scaled_dot_product_attention`` with no
backend chosen, pytorch/torchtitan 1ea476e9f ``torchtitan/models/llama/model.py:204``) runs
SDPA's own choice as the PyTorch of 2024 made it: FlashAttention-2 (its ``torchtitan``
entry), the preference for cuDNN above being gated on cuDNN 9.9, a 2025 release."""


ATTENTION_BACKEND_KERNELS: dict[str, dict[str, str]] = {
    "nvidia": {"flash": "flash2", "fused": "cudnn"},
    "amd": {"flash": "ck", "fused": "aiter"},
}
"""The kernel of each attention backend a run names (Megatron-LM's ``--attention-backend``,
Transformer Engine's ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN``; :mod:`stg.core.attention_backend`)
by vendor: ``flash`` is the flash-attn package (FlashAttention-2 on NVIDIA; its ROCm backend is
Composable Kernel's), ``fused`` the vendor library (cuDNN; AITER in TE's ROCm build)."""

AMD_ARCHS = ("cdna3", "cdna4")

SDPA_CUDNN_FIRST = frozenset({"9.0", "10.0"})
"""The NVIDIA compute capabilities on which eager PyTorch's SDPA tries cuDNN's attention first
(``check_prefer_cudnn_attention``: major 9 or 10, minor 0; :data:`ATTENTION_CHOICE`)."""


def attention_kernel_for(
    arch: str, profile: str, backend: str = "auto", compute_capability: str | None = None
) -> str:
    """The fused attention kernel that ``profile`` (``megatron``, ``eager``, ``compiled``) runs
    on ``arch``:
    the run's ``backend`` (``flash``, ``fused``: :data:`ATTENTION_BACKEND_KERNELS`) where it
    names one; for the eager profile on an NVIDIA GPU whose ``compute_capability`` is given,
    cuDNN's where SDPA puts it first (:data:`SDPA_CUDNN_FIRST`), else FlashAttention-2; else
    :data:`ATTENTION_CHOICE`; ``flash2`` where the architecture has no entry (Volta and
    Turing price it unfused, having no fused kernel)."""
    if backend != "auto":
        return ATTENTION_BACKEND_KERNELS["amd" if arch in AMD_ARCHS else "nvidia"][backend]
    if profile == "eager" and compute_capability is not None and arch not in AMD_ARCHS:
        return "cudnn" if compute_capability in SDPA_CUDNN_FIRST else "flash2"
    return ATTENTION_CHOICE.get(arch, {}).get(profile, "flash2")


UNFUSED_SCORE_BYTES: dict[str, tuple[float, float]] = {
    "forward": (39.0, 0.22),
    "backward": (33.0, 0.44),
}
"""Bytes PyTorch's unfused (math) attention moves per score element beyond its two GEMMs,
as ``a + b·head_dim`` (scores, mask, softmax in fp32, dropout and their gradients through
HBM): H100 data, math backend, sequence 2048-4096, non-causal: 52-54 B (d 64) and 66-67 B
(d 128) forward, 60-64 and 87-92 backward. Causal masking adds ``UNFUSED_CAUSAL_BYTES``."""

UNFUSED_CAUSAL_BYTES = 13.0
"""Extra bytes per score element forward for the causal mask (H100 data: causal minus
non-causal math-backend cases, 12-14 B)."""


# ---------------------------------------------------------------------------------------------
# The GPU


TENSOR_DTYPES = frozenset({"tf32", "bf16", "fp16", "fp8", "int8", "fp6", "fp4"})


@dataclass(frozen=True)
class Gpu:
    """One GPU as the kernel models see it. Peaks are dense (not 2:4 sparse), at the boost
    clock, in operations per second; bandwidth in bytes per second."""

    sm_count: int
    peak_clock_ghz: float
    """the clock at which the data sheet's tensor-core peaks are computed"""
    sustained_clock_ghz: float
    """the SM clock under sustained tensor-core load (power-capped)"""
    peak_flops: dict[str, float]
    hbm_bandwidth: float
    arch: str = "hopper"
    """the GPU generation whose attention kernels apply (a key of :data:`FUSED_ATTENTION`)"""
    compute_capability: str | None = None
    """NVIDIA's ``"major.minor"`` where known (:data:`FP8_ATTENTION_SPEED` is keyed by it)"""
    stream_efficiency: float = STREAM_EFFICIENCY
    """fraction of ``hbm_bandwidth`` that streaming kernels reach"""

    def rate(self, dtype: str) -> float:
        """Operations per second that the best kernel sustains on large problems."""
        peak = self.peak_flops[dtype]
        if dtype in TENSOR_DTYPES:
            speed = ARCH_DTYPE_GEMM_SPEED.get(self.arch, {}).get(dtype, 1.0)
            return peak * self.clock_scale * self.gemm_efficiency * speed
        return peak * FP32_SIMT_EFFICIENCY

    @property
    def sm_clocks_per_s(self) -> float:
        """SM clock cycles per second over all SMs at the data sheet's peak clock: what a rate
        measured in elements per SM per clock is multiplied by."""
        return self.sm_count * self.peak_clock_ghz * 1e9

    @property
    def clock_scale(self) -> float:
        return self.sustained_clock_ghz / self.peak_clock_ghz

    @property
    def gemm_efficiency(self) -> float:
        """Fraction of the clock-scaled tensor-core peak that cuBLAS sustains on large GEMMs."""
        return ARCH_GEMM_PIPE_EFFICIENCY.get(self.arch, GEMM_PIPE_EFFICIENCY)

    @property
    def attention_kernels(self) -> dict[str, AttentionKernel]:
        return FUSED_ATTENTION.get(self.arch, FUSED_ATTENTION["hopper"])

    def stream_time(self, nbytes: float, kind: str = "stream", dtype: str = "bf16") -> float:
        seconds = nbytes / (self.hbm_bandwidth * self.stream_efficiency * MEMORY_KERNEL_SPEED[kind])
        width = DTYPE_BYTES.get(dtype, 2)
        if kind == "softmax" and width < 4:  # one read and one write per element
            elements = nbytes / (2 * width)
            rate = self.sm_clocks_per_s * SOFTMAX_16BIT_ELEMENTS_PER_SM_CLOCK
            seconds = max(seconds, elements / rate)
        return seconds


DTYPE_BYTES = {
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "fp6": 0.75,
    "fp4": 0.5,
}


def gemm_time(
    gpu: Gpu,
    m: int,
    n: int,
    k: int,
    dtype: str = "bf16",
    batch: int = 1,
    nbytes: float | None = None,
) -> float:
    """Seconds of ``batch`` GEMMs ``[m, k] x [k, n]`` in ``dtype`` (output in the same width,
    fp8/int8 with a 16-bit output). ``nbytes``: what the kernel moves where it is not A, B
    and C once (an implicit-GEMM convolution reads its input, not the ``[m, k]`` window
    matrix)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    width = DTYPE_BYTES[dtype]
    output = m * n * max(width, 2) * batch
    memory = (m * k + k * n) * width * batch + output
    if nbytes is not None:
        memory = nbytes
    # C leaves through the epilogue, slower than a streaming kernel writes
    slower_write = 1 / GEMM_OUTPUT_WRITE_SPEED.get(gpu.arch, 1.0) - 1
    memory_time = gpu.stream_time(memory + output * slower_write)
    return max(_gemm_tile_time(gpu, m, n, k, dtype, batch), memory_time)


def grouped_gemm_time(gpu: Gpu, groups: int, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """Seconds of a grouped GEMM over ``groups`` experts of ``[m, k] x [k, n]`` each (a
    mixture's experts as ``torch._grouped_mm`` runs them): the tile model's time at the
    grouped kernel's rate (:data:`GROUPED_GEMM_COMPUTE_SPEED`), bounded below by its A, B and C
    streamed at the ``grouped_gemm`` bandwidth share (few rows per expert: every expert's
    weights are read for little work)."""
    if min(m, n, k, groups) <= 0:
        return 0.0
    width = DTYPE_BYTES[dtype]
    memory = ((m * k + k * n) * width + m * n * max(width, 2)) * groups
    compute = _gemm_tile_time(gpu, m, n, k, dtype, groups, split_k=False)
    compute /= GROUPED_GEMM_COMPUTE_SPEED
    return max(compute, gpu.stream_time(memory, "grouped_gemm"))


def scaled_gemm_time(
    gpu: Gpu,
    m: int,
    n: int,
    k: int,
    recipe: str,
    batch: int = 1,
    nbytes: float | None = None,
) -> float:
    """Seconds of ``batch`` fp8 GEMMs ``[m, k] x [k, n]`` (bf16 output) under a low-precision
    ``recipe``'s scaling: the tensorwise GEMM's :func:`gemm_time` over the recipe's
    :data:`RECIPE_GEMM_SPEED`, except rowwise scales where their epilogue rate is measured
    (:data:`ROWWISE_EPILOGUE_ELEMENTS_PER_SM_CLOCK`): PyTorch's CUTLASS kernel for them splits
    no ``k`` (the tile model without split-K, at the recipe's speed), and it is bound below by
    reading A and B at the streaming rate, then writing C at the epilogue's element rate or, on
    a GPU whose HBM is slower than that, at a GEMM epilogue's share of the HBM bandwidth
    (:data:`GEMM_OUTPUT_WRITE_SPEED`, as :func:`gemm_time` writes it)."""
    speed = recipe_gemm_speed(gpu.arch, recipe)
    rate = ROWWISE_EPILOGUE_ELEMENTS_PER_SM_CLOCK.get(gpu.arch)
    if recipe != "rowwise" or rate is None or min(m, n, k, batch) <= 0:
        return gemm_time(gpu, m, n, k, "fp8", batch, nbytes) / speed
    elements = m * n * batch
    # what the kernel reads: A and B in fp8, or ``nbytes`` less C (16-bit) where given
    read = (m * k + k * n) * batch if nbytes is None else max(nbytes - 2 * elements, 0.0)
    sm_write = elements / (gpu.sm_clocks_per_s * rate)
    hbm_write = gpu.stream_time(2 * elements / GEMM_OUTPUT_WRITE_SPEED.get(gpu.arch, 1.0))
    epilogue = gpu.stream_time(read) + max(sm_write, hbm_write)
    tiles = _gemm_tile_time(gpu, m, n, k, "fp8", batch, split_k=False) / speed
    return max(tiles, epilogue)


def scatter_add_time(gpu: Gpu, elements: float, dtype: str = "bf16") -> float:
    """Seconds of PyTorch's ``index_add_`` adding ``elements`` values into their target rows
    with atomics (:data:`SCATTER_ADD_ELEMENTS_PER_SM_CLOCK`)."""
    width = 4 if DTYPE_BYTES.get(dtype, 2) >= 4 else 2
    rate = gpu.sm_clocks_per_s * SCATTER_ADD_ELEMENTS_PER_SM_CLOCK[width]
    return elements / rate


def _gemm_tile_time(
    gpu: Gpu, m: int, n: int, k: int, dtype: str, batch: int, split_k: bool = True
) -> float:
    """The tile model's time of ``batch`` GEMMs (waves of CTA tiles; split-K where
    ``split_k``), no memory bound."""
    per_sm = gpu.rate(dtype) / gpu.sm_count
    best = math.inf
    for tile_m, tile_n in ARCH_GEMM_TILES.get(gpu.arch, GEMM_TILES):
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * batch
        split = 1
        while True:
            waves = math.ceil(tiles * split / gpu.sm_count)
            t = waves * (2 * tile_m * tile_n * math.ceil(k / split) / per_sm + GEMM_TILE_OVERHEAD_S)
            if split > 1:  # fp32 partial sums written, then read by the reduction
                t += gpu.stream_time(2 * 4 * m * n * batch * split)
            best = min(best, t)
            split *= 2
            if not split_k or tiles * split > 2 * gpu.sm_count or k // split < SPLIT_K_MIN:
                break
    return best


AttentionImpl = Literal["flash2", "cudnn", "ck", "aiter", "unfused"]


def attention_flops(
    batch: int, heads: int, s_q: int, s_kv: int, head_dim: int, causal: bool
) -> float:
    """Textbook FLOPs of the attention core forward (QK^T and AV): 4·b·h·s_q·s_kv·d, halved
    under causal masking."""
    flops = 4.0 * batch * heads * s_q * s_kv * head_dim
    return flops / 2 if causal else flops


def attention_time(
    gpu: Gpu,
    impl: str,
    batch: int,
    heads: int,
    s_q: int,
    s_kv: int,
    head_dim: int,
    *,
    causal: bool = True,
    backward: bool = False,
    dtype: str = "bf16",
    causal_split: int = 1,
    window: int = 0,
    chunk: int = 0,
    topk: int = 0,
    fp8_scaling: str = "fp8",
) -> float:
    """Seconds of the attention core (scores, softmax, context) forward or backward.
    ``causal_split`` > 1: the ``s_q = s_kv / causal_split`` queries are one context-parallel
    rank's load-balanced share of a causal sequence (chunks ``i`` and ``2·cp-1-i`` of
    ``2·cp``), whose blocks up to the diagonal are ``1/causal_split`` of the whole.
    ``window`` / ``chunk`` (causal, ``s_q == s_kv`` or a balanced share): each query sees its
    ``window`` latest keys (FlashAttention's ``window_size=(window - 1, 0)``) or those of its
    own ``chunk``; a query block visits only the key blocks its rows reach
    (:func:`masked_kv_blocks`; a balanced share, as many as the whole sequence's on average);
    ``topk``: each query sees the ``topk`` keys an indexer picked (sparse attention), gathered
    in blocks: as many blocks as that many keys fill, at most its causal ones.
    ``fp8_scaling`` (``dtype`` fp8): ``fp8`` (per-tensor scales) or ``mxfp8`` (block scales),
    whose measured speed over bf16 applies where known (:data:`FP8_ATTENTION_SPEED`)."""
    if min(batch, heads, s_q, s_kv, head_dim) <= 0:
        return 0.0
    if impl == "unfused":
        return _unfused_attention_time(
            gpu, batch, heads, s_q, s_kv, head_dim, causal=causal, backward=backward, dtype=dtype
        )
    kernel = gpu.attention_kernels.get(impl)
    if kernel is None:  # no fused kernel on this GPU (Volta, Turing): the unfused path
        return _unfused_attention_time(
            gpu, batch, heads, s_q, s_kv, head_dim, causal=causal, backward=backward, dtype=dtype
        )
    rows = ATTENTION_BLOCK_ROWS
    q_blocks = math.ceil(s_q / rows)
    kv_blocks = math.ceil(s_kv / rows)
    balanced = causal_split > 1 and s_q * causal_split == s_kv
    if topk and not (s_q == s_kv or balanced):  # new tokens against a cache: picked keys
        kv_per_block = rows * min(kv_blocks, math.ceil(topk / rows))
    elif causal:  # block i attends to the kv blocks up to the diagonal: on average (n + 1) / 2
        # (also per query block of a load-balanced context-parallel share: its two chunks,
        # i and 2·cp-1-i, reach (i + 1) and (2·cp - i) chunks of keys, together n + 1 blocks)
        full = s_q == s_kv or balanced
        kv_per_block = rows * (kv_blocks + 1) / 2 if full else rows * kv_blocks
        if (window or chunk or topk) and full:  # a balanced share: the whole sequence's mean
            kv_per_block = rows * masked_kv_blocks(s_kv, rows, window, chunk, topk)
    else:
        kv_per_block = rows * kv_blocks
    blocks = batch * heads * q_blocks
    splits = 1
    if not backward and s_q < s_kv and blocks < gpu.sm_count and not balanced:
        # split-KV (Flash-Decoding; FlashAttention's num_splits): a few query rows against a
        # long cache leave SMs idle, so the keys are split over CTAs that each attend to a
        # part, and a second pass combines their fp32 partial outputs
        visited = math.ceil(kv_per_block / rows)  # kv_blocks, or a sparse query's picks
        splits = min(visited, math.ceil(gpu.sm_count / blocks))
        kv_per_block = rows * math.ceil(visited / splits)
    work = 4.0 * rows * kv_per_block * head_dim
    if backward:
        work *= ATTENTION_BACKWARD_WORK
    efficiency = kernel.efficiency_for(head_dim, backward)
    measured = FP8_ATTENTION_SPEED.get(gpu.compute_capability or "", {})
    fp8_speed = measured.get(fp8_scaling) if dtype == "fp8" else None
    if fp8_speed is not None:  # the bf16 kernel's rate times cuDNN's measured fp8 speed-up
        dtype, efficiency = "bf16", efficiency * fp8_speed[1 if backward else 0]
    peak = gpu.peak_flops[dtype] * gpu.clock_scale
    per_sm = peak * efficiency / gpu.sm_count
    waves = math.ceil(blocks * splits / gpu.sm_count)
    seconds = waves * (work / per_sm + kernel.block_overhead_s[1 if backward else 0])
    if splits > 1:  # partial outputs and their log-sum-exp written, then read and reduced
        seconds += gpu.stream_time(2 * 4 * splits * batch * heads * s_q * (head_dim + 1))
    return seconds


def masked_kv_blocks(seq: int, rows: int, window: int, chunk: int, topk: int = 0) -> float:
    """Key blocks of ``rows`` keys a query block of ``rows`` queries visits, on average, in
    causal self-attention over ``seq`` tokens where each query sees its ``window`` latest
    keys (``window`` > 0) or the keys of its own aligned ``chunk`` up to itself: from the
    block of the first key its first row sees to its own diagonal block; or (``topk`` > 0)
    the ``topk`` keys picked for it, gathered into ``topk / rows`` blocks, at most its
    causal ones."""
    q_blocks = math.ceil(seq / rows)
    if topk:
        gathered = math.ceil(topk / rows)
        return sum(min(gathered, block + 1) for block in range(q_blocks)) / q_blocks
    visited = 0
    for block in range(q_blocks):
        first_query = block * rows
        first_key = max(0, first_query - window + 1) if window else first_query // chunk * chunk
        visited += block - first_key // rows + 1
    return visited / q_blocks


def _unfused_attention_time(
    gpu: Gpu,
    batch: int,
    heads: int,
    s_q: int,
    s_kv: int,
    head_dim: int,
    *,
    causal: bool,
    backward: bool,
    dtype: str,
) -> float:
    bh = batch * heads
    gemms = gemm_time(gpu, s_q, s_kv, head_dim, dtype, bh) + gemm_time(
        gpu, s_q, head_dim, s_kv, dtype, bh
    )
    a, b = UNFUSED_SCORE_BYTES["backward" if backward else "forward"]
    per_element = a + b * head_dim + (UNFUSED_CAUSAL_BYTES if causal and not backward else 0)
    # the score bytes were measured beyond GEMMs whose output left at the streaming rate; the
    # score-writing GEMMs (one forward, two in the doubled backward) now pay for their slower
    # epilogue themselves
    slower_write = 1 / GEMM_OUTPUT_WRITE_SPEED.get(gpu.arch, 1.0) - 1
    per_element -= (2 if backward else 1) * DTYPE_BYTES.get(dtype, 2) * slower_write
    scores = gpu.stream_time(per_element * bh * s_q * s_kv)
    return (2 * gemms if backward else gemms) + scores


NORM_NAMES = ("norm", "ln_", "ln1", "ln2", "bn")
"""Op names of normalisation-class memory-bound kernels (LayerNorm, RMSNorm, batch norm as
torchvision names it, ``bn1``)."""


def memory_kind(name: str) -> str:
    """The memory-bound kernel class of a compute node by its name (the last path component,
    up to its first dot): ``softmax``, ``norm`` (LayerNorm, RMSNorm, batch norm), ``dropout``
    (a dropout forward, its bytes counting the mask; its gradient ``*dropout.grad_*`` is a
    ``stream`` kernel) or ``stream``."""
    last = name.rsplit("/", 1)[-1].lower()
    base = last.split(".", 1)[0]
    if "dropout" in base:
        return "stream" if ".grad" in last else "dropout"
    if "softmax" in base:
        return "softmax"
    if any(n in base for n in NORM_NAMES):
        return "norm"
    return "stream"


def memory_bound_time(gpu: Gpu, nbytes: float, kind: str = "stream", dtype: str = "bf16") -> float:
    """Seconds of a memory-bound kernel of class ``kind`` (``stream``, ``norm``, ``softmax``)
    moving ``nbytes`` (reads plus writes) of ``dtype`` elements."""
    return gpu.stream_time(nbytes, kind, dtype)
