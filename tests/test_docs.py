"""The code in the docs runs: the plugin guide's and the model API's modules, commands and
tests, the system files of docs/systems.md, and the README."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.api import GraphBuilder
from stg.cli import app, builtin_command_names
from stg.perf.system import KNOWN_KEYS, NETWORK_KEYS, system_from_dict
from stg.testing import make_registry

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
MODEL_API = ROOT / "docs" / "model-api.md"
SYSTEMS = ROOT / "docs" / "systems.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
FILE_FENCE = re.compile(r"^```(\w+) ([\w.-]+)\n(.*?)^```", re.S | re.M)
"""A block with a file name after the language (```json my-cluster.json): a file to write."""


def blocks(path: Path, language: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


def named_files(path: Path) -> dict[str, str]:
    """The blocks of ``path`` that name a file after their language, by file name."""
    text = path.read_text(encoding="utf-8")
    return {name: body for _, name, body in FILE_FENCE.findall(text)}


def console_commands(path: Path) -> list[str]:
    return [
        line[2:]
        for body in blocks(path, "console")
        for line in body.splitlines()
        if line.startswith("$ stg ")
    ]


def write_modules(doc: Path, directory: Path) -> dict[str, Path]:
    """Every python block of ``doc`` (each starts with ``# name.py``), written to directory."""
    written = {}
    for body in blocks(doc, "python"):
        first = body.splitlines()[0]
        assert first.startswith("# ") and first.endswith(".py"), first
        name = first[2:]
        (directory / name).write_text(body, encoding="utf-8")
        written[name[:-3]] = directory / name
    return written


def run_module_tests(modules: dict[str, Path]) -> int:
    """Run the ``test_*`` functions of the ``test_*`` modules, as pytest would; how many ran."""
    ran = 0
    for name in [name for name in modules if name.startswith("test_")]:
        module = importlib.import_module(name)
        for attr, fn in sorted(vars(module).items()):
            if attr.startswith("test_") and callable(fn):
                kwargs = {}
                if "stg_registry" in inspect.signature(fn).parameters:
                    kwargs["stg_registry"] = make_registry
                fn(**kwargs)
                ran += 1
    return ran


@pytest.fixture
def doc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory, importable, with installed plugins switched off;
    the modules written there are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    yield tmp_path
    for path in tmp_path.glob("*.py"):
        sys.modules.pop(path.stem, None)


@pytest.fixture
def guide_modules(doc_dir: Path) -> dict[str, Path]:
    """Every python block of the guide that starts with ``# name.py``, written to tmp_path."""
    return write_modules(GUIDE, doc_dir)


def test_guide_console_commands_run(guide_modules: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    commands = console_commands(GUIDE)
    assert len(commands) >= 2
    for command in commands:
        args = shlex.split(command)[1:]
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert "failed" not in result.stdout, (command, result.stdout)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["workload.0.csv", "workload.1.csv", "workload.json"]
    header = (tmp_path / "out" / "workload.0.csv").read_text().splitlines()[0]
    assert header == "id,name,type,num_ops,comm_size,data_deps"


def test_guide_tests_pass(guide_modules: dict[str, Path]) -> None:
    assert run_module_tests(guide_modules) >= 2


def test_guide_command_plugin(guide_modules: dict[str, Path]) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["-p", "stg_hello", "hello", "--name", "chakra"])
    assert ok.exit_code == 0 and ok.stdout == "hello chakra\n"
    bad = runner.invoke(app, ["-p", "stg_hello", "hello", "--name", ""])
    assert bad.exit_code == 2
    assert bad.stderr == "error: name must not be empty\n"


def test_guide_packaging_names_the_module() -> None:
    (toml,) = blocks(GUIDE, "toml")
    data = tomllib.loads(toml)
    entry_points = data["project"]["entry-points"]["stg"]
    modules = {body.splitlines()[0][2:-3] for body in blocks(GUIDE, "python")}
    assert set(entry_points.values()) <= modules
    assert set(data["tool"]["setuptools"]["py-modules"]) == set(entry_points.values())
    assert data["build-system"]["build-backend"] == "setuptools.build_meta"
    assert "symbolic-tensor-graph" in data["project"]["dependencies"]
    # building, installing and loading it: tests/test_plugin_packaging.py


# -- docs/model-api.md ----------------------------------------------------------------------


def test_model_api_tests_pass(doc_dir: Path) -> None:
    modules = write_modules(MODEL_API, doc_dir)
    assert set(modules) == {
        "stg_parallel", "test_stg_parallel", "stg_interleaved", "test_stg_interleaved",
        "stg_tiny_cnn", "test_stg_tiny_cnn",
    }  # fmt: skip
    assert run_module_tests(modules) >= 3


def test_model_api_console_commands_run(doc_dir: Path) -> None:
    write_modules(MODEL_API, doc_dir)
    commands = console_commands(MODEL_API)
    assert len(commands) >= 3
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert "failed" not in result.stdout, (command, result.stdout)
    written = sorted(p.name for p in (doc_dir / "out").iterdir())
    assert written == ["workload.0.et", "workload.1.et", "workload.json"]


def test_model_api_documents_every_builder_method() -> None:
    text = MODEL_API.read_text(encoding="utf-8")
    public = [name for name in vars(GraphBuilder) if not name.startswith("_")]
    assert "einsum" in public and "custom" in public
    missing = [name for name in public if f"`b.{name}(" not in text]
    assert not missing, missing


def test_model_api_covers_what_the_builtin_models_use() -> None:
    text = MODEL_API.read_text(encoding="utf-8")
    used = set()
    for path in sorted((ROOT / "models").glob("*.py")):
        used |= set(re.findall(r"\bb\.(\w+)", path.read_text(encoding="utf-8")))
    assert used >= {"einsum", "weight", "elementwise", "custom", "residual", "tag", "add"}
    missing = sorted(name for name in used if f"`b.{name}" not in text)
    assert not missing, missing


# -- docs/systems.md ------------------------------------------------------------------------


def test_systems_documents_every_key() -> None:
    text = SYSTEMS.read_text(encoding="utf-8")
    missing = [key for key in sorted(KNOWN_KEYS | NETWORK_KEYS) if f"| `{key}` |" not in text]
    assert not missing, missing


def test_systems_example_files_are_accepted(doc_dir: Path) -> None:
    files = named_files(SYSTEMS)
    assert set(files) == {"my-cluster.json", "minimal.json"}
    example = json.loads(files["my-cluster.json"])
    assert set(example) == KNOWN_KEYS  # the full example shows every key
    assert all(set(dim) == NETWORK_KEYS for dim in example["network"])
    assert system_from_dict(example).name == "my-cluster"
    for name, body in files.items():
        system_from_dict(json.loads(body), name)
        (doc_dir / name).write_text(body, encoding="utf-8")
    commands = console_commands(SYSTEMS)
    assert any("--system my-cluster.json" in command for command in commands)
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        if "--json" in command:
            assert json.loads(result.stdout)["memory"]["system"] == "my-cluster"


def test_systems_error_example(doc_dir: Path) -> None:
    example = json.loads(named_files(SYSTEMS)["my-cluster.json"])
    del example["network"][1]["latency_us"]
    (doc_dir / "my-cluster.json").write_text(json.dumps(example), encoding="utf-8")
    result = CliRunner().invoke(
        app, ["predict", "--system", "my-cluster.json", "--num_stacks", "1"]
    )
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line == "error: my-cluster.json: network[1]: missing key 'latency_us'"
    assert f"`{line}`" in " ".join(SYSTEMS.read_text(encoding="utf-8").split())


def test_readme_links_every_doc() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    more = text[text.index("## More") :]
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in more, doc.name


def test_readme_opens_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = FENCE.search(text)
    assert first is not None
    lines = [line for line in first.group(2).splitlines() if line and not line.startswith("#")]
    assert lines == [
        "pip install -e . && stg generate",
        "python -m venv .venv && . .venv/bin/activate && "
        "pip install 'torch==2.13.0' -e '.[test,bench,explore]' -e plugins/stg-int8-kernels "
        "-e plugins/stg-vision-models && python -m pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert lines[1] in ci.splitlines()
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["testpaths"]
    assert "plugins/stg-int8-kernels/tests" in testpaths
    assert "plugins/stg-vision-models/tests" in testpaths


def test_readme_cli_reference_covers_every_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in builtin_command_names():
        assert f"stg {command}" in text, command


# -- docs/bench.md ----------------------------------------------------------------------------

BENCH = ROOT / "docs" / "bench.md"


def test_bench_console_commands_run(doc_dir: Path) -> None:
    """The files and commands of docs/bench.md, in order: compute, model, calibrate, predict
    with the table, comms, and a plugin's operator."""
    files = named_files(BENCH)
    assert set(files) == {"ops.json", "myops.json"}
    for name, body in files.items():
        (doc_dir / name).write_text(body, encoding="utf-8")
    for shipped in (ROOT / "tests" / "data" / "pytorch_et").iterdir():  # the walk-through's
        (doc_dir / shipped.name).write_bytes(shipped.read_bytes())
    assert set(write_modules(BENCH, doc_dir)) == {"stg_myops"}
    commands = console_commands(BENCH)
    assert len(commands) >= 8
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
    cases = [json.loads(x) for x in (doc_dir / "results.jsonl").read_text().splitlines()]
    ids = [(c["op_name"], c["id"]) for c in cases if "op_name" in c]
    assert ids == [("torch.mm", "0|0|0"), ("torch.bmm", "0|0|0_0"), ("torch.bmm", "0|0|0_1"),
                   ("aten::add", "0|0|0"), ("torch.nn.Linear", "0|0|0")]  # fmt: skip
    shapes = [c["config"]["input"]["args"][0]["shape"] for c in cases[2:4]]
    assert shapes == [[4, 32, 16], [4, 64, 16]]  # the doc's reading of its __copy__
    assert (doc_dir / "roofline.png").is_file() and (doc_dir / "busbw.png").is_file()
    network = json.loads((doc_dir / "network.json").read_text())["network"]
    system_from_dict({**json.loads(named_files(SYSTEMS)["minimal.json"]), "network": network})
    (plugin_case,) = [json.loads(x) for x in (doc_dir / "myops.jsonl").read_text().splitlines()
                      if '"op_name"' in x]  # fmt: skip
    assert plugin_case["extra"]["bytes"] == 3 * 4 * 4096
    part = [json.loads(x) for x in (doc_dir / "part.jsonl").read_text().splitlines()]
    assert [(c["op_name"], c["id"]) for c in part if "op_name" in c] == [
        ("torch.bmm", "0|0|0_1"), ("aten::add", "0|0|0")
    ]  # fmt: skip
    assert (doc_dir / "part_trace_0.json").is_file() and (doc_dir / "part_trace_1.json").is_file()
    # the walk-through: the profiled job predicted with its own measured operators
    assert (doc_dir / "trace" / "mlp.0.et").is_file() and (doc_dir / "trace" / "ddp.json").is_file()
    predicted = CliRunner().invoke(
        app,
        [
            "predict",
            "trace/mlp",
            "--predictor",
            "time",
            "--calibration",
            "mlp-calibration.json",
            "--json",
        ],
    )
    assert json.loads(predicted.stdout)["time"]["calibration"]["analytical"] == 0


def test_bench_error_examples_are_what_stg_prints(doc_dir: Path) -> None:
    """The error lines shown in docs/bench.md come from this config."""
    f32 = {"type": "tensor", "dtype": "float"}
    gen = {"input_data_generator": "PyTorch:DefaultDataGenerator"}
    config = {
        "torch.mm": {**gen, "config": [{"input": [
            {"args": [{**f32, "shape": [64, 32]}, {**f32, "shape": [32, 16]}]},
            {"args": [{**f32, "shape": [64, 32]}, {**f32, "shape": [31, 16]}]}]}]},
        "torch.foo": {**gen, "config": [{"input": [{"args": []}]}]},
        "torch.bmm": {**gen, "input_iterator": "RangeConfigIterator", "config": [{"input": [
            {"args": [{**f32, "shape": [4, [64, 32, 32], 8], "__range__": ["shape"]}]}]}]},
    }  # fmt: skip
    (doc_dir / "bad.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["bench", "compute", "bad.json", "-i", "1", "-o", "r.jsonl"])
    assert result.exit_code == 1
    shown = [line for body in blocks(BENCH, "text") for line in body.splitlines()]
    for line in (x for x in result.stderr.splitlines() if x.startswith("error: ")):
        if "unknown operator" in line:
            head, tail = line.split("; allowed: ")
            assert f"{head}; allowed: torch.Tensor.copy_, ..., {tail.rsplit(', ', 1)[1]}" in shown
        else:
            assert line in shown, line


# -- docs/presets.md ----------------------------------------------------------------------------

PRESETS = ROOT / "docs" / "presets.md"
PRESET_ROW = re.compile(
    r"^\| `([\w.-]+)` \| ([\w-]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| [^|]+ \|$", re.M
)
"""A row of the table of presets: name, model, dimensions, published, template, (source)."""


def test_presets_table_is_what_the_registry_and_templates_say() -> None:
    """Every built-in preset has a row: its model, dimensions, published figures and the
    template's counts as stg computes them (tied presets without their own LM head)."""
    from stg.core.modelinfo import model_parameters
    from stg.core.options import GenerateOptions, resolve_model
    from stg.core.pipeline import symbol_values

    registry = make_registry()
    rows = {m[0]: m[1:] for m in PRESET_ROW.findall(PRESETS.read_text(encoding="utf-8"))}
    assert set(rows) == {entry.name for entry in registry.presets}
    billions = lambda v: f"{v / 1e9:.2f}B"  # noqa: E731
    for entry in registry.presets:
        preset = entry.item
        model, dims, published, template = (cell.strip() for cell in rows[entry.name])
        assert model == preset.model, entry.name
        assert dims == " ".join(f"{k} {v}" for k, v in preset.dims.items()), entry.name
        stated = [x for x in (preset.published_parameters, preset.published_active_parameters)
                  if x is not None]  # fmt: skip
        assert published == (" / ".join(f"{x / 1e9:g}B" for x in stated) or "-"), entry.name
        values, _ = resolve_model({"model": entry.name}, registry)
        o = GenerateOptions(**values)
        counts = model_parameters(registry.models.get(o.model), o, symbol_values(o))
        untied_copy = preset.tied_embeddings and not o.tie_embeddings
        total = counts["parameters"] - (o.dvocal * o.dmodel if untied_copy else 0)
        shown = [billions(total)]
        if preset.published_active_parameters is not None:
            shown.append(billions(counts["active_parameters"]))
        expected = " / ".join(shown) + (" (tied)" if preset.tied_embeddings else "")
        assert template == expected, entry.name


def test_presets_doc_plugin_tests_and_commands_run(doc_dir: Path) -> None:
    for name, body in named_files(PRESETS).items():  # the plugin's preset file
        (doc_dir / name).write_text(body, encoding="utf-8")
    modules = write_modules(PRESETS, doc_dir)
    assert set(modules) == {"stg_mistral", "test_stg_mistral"}
    assert run_module_tests(modules) == 1
    commands = console_commands(PRESETS)
    assert len(commands) >= 5
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
    for out in ("out", "out-mistral"):
        written = sorted(p.name for p in (doc_dir / out).iterdir())
        assert written == ["workload.0.et", "workload.1.et", "workload.json"], out
    line = " ".join(result.stderr.split())  # the last command: the plugin's preset
    assert "preset │ mistral-7b" in line and "num_stacks 2 (preset: 32)" in line


def test_readme_quick_start_runs_a_preset(doc_dir: Path) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") : text.index("**Drop-in")]
    (line,) = [x for x in quick.splitlines() if x.startswith("stg generate --model ")]
    args = shlex.split(line.split("#")[0])[1:]
    assert args[:3] == ["generate", "--model", "llama3-8b"] and "--tp" in args
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["preset"]["name"] == "llama3-8b" and summary["ranks"] >= 8


# -- docs/exploration.md ----------------------------------------------------------------------

EXPLORATION = ROOT / "docs" / "exploration.md"


def test_exploration_console_commands_run(doc_dir: Path) -> None:
    for name, body in named_files(EXPLORATION).items():
        (doc_dir / name).write_text(body, encoding="utf-8")
    commands = console_commands(EXPLORATION)
    assert any(c.startswith("stg sweep") for c in commands)
    assert any(c.startswith("stg search") for c in commands)
    runner = CliRunner()
    for command in commands:
        result = runner.invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
    assert (doc_dir / "sweep1" / "results.csv").is_file()
    assert (doc_dir / "sweep2" / "sweep.png").is_file()


def test_readme_quick_start_sweep_runs(doc_dir: Path) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") : text.index("**Drop-in")]
    (line,) = [x for x in quick.splitlines() if x.startswith("stg sweep ")]
    result = CliRunner().invoke(app, shlex.split(line.split("#")[0])[1:])
    assert result.exit_code == 0, result.output
    assert (doc_dir / "sweep" / "results.parquet").is_file()
    assert (doc_dir / "sweep" / "sweep.html").is_file()


# -- docs/inference.md --------------------------------------------------------------------------

INFERENCE = ROOT / "docs" / "inference.md"


def test_inference_doc_commands_run(doc_dir: Path) -> None:
    for name, body in named_files(INFERENCE).items():  # the precision plans they read
        (doc_dir / name).write_text(body, encoding="utf-8")
    commands = console_commands(INFERENCE)
    assert len(commands) >= 6
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
    for out in ("prefill", "decode", "mixed"):
        written = sorted(p.name for p in (doc_dir / out).iterdir())
        assert written == ["workload.0.et", "workload.1.et", "workload.json"], out


def test_inference_doc_error_line_is_what_stg_prints(doc_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", "debug", "--phase", "decode", "--sp", "2"]
    )
    assert result.exit_code == 2
    line = result.stderr.strip()
    shown = [x for body in blocks(INFERENCE, "text") for x in body.splitlines()]
    assert line in shown
    (doc_dir / "nvfp4.json").write_text(named_files(INFERENCE)["nvfp4.json"], encoding="utf-8")
    small = ["--model", "llama", "--num_stacks", "1", "--dmodel", "256", "--dff", "512"]
    small += ["--phase", "decode", "--batch", "8", "--system", "v100-32g"]
    refused = CliRunner().invoke(app, ["predict", *small, "--precision_plan", "nvfp4.json"])
    assert refused.exit_code == 2 and refused.stderr.strip() in shown


def test_readme_quick_start_runs_a_serving_prediction() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") : text.index("**Drop-in")]
    (line,) = [x for x in quick.splitlines() if "--phase" in x]
    args = shlex.split(line.split("#")[0])[1:]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["serving"]
    assert report["time_per_output_token_s"] >= report["memory_bandwidth_bound_s"] > 0


# -- docs/simulate.md ---------------------------------------------------------------------------

SIMULATE = ROOT / "docs" / "simulate.md"


def test_simulate_doc_commands_run(doc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands of docs/simulate.md, with the ASTRA-sim that ``$ASTRA_SIM_BIN`` names
    where one is built, else with the stand-in that prints its output
    (tests/astra_sim_standin.py)."""
    from astra_sim_standin import write_standin

    if not os.environ.get("ASTRA_SIM_BIN"):
        monkeypatch.setenv("ASTRA_SIM_BIN", str(write_standin(doc_dir)))
    commands = console_commands(SIMULATE)
    assert [c.split()[1] for c in commands] == ["generate", "simulate", "simulate", "sweep"]
    outputs = []
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        outputs.append(result.stdout)
    assert "ASTRA-sim beside stg predict: out on h100-80g (4 ranks)" in outputs[1]
    report = json.loads(outputs[2])
    assert report["world_size"] == 4 and report["iteration_time_s"]["astra_sim"] > 0
    rows = (doc_dir / "sweep-sim" / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:])


def test_simulate_doc_names_the_written_inputs() -> None:
    """The page's table of cases and its build match what stg writes and reads."""
    from stg.perf.astra_sim import FILE_SUFFIXES

    text = SIMULATE.read_text(encoding="utf-8")
    assert all(f"`<name>{suffix}`" in text for suffix in FILE_SUFFIXES.values())
    assert "518bd513ae110428cd62eb60efc0f3993fd53c70" in text


# -- docs/serving.md ----------------------------------------------------------------------------

SERVING = ROOT / "docs" / "serving.md"


def test_serving_doc_commands_run_and_say_what_the_doc_says(doc_dir: Path) -> None:
    for name, body in named_files(SERVING).items():
        (doc_dir / name).write_text(body, encoding="utf-8")
    commands = console_commands(SERVING)
    assert len(commands) == 10
    goodput = []
    for command in commands:
        if " search " in command:
            continue
        result = CliRunner().invoke(app, shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)
        if "--json" not in command:
            goodput.append(float(result.stdout.split("% within")[0].rsplit("(", 1)[1]))
            if "--replicas 1 " in command and "--prefill-replicas" not in command:
                shown = [x for body in blocks(SERVING, "text") for x in body.splitlines()]
                first = result.stdout.splitlines()[0]
                assert first.split(", ")[:3] == shown[0].split(", ")[:3]
    # one replica misses the SLOs for most requests, two meet them for almost all, and so do
    # one prefill and one decode replica
    assert goodput[0] < 50 < 95 < goodput[1] <= goodput[2]
    assert goodput[3] > 95 and goodput[4] > 95
    rows = (doc_dir / "per-request.csv").read_text().splitlines()
    assert rows[0].startswith("id,replica,arrival_s,prompt_tokens") and len(rows) == 5
    assert (doc_dir / "occupancy.csv").read_text().startswith("time_s,replica,kv_blocks_used")


def test_serving_doc_engine_profiles_table() -> None:
    """The engine-profile example's table is what its three commands print."""
    commands = [c for c in console_commands(SERVING) if "--scheduler vllm --rate 20" in c]
    assert len(commands) == 3
    text = SERVING.read_text(encoding="utf-8")
    for command in commands:
        result = CliRunner().invoke(app, [*shlex.split(command)[1:], "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        ttft, tpot = report["ttft_s"], report["tpot_s"]
        cells = (
            f"| {1e3 * ttft['p50']:.1f} ms / {1e3 * ttft['p99']:.1f} ms "
            f"| {1e3 * tpot['p50']:.1f} ms / {1e3 * tpot['p90']:.1f} ms |"
        )
        assert cells in text, cells


def test_serving_doc_capacity_plan_is_the_hand_search() -> None:
    """The capacity-planning example's cheapest plans are 8 GPUs, and its two replicas of
    tp 4 have the percentiles of the hand search's two-replica run."""
    [search] = [c for c in console_commands(SERVING) if " search " in c]
    [by_hand] = [
        c for c in console_commands(SERVING) if "--replicas 2 " in c and "--draft" not in c
    ]
    result = CliRunner().invoke(app, [*shlex.split(search)[1:], "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["best"]
    assert {p["gpus"] for p in plans} == {8}
    [two] = [p for p in plans if (p["tp"], p["kv_dtype"], p["layout"]) == (4, "bf16", "aggregated")]
    assert two["replicas"] == 2
    served = CliRunner().invoke(app, [*shlex.split(by_hand)[1:], "--json"])
    report = json.loads(served.stdout)
    assert two["ttft_s"] == pytest.approx(report["ttft_s"]["p99"], rel=1e-12)
    assert two["tpot_s"] == pytest.approx(report["tpot_s"]["p90"], rel=1e-12)
    text = SERVING.read_text(encoding="utf-8")
    assert f"| 8 | 4 | bf16 | aggregated | 2 | {1e3 * two['ttft_s']:.1f} ms |" in text


def test_readme_precision_plan_example_says_what_stg_finds(tmp_path: Path) -> None:
    """The README's figures of ``stg plan precision`` (the example plugin installed) are the
    command's own: they drifted once the predictors changed."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    command = "stg plan precision --tp 8 --num_stacks 8 --memory-budget 21GiB"
    assert f"`{command}`" in text
    args = [*shlex.split(command)[1:], "--json", "--out", str(tmp_path / "plan.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    gib = 2**30
    said = (
        f"starts from {report['baseline']['iteration_time_s']:.3f} s and "
        f"{report['baseline']['peak_bytes'] / gib:.2f} GiB per GPU (over budget), lowers "
        f"{report['steps'][0]['op']} to int8 to fit"
    )
    assert said in text
    assert (
        f"{report['best']['iteration_time_s']:.3f} s and {report['best']['peak_bytes'] / gib:.2f}"
        f" GiB, a predicted speedup of {report['speedup']:.2f}\u00d7 ({report['evaluations']} plans"
    ) in text
