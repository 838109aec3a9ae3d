"""RoBERTa (Liu et al. 2019): BERT's encoder, trained without next-sentence prediction.

The architecture is BERT's (``models/bert.py``: bidirectional post-LN layers, GELU MLPs,
the masked-LM head); what differs is the embedding: no segment embedding (RoBERTa's inputs
are single segments; its released checkpoints keep a one-row token-type table, a constant
vector that this template leaves out) and a larger, byte-level BPE vocabulary (50,265).
Released checkpoints hold 514 position rows (two offset by the padding index); the template
holds ``seq`` rows, as BERT's does.
"""

from __future__ import annotations

from stg.api import GraphBuilder, Model, Tensor, hookimpl
from stg.models import bert


def embedding(b: GraphBuilder, x: None) -> Tensor:
    bert.bidirectional(b, "RoBERTa")
    return bert.embeddings(b, segments=False)


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
