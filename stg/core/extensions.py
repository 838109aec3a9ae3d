"""Loading stg's optional C extensions (lowering's runs, the replay engine): each has a pure-
Python reference that runs where the extension is not built, is stale, or is turned off."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load_extension(name: str, abi_version: int, switch: str) -> tuple[ModuleType | None, str]:
    """The compiled module ``name`` (``stg.core._lowering``) and ``"compiled"``, or None and
    why the Python code runs instead: ``{switch}=python`` in the environment turns it off; a
    module that is not built or whose ``ABI_VERSION`` is not ``abi_version`` (a build of an
    older source) is not used."""
    if os.environ.get(switch, "").lower() in ("python", "reference"):
        return None, f"turned off by {switch}=python"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"{name} is not built ({exc}); run pip install -e ."
    if getattr(module, "ABI_VERSION", None) != abi_version:
        return None, f"{name} is stale; run pip install -e . to rebuild it"
    return module, "compiled"
