"""A cache on disk of the small workloads that the analytical predictor builds and prices,
and of the model's count of block kinds that chooses which ones it builds.

Building a one- or two-layer workload runs the symbolic core (sympy) and lowering; a process
that finds the workload here reads it back instead (a pickle of a few tens of kB), and with
the count beside it imports neither the model nor sympy. An entry is used only when it is
exactly what a build would give now:

- its key is the workload's options (the run's, for the count), the Python version, the
  plugins of the registry (name, distribution, version, source) and the folder this module
  was loaded from (:data:`INSTALLATION`), so another option, plugin or installation of stg
  (another checkout, another virtual environment) is another entry;
- it records every module file the storing process had loaded (path, modification time in
  ns, size: the check Python makes of its own bytecode cache) and is ignored once any of
  them changed or went away, so an edit of stg, a model or a library rebuilds it. A build
  reads no other file (no built-in model or plugin reads data when it builds).

The folder is ``$STG_CACHE_DIR`` (empty: no cache), else ``$XDG_CACHE_HOME/stg`` or
``~/.cache/stg``, under ``reduced-workloads/``; once it holds an eighth more than
:data:`MAX_ENTRIES` entries (as counted by the storing process), the newest
:data:`MAX_ENTRIES` are kept. A folder that cannot be read or written only costs the build.
Entries are pickles: like Python's bytecode cache, the folder is trusted as the user's own.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

CACHE_ENV = "STG_CACHE_DIR"
SUBFOLDER = "reduced-workloads"
FORMAT = 2
"""Bumped when the layout of an entry changes: ``(FORMAT, pickled manifest, pickled
object)``."""
MAX_ENTRIES = 256
"""Entries kept (each about 100 kB with its list of module files); the oldest go first."""

INSTALLATION = os.path.dirname(os.path.abspath(__file__))
"""Where these built-in predictors are installed: two installations sharing the cache folder
(say two versions in two environments) keep their own entries, as each entry's list of module
files only tells whether the installation that stored it changed."""

T = TypeVar("T")
Manifest = tuple[tuple[str, int, int], ...]


def cache_folder() -> Path | None:
    """Where entries go, or None where ``$STG_CACHE_DIR`` is set empty."""
    given = os.environ.get(CACHE_ENV)
    if given is not None:
        return Path(given) / SUBFOLDER if given else None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home == "~":  # no home folder known: no cache rather than one in the cwd
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "stg" / SUBFOLDER


def registry_plugins(registry: Any) -> list[tuple[object, ...]]:
    """What an entry's key names of the registry: each plugin's name, distribution, version
    and source."""
    return [(p.name, p.dist, p.version, p.source) for p in registry.plugins]


def entry_key(options: Any, plugins: Iterable[tuple[object, ...]]) -> str:
    """The name of the entry of a workload built from ``options`` with these plugins."""
    identity = repr((FORMAT, sys.version, INSTALLATION, repr(options), tuple(plugins)))
    return hashlib.sha256(identity.encode()).hexdigest()


_manifest: tuple[tuple[str, ...], Manifest] | None = None
""":func:`loaded_files` as last computed, with the names of the modules loaded then."""
_pickled: tuple[Manifest, bytes] | None = None
"""The manifest last stored, pickled (the entries a process stores share it)."""
_unpickled: dict[bytes, Manifest] = {}
"""Manifests read back, by their pickle (the entries one process stored share one)."""
_counted: dict[Path, int] = {}
"""Per folder: its entries as this process counted them and stored since."""


def loaded_files() -> Manifest:
    """Every file of a loaded module, with its modification time and size (found again only
    once the loaded modules change: a search stores dozens of entries with the same ones)."""
    global _manifest
    names = tuple(sys.modules)
    if _manifest is not None and _manifest[0] == names:
        return _manifest[1]
    _manifest = (names, _loaded_files())
    return _manifest[1]


def _loaded_files() -> Manifest:
    out = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        path = os.path.abspath(path)  # a script's own may be relative to where it ran
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.add((path, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def unchanged(manifest: Manifest) -> bool:
    """Whether every file of ``manifest`` is still there, as it was."""
    for path, mtime_ns, size in manifest:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if st.st_mtime_ns != mtime_ns or st.st_size != size:
            return False
    return True


def load(key: str) -> Any | None:
    """The object stored under ``key``, or None (no entry, or one made by other code)."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        with open(folder / f"{key}.pickle", "rb") as f:
            fmt, pickled_manifest, payload = pickle.load(f)
        if fmt != FORMAT:
            return None
        manifest = _unpickled.get(pickled_manifest)
        if manifest is None:
            if len(_unpickled) > 16:
                _unpickled.clear()
            manifest = _unpickled[pickled_manifest] = pickle.loads(pickled_manifest)
        if not unchanged(manifest):
            return None
        return pickle.loads(payload)
    except Exception:  # a missing, partial or foreign entry is a miss, whatever it raises
        return None


def store(key: str, value: Any) -> None:
    """Store ``value`` under ``key`` with the files of the modules loaded now (atomically;
    a folder that cannot be written is skipped)."""
    folder = cache_folder()
    if folder is None:
        return
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a plugin's object that cannot be pickled: built each time
        return
    global _pickled
    manifest = loaded_files()
    if _pickled is None or _pickled[0] is not manifest:
        _pickled = (manifest, pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
    entry = (FORMAT, _pickled[1], payload)
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, folder / f"{key}.pickle")
        tmp = None
        _prune_if_full(folder)
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _prune_if_full(folder: Path) -> None:
    """:func:`_prune` once the folder holds an eighth more than :data:`MAX_ENTRIES` entries:
    counted once per process, then one more per store."""
    count = _counted.get(folder)
    count = len(list(folder.glob("*.pickle"))) if count is None else count + 1
    if count > MAX_ENTRIES + MAX_ENTRIES // 8:
        count = _prune(folder)
    _counted[folder] = count


def _prune(folder: Path) -> int:
    """Remove the oldest entries beyond :data:`MAX_ENTRIES`; the entries left."""
    entries = []
    for path in folder.glob("*.pickle"):
        try:
            entries.append((path.stat().st_mtime_ns, path))
        except OSError:
            continue
    entries.sort(reverse=True)
    for _, path in entries[MAX_ENTRIES:]:
        try:
            path.unlink()
        except OSError:
            pass
    return min(len(entries), MAX_ENTRIES)


def cached(key: str, build: Callable[[], T]) -> T:
    """The object stored under ``key``, else ``build()``, stored."""
    value = load(key)
    if value is None:
        value = build()
        store(key, value)
    return value


_REGISTRIES: dict[int, Any] = {}
"""The registries :func:`layer_kinds` was asked about, by id (its memo's key)."""


def layer_kinds(options: Any, registry: Any) -> int:
    """How many block kinds the model's layer stack for ``options`` has (0: none). A deferred
    built-in model not imported yet is not imported for it where an entry has the count; an
    imported model counts at once (no entry per plan of a search)."""
    _REGISTRIES[id(registry)] = registry
    return _cached_layer_kinds(options, id(registry))


@lru_cache(maxsize=2048)
def _cached_layer_kinds(options: Any, registry_id: int) -> int:
    registry = _REGISTRIES[registry_id]

    def count() -> int:
        model = registry.models.get(options.model)
        return len({kind for kind, _, _ in model.layer_runs(options.as_dict())})

    if not registry.models.pending(options.model):
        return count()
    return cached(entry_key(("layer kinds", options), registry_plugins(registry)), count)


def store_layer_kinds(options: Any, registry: Any) -> None:
    """Store :func:`layer_kinds` of ``options`` (whose model is imported now) where no entry
    has it: for a caller that stores an entry of these options anyway (the time predictor's
    bound parts), so that the next process reads both without importing the model."""
    key = entry_key(("layer kinds", options), registry_plugins(registry))
    if load(key) is None:
        store(key, layer_kinds(options, registry))
