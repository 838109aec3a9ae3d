"""The original STG's command lines, small interface defects, scriptable output and progress.

The original STG is https://github.com/astra-sim/symbolic_tensor_graph (``python main.py``);
its README's example lines must run unchanged with ``stg generate`` in their place.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from stg.cli import app, builtin_command_names
from stg.core.options import GenerateOptions

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--dvocal", "128", "--dmodel", "64", "--dff", "128", "--head", "4", "--kvhead", "2",
    "--seq", "32", "--batch", "8", "--micro_batch", "4", "--num_stacks", "2",
]  # fmt: skip

# The original README's command lines, as it writes them. SMALL: the test appends
# --num_stacks 4 (the 80-layer default makes 64 JSON files of ~1 MB); the spellings are theirs.
SMALL = ["--num_stacks", "4"]
ORIGINAL_LINES = [
    # "Usage" (README, 2024-2025)
    (
        "python main.py --output_dir generated/ \\\n"
        "               --output_name workload.%d.et \\\n"
        "               --comm_group_file comm_group.json \\\n"
        "               --dp 2 --tp 2 --pp 2 \\\n"
        "               --weight_sharded 0 ",
        [],
    ),
    # "Example Commands" (README since October 2024)
    (
        "python main.py --output_dir generated/ --output_name workload_1.%d.et "
        "--comm_group_file comm_group_1.json --dp 8 --tp 4 --pp 4 --sp 1 --weight_sharded 0 "
        "--chakra_schema_version v0.0.4",
        SMALL,
    ),
    (
        "python main.py --output_dir generated/ --output_name workload_2.%d.et "
        "--comm_group_file comm_group_2.json --dp 64 --tp 1 --pp 1 --sp 1 --weight_sharded 1 "
        "--chakra_schema_version v0.0.4",
        [],
    ),
    (
        "python main.py --output_dir generated/ --output_name workload_3.%d.json "
        "--comm_group_file comm_group_3.json --dp 4 --tp 4 --pp 2 --sp 2 --weight_sharded 1 "
        "--chakra_schema_version json",
        SMALL,
    ),
    # the same, as the README wrote it before --mp was renamed --tp
    (
        "python main.py --output_dir generated/ --output_name workload_1.%d.et "
        "--comm_group_file comm_group_1.json --dp 8 --mp 4 --pp 4 --sp 1 --weight_sharded 0 "
        "--chakra_schema_version v0.0.4",
        SMALL,
    ),
    # every size spelled out, a Llama-7B-like model
    (
        "python main.py --output_dir generated/ --output_name workload.%d.et "
        "--comm_group_file comm_group.json --chakra_schema_version v0.0.4 --dp 2 --tp 2 --pp 2 "
        "--sp 1 --weight_sharded 0 --activation_recompute 0 --tpsp 1 --model_type llama "
        "--batch 64 --micro_batch 8 --dvocal 32000 --dmodel 4096 --dff 11008 --head 32 "
        "--kvhead 32 --num_stacks 32 --seq 4096",
        [],
    ),
]


def _args(line: str) -> list[str]:
    words = shlex.split(line.replace("\\\n", " "))
    assert words[:2] == ["python", "main.py"] or words[:2] == ["stg", "generate"], words
    return ["generate", *words[2:]]


def _value(args: list[str], name: str, default: str) -> str:
    names = {name, name.replace("_", "-")} | ({"--mp"} if name == "--tp" else set())
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a in names]
    return values[-1] if values else default


@pytest.mark.parametrize(("line", "extra"), ORIGINAL_LINES, ids=range(len(ORIGINAL_LINES)))
def test_original_readme_lines_run_unchanged(
    line: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = _args(line)
    result = runner.invoke(app, args + extra)
    assert result.exit_code == 0, result.output
    world = 1
    for axis in ("--dp", "--tp", "--pp", "--sp"):
        world *= int(_value(args, axis, "1"))
    pattern = _value(args, "--output_name", "")
    groups = _value(args, "--comm_group_file", "")
    written = sorted(p.name for p in (tmp_path / "generated").iterdir())
    assert written == sorted([pattern % r for r in range(world)] + [groups])
    members = json.loads((tmp_path / "generated" / groups).read_text())
    assert members and all(len(ranks) > 1 for ranks in members.values())
    first = (tmp_path / "generated" / (pattern % 0)).read_bytes()
    if _value(args, "--chakra_schema_version", "v0.0.4") == "json":
        assert json.loads(first)["workload_graph"]
    else:
        assert b"0.0.4" in first[:64]


def test_the_readme_shows_what_the_tests_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's drop-in example runs, and each original spelling it names is tested here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("**Drop-in for the original STG**") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    command = block.group(1).split("\nls ")[0]
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, _args(command))
    assert result.exit_code == 0, result.output
    listed = block.group(1).split("\nls generated")[1].split("#", 1)[1].split()
    written = sorted(p.name for p in (tmp_path / "generated").iterdir())
    assert listed[0] == "comm_group.json" and listed[0] in written and len(written) == 9
    tested = " ".join(line for line, _ in ORIGINAL_LINES) + " ".join(
        " ".join(args) for args, _ in SPELLINGS
    )
    named = {
        option
        for span in re.findall(r"`([^`]*)`", section[: section.index("## Concepts")])
        for option in re.findall(r"--[a-z_-]+", span)
    }
    assert {"--comm_group_file", "--mp", "--micro_batch", "--model_type"} <= named
    for option in named - {"--micro-batch"}:  # dashed spellings: test_cli_generate.py
        assert option in tested, option


SPELLINGS = [
    (["--model_type", "dense"], dict(model="gpt")),
    (["--model_type", "gpt"], dict(model="gpt")),
    (["--model_type", "llama"], dict(model="llama")),
    (["--model_type", "moe"], dict(model="moe")),
    (
        ["--model_type", "debug"],
        dict(model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=256,
             num_stacks=4),
    ),
    (["--model_type", "debug", "--num_stacks", "2"], dict(model="gpt", dmodel=256, num_stacks=2)),
    (["--micro_batch", "-1"], dict(micro_batch=None)),
    (["--zero", "3"], dict(weight_sharded=True, zero=0)),
    (["--mixed_precision", "1", "--print_gpu_vram", "0"], dict(mixed_precision=True)),
    (["--chakra_schema_version", "v0.0.1", "--ep", "1"], dict(format="chakra-v0.0.1")),
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), SPELLINGS, ids=[" ".join(a) for a, _ in SPELLINGS])
def test_original_spellings_generate(
    args: list[str], expected: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    small = [] if "debug" in args else ["--num_stacks", "2", "--seq", "256"]
    result = runner.invoke(app, ["generate", *small, *args, "--output_dir", "out", "--json"])
    assert result.exit_code == 0, result.output
    path = Path(json.loads(result.stdout)["rank_files"][0])
    from stg.trace.reader import read_metadata

    if "v0.0.1" in args:  # no metadata in that schema
        assert path.suffix == ".et" and expected == {"format": "chakra-v0.0.1"}
        return
    recorded = read_metadata(path)["attrs"]["options"]  # type: ignore[index]
    if isinstance(recorded, str):
        recorded = json.loads(recorded)
    for key, value in expected.items():
        assert recorded[key] == value, key


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_aliases_write_the_same_bytes(tmp_path: Path) -> None:
    whole = TINY[: TINY.index("--micro_batch")] + TINY[TINY.index("--micro_batch") + 2 :]
    pairs = [
        ([*TINY, "--model_type", "dense"], [*TINY, "--model", "gpt"]),
        ([*whole, "--micro_batch", "-1"], whole),
        ([*TINY, "--dp", "2", "--zero", "3"], [*TINY, "--dp", "2", "--weight_sharded", "true"]),
        ([*TINY, "--mp", "2"], [*TINY, "--tp", "2"]),
    ]
    for i, (alias, plain) in enumerate(pairs):
        a, b = tmp_path / f"a{i}", tmp_path / f"b{i}"
        for out, args in ((a, alias), (b, plain)):
            result = runner.invoke(app, ["generate", *args, "--output_dir", str(out)])
            assert result.exit_code == 0, result.output
        assert _files(a) == _files(b), alias
    assert GenerateOptions(micro_batch=-1) == GenerateOptions()
    assert GenerateOptions(zero=3) == GenerateOptions(weight_sharded=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro_batch", "0"], "error: micro_batch=0 is not allowed; allowed: a positive "
         "divisor of batch=8, or -1 (the whole batch)"),
        (["--micro_batch", "-3"], "error: micro_batch=-3 is not allowed; allowed: a positive "
         "divisor of batch=8, or -1 (the whole batch)"),
        (["--zero", "3", "--weight_sharded", "false"], "error: zero=3 means "
         "weight_sharded=true, but weight_sharded=false was given; give one of them"),
        (["--zero", "4"], "error: zero=4 is not allowed; allowed: 0, 1, 2, 3 "
         "(3 = weight_sharded=true)"),
        (["--tpsp", "maybe"], "error: Invalid value for '--tpsp': 'maybe' is not a boolean; "
         "allowed: true, t, yes, y, 1, false, f, no, n, 0 (any case) (see 'stg generate --help')"),
        (["--comm_group_file", "sub/groups.json"], "error: comm_group_file='sub/groups.json' "
         "is not allowed; allowed: a file name without directories (it is written into "
         "output_dir)"),
        (["--comm_group_file", "workload.0.et"], "error: comm_group_file='workload.0.et' is "
         "the name of a rank file; allowed: any other file name"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_and_write_nothing(
    args: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "never"
    result = runner.invoke(app, ["generate", *TINY, *args, "--output_dir", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr == message + "\n"
    assert result.stdout == "" and not out.exists()


@pytest.mark.parametrize("words", [("yes", "no"), ("t", "f"), ("Y", "N"), ("1", "0")])
def test_every_listed_boolean_word_is_accepted(words: tuple[str, str], tmp_path: Path) -> None:
    for word in words:
        result = runner.invoke(
            app, ["generate", *TINY, "--tpsp", word, "--output_dir", str(tmp_path / word)]
        )
        assert result.exit_code == 0, result.output


# -- --help --------------------------------------------------------------------------------------


def _help(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _row(text: str, option: str) -> str:
    rows = [line for line in text.splitlines() if re.search(rf"[│ ,]{option}[ ,]", line)]
    assert rows, option
    return rows[0]


def test_help_shows_flags_without_a_value() -> None:
    pages = {"stg": _help()}
    for name in builtin_command_names():
        text = _help(name)
        if "Commands" in text:  # a group: the help of each of its commands
            for sub in ("list", "precision", "trace", "model"):
                if re.search(rf"│ {sub} ", text):
                    pages[f"{name} {sub}"] = _help(name, sub)
        else:
            pages[name] = text
    assert {"generate", "validate", "predict", "plan precision", "plugins list"} <= set(pages)
    for page, text in pages.items():
        assert "<bool>" not in text, page
        assert _row(text, "--help").split("--help")[1].split()[:2] == ["-h", "Show"], page
    generate = pages["generate"]
    for flag in ("--json", "--predict"):
        assert "<bool>" not in _row(generate, flag)
    # the original STG's booleans take a value and say which
    for option in ("--tpsp", "--weight_sharded", "--mixed_precision", "--print_gpu_vram"):
        assert "true|false" in _row(generate, option), option
    zero = _row(generate, "--zero")
    assert "0|1|2|3" in zero and "3 is --weight_sharded true" in zero
    assert "-1 for the whole batch" in _row(generate, "--micro_batch")
    assert "--mp" in _row(generate, "--tp")
    assert "--json" in pages["plan precision"] and "<bool>" not in pages["plan precision"]


# -- warnings and hints ---------------------------------------------------------------------------


def test_a_plan_naming_an_unknown_op_warns(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ops": {"fc1": "int8", "fc3": "int8", "attn_*": "fp8"}}))
    result = runner.invoke(
        app, ["generate", *TINY, "--precision_plan", str(plan), "--output_dir", str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: precision plan: op 'fc3' matches no op of model 'gpt' and is ignored; known "
        "ops: attn_out, context, fc1, fc2, k, logits, q, scores, v"
    ]
    plan.write_text(json.dumps({"ops": {"fc*": "int8"}}))
    result = runner.invoke(
        app, ["predict", *TINY, "--precision_plan", str(plan), "--predictor", "memory"]
    )
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr


def test_plan_precision_names_the_plugin_that_would_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    args = ["plan", "precision", *TINY, "--out", str(tmp_path / "plan.json")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    hints = [line for line in result.stderr.splitlines() if line.startswith("hint:")]
    assert len(hints) == 1 and "hint:" not in result.stdout
    for words in ("no kernel plugin runs fp8/int8 on a100-80g", "plugins/stg-int8-kernels",
                  "pip install -e plugins/stg-int8-kernels", "stg_register_kernels"):  # fmt: skip
        assert words in hints[0], words
    # no plan fits: the same advice on the one error line
    result = runner.invoke(app, [*args, "--memory-budget", "1KiB"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "pip install -e plugins/stg-int8-kernels" in (
        result.stderr
    )
    # with the example plugin loaded (int8 on a100-80g) there is nothing to advise
    result = runner.invoke(app, ["-p", "stg_int8_kernels", *args])
    assert result.exit_code == 0, result.output
    assert "hint:" not in result.stderr


# -- tables at 80 columns -------------------------------------------------------------------------


def test_memory_tables_never_cut_numbers_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
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
    assert "…" not in out
    rows = [line for line in out.splitlines() if "1024" in line]
    assert len(rows) == 2 and all(line.count("12345.67") == 6 for line in rows), out
    for header in ("gradients", "optimizer", "activations", "buffers"):
        assert header in out
    # and the summary of stg generate --predict, on an 80-column stderr
    result = runner.invoke(
        app,
        ["generate", *TINY, "--output_dir", str(tmp_path / "o"), "--predict", "--print_gpu_vram",
         "true"],
        env={"COLUMNS": "80"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "…" not in result.stderr and "…" not in result.stdout
    assert re.search(r"predicted peak memory per GPU +│ +[0-9.]+ [KMG]iB \([0-9,]+ B\) │",
                     result.stderr)  # fmt: skip


# -- scriptable output ----------------------------------------------------------------------------


def test_json_summary_is_all_of_stdout(tmp_path: Path) -> None:
    out = tmp_path / "o"
    args = ["generate", *TINY, "--tp", "2", "--output_dir", str(out)]
    result = runner.invoke(app, [*args, "--json", "--comm_group_file", "groups.json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert result.stderr == ""
    assert data["ranks"] == 2 and data["nodes"]["COMP"] > 0 and data["flops"] > 0
    assert data["output_dir"] == str(out)
    assert data["rank_files"] == [str(out / "workload.0.et"), str(out / "workload.1.et")]
    assert data["comm_group_file"] == str(out / "groups.json")
    assert data["bytes_written"] == sum(p.stat().st_size for p in out.iterdir())
    assert data["astra_sim"]["arguments"] == [
        f"--workload-configuration={out / 'workload'}",
        f"--comm-group-configuration={out / 'groups.json'}",
    ]
    assert "predictions" not in data
    # --predict and --print_gpu_vram go into the JSON too, not as tables on stdout
    result = runner.invoke(app, [*args, "--json", "--predict", "--print_gpu_vram", "true"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["predictions"]) == {"time", "memory"}
    result = runner.invoke(app, [*args, "--json", "--print_gpu_vram", "true"])
    assert set(json.loads(result.stdout)["predictions"]) == {"memory"}


def test_human_summary_ends_with_astra_sim_arguments(tmp_path: Path) -> None:
    out = tmp_path / "o"
    result = runner.invoke(
        app,
        ["generate", *TINY, "--tp", "2", "--output_dir", str(out), "--output_name", "llm.%d.et"],
        env={"COLUMNS": "60"},
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines[-2] == "ASTRA-sim arguments:"
    assert lines[-1] == (
        f"--workload-configuration={out / 'llm'} --comm-group-configuration={out / 'llm.json'}"
    )
    # ASTRA-sim opens <prefix>.<rank>.et: the prefix and the rank files agree
    prefix = lines[-1].split()[0].split("=", 1)[1]
    for rank in range(2):
        assert Path(f"{prefix}.{rank}.et").is_file()
    # files ASTRA-sim cannot read: the summary says why instead
    for extra, words in (
        (["--format", "json"], "ASTRA-sim reads chakra-v0.0.4 traces, not json"),
        (["--output_name", "rank%d.et"], "ASTRA-sim opens <prefix>.<rank>.et"),
    ):
        result = runner.invoke(
            app, ["generate", *TINY, *extra, "--output_dir", str(tmp_path / "x")]
        )
        assert result.exit_code == 0, result.output
        assert words in result.stderr and "--workload-configuration" not in result.stderr


# -- progress -------------------------------------------------------------------------------------


def test_progress_covers_building_and_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stg.cli.generate as generate_module

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(generate_module, "err_console", lambda: console)
    result = runner.invoke(
        app, ["generate", *TINY, "--dp", "2", "--pp", "2", "--output_dir", str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.output
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert re.search(r"building +━+ \d+/\d+", shown)
    assert re.search(r"writing rank files ━+ 4/4", shown)
    assert "lowering" not in shown


def test_write_workload_reports_each_rank_file(tmp_path: Path) -> None:
    from stg.core.pipeline import build_workload
    from stg.host.registry import load_registry
    from stg.trace.writer import WRITING, write_workload

    registry = load_registry(autoload=False)
    options = GenerateOptions(dvocal=128, dmodel=64, dff=128, head=4, kvhead=2, seq=32,
                              batch=8, micro_batch=4, num_stacks=2, dp=2, tp=2)  # fmt: skip
    workload = build_workload(options, registry)
    calls: list[tuple[str, int, int]] = []
    for name in ("chakra-v0.0.4", "json"):
        calls.clear()
        emitter = registry.emitters.get(name)
        write_workload(workload, emitter, tmp_path / name, "w", progress=lambda *a: calls.append(a))
        assert calls[0] == (WRITING, 0, 4) and calls[-1] == (WRITING, 4, 4)
        assert [(WRITING, n, 4) for n in range(1, 5)] == sorted(set(calls[1:]))
    assert WRITING == "writing rank files"
