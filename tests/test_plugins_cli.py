"""The CLI shell: ``stg plugins list``, ``-p``, plugin commands, one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app

runner = CliRunner()


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_plugins_list_shows_good_and_broken_plugins_and_exits_0(fake_dists: Path) -> None:
    result = runner.invoke(app, ["plugins", "list"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "fake_good (stg-fake-good)" in out
    assert "fake-int8-gemm" in out and "fake-hello" in out
    broken_row = next(line for line in out.splitlines() if "fake_broken" in line)
    assert "1.0" in broken_row and "entry point" in broken_row
    assert "failed: RuntimeError: stg_fake_broken cannot be imported (on purpose)" in broken_row
    assert "stg.emitters." in out  # built-ins are listed as plugins too


def test_plugins_list_json(fake_dists: Path) -> None:
    result = runner.invoke(app, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    good = next(p for p in report["plugins"] if p["name"] == "fake_good")
    assert good == {
        "name": "fake_good",
        "dist": "stg-fake-good",
        "version": "1.0",
        "source": "entry point",
        "registers": {
            "kernels": ["fake-int8-gemm"],
            "emitters": ["fake-lines"],
            "commands": ["fake-hello"],
        },
    }
    failures = {f["name"]: f for f in report["failures"]}
    assert failures["fake_broken"] == {
        "name": "fake_broken",
        "dist": "stg-fake-broken",
        "version": "1.0",
        "source": "entry point",
        "error": "RuntimeError: stg_fake_broken cannot be imported (on purpose)",
    }
    assert failures["fake_wrongtype"]["version"] == "0.3"
    assert all(p["source"] == "builtin" for p in report["plugins"][:1])
    again = runner.invoke(app, ["plugins", "list", "--json"])
    assert again.stdout == result.stdout  # deterministic


def test_autoload_env_hides_entry_points(fake_dists: Path) -> None:
    result = runner.invoke(
        app, ["plugins", "list", "--json"], env={"STG_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert not [p for p in report["plugins"] if p["source"] == "entry point"]
    assert not [f for f in report["failures"] if f["source"] == "entry point"]


def test_dash_p_loads_a_module_after_everything_else(fake_dists: Path) -> None:
    result = runner.invoke(app, ["-p", "fake_cli_plugin", "plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    plugins = json.loads(result.stdout)["plugins"]
    assert plugins[-1]["name"] == "fake_cli_plugin"
    assert plugins[-1]["source"] == "command line"
    assert plugins[-1]["registers"]["emitters"] == ["names"]
    both = runner.invoke(
        app, ["--plugin=fake_cli_plugin", "-p", "no_such_module_xyz", "plugins", "list", "--json"]
    )
    assert both.exit_code == 0
    assert (
        "warning: plugin 'no_such_module_xyz' failed to load: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    ) in both.stderr
    failures = json.loads(both.stdout)["failures"]
    assert [f["name"] for f in failures if f["source"] == "command line"] == [
        "no_such_module_xyz"
    ]


def test_plugin_commands_are_added_and_shown_in_help(fake_dists: Path) -> None:
    result = runner.invoke(app, ["fake-hello", "--name", "astra"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "hello astra\n"
    helptext = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert helptext.exit_code == 0
    assert "fake-hello" in helptext.stdout
    assert "generate" in helptext.stdout and "plugins" in helptext.stdout


def test_plugin_command_from_dash_p_and_user_error_is_one_line(fake_dists: Path) -> None:
    result = runner.invoke(app, ["-p", "fake_cli_plugin", "fake-fail", "--value", "7"])
    assert result.exit_code == 2
    assert _one_error_line(result.stderr) == "error: value=7 is not allowed; allowed: none"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bogus"], "error: No such option: --bogus (see 'stg --help')"),
        (["nope"], "error: No such command 'nope' (see 'stg --help')"),
        (["plugins", "list", "--x"], "error: No such option: --x (see 'stg plugins list --help')"),
        (
            ["generate", "--tpsp", "maybe"],
            "error: Invalid value for '--tpsp': 'maybe' is not a boolean; allowed: true, t, "
            "yes, y, 1, false, f, no, n, 0 (any case) (see 'stg generate --help')",
        ),
        (["generate", "--dp"], None),
        (["generate", "--dp", "two"], None),
        (["generate", "--activation_recompute", "some"], None),
        (["-p"], None),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], expected: str | None) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.stderr)
    if expected is not None:
        assert line == expected
    assert result.stdout == ""


def test_no_arguments_prints_help() -> None:
    result = runner.invoke(app, [])
    assert result.exit_code == 0
    assert "Usage" in result.stdout and "plugins" in result.stdout


def test_version() -> None:
    from stg import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"stg {__version__}\n"


def test_main_entry_point_exits_with_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    from stg.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--bogus"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: No such option: --bogus (see 'stg --help')\n"
