"""Named presets: published configurations of the built-in models (``--model llama3-8b``).

The presets are data: one TOML file per family in ``preset_data/`` (read by
:func:`stg.api.load_presets`; docs/presets.md, "Presets as data"), each preset with the
dimensions of one model template and where they come from; the parameter counts it states
are the source's, and tests/test_presets.py checks the templates against them (within 1%,
total and, for mixtures of experts, per token; the figures further off, and why, are in
docs/presets.md). ``seq`` is the pre-training sequence length where the source states one,
else the context window. Explicit options override a preset's values
(``--model llama3-8b --seq 2048``).
"""

from __future__ import annotations

from importlib.resources import files

from stg.api import Preset, hookimpl, load_presets

FAMILIES = (
    "gpt", "llama", "llama4", "mixtral", "qwen3", "deepseek", "glm", "gpt-oss", "nemotron",
    "mpt", "bert", "roberta",
)  # fmt: skip
"""The families' files (``preset_data/<family>.toml``), in the order they register."""


def builtin_presets() -> tuple[Preset, ...]:
    """Every built-in preset, family by family in :data:`FAMILIES` order."""
    folder = files(__package__) / "preset_data"
    return tuple(p for family in FAMILIES for p in load_presets(folder / f"{family}.toml"))


@hookimpl
def stg_register_presets(register):  # type: ignore[no-untyped-def]
    for preset in builtin_presets():
        register(preset)
