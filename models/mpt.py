"""MPT (MosaicML's MosaicPretrainedTransformer): multi-head attention with ALiBi instead of
position embeddings, a GELU MLP, LayerNorms, and no biases anywhere (``no_bias``).

ALiBi (Press, Smith and Lewis, "Train Short, Test Long", ICLR 2022, arXiv:2108.12409,
section 3) adds ``-m_a · (i - j)`` to the score of query i and key j, a fixed slope ``m_a``
per head (a geometric sequence, no weights, no gradient). FlashAttention computes the bias
inside its kernel from the slopes (flash-attn 2.4's ``alibi_slopes``; MPT-7B trained with
llm-foundry's Triton FlashAttention, whose bias input does the same): one multiply and one
add per score, no memory traffic beyond a slope per head. Here the bias is a 2-FLOP op on
the scores in the attention core, so a fused core (``--attention fused``) counts its FLOPs in
the one kernel and moves no bytes for it, and an unfused one runs it as its own kernel over
the score matrix. Its backward passes the scores' gradient through the add unchanged (no
FLOPs). Like the softmax, it is counted over the score matrix.

The LayerNorms have a weight and no bias (``norm_type`` low_precision_layernorm with
``no_bias``); the MLP is ``dff`` wide (``expansion_ratio`` · dmodel) with exact GELU; MPT ties
its LM head to the word embedding (``--tie_embeddings true`` in the presets). Tensor
parallelism splits heads and ``dff`` as in GPT.
"""

from __future__ import annotations

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.models.gpt import GELU_FLOPS, SOFTMAX_FLOPS, causal_scale, cross_entropy, tied
from stg.models.llama import refuse_dropout

ALIBI_FLOPS = 2  # the slope times the query-key distance, then the add to the score
LAYERNORM_FLOPS = 6  # mean, variance, normalise (3), scale: stg's LayerNorm less the bias add


def layernorm(b: GraphBuilder, x: Tensor, name: str) -> Tensor:
    """LayerNorm over dmodel with a weight and no bias, tagged ``layernorm``."""
    gamma = b.weight(f"{name}.weight", "dmodel")
    with b.tag("layernorm"):
        return b.elementwise(name, x, gamma, flops=LAYERNORM_FLOPS, reduce=("dmodel",))


def embedding(b: GraphBuilder, x: None) -> Tensor:
    """The word embedding alone: ALiBi replaces position embeddings."""
    refuse_dropout(b)
    wte = b.weight("wte", "dvocal dmodel", shard={"dvocal": "tp"}, tied=tied(b, "embedding"))
    return b.residual(b.gather(wte, b.tokens(), name="token_embedding"))


def alibi(b: GraphBuilder, scores: Tensor) -> Tensor:
    """The scores plus each head's linear distance penalty (module docstring)."""
    return b.custom("alibi", [scores], list(scores.dims), flops=ALIBI_FLOPS, backward_flops=0,
                    out_sharding=scores.sharding)  # fmt: skip


def attention(b: GraphBuilder, x: Tensor) -> Tensor:
    """Multi-head attention without biases, ALiBi on the scores."""
    tp = {"head": "tp"}
    q = b.einsum("bsh,hak->bsak", x, b.weight("wq", "dmodel head dhead", shard=tp), name="q")
    k = b.einsum("bsh,hak->bsak", x, b.weight("wk", "dmodel head dhead", shard=tp), name="k")
    v = b.einsum("bsh,hak->bsak", x, b.weight("wv", "dmodel head dhead", shard=tp), name="v")
    with b.tag("core_attention"):
        scores = b.einsum("bsak,btak->bast", q, k, name="scores", scale=causal_scale(b))
        probs = b.elementwise("softmax", alibi(b, scores), flops=SOFTMAX_FLOPS, reduce=(-1,))
        ctx = b.einsum("bast,btak->bsak", probs, v, name="context", scale=causal_scale(b))
    wo = b.weight("wo", "head dhead dmodel", shard=tp)
    return b.residual(b.einsum("bsak,akh->bsh", ctx, wo, name="attn_out"))


def mlp(b: GraphBuilder, x: Tensor) -> Tensor:
    """up (dmodel -> dff), GELU, down, no biases."""
    with b.tag("mlp"):
        tp = {"dff": "tp"}
        up = b.einsum("bsh,hf->bsf", x, b.weight("w1", "dmodel dff", shard=tp), name="fc1")
        up = b.elementwise("gelu", up, flops=GELU_FLOPS)
        down = b.einsum("bsf,fh->bsh", up, b.weight("w2", "dff dmodel", shard=tp), name="fc2")
        return b.residual(down)


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, attention(b, layernorm(b, x, "norm_1")), name="residual1")
    return b.add(x, mlp(b, layernorm(b, x, "norm_2")), name="residual2")


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    """The final LayerNorm, the logits over the (tied) vocabulary-parallel weight, the loss."""
    vocab = {"dvocal": "tp"}
    copy = tied(b, "copy")
    weight = (
        b.weight("wte", "dvocal dmodel", vocab, copy)
        if copy
        else b.weight("lm_head", "dvocal dmodel", shard=vocab)
    )
    h = layernorm(b, x, "norm_f")
    return cross_entropy(b, b.einsum("bsh,vh->bsv", h, weight, name="logits"))


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "mpt",
            embedding=embedding,
            block=block,
            head=head,
            description="MPT: multi-head attention with ALiBi, GELU MLP, no biases",
        )
    )
