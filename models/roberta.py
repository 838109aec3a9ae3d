"""RoBERTa (Liu et al. 2019): BERT's encoder, trained without next-sentence prediction.

The architecture is BERT's (``models/bert.py``: bidirectional post-LN layers, GELU MLPs,
the masked-LM head); what differs is the embedding: no segment embedding (RoBERTa's inputs
are single segments; its released checkpoints keep a one-row token-type table, a constant
vector that this template leaves out) and a larger, byte-level BPE vocabulary (50,265).
Released checkpoints hold 514 position rows (two offset by the padding index); the template
holds ``seq`` rows, as BERT's does.

``roberta-mc`` has the multiple-choice head that QSync (Zhao et al. 2024) fine-tunes RoBERTa
with on SWAG (Hugging Face's ``RobertaForMultipleChoice``): each example's choices are
sequences of the batch (``--batch`` counts sequences: 4 per SWAG example); the pooler (a
dense layer with tanh on the first token) and a linear layer give one score per sequence,
and the cross-entropy runs over each example's choices.
"""

from __future__ import annotations

import sympy

from stg.api import Dim, GraphBuilder, Model, Tensor, hookimpl
from stg.models import bert

TANH_FLOPS = 4  # exponentials and a division, per element
SCORE = Dim("score", sympy.Integer(1))
"""One score per (example, choice) sequence."""


def embedding(b: GraphBuilder, x: None) -> Tensor:
    bert.bidirectional(b, "RoBERTa")
    return bert.embeddings(b, segments=False)


def multiple_choice_head(b: GraphBuilder, x: Tensor) -> Tensor:
    """Pooler (dense + tanh on the first token), one score per sequence, the loss over the
    choices of each example."""
    whole = b.sharding(x.dims, {"batch": b.data_axes})  # the first token: sequence gathered
    first = b.custom(
        "first_token",
        [x],
        "batch dmodel",
        flops=0,
        backward_flops=1,
        in_shardings=[whole],
    )
    pooled = b.einsum("bh,hk->bk", first, b.weight("pooler", "dmodel dmodel"), name="pooler")
    pooled = b.elementwise("pooler_bias", pooled, b.weight("pooler.bias", "dmodel"))
    pooled = b.elementwise("pooler_tanh", pooled, flops=TANH_FLOPS)
    scores = b.einsum(
        "bh,hc->bc", pooled, b.weight("classifier", ["dmodel", SCORE]), name="classifier"
    )
    scores = b.elementwise("classifier_bias", scores, b.weight("classifier.bias", [SCORE]))
    return b.custom(
        "choice_cross_entropy",
        [scores],
        "batch",
        flops=bert.CROSS_ENTROPY_FLOPS,
        backward_flops=bert.CROSS_ENTROPY_BACKWARD_FLOPS,
        out_dtype="fp32",
    )


@hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    register(
        Model(
            "roberta",
            embedding=embedding,
            block=bert.block,
            head=bert.head,
            description="RoBERTa: BERT's encoder and masked-LM head, no segment embedding",
        )
    )
    register(
        Model(
            "roberta-mc",
            embedding=embedding,
            block=bert.block,
            head=multiple_choice_head,
            description="RoBERTa with the multiple-choice head (pooler, a score per choice)",
        )
    )
