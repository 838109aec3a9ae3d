"""Mamba-2 (SSD, chunked) and gated DeltaNet (chunkwise gated delta rule) blocks in hybrid
stacks: FLOPs, decode state and memory from the written traces against closed forms; the
traces validate, decode with mlc-chakra's reader and feed."""

from __future__ import annotations

from pathlib import Path

import pytest
from consumers import assert_ranks_decode_and_feed
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType
from stg.host.registry import load_registry
from stg.predictors.memory import predict_memory
from stg.trace.reader import read_nodes

HYBRID = dict(
    model="hybrid", dvocal=256, dmodel=64, dff=128, head=4, kvhead=2, seq=128, num_stacks=2,
    batch=2, micro_batch=2, causal=True,
)  # fmt: skip
SSM = dict(ssm_chunk=16, ssm_head_dim=8, ssm_state=4, ssm_groups=2)
LINEAR = dict(linear_key_heads=2, linear_value_heads=4, linear_head_dim=8)


def run(**kw: object) -> dict:
    """The options of a hybrid run: the sizes of the layers its pattern has, then ``kw``."""
    pattern = str(kw.get("layer_pattern", ""))
    mamba = SSM if "M" in pattern else {}
    return {**HYBRID, **mamba, **(LINEAR if "G" in pattern else {}), **kw}


b, h = 2, 64
CONV = 2 * 4 + 4  # four taps, SiLU (Mamba-2's convolution adds its bias: 1 more)


def generate(tmp_path: Path, **kw: object) -> Path:
    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out)]
    for key, value in run(**kw).items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def layer_flops(out: Path, layer: int = 0, phase: str = "fwd") -> int:
    return sum(
        n.num_ops
        for n in read_nodes(out / "workload.0.et")
        if n.type is NodeType.COMP and n.name.startswith(f"mb0/layer{layer}/{phase}/")
    )


def mamba2_flops(s: int) -> int:
    """Forward FLOPs of one Mamba-2 layer (SSD, Dao and Gu 2024, Listing 1) at tp 1."""
    p, g, n, length = 8, 2, 4, 16
    heads = 2 * h // p  # expand 2
    r, c = heads // g, s // length
    bs = b * s
    projections = 2 * bs * h * (2 * heads * p + 2 * g * n + heads)
    convolutions = (CONV + 1) * bs * (heads * p + 2 * g * n)
    gates = (4 + 2 + 1 + 2 + 1) * bs * heads  # softplus, dt·A, cumsum, two decays
    intra = 2 * b * c * length**2 * g * n + 3 * r * b * c * g * length**2
    intra += 2 * b * c * length**2 * heads * p
    states = 2 * bs * heads * p * n  # chunk states, and again their read-out
    passing = b * c * heads + 2 * c * b * c * heads + 2 * b * heads * c * c * p * n
    out = (1 + 2 + 9) * bs * heads * p + 2 * bs * heads * p * h  # sum, D, gated norm, out
    layer = projections + convolutions + gates + intra + 2 * states + passing + out
    return 4 * bs * h + layer + bs * h  # the norm, the layer, the residual add


def deltanet_flops(s: int) -> int:
    """Forward FLOPs of one gated DeltaNet mixer layer (Yang et al. 2024, chunkwise form)."""
    keys, values, d, length = 2, 4, 8, 64
    r, c, bs = values // keys, s // length, b * s
    projections = 2 * bs * h * (2 * keys * d + 2 * values * d + 2 * values)
    convolutions = CONV * bs * (2 * keys * d + values * d)
    norms = 3 * bs * 2 * keys * d
    gates = (4 + 6 + 1 + 2) * bs * values  # sigmoid, log decay, cumsum, β·Γ
    wy = 2 * b * c * length**2 * keys * d + 3 * r * b * c * keys * length**2
    wy += int(2 * length / 3 * b * c * values * length**2)  # triangular solve
    wy += 2 * 2 * b * c * length**2 * values * d  # W and U
    scan = int((2 * d + d / length) * bs * values * d)
    chunks = 2 * bs * values * d * d + bs * values * d + 2 * bs * values * d * d  # W·S, -, Q·S
    chunks += 2 * b * c * length**2 * keys * d + 3 * r * b * c * keys * length**2
    chunks += 2 * b * c * length**2 * values * d + bs * values * d  # (QKᵀ∘M)·v_new, sum
    out = 9 * bs * values * d + 2 * bs * values * d * h
    layer = projections + convolutions + norms + gates + wy + scan + chunks + out
    return 4 * bs * h + layer + bs * h  # the norm, the layer, the residual add


@pytest.mark.parametrize("seq", [64, 128])
def test_mamba2_layer_flops_match_the_ssd_closed_form(tmp_path: Path, seq: int) -> None:
    out = generate(tmp_path, layer_pattern="M", seq=seq)
    assert layer_flops(out) == mamba2_flops(seq)


@pytest.mark.parametrize("seq", [64, 128])
def test_deltanet_layer_flops_match_the_chunkwise_closed_form(tmp_path: Path, seq: int) -> None:
    out = generate(tmp_path, layer_pattern="G", seq=seq)
    assert layer_flops(out) == deltanet_flops(seq)


def test_chunked_scans_are_linear_in_the_sequence_within_a_chunk_size(tmp_path: Path) -> None:
    """Chunked, the quadratic part is per chunk: doubling the sequence doubles the work but
    for the chunk-to-chunk state passing (Mamba-2: quadratic in chunks, 2·b·H·c²·P·N)."""
    assert abs(deltanet_flops(256) - 2 * deltanet_flops(128)) <= 1  # the solve's rounding
    c1, c2 = 128 // 16, 256 // 16
    quadratic = 2 * b * 16 * 8 * 4 + 2 * b * 16  # per chunk pair: 2·b·H·P·N and its decays
    assert mamba2_flops(256) - 2 * mamba2_flops(128) == quadratic * (c2 * c2 - 2 * c1 * c1)


def test_the_backward_is_derived(tmp_path: Path) -> None:
    out = generate(tmp_path, layer_pattern="MG")
    names = {n.name for n in read_nodes(out / "workload.0.et")}
    for op in ("ssd_pass.grad_ssd_states", "state_scan.grad_wy_w", "conv_x.grad_conv_x"):
        assert any(name.endswith(op) for name in names), op
    assert layer_flops(out, 0, "bwd") > 2 * layer_flops(out, 0, "fwd")


def test_tensor_parallelism_splits_groups_and_key_heads(tmp_path: Path) -> None:
    one = generate(tmp_path / "1", layer_pattern="MG")
    two = generate(tmp_path / "2", layer_pattern="MG", tp=2)

    def gemm(out: Path, name: str) -> int:
        (node,) = [n for n in read_nodes(out / "workload.0.et") if n.name == f"mb0/{name}"]
        return node.num_ops

    for name in ("layer0/fwd/in_x", "layer0/fwd/ssd_pass", "layer1/fwd/state_scan"):
        assert gemm(two, name) * 2 == gemm(one, name)


def decode(**kw: object) -> tuple[list[int], int]:
    o = GenerateOptions(**run(**{"phase": "decode", "steps": 2, **kw}))  # type: ignore[arg-type]
    w = build_workload(o, load_registry())
    flops = sum(n.num_ops for n in w.ranks[0].nodes() if n.name.startswith("step1/mb0/layer"))
    return w.rank_classes[0].facts["kv_cache_bytes_per_step"], flops


def test_decode_state_is_constant_per_token() -> None:
    """A decode step updates a state of constant size: the same bytes held and the same
    FLOPs after 100 tokens as after 10000; attention's cache grows by a token per step."""
    p, g, n, heads = 8, 2, 4, 16
    mamba_state = heads * p * n + 3 * (heads * p + 2 * g * n)  # SSM state, convolution inputs
    keys, values, d = 2, 4, 8
    delta_state = values * d * d + 3 * (2 * keys * d + values * d)
    for pattern, per_layer in (("M", mamba_state), ("G", delta_state)):
        short, short_flops = decode(layer_pattern=pattern, context=100)
        long, long_flops = decode(layer_pattern=pattern, context=10000)
        assert short == long == [2 * b * per_layer * 2] * 2  # 2 layers, bf16
        assert short_flops == long_flops
        # a prefill leaves the same state behind, whatever the prompt's length
        for seq in (128, 256):
            o = GenerateOptions(**run(**{"layer_pattern": pattern, "phase": "prefill", "seq": seq}))  # type: ignore[arg-type]
            facts = build_workload(o, load_registry()).rank_classes[0].facts
            assert facts["kv_cache_bytes"] == 2 * b * per_layer * 2
    cache, _ = decode(layer_pattern="M*", context=100)
    kv_token = 2 * b * 2 * 16 * 2  # K and V of 2 kv heads of 16, bf16
    assert cache == [b * mamba_state * 2 + 101 * kv_token, b * mamba_state * 2 + 102 * kv_token]


def test_hybrid_stacks_split_over_pipeline_stages() -> None:
    o = GenerateOptions(**run(**{"layer_pattern": "M-M*-GE-", "num_stacks": 8, "pp": 2,  # type: ignore[arg-type]
                           "mlp_activation": "relu2", "experts": 4, "kexperts": 2}))  # fmt: skip
    w = build_workload(o, load_registry())
    kinds = [rc.facts["layer_kinds"] for rc in w.rank_classes]
    assert kinds == [{"mamba": 2, "mlp": 1, "attention": 1}, {"mlp": 2, "deltanet": 1, "moe": 1}]
    # a pattern repeats when its length divides num_stacks (Qwen3-Next's 3:1 period)
    o = GenerateOptions(**run(**{"layer_pattern": "G*", "num_stacks": 6}))  # type: ignore[arg-type]
    assert build_workload(o, load_registry()).rank_classes[0].facts["layer_kinds"] == {
        "deltanet": 3, "attention": 3
    }  # fmt: skip


def test_squared_relu_mlp_has_two_matrices() -> None:
    def params(**kw: object) -> int:
        o = GenerateOptions(**run(**{"layer_pattern": "-", **kw}))  # type: ignore[arg-type]
        return build_workload(o, load_registry()).rank_classes[0].facts["parameters"]

    assert params() - params(mlp_activation="relu2") == 2 * h * 128  # SwiGLU's third matrix


def test_memory_predictor_reads_what_the_layers_keep() -> None:
    """Saved activations of these layers come from their graphs: two layers more keep two
    layers' bytes more; fused attention keeps no score matrix (linear in the sequence)."""

    def activations(**kw: object) -> float:
        o = GenerateOptions(**run(**{"layer_pattern": "M", **kw}))  # type: ignore[arg-type]
        return predict_memory(build_workload(o, load_registry()))["classes"][0]["activations"]

    o = GenerateOptions(**run(**{"layer_pattern": "M"}))  # type: ignore[arg-type]
    per_layer = build_workload(o, load_registry()).rank_classes[0].facts["layer_activation_bytes"]
    assert activations(num_stacks=4) - activations() == pytest.approx(2 * per_layer["mamba"], abs=1)

    def attention_bytes(seq: int, attention: str) -> int:
        o = GenerateOptions(**run(**{"layer_pattern": "*", "seq": seq, "attention": attention}))  # type: ignore[arg-type]
        facts = build_workload(o, load_registry()).rank_classes[0].facts
        return facts["layer_activation_bytes"]["attention"]

    assert attention_bytes(256, "fused") == 2 * attention_bytes(128, "fused")
    assert attention_bytes(256, "unfused") > 2 * attention_bytes(128, "unfused")


@pytest.mark.parametrize(
    "kw",
    [
        dict(layer_pattern="M*G-", num_stacks=4, pp=2, tp=2),
        dict(layer_pattern="MG", dp=2, batch=4, phase="decode", context=64),
    ],
)
def test_hybrid_traces_validate_decode_and_feed(tmp_path: Path, kw: dict) -> None:
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
        (dict(layer_pattern="MX"), "unknown letter 'X'"),
        (dict(layer_pattern="MMM"), "which must divide num_stacks=2"),
        (dict(model="hybrid"), "needs --layer_pattern"),
        (dict(layer_pattern="M", tp=4, head=4, kvhead=4), "tp=4 must divide ssm_groups=2"),
        (dict(layer_pattern="M", sp=2), "without context parallelism"),
        (dict(layer_pattern="M", ssm_chunk=48), "ssm_chunk=48 must divide seq=128"),
        (dict(layer_pattern="G", seq=96), "chunk of 64 tokens must divide seq=96"),
        (
            dict(layer_pattern="M", phase="mixed", prefill_batch=1, micro_batch=-1),
            "phase=mixed is not allowed",
        ),
        (dict(layer_pattern="-", mlp_activation="gelu"), "allowed: swiglu, relu2"),
        (dict(layer_pattern="M", ssm_state=0), "ssm_state=0 must be an integer >= 1"),
        (dict(layer_pattern="M-", linear_key_heads=2), "linear_key_heads=2 does not apply"),
    ],
)
def test_bad_hybrid_options_are_one_line(tmp_path: Path, kw: dict, message: str) -> None:
    args = ["generate", "--output_dir", str(tmp_path / "out")]
    for key, value in run(**kw).items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def layer_parameters(pattern: str, **kw: object) -> int:
    """Parameters of one layer: the difference two more layers of ``pattern`` make, halved."""

    def total(layers: int) -> int:
        o = GenerateOptions(**run(**{"layer_pattern": pattern, "num_stacks": layers, **kw}))  # type: ignore[arg-type]
        return build_workload(o, load_registry()).rank_classes[0].facts["parameters"]

    return (total(4) - total(2)) // 2


def test_layer_parameters_match_the_published_modules() -> None:
    """Mamba-2 (mamba_ssm Mamba2: in_proj without bias, conv1d with bias, dt_bias, A_log, D,
    the gated RMSNorm, out_proj) and Qwen3-Next's gated DeltaNet (in_proj_qkvz, in_proj_ba,
    conv1d without bias, dt_bias, A_log, the gated RMSNorm over a head, out_proj), each with
    the layer's RMSNorm."""
    p, g, n, heads = 8, 2, 4, 16
    channels = heads * p + 2 * g * n
    mamba = h * (2 * heads * p + 2 * g * n + heads) + 4 * channels + channels + 3 * heads
    mamba += heads * p + heads * p * h + h
    assert layer_parameters("M") == mamba
    keys, values, d = 2, 4, 8
    delta = h * (2 * keys * d + 2 * values * d + 2 * values) + 4 * (2 * keys * d + values * d)
    delta += 2 * values + d + values * d * h + h
    assert layer_parameters("G") == delta
    # Qwen3-Next's gated attention: a gate projection as large as the query projection
    gate = layer_parameters("*", attention_output_gate=True) - layer_parameters("*")
    assert gate == h * HYBRID["head"] * (h // HYBRID["head"])


def test_global_attention_layers_ignore_the_chunk(tmp_path: Path) -> None:
    """Llama 4 Maverick's pattern: chunked attention with a global layer in four, dense and
    MoE feed-forward layers in turn (``*-*E*-AE``, 8 letters for its 4 layers)."""
    out = generate(
        tmp_path, layer_pattern="*-*E*-AE", num_stacks=8, attention_chunk=32, experts=4,
        kexperts=2,
    )  # fmt: skip
    attention = {
        n.name.split("/")[1]: n
        for n in read_nodes(out / "workload.0.et")
        if n.name.startswith("mb0/layer") and n.name.endswith("/fwd/core_attention")
    }
    assert sorted(attention) == ["layer0", "layer2", "layer4", "layer6"]
    assert [attention[f"layer{i}"].attrs.get("attention_chunk") for i in (0, 2, 4, 6)] == [
        32, 32, 32, None
    ]  # fmt: skip
    assert attention["layer6"].num_ops > attention["layer0"].num_ops
