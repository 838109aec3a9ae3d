"""stg.cli._shared.light_coercion decides only what typer's pydantic adapters decide alike."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.models import OptionInfo
from typer.testing import CliRunner

from stg.cli import app
from stg.cli._shared import UNDECIDED, coerce_values, handles

_coercion = pytest.importorskip("typer._coercion")  # typer >= 0.29 coerces through pydantic


def _parse_upper(value: str) -> str:
    if value == "bad":
        raise ValueError("no bad values")  # pydantic words it; the fallback must too
    if value == "refused":
        raise typer.BadParameter("refused here")
    return value.upper()


INFOS = {
    "plain": OptionInfo(),
    "min 1": OptionInfo(min=1),
    "between -2 and 5": OptionInfo(min=-2, max=5),
    "clamped": OptionInfo(min=0, max=3, clamp=True),
    "parser": OptionInfo(parser=_parse_upper),
}
ANNOTATIONS = [str, bool, int, float, list[str], list[int]]
VALUES = [
    "0", "-0", "+5", "007", "12", " 12", "12 ", "1_000", "1.0", "1.5", "-2.25", "1e3", "2E-3",
    "-1", "6", "9" * 18, "9" * 19, "0x10", "\u0663", "inf", "nan", "", "abc", "true", "bad",
    "refused", 0, 3, 7, -1, 2.5, 3.0, True, False, None, ["1", "2"], ("a", " 3"), ["x", "bad"],
]  # fmt: skip


def _typer_result(annotation: Any, info: OptionInfo, value: Any) -> tuple[str, Any]:
    """What typer's own runtime parameter (its pydantic adapter) gives: a value or an error."""
    descriptor = _coercion.resolve_type_descriptor(annotation, info)
    full = _coercion.build_runtime_param(descriptor)
    try:
        return "value", full._coerce_value(value, param=None, ctx=None)
    except Exception as exc:  # any error: typer refused it
        return "error", f"{type(exc).__name__}: {exc}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b and str(a) == str(b)  # -0.0 is not 0.0


@pytest.mark.parametrize("info_name", INFOS)
@pytest.mark.parametrize("annotation", ANNOTATIONS, ids=repr)
def test_every_value_decided_is_typers_result(annotation: Any, info_name: str) -> None:
    info = INFOS[info_name]
    assert handles(annotation, info)
    decided = 0
    for value in VALUES:
        try:
            ours = coerce_values(annotation, info, value)
        except Exception as exc:  # a parser's own error goes out as is
            assert _typer_result(annotation, info, value) == (
                "error",
                f"{type(exc).__name__}: {exc}",
            ), value
            continue
        if ours is UNDECIDED:
            continue
        decided += 1
        kind, theirs = _typer_result(annotation, info, value)
        assert kind == "value" and _same(ours, theirs), (value, ours, theirs)
    # the common values (a number, a word, a flag) are decided without pydantic; clamped
    # numbers always go to typer
    clamped_numbers = bool(info.clamp) and annotation in (int, float, list[int])
    assert decided >= 2 or clamped_numbers, (annotation, info_name)


def test_common_command_line_values_are_decided() -> None:
    info = OptionInfo()
    assert coerce_values(int, info, "12") == 12
    assert coerce_values(int, OptionInfo(min=1), "0") is UNDECIDED  # typer words the bound
    assert coerce_values(float, info, "0.5") == 0.5
    assert coerce_values(str, info, "a100-80g") == "a100-80g"
    assert coerce_values(list[str], info, ()) == []
    assert coerce_values(int, info, "\u0663") is UNDECIDED  # int() reads it, pydantic does not


@pytest.mark.parametrize(
    "info",
    [OptionInfo(), OptionInfo(exists=True, dir_okay=False), OptionInfo(file_okay=False)],
    ids=["plain", "an existing file", "a folder"],
)
def test_a_path_decided_is_typers_path_with_typers_checks(
    info: OptionInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file.et").write_text("")
    values = [
        "sub", "sub/file.et", "./sub", "sub/", "sub//file.et", "missing/x", "-", ".", "",
        str(tmp_path / "sub" / "file.et"), Path("sub"), 3,
    ]  # fmt: skip
    decided = 0
    for value in values:
        try:
            ours = coerce_values(Path, info, value)
        except Exception as exc:  # typer's own check of the path, as typer words it
            assert _typer_result(Path, info, value) == ("error", f"{type(exc).__name__}: {exc}")
            continue
        if ours is not UNDECIDED:
            decided += 1
            assert _typer_result(Path, info, value) == ("value", ours), value
            assert type(ours) is type(_typer_result(Path, info, value)[1])
    assert decided >= 1


def test_files_tuples_and_other_path_types_stay_with_typer() -> None:
    info = OptionInfo()
    assert handles(Path, info)
    assert not handles(Path, OptionInfo(path_type=str))
    assert not handles(tuple[int, int], info)
    assert handles(Path, OptionInfo(parser=Path))  # typer runs a parser before anything
    assert coerce_values(Path, info, "a//b") is UNDECIDED  # typer names it as given


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "abc"], "error: Invalid value for '--tp' / '--mp': Input should be a valid "
         "integer, unable to parse string as an integer (see 'stg predict --help')"),
        (["--max-nodes", "0"], "error: Invalid value for '--max-nodes' / '--max_nodes': Input "
         "should be greater than or equal to 1 (see 'stg predict --help')"),
        (["--tpsp", "maybe"], "error: Invalid value for '--tpsp': 'maybe' is not a boolean; "
         "allowed: true, t, yes, y, 1, false, f, no, n, 0 (any case) (see 'stg predict --help')"),
    ],
)  # fmt: skip
def test_refused_values_keep_typers_message(args: list[str], message: str) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["predict", "--predictor", "analytical", "--json", *args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message
