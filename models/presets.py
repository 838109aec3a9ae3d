"""Named presets: published configurations of the built-in models (``--model llama3-8b``).

Each preset fills the dimensions of one model template and cites where they come from; the
parameter counts it states are the source's, and tests/test_presets.py checks the templates
against them (within 1%, total and, for mixtures of experts, per token; the three figures
further off, and why, are in docs/presets.md). ``seq`` is the
pre-training sequence length where the source states one, else the context window.
Explicit options override a preset's values (``--model llama3-8b --seq 2048``).
"""

from __future__ import annotations

from stg.api import Preset, hookimpl

NARAYANAN = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM (SC21, arXiv:2104.04473), Table 1: heads, hidden size, layers and "
    "parameters; vocabulary 51,200 and sequence 2,048 (section 5.1); FFN 4h"
)
NARAYANAN_TABLE_1 = (
    # name, published parameters, heads, hidden size, layers
    ("gpt-1.7b", 1.7e9, 24, 2304, 24),
    ("gpt-3.6b", 3.6e9, 32, 3072, 30),
    ("gpt-7.5b", 7.5e9, 32, 4096, 36),
    ("gpt-18.4b", 18.4e9, 48, 6144, 40),
    ("gpt-39.1b", 39.1e9, 64, 8192, 48),
    ("gpt-76.1b", 76.1e9, 80, 10240, 60),
    ("gpt-145.6b", 145.6e9, 96, 12288, 80),
    ("gpt-310.1b", 310.1e9, 128, 16384, 96),
    ("gpt-529.6b", 529.6e9, 128, 20480, 105),
    ("gpt-1008b", 1008.0e9, 160, 25600, 128),
)


def _gpt(hidden: int, heads: int, layers: int, vocab: int, seq: int) -> dict[str, int]:
    """GPT's dimensions: multi-head attention (kvhead = head), FFN 4h."""
    return {
        "dvocal": vocab,
        "dmodel": hidden,
        "dff": 4 * hidden,
        "head": heads,
        "kvhead": heads,
        "seq": seq,
        "num_stacks": layers,
    }


DEVLIN = (
    "Devlin et al. 2019, BERT: Pre-training of Deep Bidirectional Transformers for Language "
    "Understanding (NAACL, arXiv:1810.04805), section 3 (layers L, hidden size H, heads A, "
    "total parameters; FFN 4H) and appendix A.2 (sequences of 512 tokens); WordPiece "
    "vocabulary 30,522, 512 positions, 2 token types: google-research/bert's "
    "bert_config.json (uncased models)"
)
LIU = (
    "Liu et al. 2019, RoBERTa: A Robustly Optimized BERT Pretraining Approach "
    "(arXiv:1907.11692), sections 4.1 and 5 (BERT's architecture: base L=12 H=768 A=12, "
    "large L=24 H=1024 A=16, 355M parameters; sequences of 512 tokens) and section 4.4 "
    "(byte-level BPE, 50K units); vocabulary 50,265 and 125M / 355M parameters: "
    "facebookresearch/fairseq examples/roberta README and the released dict"
)


def _encoder(hidden: int, heads: int, layers: int, vocab: int) -> dict[str, int]:
    """BERT's dimensions: multi-head attention, FFN 4H, 512-token sequences."""
    return {
        "dvocal": vocab,
        "dmodel": hidden,
        "dff": 4 * hidden,
        "head": heads,
        "kvhead": heads,
        "seq": 512,
        "num_stacks": layers,
    }


PRESETS: tuple[Preset, ...] = (
    Preset(
        name="debug",
        model="gpt",
        dims={
            "dvocal": 1024,
            "dmodel": 256,
            "dff": 1024,
            "head": 8,
            "kvhead": 8,
            "seq": 256,
            "num_stacks": 4,
        },
        source="stg's tiny GPT for the original STG's --model_type debug (not a published model)",
        description="a tiny GPT for debugging",
    ),
    Preset(
        name="gpt3-175b",
        model="gpt",
        dims=_gpt(hidden=12288, heads=96, layers=96, vocab=50257, seq=2048),
        source=(
            "Brown et al. 2020, Language Models are Few-Shot Learners (arXiv:2005.14165), "
            "Table 2.1 (175.0B parameters, 96 layers, d_model 12288, 96 heads, d_ff = "
            "4 d_model) and section 2.1 (context 2048; GPT-2's model, whose LM head is its "
            "word embedding, and 50,257-token vocabulary)"
        ),
        description="GPT-3 175B",
        aliases=("gpt3",),
        published_parameters=175.0e9,
        tied_embeddings=True,
        vocab_divisible_by=128,  # Megatron-LM's default: 50,257 -> 50,304 (tp 1), 51,200 (tp 8)
    ),
    *(
        Preset(
            name=name,
            model="gpt",
            dims=_gpt(hidden=hidden, heads=heads, layers=layers, vocab=51200, seq=2048),
            source=NARAYANAN,
            description=f"Megatron-LM's GPT of {published / 1e9:.1f}B parameters",
            published_parameters=published,
            tied_embeddings=True,
        )
        for name, published, heads, hidden, layers in NARAYANAN_TABLE_1
    ),
    Preset(
        name="llama2-7b",
        model="llama",
        dims={
            "dvocal": 32000,
            "dmodel": 4096,
            "dff": 11008,
            "head": 32,
            "kvhead": 32,
            "seq": 4096,
            "num_stacks": 32,
        },
        source=(
            "Touvron et al. 2023, Llama 2 (arXiv:2307.09288), Table 1 (context 4k, no GQA at "
            "7B) and section 2.2 (Llama 1's architecture); dimensions and 6.7B parameters: "
            "Touvron et al. 2023, LLaMA (arXiv:2302.13971), Table 2; FFN and vocabulary: "
            "meta-llama/Llama-2-7b-hf config.json"
        ),
        description="Llama 2 7B",
        published_parameters=6.7e9,
    ),
    Preset(
        name="llama2-13b",
        model="llama",
        dims={
            "dvocal": 32000,
            "dmodel": 5120,
            "dff": 13824,
            "head": 40,
            "kvhead": 40,
            "seq": 4096,
            "num_stacks": 40,
        },
        source=(
            "Touvron et al. 2023, Llama 2 (arXiv:2307.09288), Table 1 (context 4k, no GQA at "
            "13B) and section 2.2 (Llama 1's architecture); dimensions and 13.0B parameters: "
            "Touvron et al. 2023, LLaMA (arXiv:2302.13971), Table 2; FFN and vocabulary: "
            "meta-llama/Llama-2-13b-hf config.json"
        ),
        description="Llama 2 13B",
        published_parameters=13.0e9,
    ),
    Preset(
        name="llama2-70b",
        model="llama",
        dims={
            "dvocal": 32000,
            "dmodel": 8192,
            "dff": 28672,
            "head": 64,
            "kvhead": 8,
            "seq": 4096,
            "num_stacks": 80,
        },
        source=(
            "Touvron et al. 2023, Llama 2 (arXiv:2307.09288), Table 1 (context 4k, GQA); "
            "dimensions: meta-llama/Llama-2-70b-hf config.json; parameters: its "
            "model.safetensors.index.json, total_size 137,953,316,864 bytes in fp16 = 68.98B "
            "(the paper's name, 70B, is 1.5% more)"
        ),
        description="Llama 2 70B",
        published_parameters=68.98e9,
    ),
    Preset(
        name="llama3-8b",
        model="llama",
        dims={
            "dvocal": 128256,
            "dmodel": 4096,
            "dff": 14336,
            "head": 32,
            "kvhead": 8,
            "seq": 8192,
            "num_stacks": 32,
        },
        source=(
            "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 3 "
            "(layers, model dimension, FFN dimension, heads, key/value heads) and section "
            "3.4.1 (pre-training sequence 8K); vocabulary 128,256 (128,000 + 256 special "
            "tokens): meta-llama/Meta-Llama-3-8B config.json"
        ),
        description="Llama 3 8B",
        published_parameters=8.0e9,
    ),
    Preset(
        name="llama3-70b",
        model="llama",
        dims={
            "dvocal": 128256,
            "dmodel": 8192,
            "dff": 28672,
            "head": 64,
            "kvhead": 8,
            "seq": 8192,
            "num_stacks": 80,
        },
        source=(
            "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 3 and "
            "section 3.4.1 (pre-training sequence 8K); vocabulary 128,256: "
            "meta-llama/Meta-Llama-3-70B config.json"
        ),
        description="Llama 3 70B",
        published_parameters=70.0e9,
    ),
    Preset(
        name="llama3-405b",
        model="llama",
        dims={
            "dvocal": 128256,
            "dmodel": 16384,
            "dff": 53248,
            "head": 128,
            "kvhead": 8,
            "seq": 8192,
            "num_stacks": 126,
        },
        source=(
            "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 3 and "
            "section 3.4.1 (pre-training sequence 8K); vocabulary 128,256: "
            "meta-llama/Llama-3.1-405B config.json"
        ),
        description="Llama 3.1 405B",
        aliases=("llama3.1-405b",),
        published_parameters=405.0e9,
    ),
    Preset(
        name="mixtral-8x7b",
        model="moe",
        dims={
            "dvocal": 32000,
            "dmodel": 4096,
            "dff": 14336,
            "head": 32,
            "kvhead": 8,
            "seq": 32768,
            "num_stacks": 32,
            "experts": 8,
            "kexperts": 2,
        },
        source=(
            "Jiang et al. 2024, Mixtral of Experts (arXiv:2401.04088), Table 1 and section 2 "
            "(pre-trained with a 32k context); parameters: Mistral AI, Mixtral of experts "
            "(mistral.ai/news/mixtral-of-experts, 2023): 46.7B total, 12.9B per token"
        ),
        description="Mixtral 8x7B: 8 experts, top-2",
        published_parameters=46.7e9,
        published_active_parameters=12.9e9,
    ),
    Preset(
        name="mixtral-8x22b",
        model="moe",
        dims={
            "dvocal": 32000,
            "dmodel": 6144,
            "dff": 16384,
            "head": 48,
            "kvhead": 8,
            "seq": 65536,
            "num_stacks": 56,
            "experts": 8,
            "kexperts": 2,
        },
        source=(
            "mistralai/Mixtral-8x22B-v0.1 config.json (dimensions, 8 experts, top-2, 64K "
            "context); parameters: Mistral AI, Cheaper, Better, Faster, Stronger "
            "(mistral.ai/news/mixtral-8x22b, 2024): 141B total, 39B active"
        ),
        description="Mixtral 8x22B: 8 experts, top-2",
        published_parameters=141e9,
        published_active_parameters=39e9,
    ),
    Preset(
        name="qwen3-moe-30b-a3b",
        model="moe",
        dims={
            "dvocal": 151936,
            "dmodel": 2048,
            "dff": 768,
            "head": 32,
            "kvhead": 4,
            "dhead": 128,
            "seq": 4096,
            "num_stacks": 48,
            "experts": 128,
            "kexperts": 8,
        },
        source=(
            "Yang et al. 2025, Qwen3 Technical Report (arXiv:2505.09388), Table 2 (layers, "
            "heads Q/KV, 128 experts, 8 activated) and section 3.2 (pre-training sequence "
            "4,096); Qwen/Qwen3-30B-A3B config.json (hidden 2048, head_dim 128, "
            "moe_intermediate_size 768, vocabulary 151,936, untied) and model card: 30.5B "
            "total, 3.3B activated"
        ),
        description="Qwen3-30B-A3B: 128 experts, top-8",
        aliases=("qwen3-30b-a3b",),
        published_parameters=30.5e9,
        published_active_parameters=3.3e9,
    ),
    Preset(
        name="qwen3-moe-235b-a22b",
        model="moe",
        dims={
            "dvocal": 151936,
            "dmodel": 4096,
            "dff": 1536,
            "head": 64,
            "kvhead": 4,
            "dhead": 128,
            "seq": 4096,
            "num_stacks": 94,
            "experts": 128,
            "kexperts": 8,
        },
        source=(
            "Yang et al. 2025, Qwen3 Technical Report (arXiv:2505.09388), Table 2 (layers, "
            "heads Q/KV, 128 experts, 8 activated) and section 3.2 (pre-training sequence "
            "4,096); Qwen/Qwen3-235B-A22B config.json (hidden 4096, head_dim 128, "
            "moe_intermediate_size 1536, vocabulary 151,936, untied) and model card: 235B "
            "total, 22B activated"
        ),
        description="Qwen3-235B-A22B: 128 experts, top-8",
        aliases=("qwen3-235b-a22b",),
        published_parameters=235e9,
        published_active_parameters=22e9,
    ),
    Preset(
        name="deepseek-v3",
        model="deepseek",
        dims={
            "dvocal": 129280,
            "dmodel": 7168,
            "dff": 2048,
            "head": 128,
            "kvhead": 128,
            "dhead": 128,
            "seq": 4096,
            "num_stacks": 61,
            "experts": 256,
            "kexperts": 8,
            "shared_experts": 1,
            "dense_layers": 3,
            "dense_dff": 18432,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "drope": 64,
        },
        source=(
            "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), section 4.2 "
            "(61 layers, hidden 7168, 128 heads of 128, KV compression 512, query compression "
            "1536, decoupled RoPE 64 per head; all FFNs but the first three are MoE of 1 shared "
            "and 256 routed experts of 2048, 8 activated; 671B total, 37B activated per token; "
            "pre-training sequence 4K, section 4.3) and deepseek-ai/DeepSeek-V3 config.json "
            "(intermediate_size 18432 of the dense layers, vocab_size 129280, untied LM head); "
            "the multi-token prediction module (14B) is not part of the 671B and not built"
        ),
        description="DeepSeek-V3: MLA, 1 shared + 256 routed experts (top-8), 3 dense layers",
        aliases=("deepseek-v3-671b",),
        published_parameters=671e9,
        published_active_parameters=37e9,
    ),
    Preset(
        name="bert-base",
        model="bert",
        dims=_encoder(hidden=768, heads=12, layers=12, vocab=30522),
        source=DEVLIN,
        description="BERT-base (uncased), masked-LM head",
        published_parameters=110e6,
        tied_embeddings=True,
    ),
    Preset(
        name="bert-base-squad",
        model="bert-qa",
        dims={**_encoder(hidden=768, heads=12, layers=12, vocab=30522), "seq": 384},
        source=(
            DEVLIN + "; fine-tuning on SQuAD v1.1: section 4.2 (a start and an end vector, "
            "the only new parameters) and google-research/bert's README (run_squad.py "
            "--max_seq_length=384), as QSync (Zhao et al. 2024) trains it: bytedance/QSync "
            "benchmark_transformers/benchmark_bert/profile_bert.sh"
        ),
        description="BERT-base fine-tuned on SQuAD (span head, 384 tokens)",
        published_parameters=110e6,
    ),
    Preset(
        name="bert-large",
        model="bert",
        dims=_encoder(hidden=1024, heads=16, layers=24, vocab=30522),
        source=DEVLIN,
        description="BERT-large (uncased), masked-LM head",
        published_parameters=340e6,
        tied_embeddings=True,
    ),
    Preset(
        name="roberta-base",
        model="roberta",
        dims=_encoder(hidden=768, heads=12, layers=12, vocab=50265),
        source=LIU,
        description="RoBERTa-base, masked-LM head",
        published_parameters=125e6,
        tied_embeddings=True,
        vocab_divisible_by=1,  # 50,265 rows, padded only for tp to divide them
    ),
    Preset(
        name="roberta-base-swag",
        model="roberta-mc",
        dims={**_encoder(hidden=768, heads=12, layers=12, vocab=50265), "seq": 128},
        source=(
            LIU + "; fine-tuning on SWAG (4 choices per example) as QSync (Zhao et al. 2024) "
            "trains it: bytedance/QSync benchmark_transformers/benchmark_roberta "
            "(profile_roberta.sh, acc_swag.py: Hugging Face's run_swag_no_trainer, "
            "RobertaForMultipleChoice, max_length 128, 16 examples per device)"
        ),
        description="RoBERTa-base fine-tuned on SWAG (multiple choice, up to 128 tokens)",
        published_parameters=125e6,
        vocab_divisible_by=1,  # 50,265 rows, padded only for tp to divide them
    ),
    Preset(
        name="roberta-large",
        model="roberta",
        dims=_encoder(hidden=1024, heads=16, layers=24, vocab=50265),
        source=LIU,
        description="RoBERTa-large, masked-LM head",
        published_parameters=355e6,
        tied_embeddings=True,
        vocab_divisible_by=1,  # 50,265 rows, padded only for tp to divide them
    ),
)


@hookimpl
def stg_register_presets(register):  # type: ignore[no-untyped-def]
    for preset in PRESETS:
        register(preset)
