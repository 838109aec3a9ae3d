"""BERT (Devlin et al. 2019): a bidirectional Transformer encoder with a masked-LM head.

The encoder attends in both directions: every query sees every key, so the attention core
costs the whole s-by-s score matrix (``causal`` is 0 in its kernel shape, whatever
``--causal`` says; ``--causal true`` is refused). Its layers are post-LayerNorm (the norm
after each residual add), with GELU MLPs and biases everywhere. The embedding adds word,
learned position and segment (token type) embeddings and normalises them.

The head is BERT's masked-LM head: a dense layer with GELU and LayerNorm, then the decoder
over the vocabulary (with its bias) and the cross-entropy loss, over every position, as
Hugging Face's ``BertForMaskedLM`` computes it (the loss ignores unmasked positions; the
matmul runs over all of them). BERT's pre-training also has next-sentence prediction
(RoBERTa dropped it: ``roberta``); the ``bert-qa`` template has the SQuAD span head instead,
the fine-tuning task QSync (Zhao et al. 2024) trained BERT on. The decoder has its own weight
here (the published model ties it to the word embedding; presets say so, and their counts
leave it out). Tensor parallelism splits as in GPT (``models/gpt.py``).
"""

from __future__ import annotations

import sympy

from stg.api import Dim, GraphBuilder, Model, Tensor, hookimpl
from stg.errors import UserError
from stg.models.gpt import (
    CROSS_ENTROPY_BACKWARD_FLOPS,
    CROSS_ENTROPY_FLOPS,
    GELU_FLOPS,
    cross_entropy,
    dropout,
    mlp,
)
from stg.models.gpt import attention as gpt_attention

TOKEN_TYPES = Dim("token_types", sympy.Integer(2))
"""Segments A and B (BERT's type_vocab_size)."""
SPAN_ENDS = Dim("span_ends", sympy.Integer(2))
"""The start and end logits of a SQuAD answer span."""


def bidirectional(b: GraphBuilder, model: str) -> None:
    """Refuse ``--causal true`` (an encoder's attention is not masked) and the serving
    phases (an encoder does not generate token by token from a KV cache)."""
    if b.options.get("causal"):
        raise UserError(
            f"{model} is a bidirectional encoder: causal=true is not allowed; allowed: causal=false"
        )
    phase = b.options.get("phase", "training")
    if phase != "training":
        raise UserError(
            f"{model} is a bidirectional encoder, not served token by token: phase={phase} "
            "is not allowed; allowed: phase=training"
        )


def embeddings(b: GraphBuilder, segments: bool) -> Tensor:
    """Word + learned position (+ segment) embeddings, then LayerNorm."""
    wte = b.weight("wte", "dvocal dmodel", shard={"dvocal": "tp"})
    h = b.unpartial(b.gather(wte, b.tokens(), name="token_embedding"))
    h = b.elementwise("position_embedding", h, b.weight("wpe", "seq dmodel"), flops=1)
    if segments:
        table = b.weight("token_type_embedding", [TOKEN_TYPES, "dmodel"])
        types = b.tokens("token_type_ids")
        h = b.add(h, b.gather(table, types, name="segment_embedding"), name="segment_add")
    return dropout(b, b.layernorm(h, "ln_embedding"), "embedding_dropout")


def embedding(b: GraphBuilder, x: None) -> Tensor:
    bidirectional(b, "BERT")
    return embeddings(b, segments=True)


def block(b: GraphBuilder, x: Tensor) -> Tensor:
    """Post-LN encoder layer: x = LN(x + attention(x)); x = LN(x + MLP(x))."""
    x = b.layernorm(b.add(x, gpt_attention(b, x, causal=False), name="residual1"), "ln1")
    return b.layernorm(b.add(x, mlp(b, x), name="residual2"), "ln2")


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    """Masked-LM head: dense + GELU + LayerNorm, decoder over the vocabulary, loss."""
    h = b.einsum("bsh,hk->bsk", x, b.weight("mlm_dense", "dmodel dmodel"), name="mlm_dense")
    h = b.elementwise("mlm_dense_bias", h, b.weight("mlm_dense.bias", "dmodel"))
    h = b.layernorm(b.elementwise("mlm_gelu", h, flops=GELU_FLOPS), "mlm_layernorm")
    decoder = b.weight("mlm_decoder", "dvocal dmodel", shard={"dvocal": "tp"})
    logits = b.einsum("bsh,vh->bsv", h, decoder, name="logits")
    bias = b.weight("mlm_decoder.bias", "dvocal", shard={"dvocal": "tp"})
    return cross_entropy(b, b.elementwise("logits_bias", logits, bias))


def qa_head(b: GraphBuilder, x: Tensor) -> Tensor:
    """SQuAD span head (``BertForQuestionAnswering``): start and end logits per token, and
    the cross-entropy of each over the sequence."""
    qa = b.weight("qa_outputs", ["dmodel", SPAN_ENDS])
    logits = b.einsum("bsh,hc->bsc", x, qa, name="qa_outputs")
    logits = b.elementwise("qa_outputs_bias", logits, b.weight("qa_outputs.bias", [SPAN_ENDS]))
    return b.custom(
        "span_cross_entropy",
        [logits],
        "batch",
        flops=CROSS_ENTROPY_FLOPS,
        backward_flops=CROSS_ENTROPY_BACKWARD_FLOPS,
        in_shardings=[b.sharding([*logits.dims], {"batch": b.data_axes})],
        out_dtype="fp32",
    )


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "bert",
            embedding=embedding,
            block=block,
            head=head,
            description="BERT: bidirectional post-LN encoder, segment embeddings, masked-LM head",
        )
    )
    register(
        Model(
            "bert-qa",
            embedding=embedding,
            block=block,
            head=qa_head,
            description="BERT with the SQuAD span head (start and end logits): fine-tuning",
        )
    )
