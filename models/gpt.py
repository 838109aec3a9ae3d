"""GPT (Megatron-LM): multi-head attention, GELU MLP, LayerNorm, learned position embeddings.

Tensor parallelism follows Megatron: Q/K/V and the first MLP matmul are split by output
(heads, dff), the attention output and the second MLP matmul by input, the vocabulary of the
embedding and LM head by rows. Every collective follows from these splits.

With ``--dropout P`` (P > 0) the layers have GPT's dropout, as Megatron-LM places it: on the
embedding (after the split for sequence parallelism), on the attention probabilities, and
after the attention projection and the second MLP matmul, between their bias and the residual
add (``*_bias_dropout``: Megatron's fused bias-dropout-add). Each writes a 1-byte mask that
its backward reads (:meth:`~stg.api.GraphBuilder.dropout`). Serving phases run without it.
"""

from __future__ import annotations

import sympy

from stg.api import GraphBuilder, Model, Tensor, hookimpl

GELU_FLOPS = 8  # tanh approximation, per element
SOFTMAX_FLOPS = 5  # scale, max, subtract+exp, sum, divide
CROSS_ENTROPY_FLOPS = 5
CROSS_ENTROPY_BACKWARD_FLOPS = 3


def dropout(b: GraphBuilder, x: Tensor, name: str) -> Tensor:
    """``x`` through dropout when training with ``--dropout`` > 0, else ``x`` unchanged."""
    if b.options.get("dropout") and b.options.get("phase", "training") == "training":
        return b.dropout(x, name)
    return x


def causal_scale(b: GraphBuilder, causal: bool | None = None) -> sympy.Expr:
    """Half of the s-by-s score matrix is computed under causal masking: ``causal``, or
    ``--causal true`` where the model leaves it to the option (``None``)."""
    if causal is None:
        causal = bool(b.options.get("causal"))
    return sympy.Rational(1, 2) if causal else sympy.Integer(1)


def tied(b: GraphBuilder, role: str) -> str | None:
    """``role`` (``"embedding"`` or ``"copy"``: :meth:`~stg.api.GraphBuilder.weight`'s
    ``tied``) where ``--tie_embeddings true`` shares the word embedding with the LM head."""
    return role if b.options.get("tie_embeddings") else None


def embedding(b: GraphBuilder, x: None) -> Tensor:
    # As in Megatron: with learned positions the word embedding is all-reduced, positions are
    # added on the whole sequence, and the sum is then split for sequence parallelism.
    wte = b.weight("wte", "dvocal dmodel", shard={"dvocal": "tp"}, tied=tied(b, "embedding"))
    h = b.unpartial(b.gather(wte, b.tokens(), name="token_embedding"))
    h = b.elementwise("position_embedding", h, b.weight("wpe", "seq dmodel"), flops=1)
    if b.options.get("dropout") and b.options.get("phase", "training") == "training":
        h = dropout(b, b.residual(h), "embedding_dropout")  # on this rank's part of the sequence
    return h


def head_bias(b: GraphBuilder, name: str) -> Tensor:
    """A bias of the per-head Q, K or V projection (split over tp with the heads)."""
    return b.weight(name, "head dhead", shard={"head": "tp"})


def attention(b: GraphBuilder, x: Tensor, causal: bool | None = None) -> Tensor:
    """Multi-head attention with biases; ``causal``: masked (None: as ``--causal`` says)."""
    q = b.einsum(
        "bsh,hak->bsak", x, b.weight("wq", "dmodel head dhead", shard={"head": "tp"}), name="q"
    )
    k = b.einsum(
        "bsh,hak->bsak", x, b.weight("wk", "dmodel head dhead", shard={"head": "tp"}), name="k"
    )
    v = b.einsum(
        "bsh,hak->bsak", x, b.weight("wv", "dmodel head dhead", shard={"head": "tp"}), name="v"
    )
    # a bias add's backward needs only the incoming gradient: nothing is saved for it
    # (Transformer Engine v2.10's Linear adds the bias in its GEMM and saves only its input)
    q = b.elementwise("q_bias", q, head_bias(b, "bq"), backward_reads="nothing")
    k = b.elementwise("k_bias", k, head_bias(b, "bk"), backward_reads="nothing")
    v = b.elementwise("v_bias", v, head_bias(b, "bv"), backward_reads="nothing")
    with b.tag("core_attention"):
        scores = b.einsum("bsak,btak->bast", q, k, name="scores", scale=causal_scale(b, causal))
        probs = b.elementwise(
            "softmax", scores, flops=SOFTMAX_FLOPS, reduce=(-1,), backward_reads="output"
        )
        probs = dropout(b, probs, "attn_dropout")
        ctx = b.einsum("bast,btak->bsak", probs, v, name="context", scale=causal_scale(b, causal))
    o = b.einsum(
        "bsak,akh->bsh",
        ctx,
        b.weight("wo", "head dhead dmodel", shard={"head": "tp"}),
        name="attn_out",
    )
    o = b.elementwise(
        "attn_out_bias", b.residual(o), b.weight("bo", "dmodel"), backward_reads="nothing"
    )
    return dropout(b, o, "attn_out_bias_dropout")


def mlp(b: GraphBuilder, x: Tensor) -> Tensor:
    with b.tag("mlp"):  # re-run under --recompute_modules mlp
        u = b.einsum(
            "bsh,hf->bsf", x, b.weight("w1", "dmodel dff", shard={"dff": "tp"}), name="fc1"
        )
        u = b.elementwise(
            "fc1_bias", u, b.weight("b1", "dff", shard={"dff": "tp"}), backward_reads="nothing"
        )
        u = b.elementwise("gelu", u, flops=GELU_FLOPS)
        d = b.einsum(
            "bsf,fh->bsh", u, b.weight("w2", "dff dmodel", shard={"dff": "tp"}), name="fc2"
        )
        d = b.elementwise(
            "fc2_bias", b.residual(d), b.weight("b2", "dmodel"), backward_reads="nothing"
        )
        return dropout(b, d, "fc2_bias_dropout")


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    x = b.add(x, attention(b, b.layernorm(x, "ln1")), name="residual1")
    return b.add(x, mlp(b, b.layernorm(x, "ln2")), name="residual2")


def lm_head(b: GraphBuilder, x: Tensor, norm: str = "layernorm") -> Tensor:
    """Final norm, LM head over the vocabulary-parallel weight (the word embedding's under
    ``--tie_embeddings true``), and cross-entropy loss."""
    h = getattr(b, norm)(x, "ln_f")
    vocab = {"dvocal": "tp"}
    copy = tied(b, "copy")
    weight = (
        b.weight("wte", "dvocal dmodel", vocab, copy)
        if copy
        else b.weight("lm_head", "dvocal dmodel", shard=vocab)
    )
    logits = b.einsum("bsh,vh->bsv", h, weight, name="logits")
    return cross_entropy(b, logits)


def cross_entropy(b: GraphBuilder, logits: Tensor) -> Tensor:
    """Softmax cross-entropy over the vocabulary, per token, in fp32."""
    return b.custom(
        "cross_entropy",
        [logits],
        "batch seq",
        flops=CROSS_ENTROPY_FLOPS,
        backward_flops=CROSS_ENTROPY_BACKWARD_FLOPS,
        out_dtype="fp32",
    )


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    return lm_head(b, x, "layernorm")


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "gpt",
            embedding=embedding,
            block=block,
            head=head,
            description="GPT: multi-head attention, GELU MLP, LayerNorm, learned positions",
        )
    )
