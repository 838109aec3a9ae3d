"""A light start: commands import only what they use (counted in fresh processes, not timed).

Each case runs in a new interpreter and reports the modules it imported: the symbolic core
(sympy), rich's markdown, the protobuf schemas and the plugin modules load only for the
commands that need them (benchmarks/startup.py measures the CPU time of the same commands).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app, builtin_command_names

FAKE_DISTS = Path(__file__).parent / "fake_dists"

# Runs the given Python (or the CLI with the given arguments) and writes the names of the
# modules imported, as JSON, on the last line of stderr.
PROBE = """
import atexit, json, sys
atexit.register(lambda: sys.stderr.write("\\n" + json.dumps(sorted(sys.modules)) + "\\n"))
if sys.argv[1] == "--exec":
    exec(sys.argv[2])
else:
    from stg.cli import main
    main(sys.argv[1:])
"""

SYMBOLIC = ("sympy", "stg.core.symbolic", "stg.core.pipeline")
SCHEMAS = ("stg.trace.proto.chakra_v001_pb2", "stg.trace.proto.chakra_v004_pb2")
PLUGINS = ("stg.models.gpt", "stg.predictors.time", "stg.emitters.chakra")


def imported(*args: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh ``python`` imported running ``args`` (exit code 0 expected)."""
    environ = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=environ
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-rank v0.0.4 trace."""
    out = tmp_path_factory.mktemp("light") / "out"
    args = ["generate", "--model", "gpt", "--num_stacks", "2", "--output_dir", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return str(out)


def test_import_of_the_cli_is_light() -> None:
    modules = imported("--exec", "import stg.cli")
    heavy = (*SYMBOLIC, *SCHEMAS, *PLUGINS, "rich.markdown", "google.protobuf", "stg.api")
    assert not modules & set(heavy)
    assert not modules & {"pluggy", "importlib.metadata"}  # stg.hookimpl, stg.__version__


def test_hookimpl_and_version_are_made_on_first_use() -> None:
    modules = imported(
        "--exec",
        "import stg, pluggy; assert isinstance(stg.hookimpl, pluggy.HookimplMarker); "
        "from stg import __version__; assert __version__ and stg.__version__ is __version__",
    )
    assert "importlib.metadata" in modules


@pytest.mark.parametrize(
    "command", [["feed"], ["inspect", "trace"], ["validate"]], ids=lambda c: " ".join(c)
)
def test_read_commands_skip_the_symbolic_core(trace: str, command: list[str]) -> None:
    modules = imported(*command, trace)
    assert not modules & {*SYMBOLIC, *PLUGINS, "stg.api", "stg.trace.proto.chakra_v001_pb2"}
    assert "stg.trace.proto.chakra_v004_pb2" in modules  # the trace's own schema
    assert "pydantic" not in modules  # its PATH argument is typer's Path without pydantic


def test_records_of_the_public_api_load_without_the_symbolic_core() -> None:
    modules = imported("--exec", "from stg.api import Kernel, Predictor, hookimpl")
    assert not modules & set(SYMBOLIC)
    names = imported("--exec", "import stg.api; stg.api.GraphBuilder")
    assert {"sympy", "stg.core.symbolic"} <= names  # what a model plugin uses still loads


def test_help_with_a_plugin_of_records_skips_the_symbolic_core() -> None:
    path = os.pathsep.join(p for p in (str(FAKE_DISTS), os.environ.get("PYTHONPATH")) if p)
    env = {"STG_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": path, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "stg", "-p", "stg_fake_good", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert done.returncode == 0 and "fake-hello" in done.stdout, done.stdout + done.stderr
    modules = imported("-p", "stg_fake_good", "--help", env=env)
    assert "stg_fake_good" in modules
    assert not modules & {*SYMBOLIC, *PLUGINS}


@pytest.mark.parametrize("command", ["predict", "generate", "search"])
def test_help_that_lists_models_and_predictors_loads_none_of_them(command: str) -> None:
    # {allowed:models} and {allowed:predictors} come from stg.host.deferred's table
    modules = imported(command, "--help")
    assert not modules & {*SYMBOLIC, *PLUGINS, *SCHEMAS}
    # the presets' TOML data is read without the symbolic core
    assert {m for m in modules if m.startswith(("stg.models.", "stg.predictors."))} <= {
        "stg.models.presets"
    }


def test_a_prediction_loads_only_the_model_and_predictor_it_uses(tmp_path: Path) -> None:
    args = ["--model", "gpt", "--num_stacks", "2", "--predictor", "analytical", "--json"]
    modules = imported("predict", *args, env={"STG_CACHE_DIR": str(tmp_path)})  # it builds
    plugins = ("stg.models.", "stg.predictors.", "stg.emitters.")
    builtins = {m for m in modules if m.startswith(plugins)}
    assert builtins == {  # a model, not a preset: stg.models.presets reads no preset file
        "stg.models.gpt",
        "stg.predictors.analytical",
        "stg.predictors._workload_cache",  # its reduced workloads on disk
    }
    assert not modules & {*SCHEMAS, "google.protobuf"}  # no trace is written or read


def test_an_analytical_prediction_as_json_loads_no_console_and_no_worker_pool() -> None:
    # rich renders tables and the progress bar of a build; --jobs serves a trace's readers
    args = ["--model", "gpt", "--num_stacks", "2", "--predictor", "analytical", "--json"]
    modules = imported("predict", *args)
    assert not {m for m in modules if m == "rich" or m.startswith("rich.")}
    assert not modules & {"stg.trace.parallel", "concurrent.futures", "multiprocessing"}
    # typer's coercion of the options through pydantic: stg.cli._shared.light_coercion decides them
    assert not {m for m in modules if m.partition(".")[0] in ("pydantic", "pydantic_core")}
    # Besides sympy and mpmath (the symbolic core's, about 490 modules: the model imports it
    # where the reduced workloads are built, not read from the cache), 290 modules on Python
    # 3.11: 188 of the standard library, 52 of stg, 26 of typer, 13 of pluggy and the
    # installed plugins; 330 leaves room for another Python, not for a new library on this
    # path
    rest = {m for m in modules if m.partition(".")[0] not in ("sympy", "mpmath")}
    assert len(rest) <= 330, sorted(rest)


@pytest.mark.parametrize("command", ["predict", "generate"])
def test_a_commands_help_builds_no_pydantic_adapter(command: str) -> None:
    # typer would coerce the root's -p/--plugin through pydantic before the command's --help
    modules = imported(command, "--help")
    assert not {m for m in modules if m.partition(".")[0] in ("pydantic", "pydantic_core")}


def test_the_analytical_predictor_loads_the_pipeline_only_to_build() -> None:
    modules = imported("--exec", "import stg.predictors.analytical")
    assert not modules & {"stg.core.pipeline", "stg.core.lowering", "stg.core.autodiff"}


GPT3_1024 = [
    "--model", "gpt3-175b", "--tp", "8", "--pp", "16", "--dp", "8",
    "--batch", "1536", "--micro_batch", "8", "--predictor", "analytical", "--json",
]  # fmt: skip


def test_an_analytical_prediction_from_the_cache_imports_no_model_and_no_sympy(
    tmp_path: Path,
) -> None:
    env = {"STG_CACHE_DIR": str(tmp_path)}
    first = imported("predict", *GPT3_1024, env=env)  # builds its reduced workloads
    assert "stg.models.gpt" in first and "sympy" in first
    modules = imported("predict", *GPT3_1024, env=env)  # reads them back
    models = {m for m in modules if m.startswith("stg.models.")}
    assert models == {"stg.models.presets"}  # the preset's dimensions, no model template
    assert not modules & {*SYMBOLIC, "mpmath", "stg.core.lowering", "stg.core.autodiff"}
    # statistics (with fractions and decimal) only for a calibration table's fits
    assert not modules & {"statistics", "fractions", "decimal"}


def test_every_deferred_built_in_model_has_a_layer_stack() -> None:
    # stg.core.validation checks a deferred model's options without importing it on this
    from stg.host.deferred import DEFERRED_BUILTINS
    from stg.host.registry import load_registry

    registry = load_registry(autoload=False)
    names = [n for table in DEFERRED_BUILTINS.values() for n in table.get("models", {})]
    assert names
    for name in names:
        model = registry.models.get(name)
        assert model.block is not None or model.stack is not None, name


def test_the_root_help_lists_the_commands_without_importing_them() -> None:
    modules = imported("--help")
    commands = {f"stg.cli.{name.replace('-', '_')}" for name in builtin_command_names()}
    assert not modules & commands
    assert not modules & {"stg.core.options", "stg.trace.feeder", "stg.explore.search"}


def test_the_command_summaries_are_the_commands_first_paragraphs() -> None:
    from stg.cli import COMMAND_SUMMARIES, _builtin_command

    assert sorted(COMMAND_SUMMARIES) == sorted(builtin_command_names())
    for name, summary in COMMAND_SUMMARIES.items():
        command = _builtin_command(name)
        text = inspect.cleandoc(command.short_help or command.help or "")
        assert summary == text.split("\n\n")[0], name
        assert not (command.hidden or command.deprecated or command.rich_help_panel), name


def test_the_root_help_is_the_same_as_from_the_commands_themselves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["--help"], env={"COLUMNS": "100"})
    monkeypatch.setattr("stg.cli.COMMAND_SUMMARIES", {})  # every command built to be listed
    built = runner.invoke(app, ["--help"], env={"COLUMNS": "100"})
    assert listed.exit_code == built.exit_code == 0
    assert listed.output == built.output
    assert "predict" in listed.output and "Predict iteration time" in listed.output


def test_the_bench_operators_load_only_for_stg_bench() -> None:
    # stg.bench.ops brings the benchmark configs and calibration tables (stg.perf.calibration)
    modules = imported(
        "--exec",
        "from stg.host.registry import load_registry; "
        "registry = load_registry(autoload=False); "
        "assert 'torch.nn.Linear' in registry.bench_ops.names()",
    )
    assert not modules & {"stg.bench.ops", "stg.bench.config", "stg.perf.calibration"}
    modules = imported(
        "--exec",
        "from stg.host.registry import load_registry; "
        "registry = load_registry(autoload=False); "
        "assert registry.bench_ops.get('torch.nn.Linear').name == 'torch.nn.Linear'",  # PARAM's
    )
    assert "stg.bench.ops" in modules


def test_the_preset_files_are_read_when_the_presets_are_first_read() -> None:
    import stg
    from stg.host.records import Preset
    from stg.host.registry import load_registry

    class Plugin:  # registers one preset after the built-ins
        @stg.hookimpl
        def stg_register_presets(self, register):  # type: ignore[no-untyped-def]
            register(Preset("tiny-gpt", "gpt", {"num_stacks": 2}, source="a test"))

    registry = load_registry(autoload=False, plugins=[Plugin()])
    assert not registry.failures
    (info,) = [p for p in registry.plugins if p.name == "stg.models.presets"]
    assert info.registered == {}  # not read yet
    registry.models.check("gpt")  # a model's name: the presets are not needed
    assert [p for p in registry.plugins if p.name == "stg.models.presets"] == [info]
    names = [e.name for e in registry.presets]
    assert "gpt3-175b" in names and names[-1] == "tiny-gpt"  # the built-ins' in their place
    (info,) = [p for p in registry.plugins if p.name == "stg.models.presets"]
    assert info.registered["presets"] == tuple(names[:-1])
    modules = imported("--exec", "import stg.host.registry as r; r.load_registry().presets")
    assert "stg.models.presets" not in modules
    modules = imported("--exec", "import stg.host.registry as r; r.load_registry().presets.names()")
    assert "stg.models.presets" in modules


PIPELINED = ["--model", "gpt", "--num_stacks", "8", "--pp", "4", "--dp", "2", "--micro_batch",
             "2", "--json"]  # fmt: skip


@pytest.mark.parametrize("batch", ["64", "8"], ids=["periodic", "whole"])
def test_a_default_prediction_from_the_cache_lowers_its_workload_without_sympy(
    batch: str, tmp_path: Path
) -> None:
    # the time predictor lowers the micro-batches its periodic replay needs (or, at 4
    # micro-batches on 4 stages, all of them) from the model's bound parts, which it keeps on
    # disk: a second process reads them back
    env = {"STG_CACHE_DIR": str(tmp_path)}
    first = imported("predict", *PIPELINED, "--batch", batch, env=env)
    assert "sympy" in first and "stg.models.gpt" in first
    modules = imported("predict", *PIPELINED, "--batch", batch, env=env)
    assert "stg.core.lowering" in modules and "stg.predictors.time" in modules
    assert not modules & {"sympy", "mpmath", "stg.core.symbolic", "stg.core.autodiff"}
    assert not {m for m in modules if m.startswith("stg.models.")} - {"stg.models.presets"}
