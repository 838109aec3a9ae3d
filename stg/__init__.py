"""stg: symbolic tensor graphs of distributed transformer training, written as Chakra traces."""

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pluggy

hookimpl = pluggy.HookimplMarker("stg")
"""Marker for plugin hook implementations: ``@stg.hookimpl``."""


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


try:
    __version__ = version("symbolic-tensor-graph")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
_map_source_tree()

__all__ = ["__version__", "hookimpl"]
