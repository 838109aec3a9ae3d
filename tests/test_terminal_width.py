"""Human output fits the terminal (``COLUMNS``; rich assumes 80 in a pipe), and ``--help``
names the allowed values of the options that take a name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.host.registry import load_registry
from stg.perf.system import PRESETS

runner = CliRunner()
WIDTHS = (60, 80, 120)
SMALL = ["--num_stacks", "1", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip
ASTRA_SIM = "ASTRA-sim arguments:"


def _lines(text: str) -> Iterator[str]:
    """The lines a reader sees; the line of ASTRA-sim arguments after ``ASTRA-sim arguments:``
    is left out: it is a command line to paste whole, as long as its paths."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if k and lines[k - 1] == ASTRA_SIM:
            continue
        yield line


def _fits(args: list[str]) -> dict[int, str]:
    """Run ``stg ARGS`` at each width; assert it succeeds and no line is wider. Returns the
    stdout at each width."""
    out = {}
    for width in WIDTHS:
        result = runner.invoke(app, args, env={"COLUMNS": str(width)})
        assert result.exit_code == 0, result.output
        for stream in (result.stdout, result.stderr):
            wide = [line for line in _lines(stream) if len(line) > width]
            assert not wide, f"stg {' '.join(args)} at {width} columns:\n" + "\n".join(wide)
        assert "…" not in result.stdout + result.stderr
        out[width] = result.stdout
    return out


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    out = tmp_path / "t"
    args = ["generate", *SMALL, "--num_stacks", "2", "--tp", "2", "--pp", "2", "--batch", "8",
            "--micro_batch", "2", "--output_dir", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_generate_summary_of_a_preset_fits(tmp_path: Path) -> None:
    for preset in ("llama3-8b", "deepseek-v3"):
        args = ["generate", "--model", preset, "--num_stacks", "4", "--predict"]
        _fits([*args, "--output_dir", str(tmp_path / preset)])


def test_predict_tables_fit(trace: Path) -> None:
    _fits(["predict", "--model", "deepseek-v3", "--num_stacks", "4", "--explain"])
    _fits(["predict", "--model", "llama3-8b", "--tp", "8", "--pp", "4", "--batch", "64"])
    _fits(["predict", *SMALL, "--phase", "decode", "--explain"])
    _fits(["predict", str(trace), "--explain"])


def test_memory_table_of_many_columns_keeps_its_numbers_whole(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stg.cli._shared import print_reports

    monkeypatch.setenv("COLUMNS", "80")
    big = 12345.67 * 2**30
    row = dict(stage=0, ranks=1024, weights=big, gradients=big, optimizer=big, activations=big,
               buffers=big, peak=big, fits=False)  # fmt: skip
    report = dict(predictor="memory", system="a100-80g", capacity_bytes=80 * 2**30,
                  classes=[row, {**row, "stage": 1}])  # fmt: skip
    print_reports({"memory": report}, "test")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = [line for line in out.splitlines() if "1024" in line]
    assert len(rows) == 2 and all(line.count("12345.67") == 6 for line in rows), out


def test_inspect_model_fits_and_cites_its_sources_with_verbose() -> None:
    for name in ("llama3-8b", "deepseek-v3"):
        plain = _fits(["inspect", "model", name])
        assert "Source:" not in plain[80] and "--verbose" in plain[80]
        verbose = _fits(["inspect", "model", name, "--verbose"])
        assert f"sources of {name}:" in verbose[80]
    listing = _fits(["inspect", "model"])
    assert "arXiv" not in listing[80] and "llama3-8b" in listing[80]
    cited = _fits(["inspect", "model", "-v"])
    assert "arXiv:2407.21783" in " ".join(cited[120].split())
    # --json is unchanged: the source stays in it
    data = json.loads(runner.invoke(app, ["inspect", "model", "llama3-8b", "--json"]).stdout)
    assert "Dubey et al. 2024" in data["preset"]["source"]


def test_inspect_model_lists_a_preset_a_line_in_80_columns() -> None:
    """The listing gives each preset one line of 80 columns or fewer (its aliases below it):
    layers, dmodel, heads, experts and the published counts; the sources come with -v."""
    plain = _fits(["inspect", "model"])[80].splitlines()
    start = [line.strip() for line in plain].index("presets (--model NAME)")
    rows = {line.split()[0]: line.split()[1:] for line in plain[start + 3 :] if line[:1].isalnum()}
    presets = list(load_registry(autoload=False).presets)
    assert {p.name for p in presets} <= set(rows)
    assert rows["llama3-8b"] == ["llama", "32", "4096", "32/8", "-", "8B"]
    assert rows["kimi-k2"] == ["deepseek", "61", "7168", "64", "8/384+1", "1000B", "/", "32B"]
    assert rows["qwen3-0.6b"] == ["llama", "28", "1024", "16/8", "-", "0.6B"]
    assert "(deepseek-v3-671b)" in [line.strip() for line in plain]
    verbose = _fits(["inspect", "model", "--verbose"])[80].splitlines()
    cited = verbose[verbose.index("sources of kimi-k2:") + 1 :]
    assert cited[0].startswith("  dims: huggingface.co/moonshotai/Kimi-K2-Instruct config.json")
    assert any(line.startswith("  published_parameters: ") for line in cited[:12])


def test_trace_reports_fit(trace: Path) -> None:
    _fits(["inspect", "trace", str(trace)])
    feed = _fits(["feed", str(trace)])
    # a row's last field wraps under itself
    assert re.search(r"^ {20,}COMM_SEND 4, COMP \d+$", feed[80], re.MULTILINE), feed[80]


def test_search_tables_fit() -> None:
    _fits(["search", "--model", "debug", "--batch", "64", "--gpus", "8", "-s", "h100-80g",
           "--refine", "2", "--top", "3"])  # fmt: skip
    _fits(["search", "--model", "llama3-8b", "--phase", "decode", "--context", "4096", "--gpus",
           "4", "-s", "h100-80g", "--max-tpot", "15ms", "--top", "3"])  # fmt: skip


def test_bench_tables_fit(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    config, results = tmp_path / "model.json", tmp_path / "results.jsonl"
    _fits(["bench", "model", *SMALL, "--batch", "2", "-o", str(config)])
    _fits(["bench", "compute", str(config), "-b", "-w", "1", "-i", "1", "-o", str(results)])
    _fits(["bench", "calibrate", str(results), "-o", str(tmp_path / "cal.json")])


def test_simulate_tables_fit(tmp_path: Path) -> None:
    from astra_sim_standin import write_standin

    out = tmp_path / "timed"
    args = ["generate", *SMALL, "--tp", "2", "--dp", "2", "--batch", "8", "--system",
            "h100-80g", "--astra_sim_configs", "--output_dir", str(out)]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    _fits(["simulate", str(out), "--astra-sim", str(write_standin(tmp_path))])


def test_commands_that_already_fit_keep_fitting(trace: Path, tmp_path: Path) -> None:
    _fits(["validate", str(trace)])
    _fits(["plugins", "list"])
    _fits(["inspect", "system", "a100-80g"])
    _fits(["plan", "precision", *SMALL, "--batch", "4", "-o", str(tmp_path / "plan.json")])
    _fits(["sweep", "--model", "debug", "--batch", "32", "--dp", "1,2", "--tp", "1..2", "-s",
           "h100-80g", "-o", str(tmp_path / "sweep"), "-j", "1"])  # fmt: skip


# -- allowed values in --help ---------------------------------------------------------------------


def _help(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _row(text: str, option: str) -> str:
    """The help of one option (from the line that starts with its name up to the next
    option's), on one line."""
    row: list[str] = []
    for line in text.splitlines():
        cell = line.strip("│ ")
        if row and (cell.startswith("-") or cell.startswith("╰")):
            break
        if row or cell.startswith(option):
            row.append(cell)
    assert row, option
    return " ".join(" ".join(row).split())


def test_help_names_the_allowed_values() -> None:
    registry = load_registry()
    generate = _help("generate")
    schedules = _row(generate, "--pipeline_schedule")
    assert registry.schedules.names() and all(n in schedules for n in registry.schedules.names())
    model = _row(generate, "--model,")
    for name in registry.models.names() + registry.presets.names():
        assert re.search(rf"[ (]{re.escape(name)}[,;.]", model), name
    assert all(name in _row(generate, "--format") for name in registry.emitters.names())
    for option in ("--dtype ", "--grad_reduce_dtype", "--kv_dtype"):
        assert all(d in _row(generate, option) for d in ("fp32", "bf16", "fp8", "int8")), option
    assert all(name in _row(generate, "--system ") for name in PRESETS)
    predict = _help("predict")
    assert all(name in _row(predict, "--predictor") for name in registry.predictors.names())
    assert all(name in _row(predict, "--system ") for name in PRESETS)
    assert all(name in _row(_help("plan", "precision"), "--pipeline_schedule")
               for name in registry.schedules.names())  # fmt: skip
    assert "llama3-8b" in _help("inspect", "model") and "t4-16g" in _help("inspect", "system")
    assert all(name in _help("sweep") for name in PRESETS)


def test_help_names_what_a_plugin_registers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "width_schedule_plugin.py").write_text(
        "import stg\n"
        "from stg.core.schedules import gpipe\n"
        "from stg.host.records import PipelineSchedule\n\n\n"
        "@stg.hookimpl\n"
        "def stg_register_parallelisms(register):\n"
        "    register(PipelineSchedule('zigzag-test', gpipe))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "300"})
    assert "zigzag-test" not in plain.stdout
    result = runner.invoke(
        app, ["-p", "width_schedule_plugin", "generate", "--help"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 0, result.output
    assert "zigzag-test" in _row(result.stdout, "--pipeline_schedule")
