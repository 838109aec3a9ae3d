"""The kernels torchtitan's Llama runs eagerly where stg's nodes price fused ones
(``--profile torchtitan``).

torchtitan at pytorch/torchtitan 1ea476e9f (2024-04-24; the commit of the Llama 2 / Llama 3
rows of ``docs/performance.md``) trains without ``torch.compile`` (``compile = false`` in every
``train_configs/*.toml``) and without autocast (FSDP2's ``MixedPrecisionPolicy`` keeps the
weights and activations bf16). Its model code then runs these ops one aten kernel each, each
kernel reading and writing its tensors through HBM:

- rotary positions in complex form (``torchtitan/models/llama/model.py:105-110``,
  ``apply_rotary_emb``): ``x.float()``, a complex64 multiply by ``freqs_cis`` (``s·dhead/2``
  complex values), ``.type_as(x)``; backward the same three, plus the copy that resolves
  ``freqs_cis.conj()`` (``clone``);
- ``repeat_kv`` (``model.py:113-122``): ``expand`` then ``reshape`` copies K and V to every
  query head of their group (``clone``) where ``n_heads > n_kv_heads``; backward a ``sum``
  over the group;
- SwiGLU as ``F.silu(w1(x)) * w3(x)`` (``model.py:248``): ``silu`` and ``mul`` forward;
  two ``mul`` and ``silu_backward`` backward;
- with ``norm_type = "rmsnorm"`` (``train_configs/llama2_70b.toml:21``,
  ``llama3_70b.toml:21``; the 8B and 13B configs run ``fused_rmsnorm``, a Triton kernel that
  stg's norm nodes price), RMSNorm in fp32 (``torchtitan/models/norms.py:90-95``):
  ``x.float()``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``type_as``, the weight's
  ``mul`` forward, and their autograd backward (16 kernels);
- logits in fp32 (``model.py:432``, ``self.output(h).float()``) before
  ``F.cross_entropy`` (``train.py:164``): the fp32 copy, ``_log_softmax``,
  ``nll_loss_forward``; backward ``nll_loss_backward`` (a zeroed fp32 gradient of the
  logits' size with one value per row written), ``_log_softmax_backward_data`` and the copy
  back to bf16.

The aten ops and their operands were listed with a ``TorchDispatchMode`` over these
expressions, forward and backward (PyTorch's autograd formulas: ``mul``'s saves both operands,
``pow``'s backward is ``grad·2·x.pow(1)``, ``mean``'s an expanded division; views are no
kernels). Each kernel's bytes are its operands' as the op defines them: every input tensor
read once (a broadcast one at its own size) and every output written once.
:func:`with_torchtitan_kernels` writes them on the node that stg has for that computation, as
the attributes :data:`EAGER_KERNELS_ATTR` (memory class and dtype of each kernel) and
:data:`EAGER_KERNEL_BYTES_ATTR`; the node's ``tensor_size`` becomes their sum. The time
predictor prices each as a memory-bound kernel of its own
(:func:`stg.perf.costs.compute_time`). The K and V copies of ``repeat_kv`` have no node of
their own in stg: they run between RoPE and attention and are recomputed with RoPE under
op-level selective checkpointing, so ``rope_k`` carries them, and its gradient the sums.

Not on the nodes: the memory these kernels hold (see ``docs/prediction.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stg.core.precision import DTYPE_BYTES
from stg.core.workload import NodeType

if TYPE_CHECKING:  # the predictors read the attributes' names without loading lowering
    from stg.core.lowering import Binder, BoundOp, BoundPart
    from stg.core.symbolic import Op

EAGER_KERNELS_ATTR = "eager_kernels"
"""Node attribute: the kernels eager PyTorch runs for the node, one ``class:dtype`` string each
(class a memory-bound kernel class of :mod:`stg.perf.kernel_time`'s ``MEMORY_KERNEL_SPEED``:
``stream``, and the classes measured for these kernels on an H100: ``convert``, ``broadcast``,
``broadcast16``, ``reduce``, ``log_softmax``, ``log_softmax_backward``)."""

EAGER_KERNEL_BYTES_ATTR = "eager_kernel_bytes"
"""Node attribute: the bytes each of :data:`EAGER_KERNELS_ATTR`'s kernels reads and writes."""

NORM_TYPES = ("fused_rmsnorm", "rmsnorm")
"""torchtitan's ``model.norm_type`` values of a Llama: its fused Triton RMSNorm, or the fp32
module of separate ops (``torchtitan/models/norms.py``, ``create_norm``)."""

ROPE_OPS = frozenset({"rope_q", "rope_k"})
ROPE_WITH_KV_COPIES = "rope_k"
SWIGLU_OP = "swiglu"
CROSS_ENTROPY_OP = "cross_entropy"
NORM_TAG = "layernorm"

FP32 = 4
COMPLEX64 = 8
INT64 = 8


@dataclass(frozen=True)
class Kernel:
    """One eager kernel: the aten op, its memory-bound class, its dtype and the bytes it moves
    (and, where a node of such kernels alone counts its ops, the elements it writes)."""

    aten: str
    nbytes: int
    dtype: str = "bf16"
    kind: str = "stream"
    written: int = 0


def rope_kernels(n: int, freqs: int, width: int, backward: bool) -> list[Kernel]:
    """``apply_rotary_emb`` on one tensor of ``n`` elements of ``width`` bytes, against
    ``freqs`` bytes of ``freqs_cis``: forward or backward."""
    to_fp32 = Kernel("_to_copy", n * (width + FP32), "fp32", "convert")
    multiply = Kernel("mul", 2 * n * FP32 + freqs, "fp32")  # n/2 complex64 in and out
    to_narrow = Kernel("_to_copy", n * (FP32 + width), kind="convert")
    if not backward:
        return [to_fp32, multiply, to_narrow]
    return [to_fp32, Kernel("clone", 2 * freqs, "fp32"), multiply, to_narrow]


def repeat_kv_kernels(kv: int, group: int, width: int, backward: bool) -> list[Kernel]:
    """``repeat_kv`` of K and of V (``kv`` elements each) to ``group`` query heads per key
    head: a copy each forward, a sum over the group each backward; none for ``group`` 1."""
    if group <= 1:
        return []
    moved = kv * width + kv * group * width
    # the copy reads its source broadcast over the group; the sum reduces over it
    if backward:
        return [Kernel("sum", moved, kind="reduce") for _ in ("k", "v")]
    return [Kernel("clone", moved, kind="broadcast16") for _ in ("k", "v")]


def swiglu_kernels(n: int, width: int, grad_of: str | None) -> list[Kernel]:
    """``F.silu(gate) * up`` over ``n`` elements: forward (``grad_of`` None), or the gradient
    of ``gate`` (``mul`` by ``up``, ``silu_backward``) or of ``up`` (``mul`` by the saved
    ``silu(gate)``)."""
    three = 3 * n * width  # two operands read, one written
    if grad_of is None:
        return [Kernel("silu", 2 * n * width), Kernel("mul", three)]
    if grad_of == "gate":
        return [Kernel("mul", three), Kernel("silu_backward", three)]
    return [Kernel("mul", three)]


def rmsnorm_kernels(
    n: int, d: int, width: int, weight_width: int, grad_of: str | None
) -> list[Kernel]:
    """torchtitan's ``RMSNorm`` (``norm_type = "rmsnorm"``) over ``n`` elements in rows of
    ``d``: forward (``grad_of`` None), the weight's gradient (``"weight"``) or the input's."""
    rows = n // d
    f32 = FP32 * n
    row = FP32 * rows
    weight = d * weight_width
    if grad_of is None:
        return [
            Kernel("_to_copy", n * width + f32, "fp32", "convert"),
            Kernel("pow", 2 * f32, "fp32"),
            Kernel("mean", f32 + row, "fp32", "reduce"),
            Kernel("add", 2 * row, "fp32"),
            Kernel("rsqrt", 2 * row, "fp32"),
            Kernel("mul", 2 * f32 + row, "fp32", "broadcast"),
            Kernel("_to_copy", f32 + n * width, kind="convert"),
            Kernel("mul", 2 * n * width + weight, kind="broadcast16"),
        ]
    if grad_of == "weight":
        return [Kernel("mul", 3 * n * width), Kernel("sum", n * width + weight)]
    return [
        Kernel("mul", 2 * n * width + weight, kind="broadcast16"),
        Kernel("_to_copy", n * width + f32, "fp32", "convert"),
        Kernel("mul", 3 * f32, "fp32"),  # gradient times x: the rsqrt's gradient
        Kernel("mul", 2 * f32 + row, "fp32", "broadcast"),  # times rsqrt: x's first gradient
        Kernel("sum", f32 + row, "fp32", "reduce"),
        Kernel("pow", 2 * row, "fp32"),  # rsqrt's backward, per row
        Kernel("mul", 2 * row, "fp32"),
        Kernel("mul", 3 * row, "fp32"),
        Kernel("div", row + f32, "fp32", "broadcast"),  # mean's backward: expanded gradient / d
        Kernel("pow", 2 * f32, "fp32"),  # pow's backward: 2·x.pow(1)·gradient
        Kernel("mul", 2 * f32, "fp32"),
        Kernel("mul", 3 * f32, "fp32"),
        Kernel("add", 3 * f32, "fp32"),  # x.float()'s two gradients
        Kernel("_to_copy", f32 + n * width, kind="convert"),
    ]


def cross_entropy_kernels(n: int, rows: int, width: int, backward: bool) -> list[Kernel]:
    """``F.cross_entropy(logits.float())`` over ``n`` logits in ``rows`` rows (tokens)."""
    f32 = FP32 * n
    if not backward:
        return [
            Kernel("_to_copy", n * width + f32, "fp32", "convert"),
            Kernel("_log_softmax", 2 * f32, "fp32", "log_softmax"),
            # the target's log-probability of each row and the targets; loss, total weight
            Kernel("nll_loss_forward", rows * (FP32 + INT64) + 2 * FP32, "fp32"),
        ]
    return [
        Kernel("nll_loss_backward", f32 + rows * (FP32 + INT64), "fp32"),
        Kernel("_log_softmax_backward_data", 3 * f32, "fp32", "log_softmax_backward"),
        Kernel("_to_copy", f32 + n * width, kind="convert"),
    ]


def _width(dtype: str) -> int:
    return int(DTYPE_BYTES.get(dtype, 2))


def _size(binder: Binder, op: Op, tensor_index: int, dim: str) -> int:
    t = op.inputs[tensor_index] if tensor_index >= 0 else op.output
    for d, axes in zip(t.dims, t.sharding.dims, strict=True):
        if d.name == dim:
            return binder.local_dim(d, axes)
    raise ValueError(f"{op.name}: {t!r} has no dimension {dim!r}")


def _grad_target(grad: Op, forward: Op) -> int:
    """Which input of ``forward`` ``grad`` computes the gradient of (its typed
    :attr:`~stg.core.symbolic.Op.grad_wrt`, set by :mod:`stg.core.autodiff`)."""
    if grad.grad_wrt is None or not 0 <= grad.grad_wrt < len(forward.inputs):
        raise ValueError(f"{grad.name}: not the gradient of an input of {forward.name}")
    return grad.grad_wrt


def op_kernels(
    op: Op, binder: Binder, norm_type: str, forward_ops: Mapping[str, Op]
) -> list[Kernel] | None:
    """The eager kernels torchtitan runs for the computation of ``op`` (a forward op, or a
    backward op with its ``grad_of``), or None where stg's node prices what runs."""
    forward = op.grad_of or op
    backward = op.grad_of is not None
    name = forward.name
    x = forward.inputs[0]
    width = _width(x.dtype)
    if name in ROPE_OPS:
        n = binder.numel(forward.output)
        freqs = _size(binder, forward, -1, "seq") * _size(binder, forward, -1, "dhead") // 2
        kernels = rope_kernels(n, freqs * COMPLEX64, width, backward)
        if name == ROPE_WITH_KV_COPIES and "rope_q" in forward_ops:
            group = binder.numel(forward_ops["rope_q"].output) // n
            kernels += repeat_kv_kernels(n, group, width, backward)
        return kernels
    if name == SWIGLU_OP:
        grad_of = None
        if backward:
            grad_of = "gate" if _grad_target(op, forward) == 0 else "up"
        return swiglu_kernels(binder.numel(x), width, grad_of)
    if name == CROSS_ENTROPY_OP:
        return cross_entropy_kernels(binder.numel(x), binder.numel(forward.output), width, backward)
    weights = [t for t in forward.inputs[1:] if t.kind == "weight"]
    if norm_type == "rmsnorm" and NORM_TAG in forward.tags and len(weights) == 1:
        grad_of = None
        if backward:
            target = forward.inputs[_grad_target(op, forward)]
            grad_of = "weight" if target is weights[0] else "input"
        d = _size(binder, forward, 0, weights[0].dims[-1].name)
        return rmsnorm_kernels(binder.numel(x), d, width, _width(weights[0].dtype), grad_of)
    return None


def with_kernels(op: BoundOp, kernels: list[Kernel]) -> BoundOp:
    """``op`` priced as ``kernels`` run in turn (:data:`EAGER_KERNELS_ATTR`,
    :data:`EAGER_KERNEL_BYTES_ATTR`), its ``tensor_size`` their bytes."""
    attrs = (
        *op.attrs,
        (EAGER_KERNELS_ATTR, tuple(f"{k.kind}:{k.dtype}" for k in kernels)),
        (EAGER_KERNEL_BYTES_ATTR, tuple(k.nbytes for k in kernels)),
    )
    return replace(op, tensor_size=sum(k.nbytes for k in kernels), attrs=attrs)


def with_torchtitan_kernels(part: BoundPart, binder: Binder, norm_type: str) -> BoundPart:
    """``part`` with torchtitan's eager kernels (module docstring) on the nodes that compute
    what they compute, forward and backward; ``norm_type`` is the Llama's ``norm_type``
    (:data:`NORM_TYPES`)."""
    forward_ops = {op.name: op for op in part.part.forward}
    return _with_op_kernels(part, lambda op: op_kernels(op, binder, norm_type, forward_ops))


def with_fp32_cross_entropy(part: BoundPart, binder: Binder) -> BoundPart:
    """``part`` with the eager kernels of ``F.cross_entropy(logits.float())`` on its loss
    nodes, forward and backward (:func:`cross_entropy_kernels`), and nothing else changed: the
    loss of an eager training script (``benchmarks/eager_step.py``) and of Hugging Face's
    causal language models, which cast the logits to fp32 before the loss, under
    ``--profile eager`` (whose other ops :mod:`stg.perf.eager` prices)."""

    def loss_kernels(op: Op) -> list[Kernel] | None:
        forward = op.grad_of or op
        if forward.name != CROSS_ENTROPY_OP:
            return None
        x = forward.inputs[0]
        return cross_entropy_kernels(
            binder.numel(x), binder.numel(forward.output), _width(x.dtype), op.grad_of is not None
        )

    return _with_op_kernels(part, loss_kernels)


def _with_op_kernels(part: BoundPart, kernels_of: Callable[[Op], list[Kernel] | None]) -> BoundPart:
    """``part`` with ``kernels_of(op)`` (where not None) on the compute node of each of its
    forward and backward ops."""
    by_name = {op.name: op for op in (*part.part.forward, *part.part.backward)}

    def rewritten(ops: Iterable[BoundOp]) -> list[BoundOp]:
        out = []
        for bound in ops:
            op = by_name.get(bound.name) if bound.type is NodeType.COMP else None
            kernels = kernels_of(op) if op is not None else None
            out.append(with_kernels(bound, kernels) if kernels else bound)
        return out

    return replace(part, forward=rewritten(part.forward), backward=rewritten(part.backward))
