"""PyTorch-native tensor parallelism (DTensor, :mod:`stg.core.dtensor`): the rearranging copies
around sequence-parallel collectives of batch-first activations when a rank holds more than
one sequence, and the tensor-parallel reduction of replicated weights' gradients before
FSDP2's reduce-scatter."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.dtensor import GATHER_COPY, SCATTER_COPY
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import Phase, node_op, node_phase
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes

SMALL = dict(
    model="llama", dvocal=1024, dmodel=256, dff=688, head=8, kvhead=4, seq=128, batch=8,
    micro_batch=8, num_stacks=2, tp=2, dp=2,
)  # fmt: skip
"""Four sequences per rank (micro-batch 8 over dp 2), sequence parallel over tp 2."""


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def nodes(o: GenerateOptions) -> list:
    return list(build_workload(o, load_registry(autoload=False)).ranks[0].nodes())


def copies(o: GenerateOptions) -> Counter[tuple[Phase, str]]:
    return Counter(
        (node_phase(n), node_op(n)) for n in nodes(o) if node_op(n) in (GATHER_COPY, SCATTER_COPY)
    )


def test_each_sequence_parallel_collective_gets_a_copy_of_its_whole_tensor() -> None:
    counted = copies(options(profile="compiled"))
    # per layer: the gathers before attention and MLP and the reduce-scatters after them,
    # backward the same in reverse; the embedding scatters (gathers its gradient), the head
    # gathers (scatters its input's gradient)
    assert counted[(Phase.FORWARD, GATHER_COPY)] == 2 * 2 + 1
    assert counted[(Phase.FORWARD, SCATTER_COPY)] == 2 * 2 + 1
    assert counted[(Phase.BACKWARD, GATHER_COPY)] == 2 * 2 + 1
    assert counted[(Phase.BACKWARD, SCATTER_COPY)] == 2 * 2 + 1
    tokens, hidden = 4 * 128, 256  # this rank's sequences, gathered
    for n in nodes(options(profile="compiled")):
        if node_op(n) in (GATHER_COPY, SCATTER_COPY):
            assert n.tensor_size == 2 * tokens * hidden * 2  # read and written, bf16


def test_the_gemm_after_a_gather_waits_for_its_copy() -> None:
    graph = nodes(options(profile="torchtitan"))
    by_id = {n.id: n for n in graph}
    q = next(n for n in graph if n.name == "mb0/layer0/fwd/q")
    assert any(node_op(by_id[d]) == GATHER_COPY for d in q.data_deps)
    scatter = next(n for n in graph if n.name == "mb0/layer0/fwd/reduce_scatter_tp:attn_out")
    assert any(node_op(by_id[d]) == SCATTER_COPY for d in scatter.data_deps)


def test_a_recomputed_gather_is_copied_again() -> None:
    counted = copies(options(profile="compiled", activation_recompute="selective_op"))
    assert counted[(Phase.RECOMPUTE, GATHER_COPY)] == 2 * 2


@pytest.mark.parametrize(
    "kw",
    [
        {"profile": "megatron"},  # sequence-first: gathers along dimension 0
        {"profile": "compiled", "dp": 8},  # one sequence per rank: a view
        {"profile": "compiled", "tpsp": False},  # all-reduces, no rearrangement
    ],
)
def test_no_copies_where_pytorch_needs_none(kw: dict[str, object]) -> None:
    assert not copies(options(**kw))


def test_a_copy_is_priced_as_a_streaming_kernel() -> None:
    system = load_system("h100-80g")
    copy = next(n for n in nodes(options(profile="compiled")) if node_op(n) == GATHER_COPY)
    seconds = compute_time(copy, system, profile="compiled")
    streamed = memory_bound_time(system.gpu, copy.tensor_size, "stream", "bf16")
    assert seconds == pytest.approx(streamed + system.kernel_overhead)


@pytest.mark.parametrize("profile", ["compiled", "megatron"])
def test_fsdp2_reduces_replicated_gradients_over_tp_before_its_reduce_scatter(
    profile: str,
) -> None:
    """The norm weights' gradients are partial over tensor parallelism: FSDP2 all-reduces them
    (DTensor redistribute) before its reduce-scatter; Megatron-LM reduces them after."""
    graph = nodes(options(profile=profile, weight_sharded=True, activation_recompute="none"))
    by_id = {n.id: n for n in graph}

    def named(part: str) -> tuple[object, object]:
        tp = next(n for n in graph if f"{part}/" in n.name and "all_reduce_tp" in n.name)
        fsdp = next(n for n in graph if f"{part}/bwd/reduce_scatter_dp" in n.name)
        return tp, fsdp

    tp, fsdp = named("layer0")
    tp_first = tp.id in fsdp.data_deps
    fsdp_first = fsdp.id in tp.data_deps
    assert (tp_first, fsdp_first) == ((True, False) if profile == "compiled" else (False, True))
    assert by_id[tp.id].comm_size > 0


def test_the_trace_with_copies_validates_and_predicts_alike(tmp_path: Path) -> None:
    """The written trace of a plan with DTensor's copies (and FSDP2's reordered reduction)
    meets ASTRA-sim's rules (``stg validate``), and predicts from the trace as from options."""
    out = tmp_path / "tp"
    flags = [f"--{k}={v}" for k, v in {**SMALL, "weight_sharded": "true"}.items()]
    args = ["generate", "--output_dir", str(out), "--profile", "torchtitan", *flags]
    assert CliRunner().invoke(app, args).exit_code == 0
    checked = CliRunner().invoke(app, ["validate", "--consumer", "astra-sim", str(out)])
    assert checked.exit_code == 0, checked.output
    written = Counter(node_op(n) for n in read_nodes(out / "workload.0.et"))
    assert written[GATHER_COPY] and written[SCATTER_COPY]
    system = load_system("h100-80g")
    o = options(profile="torchtitan", weight_sharded=True)
    from_options = predict_time(build_workload(o, load_registry(autoload=False)), system)
    from_trace = CliRunner().invoke(
        app, ["predict", str(out), "--system", "h100-80g", "--predictor", "time", "--json"]
    )
    assert from_trace.exit_code == 0, from_trace.output
    report = json.loads(from_trace.output)
    report = report.get("time", report)
    assert report["iteration_time_s"] == pytest.approx(from_options["iteration_time_s"], rel=1e-9)
