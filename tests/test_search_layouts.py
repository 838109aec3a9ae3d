"""``stg search`` over the newer layouts: recompute of some layers (Megatron's block method),
expert parallelism folded over the dense ranks, and uneven pipeline splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.api import GenerateOptions
from stg.cli import main
from stg.core.pipeline import validate_options
from stg.explore.search import SearchSpace, plans
from stg.host.registry import load_registry
from stg.perf.system import load_system
from stg.predictors.memory import predict_analytic

LLAMA = dict(
    model="llama", dvocal=1024, dmodel=512, dff=2048, head=8, kvhead=8, seq=256, num_stacks=8,
    batch=16,
)  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_search_finds_the_partial_recompute_that_alone_fits_fastest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """One GPU, 8 Llama layers, micro-batches of 4. Recomputing the first k layers (block) of
    the 8 keeps one layer input instead of all of a layer's activations for each of the k,
    so the peak falls by the same amount per layer (the memory predictor's closed forms:
    k = 1..7 below). The GPU is given a capacity between k = 3's peak and k = 2's: no
    recompute, selective recompute (which keeps almost as much) and k <= 2 do not fit.
    Each recomputed layer adds its forward to the iteration, so among the plans that fit
    (k = 3..7 and full, k = 8) time grows with k: the optimum recomputes 3 layers, a plan
    that only the block method can spell."""
    options = dict(LLAMA, micro_batch=4)

    def peak(**plan: object) -> int:
        o = GenerateOptions(**{**options, **plan})  # type: ignore[arg-type]
        return int(predict_analytic(o, "h100-80g")["peak_bytes"])

    block = {
        k: peak(activation_recompute="full", recompute_method="block", recompute_num_layers=k)
        for k in range(1, 8)
    }
    steps = {block[k] - block[k + 1] for k in range(1, 7)}
    assert len(steps) == 1 and steps.pop() > 0  # one layer's saving per recomputed layer
    capacity = (block[2] + block[3]) / 2
    assert peak(activation_recompute="selective") > capacity and peak() > capacity
    assert peak(activation_recompute="full") < capacity
    system = load_system("h100-80g").as_dict()
    system["name"] = "small-h100"
    system["hbm_gib"] = capacity / 2**30
    path = tmp_path / "small.json"
    path.write_text(json.dumps(system))
    code, out, err = run(
        capsys, "search",
        *[item for k, v in LLAMA.items() for item in (f"--{k}", v)],
        "--gpus", 1, "-s", path, "--micro-batch", 4, "--recompute-layers", "1..7",
        "--refine", 3, "--top", 3, "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    chosen = [(b["plan"]["recompute"], b["plan"].get("recompute_num_layers"))
              for b in result["best"]]  # fmt: skip
    assert chosen == [("full", 3), ("full", 4), ("full", 5)]
    assert result["best"][0]["plan"]["recompute_method"] == "block"
    # none, selective, k = 1 and 2 pruned by memory; full and k = 6, 7 priced or bounded out
    assert result["pruned"]["memory: peak above the GPU's capacity"] == 4
    assert result["enumerated"] == 3 + 7
    times = [b["time"]["iteration_time_s"] for b in result["best"]]
    assert times == sorted(times)
    # the same search without the block counts has only full recompute left, slower
    code, out, err = run(
        capsys, "search",
        *[item for k, v in LLAMA.items() for item in (f"--{k}", v)],
        "--gpus", 1, "-s", path, "--micro-batch", 4, "--refine", 1, "--top", 1, "--json",
    )  # fmt: skip
    assert code == 0, err
    full = json.loads(out)["best"][0]
    assert full["plan"]["recompute"] == "full" and "recompute_method" not in full["plan"]
    assert full["time"]["iteration_time_s"] > times[0]


def test_folded_plans_fill_the_gpus_with_ep_across_dense_ranks() -> None:
    """With ep folded (etp 1) the world is dp·tp·cp·pp: every plan uses the 8 GPUs, ep may
    exceed dp (it spans tp too), and each passes the divisibility rules or is pruned."""
    base = GenerateOptions(
        model="moe", dvocal=1024, dmodel=256, dff=512, head=8, kvhead=8, seq=64, num_stacks=2,
        batch=16, experts=8, kexperts=2, etp=1,
    )  # fmt: skip
    space = SearchSpace(sharding=("0",), schedules=("1f1b",), recompute=("none",))
    folded = plans(base, 8, space)
    assert folded and all(o.ep_folded and o.world_size == 8 for o in folded)
    assert any(o.ep > o.dp for o in folded)
    for o in folded:
        assert (o.dp * o.tp * o.sp) % (o.ep * o.expert_tp) == 0
    registry = load_registry()
    valid = 0
    for o in folded:
        try:
            validate_options(o, registry)
            valid += 1
        except Exception as exc:  # pruned by a divisibility rule, one line
            assert "\n" not in str(exc)
    assert valid > 0
    both = plans(base, 8, SearchSpace(sharding=("0",), schedules=("1f1b",), recompute=("none",),
                                      ep_layouts=("multiply", "fold")))  # fmt: skip
    multiplied = [o for o in both if not o.ep_folded]
    assert all(o.world_size == 8 for o in both) and multiplied
    # ep 1 folded is the multiplied plan: enumerated once
    assert not any(o.ep_folded and o.ep == 1 for o in both)


def test_uneven_splits_are_enumerated_only_where_there_are_stages() -> None:
    base = GenerateOptions(**{**LLAMA, "num_stacks": 7})  # type: ignore[arg-type]
    space = SearchSpace(
        sharding=("0",), schedules=("1f1b",), recompute=("none",), micro_batch_per_replica=(1,),
        pipeline_splits=("even", "loss", "both"),
    )  # fmt: skip
    got = {
        (o.pp, o.account_for_embedding_in_pipeline_split, o.account_for_loss_in_pipeline_split)
        for o in plans(base, 2, space)
    }
    assert got == {(1, False, False), (2, False, False), (2, False, True), (2, True, True)}


def test_default_space_enumerates_the_plans_it_always_did() -> None:
    """No new axis given: the same plans, none with a new option set."""
    base = GenerateOptions(**LLAMA)  # type: ignore[arg-type]
    out = plans(base, 4, SearchSpace())
    assert out
    for o in out:
        assert o.recompute_method is None and o.recompute_num_layers is None
        assert o.ep_layout is None and not o.account_for_loss_in_pipeline_split
        assert not o.account_for_embedding_in_pipeline_split


def test_search_axes_refuse_unknown_words(capsys: pytest.CaptureFixture[str]) -> None:
    for flag, value, allowed in [
        ("--ep_layout", "folded", "allowed: multiply, fold"),
        ("--pipeline-split", "first", "allowed: even, embedding, loss, both"),
    ]:
        code, _, err = run(
            capsys, "search", "--model", "debug", "--gpus", 2, "--batch", 4, flag, value
        )
        assert code == 2 and allowed in err and err.count("\n") == 1


def test_search_finds_the_last_stage_split_that_balances_a_heavy_output_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two pipeline stages, 8 Llama layers (h 2048, F 8192) and a vocabulary of 65,536. A
    layer's GEMMs are 2·(4h² + 3hF) = 134 MFLOP per token (+6 % causal attention at s 2048),
    the output layer's 2·h·V = 268 MFLOP: the head weighs about two layers. The even split
    (4 | 4 + head) paces the pipeline at ~6 layers a micro-batch; 3 layers on the last stage
    (5 | 3 + head) at ~5; 2 (6 | 2 + head) at ~6 again. Only Megatron's
    --decoder-last-pipeline-num-layers spells the optimum, 3."""
    model = dict(model="llama", dvocal=65536, dmodel=2048, dff=8192, head=16, kvhead=16,
                 seq=2048, num_stacks=8, batch=16)  # fmt: skip
    code, out, err = run(
        capsys, "search", *[item for k, v in model.items() for item in (f"--{k}", v)],
        "--gpus", 2, "--pp", 2, "--tp", 1, "--micro-batch", 1, "--zero", 0,
        "--recompute", "none", "--schedule", "1f1b", "--last-stage-layers", "1..7",
        "--refine", 7, "--top", 7, "-s", "h100-80g", "--json",
    )  # fmt: skip
    assert code == 0, err
    best = json.loads(out)["best"]
    time = {b["plan"].get("last_stage_layers", 4): b["time"]["iteration_time_s"] for b in best}
    assert len(time) == 7  # the even split once (4 on the last stage), not twice
    assert min(time, key=time.__getitem__) == 3
    assert time[3] < 0.95 * time[4] and time[3] < 0.95 * time[2]
    assert best[0]["plan"]["last_stage_layers"] == 3
