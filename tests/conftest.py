"""Shared fixtures of the stg test suite."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FAKE_DISTS = Path(__file__).parent / "fake_dists"


@pytest.fixture
def fake_dists(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put tests/fake_dists on sys.path: its fake installed distributions (entry points of
    group ``stg``) become visible, and its bare modules importable for ``-p``."""
    monkeypatch.syspath_prepend(str(FAKE_DISTS))
    monkeypatch.delenv("STG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    yield FAKE_DISTS
    for name in [n for n in sys.modules if n.startswith(("stg_fake_", "fake_cli_plugin"))]:
        del sys.modules[name]
