"""Uneven pipeline stages: Megatron-LM's first/last-stage layer counts, the embedding and loss
counted as layers, and an explicit per-chunk list; every split generates, validates and
predicts (time, memory, analytical) with the same layers per stage."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.plan import chunk_layer_counts
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options
from stg.predictors.memory import analytic_memory, count_parameters, predict_memory
from stg.predictors.time import predict_time
from stg.trace.validate import validate_trace, validate_workload

SMALL = dict(
    model="gpt", dvocal=1024, dmodel=512, dff=2048, head=8, kvhead=8, seq=256, batch=16,
    micro_batch=4, dp=2,
)  # fmt: skip


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "chunks"),
    [
        # 61 layers over 8 stages, Megatron's DeepSeek-V3 split: 8 on the first and 5 on the last
        (dict(num_stacks=61, pp=8, decoder_first_pipeline_num_layers=8,
              decoder_last_pipeline_num_layers=5), (8, 8, 8, 8, 8, 8, 8, 5)),
        (dict(num_stacks=94, pp=4, decoder_first_pipeline_num_layers=22), (22, 24, 24, 24)),
        (dict(num_stacks=94, pp=4, decoder_last_pipeline_num_layers=22), (24, 24, 24, 22)),
        # interleaved: each stage's layers split over its chunks, chunk c on stage c mod pp
        (dict(num_stacks=10, pp=2, virtual_stages=2, pipeline_schedule="interleaved",
              decoder_first_pipeline_num_layers=2), (1, 4, 1, 4)),
        (dict(num_stacks=6, pp=4, account_for_embedding_in_pipeline_split=True,
              account_for_loss_in_pipeline_split=True), (1, 2, 2, 1)),
        (dict(num_stacks=7, pp=4, account_for_embedding_in_pipeline_split=True), (1, 2, 2, 2)),
        (dict(num_stacks=3, pp=4, account_for_embedding_in_pipeline_split=True), (0, 1, 1, 1)),
        (dict(num_stacks=6, pp=4, pipeline_layers=(0, 2, 2, 2)), (0, 2, 2, 2)),
        (dict(num_stacks=61, pp=4), (16, 15, 15, 15)),  # unchanged default: first chunks longer
    ],
)  # fmt: skip
def test_layers_per_chunk_follow_megatron(kw: dict, chunks: tuple[int, ...]) -> None:
    assert chunk_layer_counts(options(**kw)) == chunks


SPLITS = [
    dict(num_stacks=7, pp=2),
    dict(num_stacks=5, pp=2, pipeline_layers=(4, 1)),  # the first stage paces the pipeline
    dict(num_stacks=6, pp=4, pipeline_layers=(0, 2, 2, 2)),
    dict(num_stacks=6, pp=4, pipeline_layers=(2, 2, 2, 0)),
    dict(num_stacks=7, pp=3, decoder_first_pipeline_num_layers=1),
    dict(num_stacks=6, pp=4, account_for_embedding_in_pipeline_split=True,
         account_for_loss_in_pipeline_split=True),
    dict(num_stacks=10, pp=2, virtual_stages=2, pipeline_schedule="interleaved",
         decoder_first_pipeline_num_layers=2),
]  # fmt: skip


@pytest.mark.parametrize("kw", SPLITS)
def test_every_split_generates_validates_and_predicts_alike(kw: dict) -> None:
    registry = load_registry()
    kernels = list(registry.kernels)
    o = options(**kw)
    chunks = chunk_layer_counts(o)
    stage_layers = [sum(chunks[c] for c in range(s, len(chunks), o.pp)) for s in range(o.pp)]
    workload = build_workload(o, registry)
    assert workload.metadata["layers_per_chunk"] == list(chunks)
    assert validate_workload(workload).ok
    # the layers each stage's ranks run, from the nodes' typed part attributes
    from stg.core.workload import node_part

    for cls in workload.rank_classes:
        held = {node_part(n) for n in cls.nodes} - {None, "embedding", "head"}
        assert len([p for p in held if str(p).startswith("layer")]) == stage_layers[cls.stage]
        assert cls.facts["layers"] == stage_layers[cls.stage]
    # memory: the options' closed form and the workload's facts give the same stages
    counted = count_parameters(o)
    assert [p.layers for p in counted] == stage_layers
    by_stage = {c.stage: c for c in workload.rank_classes}
    assert [int(by_stage[s].facts["parameters"]) for s in range(o.pp)] == [p.total for p in counted]
    report = predict_memory(workload, "h100-80g")
    from_options = analytic_memory(o)
    peaks = {c["stage"]: c["peak"] for c in report["classes"]}
    for memory in from_options:
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-6)
    # time: the analytical closed form's stages hold those layers, and it agrees with the
    # replay of the whole workload (1F1B's closed form: paced by the slowest stage, whichever)
    dag = predict_time(workload, "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=registry, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.03
    stage_times = [t["forward"] for t in fast["stage_times_s"]]
    middle = range(1, o.pp - 1)  # neither embedding nor head: a middle stage is its layers
    per_layer = {round(stage_times[s] / stage_layers[s], 12) for s in middle}
    assert len(per_layer) <= 1
    if stage_layers[0] == 0:  # the embedding alone: less than a stage of layers
        assert stage_times[0] < min(stage_times[s] for s in middle)


def test_an_embedding_stage_of_its_own_writes_a_valid_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["generate", "--model", "debug", "--num_stacks", "4", "--pp", "3", "--batch", "4",
         "--micro_batch", "2", "--pipeline_layers", "0,2,2", "--output_dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert validate_trace(out).ok


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "4", "--pipeline_layers", "0,5,5"],
         "pipeline_layers=0,5,5 lists 3 chunks; allowed: one layer count per model chunk"),
        (["--pp", "4", "--pipeline_layers", "2,0,6,6"],
         "leaves a middle chunk without a layer; allowed: 0 only for the first chunk"),
        (["--pp", "4", "--pipeline_layers", "2,2,2,2"],
         "holds 8 layers; allowed: counts that sum to num_stacks=14"),
        (["--pp", "4", "--pipeline_layers", "2,x"],
         "give the layers of every model chunk, comma-separated integers >= 0"),
        (["--pp", "4", "--decoder_first_pipeline_num_layers", "3"],
         "leave 11 of num_stacks=14 layers for 3 other stage(s); allowed: a remainder"),
        (["--pp", "1", "--decoder_last_pipeline_num_layers", "3"],
         "pp=1 is not allowed; allowed: pp > 1"),
        (["--pp", "4", "--decoder_first_pipeline_num_layers", "0"],
         "decoder_first_pipeline_num_layers=0 must be a positive integer"),
        (["--pp", "4", "--account_for_loss_in_pipeline_split", "true"],
         "num_stacks=14 plus the loss counted as layers (15) must be divisible by "
         "pp·virtual_stages=4; allowed: num_stacks + 1 a multiple of 4 (e.g. 11 or 15)"),
        (["--pp", "2", "--pipeline_layers", "7,7", "--account_for_loss_in_pipeline_split", "t"],
         "cannot be combined; allowed: one way to split the layers"),
    ],
)  # fmt: skip
def test_impossible_splits_are_refused_with_one_line(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["generate", "--model", "debug", "--num_stacks", "14", "--batch", "4", *args,
         "--output_dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not out.exists()


def test_split_options_off_are_not_recorded() -> None:
    recorded = options(num_stacks=4).recorded()
    for name in (
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "pipeline_layers",
    ):
        assert name not in recorded
    split = options(num_stacks=4, pp=2, pipeline_layers=[1, 3])  # a trace's metadata: a list
    assert split.pipeline_layers == (1, 3) and split.recorded()["pipeline_layers"] == (1, 3)
    with pytest.raises(OptionError):
        chunk_layer_counts(options(num_stacks=4, pp=2, pipeline_layers=(1, 2)))


def test_a_sweep_spells_splits_with_plus(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stg.errors import UserError
    from stg.explore.space import values_of

    assert values_of("pipeline_layers", "0+2+2,2+2+0") == [(0, 2, 2), (2, 2, 0)]
    assert values_of("pipeline_layers", [0, 2, 2]) == [(0, 2, 2)]  # one split as a TOML list
    assert values_of("pipeline_layers", [[0, 2, 2], "1+2+1"]) == [(0, 2, 2), (1, 2, 1)]
    with pytest.raises(UserError, match="joined by '\\+'"):
        values_of("pipeline_layers", "0+x")
    spec = tmp_path / "spec.toml"
    spec.write_text(
        'model = "gpt"\nnum_stacks = 4\npp = 2\nbatch = 16\nmicro_batch = 4\n'
        'pipeline_layers = "1+3,3+1"\n'
    )
    result = CliRunner().invoke(app, ["sweep", str(spec), "-o", str(tmp_path / "s"), "--json"])
    assert result.exit_code == 0, result.output
    table = (tmp_path / "s" / "results.csv").read_text().splitlines()
    assert len(table) == 3  # a header and one row per split
