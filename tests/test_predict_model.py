"""The time predictor's physical model: kernel shapes, execution profiles, streams, explain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.kernel_time import attention_time, gemm_time
from stg.perf.system import load_system
from stg.predictors.time import EAGER_OP_HOST_S, compute_time, predict_time

LLAMA = GenerateOptions(
    model="llama", dmodel=2048, dff=8192, head=16, kvhead=8, seq=4096, dvocal=32000,
    num_stacks=2, batch=2, micro_batch=2, causal=True,
)


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def _nodes(workload, suffix):
    return [n for n in workload.ranks[0].nodes() if n.name.endswith(suffix)]


def test_matmuls_are_priced_by_the_gemm_model(registry):
    h100 = load_system("h100-80g")
    node = _nodes(build_workload(LLAMA, registry), "layer0/fwd/gate")[0]
    batch, m, n, k = node.attrs["gemm"]
    assert (batch, m, n, k) == (1, 2 * 4096, 8192, 2048)
    expected = gemm_time(h100.gpu, m, n, k, "bf16", batch) + h100.kernel_overhead
    assert compute_time(node, h100) == pytest.approx(expected)


def test_fused_attention_is_priced_by_the_attention_model(registry):
    h100, a100 = load_system("h100-80g"), load_system("a100-80g")
    workload = build_workload(LLAMA, registry)
    forward = _nodes(workload, "layer0/fwd/core_attention")[0]
    backward = _nodes(workload, "layer0/bwd/core_attention.grad")[0]
    batch, heads, s_q, s_kv, d, causal, _ = forward.attrs["attention"]
    assert causal == 1
    # Megatron (Transformer Engine) runs cuDNN's kernel on Hopper, FlashAttention-2 on Ampere
    cudnn = attention_time(h100.gpu, "cudnn", batch, heads, s_q, s_kv, d, causal=True)
    assert compute_time(forward, h100) == pytest.approx(cudnn + h100.kernel_overhead)
    flash = attention_time(a100.gpu, "flash2", batch, heads, s_q, s_kv, d, causal=True)
    assert compute_time(forward, a100) == pytest.approx(flash + a100.kernel_overhead)
    assert compute_time(backward, h100) > 2 * compute_time(forward, h100)
    # eager PyTorch 2.11's SDPA runs cuDNN's on Hopper too; torchtitan's of 2024 ran flash
    assert compute_time(forward, h100, profile="eager") == pytest.approx(
        cudnn + h100.kernel_overhead
    )
    eager = attention_time(h100.gpu, "flash2", batch, heads, s_q, s_kv, d, causal=True)
    assert compute_time(forward, h100, profile="torchtitan") == pytest.approx(
        eager + h100.kernel_overhead
    )


def test_fused_attention_is_faster_than_unfused_at_long_sequences(registry):
    fused = predict_time(build_workload(LLAMA, registry), "h100-80g")["iteration_time_s"]
    unfused = build_workload(replace(LLAMA, attention="unfused"), registry)
    assert predict_time(unfused, "h100-80g")["iteration_time_s"] > 1.1 * fused


def test_eager_profile_pays_the_host_per_op(registry):
    tiny = replace(LLAMA, dmodel=256, dff=512, head=4, kvhead=4, seq=128, dvocal=1000)
    workload = build_workload(tiny, registry)
    megatron = predict_time(workload, "h100-80g")["iteration_time_s"]
    eager = predict_time(build_workload(replace(tiny, profile="eager"), registry), "h100-80g")
    compute_nodes = sum(1 for n in workload.ranks[0].nodes() if n.type.name == "COMP")
    assert eager["iteration_time_s"] >= compute_nodes * EAGER_OP_HOST_S * (1 - 1e-9)
    assert eager["iteration_time_s"] > 3 * megatron


def test_explain_adds_up_to_the_iteration_time(registry):
    o = replace(LLAMA, seq=1024, num_stacks=4, dp=2, tp=2, pp=2, batch=8, micro_batch=4)
    report = predict_time(build_workload(o, registry), "a100-80g", explain=True)
    parts = report["explain"]["breakdown_s"]
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=1e-9)
    assert any(k.startswith("compute: gemm") for k in parts)
    assert any(k.startswith("communication: ") for k in parts)


def test_gradient_reductions_do_not_block_tensor_parallel_collectives(registry):
    # dp and tp collectives run on their own communicators' streams: the last micro-batch's
    # tensor-parallel collectives of a stage do not wait for the gradient reductions that
    # the stage started for its later layers, so pipeline stages do not serialise on them
    o = replace(
        LLAMA, dmodel=4096, dff=16384, head=32, kvhead=32, seq=2048, num_stacks=8,
        tp=2, pp=4, dp=2, batch=16, micro_batch=2, rank_order="tp,sp,ep,pp,dp",
    )  # data parallelism across nodes (InfiniBand), the slowest reductions
    report = predict_time(build_workload(o, registry), "a100-80g", explain=True)
    parts = report["explain"]["breakdown_s"]
    reductions = sum(v for k, v in parts.items() if "(2 ranks)" in k and "all_reduce" in k)
    assert reductions < 0.2 * report["iteration_time_s"]


def test_cli_explain_for_options_and_for_a_trace(tmp_path, capsys):
    import json

    from stg.cli import main

    def run(*args):
        with pytest.raises(SystemExit) as info:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert info.value.code == 0, err
        return out

    small = ["--num_stacks", 2, "--dmodel", 256, "--dff", 1024, "--head", 4, "--kvhead", 4,
             "--seq", 128, "--dvocal", 1000, "--tp", 2, "--batch", 4]
    report = json.loads(run("predict", *small, "--explain", "--json"))["time"]
    parts = report["explain"]["breakdown_s"]
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=1e-9)
    run("generate", *small, "--output_dir", tmp_path / "trace")
    from_trace = json.loads(run("predict", tmp_path / "trace", "--explain", "--json"))["time"]
    assert from_trace["explain"]["breakdown_s"].keys() == parts.keys()
    text = run("predict", *small, "--explain")
    assert "where the iteration time goes" in text and "compute: gemm" in text
