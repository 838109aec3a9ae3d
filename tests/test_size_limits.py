"""Workload sizes with an upper check: the estimate before building, ``--max-nodes``, the
memory left, and a MemoryError as one line."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.sizes import (
    WorkloadSize,
    WorkloadTooLarge,
    available_memory,
    check_size,
    estimate_size,
)
from stg.host.registry import load_registry

TINY = [
    "--dvocal", "128", "--dmodel", "64", "--dff", "128", "--head", "4", "--kvhead", "2",
    "--seq", "32", "--batch", "8", "--micro_batch", "4", "--num_stacks", "2",
]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_a_huge_stack_is_refused_at_once_without_building(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "generate", "--num_stacks", 10**9, "--output_dir", out_dir)
    assert code == 2
    assert err.startswith("error: this workload needs about ") and err.count("\n") == 1
    assert "available" in err and "--max-nodes" in err and "--num_stacks" in err
    assert "Traceback" not in err and out == ""
    assert not out_dir.exists()


def test_predict_refuses_a_huge_stack_too(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "predict", "--num_stacks", 10**9)
    assert code == 2
    assert err.startswith("error: this workload needs about ") and out == ""


def test_max_nodes_refuses_a_small_run_and_admits_it_when_raised(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "generate", *TINY, "--max-nodes", 10, "--output_dir", out_dir)
    assert code == 2, err
    assert "allowed: at most --max-nodes 10 nodes" in err and err.count("\n") == 1
    assert not out_dir.exists()
    code, out, err = run(
        capsys, "generate", *TINY, "--max-nodes", 10**6, "--output_dir", out_dir, "--json"
    )
    assert code == 0, err
    assert sum(json.loads(out)["nodes"].values()) > 10  # what --max-nodes 10 refused
    assert any(out_dir.iterdir())
    code, _, err = run(capsys, "generate", *TINY, "--max-nodes", 0, "--output_dir", out_dir)
    assert code == 2 and "--max-nodes" in err


def test_max_nodes_does_not_apply_to_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "predict", "somewhere", "--max-nodes", 5)
    assert code == 2 and "--max-nodes limits a generated workload" in err


SMALL = {"dvocal": 256, "dmodel": 64, "dff": 128, "head": 4, "kvhead": 4, "seq": 32}

PLANS = [
    {"model": "gpt", "num_stacks": 8, "batch": 16, "micro_batch": 2},
    {"model": "gpt", "num_stacks": 8, "dp": 2, "tp": 2, "pp": 2, "batch": 16, "micro_batch": 2},
    {"model": "llama", "num_stacks": 16, "tp": 4, "pp": 4, "batch": 32, "micro_batch": 1},
    {"model": "moe", "num_stacks": 4, "dp": 2, "ep": 2, "pp": 2, "batch": 16, "micro_batch": 4},
    {"model": "llama", "num_stacks": 8, "pp": 2, "virtual_stages": 2,
     "pipeline_schedule": "interleaved", "batch": 16, "micro_batch": 4,
     "activation_recompute": "full"},
    {"model": "gpt", "num_stacks": 4, "dp": 4, "zero": 3, "batch": 16, "micro_batch": 4,
     "activation_recompute": "selective"},
    {"model": "llama", "num_stacks": 4, "pp": 2, "dtype": "fp8", "batch": 8, "micro_batch": 2,
     "activation_recompute": "full"},
    {"model": "llama", "num_stacks": 4, "pp": 2, "phase": "decode", "steps": 8, "batch": 4},
    {"model": "gpt", "num_stacks": 4, "phase": "prefill", "batch": 4, "tp": 2},
]  # fmt: skip


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_the_estimate_bounds_the_nodes_built(plan: dict[str, object]) -> None:
    registry = load_registry()
    options = GenerateOptions(**{**SMALL, **plan})
    size = estimate_size(options, registry)
    workload = build_workload(options, registry)
    nodes = sum(len(graph) for graph in workload.ranks)
    templates = sum(len(c.nodes) for c in workload.rank_classes)
    assert nodes <= size.nodes <= 2 * nodes
    assert templates <= size.templates <= 2 * templates
    assert size.ranks == workload.world_size
    assert size.memory_bytes > size.templates * 100 and size.disk_bytes > size.nodes * 10


def test_a_stack_of_a_billion_layers_is_estimated_in_little_memory() -> None:
    registry = load_registry()
    options = GenerateOptions(model="llama", num_stacks=10**9, pp=4, batch=8, micro_batch=1)
    tracemalloc.start()
    size = estimate_size(options, registry)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 20  # runs of layer kinds, not a tuple of 10^9 names (8 GB)
    one_layer = estimate_size(GenerateOptions(model="llama", num_stacks=4, pp=4, batch=8,
                                              micro_batch=1), registry)  # fmt: skip
    assert size.nodes > 10**8 * one_layer.nodes


def test_memory_and_node_limits() -> None:
    size = WorkloadSize(nodes=4_100, templates=1_000, ranks=8, memory_bytes=3 << 30,
                        disk_bytes=1 << 20)  # fmt: skip
    check_size(size, available=4 << 30)
    check_size(size, max_nodes=4_100, available=4 << 30)
    with pytest.raises(WorkloadTooLarge, match=r"3\.0 GiB in memory.* has 2\.0 GiB available"):
        check_size(size, available=2 << 30)
    with pytest.raises(WorkloadTooLarge, match=r"about 4,100 nodes.*at most --max-nodes 4,000"):
        check_size(size, max_nodes=4_000, available=4 << 30)
    with pytest.raises(WorkloadTooLarge, match="allowed: what fits in memory"):
        check_size(size, available=1 << 30, option=None)
    assert available_memory() > 0


def test_a_memory_error_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stg.core.pipeline

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(stg.core.pipeline, "build_workload", exhausted)
    code, out, err = run(capsys, "generate", *TINY, "--output_dir", tmp_path / "out")
    assert code == 2
    assert err.startswith("error: out of memory") and err.count("\n") == 1
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "out").exists()


def test_searches_and_sweeps_skip_workloads_beyond_the_memory_left(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stg.core.sizes

    monkeypatch.setattr(stg.core.sizes, "available_memory", lambda: 1024)
    code, out, err = run(
        capsys, "search", "--model", "debug", "--batch", "16", "--gpus", "2", "--refine", "2",
        "-j", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["refined"] == 0  # the DAG predictor's workloads would not fit
    assert result["best"] and all("analytical" in b and "time" not in b for b in result["best"])
    code, out, err = run(
        capsys, "sweep", "--model", "debug", "--batch", "16", "--predictor", "time", "-o",
        tmp_path / "sweep", "-j", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    rows = (tmp_path / "sweep" / "results.csv").read_text()
    assert "this workload needs about" in rows and "allowed: what fits in memory" in rows


def test_a_model_without_a_layer_stack_has_no_runs() -> None:
    """ResNet-50 and the other stackless models (the vision plugin) have no layer kinds."""
    from stg.core.lowering import LayerKinds

    assert LayerKinds([]).runs() == ()
    assert LayerKinds([("a", 2), ("b", 0), ("c", 1)]).runs() == (("a", 2), ("c", 1))
