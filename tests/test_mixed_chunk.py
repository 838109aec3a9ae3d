"""A mixed serving iteration whose prefill chunk is shorter than ``--seq`` (found by a fuzz of
valid plans: GPT's position embedding node had a negative ``tensor_size``), and ``stg
validate``'s ``negative-size`` check, which refuses any node with a negative count."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.inference import position_rows, step_groups
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, Node, NodeType
from stg.host.registry import load_registry
from stg.trace import chakra_v004, decode
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import format_comm_groups

GPT = dict(model="gpt", dmodel=256, dff=1024, head=8, kvhead=8, seq=128, dvocal=1024)
GPT_ARGS = [a for k, v in GPT.items() for a in (f"--{k}", str(v))]
BYTES = 2  # bf16
SIZES = ("num_ops", "tensor_size", "comm_size")


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def mixed(**kw: object) -> GenerateOptions:
    base = dict(GPT, num_stacks=2, phase="mixed", batch=4, prefill_batch=2, chunk=64)
    return GenerateOptions(**{**base, **kw})


def position_node(workload) -> object:
    return next(n for n in workload.rank_classes[0].nodes if n.name.endswith("position_embedding"))


@pytest.mark.parametrize(
    ("kw", "rows"),
    [
        (dict(), 64 + 1),  # chunk at 0..63, decoding tokens at 128 (context = seq)
        (dict(context=4096), 64 + 1),  # the fuzz's plan: once -2 MB
        (dict(batch=64, prefill_batch=1, context=1000), 64 + 1),
        (dict(context=30), 64),  # the decoding tokens' position lies inside the chunk
        (dict(chunk=32, prefill_context=64, context=70), 32),
        (dict(chunk=32, prefill_context=64, context=200, tp=2), 32 + 1),
    ],
    ids=str,
)
def test_position_embedding_reads_the_rows_of_the_positions_processed(registry, kw, rows):
    """One node adds the position rows to the tokens of both groups: it reads the tokens'
    activations and the table's rows at the distinct positions of the iteration's new tokens
    (a chunk's, the decoding tokens'), and writes the sum."""
    options = mixed(**kw)
    (groups,) = step_groups(options)  # the chunks and the decoding tokens
    assert position_rows(groups) == rows
    w = build_workload(options, registry)
    for rank_class in w.rank_classes:
        for n in rank_class.nodes:
            assert all(getattr(n, f) >= 0 for f in SIZES), n
    node = position_node(w)
    tokens = options.prefill_batch * options.chunk + options.batch
    activations = 2 * tokens * GPT["dmodel"] * BYTES  # the tokens' sums read and written
    assert node.tensor_size - activations == rows * GPT["dmodel"] * BYTES
    assert node.num_ops == tokens * GPT["dmodel"]
    assert validate_workload(w).ok


def test_one_group_reads_its_own_rows(registry):
    """Prefill reads its prompt's rows, a decode step one row (the merge is not involved)."""
    for options, rows, tokens in (
        (replace(mixed(), phase="prefill", prefill_batch=0, chunk=None, batch=2), 128, 2 * 128),
        (replace(mixed(), phase="decode", prefill_batch=0, chunk=None, context=500), 1, 4),
    ):
        node = position_node(build_workload(options, registry))
        activations = 2 * tokens * GPT["dmodel"] * BYTES
        assert node.tensor_size - activations == rows * GPT["dmodel"] * BYTES


def test_mixed_gpt_is_the_priced_iteration(registry):
    """The iteration pricer of ``stg serve`` counts the distinct positions an iteration reads;
    the mixed workload's replay is its price of the same batch."""
    from stg.explore.serve_cost import Batch, replica_pricer
    from stg.perf.system import load_system

    system = load_system("h100-80g")
    base = replace(mixed(causal=True), phase="decode", batch=1, prefill_batch=0, chunk=None)
    pricer = replica_pricer(base, system, registry)
    options = replace(base, phase="mixed", batch=6, context=300, prefill_batch=2, chunk=64)
    serving = registry.predictors.get("serving")
    want = serving.predict(
        build_workload(options, registry), system, kernels=list(registry.kernels)
    )["time_s"]
    assert pricer.price(Batch(((64, 64),) * 2, (301,) * 6)) == pytest.approx(want, rel=1e-9)


def test_cli_mixed_chunk_below_seq_writes_no_negative_size(tmp_path: Path):
    out = tmp_path / "mixed"
    args = [*GPT_ARGS, "--num_stacks", "2", "--phase", "mixed", "--chunk", "64"]
    args += ["--batch", "4", "--prefill_batch", "2", "--context", "4096"]
    made = CliRunner().invoke(
        app, ["generate", *args, "--output_dir", str(out), "--format", "json"]
    )
    assert made.exit_code == 0, made.output
    nodes = json.loads((out / "workload.0.json").read_text())["workload_graph"]
    assert nodes and all(n.get(f, 0) >= 0 for n in nodes for f in SIZES)
    position = next(n for n in nodes if n["Name"].endswith("position_embedding"))
    tokens = 2 * 64 + 4
    assert position["tensor_size"] == (2 * tokens + 65) * GPT["dmodel"] * BYTES
    checked = CliRunner().invoke(app, ["validate", str(out)])
    assert checked.exit_code == 0, checked.output


# -- stg validate: negative-size ----------------------------------------------------------------


@pytest.fixture(params=["fast", "reference"])
def decoder(request, monkeypatch):
    """Both decoders: a rank file the compiled summary accepts is not read node by node, so
    the summary must hand a negative count to the reference."""
    if request.param == "reference":
        monkeypatch.setattr(decode, "enabled", lambda: False)
    elif not decode.enabled():
        pytest.skip(f"fast decoder: {decode.status()}")
    return request.param


def test_validate_refuses_a_negative_tensor_size_in_a_json_trace(tmp_path: Path, decoder):
    out = tmp_path / "t"
    made = CliRunner().invoke(
        app,
        ["generate", *GPT_ARGS, "--num_stacks", "1", "--phase", "decode", "--batch", "2",
         "--output_dir", str(out), "--format", "json"],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert validate_trace(out).ok
    rank_file = out / "workload.0.json"
    document = json.loads(rank_file.read_text())
    node = next(n for n in document["workload_graph"] if n["Name"].endswith("position_embedding"))
    node["tensor_size"] = -1997824
    rank_file.write_text(json.dumps(document))
    report = validate_trace(out)
    assert [(v.check, v.node) for v in report.errors] == [("negative-size", node["Id"])]
    assert "tensor_size is -1997824" in report.errors[0].message
    assert "position_embedding" in report.errors[0].message
    result = CliRunner().invoke(app, ["validate", str(out)])
    assert result.exit_code == 1, result.output
    assert "negative-size" in result.output
    # a consumer that is not ASTRA-sim takes no negative count either
    assert not validate_trace(out, consumer="chakra").ok


@pytest.mark.parametrize("field", ["num_ops", "comm_size"])
def test_validate_refuses_a_negative_count_in_a_v004_trace(tmp_path: Path, decoder, field):
    """``num_ops`` and ``comm_size`` are int64 in v0.0.4 (``tensor_size`` is unsigned)."""
    comp = Node(id=0, name="c0", type=NodeType.COMP, num_ops=10, tensor_size=4)
    coll = Node(
        id=1,
        name="ar1",
        type=NodeType.COMM_COLL,
        data_deps=(0,),
        comm_type=CollectiveType.ALL_REDUCE,
        comm_size=64,
        comm_group=1,
    )
    bad = {0: comp, 1: coll}
    target = 0 if field == "num_ops" else 1
    bad[target] = replace(bad[target], **{field: -8})
    out = tmp_path / "t"
    out.mkdir()
    for rank in range(2):
        (out / f"w.{rank}.et").write_bytes(chakra_v004.encode_nodes([bad[0], bad[1]]))
    (out / "w.json").write_text(format_comm_groups({1: (0, 1)}))
    report = validate_trace(out)
    negative = [v for v in report.errors if v.check == "negative-size"]
    assert [(v.rank, v.node) for v in negative] == [(0, target), (1, target)]
    assert f"{field} is -8" in negative[0].message
    # a negative num_ops beside bytes also breaks the roofline rule; nothing else is wrong
    assert {v.check for v in report.errors} <= {"negative-size", "roofline"}


def test_validate_workload_refuses_a_negative_size(registry):
    w = build_workload(mixed(), registry)
    assert validate_workload(w).ok
    node = position_node(w)
    node.tensor_size = -5  # a template: not frozen
    report = validate_workload(w)
    assert {v.check for v in report.errors} == {"negative-size"}
    assert "tensor_size is -5" in report.errors[0].message
