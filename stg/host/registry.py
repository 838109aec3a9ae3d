"""The plugin host: finds plugins, checks what they register, and remembers who registered what.

Load order: the built-in plugin modules (every module of ``stg.models``, ``stg.emitters``,
``stg.predictors``, then ``stg.core.schedules``), then the entry points of group ``stg`` sorted by
name, then modules named with ``-p``, then plugin objects passed in by a caller. Built-ins go
through exactly the same path as third-party plugins.

A plugin whose import fails, whose hook raises, or that registers something malformed is
recorded in :attr:`Registry.failures` with its name, distribution and version; none of its
registrations are kept and everything else still loads. Setting
``STG_DISABLE_PLUGIN_AUTOLOAD=1`` skips the entry points (built-ins and ``-p`` still load).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pluggy

import stg
from stg.errors import UnknownNameError, UserError
from stg.host import hookspecs
from stg.host.deferred import DEFERRED_BUILTINS
from stg.host.records import (
    BenchOp,
    Emitter,
    Kernel,
    Model,
    PipelineSchedule,
    Predictor,
    Preset,
)

if TYPE_CHECKING:
    import typer

T = TypeVar("T")

DISABLE_AUTOLOAD_ENV = "STG_DISABLE_PLUGIN_AUTOLOAD"
ENTRY_POINT_GROUP = "stg"
BUILTIN_DIST = "symbolic-tensor-graph"
BUILTIN_PACKAGES = ("stg.models", "stg.emitters", "stg.predictors")
BUILTIN_MODULES = ("stg.core.schedules", "stg.bench.ops")

UNLISTED_BUILTINS: Mapping[str, str] = {"stg.models.presets": "presets"}
"""Built-in plugin modules whose names are listed nowhere (the presets are data files), by the
one catalog they register into: imported, and their hooks run, when that catalog is first
read, so a run that names no preset parses none."""

SOURCE_BUILTIN = "builtin"
SOURCE_ENTRY_POINT = "entry point"
SOURCE_COMMAND_LINE = "command line"
SOURCE_IN_PROCESS = "in process"


@dataclass(frozen=True)
class _Kind:
    hook: str
    catalog: str
    label: str
    record: type


KINDS: tuple[_Kind, ...] = (
    _Kind("stg_register_models", "models", "model", Model),
    _Kind("stg_register_parallelisms", "schedules", "pipeline schedule", PipelineSchedule),
    _Kind("stg_register_kernels", "kernels", "kernel", Kernel),
    _Kind("stg_register_emitters", "emitters", "emitter", Emitter),
    _Kind("stg_register_predictors", "predictors", "predictor", Predictor),
    _Kind("stg_register_bench_ops", "bench_ops", "bench operator", BenchOp),
    _Kind("stg_register_presets", "presets", "preset", Preset),
)
COMMANDS_HOOK = "stg_register_commands"


class AmbiguousNameError(UserError, LookupError):
    """A bare name that several plugins registered; ``dist:name`` selects one."""


class PluginError(Exception):
    """Why one plugin could not be loaded (recorded, never raised out of :func:`load_registry`)."""


def normalize_dist(name: str) -> str:
    """A distribution name in canonical form (PEP 503), for comparisons."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Registered(Generic[T]):
    """One registered item with its provenance."""

    item: T
    name: str
    aliases: tuple[str, ...]
    plugin: str
    dist: str | None
    version: str | None
    source: str

    @property
    def qualified(self) -> str:
        """``dist:name`` (or ``plugin:name`` for a plugin outside any distribution)."""
        return f"{self.dist or self.plugin}:{self.name}"


@dataclass(frozen=True)
class _Pending:
    """A registration of a deferred built-in module (:mod:`stg.host.deferred`) not imported
    yet: its name and provenance, without the item."""

    name: str
    aliases: tuple[str, ...]
    plugin: str
    dist: str | None
    version: str | None
    source: str

    @property
    def qualified(self) -> str:
        return f"{self.dist or self.plugin}:{self.name}"


@dataclass(frozen=True)
class _Unlisted:
    """The place in a catalog of what an unlisted built-in module (:data:`UNLISTED_BUILTINS`)
    registers, not imported yet."""

    plugin: str


class Catalog(Generic[T]):
    """The items of one kind (models, emitters, ...) in registration order."""

    def __init__(
        self,
        label: str,
        entries: Sequence[Registered[T]] = (),
        failures: Sequence[PluginFailure] = (),
        load: Callable[[str], None] | None = None,
    ) -> None:
        self.label = label
        self._entries: list[Registered[T] | _Pending | _Unlisted] = list(entries)
        # The registry's own list (shared, not copied): plugins that failed to load, named in
        # the error for an unknown name since one of them may have registered it.
        self._failures = failures
        self._load = load
        """imports a deferred module and puts its items in place of its pending entries"""

    def _loaded(self) -> list[Registered[T]]:
        """The entries, every deferred module among them loaded first."""
        for entry in list(self._entries):
            if isinstance(entry, _Pending | _Unlisted) and self._load is not None:
                self._load(entry.plugin)
        return [e for e in self._entries if isinstance(e, Registered)]

    def _listed(self) -> list[Registered[T] | _Pending]:
        """The entries whose names are known, the unlisted modules' loaded first."""
        for entry in list(self._entries):
            if isinstance(entry, _Unlisted) and self._load is not None:
                self._load(entry.plugin)
        return [e for e in self._entries if not isinstance(e, _Unlisted)]

    def entries(self) -> list[Registered[T]]:
        """Every registration, in load order (built-ins first)."""
        return self._loaded()

    def names(self) -> list[str]:
        """Registered names (not aliases), sorted, each once."""
        return sorted({entry.name for entry in self._listed()})

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._match(name)  # a deferred module's name is known without importing it
        except UserError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._listed())

    def __iter__(self) -> Iterator[Registered[T]]:
        return iter(self._loaded())

    def check(self, name: str) -> None:
        """Raise what :meth:`lookup` raises for a name that is unknown or ambiguous, without
        importing a deferred module (its names are known from :mod:`stg.host.deferred`)."""
        self._match(name)

    def pending(self, name: str) -> bool:
        """Whether the item called ``name`` belongs to a deferred built-in module not imported
        yet (an unknown or ambiguous name raises as :meth:`lookup` does)."""
        return isinstance(self._match(name), _Pending)

    def get(self, name: str) -> T:
        """The item called ``name`` (a name, an alias, or ``dist:name``)."""
        return self.lookup(name).item

    def lookup(self, name: str) -> Registered[T]:
        """Like :meth:`get`, returning the item with its provenance."""
        match = self._match(name)
        if isinstance(match, _Pending) and self._load is not None:
            self._load(match.plugin)  # the entry is now the item, or gone if it failed
            match = self._match(name)
        if isinstance(match, _Pending):  # only while its own hooks run
            raise RuntimeError(f"{self.label} {name!r} is used while its module loads")
        return match

    def _match(self, name: str) -> Registered[T] | _Pending:
        """The one entry called ``name``, loaded or pending."""
        qualifier, _, given = name.rpartition(":")
        base = given.lower()
        candidates = self._listed()
        if qualifier:
            wanted = normalize_dist(qualifier)
            candidates = [
                e
                for e in candidates
                if (e.dist is not None and normalize_dist(e.dist) == wanted)
                or e.plugin == qualifier
            ]
        # bench operators keep PARAM's spelling (torch.nn.Linear); other names are lower-case
        matches = [e for e in candidates if e.name in (given, base)]
        if len({e.name for e in matches}) > 1:
            matches = [e for e in matches if e.name == given]
        if not matches:
            matches = [e for e in candidates if base in e.aliases]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise UnknownNameError(
                f"unknown {self.label} {name!r}; allowed: {', '.join(self.names()) or '(none)'}"
                + _failed_plugins_note(self._failures)
            )
        choices = ", ".join(e.qualified for e in matches)
        raise AmbiguousNameError(
            f"{self.label} {name!r} is registered by several plugins; choose one of: {choices}"
        )


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin and the names it registered, by catalog (``models``, ``emitters``, ...)."""

    name: str
    dist: str | None
    version: str | None
    source: str
    registered: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, with a one-line reason."""

    name: str
    dist: str | None
    version: str | None
    source: str
    error: str


@dataclass(frozen=True)
class CommandSet:
    """The commands one plugin added through ``stg_register_commands`` (a Typer app)."""

    app: typer.Typer
    names: tuple[str, ...]


class Registry:
    """Everything the loaded plugins registered, with provenance and load failures."""

    def __init__(self) -> None:
        self.plugins: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        failures = self.failures
        self.models: Catalog[Model] = Catalog("model", failures=failures)
        self.schedules: Catalog[PipelineSchedule] = Catalog("pipeline schedule", failures=failures)
        self.kernels: Catalog[Kernel] = Catalog("kernel", failures=failures)
        self.emitters: Catalog[Emitter] = Catalog("emitter", failures=failures)
        self.predictors: Catalog[Predictor] = Catalog("predictor", failures=failures)
        self.commands: Catalog[CommandSet] = Catalog("command set", failures=failures)
        self.bench_ops: Catalog[BenchOp] = Catalog("bench operator", failures=failures)
        self.presets: Catalog[Preset] = Catalog("preset", failures=failures)
        for name in ("models", "schedules", "kernels", "emitters", "predictors", "commands"):
            self.catalog(name)._load = self._load_deferred
        self.bench_ops._load = self.presets._load = self._load_deferred
        self._loaded_objects: set[int] = set()
        self._pm = pluggy.PluginManager("stg")
        self._pm.add_hookspecs(hookspecs)
        self._deferred: dict[str, PluginInfo] = {}
        """deferred built-in modules not imported yet (see :mod:`stg.host.deferred`)"""
        self._lock = threading.RLock()

    def catalog(self, name: str) -> Catalog[Any]:
        """A catalog by attribute name (``"models"``, ``"emitters"``, ...)."""
        catalogs = ("models", "schedules", "kernels", "emitters", "predictors", "commands")
        if name not in (*catalogs, "bench_ops", "presets"):
            raise KeyError(name)
        return getattr(self, name)

    def command_names(self) -> list[str]:
        """Names of all commands that plugins added, sorted."""
        return sorted({n for entry in self.commands for n in entry.item.names})

    def failures_note(self) -> str:
        """`` (plugin P failed to load: why)`` for the plugins that failed, or '': what an
        error about an unknown name adds, since one of them may have registered it."""
        return _failed_plugins_note(self.failures)

    # -- loading --------------------------------------------------------------------------

    def add_plugin(
        self,
        plugin: object,
        name: str,
        *,
        dist: str | None = None,
        version: str | None = None,
        source: str = SOURCE_IN_PROCESS,
        reserved_commands: Collection[str] = (),
        skip_if_empty: bool = False,
    ) -> bool:
        """Register one plugin object; on any error record a failure instead. True if loaded."""
        if name in self._deferred and plugin is sys.modules.get(name):
            self._load_deferred(name)  # a deferred built-in, given as an object
        if id(plugin) in self._loaded_objects:
            return True
        try:
            staged = self._collect(plugin, name, reserved_commands)
        except PluginError as exc:
            self.failures.append(PluginFailure(name, dist, version, source, str(exc)))
            return False
        if staged is None:
            if not skip_if_empty:
                self.failures.append(
                    PluginFailure(name, dist, version, source, "defines no @stg.hookimpl hooks")
                )
            return False
        self._loaded_objects.add(id(plugin))
        for catalog, items in staged.items():
            for item, names, aliases in items:
                entry = Registered(item, names, aliases, name, dist, version, source)
                self.catalog(catalog)._entries.append(entry)
        self.plugins.append(PluginInfo(name, dist, version, source, _registered(staged)))
        return True

    def _collect(
        self, plugin: object, name: str, reserved_commands: Collection[str]
    ) -> dict[str, list[tuple[Any, str, tuple[str, ...]]]] | None:
        """Call the plugin's hooks into a staging area; None if it implements no hooks."""
        pm = self._pm
        if pm.get_plugin(name) is not None:
            raise PluginError(f"another plugin named {name!r} is already loaded")
        try:
            pm.register(plugin, name=name)
        except Exception as exc:
            raise PluginError(_one_line(exc)) from exc
        try:
            callers = pm.get_hookcallers(plugin) or []
            if not callers:
                pm.unregister(plugin)
                return None
            known = [*sorted(k.hook for k in KINDS), COMMANDS_HOOK]
            for caller in callers:
                if not caller.has_spec():
                    raise PluginError(
                        f"unknown hook {caller.name}; known hooks: {', '.join(known)}"
                    )
            staged: dict[str, list[tuple[Any, str, tuple[str, ...]]]] = {}
            for kind in KINDS:
                items = staged.setdefault(kind.catalog, [])
                for impl in _impls(pm, kind.hook, plugin):
                    _call(impl, kind.hook, register=_registrar(kind, items))
            commands = staged.setdefault("commands", [])
            for impl in _impls(pm, COMMANDS_HOOK, plugin):
                commands.append(_collect_commands(impl, reserved_commands, self))
            return staged
        except BaseException:
            pm.unregister(plugin)
            raise

    def load_builtins(self, reserved_commands: Collection[str] = ()) -> None:
        """Register the built-in plugin modules (skipping helper modules without hooks); a
        deferred one (:mod:`stg.host.deferred`) by its names only, imported on first use."""
        for module_name in builtin_module_names():
            if module_name in DEFERRED_BUILTINS or module_name in UNLISTED_BUILTINS:
                self._defer(module_name)
                continue
            module = _import(module_name)
            if isinstance(module, PluginError):
                self.failures.append(
                    PluginFailure(
                        module_name, BUILTIN_DIST, stg.__version__, SOURCE_BUILTIN, str(module)
                    )
                )
                continue
            self.add_plugin(
                module,
                module_name,
                dist=BUILTIN_DIST,
                version=stg.__version__,
                source=SOURCE_BUILTIN,
                reserved_commands=reserved_commands,
                skip_if_empty=True,
            )

    def _defer(self, module_name: str) -> None:
        """Pending entries for what a deferred built-in module registers (one unlisted
        entry for an unlisted module, whose names are known once it loads)."""
        table = DEFERRED_BUILTINS.get(module_name, {})
        registered = {catalog: tuple(names) for catalog, names in table.items()}
        info = PluginInfo(module_name, BUILTIN_DIST, stg.__version__, SOURCE_BUILTIN, registered)
        for catalog, names in table.items():
            entries = self.catalog(catalog)._entries
            entries.extend(_Pending(n, a, *astuple_of(info)) for n, a in names.items())
        if module_name in UNLISTED_BUILTINS:
            self.catalog(UNLISTED_BUILTINS[module_name])._entries.append(_Unlisted(module_name))
        self.plugins.append(info)
        self._deferred[module_name] = info

    def load_unlisted(self) -> None:
        """Import the unlisted built-in modules not imported yet, so that every plugin's
        :attr:`PluginInfo.registered` is complete (``stg plugins list``)."""
        for module_name in [n for n in self._deferred if n in UNLISTED_BUILTINS]:
            self._load_deferred(module_name)

    def _load_deferred(self, module_name: str) -> None:
        """Import a deferred built-in module and run its hooks: its items replace its pending
        entries (in place, keeping the load order); where it fails, they go and the failure
        is recorded, as for any plugin."""
        with self._lock:
            info = self._deferred.pop(module_name, None)
            if info is None:
                return
            module = _import(module_name)
            staged: dict[str, list[tuple[Any, str, tuple[str, ...]]]] = {}
            error = str(module) if isinstance(module, PluginError) else None
            if not isinstance(module, PluginError):
                try:
                    staged = self._collect(module, module_name, ()) or {}
                except PluginError as exc:
                    error = str(exc)
                self._loaded_objects.add(id(module))
            unlisted = UNLISTED_BUILTINS.get(module_name)
            for catalog in {*info.registered, *staged, *([unlisted] if unlisted else [])}:
                items = {name: (item, aliases) for item, name, aliases in staged.get(catalog, [])}
                entries = self.catalog(catalog)._entries
                kept: list[Any] = []
                for entry in entries:
                    if isinstance(entry, _Unlisted) and entry.plugin == module_name:
                        kept.extend(  # in its place: the load order is kept
                            Registered(item, name, aliases, *astuple_of(info))
                            for name, (item, aliases) in items.items()
                        )
                        items.clear()
                        continue
                    if isinstance(entry, _Pending) and entry.plugin == module_name:
                        if entry.name not in items:
                            continue
                        item, aliases = items.pop(entry.name)
                        entry = Registered(item, entry.name, aliases, *astuple_of(info))
                    kept.append(entry)
                kept.extend(  # anything the table does not list
                    Registered(item, name, aliases, *astuple_of(info))
                    for name, (item, aliases) in items.items()
                )
                entries[:] = kept
            if error is not None:
                self.plugins.remove(info)
                self.failures.append(
                    PluginFailure(module_name, info.dist, info.version, info.source, error)
                )
            elif unlisted:  # what it registered is known now
                known = dataclasses.replace(info, registered=_registered(staged))
                self.plugins[self.plugins.index(info)] = known

    def load_entry_points(self, reserved_commands: Collection[str] = ()) -> None:
        """Register the plugins of the entry-point group ``stg``, sorted by name."""
        seen: set[tuple[str, str, str]] = set()
        eps = sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (ep.name, _ep_dist(ep)[0] or "", ep.value),
        )
        for ep in eps:
            dist, version = _ep_dist(ep)
            key = (ep.name, dist or "", ep.value)
            if key in seen:
                continue
            seen.add(key)
            try:
                plugin = ep.load()
            except BaseException as exc:  # a plugin may even call sys.exit at import
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self.failures.append(
                    PluginFailure(ep.name, dist, version, SOURCE_ENTRY_POINT, _one_line(exc))
                )
                continue
            self.add_plugin(
                plugin,
                ep.name,
                dist=dist,
                version=version,
                source=SOURCE_ENTRY_POINT,
                reserved_commands=reserved_commands,
            )

    def load_module(self, module_name: str, reserved_commands: Collection[str] = ()) -> None:
        """Register a plugin module named on the command line (``-p module``)."""
        dist, version = _module_dist(module_name)
        module = _import(module_name, from_cwd=True)
        if isinstance(module, PluginError):
            self.failures.append(
                PluginFailure(module_name, dist, version, SOURCE_COMMAND_LINE, str(module))
            )
            return
        self.add_plugin(
            module,
            module_name,
            dist=dist,
            version=version,
            source=SOURCE_COMMAND_LINE,
            reserved_commands=reserved_commands,
        )


def builtin_module_names() -> list[str]:
    """The built-in plugin modules, in load order."""
    names: list[str] = []
    for package_name in BUILTIN_PACKAGES:
        package = importlib.import_module(package_name)
        found = sorted(
            info.name
            for info in pkgutil.iter_modules(package.__path__)
            if not info.name.startswith("_")
        )
        names.extend(f"{package_name}.{n}" for n in found)
    for module_name in BUILTIN_MODULES:
        if importlib.util.find_spec(module_name) is not None:
            names.append(module_name)
    return names


def autoload_enabled() -> bool:
    """False when ``STG_DISABLE_PLUGIN_AUTOLOAD`` is set to anything but '', '0' or 'false'."""
    value = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower()
    return value in ("", "0", "false", "no")


def load_registry(
    extra_plugins: Sequence[str] = (),
    autoload: bool | None = None,
    *,
    plugins: Sequence[object] = (),
    reserved_commands: Collection[str] = (),
    builtins: bool = True,
) -> Registry:
    """Load built-ins, entry points (unless disabled), ``-p`` modules, then plugin objects.

    ``extra_plugins`` are module names (``-p``); ``autoload=None`` follows the environment
    variable ``STG_DISABLE_PLUGIN_AUTOLOAD``; ``plugins`` are plugin objects registered last
    (tests and embedding); ``reserved_commands`` are command names plugins may not take;
    ``builtins=False`` skips the built-in modules (the CLI uses it to list plugin commands).
    """
    registry = Registry()
    if builtins:
        registry.load_builtins(reserved_commands)
    if autoload is None:
        autoload = autoload_enabled()
    if autoload:
        registry.load_entry_points(reserved_commands)
    for module_name in extra_plugins:
        registry.load_module(module_name, reserved_commands)
    for index, plugin in enumerate(plugins):
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{index}"
        registry.add_plugin(plugin, name, reserved_commands=reserved_commands)
    return registry


# -- helpers ------------------------------------------------------------------------------


def astuple_of(info: PluginInfo) -> tuple[str, str | None, str | None, str]:
    """A plugin's provenance as a registration records it: (plugin, dist, version, source)."""
    return info.name, info.dist, info.version, info.source


def _failed_plugins_note(failures: Sequence[PluginFailure]) -> str:
    """`` (plugin P failed to load: why)`` for each failed plugin, on the same line; ''."""
    notes = []
    for failure in failures:
        origin = " ".join(part for part in (failure.dist, failure.version) if part)
        origin = f" ({origin})" if origin else ""
        why = (failure.error.strip().splitlines() or [""])[0]
        notes.append(f"plugin {failure.name}{origin} failed to load: {why}")
    return f" ({'; '.join(notes)})" if notes else ""


def _registered(
    staged: Mapping[str, Sequence[tuple[Any, str, tuple[str, ...]]]],
) -> dict[str, tuple[str, ...]]:
    """What a plugin's hooks registered, by catalog (:attr:`PluginInfo.registered`)."""
    registered: dict[str, tuple[str, ...]] = {}
    for catalog, items in staged.items():
        if items:
            if catalog == "commands":
                registered[catalog] = tuple(n for it in items for n in it[0].names)
            else:
                registered[catalog] = tuple(it[1] for it in items)
    return registered


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _import(module_name: str, from_cwd: bool = False) -> ModuleType | PluginError:
    """Import a plugin module, or the one-line error. With ``from_cwd`` (``-p``), a module that
    is not importable is looked for in the current directory too, as ``python -m`` finds it
    (the directory is on ``sys.path`` only while it is imported)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        cwd = os.path.abspath(os.curdir)
        if not from_cwd or exc.name != top or cwd in sys.path:
            return PluginError(_one_line(exc))
        error: BaseException = exc
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return PluginError(_one_line(exc))
    sys.path.insert(0, cwd)
    try:
        importlib.invalidate_caches()
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        return PluginError(_one_line(error if exc.name == top else exc))
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return PluginError(_one_line(exc))
    finally:
        sys.path.remove(cwd)


def _ep_dist(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"] or dist.name, dist.version


def _module_dist(module_name: str) -> tuple[str | None, str | None]:
    """The distribution named like the module's top-level package (``stg_relu`` ->
    ``stg-relu``), if one is installed; a full scan of all distributions would be slow."""
    top = module_name.split(".", 1)[0]
    if top == "stg":
        return BUILTIN_DIST, stg.__version__
    try:
        dist = metadata.distribution(top)
    except (metadata.PackageNotFoundError, ValueError):
        return None, None
    return dist.metadata["Name"] or top, dist.version


def _impls(pm: pluggy.PluginManager, hook: str, plugin: object) -> list[Any]:
    caller = getattr(pm.hook, hook)
    return [impl for impl in caller.get_hookimpls() if impl.plugin is plugin]


def _call(impl: Any, hook: str, **kwargs: Any) -> Any:
    if impl.hookwrapper or impl.wrapper:
        raise PluginError(f"{hook}: hook wrappers are not supported")
    try:
        return impl.function(**{name: kwargs[name] for name in impl.argnames})
    except PluginError:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PluginError(f"{hook}: {_one_line(exc)}") from exc


def _registrar(kind: _Kind, items: list[tuple[Any, str, tuple[str, ...]]]) -> Callable[[Any], None]:
    def register(record: Any) -> None:
        if not isinstance(record, kind.record):
            raise PluginError(
                f"{kind.hook} registered {_short_repr(record)}; expected a "
                f"stg.host.records.{kind.record.__name__}"
            )
        if any(existing[1] == record.name for existing in items):
            raise PluginError(f"{kind.hook} registered {kind.label} {record.name!r} twice")
        items.append((record, record.name, tuple(getattr(record, "aliases", ()))))

    register.__doc__ = f"Register one stg.host.records.{kind.record.__name__}."
    return register


def _short_repr(value: object) -> str:
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return f"a {type(value).__name__} named {name!r}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _collect_commands(
    impl: Any, reserved_commands: Collection[str], registry: Registry
) -> tuple[CommandSet, str, tuple[str, ...]]:
    import typer
    import typer.main

    app = typer.Typer()
    _call(impl, COMMANDS_HOOK, app=app)
    try:
        group = typer.main.get_group(app)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PluginError(f"{COMMANDS_HOOK}: {_one_line(exc)}") from exc
    names = tuple(sorted(group.commands))
    taken = set(reserved_commands) | set(registry.command_names())
    for command in names:
        if command in taken:
            raise PluginError(f"{COMMANDS_HOOK}: command {command!r} is already taken")
    return CommandSet(app, names), ",".join(names), ()
