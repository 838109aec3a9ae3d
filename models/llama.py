"""Llama: grouped-query attention (--kvhead), SwiGLU MLP, RMSNorm, rotary positions.

Query heads are laid out as (kvhead, qgroup): each of the ``kvhead`` key/value heads serves a
group of ``head / kvhead`` query heads, and tensor parallelism splits the kvhead dimension.

Attention that is not full causal (``--causal true``): ``--attention_window W`` (each query
sees its latest W keys) or ``--attention_chunk C`` (the keys of its own chunk), on every layer
or, with ``--full_attention_every k``, on all but every k-th layer (kinds ``local`` and
``global``: gpt-oss alternates sliding and full layers, Llama 4 has one global layer in
four); ``--attention_sinks true`` adds a learned logit per head to every softmax's
denominator (gpt-oss); ``--attention_output_gate true`` multiplies each head's output by the
sigmoid of another projection of the layer input before the output projection (Qwen3-Next's
gated attention: Qiu et al. 2025, "Gated Attention for Large Language Models", the
per-head elementwise gate after scaled dot-product attention).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stg.api import AttentionSpan, GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models.gpt import SOFTMAX_FLOPS, causal_scale, lm_head, tied

ROPE_FLOPS = 3  # two multiplies and an add per element
SWIGLU_FLOPS = 5  # silu (4) and the gate product (1)
SIGMOID_GATE_FLOPS = 5  # sigmoid (negate, exp, add, divide) and the product


def refuse_dropout(b: GraphBuilder) -> None:
    """Llama-family models (and the MoE and DeepSeek models built on them) train without
    dropout: ``--dropout`` > 0 is refused rather than silently ignored."""
    rate = b.options.get("dropout")
    if rate:
        model = b.options.get("model", "llama")
        raise UserError(
            f"{model} trains without dropout: dropout={rate} is not allowed; allowed: 0"
        )


def embedding(b: GraphBuilder, x: None) -> Tensor:
    refuse_dropout(b)
    wte = b.weight("wte", "dvocal dmodel", shard={"dvocal": "tp"}, tied=tied(b, "embedding"))
    return b.residual(b.gather(wte, b.tokens(), name="token_embedding"))


def attention_span(b: GraphBuilder, full: bool = False) -> AttentionSpan | None:
    """The keys a query of this layer sees when it is not every earlier one: the window or
    chunk of ``--attention_window`` / ``--attention_chunk`` (None on a ``full`` layer)."""
    window = b.options.get("attention_window")
    chunk = b.options.get("attention_chunk")
    if full or not (window or chunk):
        return None
    if window and chunk:
        raise UserError(f"attention_window={window} and attention_chunk={chunk}: give one of them")
    if not b.options.get("causal"):
        option = "attention_window" if window else "attention_chunk"
        raise UserError(f"{option} masks causal attention: it needs --causal true")
    return AttentionSpan(window=int(window or 0), chunk=int(chunk or 0))


def softmax(b: GraphBuilder, scores: Tensor, heads: str = "kvhead qgroup") -> Tensor:
    """The softmax over keys; with ``--attention_sinks true`` each head's learned sink logit
    joins every row's denominator (gpt-oss): a weight of one value per head, with a gradient.
    The sink costs 2 FLOPs per row forward (its exp and the add) and 2 backward for its
    gradient (``-p_sink`` times the row's ``Σ dP·P``, which the softmax backward has)."""
    if not b.options.get("attention_sinks"):
        # its backward needs only its output (Megatron-LM core 0.20.0's fused softmax
        # save_for_backward(softmax_results), PyTorch's SoftmaxBackward0 its result)
        return b.elementwise(
            "softmax", scores, flops=SOFTMAX_FLOPS, reduce=(-1,), backward_reads="output"
        )
    sinks = b.weight("sinks", heads, shard={heads.split()[0]: "tp"})
    per_row = 2 / scores.dims[-1].size  # per element of a row of keys
    return b.custom(
        "softmax",
        [scores, sinks],
        list(scores.dims),
        flops=SOFTMAX_FLOPS + per_row,
        backward_flops=(2 * SOFTMAX_FLOPS, per_row),
        grad_inputs=(0, 1),
        out_sharding=scores.sharding,
    )


def attention(b: GraphBuilder, x: Tensor, full: bool = False) -> Tensor:
    """Grouped-query attention; its queries see the keys :func:`attention_span` gives unless
    the layer is ``full`` (a global layer of a local/global stack)."""
    span = attention_span(b, full)
    tp = {"kvhead": "tp"}
    q = b.einsum(
        "bsh,hgrk->bsgrk", x, b.weight("wq", "dmodel kvhead qgroup dhead", shard=tp), name="q"
    )
    k = b.einsum("bsh,hgk->bsgk", x, b.weight("wk", "dmodel kvhead dhead", shard=tp), name="k")
    v = b.einsum("bsh,hgk->bsgk", x, b.weight("wv", "dmodel kvhead dhead", shard=tp), name="v")
    # RoPE is a fixed rotation: its backward rotates the gradient back and keeps no input
    # (Transformer Engine v2.10's FusedRoPEFunc saves only the frequencies)
    q = b.elementwise("rope_q", q, flops=ROPE_FLOPS, backward_reads="nothing")
    k = b.elementwise("rope_k", k, flops=ROPE_FLOPS, backward_reads="nothing")
    with b.tag("core_attention"):
        scores = b.einsum(
            "bsgrk,btgk->bgrst", q, k, name="scores", scale=causal_scale(b), span=span
        )
        probs = softmax(b, scores)
        ctx = b.einsum(
            "bgrst,btgk->bsgrk", probs, v, name="context", scale=causal_scale(b), span=span
        )
    if b.options.get("attention_output_gate"):
        w_gate = b.weight("w_gate", "dmodel kvhead qgroup dhead", shard=tp)
        gate = b.einsum("bsh,hgrk->bsgrk", x, w_gate, name="gate_proj")
        ctx = b.elementwise("output_gate", ctx, gate, flops=SIGMOID_GATE_FLOPS)
    wo = b.weight("wo", "kvhead qgroup dhead dmodel", shard=tp)
    return b.residual(b.einsum("bsgrk,grkh->bsh", ctx, wo, name="attn_out"))


def mlp(b: GraphBuilder, x: Tensor, ffn: str = "dff") -> Tensor:
    """The SwiGLU MLP of FFN size ``ffn`` (a dimension: ``dff``, or ``dff_dense`` for the
    dense layers of a stack of MoE layers), column/row parallel over tp."""
    tp = {ffn: "tp"}
    with b.tag("mlp"):  # re-run under --recompute_modules mlp
        # Megatron-Core's fc1 holds gate and up as one weight (linear="fc1")
        w1 = b.weight("w1", f"dmodel {ffn}", shard=tp, linear="fc1")
        gate = b.einsum("bsh,hf->bsf", x, w1, name="gate")
        w3 = b.weight("w3", f"dmodel {ffn}", shard=tp, linear="fc1")
        up = b.einsum("bsh,hf->bsf", x, w3, name="up")
        act = b.elementwise("swiglu", gate, up, flops=SWIGLU_FLOPS)
        w2 = b.weight("w2", f"{ffn} dmodel", shard=tp)
        down = b.einsum("bsf,fh->bsh", act, w2, name="down")
        return b.residual(down)


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


def global_block(b: GraphBuilder, x: Tensor) -> Tensor:
    """A layer whose attention sees every earlier key (the global layer of a local stack)."""
    x = b.add(x, attention(b, b.rmsnorm(x, "attention_norm"), full=True), name="residual1")
    return b.add(x, mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


Block = Callable[[GraphBuilder, Tensor], Tensor]


def local_global_stack(
    options: Mapping[str, Any], local: Block, full: Block
) -> list[tuple[str, Block, int]]:
    """The layers of a stack whose every ``full_attention_every``-th layer (the k-th, 2k-th,
    ...) is ``full`` (kind ``global``) and the others ``local`` (kind ``local``: a window or
    chunk); one kind ``block`` when the option is unset."""
    layers = int(options["num_stacks"])
    every = options.get("full_attention_every")
    if not every:
        return [("block", local, layers)]
    if not (options.get("attention_window") or options.get("attention_chunk")):
        raise UserError(
            f"full_attention_every={every} alternates local and full layers: it needs "
            "--attention_window or --attention_chunk"
        )
    return [
        ("global", full, 1) if (layer + 1) % int(every) == 0 else ("local", local, 1)
        for layer in range(layers)
    ]


def stack(options: Mapping[str, Any]) -> list[tuple[str, Block, int]]:
    """Llama's layers: all alike, or local and global in turn (``--full_attention_every``)."""
    return local_global_stack(options, block, global_block)


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    return lm_head(b, x, "rmsnorm")


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "llama",
            embedding=embedding,
            block=block,
            head=head,
            stack=stack,
            description="Llama: grouped-query attention, SwiGLU, RMSNorm, rotary positions",
        )
    )
