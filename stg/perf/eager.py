"""What eager PyTorch runs for one node of a generated training graph (``--profile eager``).

Eager PyTorch dispatches one aten op at a time, and each costs the host its dispatch,
autograd bookkeeping and launch (:data:`stg.perf.costs.EAGER_OP_HOST_S`). It dispatches more
ops than stg has nodes: bf16 autocast over fp32 weights copies every weight (and every fp32
activation a matmul takes) into bf16 and every such gradient back, rotary positions in the
rotate-half form are five ops forward and nine backward, and a gradient that two consumers
return is summed by one more add each. :data:`EAGER_OPS` holds, per node op (the typed ``op``
attribute, :func:`stg.perf.kernels.kernel_name`), the ops eager PyTorch 2.11 dispatches on a
CUDA GPU for the models ``benchmarks/eager_step.py`` writes (Llama and GPT layers, embedding
and head, as eager training scripts and Hugging Face's models write them): 97 per Llama layer
and 72 per GPT layer, where stg has 42 and 53 nodes. Where these came from:

- **Counted on the GPU.** A ``TorchDispatchMode`` over one training step of
  ``eager_step.build`` (bf16 autocast on CUDA, torch 2.11.0+cu130 on an H200; views and
  ``_unsafe_view`` left out), two layers minus one layer: 97 ops per Llama layer (34
  ``_to_copy``, 21 ``mm``, 13 ``add``, 11 ``mul``, 4 ``neg``, 4 ``slice_backward``, 2 ``cat``,
  2 ``_fused_rms_norm`` and 2 of its backward, ``silu`` and its backward, cuDNN SDPA and its
  backward) and 72 per GPT layer (34 ``_to_copy``, 12 ``mm``, 6 ``addmm``, 6 ``sum``,
  6 ``add``, ``native_layer_norm`` and its backward twice, ``gelu`` and its backward, SDPA
  and its backward); 18 (Llama) and 23 (GPT) outside the layers
  (tests/data/eager/h200-eager-op-counts.json).
- **From PyTorch's source** (2.11): ``rms_norm`` calls ``_fused_rms_norm`` when the weight has
  the input's dtype (``aten/src/ATen/native/layer_norm.cpp``, ``rms_norm_symint``), one CUDA
  kernel forward and ``_fused_rms_norm_backward`` for both gradients (``native_functions.yaml``,
  ``derivatives.yaml``); on a CPU it is the composite pow, mean, add, rsqrt, mul, mul instead.
  Autocast casts a fp32 leaf that requires grad once per autocast region and caches it
  (``aten/src/ATen/autocast_mode.cpp``, ``cached_cast``): one copy per weight per forward; an
  activation is cast at every use (``q``, ``k`` and ``v`` each cast the norm's output). The
  autograd engine casts a gradient back to its input's dtype (a ``_to_copy``): a weight's bf16
  gradient to fp32, and an fp32 gradient to a bf16 input (the residual stream is fp32: the
  embedding's output is, and ``x + bf16`` promotes). ``F.linear`` with a bias is one
  ``addmm`` (the bias add is in the GEMM); its backward sums the bias gradient. A first
  gradient accumulation into ``.grad`` (set to None by ``zero_grad``) takes the tensor: no op.
- **From the eager model's code** (``benchmarks/eager_step.py``, ``Experts``): a mixture's
  router and expert GEMMs with their copies of the fp32 stacked expert weights to bf16 and
  of their gradients back (:func:`_moe`; a profiled Qwen3-30B-A3B layer on the H200 spends
  2.6 ms per step in such copies, tests/data/kernels/h200-moe-layer.jsonl).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stg.core.precision import DTYPE_BYTES
from stg.perf.casts import default_cast_model
from stg.perf.kernels import kernel_name
from stg.perf.system import System


@dataclass(frozen=True, slots=True)
class EagerOps:
    """What eager PyTorch runs for one node."""

    ops: int
    """aten ops dispatched (each pays the host's time per op)"""
    casts: tuple[str, ...] = ()
    """autocast copies among them, of a GEMM node's ``input`` (batch·m·k elements),
    ``weight`` (batch·k·n) or ``output`` (batch·m·n) between fp32 and bf16, priced as
    streaming kernels (:func:`stg.perf.casts.default_cast_model`)"""
    own_kernel: bool = True
    """False where the node's arithmetic runs in another node's op (a bias in ``addmm``) or
    nowhere (a gradient passed on unchanged): its own kernel time is none"""


ONE_OP = EagerOps(1)
"""a node stg has no count for: one op, its own kernel"""


def _linear(
    op: str,
    source: str,
    weight: str,
    cast_input: bool,
    cast_input_grad: bool = False,
    bias: str | None = None,
) -> Iterator[tuple[str, EagerOps]]:
    """The entries of one ``nn.Linear`` under autocast: ``op`` multiplies ``source`` by
    ``weight`` (and adds ``bias`` in the same ``addmm``). ``cast_input``: its input is fp32
    (a norm's output), copied to bf16 forward and its gradient back to fp32 backward.
    ``cast_input_grad``: its output feeds the fp32 residual, whose gradient is copied to bf16
    before the input gradient's GEMM."""
    yield op, EagerOps(3, ("input", "weight")) if cast_input else EagerOps(2, ("weight",))
    grad_source = f"{op}.grad_{source}"
    if cast_input:
        yield grad_source, EagerOps(2, ("output",))
    elif cast_input_grad:
        yield grad_source, EagerOps(2, ("input",))
    else:
        yield grad_source, EagerOps(1)
    yield f"{op}.grad_{weight}", EagerOps(2, ("output",))
    if bias is not None:
        name = f"{op}_bias"
        yield name, EagerOps(1, own_kernel=False)  # the bias's cast; the add is in addmm
        yield f"{name}.grad_{op}", EagerOps(0, own_kernel=False)  # passed on unchanged
        yield f"{name}.grad_{bias}", EagerOps(2)  # sum over tokens, cast back to fp32


def _norm(op: str, source: str, bias: bool) -> Iterator[tuple[str, EagerOps]]:
    """A LayerNorm (``native_layer_norm``) or RMSNorm (``_fused_rms_norm``): one op forward,
    one backward for the input's and the weights' gradients together."""
    yield op, EagerOps(1)
    yield f"{op}.grad_{source}", EagerOps(1)
    yield f"{op}.grad_{op}.weight", EagerOps(0)  # in the same backward op
    if bias:
        yield f"{op}.grad_{op}.bias", EagerOps(0)


def _rope(op: str, source: str) -> Iterator[tuple[str, EagerOps]]:
    """Rotate-half rotary positions, ``t * cos + cat((-t2, t1)) * sin`` with fp32 ``cos`` and
    ``sin`` over a bf16 ``t``: mul, neg, cat, mul, add forward, and the copy of the fp32
    result to bf16 that autocast makes for SDPA; backward that copy's cast back to fp32, two
    muls by ``cos`` and ``sin`` and their casts back to bf16, the neg, a ``slice_backward``
    per half and two adds of the three gradients of ``t``."""
    yield op, EagerOps(6)
    yield f"{op}.grad_{source}", EagerOps(10)


def _cross_entropy() -> Iterator[tuple[str, EagerOps]]:
    """``F.cross_entropy(logits.float())``: the fp32 copy, ``_log_softmax``, ``nll_loss``;
    backward the loss's seed (``ones_like``), ``nll_loss_backward``,
    ``_log_softmax_backward_data`` and the cast back to bf16."""
    yield "cross_entropy", EagerOps(3)
    yield "cross_entropy.grad_logits", EagerOps(4)


def _head(norm: str, bias: bool) -> Iterator[tuple[str, EagerOps]]:
    yield from _norm(norm, "x", bias)
    yield from _linear("logits", norm, "lm_head", cast_input=True)
    yield from _cross_entropy()


def _residual(op: str) -> Iterator[tuple[str, EagerOps]]:
    """``x + branch``: one add; its gradient to ``x`` is passed on, and the cast of the
    branch's gradient to bf16 is counted at the branch's GEMM (``cast_input_grad``)."""
    yield op, EagerOps(1)


def _llama() -> Iterator[tuple[str, EagerOps]]:
    yield "token_embedding", EagerOps(1)
    yield "token_embedding.grad_wte", EagerOps(1)  # embedding_dense_backward
    yield from _norm("attention_norm", "x", bias=False)
    for op, weight in (("q", "wq"), ("k", "wk"), ("v", "wv")):
        yield from _linear(op, "attention_norm", weight, cast_input=True)
    yield from _rope("rope_q", "q")
    yield from _rope("rope_k", "k")
    yield "core_attention", EagerOps(1)  # fused SDPA
    yield "core_attention.grad", EagerOps(1)
    yield from _linear("attn_out", "context", "wo", cast_input=False, cast_input_grad=True)
    yield from _residual("residual1")
    yield from _norm("ffn_norm", "residual1", bias=False)
    yield from _linear("gate", "ffn_norm", "w1", cast_input=True)
    yield from _linear("up", "ffn_norm", "w3", cast_input=True)
    yield "swiglu", EagerOps(2)  # silu, mul
    yield "swiglu.grad_gate", EagerOps(2)  # mul by up, silu_backward
    yield "swiglu.grad_up", EagerOps(1)  # mul by silu(gate)
    yield from _linear("down", "swiglu", "w2", cast_input=False, cast_input_grad=True)
    yield from _residual("residual2")
    yield from _head("ln_f", bias=False)


def _gpt() -> Iterator[tuple[str, EagerOps]]:
    yield "token_embedding", EagerOps(1)
    yield "token_embedding.grad_wte", EagerOps(1)
    yield "position_embedding", EagerOps(3)  # arange, embedding, add
    yield "position_embedding.grad_token_embedding", EagerOps(0, own_kernel=False)
    yield "position_embedding.grad_wpe", EagerOps(2)  # sum over the batch, embedding backward
    yield from _norm("ln1", "x", bias=True)
    for op, weight, bias in (("q", "wq", "bq"), ("k", "wk", "bk"), ("v", "wv", "bv")):
        yield from _linear(op, "ln1", weight, cast_input=True, bias=bias)
    yield "core_attention", EagerOps(1)
    yield "core_attention.grad", EagerOps(1)
    yield from _linear("attn_out", "context", "wo", False, cast_input_grad=True, bias="bo")
    yield from _residual("residual1")
    yield from _norm("ln2", "residual1", bias=True)
    yield from _linear("fc1", "ln2", "w1", cast_input=True, bias="b1")
    yield "gelu", EagerOps(1)
    yield "gelu.grad_fc1_bias", EagerOps(1)  # gelu_backward
    yield from _linear("fc2", "gelu", "w2", cast_input=False, cast_input_grad=True, bias="b2")
    yield from _residual("residual2")
    yield from _head("ln_f", bias=True)


def _moe() -> Iterator[tuple[str, EagerOps]]:
    """``eager_step.build``'s ``Experts`` (the ``torch._grouped_mm`` path the H200 steps ran,
    tests/data/eager/h200-eager-moe-steps.jsonl): the fp32 norm output is copied to bf16
    once (``x.to``) for the router and the experts; the router, an ``nn.Linear`` under
    autocast, casts its weight and its logits go back to fp32 (``.float()``); the stacked
    fp32 expert weights are copied to bf16 every forward (``self.w13.to``, ``self.w2.to``)
    and autograd copies their gradients back to fp32. ``w13`` holds gate and up: one copy,
    one ``_grouped_mm`` for both (and, backward, one for the input's and one for the
    weight's gradient after the ``cat`` that joins the two halves' gradients), so
    ``expert_gate`` counts the ops and ``expert_up`` prices its half of the copies."""
    # x.to(bf16), the weight's cast, mm, .float(); backward the logits' gradient to bf16,
    # mm, x's gradient back to fp32 (after index_select's is added to it); the weight's
    yield "router", EagerOps(4, ("input", "weight", "output"))
    yield "router.grad_ffn_norm", EagerOps(3, ("input", "output"))
    yield "router.grad_router", EagerOps(2, ("output",))
    yield "expert_gate", EagerOps(2, ("weight",))  # w13's copy, _grouped_mm
    yield "expert_up", EagerOps(0, ("weight",))
    yield "expert_down", EagerOps(2, ("weight",))  # w2's copy, _grouped_mm
    yield "expert_down.grad_swiglu", EagerOps(1)
    yield "expert_down.grad_w2", EagerOps(2, ("output",))  # _grouped_mm, copy to fp32
    yield "expert_gate.grad_dispatch", EagerOps(2)  # cat of the halves' gradients, _grouped_mm
    yield "expert_up.grad_dispatch", EagerOps(0)
    yield "expert_gate.grad_w1", EagerOps(2, ("output",))  # _grouped_mm, copy to fp32
    yield "expert_up.grad_w3", EagerOps(0, ("output",))


def _table() -> dict[str, EagerOps]:
    table: dict[str, EagerOps] = {}
    for op, ops in (*_llama(), *_gpt(), *_moe()):
        if table.setdefault(op, ops) != ops:
            raise AssertionError(f"two counts for {op}: {table[op]} and {ops}")
    return table


EAGER_OPS: Mapping[str, EagerOps] = _table()
"""Per node op: the ops eager PyTorch dispatches (module docstring). Llama's and GPT's ops of
the same name (``q``, ``ln_f``, ``cross_entropy``) run the same ops; a bias is a node of its
own (``q_bias``). Gradient sums (``*.grad_sum``) are counted by :func:`gradient_sum_ops`."""


def gradient_sum_ops(node: Any) -> int:
    """Adds eager PyTorch runs for a gradient sum of t terms (an add node of ``t - 1`` FLOPs
    per element that reads t tensors and writes one of its dtype): ``t - 1``, one per further
    gradient the autograd engine accumulates."""
    width = DTYPE_BYTES.get(node.dtype or "bf16", 2)
    if node.tensor_size <= 0:
        return 1
    ratio = node.num_ops * width / node.tensor_size  # (t - 1) / (t + 1)
    if not 0 < ratio < 1:
        return 1
    return max(1, round((1 + ratio) / (1 - ratio)) - 1)


def eager_ops(node: Any) -> EagerOps:
    """What eager PyTorch runs for ``node``: its :data:`EAGER_OPS` entry, a gradient sum's
    adds, else one op of its own."""
    op = kernel_name(node)
    found = EAGER_OPS.get(op)
    if found is not None:
        return found
    if op.endswith(".grad_sum"):
        return EagerOps(gradient_sum_ops(node))
    return ONE_OP


def _cast_elements(node: Any, operand: str) -> int:
    gemm = (getattr(node, "attrs", None) or {}).get("gemm")
    if gemm is None or len(gemm) != 4:
        return 0
    batch, m, n, k = gemm
    return int(batch * {"input": m * k, "weight": k * n, "output": m * n}[operand])


def eager_time(node: Any, system: System, kernel_seconds: float, op_host_s: float) -> float:
    """Time of ``node`` in eager PyTorch: its kernel's ``kernel_seconds`` (none where another
    op runs its arithmetic) and the autocast copies it adds, or its ops' host time
    (``op_host_s`` each) where that is longer."""
    ops = eager_ops(node)
    device = kernel_seconds if ops.own_kernel else 0.0
    if ops.casts:
        model = default_cast_model(system)
        device += sum(model.time(_cast_elements(node, c), "fp32", "bf16") for c in ops.casts)
    return max(device, ops.ops * op_host_s)
