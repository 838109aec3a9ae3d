"""``stg serve`` and ``stg search``: bad input refused in one line (exit 2) before any work,
and the exit status of a search that finds nothing the same with ``--json``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from stg.cli import app

SERVE = ["serve", "--model", "debug", "--rate", "2", "--duration", "3"]
TRAINING = ["search", "--gpus", "4", "--model", "debug", "--batch", "16"]
DECODE = ["search", "--gpus", "4", "--model", "debug", "--phase", "decode", "--max-tpot", "50ms"]
CAPACITY = [
    *["search", "--gpus", "2", "--model", "debug", "--phase", "serve"],
    *["--rate", "2", "--duration", "3", "--max-ttft", "p99:2s"],
]
SEARCH = ["search", "--gpus", "4", "--model", "debug"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # a negative seed (numpy refuses it)
        ([*SERVE, "--seed", "-1"], "error: --seed -1: must be a non-negative integer"),
        (
            [*SERVE, "--trace", "t.csv", "--seed", "-1"],
            "error: --seed -1: must be a non-negative integer",
        ),
        ([*CAPACITY, "--seed", "-1"], "error: --seed -1: must be a non-negative integer"),
        # output files in a folder that does not exist, or two tables in one file
        (
            [*SERVE, "--requests-table", "nodir/r.csv"],
            "error: --requests-table nodir/r.csv: directory 'nodir' does not exist",
        ),
        (
            [*SERVE, "--timeline", "nodir/t.csv"],
            "error: --timeline nodir/t.csv: directory 'nodir' does not exist",
        ),
        (
            [*SERVE, "--plot", "nodir/p.html"],
            "error: --plot nodir/p.html: directory 'nodir' does not exist",
        ),
        (
            [*SERVE, "--requests-table", "x.csv", "--timeline", "./x.csv"],
            "error: --requests-table x.csv --timeline ./x.csv: both name the same file",
        ),
        # a degree of 0 on every search path
        ([*TRAINING, "--tp", "0"], "error: --tp 0: must be a positive integer"),
        ([*TRAINING, "--pp", "0"], "error: --pp 0: must be a positive integer"),
        ([*TRAINING, "--cp", "0"], "error: --cp 0: must be a positive integer"),
        ([*TRAINING, "--ep", "-1"], "error: --ep -1: must be a positive integer"),
        ([*TRAINING, "--micro-batch", "0"], "error: --micro-batch 0: must be a positive integer"),
        (
            [*TRAINING, "--virtual-stages", "2,0"],
            "error: --virtual-stages 2,0: every value must be a positive integer",
        ),
        (
            [*TRAINING, "--recompute-layers", "0"],
            "error: --recompute-layers 0: must be a positive integer",
        ),
        ([*DECODE, "--ep", "0"], "error: --ep 0: must be a positive integer"),
        ([*DECODE, "--tp", "0"], "error: --tp 0: must be a positive integer"),
        ([*DECODE, "--pp", "0"], "error: --pp 0: must be a positive integer"),
        ([*CAPACITY, "--tp", "0"], "error: --tp 0: --tp and --max-num-batched-tokens take"),
        ([*CAPACITY, "--pp", "0"], "error: --pp 0: --pp and --ep take positive integers"),
        # --swap-bandwidth out of range, with or without swapping
        ([*SERVE, "--swap-bandwidth", "0"], "error: --swap-bandwidth 0: must be a positive"),
        ([*SERVE, "--swap-bandwidth", "-1"], "error: --swap-bandwidth -1: must be a positive"),
        (
            [*SERVE, "--preemption", "swap", "--swap-bandwidth", "0"],
            "error: --swap-bandwidth 0: must be a positive number (GB/s)",
        ),
        (
            [*SERVE, "--preemption", "swap", "--swap-bandwidth", "-1"],
            "error: --swap-bandwidth -1: must be a positive number (GB/s)",
        ),
        # sizes no plan makes valid, refused before the search
        ([*SEARCH, "--batch", "0"], "error: batch=0 must be a positive integer"),
        ([*SEARCH, "--seq", "0"], "error: seq=0 must be a positive integer"),
        ([*SEARCH, "--num_stacks", "0"], "error: num_stacks=0 must be a positive integer"),
        (
            [*SEARCH, "--phase", "decode", "--context", "0"],
            "error: context=0 must be a positive integer",
        ),
        (
            [*SEARCH, "--phase", "decode", "--context", "-1"],
            "error: context=-1 must be a positive integer",
        ),
        (
            [*SEARCH, "--phase", "mixed"],
            "error: phase=mixed batches prompts being prefilled with the decoding requests: "
            "give --prefill_batch",
        ),
        # the option itself named; an unknown phase first; a draft without speculation
        (
            [*SERVE, "--max-num-batched-tokens", "0"],
            "error: --max-num-batched-tokens 0: must be a positive integer",
        ),
        (
            [*SEARCH, "--phase", "bogus", "-j", "2"],
            "error: --phase 'bogus' is not allowed; allowed: training, prefill, decode, mixed, "
            "serve",
        ),
        (
            [*SERVE, "--draft", "llama3-8b"],
            "error: --draft llama3-8b: the draft model of speculative decoding; give "
            "--speculative N",
        ),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.csv").write_text("arrival,prompt,output\n0.0,16,4\n", encoding="utf-8")
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


def test_goodput_without_slos_says_so() -> None:
    result = invoke(*SERVE)
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("goodput")]
    assert "None" not in line
    assert line.endswith("(100.0% within the SLOs: none given)")


@pytest.mark.parametrize(
    "args",
    [
        [*DECODE[:-1], "1us"],  # no plan meets the limit
        ["search", "--gpus", "1", "--model", "llama3-70b", "--batch", "1", "-j", "1"],  # memory
        [*CAPACITY[:-1], "p99:1us", "-j", "1"],  # no layout meets the limits
    ],
)
def test_json_exits_as_the_text_does(args) -> None:
    text = invoke(*args)
    assert text.exit_code == 1, text.output
    result = invoke(*args, "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["best"] == []
