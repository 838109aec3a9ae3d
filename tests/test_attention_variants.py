"""Attention that is not full causal: sliding window, chunked local attention, local/global
stacks, attention sinks. FLOPs, bytes and KV cache from the written traces against closed
forms; the kernel model prices the visited blocks; the traces validate, decode and feed."""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy
from consumers import assert_ranks_decode_and_feed
from typer.testing import CliRunner

from stg.api import AttentionSpan
from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType, node_op
from stg.host.registry import load_registry
from stg.perf.kernel_time import attention_time, masked_kv_blocks
from stg.perf.system import load_system
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes

LLAMA = dict(
    model="llama", dvocal=256, dmodel=64, dff=128, head=4, kvhead=2, seq=64, num_stacks=2,
    batch=2, micro_batch=2, causal=True,
)  # fmt: skip
B, S, H, D = 2, 64, 4, 16
SOFTMAX = 5


def generate(tmp_path: Path, **kw: object) -> Path:
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out)]
    for key, value in {**LLAMA, **kw}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def attention_nodes(out: Path, rank: int = 0) -> dict[str, object]:
    """Layer 0 and 1's fused attention nodes of micro-batch 0, forward and backward."""
    return {
        n.name.removeprefix("mb0/"): n
        for n in read_nodes(out / f"workload.{rank}.et")
        if n.name.startswith("mb0/layer") and (node_op(n) or "").startswith("core_attention")
    }


def window_pairs(seq: int, window: int) -> int:
    """Σ over positions p of min(window, p): the (query, key) pairs of a sliding window."""
    return sum(min(window, p) for p in range(1, seq + 1))


def chunk_pairs(seq: int, chunk: int) -> int:
    """Σ over positions p of (p - 1) mod chunk + 1: the pairs of chunked local attention."""
    return sum((p - 1) % chunk + 1 for p in range(1, seq + 1))


def core_flops(pairs2: sympy.Rational) -> int:
    """Forward FLOPs of one fused attention core of b·h heads: QKᵀ and PV over ``pairs2``
    (query, key) pairs (the diagonal counted half, as causal attention's s²/2), plus the
    softmax over the whole s-by-s matrix (5 FLOPs per element, as every attention here)."""
    return int(4 * B * H * D * pairs2) + SOFTMAX * B * H * S * S


@pytest.mark.parametrize(
    ("kw", "pairs"),
    [
        (dict(attention_window=16), window_pairs(S, 16)),
        (dict(attention_window=5), window_pairs(S, 5)),
        (dict(attention_chunk=16), chunk_pairs(S, 16)),
        (dict(attention_chunk=24), chunk_pairs(S, 24)),
    ],
)
def test_span_flops_match_closed_forms(tmp_path: Path, kw: dict, pairs: int) -> None:
    out = generate(tmp_path, **kw)
    nodes = attention_nodes(out)
    forward = nodes["layer0/fwd/core_attention"]
    assert forward.num_ops == core_flops(sympy.Rational(pairs) - sympy.Rational(S, 2))
    backward = nodes["layer0/bwd/core_attention.grad"]
    # four gradient matmuls over the same pairs, the softmax backward at twice its forward
    assert backward.num_ops == 2 * (forward.num_ops - SOFTMAX * B * H * S * S) + 2 * (
        SOFTMAX * B * H * S * S
    )
    (name,) = kw
    assert forward.attrs[name] == kw[name]
    assert forward.attrs["attention"][5] == 1  # causal


def test_span_bytes_are_causal_attentions(tmp_path: Path) -> None:
    """A window or chunk changes what the kernel computes, not what it reads and writes:
    Q, K, V, the output and its log-sum-exp rows (FlashAttention's window_size)."""
    causal = attention_nodes(generate(tmp_path / "c"))
    for kw in (dict(attention_window=8), dict(attention_chunk=16)):
        spanned = attention_nodes(generate(tmp_path / next(iter(kw)), **kw))
        for name, node in causal.items():
            assert spanned[name].tensor_size == node.tensor_size


@pytest.mark.parametrize("kw", [dict(attention_window=S), dict(attention_chunk=4 * S)])
def test_a_span_as_long_as_the_sequence_computes_causal_attention(tmp_path, kw) -> None:  # type: ignore[no-untyped-def]
    causal = attention_nodes(generate(tmp_path / "c"))
    spanned = attention_nodes(generate(tmp_path / "s", **kw))
    assert {k: n.num_ops for k, n in spanned.items()} == {k: n.num_ops for k, n in causal.items()}


def test_span_fraction_closed_form() -> None:
    seq = sympy.Symbol("seq", positive=True, integer=True)
    cases = ((AttentionSpan(window=7), window_pairs), (AttentionSpan(chunk=6), chunk_pairs))
    for span, pairs in cases:
        size = span.window or span.chunk
        for s in (1, 5, 12, 40, 41):
            expected = sympy.Rational(pairs(s, size) * 2 - s, 2 * s * s)
            assert span.fraction(seq).subs(seq, s) == expected
    with pytest.raises(ValueError):
        AttentionSpan(window=4, chunk=4)


def test_local_and_global_layers_alternate(tmp_path: Path) -> None:
    """gpt-oss: layer 0 sliding, layer 1 full, ...; every k-th layer is global."""
    out = generate(tmp_path, num_stacks=4, attention_window=8, full_attention_every=2)
    nodes = attention_nodes(out)
    full = core_flops(sympy.Rational(S * S, 2))
    local = core_flops(sympy.Rational(window_pairs(S, 8)) - sympy.Rational(S, 2))
    assert [nodes[f"layer{i}/fwd/core_attention"].num_ops for i in range(4)] == [
        local, full, local, full
    ]  # fmt: skip
    assert "attention_window" not in nodes["layer1/fwd/core_attention"].attrs
    more = {"num_stacks": 4, "attention_chunk": 16, "full_attention_every": 4, "pp": 2}
    workload = build_workload(GenerateOptions(**{**LLAMA, **more}), load_registry())  # type: ignore[arg-type]
    kinds = [rc.facts["layer_kinds"] for rc in workload.rank_classes]
    assert kinds == [{"local": 2}, {"local": 1, "global": 1}]


def test_moe_layers_take_the_same_spans(tmp_path: Path) -> None:
    out = generate(
        tmp_path, model="moe", experts=4, kexperts=2, attention_window=8, full_attention_every=2,
        attention_sinks=True,
    )  # fmt: skip
    nodes = attention_nodes(out)
    assert nodes["layer0/fwd/core_attention"].attrs["attention_window"] == 8
    assert "attention_window" not in nodes["layer1/fwd/core_attention"].attrs


def test_sinks_are_one_learned_logit_per_head(tmp_path: Path) -> None:
    """gpt-oss: a sink per head joins each softmax's denominator (2 FLOPs per row: its exp
    and the add; 2 per row backward for its gradient); it is a weight with a gradient,
    data-parallel all-reduced with the others."""
    plain = generate(tmp_path / "p", dp=2, batch=4)
    sinks = generate(tmp_path / "s", dp=2, batch=4, attention_sinks=True)
    rows = 1 * H * S  # this rank's sequence (micro-batch 2 over dp 2), every head and query
    with_sinks, without = attention_nodes(sinks), attention_nodes(plain)
    assert {k: n.num_ops - without[k].num_ops for k, n in with_sinks.items()} == {
        k: 2 * rows for k in without
    }

    def gradient_bytes(out: Path) -> int:
        return sum(
            n.comm_size for n in read_nodes(out / "workload.0.et") if n.type is NodeType.COMM_COLL
            and not n.name.startswith("mb")
        )  # fmt: skip

    # one bf16 gradient per head and layer more to all-reduce over dp
    assert gradient_bytes(sinks) - gradient_bytes(plain) == 2 * H * LLAMA["num_stacks"]

    def parameters(**kw: object) -> int:
        o = GenerateOptions(**{**LLAMA, **kw})  # type: ignore[arg-type]
        return build_workload(o, load_registry()).rank_classes[0].facts["parameters"]

    assert parameters(attention_sinks=True) - parameters() == H * LLAMA["num_stacks"]


def test_decode_cache_is_bounded_by_the_window() -> None:
    """Serving: a sliding-window layer keeps and reads at most its window of keys; a chunked
    layer the keys of the current chunk; full layers the whole context."""

    def decode(**kw: object):  # type: ignore[no-untyped-def]
        o = GenerateOptions(**{**LLAMA, "num_stacks": 1, "phase": "decode", "steps": 2, **kw})  # type: ignore[arg-type]
        w = build_workload(o, load_registry())
        core = [n for n in w.ranks[0].nodes() if node_op(n) == "core_attention"]
        keys = [n.attrs["attention"][3] for n in core]
        return w.rank_classes[0].facts["kv_cache_bytes_per_step"], keys

    per_token = 2 * B * (LLAMA["kvhead"]) * D * 2  # K and V, bf16, one layer
    full, keys = decode(context=200)
    assert full == [201 * per_token, 202 * per_token] and set(keys) == {201, 202}
    window, keys = decode(context=200, attention_window=32)
    assert window == [32 * per_token, 32 * per_token] and set(keys) == {32}
    short, keys = decode(context=10, attention_window=32)
    assert short == [11 * per_token, 12 * per_token]
    chunk, keys = decode(context=200, attention_chunk=64)  # positions 201, 202: 9, 10 keys
    assert chunk == [9 * per_token, 10 * per_token] and set(keys) == {9, 10}


def test_prefill_with_a_window_computes_the_training_pairs() -> None:
    o = GenerateOptions(**{**LLAMA, "num_stacks": 1, "phase": "prefill", "attention_window": 8})  # type: ignore[arg-type]
    w = build_workload(o, load_registry())
    (core,) = [n for n in w.ranks[0].nodes() if node_op(n) == "core_attention"][:1]
    # serving counts the diagonal whole: Σ min(window, p) pairs over the prompt; the kernel
    # also appends the new keys and values to the cache (one op per element written)
    appends = 2 * B * S * LLAMA["kvhead"] * D
    expected = int(4 * B * H * D * window_pairs(S, 8)) + SOFTMAX * B * H * S * S + appends
    assert core.num_ops == expected


def test_kernel_model_visits_only_the_blocks_in_the_span() -> None:
    # 32 query blocks of 128: a window of 128 reaches one block back (block 0: itself only)
    assert masked_kv_blocks(4096, 128, 128, 0) == (1 + 2 * 31) / 32
    assert masked_kv_blocks(4096, 128, 0, 1024) == 4.5  # 8 blocks per chunk: 1..8, mean 4.5
    h100 = load_system("h100-80g").gpu
    args = (h100, "cudnn", 4, 32, 4096, 4096, 128)
    causal = attention_time(*args, causal=True)
    assert attention_time(*args, causal=True, window=4096) == causal
    assert attention_time(*args, causal=True, chunk=4096) == causal
    window = attention_time(*args, causal=True, window=128)
    chunk = attention_time(*args, causal=True, chunk=1024)
    assert window < chunk < causal
    # the time grows with the key blocks visited and nothing else; a 128-key window visits
    # (63/32) / (33/2) of causal attention's blocks (the rest: per-block overheads)
    windows = (129, 257, 385)
    times = [attention_time(*args, causal=True, window=w) for w in windows]
    blocks = [masked_kv_blocks(4096, 128, w, 0) for w in windows]
    assert (times[2] - times[1]) / (times[1] - times[0]) == pytest.approx(
        (blocks[2] - blocks[1]) / (blocks[1] - blocks[0]), rel=1e-9
    )
    assert (63 / 32) / (33 / 2) < window / causal < 0.2


def test_predicted_time_prices_the_window() -> None:
    kw = {**LLAMA, "seq": 4096, "dmodel": 2048, "dff": 4096, "head": 16, "kvhead": 4}

    def iteration(**more: object) -> float:
        o = GenerateOptions(**{**kw, **more})  # type: ignore[arg-type]
        return predict_time(build_workload(o, load_registry()), "h100-80g")["iteration_time_s"]

    assert iteration(attention_window=128) < iteration(attention_chunk=1024) < iteration()


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_window=8, full_attention_every=2, attention_sinks=True, pp=2, tp=2),
        dict(attention_chunk=16, sp=2, dp=2, batch=4),
    ],
)
def test_span_traces_validate_decode_and_feed(tmp_path: Path, kw: dict) -> None:
    out = generate(tmp_path, **kw)
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    assert_ranks_decode_and_feed(out)
    result = runner.invoke(app, ["feed", str(out), "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(causal=False, attention_window=8), "attention_window masks causal attention"),
        (dict(attention_window=8, attention_chunk=8), "give one of them"),
        (dict(full_attention_every=2), "needs --attention_window or --attention_chunk"),
        (dict(attention_window=0), "attention_window=0 must be an integer >= 1"),
        (dict(model="gpt", attention_window=8), "attention_window=8 does not apply to model"),
        (dict(model="deepseek", attention_sinks=True), "attention_sinks=true does not apply"),
    ],
)
def test_bad_spans_are_one_line(tmp_path: Path, kw: dict, message: str) -> None:
    args = ["generate", "--output_dir", str(tmp_path / "out")]
    for key, value in {**LLAMA, **kw}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_output_gate_is_a_projection_and_a_sigmoid_product(tmp_path: Path) -> None:
    """Qwen3-Next's gated attention: each head's output times the sigmoid of another
    projection of the layer input (5 FLOPs per element: the sigmoid and the product)."""

    def layer(out: Path) -> int:
        return sum(
            n.num_ops
            for n in read_nodes(out / "workload.0.et")
            if n.type is NodeType.COMP and n.name.startswith("mb0/layer0/fwd/")
        )

    plain = layer(generate(tmp_path / "p"))
    gated = layer(generate(tmp_path / "g", attention_output_gate=True))
    assert gated - plain == 2 * B * S * LLAMA["dmodel"] * H * D + 5 * B * S * H * D


def test_a_context_parallel_share_prices_its_window() -> None:
    """Under context parallelism (a load-balanced share of s/cp queries against s keys) a
    window is priced by the blocks it visits, as without the split."""
    h100 = load_system("h100-80g").gpu
    share = (h100, "cudnn", 4, 32, 2048, 4096, 128)
    causal = attention_time(*share, causal=True, causal_split=2)
    window = attention_time(*share, causal=True, causal_split=2, window=128)
    whole = attention_time(h100, "cudnn", 4, 32, 4096, 4096, 128, causal=True, window=128)
    assert window < causal / 4
    assert window == pytest.approx(whole / 2, rel=0.1)  # half the query blocks


# -- DeepSeek sparse attention (DSA): a lightning indexer picks index_topk keys per query ----

DSA = dict(
    model="deepseek", dvocal=256, dmodel=64, dff=64, head=4, kvhead=4, dhead=8, seq=64,
    num_stacks=2, experts=4, kexperts=2, dense_layers=1, dense_dff=128, q_lora_rank=16,
    kv_lora_rank=16, drope=4, batch=2, micro_batch=2, causal=True, index_topk=8,
    index_heads=4, index_head_dim=8,
)  # fmt: skip


def dsa_nodes(**kw: object) -> dict[str, object]:
    o = GenerateOptions(**{**DSA, **kw})  # type: ignore[arg-type]
    return {
        n.name.split("/", 1)[1]: n
        for n in build_workload(o, load_registry()).ranks[0].nodes()
        if n.name.startswith("mb0/layer0/")
    }


def test_sparse_attention_and_its_indexer_match_closed_forms() -> None:
    """Training: each query attends to min(topk, position) keys (the diagonal counted half,
    as causal attention); the indexer scores every earlier key with its heads (fp8), picks
    the top k, and learns from the KL divergence to the attention over its picks."""
    nodes = dsa_nodes()
    b, s, a, k, j, d = 2, 64, 4, 8, 4, 8
    dhead, drope, qlora, dmodel = 8, 4, 16, 64
    pairs2 = window_pairs(s, k) - s // 2  # Σ min(k, p) - s/2
    core = 2 * b * a * pairs2 * (dhead + drope) + 2 * b * a * pairs2 * dhead  # QKᵀ, PV
    core += b * a * s * k + SOFTMAX * b * a * s * k  # score parts added, softmax: picks only
    assert nodes["layer0/fwd/core_attention"].num_ops == core
    assert nodes["layer0/fwd/core_attention"].attrs["attention_topk"] == k
    assert nodes["layer0/fwd/index_scores"].num_ops == 2 * b * s * s * j * d // 2
    assert nodes["layer0/fwd/index_q"].num_ops == 2 * b * s * qlora * j * d
    assert nodes["layer0/fwd/index_k"].num_ops == 2 * b * s * dmodel * d
    assert nodes["layer0/fwd/index_topk"].num_ops == b * s * s
    assert nodes["layer0/fwd/indexer_kl"].num_ops == 8 * b * s * k
    # the indexer learns from its own loss only: its input is detached from the model
    assert "layer0/bwd/indexer_kl.grad_index_scores" in nodes
    assert "layer0/bwd/index_wq" not in nodes and not any(
        name.startswith("layer0/bwd/index_q.grad_q_norm") for name in nodes
    )
    assert "layer0/bwd/index_q.grad_index_wq" in nodes


def test_sparse_decode_reads_its_picks_not_the_context() -> None:
    """A decode step attends to topk cached latents whatever the context (the indexer still
    scores them all, in fp8)."""

    def step(context: int, **kw: object) -> tuple[int, int, int]:
        nodes = dsa_nodes(phase="decode", steps=1, context=context, **kw)
        core = nodes["layer0/fwd/core_attention"]
        return core.num_ops, core.tensor_size, nodes["layer0/fwd/index_scores"].num_ops

    short, long = step(64), step(1024)
    assert short[:2] == long[:2]
    assert long[2] == 2 * 2 * 4 * 8 * 1025  # b · j · d · keys, twice
    unset = dict(index_topk=None, index_heads=None, index_head_dim=None)
    dense = dsa_nodes(phase="decode", steps=1, context=1024, **unset)
    assert dense["layer0/fwd/core_attention"].tensor_size > 10 * long[1]


def test_sparse_attention_traces_validate_decode_and_feed(tmp_path: Path) -> None:
    args = ["generate", "--output_dir", str(tmp_path / "out")]
    for key, value in {**DSA, "tp": 2, "dp": 2, "batch": 4}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["validate", str(tmp_path / "out")]).exit_code == 0
    assert_ranks_decode_and_feed(tmp_path / "out")
    assert runner.invoke(app, ["feed", str(tmp_path / "out")]).exit_code == 0


def test_sparse_kernel_visits_its_picks() -> None:
    assert masked_kv_blocks(4096, 128, 0, 0, 2048) == sum(min(16, i + 1) for i in range(32)) / 32
    h100 = load_system("h100-80g").gpu
    args = (h100, "cudnn", 4, 32, 4096, 4096, 128)
    assert attention_time(*args, causal=True, topk=4096) == attention_time(*args, causal=True)
    assert attention_time(*args, causal=True, topk=512) < attention_time(*args, causal=True) / 3
    decode = (h100, "cudnn", 4, 128, 1, 65536, 576)
    assert attention_time(*decode, causal=False, topk=2048) < attention_time(*decode) / 8


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(causal=False), "index_topk picks among earlier keys: it needs --causal true"),
        (dict(index_topk=None), "index_heads=4 does not apply to model 'deepseek'"),
    ],
)
def test_bad_sparse_options_are_one_line(tmp_path: Path, kw: dict, message: str) -> None:
    args = ["generate", "--output_dir", str(tmp_path / "out")]
    for key, value in {**DSA, **kw}.items():
        if value is not None:
            args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()
