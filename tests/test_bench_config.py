"""PARAM's compute-benchmark config format as stg.bench.config reads it (no torch needed).

Conformance: configs equivalent to PARAM's shipped examples (written here, not copied) must
expand to exactly the ids and materialized configs that PARAM itself wrote when it ran them
(../shared/data/param, genuine PARAM output); the macro examples of PARAM's
development.md expand as documented there; mistakes give one line naming where.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stg.bench.config import Case, ConfigError, expand, load_config

PARAM = Path(__file__).resolve().parents[2] / "shared" / "data" / "param"
GEN = "PyTorch:DefaultDataGenerator"


def _param_cases(name: str) -> list[tuple[str, str, dict[str, Any]]]:
    lines = [json.loads(x) for x in (PARAM / name).read_text().splitlines() if x.strip()]
    return [(x["op_name"], x["id"], x["config"]) for x in lines if "op_name" in x]


def _ours(config: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    expansion = expand(config)
    assert expansion.errors == []
    return [(c.op_name, c.id, c.config) for c in expansion.cases]


def _t(dtype: str, shape: list[Any], **extra: Any) -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "shape": shape, **extra}


def _int(value: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "int", "value": value, **extra}


# -- conformance with PARAM's own output -------------------------------------------------------


def test_range_and_copy_macros_expand_as_param_ran_them() -> None:
    """A baddbmm whose batch, m, k and n are ranges tied by __copy__, and a bmm with two
    ranged arg-sets: 64 + 6 cases, in PARAM's order with PARAM's ids."""
    rng = {"__range__": ["shape"]}
    config = {
        "torch.baddbmm": {
            "input_iterator": "RangeConfigIterator",
            "input_data_generator": GEN,
            "config": [
                {
                    "input": [
                        {
                            "args": [
                                _t("float", [[1, 2, 1], -1, -1], **rng,
                                   __copy__=[{"shape": [1, [1, 1]]}, {"shape": [2, [2, 2]]}]),
                                _t("float", [-1, [512, 513, 1], [515, 518, 1]], **rng,
                                   __copy__=[{"shape": [0, [0, 0]]}]),
                                _t("float", [-1, -1, [512, 515, 1]], **rng,
                                   __copy__=[{"shape": [0, [0, 0]]}, {"shape": [1, [1, 2]]}]),
                            ],
                            "kwargs": {"beta": _int(1), "alpha": _int(1)},
                        }
                    ]
                }
            ],
        },
        "torch.bmm": {
            "input_iterator": "RangeConfigIterator",
            "input_data_generator": GEN,
            "config": [
                {
                    "input": [
                        {"args": [_t("float", [512, [512, 514, 1], 30], **rng),
                                  _t("float", [512, 30, 64])]},
                        {"args": [_t("float", [512, 64, 30]),
                                  _t("float", [512, 30, [128, 130, 1]], **rng)]},
                    ]
                }
            ],
        },
    }  # fmt: skip
    expected = _param_cases("h100-param_mm_range.jsonl")
    assert len(expected) == 70
    assert _ours(config) == expected


def test_int_value_ranges_expand_as_param_ran_them() -> None:
    rng = {"__range__": ["value"]}
    config = {
        "torch.add": {
            "input_iterator": "RangeConfigIterator",
            "input_data_generator": GEN,
            "config": [
                {"input": [{"args": [_t("float", [128, 256]), _int([1, 10, 1], **rng)]},
                           {"args": [_t("float", [256, 256]), _int([10, 20, 2], **rng)]}]},
                {"input": [{"args": [_t("float", [64, 256]), _int([30, 40, 1], **rng)]},
                           {"args": [_t("float", [64, 256]), _int([40, 50, 2], **rng)]}]},
            ],
        }
    }  # fmt: skip
    expected = _param_cases("h100-param_simple_add_range.jsonl")
    assert len(expected) == 33
    assert _ours(config) == expected


def test_plain_configs_keep_their_arg_sets_and_ids() -> None:
    """Without macros (DefaultConfigIterator) each input arg-set runs as written: the
    llama2 GEMMs, one config item each, ids <item>|0|0."""
    expected = _param_cases("h100-param_llama2.jsonl")
    config = {
        "torch.mm": {
            "input_data_generator": GEN,
            "config": [{"input": [c["input"]]} for _, _, c in expected],
        }
    }
    assert _ours(config) == expected


def test_schema_builds_of_aten_ops_as_param_ran_them() -> None:
    """aten ops built from their schema, an in-place one with requires_grad false."""
    expected = _param_cases("h100-param_aten_ops.jsonl")
    config = {
        op: {
            "build_data_generator": GEN,
            "input_data_generator": GEN,
            "config": [{"build": [c["build"]], "input": [c["input"]]}],
        }
        for op, _, c in expected
    }
    assert _ours(config) == expected


# -- PARAM's documented macro examples (development.md) ----------------------------------------


def _single(args: list[Any], ranged: bool = True) -> list[dict[str, Any]]:
    info: dict[str, Any] = {"input_data_generator": GEN, "config": [{"input": [{"args": args}]}]}
    if ranged:
        info["input_iterator"] = "RangeConfigIterator"
    cases = expand({"torch.op": info}).cases
    assert all(c.error is None for c in cases), [c.error for c in cases]
    return [c.input for c in cases]  # type: ignore[misc]


def test_documented_shape_range() -> None:
    inputs = _single([_t("float", [512, [512, 514, 1], 30], __range__=["shape"])])
    assert [i["args"][0]["shape"] for i in inputs] == [[512, 512, 30], [512, 513, 30],
                                                       [512, 514, 30]]  # fmt: skip
    assert all("__range__" not in i["args"][0] for i in inputs)


def test_documented_bool_list_range() -> None:
    inputs = _single([{"type": "bool", "value": [True, False], "__range__": ["value"]}])
    assert [i["args"][0]["value"] for i in inputs] == [True, False]


def test_documented_copy() -> None:
    inputs = _single(
        [_t("float", [-1, 64, 128], __copy__=[{"shape": [0, [1, 2]]}]), _t("float", [8, 16, 32])]
    )
    assert [i["args"][0]["shape"] for i in inputs] == [[32, 64, 128]]


def test_dtype_lists_cross_independently_as_in_param() -> None:
    """Every ranged attribute is crossed with every other (PARAM.md's caveat): two tensors
    with two dtypes each give four cases, (float, bfloat16) pairs included."""
    rng = {"__range__": ["dtype"]}
    inputs = _single([_t(["float", "bfloat16"], [4, 4], **rng),
                      _t(["float", "bfloat16"], [4, 4], **rng)])  # fmt: skip
    pairs = [(i["args"][0]["dtype"], i["args"][1]["dtype"]) for i in inputs]
    assert pairs == [("float", "float"), ("float", "bfloat16"), ("bfloat16", "float"),
                     ("bfloat16", "bfloat16")]  # fmt: skip


def test_kwarg_ranges_expand_after_the_args() -> None:
    inputs = _single([_int([1, 2, 1], __range__=["value"])], ranged=True)
    assert [i["args"][0]["value"] for i in inputs] == [1, 2]
    info = {
        "input_iterator": "RangeConfigIterator",
        "input_data_generator": GEN,
        "config": [{"input": [{"args": [_int([1, 2, 1], __range__=["value"])],
                               "kwargs": {"k": {"type": "str", "value": ["a", "b"],
                                                "__range__": ["value"]}}}]}],
    }  # fmt: skip
    cases = expand({"torch.op": info}).cases
    got = [(c.input["args"][0]["value"], c.input["kwargs"]["k"]["value"]) for c in cases]  # type: ignore[index]
    assert got == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert [c.id for c in cases] == ["0|0|0_0", "0|0|0_1", "0|0|0_2", "0|0|0_3"]


# -- run ids ------------------------------------------------------------------------------------


def test_build_ids_are_stable_across_build_entries() -> None:
    """PARAM accumulates the prefix over build entries (0|0|0, 0|0|1|0, ...); stg's ids
    name each build by its own index."""
    build = [
        {"args": [_int(4), _int(8)]},
        {"args": [_int(4), _int(16)]},
        {"args": [_int(4), _int(2)]},
    ]
    config = {
        "torch.nn.Linear": {
            "build_data_generator": GEN,
            "input_data_generator": GEN,
            "config": [
                {"build": build, "input": [{"args": [_t("float", [2, 4])]}]},
                {"build": build[:1], "input": [{"args": [_t("float", [3, 4])]}]},
            ],
        }
    }
    cases = expand(config).cases
    assert [c.id for c in cases] == ["0|0|0", "0|1|0", "0|2|0", "1|0|0"]
    assert [c.build["args"][1]["value"] for c in cases] == [8, 16, 2, 8]  # type: ignore[index]


def test_ranged_builds_get_variant_ids() -> None:
    config = {
        "torch.nn.Linear": {
            "build_iterator": "RangeConfigIterator",
            "build_data_generator": GEN,
            "input_data_generator": GEN,
            "config": [
                {
                    "build": [{"args": [_int(4), _int([8, 9, 1], __range__=["value"])]}],
                    "input": [{"args": [_t("float", [2, 4])]}],
                }
            ],
        }
    }
    assert [c.id for c in expand(config).cases] == ["0|0_0|0", "0|0_1|0"]


# -- mistakes -----------------------------------------------------------------------------------


def _errors(args: list[Any], ranged: bool = True) -> list[str]:
    info: dict[str, Any] = {"input_data_generator": GEN, "config": [{"input": [{"args": args}]}]}
    if ranged:
        info["input_iterator"] = "RangeConfigIterator"
    return [c.error for c in expand({"torch.op": info}).cases if c.error]


@pytest.mark.parametrize(
    ("args", "ranged", "message"),
    [
        ([_t("float", [[4, 2, 1]], __range__=["shape"])], True,
         "config[0].input[0].args[0].shape[0]: bad macro: range [4, 2, 1] needs min <= max and "
         "step > 0"),
        ([_t("float", [[1, 4]], __range__=["shape"])], True,
         "config[0].input[0].args[0].shape[0]: bad macro: a range must be [min, max, step] of "
         "integers"),
        ([{"type": "float", "value": [1.0, 2.0, 0.5], "__range__": ["value"]}], True,
         "config[0].input[0].args[0]: bad macro: __range__ names 'value'; float ranges are not "
         "supported (as in PARAM)"),
        ([_t("float", [4], __range__=["size"])], True,
         "config[0].input[0].args[0]: bad macro: __range__ names 'size', which the spec lacks"),
        ([_t("float", [-1], __copy__=[{"shape": [0, [3, 0]]}])], True,
         "config[0].input[0].__copy__: bad macro: copies from argument 3; the arg-set has 1"
         .replace("__copy__", "args[0].__copy__")),
        ([_t("float", [4, [1, 2, 1]], __range__=["shape"])], False,
         'config[0].input[0].args[0]: bad macro: __range__ needs "input_iterator": '
         '"RangeConfigIterator" (or "build_iterator" for a build)'),
        ([_t("float", [-1, 4])], False,
         "config[0].input[0].args[0]: shape [-1, 4] has -1 at index 0; sizes are integers >= 0 "
         "(a __copy__ target left unfilled?)"),
        ([{"type": "tensorr"}], False,
         "config[0].input[0].args[0]: unknown type 'tensorr'; allowed: int, long, float, double, "
         "bool, str, device, none, genericlist, tuple, tensor, dtype"),
        ([_t("complex", [2])], False,
         "config[0].input[0].args[0]: tensor dtype 'complex' is not known; allowed: float, "
         "double, float16, bfloat16, int, long, int8, uint8, int16, bool"),
    ],
)  # fmt: skip
def test_a_mistake_is_one_line_naming_where(args: list[Any], ranged: bool, message: str) -> None:
    assert _errors(args, ranged) == [message]


def test_a_bad_case_does_not_stop_the_others() -> None:
    config = {
        "torch.mm": {
            "input_data_generator": GEN,
            "config": [{"input": [{"args": [_t("float", [-1, 2])]},
                                  {"args": [_t("float", [2, 2]), _t("float", [2, 2])]}]}],
        },
        "torch.add": {"input_data_generator": GEN, "input_iterator": "Nope", "config": []},
        "torch.mul": {"input_data_generator": "Other:Gen", "config": []},
        "torch.bmm": {"input_data_generator": GEN, "config": [{"build": []}]},
    }  # fmt: skip
    cases = expand(config).cases
    assert [(c.op_name, c.id, c.error is None) for c in cases] == [
        ("torch.mm", "0|0|0", False),
        ("torch.mm", "0|0|1", True),
        ("torch.add", "-", False),
        ("torch.mul", "-", False),
        ("torch.bmm", "0", False),
    ]
    assert cases[2].error == (
        "input_iterator 'Nope' is not known; allowed: DefaultConfigIterator, RangeConfigIterator"
    )
    assert cases[4].error == 'config[0] needs "input": a non-empty list of arg-sets'


def test_operators_without_a_generator_are_skipped_as_param_skips_them() -> None:
    config = {
        "__meta__": {"note": "ignored"},
        "__stg__": [1, 2],
        "torch.mm": {"config": []},
        "torch.add": {"input_data_generator": GEN,
                      "config": [{"input": [{"args": [_t("float", [2])]}]}]},
    }  # fmt: skip
    expansion = expand(config)
    assert [c.run_id for c in expansion.cases] == ["torch.add|0|0|0"]
    assert expansion.warnings == ["torch.mm: no input_data_generator, skipped (as PARAM skips it)"]


def test_case_config_is_the_result_lines_config() -> None:
    case = Case("torch.mm", "0|0|0", None, {"args": []})
    assert case.config == {"build": None, "input": {"args": []}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ("[1]", "must be a JSON object of operator names, got list"),
    ],
)
def test_load_config_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config {str(path)!r} {message}"
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.json")
