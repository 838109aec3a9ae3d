"""Llama: grouped-query attention (--kvhead), SwiGLU MLP, RMSNorm, rotary positions.

Query heads are laid out as (kvhead, qgroup): each of the ``kvhead`` key/value heads serves a
group of ``head / kvhead`` query heads, and tensor parallelism splits the kvhead dimension.
"""

from __future__ import annotations

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models.gpt import SOFTMAX_FLOPS, causal_scale, lm_head

ROPE_FLOPS = 3  # two multiplies and an add per element
SWIGLU_FLOPS = 5  # silu (4) and the gate product (1)


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
    wte = b.weight("wte", "dvocal dmodel", shard={"dvocal": "tp"})
    return b.residual(b.gather(wte, b.tokens(), name="token_embedding"))


def attention(b: GraphBuilder, x: Tensor) -> Tensor:
    tp = {"kvhead": "tp"}
    q = b.einsum(
        "bsh,hgrk->bsgrk", x, b.weight("wq", "dmodel kvhead qgroup dhead", shard=tp), name="q"
    )
    k = b.einsum("bsh,hgk->bsgk", x, b.weight("wk", "dmodel kvhead dhead", shard=tp), name="k")
    v = b.einsum("bsh,hgk->bsgk", x, b.weight("wv", "dmodel kvhead dhead", shard=tp), name="v")
    q = b.elementwise("rope_q", q, flops=ROPE_FLOPS)
    k = b.elementwise("rope_k", k, flops=ROPE_FLOPS)
    with b.tag("core_attention"):
        scores = b.einsum("bsgrk,btgk->bgrst", q, k, name="scores", scale=causal_scale(b))
        probs = b.elementwise("softmax", scores, flops=SOFTMAX_FLOPS, reduce=(-1,))
        ctx = b.einsum("bgrst,btgk->bsgrk", probs, v, name="context", scale=causal_scale(b))
    wo = b.weight("wo", "kvhead qgroup dhead dmodel", shard=tp)
    return b.residual(b.einsum("bsgrk,grkh->bsh", ctx, wo, name="attn_out"))


def mlp(b: GraphBuilder, x: Tensor) -> Tensor:
    with b.tag("mlp"):  # re-run under --recompute_modules mlp
        w1 = b.weight("w1", "dmodel dff", shard={"dff": "tp"})
        gate = b.einsum("bsh,hf->bsf", x, w1, name="gate")
        w3 = b.weight("w3", "dmodel dff", shard={"dff": "tp"})
        up = b.einsum("bsh,hf->bsf", x, w3, name="up")
        act = b.elementwise("swiglu", gate, up, flops=SWIGLU_FLOPS)
        w2 = b.weight("w2", "dff dmodel", shard={"dff": "tp"})
        down = b.einsum("bsf,fh->bsh", act, w2, name="down")
        return b.residual(down)


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
    return b.add(x, mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")


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
            description="Llama: grouped-query attention, SwiGLU, RMSNorm, rotary positions",
        )
    )
