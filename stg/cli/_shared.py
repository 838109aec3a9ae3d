"""What several commands share, so that no command module imports another.

- the generation options as CLI parameters and their parsing: every field of
  :class:`stg.core.options.GenerateOptions` as a typer option (:func:`option_parameters`,
  used by ``stg generate``, ``stg predict`` and ``stg plan precision``), the ``--system``
  option (:func:`system_parameter`) and :func:`options_from_cli`;
- plain flags in ``--help`` (:func:`plain_flags_in_help`);
- option values coerced without pydantic where typer's result is certain
  (:func:`light_coercion`);
- the progress bar of a long build, and its warnings (:func:`progress_bar`);
- running predictors on a workload or a trace and printing their reports
  (:func:`run_predictors`, :func:`print_reports`, :func:`print_table`);
- trace-analysis helpers of ``stg feed`` and ``stg inspect trace`` (:func:`check_common`,
  :func:`run_analysis` and their help texts);
- formatting (:func:`format_seconds`, :func:`format_bytes`).

Not a command: modules of ``stg.cli`` whose name starts with ``_`` are skipped. Heavy imports
stay inside the functions, so a command pays only for what it uses.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, get_args, get_origin

import typer

from stg.errors import UserError, check_replaceable

if TYPE_CHECKING:
    from stg.core.options import GenerateOptions, PresetUse
    from stg.host.registry import Registry
    from stg.trace.stats import TraceStats

# -- the generation options as CLI parameters -------------------------------------------------

TRUE_WORDS = ("true", "t", "yes", "y", "1")
FALSE_WORDS = ("false", "f", "no", "n", "0")
RECOMPUTE_VALUES = ("none", "selective", "selective_op", "full")
BOOL = "true|false"
"""Metavar of the original STG's booleans, which take a value (``--tpsp false``)."""
SCHEMA_FORMATS = {"v0.0.4": "chakra-v0.0.4", "v0.0.1": "chakra-v0.0.1", "json": "json"}


def parse_bool(value: str) -> bool:
    """``true/t/yes/y/1`` or ``false/f/no/n/0`` (any case), as the original STG's flags."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise typer.BadParameter(
        f"{value!r} is not a boolean; allowed: {', '.join(TRUE_WORDS + FALSE_WORDS)} (any case)"
    )


def parse_recompute(value: str) -> str:
    """``none|selective|selective_op|full``; ``true`` means full and ``false`` none (the
    original flag)."""
    word = value.strip().lower()
    if word in RECOMPUTE_VALUES:
        return word
    if word in TRUE_WORDS:
        return "full"
    if word in FALSE_WORDS:
        return "none"
    raise typer.BadParameter(
        f"{value!r} is not allowed; allowed: {', '.join(RECOMPUTE_VALUES)} (or true/false)"
    )


def parse_placement(value: str) -> tuple[tuple[str, int], ...]:
    """``v100:4,t4:4`` as ``GenerateOptions.placement``."""
    runs = []
    for part in value.split(","):
        name, _, count = part.strip().partition(":")
        if not name or not count.strip().isdigit() or int(count) <= 0:
            raise typer.BadParameter(
                f"{value!r}: give runs GROUP:RANKS in rank order, e.g. v100:4,t4:4"
            )
        runs.append((name, int(count)))
    return tuple(runs)


def parse_layer_counts(value: str) -> tuple[int, ...]:
    """``1,4,4,3`` as ``GenerateOptions.pipeline_layers``."""
    parts = [part.strip() for part in value.split(",")]
    if not parts or not all(part.isdigit() for part in parts):
        raise typer.BadParameter(
            f"{value!r}: give the layers of every model chunk, comma-separated integers >= 0 "
            "(e.g. 0,4,4,4)"
        )
    return tuple(int(part) for part in parts)


def parse_modules(value: str) -> tuple[str, ...]:
    """``core_attn,mlp`` as ``GenerateOptions.recompute_modules`` (names checked with the
    other options)."""
    return tuple(part.strip().lower() for part in value.split(",") if part.strip())


def parse_precision_plan(value: str) -> tuple[tuple[str, str], ...]:
    """A precision plan file (see :mod:`stg.core.precision`) as ``GenerateOptions.precision``."""
    from stg.core.precision import load_plan

    try:
        return load_plan(value)
    except UserError as exc:
        raise typer.BadParameter(str(exc)) from None


@dataclass(frozen=True)
class _Spec:
    help: str
    aliases: tuple[str, ...] = ()
    parser: Callable[[str], Any] | None = None
    metavar: str | None = None


_MODEL = "Model"
_PARALLEL = "Parallelism"
_TRAINING = "Training"
_OUTPUT = "Output"
_SERVING = "Serving (inference phases)"

# help text and extra spellings per GenerateOptions field (panel, spec)
SPECS: dict[str, tuple[str, _Spec]] = {
    "model": (
        _MODEL,
        _Spec(
            "Model template (a registered model name or alias, or dist:name) or a named "
            "preset that fills its sizes (sizes given win; stg inspect model lists them) - "
            "{allowed:models}; the original STG's names work too: dense = gpt, debug = a tiny "
            "gpt (4 layers, dmodel 256).",
            ("--model_type", "--model-type"),
            metavar="NAME",
        ),
    ),
    "dvocal": (_MODEL, _Spec("Vocabulary size V.")),
    "dmodel": (_MODEL, _Spec("Hidden size h.")),
    "dff": (_MODEL, _Spec("FFN hidden size F.")),
    "batch": (_MODEL, _Spec("Global batch: samples per iteration.")),
    "micro_batch": (
        _MODEL,
        _Spec(
            "Global micro-batch: a positive divisor of --batch, or -1 for the whole batch "
            "(default: -1)."
        ),
    ),
    "seq": (_MODEL, _Spec("Sequence length s.")),
    "head": (_MODEL, _Spec("Attention heads a.")),
    "kvhead": (_MODEL, _Spec("Key/value heads (GQA).")),
    "dhead": (_MODEL, _Spec("Size of one attention head (default: dmodel/head).")),
    "num_stacks": (_MODEL, _Spec("Transformer layers L.")),
    "experts": (_MODEL, _Spec("Experts per MoE layer.")),
    "kexperts": (_MODEL, _Spec("Experts each token is routed to (top-k).")),
    "capacity_factor": (
        _MODEL,
        _Spec(
            "MoE capacity factor of --moe_routing capacity: ceil(cf·k·tokens/E) per expert of "
            "each rank's tokens, as Megatron-LM caps them."
        ),
    ),
    "moe_routing": (
        _MODEL,
        _Spec(
            "MoE routing: capacity (tokens above --capacity_factor dropped; 1 = balanced) or "
            "dropless (Megatron's default: each expert shaped for the expected most loaded "
            "one's tokens).",
            metavar="MODE",
        ),
    ),
    "shared_experts": (
        _MODEL,
        _Spec(
            "Shared experts of dff beside the routed ones, used by every token (DeepSeek, "
            "Llama 4, Qwen3-Next, GLM-4.5; moe, deepseek and hybrid E layers)."
        ),
    ),
    "dense_layers": (
        _MODEL,
        _Spec(
            "Dense layers before the MoE layers (DeepSeek-V3, GLM-4.5: 3; at most num_stacks-1)."
        ),
    ),
    "dense_dff": (
        _MODEL,
        _Spec("FFN hidden size of the dense layers and hybrid - layers (default: dff)."),
    ),
    "q_lora_rank": (
        _MODEL,
        _Spec("Latent attention: rank of the query compression (unset: no compression)."),
    ),
    "kv_lora_rank": (
        _MODEL,
        _Spec("Latent attention: rank of the key/value latent (default: 4·dhead)."),
    ),
    "mtp_depth": (
        _MODEL,
        _Spec("Multi-token prediction modules after the head (DeepSeek-V3: 1; default: none)."),
    ),
    "drope": (
        _MODEL,
        _Spec("Latent attention: decoupled RoPE dimension per head (default: dhead/2)."),
    ),
    "attention_window": (
        _MODEL,
        _Spec("Sliding-window attention: keys each query sees (causal; default: all)."),
    ),
    "attention_chunk": (
        _MODEL,
        _Spec("Chunked local attention: tokens per chunk (causal; Llama 4: 8192)."),
    ),
    "full_attention_every": (
        _MODEL,
        _Spec("Every k-th layer attends to all keys, the others to a window or chunk."),
    ),
    "attention_sinks": (
        _MODEL,
        _Spec(
            "A learned sink logit per attention head (gpt-oss).", parser=parse_bool, metavar=BOOL
        ),
    ),
    "attention_output_gate": (
        _MODEL,
        _Spec(
            "Gate attention's output by a sigmoid of a projection (Qwen3-Next).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "tie_embeddings": (
        _MODEL,
        _Spec(
            "One matrix for the word embedding and the LM head (MPT, Llama 3.2 1B/3B); with "
            "pp > 1 a copy on the last stage, gradients all-reduced over the first and last.",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "layer_pattern": (
        _MODEL,
        _Spec(
            "Hybrid stack, a letter per layer: M Mamba-2, G gated DeltaNet, * attention, "
            "A global attention, - MLP, E MoE.",
            metavar="PATTERN",
        ),
    ),
    "mlp_activation": (
        _MODEL,
        _Spec("Hybrid MLP layers: swiglu (default) or relu2 (Nemotron-H).", metavar="NAME"),
    ),
    "ssm_state": (_MODEL, _Spec("Mamba-2: state size per head (d_state; default: 128).")),
    "ssm_heads": (_MODEL, _Spec("Mamba-2: SSM heads (default: 2·dmodel / ssm_head_dim).")),
    "ssm_head_dim": (_MODEL, _Spec("Mamba-2: size of one SSM head (default: 64).")),
    "ssm_groups": (_MODEL, _Spec("Mamba-2: groups sharing B and C (default: 1).")),
    "ssm_chunk": (_MODEL, _Spec("Mamba-2: chunk of the SSD algorithm (default: 256).")),
    "linear_key_heads": (_MODEL, _Spec("Gated DeltaNet: query/key heads (default: head).")),
    "linear_value_heads": (
        _MODEL,
        _Spec("Gated DeltaNet: value heads (default: linear_key_heads)."),
    ),
    "index_topk": (
        _MODEL,
        _Spec("DeepSeek sparse attention: keys per query the indexer picks (V3.2: 2048)."),
    ),
    "index_heads": (_MODEL, _Spec("DeepSeek sparse attention: indexer heads (default: 64).")),
    "index_head_dim": (
        _MODEL,
        _Spec("DeepSeek sparse attention: size of an indexer head (default: 128)."),
    ),
    "linear_head_dim": (_MODEL, _Spec("Gated DeltaNet: size of a key/value head (default: 128).")),
    "dp": (_PARALLEL, _Spec("Data-parallel degree.")),
    "tp": (_PARALLEL, _Spec("Tensor-parallel degree (--mp: the original STG's name).", ("--mp",))),
    "sp": (_PARALLEL, _Spec("Sequence/context-parallel degree.", ("--cp",))),
    "pp": (_PARALLEL, _Spec("Pipeline-parallel degree.")),
    "ep": (_PARALLEL, _Spec("Expert-parallel degree.")),
    "ep_layout": (
        _PARALLEL,
        _Spec(
            "How --ep places experts: multiply (ep is a mesh axis of its own, dp·tp·sp·pp·ep "
            "ranks) or fold (Megatron's MoE parallel folding: ep·etp ranks of the dp·tp·sp "
            "ranks of a stage hold the experts, dp·tp·sp·pp ranks). Default: multiply, or "
            "fold where --etp is given.",
            metavar="multiply|fold",
        ),
    ),
    "etp": (
        _PARALLEL,
        _Spec(
            "Expert tensor parallelism: ranks that split each expert's FFN (Megatron's "
            "--expert-tensor-parallel-size; implies --ep_layout fold; default: tp).",
            metavar="N",
        ),
    ),
    "tpsp": (
        _PARALLEL,
        _Spec("Megatron sequence parallelism inside TP.", parser=parse_bool, metavar=BOOL),
    ),
    "weight_sharded": (
        _PARALLEL,
        _Spec(
            "Shard weights, gradients and optimizer states over dp·sp as one flat, padded "
            "buffer per layer (FSDP / ZeRO-3).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "zero": (
        _PARALLEL,
        _Spec("ZeRO stage: 0, 1, 2 or 3 (3 is --weight_sharded true).", metavar="0|1|2|3"),
    ),
    "reshard_after_forward": (
        _PARALLEL,
        _Spec(
            "FSDP (--weight_sharded): free a layer's gathered weights after its forward "
            "(always: gathered again before its backward) or keep them (never); default: "
            "never with pp > 1, always without (torchtitan's fsdp_reshard_after_forward).",
            metavar="default|always|never",
        ),
    ),
    "cp_comm_type": (
        _PARALLEL,
        _Spec(
            "Context parallelism (--sp): p2p passes keys and values around a ring, overlapped "
            "with the attention steps; all_gather gathers them before the attention and its "
            "backward (Megatron's --cp-comm-type; default p2p, as there). Under --profile "
            "compiled or torchtitan, all_gather is PyTorch's context_parallel with its "
            "all-gather rotation (torchtitan's default).",
            metavar="p2p|all_gather",
        ),
    ),
    "overlap_param_gather": (
        _PARALLEL,
        _Spec(
            "ZeRO-1/2 (distributed optimizer): each layer's parameter all-gather overlaps the "
            "next iteration's forward (Megatron's --overlap-param-gather; default off, as there).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "tp_comm_overlap": (
        _PARALLEL,
        _Spec(
            "Tensor-parallel all-gathers and reduce-scatters split into chunks and overlapped "
            "with their GEMMs (Megatron/Transformer Engine --tp-comm-overlap; needs --tpsp).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "overlap_moe_ep_comm": (
        _PARALLEL,
        _Spec(
            "MoE expert-parallel all-to-alls of one micro-batch's forward hidden behind another's "
            "backward compute and vice versa: combined 1F1B steps (Megatron's "
            "--overlap-moe-expert-parallel-comm; needs ep > 1, and with pp > 1 "
            "pipeline_schedule=interleaved; default off, as there).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "moe_sort_by_expert": (
        _PARALLEL,
        _Spec(
            "Copy the tokens an expert-parallel all-to-all brings into local-expert order, and "
            "back before the return all-to-all, forward and backward (Megatron-core's alltoall "
            "token dispatcher, moe_token_dispatcher_type alltoall; needs ep > 1 and "
            "profile=megatron; default off: one permutation each way, as the flex dispatcher).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "moe_dispatcher": (
        _PARALLEL,
        _Spec(
            "Library of the expert-parallel all-to-alls: alltoall (NCCL's all-to-all of every "
            "routed copy, Megatron-core's alltoall dispatcher), deepep or hybridep (a token "
            "sent once per destination rank and node, at the kernels' rates measured on H100; "
            "Megatron-core's flex dispatcher, NeMo AutoModel's dispatcher; needs ep > 1).",
            metavar="NAME",
        ),
    ),
    "moe_gate": (
        _PARALLEL,
        _Spec(
            "Where a token's experts fall, for --moe_dispatcher deepep or hybridep: random "
            "(k distinct experts at random; default) or consecutive (token t takes experts "
            "t·k to t·k+k-1: NeMo AutoModel's fake balanced gate; needs --moe_routing "
            "capacity).",
            metavar="NAME",
        ),
    ),
    "moe_dispatcher_sms": (
        _PARALLEL,
        _Spec(
            "SMs the --moe_dispatcher deepep or hybridep kernels run on (Megatron-core's "
            "moe_deepep_num_sms, moe_hybridep_num_sms; default: theirs, 20 and 16).",
            metavar="N",
        ),
    ),
    "rank_order": (_PARALLEL, _Spec("Mesh axes, fastest-varying first.", metavar="AXES")),
    "pipeline_schedule": (
        _PARALLEL,
        _Spec("Pipeline schedule: {allowed:schedules}.", metavar="NAME"),
    ),
    "virtual_stages": (_PARALLEL, _Spec("Model chunks per pipeline stage (interleaving).")),
    "decoder_first_pipeline_num_layers": (
        _PARALLEL,
        _Spec(
            "Layers of the first pipeline stage; the stages without a count split the rest "
            "evenly (Megatron's --decoder-first-pipeline-num-layers; default: unset).",
            metavar="N",
        ),
    ),
    "decoder_last_pipeline_num_layers": (
        _PARALLEL,
        _Spec(
            "Layers of the last pipeline stage (Megatron's --decoder-last-pipeline-num-layers; "
            "default: unset).",
            metavar="N",
        ),
    ),
    "account_for_embedding_in_pipeline_split": (
        _PARALLEL,
        _Spec(
            "Count the embedding as one layer of the even pipeline split: the first chunk "
            "holds one layer less (Megatron's --account-for-embedding-in-pipeline-split).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "account_for_loss_in_pipeline_split": (
        _PARALLEL,
        _Spec(
            "Count the head and loss as one layer of the even pipeline split: the last chunk "
            "holds one layer less (Megatron's --account-for-loss-in-pipeline-split).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "pipeline_layers": (
        _PARALLEL,
        _Spec(
            "Layers of every model chunk (pp·virtual_stages counts, chunk c on stage c mod pp), "
            "e.g. 0,4,4,4; the first and last may be 0: the embedding or the head alone on "
            "its stage (default: as even as possible, the first chunks one layer longer).",
            parser=parse_layer_counts,
            metavar="N,N,...",
        ),
    ),
    "pipeline_flushes": (
        _PARALLEL,
        _Spec(
            "Run the micro-batches of an iteration as N pipeline schedules in turn, each "
            "filled and drained and ending with its gradient reductions (torchtitan's and NeMo "
            "AutoModel's gradient accumulation under pipeline parallelism; needs pp > 1 and N "
            "dividing the micro-batches; default 1: one schedule, as Megatron).",
            metavar="N",
        ),
    ),
    "activation_recompute": (
        _TRAINING,
        _Spec(
            "Activation recomputation: none, selective (Megatron's modules), selective_op "
            "(torchtitan's op-level checkpointing: every op but the attention core and "
            "every other matmul), full (true = full, false = none).",
            parser=parse_recompute,
            metavar="MODE",
        ),
    ),
    "recompute_method": (
        _TRAINING,
        _Spec(
            "Which layers full recompute checkpoints (Megatron's --recompute-method): uniform "
            "(groups of --recompute_num_layers layers of each model chunk, only each group's "
            "input kept) or block (the first --recompute_num_layers layers of each chunk; the "
            "others keep all activations). Default: every layer on its own.",
            metavar="uniform|block",
        ),
    ),
    "recompute_num_layers": (
        _TRAINING,
        _Spec(
            "Layers per recompute group (uniform) or recomputed per model chunk (block); "
            "Megatron's --recompute-num-layers.",
            metavar="N",
        ),
    ),
    "recompute_modules": (
        _TRAINING,
        _Spec(
            "Modules selective recompute re-runs (Megatron's --recompute-modules): core_attn, "
            "mlp, layernorm, mla_up_proj, comma-separated (default: core_attn).",
            parser=parse_modules,
            metavar="NAMES",
        ),
    ),
    "cpu_offloading_num_layers": (
        _TRAINING,
        _Spec(
            "Copy the saved activations of the first N layers to host memory after their "
            "forward and back before their backward, on a copy stream beside the compute "
            "(Megatron's --cpu-offloading-num-layers; pp 1, no recompute). Default 0: off.",
            metavar="N",
        ),
    ),
    "mixed_precision": (
        _TRAINING,
        _Spec("fp32 master weights and optimizer states.", parser=parse_bool, metavar=BOOL),
    ),
    "dtype": (
        _TRAINING,
        _Spec("Compute and activation dtype: {allowed:dtypes}.", metavar="DTYPE"),
    ),
    "grad_reduce_dtype": (
        _TRAINING,
        _Spec(
            "Dtype of gradient reduction ({allowed:dtypes}); unset means --dtype.", metavar="DTYPE"
        ),
    ),
    "causal": (
        _TRAINING,
        _Spec("Count only the causal half of attention scores.", parser=parse_bool, metavar=BOOL),
    ),
    "attention": (
        _TRAINING,
        _Spec(
            "Attention core: fused (one FlashAttention-class kernel, no score matrix in "
            "memory) or unfused (scores, softmax, context as separate kernels).",
            metavar="fused|unfused",
        ),
    ),
    "attention_backend": (
        _TRAINING,
        _Spec(
            "Fused attention kernel of a training run (Megatron's --attention-backend): auto "
            "(the stack's choice: cuDNN's on Hopper and Blackwell under --profile megatron), "
            "flash (the flash-attn package, FlashAttention-2; as with NVTE_FUSED_ATTN=0) or "
            "fused (cuDNN; AITER on AMD).",
            metavar="auto|flash|fused",
        ),
    ),
    "dropout": (
        _TRAINING,
        _Spec(
            "Dropout rate p of GPT, BERT and RoBERTa (hidden, embedding and attention "
            "dropout, as Megatron's --hidden-dropout/--attention-dropout; 0: none). "
            "Llama-family models train without dropout and refuse p > 0.",
            metavar="P",
        ),
    ),
    "profile": (
        _TRAINING,
        _Spec(
            "How the training stack executes, for predictions: megatron (fused kernels, "
            "asynchronous launches), eager (eager PyTorch, one launch per op), compiled "
            "(torch.compile as torchtitan runs it: fused kernels, SDPA's FlashAttention-2) or "
            "torchtitan (torchtitan's Llama in eager PyTorch, 2024: its rotary embedding in "
            "fp32, repeat_kv copies, unfused SwiGLU and fp32 logits as the kernels they are).",
            metavar="megatron|eager|compiled|torchtitan",
        ),
    ),
    "norm_type": (
        _TRAINING,
        _Spec(
            "torchtitan's model.norm_type under --profile torchtitan: fused_rmsnorm (its "
            "Triton kernel, the default) or rmsnorm (RMSNorm as separate fp32 ops).",
            metavar="fused_rmsnorm|rmsnorm",
        ),
    ),
    "precision": (
        _TRAINING,
        _Spec(
            'Per-op precision plan: a JSON file {"ops": {"fc1": "int8", ...}} '
            "(as stg plan precision writes; default: every op in --dtype).",
            parser=parse_precision_plan,
            metavar="FILE",
        ),
    ),
    "amax_history": (
        _TRAINING,
        _Spec(
            "fp8 GEMMs (a precision plan or --dtype fp8): length of Transformer Engine's "
            "amax history per fp8 tensor, which its delayed-scaling update reads and writes "
            "after each amax reduction (DelayedScaling.amax_history_len, default 1024; "
            "Megatron's --fp8-amax-history-len).",
            metavar="N",
        ),
    ),
    "low_precision_recipe": (
        _TRAINING,
        _Spec(
            "--dtype fp8 training: how the GEMM operands are quantized (stg/core/recipes.py "
            "cites each): delayed (Transformer Engine's DelayedScaling, default), tensorwise "
            "(current scaling), rowwise (torchao), blockwise (1x128 activations, 128x128 "
            "weights, as DeepSeek-V3), mxfp8 (OCP MX: 32-element blocks, E8M0 scales), nvfp4 "
            "(fp4 GEMMs: 16-element blocks, E4M3 scales, Hadamard transform on wgrad inputs; "
            "needs a system with an fp4 peak).",
            metavar="NAME",
        ),
    ),
    "fp8_param_gather": (
        _TRAINING,
        _Spec(
            "With --low_precision_recipe tensorwise, blockwise or mxfp8 under FSDP "
            "(--weight_sharded): keep the weights in fp8 and all-gather them in fp8 (with "
            "their block scales) instead of bf16 (Megatron's --fp8-param-gather; default off).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "fp8_dispatch": (
        _TRAINING,
        _Spec(
            "With --low_precision_recipe other than delayed and --ep > 1: send the tokens to "
            "the experts (and the down-projection's gradients back) in the recipe's format "
            "with its scales, as DeepSeek-V3 does; combines stay bf16 (default off: bf16).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "fp8_attention": (
        _TRAINING,
        _Spec(
            "With --dtype fp8 under the megatron profile: run the fused attention core in fp8 "
            "too (Megatron's --fp8-dot-product-attention, Transformer Engine's fp8_dpa): "
            "cuDNN's fp8 kernel, MXFP8 under --low_precision_recipe mxfp8, with its casts "
            "(default off: bf16 attention).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "optimizer": (
        _TRAINING,
        _Spec(
            "The optimizer: adam (default) or muon, Megatron-Core's Muon: each weight matrix "
            "orthogonalized by Newton-Schulz iterations (Adam for embeddings, output layers "
            "and non-matrix weights; with --zero 1 or 2 the layer-wise distributed Muon).",
            metavar="adam|muon",
        ),
    ),
    "muon_ns_steps": (
        _TRAINING,
        _Spec(
            "With --optimizer muon: Newton-Schulz iterations per matrix (Megatron's "
            "--muon-num-ns-steps; default 5).",
            metavar="N",
        ),
    ),
    "eager_loss": (
        _TRAINING,
        _Spec(
            "With --profile compiled: run the loss outside the compiled region, as eager "
            "PyTorch's F.cross_entropy on an fp32 copy of the logits (its kernels and its "
            "transient memory), as torchtitan did until it compiled its loss (default off: the "
            "loss fused like the model).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "nvfp4_disable_rht": (
        _TRAINING,
        _Spec(
            "With --low_precision_recipe nvfp4: no random Hadamard transform on the "
            "weight-gradient GEMM's inputs (Transformer Engine's NVTE_NVFP4_DISABLE_RHT; "
            "default off: transformed).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "nvfp4_disable_stochastic_rounding": (
        _TRAINING,
        _Spec(
            "With --low_precision_recipe nvfp4: round the gradients to nearest instead of "
            "stochastically (Transformer Engine's NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING; "
            "default off: stochastic).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "megatron_fsdp": (
        _TRAINING,
        _Spec(
            "With --weight_sharded true: shard as Megatron-LM's FSDP (--use-megatron-fsdp), "
            "whose parameters and gradients live in its collective buffers, instead of "
            "PyTorch's FSDP2 with its copy kernels around each all-gather and reduce-scatter "
            "(default off: FSDP2).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "first_last_layers_bf16": (
        _TRAINING,
        _Spec(
            "With --low_precision_recipe other than delayed: run the first "
            "--num_layers_at_start_in_bf16 and the last --num_layers_at_end_in_bf16 layers in "
            "bf16 (no quantize nodes, no quantized weight copies), as Megatron-LM's "
            "--first-last-layers-bf16 and the NVFP4 paper's bf16 layers (default off).",
            parser=parse_bool,
            metavar=BOOL,
        ),
    ),
    "num_layers_at_start_in_bf16": (
        _TRAINING,
        _Spec(
            "With --first_last_layers_bf16: layers at the start of the stack kept in bf16, "
            "0 to num_stacks // pp (default 1, as Megatron-LM's).",
            metavar="N",
        ),
    ),
    "num_layers_at_end_in_bf16": (
        _TRAINING,
        _Spec(
            "With --first_last_layers_bf16: layers at the end of the stack kept in bf16, "
            "0 to num_stacks // pp (default 1, as Megatron-LM's).",
            metavar="N",
        ),
    ),
    "phase": (
        _SERVING,
        _Spec(
            "What one run is: training (an iteration: forward, backward, optimizer), "
            "prefill (--batch prompts of --seq tokens, writing the KV cache), decode "
            "(--steps steps of one new token per sequence against --context cached tokens) "
            "or mixed (one continuously batched iteration: --prefill_batch requests prefill "
            "--chunk tokens beside --batch decoding requests).",
            metavar="PHASE",
        ),
    ),
    "context": (
        _SERVING,
        _Spec(
            "decode, mixed: tokens in the KV cache of each decoding sequence before the "
            "step (default: --seq).",
            metavar="N",
        ),
    ),
    "steps": (
        _SERVING,
        _Spec("decode: steps in one trace, the cache growing by one token each.", metavar="N"),
    ),
    "kv_dtype": (
        _SERVING,
        _Spec("Dtype of the KV cache: {allowed:dtypes} (default: --dtype).", metavar="DTYPE"),
    ),
    "prefill_batch": (
        _SERVING,
        _Spec("mixed: requests prefilling a chunk of their prompt in the iteration.", metavar="N"),
    ),
    "chunk": (
        _SERVING,
        _Spec("mixed: prompt tokens each prefilling request adds (default: --seq).", metavar="N"),
    ),
    "prefill_context": (
        _SERVING,
        _Spec(
            "mixed: prompt tokens of each prefilling request already in the cache (earlier "
            "chunks).",
            metavar="N",
        ),
    ),
    "placement": (
        _TRAINING,
        _Spec(
            "Device groups of a hybrid cluster per rank, as runs in rank order, e.g. "
            "v100:4,t4:4 (default: from a hybrid --system, else one device kind); each "
            "group's ranks run the precision plan's entries for that group.",
            parser=parse_placement,
            metavar="GROUP:N,...",
        ),
    ),
    "format": (
        _OUTPUT,
        _Spec("Output format: {allowed:emitters} (or an emitter's alias).", metavar="NAME"),
    ),
    "output_dir": (_OUTPUT, _Spec("Directory to write into.", metavar="DIR")),
    "output_name": (
        _OUTPUT,
        _Spec(
            "Rank file name; %d is the rank (default: workload.%d plus the format's extension).",
            metavar="NAME",
        ),
    ),
}

SCHEMA_OPTION = "chakra_schema_version"


OPTION_SPELLINGS = {"precision": "precision_plan"}
"""Fields whose option is spelled otherwise first (``--precision_plan FILE``; the field name
``--precision`` works too)."""

COMMAND_OPTIONS = frozenset(
    {
        "predict",
        "print_gpu_vram",
        "system",
        "calibration",
        "astra_sim_configs",
        "comm_group_file",
        "as_json",
        "max_nodes",
    }
)
"""Options of ``stg generate`` that are not GenerateOptions fields."""


MAX_NODES_HELP = (
    "Refuse (before building anything) a workload of more nodes than this, over every rank "
    "(default: no limit but the memory available; the estimate is printed when refused)."
)


def max_nodes_parameter(**extra: Any) -> inspect.Parameter:
    """The ``--max-nodes N`` option of the commands that build a whole workload."""
    return inspect.Parameter(
        "max_nodes",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            None, "--max-nodes", "--max_nodes", min=1, help=MAX_NODES_HELP, metavar="N", **extra
        ),
        annotation=Optional[int],  # noqa: UP045 (typer needs a runtime type object)
    )


def check_workload_size(
    options: GenerateOptions, registry: Registry, max_nodes: int | None
) -> None:
    """Refuse, with one line, a workload too large for this machine's memory or for
    ``--max-nodes``, from its estimated size (:mod:`stg.core.sizes`), before it is built."""
    from stg.core.sizes import check_size, estimate_size

    check_size(estimate_size(options, registry), max_nodes)


def system_parameter(
    help: str, default: str | None = "a100-80g", **extra: Any
) -> inspect.Parameter:
    """The ``--system/-s NAME|FILE`` option shared by generate, predict and plan (``default``
    None: the command tells a given system from none)."""
    return inspect.Parameter(
        "system",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            default,
            "--system",
            "-s",
            help=help,
            metavar="NAME|FILE",
            **extra,
        ),
        annotation=str if default is not None else Optional[str],  # noqa: UP045
    )


# -- allowed values in --help -------------------------------------------------------------------


RegistryOf = Callable[[], "Registry"]
"""The invocation's registry, loaded on the first call (kinds that need none never load it)."""


def _names(kind: str) -> Callable[[RegistryOf], list[str]]:
    return lambda registry: registry().catalog(kind).names()


def _system_presets(registry: RegistryOf) -> list[str]:
    from stg.perf.system import PRESETS

    return sorted(PRESETS)


def _dtypes(registry: RegistryOf) -> list[str]:
    from stg.core.precision import DTYPES

    return list(DTYPES)


def _models_and_presets(registry: RegistryOf) -> list[str]:
    loaded = registry()
    presets = ", ".join(loaded.presets.names())
    return [f"models: {', '.join(loaded.models.names())}; presets: {presets}"]


ALLOWED: dict[str, Callable[[RegistryOf], list[str]]] = {
    "models": _models_and_presets,
    "schedules": _names("schedules"),
    "emitters": _names("emitters"),
    "predictors": _names("predictors"),
    "systems": _system_presets,
    "dtypes": _dtypes,
}
"""The allowed names of each kind; registered names come from this invocation's registry
(plugins included)."""


ALLOWED_MARK = re.compile(r"\{allowed:(\w+)\}")
"""``{allowed:KIND}`` in an option's help: the allowed names of KIND (a key of
:data:`ALLOWED`), filled in when help is shown."""


def resolve_allowed(text: str, registry: RegistryOf) -> str:
    """``text`` with each ``{allowed:KIND}`` replaced by the names of KIND."""
    return ALLOWED_MARK.sub(lambda m: ", ".join(ALLOWED[m.group(1)](registry)), text)


def allowed_values_in_help() -> None:
    """Make ``--help`` name the allowed values where an option's help says
    ``{allowed:KIND}``: the names are looked up (the registry loaded, where a kind needs it)
    only while help is formatted, so running a command costs nothing more. Idempotent."""
    from typer.core import TyperCommand

    original = TyperCommand.format_help
    if getattr(original, "_stg_allowed_values", False):
        return

    def format_help(self: Any, ctx: Any, formatter: Any) -> None:
        from stg.cli import get_registry

        lazy = [(p, p.help) for p in self.params if ALLOWED_MARK.search(p.help or "")]
        for param, text in lazy:
            param.help = resolve_allowed(text, lambda: get_registry(ctx))
        try:
            original(self, ctx, formatter)
        finally:
            for param, text in lazy:
                param.help = text

    format_help._stg_allowed_values = True  # type: ignore[attr-defined]
    TyperCommand.format_help = format_help  # type: ignore[method-assign]


def option_names(field_name: str) -> list[str]:
    """All spellings of a field's option: underscored, dashed, then aliases."""
    names: list[str] = []
    for spelled in dict.fromkeys((OPTION_SPELLINGS.get(field_name, field_name), field_name)):
        names.append(f"--{spelled}")
        if "_" in spelled:
            names.append(f"--{spelled.replace('_', '-')}")
    names.extend(SPECS[field_name][1].aliases)
    return names


_TYPES: dict[str, Any] = {
    "int": Optional[int],  # noqa: UP045 (typer needs a runtime type object)
    "int | None": Optional[int],  # noqa: UP045
    "float": Optional[float],  # noqa: UP045
    "str": Optional[str],  # noqa: UP045
    "str | None": Optional[str],  # noqa: UP045
    "bool": Optional[str],  # noqa: UP045 (parsed by parse_bool)
}


def option_parameters() -> list[inspect.Parameter]:
    """The typer parameters of every GenerateOptions field (other commands reuse them)."""
    from stg.core.options import GenerateOptions

    params = []
    for f in fields(GenerateOptions):
        if f.metadata.get("internal"):
            continue
        if f.name not in SPECS:
            raise RuntimeError(f"stg generate has no option for GenerateOptions.{f.name}")
        panel, spec = SPECS[f.name]
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        annotation = _TYPES.get(type_name, Optional[str])  # noqa: UP045
        default = f.default if f.default is not MISSING else None
        text = spec.help if "default" in spec.help else f"{spec.help} (default: {_show(default)})"
        option = typer.Option(
            None,
            *option_names(f.name),
            help=text,
            show_default=False,
            parser=spec.parser,
            metavar=spec.metavar,
            rich_help_panel=panel,
        )
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
            )
        )
    schema = typer.Option(
        None,
        f"--{SCHEMA_OPTION}",
        f"--{SCHEMA_OPTION.replace('_', '-')}",
        help="Original STG spelling of --format: v0.0.4, v0.0.1 or json.",
        show_default=False,
        metavar="VERSION",
        rich_help_panel=_OUTPUT,
    )
    params.append(
        inspect.Parameter(
            SCHEMA_OPTION,
            inspect.Parameter.KEYWORD_ONLY,
            default=schema,
            annotation=Optional[str],  # noqa: UP045
        )
    )
    return params


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "unset" if value is None else str(value)


def options_from_cli(values: Mapping[str, Any]) -> GenerateOptions:
    """GenerateOptions from parsed option values (``None`` = not given, keep the default).

    The original STG's spellings are resolved here: ``--chakra_schema_version``, the model
    names ``dense`` and ``debug``, ``--micro_batch -1`` and ``--zero 3`` (both resolved by
    GenerateOptions itself); so are named presets (``--model llama3-8b``: see
    :func:`options_and_preset_from_cli`).
    """
    return options_and_preset_from_cli(values)[0]


def options_and_preset_from_cli(
    values: Mapping[str, Any],
) -> tuple[GenerateOptions, PresetUse | None]:
    """:func:`options_from_cli`, and what a named preset given as ``--model`` contributed
    (:func:`stg.core.options.resolve_model`; None without one), for summaries."""
    from stg.core.options import GenerateOptions, OptionError, resolve_model

    given = {
        k: v
        for k, v in values.items()
        if v is not None and k != SCHEMA_OPTION and k not in COMMAND_OPTIONS
    }
    schema = values.get(SCHEMA_OPTION)
    if schema is not None:
        if schema not in SCHEMA_FORMATS:
            raise OptionError(
                f"chakra_schema_version={schema!r} is not allowed; allowed: "
                f"{', '.join(SCHEMA_FORMATS)}"
            )
        fmt = SCHEMA_FORMATS[schema]
        if "format" in given and given["format"] != fmt:
            raise OptionError(
                f"chakra_schema_version={schema} means format={fmt}, "
                f"but format={given['format']} was given; give one of them"
            )
        given["format"] = fmt
    if given.get("zero") == 3 and given.get("weight_sharded") is False:
        raise OptionError(
            "zero=3 means weight_sharded=true, but weight_sharded=false was given; give one of them"
        )
    preset = None
    if "model" in given:
        given, preset = resolve_model(given, _registry())
    return GenerateOptions(**given), preset


def _registry() -> Registry:
    """The registry of this invocation; outside a command (a test parsing options), the
    built-ins, installed plugins and nothing else."""
    from typer._click.globals import get_current_context

    if get_current_context(silent=True) is not None:
        from stg.cli import get_registry

        return get_registry()
    from stg.host.registry import load_registry

    return load_registry()


def plain_flags_in_help() -> None:
    """Show flags (``--json``, ``--predict``, ``--help``) without a value in ``--help``.

    Typer's rich help prints the type of every option, so a flag reads ``--json <bool>`` as
    if it took a value. Options with a metavar (the original STG's value-taking booleans,
    ``--tpsp true|false``) keep it. Idempotent; the stg command line applies it once.
    """
    from typer.core import TyperOption

    original = getattr(TyperOption, "display_type_rich", None)
    if original is None:  # typer < 0.29 prints no type beside a flag; nothing to change
        return
    if getattr(original, "_stg_plain_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._stg_plain_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def check_writable_file(option: str, target: Path) -> None:
    """One ``error:`` line (exit 2) when ``target`` cannot be written as a file. Asks the
    kernel (``access``: permissions, a read-only file system) rather than writing a probe,
    which would touch the folder of a command that then fails; faults that only a write
    shows (a full disk) are reported by the writer, which leaves nothing behind."""
    if target.is_dir():
        raise UserError(f"{option} {target}: it is a directory; give a file name")
    check_replaceable(target)
    folder = target.parent
    if not folder.is_dir():
        if folder.exists():
            raise UserError(f"{option} {target}: {str(folder)!r} is not a directory")
        raise UserError(f"{option} {target}: directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(folder) else "permission denied"
        raise UserError(f"{option} {target}: cannot write: {reason}")


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# -- progress -----------------------------------------------------------------------------------


PHASES: dict[str, str] = {
    "lowering": "building",
    "plans evaluated": "evaluating precision plans",
    "closed forms": "search: plans checked by closed forms",
    "analytical": "search: plans considered for analytical pricing",
    "DAG predictor": "search: best plans re-priced by the DAG predictor",
    "serving predictor": "search: plans priced by the serving predictor",
    "configurations": "sweep: configurations evaluated",
    "reading traces": "reading rank files",
}
"""What progress says for the phases that the library reports under internal names
(``build_workload`` reports ``lowering``; the writer reports ``writing rank files`` itself)."""

PROGRESS_INTERVAL_S = 10.0
"""Off a terminal (a pipe, a log file), a long command prints a progress line to stderr at
most this often, and a final one when it is done; a command done sooner prints none."""

ProgressCallback = Callable[[str, int, int], None]


@contextmanager
def progress_bar(console: Any, interval: float | None = None) -> Iterator[ProgressCallback]:
    """Progress of a long command on stderr: a rich bar on a terminal (one line per phase:
    ``building 12/12``, ``writing rank files 37/128``), else a plain line at most every
    ``interval`` seconds (default :data:`PROGRESS_INTERVAL_S`) and a final one (see
    :class:`ProgressLines`).

    The warnings of the work inside (a precision plan naming an unknown op) are printed as
    ``warning: ...`` lines on stderr when it ends, bar or not (:func:`plan_warnings`).
    """
    with plan_warnings(), _bar(console, interval) as update:
        yield update


@contextmanager
def plan_warnings() -> Iterator[None]:
    """Print the precision-plan warnings of the work inside (a plan entry that matches no op
    of the model) as ``warning: ...`` lines on stderr when it ends, each once, before the
    error line of a failure: not Python's ``file:line: PrecisionPlanWarning`` and source line
    (the predictors that build their own workloads build it more than once). Inside another
    one it adds nothing: the outermost prints them all."""
    import warnings

    from stg.core.precision import PrecisionPlanWarning

    if _recording_plan_warnings.get():
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PrecisionPlanWarning)
        token = _recording_plan_warnings.set(True)
        try:
            yield
        finally:
            _recording_plan_warnings.reset(token)
            for message in dict.fromkeys(str(w.message) for w in caught):
                typer.echo(f"warning: {message}", err=True)


_recording_plan_warnings: ContextVar[bool] = ContextVar("_recording_plan_warnings", default=False)
"""Whether a :func:`plan_warnings` context is open in this context (the outermost records and
prints)."""


@contextmanager
def _bar(console: Any, interval: float | None = None) -> Iterator[ProgressCallback]:
    if not console.is_terminal:
        lines = ProgressLines(PROGRESS_INTERVAL_S if interval is None else interval)
        yield lines.update
        lines.finish()  # not after an error: its one line stays the last
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(PHASES.get(stage, stage), total=total or None)
            bar.update(tasks[stage], completed=done, total=total or None)

        yield update


class ProgressLines:
    """Progress as plain lines on stderr, for a pipe or a log:
    ``search: plans checked by closed forms: 1,200 of 5,400 (22%), 1m10s elapsed``.

    :meth:`update` prints a line once ``interval`` seconds have passed since the start or
    the last line; :meth:`finish` prints the latest state of the last phase, if any line was
    printed before (a short command stays silent). ``clock`` is injectable for tests.
    """

    def __init__(self, interval: float, clock: Callable[[], float] | None = None) -> None:
        import time

        self.interval = interval
        self.clock = clock or time.monotonic
        self.started = self.last = self.clock()
        self.printed = False
        self.latest: dict[str, tuple[int, int]] = {}
        self.shown: dict[str, tuple[int, int]] = {}

    def update(self, stage: str, done: int, total: int) -> None:
        """Record a phase's progress; print it if a line is due."""
        self.latest.pop(stage, None)  # the phase updated last comes last
        self.latest[stage] = (done, total)
        now = self.clock()
        if now - self.last >= self.interval:
            self._print(stage, now)

    def finish(self) -> None:
        """The final line: the last phase's last state, where a line was printed before."""
        if not self.printed or not self.latest:
            return
        stage = next(reversed(self.latest))
        if self.shown.get(stage) != self.latest[stage]:
            self._print(stage, self.clock())

    def _print(self, stage: str, now: float) -> None:
        done, total = self.latest[stage]
        counted = f"{done:,} of {total:,} ({100 * done // total}%)" if total else f"{done:,}"
        label = PHASES.get(stage, stage)
        line = f"{label}: {counted}, {format_elapsed(now - self.started)} elapsed"
        typer.echo(fit_lines(line, terminal_width()), err=True)  # a log's width, too
        self.last = now
        self.printed = True
        self.shown[stage] = (done, total)


def format_elapsed(seconds: float) -> str:
    """``42s``, ``1m10s``, ``2h05m``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


# -- predictors -----------------------------------------------------------------------------


def _accepts(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def calibration_parameter(help_text: str, **extra: Any) -> inspect.Parameter:
    """The ``--calibration FILE`` option (a table of ``stg bench calibrate``)."""
    return inspect.Parameter(
        "calibration",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--calibration", help=help_text, metavar="FILE", **extra),
        annotation=Optional[str],  # noqa: UP045 (typer needs a runtime type object)
    )


def load_calibration_option(path: str | None, system: Any = None) -> Any:
    """The calibration table of ``--calibration`` (None without one); refused on a hybrid
    system, whose device groups each need their own measured kernels."""
    if path is None:
        return None
    from stg.perf.calibration import load_calibration
    from stg.perf.hybrid import is_hybrid

    if system is not None and is_hybrid(system):
        raise UserError(
            "--calibration holds one device's measured kernels; on a hybrid system give it "
            "with one group's device preset (--system t4-16g) instead"
        )
    return load_calibration(path)


def _accepts_explicitly(fn: Any, keyword: str) -> bool:
    """Whether ``fn`` names the keyword parameter ``keyword`` (not just ``**kwargs``)."""
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def read_trace_input(
    path: str, jobs: int = 0, comm_group_file: str | None = None
) -> tuple[Mapping[int, list[Any]], dict[int, tuple[int, ...]], dict]:
    """The ranks of a trace (a :class:`stg.trace.ranks.TraceRanks`: rank -> nodes, decoded on
    demand, with per-rank summaries read by ``jobs`` processes), its comm groups and (if
    recorded) its generation options."""
    from stg.trace.ranks import read_ranks
    from stg.trace.reader import read_metadata
    from stg.trace.validate import (
        check_rank_set,
        find_rank_files,
        locate_comm_groups,
        read_comm_groups,
    )

    files, default_group = find_rank_files(path)
    if default_group is not None:
        check_rank_set(files)
    group_path, note = locate_comm_groups(files, default_group, comm_group_file)
    if note:
        typer.echo(note, err=True)
    groups: dict[int, tuple[int, ...]] = {}
    if group_path is not None and group_path.is_file():
        groups = read_comm_groups(group_path)
    nodes = read_ranks([f for f in files if f is not None], jobs)
    options: dict[str, Any] = {}
    attrs = read_metadata(files[0]).get("attrs") or {}  # type: ignore[arg-type]
    raw = attrs.get("options")
    if isinstance(raw, str):
        try:
            decoded = json.loads(raw)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            options = decoded
    elif isinstance(raw, Mapping):
        options = dict(raw)
    return nodes, groups, options


def run_predictors(
    names: list[str],
    registry: Any,
    system: Any,
    *,
    options: Any = None,
    workload: Any = None,
    trace: tuple[Mapping[int, list[Any]], dict[int, tuple[int, ...]], dict] | None = None,
    timeline: str | None = None,
    calibration: Any = None,
    explain: bool = False,
    exact: bool = False,
    max_nodes: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Run each named predictor on generation options, a generated workload or a trace;
    reports by name. With ``options``, a predictor that needs only them (``needs="options"``)
    answers through ``predict_options`` and the others get ``workload`` (built only when one
    of them needs it). ``calibration`` (a :class:`stg.perf.calibration.Calibration`) goes to
    predictors that take it (the time predictor: measured kernel times before its models);
    ``explain`` asks those that can for the breakdown of their critical path; ``exact`` asks
    those that can to replay every micro-batch (a trace is always replayed whole). A
    ``predict_options`` that names them also gets ``timeline``, ``calibration``, ``exact``,
    ``workload`` (where built for another predictor) and ``max_nodes`` (the most nodes of a
    workload it builds itself)."""
    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        predictor = registry.predictors.get(name)
        if options is not None and predictor.needs == "options":
            offered = {"registry": registry, "kernels": list(registry.kernels)}
            if explain:
                offered["explain"] = True
            fn = predictor.predict_options
            kwargs = {k: v for k, v in offered.items() if _accepts(fn, k)}
            named = {
                "timeline": timeline,
                "calibration": calibration,
                "exact": exact or None,
                "workload": workload,
                "max_nodes": max_nodes,
            }
            for key, value in named.items():
                if value is not None and _accepts_explicitly(fn, key):
                    kwargs[key] = value
            reports[name] = fn(options, system, **kwargs)
            continue
        if workload is not None:
            kwargs: dict[str, Any] = {}
            if timeline is not None and _accepts(predictor.predict, "timeline"):
                kwargs["timeline"] = timeline
            if _accepts_explicitly(predictor.predict, "kernels"):
                kwargs["kernels"] = list(registry.kernels)
            if calibration is not None and _accepts_explicitly(predictor.predict, "calibration"):
                kwargs["calibration"] = calibration
            if explain and _accepts_explicitly(predictor.predict, "explain"):
                kwargs["explain"] = True
            if exact and _accepts_explicitly(predictor.predict, "exact"):
                kwargs["exact"] = True
            if _accepts_explicitly(predictor.predict, "registry"):
                kwargs["registry"] = registry
            reports[name] = predictor.predict(workload, system, **kwargs)
            continue
        assert trace is not None
        # a trace is priced through these modules' own functions (the others load on use)
        from stg.predictors import memory as memory_predictor
        from stg.predictors import time as time_predictor

        nodes, groups, recorded = trace
        if predictor.predict is time_predictor.predict_time:
            tokens = None
            if recorded.get("batch") and recorded.get("seq"):
                tokens = int(recorded["batch"]) * int(recorded["seq"])
            if recorded.get("phase", "training") != "training":
                tokens = _serving_tokens(recorded)
            extra: dict[str, Any] = {"calibration": calibration} if calibration is not None else {}
            if explain:
                extra["explain_path"] = True
            if recorded.get("profile"):
                extra["profile"] = str(recorded["profile"])
            extra.update(time_predictor.overlap_options(recorded))
            # one replay per class of identical ranks (problem_from_trace), else every rank
            reports[name] = time_predictor.predict_trace(
                nodes,
                groups,
                system,
                dtype=str(recorded.get("dtype") or "bf16"),
                tokens=tokens,
                timeline=timeline,
                kernels=list(registry.kernels),
                **extra,
            )
        elif predictor.predict is memory_predictor.predict_memory:
            if not recorded.get("model"):  # an imported trace records its dtype only
                raise UserError(
                    "the memory predictor needs generation options; this trace does not record "
                    "them (give the options of stg generate instead of a trace, or --predictor "
                    "time)"
                )
            # from the recorded options: the closed forms where they hold, else the workload
            # they build (memory_predictor.CLOSED_FORM_MODELS; op-level checkpointing of
            # layers without a closed form). They passed generation's read check: a model
            # option that the layers do not read is one a preset filled in
            from stg.host.records import MODEL_OPTIONS

            recorded = {
                **recorded,
                "preset_fills": tuple(k for k in MODEL_OPTIONS if recorded.get(k) is not None),
            }
            from stg.perf.hybrid import is_hybrid

            if is_hybrid(system):  # its device groups' memory, from the workload built
                from dataclasses import replace

                from stg.perf.hybrid import placed
                from stg.perf.system import check_capacity

                # placed as this system places its ranks (as the time predictor replays
                # them), whatever placement the trace was generated with
                recorded_options = replace(memory_predictor.as_options(recorded), placement=())
                check_capacity(system, recorded_options.world_size, "ranks of the trace")
                reports[name] = memory_predictor.predict_memory_options(
                    placed(recorded_options, system),
                    system,
                    kernels=list(registry.kernels),
                    registry=registry,
                )
                continue
            priced = (
                memory_predictor.predict_analytic
                if memory_predictor.closed_forms_apply(recorded, registry)
                else memory_predictor.predict_memory_options
            )
            reports[name] = priced(
                recorded, system, kernels=list(registry.kernels), registry=registry
            )
        else:
            raise UserError(
                f"predictor {name!r} needs a generated workload; give the options of "
                "stg generate instead of a trace"
            )
    for name, report in reports.items():
        iteration = report.get("iteration_time_s") if isinstance(report, Mapping) else None
        if isinstance(iteration, float) and not math.isfinite(iteration):
            from stg.perf.system import non_finite_time

            raise non_finite_time(
                f"predictor {name!r}", iteration, str(getattr(system, "name", system))
            )
    return reports


def _serving_tokens(options: Mapping[str, Any]) -> int | None:
    """New tokens of a serving trace (prompt tokens, or one per sequence and decode step),
    from its recorded options; None where they do not describe a run."""
    from stg.core.inference import new_tokens
    from stg.core.options import GenerateOptions

    known = {f.name for f in fields(GenerateOptions)}
    try:
        return new_tokens(GenerateOptions(**{k: v for k, v in options.items() if k in known}))
    except (TypeError, ValueError):
        return None


def print_group_times(console: Any, report: Mapping[str, Any]) -> None:
    """The per-device-group table of a time report on a hybrid cluster."""
    from rich.table import Table

    placement = ", ".join(f"{name} x {count}" for name, count in report.get("placement", []))
    table = Table(
        title=f"per device group (ranks in order: {placement}; straggler: {report['straggler']})",
        title_justify="left",
    )
    for column in ("group", "device", "ranks", "compute", "casts", "sync wait", "sync points"):
        table.add_column(column, justify="right")
    for name, g in report["groups"].items():
        table.add_row(
            name,
            g["device"],
            str(g["ranks"]),
            format_seconds(g["compute_s"]),
            format_seconds(g["casts_s"]),
            format_seconds(g["sync_wait_s"]),
            str(len(g["sync_points"])),
        )
    print_table(console, table)
    if "explain" in report:
        points = Table(title="wait at each synchronisation point", title_justify="left")
        points.add_column("sync point")
        for name in report["groups"]:
            points.add_column(name, justify="right")
        rows: dict[str, list[str]] = {}
        names = list(report["groups"])
        for k, name in enumerate(names):
            for point in report["groups"][name]["sync_points"]:
                label = f"{point['name']} ({point['type']}, {point['ranks']} ranks)"
                rows.setdefault(label, ["-"] * len(names))[k] = format_seconds(point["wait_s"])
        for label, cells in rows.items():
            points.add_row(label, *cells)
        print_table(console, points)


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


LONG_WORD = 24
"""Cells without a space up to this long (numbers, names) are never broken; longer ones
(paths) may be folded."""


def print_table(console: Any, table: Any) -> None:
    """Print a rich table within the console's width (``COLUMNS``, or 80 in a pipe), never
    cutting a cell short (``1234.…``) nor breaking a number.

    The first that fits: the table as built; the same with its text wrapped at spaces (and
    words longer than :data:`LONG_WORD` folded); a compact layout (no box, a space between
    columns), then that wrapped; last, the compact layout with any cell folded.
    """
    width = console.width
    for column in table.columns:
        column.no_wrap, column.overflow = True, "fold"
    if _table_width(console, table) <= width:
        console.print(table)
        return
    _wrap_text_columns(console, table)
    if _table_width(console, table) > width:
        _compact(table)
        for column in table.columns:
            column.no_wrap = True
        if _table_width(console, table) > width:
            _wrap_text_columns(console, table)
            if _table_width(console, table) > width:
                for column in table.columns:
                    column.no_wrap = False
    console.print(table)


def _table_width(console: Any, table: Any) -> int:
    """The columns the table takes with its ``no_wrap`` columns whole and the others wrapped
    at every space (and their long words folded)."""
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    for column in table.columns:
        if not column.no_wrap:
            sizes = _cell_sizes(console, column)
            least = max(min(s.minimum, LONG_WORD) for s in sizes)
            natural -= max(s.maximum for s in sizes) - least
    return int(natural)


def _wrap_text_columns(console: Any, table: Any) -> None:
    """Let the columns that hold a space or a long word wrap."""
    for column in table.columns:
        column.no_wrap = all(
            s.minimum == s.maximum <= LONG_WORD for s in _cell_sizes(console, column)
        )


def _cell_sizes(console: Any, column: Any) -> list[Any]:
    """The rich measurements of a column's header and cells."""
    from rich.measure import Measurement

    options = console.options.update_width(1 << 16)
    return [Measurement.get(console, options, cell) for cell in (column.header, *column.cells)]


def _compact(table: Any) -> None:
    """No box around or between the cells: a rule under the header, a space between columns."""
    from rich import box

    table.box = box.SIMPLE_HEAD
    table.show_edge = False
    table.padding = (0, 0)


def fit_lines(text: str, width: int) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces, its continuation lines
    indented to the column the line's last field starts in (after two spaces), where that
    leaves a third of the width."""
    import re
    import textwrap

    lines = []
    for line in text.splitlines():
        if len(line) <= width:
            lines.append(line)
            continue
        room = max(20, width // 3)
        starts = [m.end() for m in re.finditer(r"  +", line) if m.end() <= width - room]
        indent = " " * (starts[-1] if starts else min(4, width // 4))
        lines.extend(
            textwrap.wrap(
                line,
                width,
                subsequent_indent=indent,
                break_long_words=True,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def terminal_width() -> int:
    """The width rich gives stdout: ``COLUMNS``, the terminal's, or 80 in a pipe."""
    from rich.console import Console

    return int(Console().width)


def print_reports(reports: Mapping[str, Mapping[str, Any]], source: str) -> None:
    """Rich tables of the time and memory reports (others as JSON) on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for name, report in reports.items():
        kind = report.get("predictor")
        if kind == "time":
            summary = Table(
                title=f"time: {source} on {report['system']}",
                title_justify="left",
                show_header=False,
            )
            summary.add_column("what")
            summary.add_column("value", justify="right")
            summary.add_row("iteration time", format_seconds(report["iteration_time_s"]))
            summary.add_row("MFU (model FLOPs)", f"{100 * report['mfu']:.1f} %")
            summary.add_row("HFU (with recompute)", f"{100 * report['hfu']:.1f} %")
            if "tokens_per_s" in report:
                summary.add_row("tokens per second", f"{report['tokens_per_s']:,.0f}")
            if "samples_per_s" in report:
                summary.add_row("samples per second", f"{report['samples_per_s']:,.0f}")
            summary.add_row(
                "ranks (simulated)",
                f"{report['world_size']:,} ({report.get('simulated_ranks', '?')})",
            )
            print_table(console, summary)
            ranks = Table(
                title="per rank (each row stands for identical ranks)", title_justify="left"
            )
            copies = any("exposed_host_copy_s" in row for row in report["ranks"])
            for column in (
                "rank",
                "ranks",
                "stage",
                "compute",
                "exposed comm",
                "comm wait",
                *(("exposed host copy",) if copies else ()),
                "bubble",
            ):
                ranks.add_column(column, justify="right")
            for row in report["ranks"]:
                ranks.add_row(
                    str(row["rank"]),
                    str(row["ranks"]),
                    "-" if row["stage"] is None else str(row["stage"]),
                    format_seconds(row["compute_s"]),
                    format_seconds(row["exposed_communication_s"]),
                    format_seconds(row["collective_wait_s"]),
                    *((format_seconds(row.get("exposed_host_copy_s", 0.0)),) if copies else ()),
                    format_seconds(row["bubble_s"]),
                )
            print_table(console, ranks)
            if "groups" in report:
                print_group_times(console, report)
            path = report["critical_path"]
            totals: dict[str, float] = {}
            count = 0
            for run in path:  # a periodic replay's run of ``repeats`` stands for that many
                repeats = run.get("repeats", 1)
                count += repeats
                seconds = repeats * (run["end_s"] - run["start_s"])
                totals[run["kind"]] = totals.get(run["kind"], 0.0) + seconds
            parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in sorted(totals.items()))
            runs = "1 run" if count == 1 else f"{count} runs"
            console.print(f"critical path: {runs} of nodes; {parts}")
            if "explain" in report:
                explained = Table(
                    title="where the iteration time goes (along the critical path)",
                    title_justify="left",
                )
                explained.add_column("part")
                explained.add_column("time", justify="right")
                explained.add_column("share", justify="right")
                total = report["explain"]["iteration_time_s"] or 1.0
                for part, seconds in report["explain"]["breakdown_s"].items():
                    explained.add_row(
                        part, format_seconds(seconds), f"{100 * seconds / total:.1f} %"
                    )
                print_table(console, explained)
            if "timeline" in report:
                console.print(f"timeline written to {report['timeline']}")
        elif kind == "serving":
            _print_serving(console, report, source)
        elif kind == "memory":
            serving = "kv_cache" in report["classes"][0]
            table = Table(
                title=f"memory per rank in GiB on {report['system']} "
                f"(capacity {_gib(report['capacity_bytes'])} GiB)",
                title_justify="left",
            )
            middle = ("KV cache",) if serving else ("gradients", "optimizer")
            hybrid = any("group" in row for row in report["classes"])
            for column in (
                *(("group", "capacity") if hybrid else ()),
                "stage",
                "ranks",
                "weights",
                *middle,
                "activations",
                "buffers",
            ):
                table.add_column(column, justify="right")
            table.add_column("peak", justify="right")
            table.add_column("fits", justify="right")
            for row in report["classes"]:
                values = (row["kv_cache"],) if serving else (row["gradients"], row["optimizer"])
                table.add_row(
                    *((row["group"], _gib(row["capacity_bytes"])) if hybrid else ()),
                    str(row["stage"]),
                    str(row["ranks"]),
                    _gib(row["weights"]),
                    *(_gib(v) for v in values),
                    _gib(row["activations"]),
                    _gib(row["buffers"]),
                    _gib(row["peak"]),
                    "yes" if row["fits"] else "NO",
                )
            print_table(console, table)
            if serving:
                console.print(
                    f"largest batch that fits: {report['max_batch']:,}; longest sequence "
                    f"(context) at this batch: {report['max_context']:,} tokens"
                )
        else:
            console.print(f"[bold]{name}[/bold]")
            console.print_json(json.dumps(report, sort_keys=True, default=str))


def _print_serving(console: Any, report: Mapping[str, Any], source: str) -> None:
    """The serving report: TTFT or time per output token, tokens/s, the memory-bandwidth
    bound, and (``--explain``) where a step's time goes."""
    from rich.table import Table

    table = Table(
        title=f"serving ({report['phase']}): {source} on {report['system']}",
        title_justify="left",
        show_header=False,
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    if "ttft_s" in report:
        table.add_row("time to first token (prefill)", format_seconds(report["ttft_s"]))
    if "iteration_s" in report:
        table.add_row("iteration time", format_seconds(report["iteration_s"]))
    if "time_per_output_token_s" in report:
        table.add_row("time per output token", format_seconds(report["time_per_output_token_s"]))
    table.add_row(
        "memory-bandwidth bound per step (weights + KV / HBM)",
        format_seconds(report["memory_bandwidth_bound_s"]),
    )
    table.add_row("tokens per second (all replicas)", f"{report['tokens_per_s']:,.0f}")
    table.add_row("MFU", f"{100 * report['mfu']:.1f} %")
    print_table(console, table)
    if "explain" in report:
        split = Table(title="where one step's time goes (one rank)", title_justify="left")
        split.add_column("part")
        split.add_column("time", justify="right")
        split.add_column("share", justify="right")
        parts = report["explain"]["per_step_s"]
        total = sum(parts.values()) or 1.0
        for part, seconds in parts.items():
            label = part.removesuffix("_s").replace("_", " ")
            split.add_row(label, format_seconds(seconds), f"{100 * seconds / total:.1f} %")
        print_table(console, split)


# -- trace analysis (stg feed, stg inspect trace) -----------------------------------------------

DEPS_HELP = (
    "Dependencies that order the nodes: data+ctrl (what ASTRA-sim honours) or data "
    "(Chakra's feeder; for traces with unusable ctrl deps)."
)
WINDOW_HELP = "Most nodes the feeder holds in memory (it reads on past forward references)."
FORMAT_HELP = "Trace format: v0.0.4, v0.0.1 or json (default: detected)."


def check_common(deps: str, window: int, format: str | None) -> None:
    """Reject bad --deps/--window/--format values with one line (exit 2)."""
    from stg.trace.feeder import DEPS_MODES
    from stg.trace.reader import FORMATS

    if deps not in DEPS_MODES:
        raise UserError(f"--deps {deps}: not known; allowed: {', '.join(DEPS_MODES)}")
    if window < 1:
        raise UserError(f"--window {window}: must be a positive integer")
    if format is not None and format not in FORMATS:
        raise UserError(f"--format {format}: not known; allowed: {', '.join(FORMATS)}")


JOBS_HELP = "Worker processes reading rank files (default 0: every core); output is the same."
COMM_GROUP_FILE_HELP = (
    "The trace's comm-group file (default: the one its metadata names, else <name>.json beside "
    "the rank files or, when that is absent, the only other comm-group JSON file there)."
)


def check_jobs(jobs: int) -> None:
    """Reject a negative --jobs with one line (exit 2)."""
    from stg.trace.parallel import resolve_jobs

    resolve_jobs(jobs)


def check_comm_group_file(path: Path | None) -> None:
    """A --comm_group_file that is missing or not a comm-group map is one line (exit 2)."""
    if path is None:
        return
    from stg.errors import TraceError
    from stg.trace.validate import read_comm_groups

    if not path.is_file():
        raise UserError(f"--comm_group_file {path}: no such file")
    try:
        read_comm_groups(path)
    except TraceError as exc:
        raise UserError(f"--comm_group_file {exc}") from None


def run_analysis(
    path: Path,
    rank: int | None,
    deps: str,
    window: int,
    format: str | None,
    jobs: int = 0,
    comm_group_file: Path | None = None,
) -> list[TraceStats]:
    """Analyze the selected rank files (with ``jobs`` worker processes; 0: every core), with
    progress on stderr (:func:`progress_bar`). ``comm_group_file`` is checked and never read
    as a rank file."""
    from stg.cli import err_console
    from stg.trace.stats import (
        check_comm_groups,
        error_line,
        find_trace_files,
        iter_stats,
        select_rank,
    )

    check_common(deps, window, format)
    check_jobs(jobs)
    check_comm_group_file(comm_group_file)
    found = find_trace_files(path)
    check_comm_groups(path, found, comm_group_file)
    files = select_rank(found, rank)
    if comm_group_file is not None:
        files = [f for f in files if not _same_file(f.path, comm_group_file)] or files
    console = err_console()
    results: list[TraceStats] = []
    stats_of = iter_stats(files, deps=deps, window=window, format=format, jobs=jobs)  # type: ignore[arg-type]
    with _bar(console) as progress:
        for stats in stats_of:
            results.append(stats)
            progress("reading traces", len(results), len(files))
    line = error_line(results)
    if line is not None:
        typer.echo(f"error: {line}", err=True)
    return results


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


# -- formatting ---------------------------------------------------------------------------------


def format_seconds(value: float) -> str:
    """A duration with a unit that keeps three significant decimals."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} µs"


def format_bytes(size: int) -> str:
    """``1,234 B`` or ``1.21 KiB (1,234 B)``: exact bytes, and binary units when large."""
    if size < 1024:
        return f"{size:,} B"
    value = float(size)
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    index = 0
    value /= 1024
    while value >= 1024 and index < len(units) - 1:
        value /= 1024
        index += 1
    return f"{value:.2f} {units[index]} ({size:,} B)"


# -- option values coerced without pydantic where typer's result is certain ---------------------
#
# typer (0.29 and later) coerces each option's value through a pydantic ``TypeAdapter`` that it
# builds on the option's first use: a command imports pydantic (76 modules, about 50 ms of CPU)
# and builds an adapter for every option it declares, given or not (about a hundred for ``stg
# predict``, another 10 ms).
# :func:`light_coercion` makes typer's options first try the values whose result is certain: a
# ``str`` for a ``str`` option, a bool for a bool flag, an ASCII decimal within the option's
# bounds for an ``int`` or ``float`` option, a path already in its normal form for a ``Path``
# option (typer's own checks then run on it), whatever an option's ``parser`` returns, and
# lists of these. Any other value, and any value typer would refuse, goes through typer's own
# adapter, so every result and every error message stays typer's (tests/test_cli_coercion.py
# compares the two on each kind of value).

UNDECIDED = object()
"""What :func:`coerce_certain` returns for a value that typer's adapter must coerce."""

INTEGER = re.compile(r"[-+]?[0-9]{1,18}", re.ASCII)
"""Decimal integers as pydantic reads them (it strips blanks and takes ``1_000`` and ``1.0``
too: those go to its adapter)."""
DECIMAL = re.compile(r"[-+]?[0-9]{1,18}(\.[0-9]{1,18})?([eE][-+]?[0-9]{1,3})?", re.ASCII)
"""Decimal numbers that Python's ``float`` and pydantic's both round correctly (``inf``,
``nan`` and the rest go to pydantic's adapter)."""

LEAVES = (str, bool, int, float)


def coerce_certain(
    annotation: Any, info: Any, value: Any, param: Any = None, ctx: Any = None
) -> Any:
    """What typer's adapter for ``annotation`` (one value, not a list) with parameter info
    ``info`` returns for ``value`` (of option ``param`` in context ``ctx``), where that is
    certain without it; else :data:`UNDECIDED`."""
    if info.parser is not None:  # typer runs the parser first, whatever the annotation
        try:
            return info.parser(value)
        except (ValueError, AssertionError):  # pydantic words these as a validation error
            return UNDECIDED
    if _plain_path(annotation, info):
        # pydantic makes a str a Path; typer then checks it and names the path as given
        if type(value) is not str or not value or str(Path(value)) != value:
            return UNDECIDED
        try:
            from typer._param_types import coerce_cli_path
        except ImportError:
            return UNDECIDED
        return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
    if annotation is str:
        return value if type(value) is str else UNDECIDED
    if annotation is bool:
        return value if type(value) is bool else UNDECIDED
    if annotation is int:
        if type(value) is int:
            number: int | float = value
        elif type(value) is str and INTEGER.fullmatch(value):
            number = int(value)
        else:
            return UNDECIDED
    elif annotation is float:
        if type(value) in (int, float):
            number = float(value)
        elif type(value) is str and DECIMAL.fullmatch(value):
            number = float(value)
        else:
            return UNDECIDED
    else:
        return UNDECIDED
    if info.clamp:
        return UNDECIDED
    if (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        return UNDECIDED  # pydantic's adapter words the bound
    return number


def _plain_path(annotation: Any, info: Any) -> bool:
    """A ``Path`` option whose value typer makes a ``Path`` (no other path type)."""
    return annotation is Path and getattr(info, "path_type", None) in (None, Path)


def handles(annotation: Any, info: Any) -> bool:
    """Whether :func:`coerce_certain` may decide the values of such an option (a list of
    them included); files, other path types, choices, tuples and dates always go to typer."""
    if get_origin(annotation) is list:
        args = get_args(annotation)
        return len(args) == 1 and handles(args[0], info)
    return info.parser is not None or annotation in LEAVES or _plain_path(annotation, info)


def coerce_values(
    annotation: Any, info: Any, value: Any, param: Any = None, ctx: Any = None
) -> Any:
    """:func:`coerce_certain` for an option's value, a list option's included (typer gives
    a list back)."""
    if get_origin(annotation) is not list:
        return coerce_certain(annotation, info, value, param, ctx)
    if not isinstance(value, (list, tuple)):
        value = [value]
    (item_annotation,) = get_args(annotation)
    items = [coerce_certain(item_annotation, info, item, param, ctx) for item in value]
    return UNDECIDED if any(item is UNDECIDED for item in items) else items


def light_coercion() -> None:
    """Make typer's parameters coerce the values :func:`coerce_certain` decides without
    building a pydantic adapter (the others, and every error, still go through it).
    Idempotent; nothing changes on a typer without this coercion layer."""
    try:
        from typer._coercion import RuntimeParam, build_runtime_param
        from typer.core import _TyperParameter
    except ImportError:  # typer < 0.29: click's own types, no pydantic
        return
    original = getattr(_TyperParameter, "get_runtime_param", None)
    if original is None or getattr(original, "_stg_light", False):
        return

    @dataclass(frozen=True)
    class LightRuntimeParam(RuntimeParam):  # type: ignore[misc]
        """Certain values directly; the others through typer's adapter, built then."""

        descriptor: Any

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            result = coerce_values(self.annotation, self.parameter_info, value, param, ctx)
            if result is UNDECIDED:
                full = build_runtime_param(self.descriptor)
                return full._coerce_value(value, param=param, ctx=ctx)
            return result

    def get_runtime_param(self: Any) -> Any:
        descriptor = self.type_descriptor
        if self._runtime_param is None and descriptor.file_annotation is None:
            if handles(descriptor.annotation, descriptor.parameter_info):
                self._runtime_param = LightRuntimeParam(
                    parameter_info=descriptor.parameter_info,
                    annotation=descriptor.annotation,
                    descriptor=descriptor,
                )
        return original(self)

    get_runtime_param._stg_light = True  # type: ignore[attr-defined]
    _TyperParameter.get_runtime_param = get_runtime_param  # type: ignore[method-assign]
