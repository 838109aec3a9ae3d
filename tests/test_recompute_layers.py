"""Recompute of some layers only: Megatron-LM's ``--recompute-method uniform|block`` with
``--recompute-num-layers``. The recomputed layers and their FLOPs are read from the written
files and checked against closed forms; the memory predictor's saved bytes against the
per-layer closed forms (Korthikanti et al.); analytical, replay and memory agree."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner
from workload_checks import check_runs_to_completion

from stg.cli import app
from stg.core.fp8 import UPDATE
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.plan import make_plan, recompute_units
from stg.core.workload import Phase, Role, node_op, node_part, node_phase, node_role
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options
from stg.predictors.memory import activation_bytes_per_layer, analytic_memory, predict_memory
from stg.predictors.time import predict_time
from stg.trace.feeder import ETFeeder, replay
from stg.trace.reader import read_nodes
from stg.trace.validate import validate_trace

# GPT, unfused attention without dropout or causal mask: a layer's forward GEMMs are
# 2·b·s·(4h² + 2hF)/t and its attention einsums 4·b·s²·h/t (scores and context)
SMALL = dict(
    model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=128, batch=8,
    micro_batch=4, attention="unfused",
)  # fmt: skip
BLOCK = dict(activation_recompute="full", recompute_method="block")
UNIFORM = dict(activation_recompute="full", recompute_method="uniform")


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def layer_gemm_flops(o: GenerateOptions) -> int:
    """Forward GEMM and attention-einsum FLOPs of one layer, one micro-batch, one tp rank."""
    b, s, h, f, t = (o.micro_batch or o.batch) // o.dp, o.seq, o.dmodel, o.dff, o.tp
    return (2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h) // t


@pytest.mark.parametrize(
    ("kw", "modes", "groups"),
    [
        # block: the first N layers of every model chunk (chunk c on stage c mod pp)
        (dict(num_stacks=8, pp=2, **BLOCK, recompute_num_layers=1),
         "FNNNFNNN", [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]),
        (dict(num_stacks=8, pp=2, virtual_stages=2, pipeline_schedule="interleaved", **BLOCK,
              recompute_num_layers=1), "FNFNFNFN", None),
        (dict(num_stacks=6, pp=2, **BLOCK, recompute_num_layers=5), "FFFFFF", None),
        # uniform: groups of N layers of each chunk, the chunk's last group shorter
        (dict(num_stacks=10, pp=2, **UNIFORM, recompute_num_layers=2),
         "FFFFFFFFFF", [(0, 1), (2, 3), (4,), (5, 6), (7, 8), (9,)]),
        (dict(num_stacks=7, pp=2, **UNIFORM, recompute_num_layers=3),
         "FFFFFFF", [(0, 1, 2), (3,), (4, 5, 6)]),
        # unset: every layer its own checkpoint, as before
        (dict(num_stacks=4, activation_recompute="full"), "FFFF", [(0,), (1,), (2,), (3,)]),
        (dict(num_stacks=4, activation_recompute="selective"), "SSSS", None),
    ],
)  # fmt: skip
def test_layers_recompute_as_megatron_chooses(kw: dict, modes: str, groups: list | None) -> None:
    o = options(**kw)
    plan = make_plan(o)
    got = "".join(plan.layer_recompute(i)[0].upper() for i in range(o.num_stacks))
    assert got == modes
    if groups is not None:
        units = [tuple(layers) for _, _, layers in recompute_units(o)]
        assert units == groups
        for unit in units:
            for layer in unit:
                assert tuple(plan.recompute_group(layer)) == unit


def written(tmp_path: Path, args: list[str]) -> Path:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", *args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    return out


def cli_args(o: GenerateOptions) -> list[str]:
    args = []
    for key, value in o.recorded().items():
        if value is None or key in ("precision", "placement"):
            continue
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_stacks=8, pp=2, virtual_stages=2, pipeline_schedule="interleaved", **BLOCK,
             recompute_num_layers=1),
        dict(num_stacks=6, pp=2, tp=2, **BLOCK, recompute_num_layers=2),
        dict(num_stacks=7, pp=2, **UNIFORM, recompute_num_layers=3),
    ],
)  # fmt: skip
def test_recompute_flops_in_the_written_files(tmp_path, kw: dict) -> None:  # type: ignore[no-untyped-def]
    """Each rank file recomputes exactly its recomputed layers, each once per micro-batch,
    with the GEMM FLOPs of a layer's forward; the trace validates, decodes with mlc-chakra's
    reader and drains through the feeder."""
    o = options(**kw)
    out = written(tmp_path, cli_args(o))
    assert validate_trace(out).ok
    plan = make_plan(o)
    for rank in range(o.world_size):
        path = out / f"workload.{rank}.et"
        nodes = read_nodes(path)
        stage = rank // (o.world_size // o.pp)
        held = [
            i
            for c in range(stage, plan.chunks, o.pp)
            for i in plan.chunk_layers(c)
            if plan.layer_recompute(i) == "full"
        ]
        flops: Counter[str] = Counter()
        for n in nodes:
            if node_phase(n) is Phase.RECOMPUTE and "gemm" in (n.attrs or {}):
                flops[str(node_part(n))] += n.num_ops
        assert flops == {f"layer{i}": o.micro_batches * layer_gemm_flops(o) for i in held}
        ids = []
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            node = et_def_pb2.Node()
            while protolib.decodeMessage(f, node):
                ids.append(node.id)
                node = et_def_pb2.Node()
        issued = [nid for kind, nid in replay(ETFeeder(path)) if kind == "issue"]
        assert sorted(ids) == sorted(issued) == sorted(n.id for n in nodes)


def test_a_uniform_group_runs_again_from_its_input_before_its_last_backward() -> None:
    """Layers 0-2 form one group: the gradient into layer 2 starts the recompute of layer 0
    (from the saved input), then 1 (from 0's recomputed output), then 2; only then the
    backwards of 2, 1, 0, none of them recomputing again."""
    o = options(num_stacks=3, **UNIFORM, recompute_num_layers=3, micro_batch=8)
    nodes = build_workload(o, load_registry()).rank_classes[0].nodes
    by_id = {n.id: n for n in nodes}
    order = []
    for n in nodes:
        phase, part = node_phase(n), node_part(n)
        if phase in (Phase.RECOMPUTE, Phase.BACKWARD) and str(part).startswith("layer"):
            step = (phase.name, part)
            if not order or order[-1] != step:
                order.append(step)
    assert order == [
        ("RECOMPUTE", "layer0"), ("RECOMPUTE", "layer1"), ("RECOMPUTE", "layer2"),
        ("BACKWARD", "layer2"), ("BACKWARD", "layer1"), ("BACKWARD", "layer0"),
    ]  # fmt: skip
    for layer in (1, 2):
        first = next(
            n for n in nodes if node_phase(n) is Phase.RECOMPUTE and node_part(n) == f"layer{layer}"
        )
        inputs = {node_part(by_id[d]) for d in first.data_deps}
        phases = {node_phase(by_id[d]) for d in first.data_deps}
        assert inputs == {f"layer{layer - 1}"} and phases == {Phase.RECOMPUTE}


def test_saved_bytes_follow_the_per_layer_closed_forms() -> None:
    """Stage 0 of 2 (1F1B, m = 4: 2 micro-batches in flight) holds 4 layers. Korthikanti's
    per-layer bytes without dropout, unfused attention: s·b·h·(8 + 24/t + 2·a·s/(h·t)) kept,
    2·s·b·h with the layer recomputed; while a recompute unit runs it holds all of its
    layers' activations."""
    base = dict(num_stacks=8, pp=2, micro_batch=2)
    o = options(**base)
    b, s, h, a, t = 2, o.seq, o.dmodel, o.head, o.tp
    kept = s * b * h * (8 + 24 / t + 2 * a * s / (h * t))
    checkpoint = 2 * s * b * h
    assert activation_bytes_per_layer(o) == kept
    held = 2
    none = analytic_memory(o)[0]
    for kw, layers, buffer in [
        (dict(**BLOCK, recompute_num_layers=1), (1, 3), kept),
        (dict(**BLOCK, recompute_num_layers=3), (3, 1), kept),
        (dict(**UNIFORM, recompute_num_layers=2), (2, 0), 2 * kept),
        (dict(**UNIFORM, recompute_num_layers=3), (2, 0), 3 * kept),  # groups of 3 and 1
        (dict(**UNIFORM, recompute_num_layers=1), (4, 0), kept),
    ]:
        got = analytic_memory(options(**base, **kw))[0]
        units, plain = layers
        expected = held * (units * checkpoint + plain * kept - 4 * kept)
        assert got.activations - none.activations == pytest.approx(expected)
        assert got.buffers == pytest.approx(buffer)
    # one checkpoint per layer (uniform, 1) is what full recompute always was
    full = analytic_memory(options(**base, activation_recompute="full"))
    assert full == analytic_memory(options(**base, **UNIFORM, recompute_num_layers=1))


@pytest.mark.parametrize(
    "kw",
    [
        dict(**BLOCK, recompute_num_layers=1),
        dict(**BLOCK, recompute_num_layers=2, virtual_stages=2, pipeline_schedule="interleaved"),
        dict(**UNIFORM, recompute_num_layers=3),
    ],
)
def test_predictors_agree_on_partial_recompute(kw: dict) -> None:
    """Analytical (from options and from the workload), the replay and the memory predictor
    (from options and from the workload's facts) agree; the hardware FLOPs exceed the model
    FLOPs by the recomputed layers' forwards."""
    registry = load_registry()
    kernels = list(registry.kernels)
    o = options(num_stacks=8, pp=2, dp=2, tp=2, batch=16, **kw)
    workload = build_workload(o, registry)
    dag = predict_time(workload, "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=registry, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.03
    again = predict_options(o, "h100-80g", registry=registry, kernels=kernels, workload=workload)
    assert again["hardware_flops"] == fast["hardware_flops"]
    plan = make_plan(o)
    recomputed = sum(1 for i in range(o.num_stacks) if plan.layer_recompute(i) == "full")
    plain = predict_options(
        options(num_stacks=8, pp=2, dp=2, tp=2, batch=16, virtual_stages=o.virtual_stages,
                pipeline_schedule=o.pipeline_schedule),
        "h100-80g", registry=registry, kernels=kernels,
    )  # fmt: skip
    extra = fast["hardware_flops"] - plain["hardware_flops"]
    per_layer = o.micro_batches * o.world_size // o.pp * layer_gemm_flops(o)
    assert extra >= recomputed * per_layer  # GEMMs, plus the layers' memory-bound ops
    assert extra < recomputed * per_layer * 1.05
    assert fast["model_flops"] == plain["model_flops"]
    report = predict_memory(workload, "h100-80g")
    peaks = {c["stage"]: c["peak"] for c in report["classes"]}
    for memory in analytic_memory(o):
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recompute_method", "block", "--recompute_num_layers", "1"],
         "recompute_method=block chooses the layers of full recompute: "
         "activation_recompute=none is not allowed; allowed: activation_recompute=full"),
        (["--activation_recompute", "full", "--recompute_method", "blocks",
          "--recompute_num_layers", "1"],
         "recompute_method='blocks' must be one of uniform, block"),
        (["--activation_recompute", "full", "--recompute_method", "uniform"],
         "recompute_method=uniform needs recompute_num_layers, a positive integer"),
        (["--activation_recompute", "full", "--recompute_num_layers", "2"],
         "recompute_num_layers=2 needs recompute_method; allowed: uniform, block"),
        (["--activation_recompute", "full", "--recompute_method", "block",
          "--recompute_num_layers", "0"],
         "needs recompute_num_layers, a positive integer (given: 0)"),
    ],
)  # fmt: skip
def test_impossible_recompute_options_are_refused_with_one_line(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["generate", "--model", "debug", "--num_stacks", "4", *args, "--output_dir", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_recompute_layer_options_off_are_not_recorded() -> None:
    recorded = options(num_stacks=4, activation_recompute="full").recorded()
    assert "recompute_method" not in recorded and "recompute_num_layers" not in recorded
    on = options(num_stacks=4, **BLOCK, recompute_num_layers=1).recorded()
    assert on["recompute_method"] == "block" and on["recompute_num_layers"] == 1


def test_fp8_amax_reductions_follow_the_recomputed_layers() -> None:
    """Transformer Engine's delayed scaling under partial recompute: a recompute forward's
    autocast exits once per unit (after a uniform group's last layer, not per layer), and
    each recomputed layer's fp8 modules reduce after their backward; kept layers do not."""
    fp8 = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
    modules = 4  # Megatron's TE layer: fused QKV, projection, FC1, FC2
    for kw, recompute_reductions, backward_layers in [
        (dict(**BLOCK, recompute_num_layers=1), {0}, {0}),
        (dict(**UNIFORM, recompute_num_layers=2), {1, 3}, {0, 1, 2, 3}),
    ]:
        o = options(num_stacks=4, batch=1, micro_batch=1, precision=fp8, **kw)
        workload = build_workload(o, load_registry())
        assert check_runs_to_completion(workload) == sum(len(g) for g in workload.ranks)
        counts: Counter[tuple[str, str]] = Counter()
        for n in workload.rank_classes[0].nodes:
            if node_role(n) is Role.FP8_AMAX and node_op(n) == UPDATE:
                counts[(str(node_part(n)), node_phase(n).name)] += 1
        assert {int(p[5:]) for p, ph in counts if ph == "RECOMPUTE"} == recompute_reductions
        assert {int(p[5:]) for p, ph in counts if ph == "BACKWARD" and p.startswith("layer")} == (
            backward_layers
        )
        for layer in backward_layers:
            assert counts[(f"layer{layer}", "BACKWARD")] == modules
