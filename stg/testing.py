"""Contract checks and a pytest fixture for plugin authors.

``check_model`` builds and lowers a model on a tiny configuration; ``check_emitter`` writes a
tiny workload and reads it back; ``check_predictor`` runs a predictor and checks its report;
``check_kernel`` predicts a small workload with and without a precision plan in a kernel's dtype;
``check_preset`` compares a preset's parameter counts with its published ones and builds it.
Each raises ``AssertionError`` naming what is wrong, and returns what it built so a test can
check more. The ``stg_registry`` fixture (installed as a pytest plugin, no conftest needed)
loads a registry with extra plugin objects::

    def test_my_model(stg_registry):
        registry = stg_registry(my_plugin_module)
        check_model("my-model", registry=registry)
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stg.core.options import GenerateOptions
from stg.host.records import Emitter, Kernel, Model, Predictor, Preset
from stg.host.registry import Registry, load_registry

if TYPE_CHECKING:
    from stg.core.workload import Node, Workload

TINY_DIMS: Mapping[str, Any] = {
    "dvocal": 64,
    "dmodel": 32,
    "dff": 64,
    "batch": 4,
    "micro_batch": 2,
    "seq": 16,
    "head": 4,
    "kvhead": 2,
    "num_stacks": 2,
    "experts": 4,
    "kexperts": 2,
}
"""Dimensions small enough that any model builds and lowers in well under a second."""

ROUND_TRIP_FIELDS: tuple[str, ...] = (
    "id",
    "name",
    "type",
    "data_deps",
    "ctrl_deps",
    "num_ops",
    "comm_type",
    "comm_size",
    "comm_group",
    "comm_src",
    "comm_dst",
    "comm_tag",
)
"""Node fields an emitter must preserve for ``check_emitter`` (override with ``fields=``)."""


class _RecordPlugin:
    """A plugin object registering given records (used when a check gets a record)."""

    def __init__(self, name: str, records: Sequence[Any]) -> None:
        self.__name__ = name
        self._records = tuple(records)
        from stg import hookimpl

        for hook, kind in (
            ("stg_register_models", Model),
            ("stg_register_emitters", Emitter),
            ("stg_register_predictors", Predictor),
            ("stg_register_kernels", Kernel),
            ("stg_register_presets", Preset),
        ):
            mine = [r for r in self._records if isinstance(r, kind)]
            if mine:
                setattr(self, hook, hookimpl(_registering(mine)))


def _registering(records: Sequence[Any]) -> Callable[..., None]:
    def hook(register: Callable[[Any], None]) -> None:
        for record in records:
            register(record)

    return hook


def make_registry(
    *plugins: object, extra_plugins: Sequence[str] = (), autoload: bool = False, strict: bool = True
) -> Registry:
    """A registry of the built-ins plus ``plugins`` (plugin objects or modules).

    Entry points are skipped unless ``autoload``; with ``strict`` any load failure raises
    ``AssertionError`` with the plugin's error (a plugin author wants to see it).
    """
    registry = load_registry(extra_plugins, autoload=autoload, plugins=plugins)
    if strict and registry.failures:
        lines = [f"{f.name} ({f.source}): {f.error}" for f in registry.failures]
        raise AssertionError("plugins failed to load: " + "; ".join(lines))
    return registry


def _resolve(kind: str, item: str | Any, registry: Registry | None) -> tuple[str, Registry]:
    """The name to look ``item`` up by, and a registry that has it."""
    if isinstance(item, str):
        return item, registry if registry is not None else make_registry()
    plugin = _RecordPlugin(f"stg.testing.{kind}", [item])
    registry = load_registry(autoload=False, plugins=[plugin])
    failures = [f.error for f in registry.failures if f.name == plugin.__name__]
    if failures:
        raise AssertionError(f"{kind} {getattr(item, 'name', item)!r} rejected: {failures[0]}")
    return f"{plugin.__name__}:{item.name}", registry


def tiny_options(**overrides: Any) -> GenerateOptions:
    """GenerateOptions with :data:`TINY_DIMS`, then ``overrides``."""
    return replace(GenerateOptions(), **{**TINY_DIMS, **overrides})


def build_tiny_workload(registry: Registry, **overrides: Any) -> Workload:
    """Validate options and build a workload on the tiny configuration."""
    from stg.core import pipeline as generate

    options = tiny_options(**overrides)
    generate.validate_options(options, registry)
    return generate.build_workload(options, registry)


def total_flops(workload: Workload) -> int:
    """Sum of num_ops over the COMP nodes of all ranks."""
    from stg.core.workload import NodeType

    return sum(
        template.num_ops
        for graph in workload.ranks
        for template in graph.rank_class.nodes
        if template.type is NodeType.COMP
    )


def _validate(workload: Workload) -> None:
    try:
        from stg.trace import validate
    except ImportError:
        return
    check = getattr(validate, "validate_workload", None)
    if check is None:
        return
    report = check(workload)
    errors = list(report.errors)
    if errors:
        shown = "; ".join(f"{e.check}: {e.message}" for e in errors[:5])
        raise AssertionError(f"the workload is not a valid trace ({len(errors)} errors): {shown}")


def check_model(model: str | Model, registry: Registry | None = None, **dims: Any) -> Workload:
    """Build and lower ``model`` (a name or a record) on a tiny configuration.

    ``dims`` override :data:`TINY_DIMS` and any other option (e.g. ``tp=2, pp=2``). Checks
    that every rank has nodes, that the FLOPs are positive, and (when :mod:`stg.trace.validate`
    is present) that the workload is a valid trace. Returns the workload.
    """
    name, registry = _resolve("model", model, registry)
    workload = build_tiny_workload(registry, model=name, **dims)
    assert workload.world_size == tiny_options(**dims).world_size, "wrong number of ranks"
    for graph in workload.ranks:
        assert len(graph) > 0, f"rank {graph.rank} has no nodes"
    assert total_flops(workload) > 0, f"model {name!r} has no FLOPs"
    _validate(workload)
    return workload


def check_preset(
    preset: str | Preset,
    registry: Registry | None = None,
    *,
    tolerance: float = 0.01,
    active_tolerance: float | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Check a preset (a name or a record) against its source, then build it.

    The model's parameters as the template builds them (:func:`stg.core.modelinfo.
    model_parameters`; less dvocal·dmodel where the published model ties its LM head to the
    embedding and the preset builds it untied, without ``tie_embeddings``) must be within
    ``tolerance`` (relative) of ``published_parameters``, and its
    active parameters within ``active_tolerance`` (default ``tolerance``) of
    ``published_active_parameters``, where the preset states them. Then the preset is built
    and lowered with ``num_stacks`` 2 (or its own, if fewer), one micro-batch of one sample
    per replica and ``options`` (e.g. ``ep=2``), and checked as ``check_model`` checks a
    model. Returns ``parameters``, ``active_parameters`` (the template's), ``compared`` (what
    was compared with ``published_parameters``) and the ``workload``.
    """
    from stg.core import pipeline as generate
    from stg.core.modelinfo import model_parameters
    from stg.core.options import resolve_model

    name, registry = _resolve("preset", preset, registry)
    values, _ = resolve_model({"model": name}, registry)
    record = registry.presets.get(name)
    full = GenerateOptions(**values)
    counts = model_parameters(registry.models.get(full.model), full, generate.symbol_values(full))
    untied_copy = record.tied_embeddings and not full.tie_embeddings  # the template's own head
    compared = counts["parameters"] - (full.dvocal * full.dmodel if untied_copy else 0)
    checks = (
        ("parameters", compared, record.published_parameters, tolerance),
        (
            "active parameters",
            counts["active_parameters"],
            record.published_active_parameters,
            tolerance if active_tolerance is None else active_tolerance,
        ),
    )
    for what, measured, published, allowed in checks:
        if published is None:
            continue
        error = measured / published - 1
        assert abs(error) <= allowed, (
            f"preset {name!r}: {what} {measured:,} are {100 * error:+.2f}% off the published "
            f"{published:,.0f} (allowed: {100 * allowed:.2f}%)"
        )
    if "tp" in options:  # what the preset fills may depend on tp (a padded vocabulary)
        full = GenerateOptions(**resolve_model({"model": name, "tp": options["tp"]}, registry)[0])
    replicas = replace(full, **options).data_replicas  # dp·ep, or dp where ep folds
    small = {"num_stacks": min(2, full.num_stacks), "batch": replicas, "micro_batch": replicas}
    run = replace(full, **{**small, **options})
    generate.validate_options(run, registry)
    workload = generate.build_workload(run, registry)
    for graph in workload.ranks:
        assert len(graph) > 0, f"rank {graph.rank} has no nodes"
    assert total_flops(workload) > 0, f"preset {name!r} has no FLOPs"
    _validate(workload)
    return {**counts, "compared": compared, "workload": workload}


def _node_fields(node: Node, fields: Iterable[str], merge_deps: bool = False) -> dict[str, Any]:
    values = {f: getattr(node, f) for f in fields}
    if merge_deps:
        values.pop("data_deps", None)
        values.pop("ctrl_deps", None)
        values["deps"] = tuple(sorted(set(node.data_deps) | set(node.ctrl_deps)))
    return values


def check_emitter(
    emitter: str | Emitter,
    registry: Registry | None = None,
    *,
    read: Callable[[Path], Sequence[Node]] | None = None,
    fields: Sequence[str] = ROUND_TRIP_FIELDS,
    merge_deps: bool = False,
    model: str = "gpt",
    directory: str | Path | None = None,
    **dims: Any,
) -> list[str]:
    """Write a tiny multi-rank workload with ``emitter`` and read every rank file back.

    ``read(path)`` returns the nodes of one rank file (default :func:`stg.trace.reader.read_nodes`;
    pass your own for a format stg cannot read). The nodes must equal the workload's in
    ``fields`` (``merge_deps`` compares data and ctrl deps as one set, for formats with a
    single parent list such as Chakra v0.0.1); writing twice must give the same bytes.
    Files go to a temporary directory
    (or ``directory``, to keep them). Returns the names of the written files.
    """
    from stg.trace.writer import write_workload

    name, registry = _resolve("emitter", emitter, registry)
    record = registry.emitters.get(name)
    dims = {"dp": 2, "tp": 2, "pp": 2, **dims}
    workload = build_tiny_workload(registry, model=model, **dims)
    if read is None:
        from stg.trace.reader import read_nodes

        read = read_nodes
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(directory) if directory is not None else Path(scratch)
        first = write_workload(workload, record, base / "first", "workload")
        second = write_workload(workload, record, base / "second", "workload")
        assert [p.name for p in first] == [p.name for p in second], "file names differ"
        for a, b in zip(first, second, strict=True):
            assert a.read_bytes() == b.read_bytes(), f"{a.name}: two writes differ"
        assert len(first) >= workload.world_size, "fewer files than ranks"
        rank_files = first[: workload.world_size]
        for graph, path in zip(workload.ranks, rank_files, strict=True):
            expected = [_node_fields(n, fields, merge_deps) for n in graph.nodes()]
            got = [_node_fields(n, fields, merge_deps) for n in read(path)]
            assert len(got) == len(expected), (
                f"{path.name}: read {len(got)} nodes, wrote {len(expected)}"
            )
            for want, have in zip(expected, got, strict=True):
                assert want == have, f"{path.name}: node {want['id']}: wrote {want}, read {have}"
        return [p.name for p in first]


def _finite_numbers(value: Any, where: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int | float):
        assert math.isfinite(value), f"{where} is {value}"
        assert value >= 0, f"{where} is negative: {value}"
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _finite_numbers(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _finite_numbers(item, f"{where}[{i}]")
    else:
        raise AssertionError(f"{where} is not JSON data: {type(value).__name__}")


def check_predictor(
    predictor: str | Predictor,
    registry: Registry | None = None,
    system: Any = None,
    *,
    model: str = "gpt",
    **dims: Any,
) -> dict[str, Any]:
    """Run ``predictor`` on a tiny workload and check the report is sane.

    The report must be a JSON-serialisable dict whose numbers are finite and non-negative,
    the same on a second run, and positive where it gives an iteration time or peak memory.
    ``system`` defaults to the first preset of :mod:`stg.perf.system`. Returns the report.
    """
    name, registry = _resolve("predictor", predictor, registry)
    record = registry.predictors.get(name)
    workload = build_tiny_workload(registry, model=model, **dims)
    if system is None:
        from stg.perf.system import load_system, preset_names

        system = load_system(preset_names()[0])
    report = record.predict(workload, system)
    assert isinstance(report, dict), f"predictor {name!r} returned {type(report).__name__}"
    text = json.dumps(report, sort_keys=True)
    _finite_numbers(report, "report")
    assert json.dumps(record.predict(workload, system), sort_keys=True) == text, (
        f"predictor {name!r} is not deterministic"
    )
    for key in ("iteration_time", "iteration_time_s", "peak_bytes"):
        if key in report:
            assert report[key] > 0, f"report.{key} must be positive, got {report[key]}"
    return report


KERNEL_DIMS: Mapping[str, Any] = {
    "dvocal": 32000,
    "dmodel": 4096,
    "dff": 16384,
    "batch": 2,
    "micro_batch": 1,
    "seq": 2048,
    "head": 32,
    "kvhead": 32,
    "num_stacks": 2,
}
"""Two layers of a 7B-class model: matmuls as large as the ones quantized kernels are for
(building and predicting costs the same at any size; small matmuls are dominated by the
fixed cost of their casts)."""


def check_kernel(
    kernel: str | Kernel,
    registry: Registry | None = None,
    system: Any = None,
    *,
    ops: Sequence[str] = ("fc1", "fc2"),
    model: str = "gpt",
    **dims: Any,
) -> dict[str, dict[str, Any]]:
    """Predict a small workload with ``ops`` planned in the kernel's dtype, and without a plan.

    Checks that the kernel applies on ``system`` (default: the first system the kernel names,
    else the first preset) and is not shadowed by another, that both time and memory reports
    are sane and deterministic, and that the planned report names the kernel. Returns
    ``{"default": {"time": ..., "memory": ...}, "planned": {...}}`` so a test can compare.
    """
    from stg.core import pipeline as generate
    from stg.perf.kernels import OP_CLASS_OF_KERNEL, KernelTable
    from stg.perf.system import load_system, preset_names
    from stg.predictors.memory import predict_memory
    from stg.predictors.time import predict_time

    name, registry = _resolve("kernel", kernel, registry)
    record = registry.kernels.get(name)
    if system is None:
        system = record.systems[0] if record.systems else preset_names()[0]
    system = load_system(system)
    table = KernelTable.build(list(registry.kernels), system.name)
    applied = table.get(OP_CLASS_OF_KERNEL[record.op_class], record.dtype)
    assert applied is record, f"kernel {name!r} does not apply on system {system.name!r}" + (
        f" ({applied.name!r} is chosen instead)" if applied else f" (systems={record.systems})"
    )
    reports: dict[str, dict[str, Any]] = {}
    for label, plan in (("default", ()), ("planned", tuple((op, record.dtype) for op in ops))):
        options = replace(GenerateOptions(), **{**KERNEL_DIMS, "model": model, **dims})
        options = replace(options, precision=plan)
        generate.validate_options(options, registry)
        workload = generate.build_workload(options, registry)
        pair = {
            "time": predict_time(workload, system, kernels=table),
            "memory": predict_memory(workload, system, kernels=table),
        }
        _finite_numbers(pair, f"{label} report")
        again = predict_time(workload, system, kernels=table)
        assert json.dumps(again, sort_keys=True) == json.dumps(pair["time"], sort_keys=True), (
            f"{label} time prediction with kernel {name!r} is not deterministic"
        )
        assert pair["time"]["iteration_time_s"] > 0 and pair["memory"]["peak_bytes"] > 0
        reports[label] = pair
    assert record.name in reports["planned"]["time"].get("kernels", ()), (
        f"the time report does not list kernel {name!r}"
    )
    return reports


try:
    import pytest
except ImportError:  # stg.testing's checks work without pytest; only the fixture needs it
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def stg_registry() -> Callable[..., Registry]:
        """Factory: ``stg_registry(*plugin_objects, extra_plugins=(), autoload=False)``."""
        return make_registry


__all__ = [
    "ROUND_TRIP_FIELDS",
    "TINY_DIMS",
    "build_tiny_workload",
    "check_emitter",
    "check_kernel",
    "check_model",
    "check_predictor",
    "check_preset",
    "make_registry",
    "tiny_options",
    "total_flops",
]
