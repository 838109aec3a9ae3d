"""``stg search --phase prefill|decode|mixed``: the serving plans of most tokens/s under a
latency limit and memory, checked against an exhaustive search with the serving predictor,
the memory-bandwidth closed form, and the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.api import GenerateOptions, build_workload
from stg.cli import main
from stg.host.registry import load_registry
from stg.perf.system import load_system

# a 0.37 B-parameter Llama: 0.75 GB of bf16 weights, GQA (4 KV heads of 128)
LLAMA = dict(model="llama", dvocal=32000, dmodel=2048, dff=8192, head=16, kvhead=4, num_stacks=4)
DECODE = dict(LLAMA, phase="decode", context=2048)
LIMIT_S = 400e-6


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def flags(options: dict[str, object]) -> list[object]:
    return [item for k, v in options.items() for item in (f"--{k}", v)]


def test_decode_search_finds_the_exhaustive_optimum_under_a_tpot_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two GPUs, 400 µs per token. A replica of one GPU (dp 2, or pp 2 whose one token
    passes both stages) reads all 0.75 GB of weights every step: 223 µs at HBM bandwidth,
    above 400 µs once priced even at one sequence. tp 2 halves the weights per GPU; its
    most tokens/s within 400 µs, over every batch of 1 to 40, is the search's answer."""
    registry = load_registry()
    system = load_system("h100-80g")
    serving = registry.predictors.get("serving")
    kernels = list(registry.kernels)
    exhaustive = []
    for plan in (dict(tp=2), dict(dp=2), dict(pp=2)):
        for per_replica in range(1, 41):
            batch = per_replica * plan.get("dp", 1)
            options = GenerateOptions(**DECODE, **plan, batch=batch)
            report = serving.predict(build_workload(options, registry), system, kernels=kernels)
            if report["time_per_output_token_s"] <= LIMIT_S:
                exhaustive.append((report["tokens_per_s"], plan.get("tp", 1), batch))
    assert exhaustive and {tp for _, tp, _ in exhaustive} == {2}
    tokens, _, batch = max(exhaustive)

    code, out, err = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "-s", "h100-80g",
        "--max-tpot", "400us", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    best = result["best"]
    assert (best[0]["plan"]["tp"], best[0]["plan"]["batch"]) == (2, batch)
    assert best[0]["tokens_per_s"] == pytest.approx(tokens)
    assert best[0]["tokens_per_s_per_gpu"] == pytest.approx(tokens / 2)
    weights = 0.75e9  # all replicas' plans read at least half of them per GPU
    for plan in best:
        assert plan["time_per_output_token_s"] <= LIMIT_S
        assert plan["peak_memory_bytes"] <= system.hbm_capacity
        # the closed form the search prunes with is the serving predictor's bound
        options = GenerateOptions(**DECODE, **{
            k: plan["plan"][k] for k in ("dp", "tp", "pp", "ep", "batch")
        }, micro_batch=None if plan["plan"]["micro_batches"] == 1
            else plan["plan"]["batch"] // plan["plan"]["micro_batches"])  # fmt: skip
        report = serving.predict(build_workload(options, registry), system, kernels=kernels)
        assert plan["memory_bandwidth_bound_s"] == pytest.approx(
            report["memory_bandwidth_bound_s"], rel=1e-9
        )
        assert plan["memory_bandwidth_bound_s"] >= weights / 2 / system.hbm_bandwidth
    # tp 2's bound by hand: weights / 2 + the KV cache, 2·layers·kv_heads·head_dim·2 bytes
    # per token and sequence over tp 2, at the step's 2048 cached tokens plus the new one
    top = best[0]
    kv = 2 * 4 * 4 * 128 * 2 // 2 * (2048 + 1) * batch
    bytes_read = top["memory_bandwidth_bound_s"] * system.hbm_bandwidth
    assert bytes_read - kv == pytest.approx(tp2_weight_bytes(registry), rel=1e-9)


def tp2_weight_bytes(registry: object) -> int:
    workload = build_workload(GenerateOptions(**DECODE, tp=2, batch=1), registry)
    return int(workload.rank_classes[0].facts["weight_bytes"])


def test_memory_bounds_the_batch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """On a 0.5 GiB GPU the KV cache, not the latency, bounds tp 2's batch: the plan fits,
    and one sequence more per replica would not."""
    system = load_system("h100-80g").as_dict()
    system["name"] = "small-hbm"
    system["hbm_gib"] = 0.5
    path = tmp_path / "small.json"
    path.write_text(json.dumps(system))
    code, out, err = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "-s", path, "--tp", "2", "--json",
    )  # fmt: skip
    assert code == 0, err
    best = json.loads(out)["best"][0]
    assert best["peak_memory_bytes"] <= 0.5 * 2**30
    registry = load_registry()
    memory = registry.predictors.get("memory")
    more = GenerateOptions(**DECODE, tp=2, batch=best["plan"]["batch"] + 1)
    report = memory.predict(build_workload(more, registry), load_system(path))
    assert not report["fits"]


def test_prefill_ttft_kv_dtype_and_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "search", *flags(dict(LLAMA, phase="prefill", seq=512)), "--gpus", 2,
        "-s", "h100-80g", "--max-ttft", "5ms", "--tp", "2", "--replica-batch", "1,2,4,8",
        "--top", "2",
    )  # fmt: skip
    assert code == 0, err
    assert "TTFT" in out and "best plans (most tokens/s)" in out and "#1: " in out
    code, out, err = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "-s", "h100-80g", "--tp", "2",
        "--kv_dtype", "bf16,fp8", "--max-tpot", "400us", "--json",
    )  # fmt: skip
    assert code == 0, err
    best = json.loads(out)["best"]
    assert best[0]["plan"]["kv_dtype"] == "fp8"  # half the cache bytes: more sequences
    assert {b["plan"]["kv_dtype"] for b in best} == {"bf16", "fp8"}


def test_an_infeasible_limit_is_an_empty_result_with_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "-s", "h100-80g", "--max-tpot", "50us",
    )  # fmt: skip
    assert code == 1
    assert "no plan meets TPOT 50.0 µs" in out and "bounded below by" in out
    code, out, _ = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "-s", "h100-80g", "--max-tpot", "50us",
        "--json",
    )  # fmt: skip
    assert code == 1 and json.loads(out)["best"] == []  # as the text: nothing met the limit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "8", "--max-tpot", "50ms"], "--max-tpot is a serving option"),
        (["--batch", "8", "--kv_dtype", "fp8"], "--kv_dtype is a serving option"),
        (["--phase", "prefill", "--max-tpot", "50ms"], "prefill has none"),
        (["--phase", "decode", "--max-ttft", "1s"], "--max-ttft limits a prefill"),
        (["--phase", "decode", "--max-tpot", "50"], "is not a positive duration; give e.g. 50ms"),
        (["--phase", "decode", "--recompute", "full"], "--recompute is a training axis"),
        (["--phase", "decode", "--kv_dtype", "fp9"], "--kv_dtype 'fp9' is not allowed"),
        (["--phase", "decode", "--batch", "8", "--replica-batch", "4"], "not both"),
    ],
)
def test_bad_combinations_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, "search", *flags(LLAMA), "--gpus", 2, "-s", "h100-80g", *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_moe_plans_split_experts_and_dense_plans_do_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ep is an axis only where it splits weights (a MoE model); for a dense one it would be
    dp under another name."""
    from stg.explore.serving_search import uses_experts

    registry = load_registry()
    moe = dict(
        model="moe", dvocal=1024, dmodel=512, dff=2048, head=8, kvhead=8, experts=4,
        num_stacks=2, phase="decode", context=256,
    )  # fmt: skip
    assert uses_experts(GenerateOptions(**moe, batch=2), registry)
    assert not uses_experts(GenerateOptions(**DECODE, batch=2), registry)
    code, out, err = run(
        capsys, "search", *flags(moe), "--gpus", 4, "-s", "h100-80g", "--max-tpot", "1ms",
        "--tp", "1", "--pp", "1", "--top", "10", "--json",
    )  # fmt: skip
    assert code == 0, err
    plans = [b["plan"] for b in json.loads(out)["best"]]
    assert {p["ep"] for p in plans} == {1, 2, 4}
    assert all(p["dp"] * p["ep"] == 4 and p["batch"] % (p["dp"] * p["ep"]) == 0 for p in plans)


def test_a_batch_past_a_kernel_boundary_is_not_taken_for_the_best(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At 516 µs per token, tp 2's steps at 34 and 35 sequences meet the limit but cost a
    kernel tile more than at 33, which gives more tokens/s: the search prices every batch
    (the affine pricer) and finds the exhaustive optimum, not the largest batch within the
    limit, nor one on a 64-sequence tile."""
    limit = 516e-6
    registry = load_registry()
    system = load_system("h100-80g")
    serving = registry.predictors.get("serving")
    kernels = list(registry.kernels)
    exhaustive = []
    for batch in range(1, 81):
        options = GenerateOptions(**DECODE, tp=2, batch=batch)
        report = serving.predict(build_workload(options, registry), system, kernels=kernels)
        if report["time_per_output_token_s"] <= limit:
            exhaustive.append((report["tokens_per_s"], batch))
    tokens, batch = max(exhaustive)
    assert batch < max(b for _, b in exhaustive)  # the largest batch within it is not the best

    code, out, err = run(
        capsys, "search", *flags(DECODE), "--gpus", 2, "--tp", 2, "--pp", 1,
        "-s", "h100-80g", "--max-tpot", "516us", "--json",
    )  # fmt: skip
    assert code == 0, err
    top = json.loads(out)["best"][0]
    assert (top["plan"]["tp"], top["plan"]["batch"]) == (2, batch)
    assert top["tokens_per_s"] == pytest.approx(tokens, rel=1e-9)
