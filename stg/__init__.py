"""stg: symbolic tensor graphs of distributed transformer training, written as Chakra traces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

    hookimpl: pluggy.HookimplMarker
    """Marker for plugin hook implementations: ``@stg.hookimpl``."""
    __version__: str


def _map_source_tree() -> None:
    """Make ``stg.models``/``stg.emitters``/``stg.predictors`` importable from an uninstalled
    checkout (an install maps the folders with setuptools ``package-dir``)."""
    root = Path(__file__).resolve().parent.parent
    for folder in ("models", "emitters", "predictors"):
        init = root / folder / "__init__.py"
        name = f"{__name__}.{folder}"
        if name in sys.modules or not init.is_file() or importlib.util.find_spec(name):
            continue
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)]
        )
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(sys.modules[__name__], folder, module)


def __getattr__(name: str) -> Any:
    """``hookimpl`` and ``__version__``, made on first use: commands that load no plugin and
    write no trace (``stg feed``) import neither pluggy nor the package metadata."""
    if name == "hookimpl":
        import pluggy

        value: Any = pluggy.HookimplMarker("stg")
    elif name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("symbolic-tensor-graph")
        except PackageNotFoundError:  # running from a source tree that is not installed
            value = "0.0.0"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


_map_source_tree()

__all__ = ["__version__", "hookimpl"]
