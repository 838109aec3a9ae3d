"""``stg generate``: option spellings and values, the run, and errors without partial output."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from stg.cli import app
from stg.cli._shared import options_from_cli
from stg.cli.generate import app as generate_app
from stg.cli.generate import workload_summary
from stg.core.options import GenerateOptions
from stg.errors import UserError

runner = CliRunner()

TINY = [
    "--dvocal", "128", "--dmodel", "64", "--dff", "128", "--head", "4", "--kvhead", "2",
    "--seq", "32", "--batch", "8", "--micro_batch", "4", "--num_stacks", "2",
]  # fmt: skip


def _parse(*args: str) -> GenerateOptions:
    command = typer.main.get_command(generate_app)
    ctx = command.make_context("generate", list(args))
    return options_from_cli(ctx.params)


def _option_names() -> set[str]:
    command = typer.main.get_command(generate_app)
    return {name for param in command.params for name in param.opts}


def test_every_option_field_has_underscore_and_dash_spellings() -> None:
    names = _option_names()
    for f in fields(GenerateOptions):
        if f.metadata.get("internal"):  # preset_fills: what a preset filled, not an option
            assert f"--{f.name}" not in names
            continue
        assert f"--{f.name}" in names
        assert f"--{f.name.replace('_', '-')}" in names
    for alias in ("--model_type", "--model-type", "--cp", "--chakra_schema_version",
                  "--chakra-schema-version"):
        assert alias in names
    # generate's own options (not GenerateOptions fields): predictions after writing
    assert {"--predict", "--print_gpu_vram", "--print-gpu-vram", "--system"} <= names
    assert {"--precision_plan", "--precision-plan"} <= names


def test_defaults_are_the_options_defaults() -> None:
    assert _parse() == GenerateOptions()


def test_spellings_map_to_fields() -> None:
    options = _parse(
        "--micro-batch", "8", "--micro_batch", "16", "--model_type", "llama", "--cp", "2",
        "--num-stacks", "3", "--weight-sharded", "1", "--rank_order", "tp,dp,sp,ep,pp",
    )
    assert options.micro_batch == 16  # the last spelling given wins, as with any option
    assert options.model == "llama"
    assert options.sp == 2
    assert options.num_stacks == 3
    assert options.weight_sharded is True
    assert options.rank_order == "tp,dp,sp,ep,pp"
    assert _parse("--model-type", "moe").model == "moe"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("True", True), ("1", True), ("yes", True),
     ("false", False), ("FALSE", False), ("0", False), ("no", False)],
)  # fmt: skip
def test_booleans_take_values(value: str, expected: bool) -> None:
    for option in ("--tpsp", "--weight_sharded", "--mixed_precision", "--causal"):
        options = _parse(option, value)
        assert getattr(options, option[2:]) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("none", "none"), ("selective", "selective"), ("full", "full"), ("FULL", "full"),
     ("true", "full"), ("false", "none"), ("1", "full"), ("0", "none")],
)  # fmt: skip
def test_activation_recompute_values(value: str, expected: str) -> None:
    assert _parse("--activation_recompute", value).activation_recompute == expected
    assert _parse("--activation-recompute", value).activation_recompute == expected


def test_chakra_schema_version_maps_to_format() -> None:
    assert _parse("--chakra_schema_version", "v0.0.4").format == "chakra-v0.0.4"
    assert _parse("--chakra-schema-version", "v0.0.1").format == "chakra-v0.0.1"
    assert _parse("--chakra_schema_version", "json").format == "json"
    assert _parse("--format", "json", "--chakra_schema_version", "json").format == "json"
    with pytest.raises(UserError, match="chakra_schema_version='v9'"):
        _parse("--chakra_schema_version", "v9")
    with pytest.raises(UserError, match="give one of them"):
        _parse("--format", "json", "--chakra_schema_version", "v0.0.4")


def test_schema_version_conflict_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["generate", "--output_dir", str(out), "--format", "json",
         "--chakra_schema_version", "v0.0.1"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.startswith("error: chakra_schema_version=v0.0.1 means format=")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


# -- runs that need the built-in models and emitters ------------------------------------


def test_generate_writes_traces_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    args = ["generate", *TINY, "--dp", "2", "--tp", "2", "--pp", "2", "--output_dir", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"workload.{r}.et" for r in range(8)] + ["workload.json"])
    summary = result.stderr
    assert "ranks" in summary and "8" in summary
    assert "nodes COMP" in summary and "FLOPs" in summary
    assert "files written" in summary and "bytes written" in summary
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    again = runner.invoke(app, args)
    assert again.exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # same input, same bytes
    groups = json.loads((out / "workload.json").read_text())
    assert groups and all(len(members) > 1 for members in groups.values())


def test_generate_with_dashed_names_and_json_format(tmp_path: Path) -> None:
    out = tmp_path / "json"
    args = ["generate", *[a.replace("_", "-") for a in TINY], "--tp", "2",
            "--chakra-schema-version", "json", "--output-dir", str(out),
            "--output-name", "trace.%d.json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["trace.0.json", "trace.1.json", "trace.json"]


def test_default_output_name_follows_the_format(tmp_path: Path) -> None:
    out = tmp_path / "json"
    result = runner.invoke(app, ["generate", *TINY, "--tp", "2", "--format", "json",
                                 "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "workload.0.json", "workload.1.json", "workload.json"
    ]


def test_bad_values_exit_2_and_write_nothing(tmp_path: Path) -> None:
    cases = [
        ["--tp", "3"],  # does not divide head=4
        ["--model", "no-such-model"],
        ["--format", "no-such-format"],
        ["--batch", "8", "--micro_batch", "3"],
    ]
    for extra in cases:
        out = tmp_path / "never"
        result = runner.invoke(app, ["generate", *TINY, *extra, "--output_dir", str(out)])
        assert result.exit_code == 2, (extra, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (extra, result.stderr)
        assert not out.exists(), extra
    unknown = runner.invoke(app, ["generate", "--model", "no-such-model"])
    assert "unknown model 'no-such-model'; allowed: " in unknown.stderr
    assert "gpt" in unknown.stderr


def test_a_plan_the_system_refuses_writes_nothing(tmp_path: Path) -> None:
    """``--predict`` prices the workload before it is written: a plan the system refuses
    (DeepEP's kernels on V100s) is one error line, exit 2, and no files."""
    moe = ["--model", "moe", "--num_stacks", "2", "--dmodel", "256", "--dff", "512", "--head",
           "4", "--kvhead", "4", "--seq", "64", "--dvocal", "512", "--experts", "8",
           "--kexperts", "2", "--dp", "4", "--ep", "4", "--ep_layout", "fold", "--batch", "8",
           "--moe_dispatcher", "deepep"]  # fmt: skip
    out = tmp_path / "never"
    result = runner.invoke(
        app, ["generate", *moe, "--system", "v100-32g", "--predict", "--output_dir", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: moe_dispatcher=deepep runs on ampere, hopper, blackwell, cdna3, cdna4 GPUs: "
        "system 'v100-32g' has volta GPUs; allowed there: moe_dispatcher=alltoall"
    )
    assert not out.exists()
    written = runner.invoke(
        app, ["generate", *moe, "--system", "a100-40g", "--predict", "--output_dir", str(out)]
    )
    assert written.exit_code == 0, written.output
    assert sorted(p.name for p in out.glob("*.et")) == [f"workload.{r}.et" for r in range(4)]


def test_summary_counts_match_the_rank_graphs() -> None:
    from stg.core.pipeline import build_workload
    from stg.core.workload import NodeType
    from stg.host.registry import load_registry

    registry = load_registry(autoload=False)
    options = _parse(*TINY, "--dp", "2", "--tp", "2", "--pp", "2")
    workload = build_workload(options, registry)
    summary = workload_summary(workload)
    nodes = [node for graph in workload.ranks for node in graph.nodes()]
    assert summary["ranks"] == 8
    assert sum(summary["nodes"].values()) == len(nodes)
    assert summary["flops"] == sum(n.num_ops for n in nodes if n.type is NodeType.COMP)
    for name, size in summary["collective_bytes"].items():
        assert size == sum(
            n.comm_size
            for n in nodes
            if n.type is NodeType.COMM_COLL and n.comm_type is not None
            and n.comm_type.name == name
        )
    assert summary["flops"] > 0
