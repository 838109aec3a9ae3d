"""Presets as data: the built-in presets read from models/preset_data/*.toml, unchanged from
when they were code, and a plugin's presets read from its own file by ``load_presets``."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

import pytest

import stg
from stg.api import load_presets
from stg.core.options import resolve_model
from stg.host.presetfile import source_parts
from stg.host.records import MODEL_OPTIONS, RecordError
from stg.host.registry import load_registry
from stg.models.presets import FAMILIES, builtin_presets
from stg.testing import check_preset, make_registry

REGISTRY = load_registry(autoload=False)
BEFORE = json.loads(
    (Path(__file__).parent / "data" / "presets" / "before_data.json").read_text(encoding="utf-8")
)["presets"]
FIELDS = ("name", "model", "dims", "source", "description", "aliases", "published_parameters",
          "published_active_parameters", "tied_embeddings", "vocab_divisible_by")  # fmt: skip


def _record(preset: stg.api.Preset) -> dict:
    value = {field: getattr(preset, field) for field in FIELDS}
    return json.loads(json.dumps({**value, "dims": dict(preset.dims), "aliases": preset.aliases}))


CHANGED_SINCE = {
    name: {"tie_embeddings": True}
    for name in ("gpt3-175b", "gpt-1.7b", "gpt-3.6b", "gpt-7.5b", "gpt-18.4b", "gpt-39.1b",
                 "gpt-76.1b", "gpt-145.6b", "gpt-310.1b", "gpt-529.6b", "gpt-1008b")
}  # fmt: skip
"""Dimensions set on purpose since the presets were code (their sources cite them): GPT-3's
and Megatron-LM's GPTs tie the LM head to the word embedding."""


def test_every_preset_of_the_code_is_unchanged_in_the_data() -> None:
    """Each of the 29 presets that models/presets.py held as code: the same record, in the
    same order, and the same options resolved from it at tp 1 and tp 8 (so the same traces),
    less the dimensions set since (:data:`CHANGED_SINCE`)."""
    names = [entry.name for entry in REGISTRY.presets]
    before = [p["name"] for p in BEFORE]
    assert [n for n in names if n in before] == before
    for old in BEFORE:
        record = _record(REGISTRY.presets.get(old["name"]))
        since = CHANGED_SINCE.get(old["name"], {})
        expected = {field: old[field] for field in FIELDS}
        expected["dims"] = {**old["dims"], **since}
        if since:  # the source names what was set since
            assert record.pop("source").startswith(expected.pop("source")), old["name"]
        assert record == expected, old["name"]
        for tp, resolved in old["resolved"].items():
            values, use = resolve_model({"model": old["name"], "tp": int(tp)}, REGISTRY)
            assert use is not None
            # bookkeeping, not an option: which model options the preset filled
            filled = values.pop("preset_fills", ())
            assert set(filled) <= set(MODEL_OPTIONS) & set(values), old["name"]
            assert json.loads(json.dumps(values)) == {**resolved["values"], **since}, (
                old["name"],
                tp,
            )
            assert json.loads(json.dumps(use.as_dict()["padded"])) == resolved["padded"]


def test_the_data_folder_holds_the_families_and_nothing_else() -> None:
    folder = files("stg.models") / "preset_data"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{f}.toml" for f in FAMILIES)
    assert [p.name for p in builtin_presets()] == [e.name for e in REGISTRY.presets]


NEW_FAMILY = """
[[preset]]
name = "tiny-llama"
model = "llama"
description = "a tiny Llama"
aliases = ["tl"]
published_parameters = {published}

[preset.source]
dims = "Doe et al. 2026, Table 2"
published_parameters = "Doe et al. 2026, Table 3"

[preset.dims]
dvocal = 64
dmodel = 32
dff = 64
head = 4
kvhead = 2
seq = 16
num_stacks = 2
"""
# embedding and LM head, final norm, 2 layers: Q and O (4 heads of 8), K and V (2), SwiGLU, norms
TINY = 2 * 64 * 32 + 32 + 2 * (2 * 32 * 4 * 8 + 2 * 32 * 2 * 8 + 3 * 32 * 64 + 2 * 32)


def _file_plugin(path: Path, name: str = "file_presets") -> SimpleNamespace:
    """A plugin that ships its presets as a TOML file."""

    @stg.hookimpl
    def stg_register_presets(register):
        for preset in load_presets(path):
            register(preset)

    return SimpleNamespace(__name__=name, stg_register_presets=stg_register_presets)


def test_a_plugin_registers_the_presets_of_its_file(tmp_path: Path) -> None:
    path = tmp_path / "presets.toml"
    path.write_text(NEW_FAMILY.format(published=TINY), encoding="utf-8")
    registry = make_registry(_file_plugin(path))
    info = next(p for p in registry.plugins if p.name == "file_presets")
    assert info.registered == {"presets": ("tiny-llama",)}
    record = registry.presets.get("tl")
    assert record.source == (
        "dims: Doe et al. 2026, Table 2; published_parameters: Doe et al. 2026, Table 3"
    )
    assert check_preset("tiny-llama", registry, tolerance=0.0, tp=2)["parameters"] == TINY
    values, _ = resolve_model({"model": "tiny-llama", "seq": 8}, registry)
    assert values == {"model": "llama", "seq": 8, "dvocal": 64, "dmodel": 32, "dff": 64,
                      "head": 4, "kvhead": 2, "num_stacks": 2}  # fmt: skip


def test_a_package_resource_loads_like_a_path() -> None:
    resource = files("stg.models") / "preset_data" / "mixtral.toml"
    by_resource = load_presets(resource)
    assert by_resource == load_presets(Path(str(resource)))
    assert [p.name for p in by_resource] == ["mixtral-8x7b", "mixtral-8x22b"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[preset]\n", r"not valid TOML: "),
        ("title = 'x'\n", r"unknown top-level key 'title'; allowed: \[\[preset\]\] tables"),
        ("preset = 3\n", r"'preset' must be \[\[preset\]\] tables"),
        (
            NEW_FAMILY.replace('aliases = ["tl"]', 'size = "7b"'),
            r"preset 'tiny-llama'.*: "
            r"unknown key 'size'; allowed: name, model, dims, source, description",
        ),
        (
            NEW_FAMILY.replace('aliases = ["tl"]', 'aliases = "tl"'),
            r"aliases must be a list of names",
        ),
        (
            NEW_FAMILY.replace('aliases = ["tl"]', 'tied_embeddings = "yes"'),
            r"tied_embeddings must be true or false",
        ),
        (NEW_FAMILY.replace("dims = ", "dmodell = "), r"source of 'dmodell': not a preset value"),
        (
            NEW_FAMILY.replace('dims = "Doe et al. 2026, Table 2"', 'dims = ""'),
            r"source of 'dims' must be a citation",
        ),
        (NEW_FAMILY.replace("[preset.source]", "[preset.sourcex]"), r"unknown key 'sourcex'"),
        (
            NEW_FAMILY.replace("dmodel = 32", "dmodel = 32.5"),
            r"preset 'tiny-llama': dmodel=32.5 must be a positive integer",
        ),
        (
            NEW_FAMILY.replace("dmodel = 32", "dmodel = 32\ncausal = 1"),
            r"preset 'tiny-llama': causal=1 must be true or false",
        ),
        (
            NEW_FAMILY.replace("dmodel = 32", "dmodel = 32\nattention_sinks = 1"),
            r"preset 'tiny-llama': attention_sinks=1 must be true or false",
        ),
        ("[[preset]]\nname = 'p'\nmodel = 'llama'\nsource = 's'\n", r"'dims' is missing"),
    ],
)
def test_a_malformed_file_names_itself_and_the_problem(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text.format(published=TINY), encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^preset file {path}.*{message}"):
        load_presets(path)


def test_a_malformed_file_fails_its_plugin_only(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[[preset]\n", encoding="utf-8")
    registry = load_registry(autoload=False, plugins=[_file_plugin(path, "bad_file")])
    (failure,) = registry.failures
    assert failure.name == "bad_file" and f"preset file {path}: not valid TOML" in failure.error
    assert "llama3-8b" in registry.presets
    missing = tmp_path / "none.toml"
    with pytest.raises(RecordError, match=rf"^preset file {missing}: cannot read it: "):
        load_presets(missing)


def test_source_parts_are_the_values_of_a_source_table() -> None:
    kimi = REGISTRY.presets.get("kimi-k2").source
    assert [value for value, _ in source_parts(kimi)] == [
        "dims", "seq", "published_parameters", "published_active_parameters"
    ]  # fmt: skip
    assert source_parts(kimi)[-1] == (
        "published_active_parameters",
        "the same table: 32B activated",
    )
    v31 = dict(source_parts(REGISTRY.presets.get("deepseek-v3.1").source))
    assert v31["dims"].endswith("; the multi-token prediction module is not built")
    llama = REGISTRY.presets.get("llama3-8b").source  # one citation, "; " inside it
    assert source_parts(llama) == [(None, llama)]
