"""The plugin host: load order, provenance, isolation of broken plugins, the name-clash rule."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import stg
from stg.errors import UnknownNameError, UserError
from stg.host import registry as registry_module
from stg.host.deferred import DEFERRED_BUILTINS
from stg.host.records import Emitter, Kernel, Model, PipelineSchedule, Predictor
from stg.host.registry import (
    BUILTIN_DIST,
    AmbiguousNameError,
    Registry,
    builtin_module_names,
    load_registry,
)


def _write_nothing(workload: object, directory: Path, output_name: str) -> list[Path]:
    return []


def _emitter(name: str, **kw: object) -> Emitter:
    return Emitter(name=name, write=_write_nothing, extension=".x", **kw)  # type: ignore[arg-type]


class _Plugin:
    """A plugin object built from hook functions (pluggy accepts any object)."""

    def __init__(self, name: str, **hooks: object) -> None:
        self.__name__ = name
        for hook_name, fn in hooks.items():
            setattr(self, hook_name, stg.hookimpl(fn))


def _emitting(name: str, *emitters: Emitter) -> _Plugin:
    def stg_register_emitters(register):
        for emitter in emitters:
            register(emitter)

    return _Plugin(name, stg_register_emitters=stg_register_emitters)


def _load(*plugins: object, **kw: object) -> Registry:
    """A registry of just these plugin objects (no built-ins, no entry points)."""
    return load_registry(autoload=False, builtins=False, plugins=plugins, **kw)  # type: ignore[arg-type]


def test_builtins_load_first_through_the_plugin_path() -> None:
    registry = load_registry(autoload=False)
    builtin = [info for info in registry.plugins if info.source == "builtin"]
    assert registry.plugins[: len(builtin)] == builtin
    for info in builtin:
        assert info.dist == BUILTIN_DIST
        assert info.version == stg.__version__
        assert info.name in builtin_module_names()
    assert not [f for f in registry.failures if f.source == "builtin"]
    names = builtin_module_names()
    for package in ("stg.models.", "stg.emitters.", "stg.predictors."):
        mine = [n for n in names if n.startswith(package)]
        assert mine == sorted(mine)
    for entry in registry.emitters.entries():
        assert entry.source == "builtin"
        assert entry.plugin.startswith("stg.emitters.")


def test_entry_points_are_loaded_with_their_distribution(fake_dists: Path) -> None:
    registry = load_registry()
    fake = [info for info in registry.plugins if info.name.startswith("fake_")]
    assert [info.name for info in fake] == ["fake_clash", "fake_good"]  # sorted by name
    good = fake[1]
    assert (good.dist, good.version, good.source) == ("stg-fake-good", "1.0", "entry point")
    assert good.registered == {
        "kernels": ("fake-int8-gemm",),
        "emitters": ("fake-lines",),
        "commands": ("fake-hello",),
    }
    kernel = registry.kernels.lookup("fake-int8-gemm")
    assert isinstance(kernel.item, Kernel)
    assert (kernel.plugin, kernel.dist, kernel.version) == ("fake_good", "stg-fake-good", "1.0")
    assert registry.command_names() == ["fake-hello"]


def test_a_plugin_that_fails_to_import_is_recorded_and_the_rest_loads(fake_dists: Path) -> None:
    registry = load_registry()
    failures = {f.name: f for f in registry.failures}
    broken = failures["fake_broken"]
    assert (broken.dist, broken.version, broken.source) == ("stg-fake-broken", "1.0", "entry point")
    assert broken.error == "RuntimeError: stg_fake_broken cannot be imported (on purpose)"
    assert "fake_good" in [info.name for info in registry.plugins]


def test_a_wrong_record_type_is_a_load_error_attributed_to_its_plugin(fake_dists: Path) -> None:
    registry = load_registry()
    failure = next(f for f in registry.failures if f.name == "fake_wrongtype")
    assert (failure.dist, failure.version) == ("stg-fake-wrongtype", "0.3")
    assert failure.error == (
        "stg_register_models registered a Kernel named 'not-a-model'; "
        "expected a stg.host.records.Model"
    )
    assert "not-a-model" not in registry.models.names()
    assert "not-a-model" not in registry.kernels.names()


def test_name_clash_bare_name_lists_both_and_dist_name_selects(fake_dists: Path) -> None:
    registry = load_registry()
    with pytest.raises(AmbiguousNameError) as info:
        registry.emitters.get("fake-lines")
    message = str(info.value)
    assert "stg-fake-clash:fake-lines" in message
    assert "stg-fake-good:fake-lines" in message
    assert isinstance(info.value, UserError)
    assert registry.emitters.get("stg-fake-good:fake-lines").extension == ".jsonl"
    assert registry.emitters.get("stg-fake-clash:fake-lines").extension == ".lines"
    assert registry.emitters.get("stg_fake_good:fake-lines").extension == ".jsonl"  # normalized
    assert registry.emitters.get("fake_clash:fake-lines").extension == ".lines"  # plugin name
    # only stg-fake-good has the alias, so the alias is unambiguous
    assert registry.emitters.lookup("lines").dist == "stg-fake-good"
    assert registry.emitters.names().count("fake-lines") == 1


def test_autoload_can_be_disabled_by_environment(
    fake_dists: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = load_registry(["fake_cli_plugin"])
    sources = {info.source for info in registry.plugins}
    assert "entry point" not in sources
    assert not [f for f in registry.failures if f.source == "entry point"]
    assert {"builtin", "command line"} <= sources
    assert "entry point" in {i.source for i in load_registry(autoload=True).plugins}
    monkeypatch.setenv("STG_DISABLE_PLUGIN_AUTOLOAD", "0")
    assert "entry point" in {i.source for i in load_registry().plugins}


def test_command_line_modules_load_after_entry_points(fake_dists: Path) -> None:
    registry = load_registry(["fake_cli_plugin"])
    sources = [info.source for info in registry.plugins]
    assert sources == sorted(sources, key=["builtin", "entry point", "command line"].index)
    entry = registry.emitters.lookup("names")
    assert (entry.plugin, entry.source) == ("fake_cli_plugin", "command line")
    assert isinstance(registry.predictors.get("flops-count"), Predictor)


def test_a_command_line_module_of_an_installed_distribution_has_its_version(
    fake_dists: Path,
) -> None:
    registry = load_registry(["stg_fake_good"], autoload=False)
    info = registry.plugins[-1]
    assert (info.name, info.dist, info.version, info.source) == (
        "stg_fake_good",
        "stg-fake-good",
        "1.0",
        "command line",
    )


def test_a_missing_command_line_module_is_a_failure() -> None:
    registry = load_registry(["no_such_stg_plugin_module"], autoload=False, builtins=False)
    (failure,) = registry.failures
    assert failure.name == "no_such_stg_plugin_module"
    assert failure.source == "command line"
    assert failure.error == "ModuleNotFoundError: No module named 'no_such_stg_plugin_module'"


def test_unknown_name_lists_allowed_names() -> None:
    registry = _load(_emitting("p", _emitter("zeta")))
    with pytest.raises(UnknownNameError) as info:
        registry.emitters.get("nope")
    allowed = ", ".join(registry.emitters.names())
    assert str(info.value) == f"unknown emitter 'nope'; allowed: {allowed}"
    assert "zeta" in allowed
    assert "nope" not in registry.emitters
    assert "zeta" in registry.emitters


def test_a_hook_that_raises_discards_its_partial_registrations() -> None:
    def stg_register_emitters(register):
        register(_emitter("half-done"))
        raise KeyError("boom")

    def stg_register_kernels(register):
        register(Kernel(name="never-kept", op_class="einsum", dtype="fp8"))

    plugin = _Plugin(
        "halfway",
        stg_register_emitters=stg_register_emitters,
        stg_register_kernels=stg_register_kernels,
    )
    registry = _load(plugin, _emitting("ok", _emitter("fine")))
    assert "half-done" not in registry.emitters
    assert "never-kept" not in registry.kernels
    (failure,) = registry.failures
    assert failure.name == "halfway"
    assert failure.error.startswith("stg_register_")
    assert "fine" in registry.emitters
    assert "halfway" not in [info.name for info in registry.plugins]


def test_a_malformed_record_names_the_field() -> None:
    def stg_register_emitters(register):
        register(Emitter(name="bad", write=_write_nothing, extension="x"))

    registry = _load(_Plugin("malformed", stg_register_emitters=stg_register_emitters))
    (failure,) = registry.failures
    assert failure.name == "malformed"
    assert failure.error == (
        "stg_register_emitters: RecordError: emitter 'bad': extension must start with '.'"
    )


def test_registering_one_name_twice_in_a_plugin_is_an_error() -> None:
    registry = _load(_emitting("twice", _emitter("same"), _emitter("same")))
    assert [f.error for f in registry.failures] == [
        "stg_register_emitters registered emitter 'same' twice"
    ]


def test_unknown_hooks_and_bad_hook_arguments_are_errors() -> None:
    def stg_register_modles(register):  # misspelt
        pass

    def stg_register_models(reg):  # argument must be called register
        pass

    registry = _load(
        _Plugin("typo", stg_register_modles=stg_register_modles),
        _Plugin("badarg", stg_register_models=stg_register_models),
    )
    errors = {f.name: f.error for f in registry.failures}
    assert errors["typo"].startswith("unknown hook stg_register_modles; known hooks: ")
    assert errors["badarg"].startswith("PluginValidationError: ")
    assert "reg" in errors["badarg"]


def test_all_record_kinds_and_aliases_are_registered() -> None:
    def order(stage: int, stages: int, micro_batches: int, chunks: int) -> list:
        return [("F", m, 0) for m in range(micro_batches)] + [
            ("B", m, 0) for m in range(micro_batches)
        ]

    def noop(*args: object) -> None:
        return None

    plugin = _Plugin(
        "everything",
        stg_register_models=lambda register: register(
            Model(name="toy", embedding=noop, block=noop, head=noop, aliases=("toy-lm",))
        ),
        stg_register_parallelisms=lambda register: register(
            PipelineSchedule(name="toy-gpipe", order=order)
        ),
        stg_register_kernels=lambda register: register(
            Kernel(name="toy-kernel", op_class="einsum", dtype="int8", speedup=3.0)
        ),
        stg_register_emitters=lambda register: register(_emitter("toy-emitter", aliases=("te",))),
        stg_register_predictors=lambda register: register(
            Predictor(name="toy-predictor", predict=lambda workload, system: {})
        ),
    )
    registry = _load(plugin)
    assert not registry.failures
    assert registry.models.get("toy-lm") is registry.models.get("toy")
    assert registry.models.get("TOY").name == "toy"
    assert registry.schedules.get("toy-gpipe").order(0, 1, 2, 1)[0] == ("F", 0, 0)
    assert registry.kernels.get("toy-kernel").speedup == 3.0
    assert registry.emitters.get("te").name == "toy-emitter"
    assert registry.predictors.get("everything:toy-predictor").name == "toy-predictor"
    info = registry.plugins[-1]
    assert info.name == "everything"
    assert info.registered == {
        "models": ("toy",),
        "schedules": ("toy-gpipe",),
        "kernels": ("toy-kernel",),
        "emitters": ("toy-emitter",),
        "predictors": ("toy-predictor",),
    }


def test_the_same_plugin_object_is_registered_once() -> None:
    plugin = _emitting("once", _emitter("one"))
    registry = _load(plugin, plugin)
    assert [e.name for e in registry.emitters.entries()].count("one") == 1
    assert not registry.failures


def test_a_command_name_taken_by_the_cli_fails_the_plugin() -> None:
    def stg_register_commands(app):
        @app.command("generate")
        def generate() -> None:
            """Shadow the built-in."""

    registry = _load(
        _Plugin("shadow", stg_register_commands=stg_register_commands),
        reserved_commands=("generate",),
    )
    assert [f.error for f in registry.failures] == [
        "stg_register_commands: command 'generate' is already taken"
    ]
    assert registry.command_names() == []


def test_a_plugin_without_hooks_is_reported() -> None:
    registry = _load(_Plugin("empty"))
    assert [f.error for f in registry.failures] == ["defines no @stg.hookimpl hooks"]


def test_core_never_imports_the_cli() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("stg", "models", "emitters", "predictors"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.is_relative_to(root / "stg" / "cli") or path == root / "stg" / "__main__.py":
                continue  # the CLI itself, and `python -m stg` which runs it
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                if any(n == "stg.cli" or n.startswith("stg.cli.") for n in names):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize("module_name", sorted(DEFERRED_BUILTINS))
def test_the_deferred_table_lists_what_each_module_registers(module_name: str) -> None:
    module = importlib.import_module(module_name)
    registry = _load(module)
    (info,) = registry.plugins
    table = DEFERRED_BUILTINS[module_name]
    assert dict(info.registered) == {catalog: tuple(names) for catalog, names in table.items()}
    for catalog, names in table.items():
        for name, aliases in names.items():
            assert registry.catalog(catalog).lookup(name).aliases == aliases


def test_deferred_builtins_register_as_if_loaded_eagerly() -> None:
    deferred = load_registry(autoload=False)
    eager = _load(*(importlib.import_module(n) for n in builtin_module_names()))
    assert [info.name for info in deferred.plugins] == [info.name for info in eager.plugins]
    for catalog in ("models", "predictors", "emitters", "schedules", "presets"):
        names = [(e.name, e.plugin, e.aliases) for e in eager.catalog(catalog)]
        assert deferred.catalog(catalog).names() == eager.catalog(catalog).names()
        assert [(e.name, e.plugin, e.aliases) for e in deferred.catalog(catalog)] == names
        assert [e.item for e in deferred.catalog(catalog)] == [
            e.item for e in eager.catalog(catalog)
        ]


def test_a_deferred_module_loads_once_on_first_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    imports: list[str] = []
    real_import = registry_module._import
    monkeypatch.setattr(
        registry_module, "_import", lambda name, **kw: imports.append(name) or real_import(name)
    )
    registry = load_registry(autoload=False)
    assert "time" in registry.predictors and "gpt" in registry.models.names()
    assert not [n for n in imports if n in DEFERRED_BUILTINS]
    assert registry.predictors.get("time").name == "time"
    registry.predictors.get("time")
    assert [n for n in imports if n in DEFERRED_BUILTINS] == ["stg.predictors.time"]
    assert "v0.0.4" in registry.emitters  # an alias, known before the module loads
    assert registry.emitters.get("v0.0.4").name == "chakra-v0.0.4"
    assert imports[-1] == "stg.emitters.chakra_v004"
    # given again as a plugin object, the module is the same plugin, not a second "time"
    registry.add_plugin(importlib.import_module("stg.models.gpt"), "stg.models.gpt")
    assert registry.models.lookup("gpt").plugin == "stg.models.gpt"
    assert len([e for e in registry.models if e.name == "gpt"]) == 1


def test_a_deferred_module_that_fails_is_a_failure_like_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = registry_module._import

    def broken(name: str, **kw: object) -> object:
        if name == "stg.models.llama":
            return registry_module.PluginError("ImportError: no module named 'sympy'")
        return real_import(name)

    monkeypatch.setattr(registry_module, "_import", broken)
    registry = load_registry(autoload=False)
    assert "llama" in registry.models.names()  # listed before it is needed
    with pytest.raises(
        UnknownNameError, match=r"unknown model 'llama'.*stg\.models\.llama .* failed to load"
    ):
        registry.models.get("llama")
    assert "llama" not in registry.models.names()
    assert registry.models.get("gpt").name == "gpt"
    (failure,) = registry.failures
    assert (failure.name, failure.source) == ("stg.models.llama", "builtin")
    assert "stg.models.llama" not in [info.name for info in registry.plugins]
