"""Shared fixtures of the stg test suite."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


REPORT_TABLES: dict[str, list[str]] = {}
"""Accuracy tables that tests fill (title -> lines); printed at the end of the run, so CI's
log shows how each sub-model fares against its measurements."""


@pytest.fixture
def report_table() -> Callable[[str, list[str]], None]:
    """``report_table(title, lines)`` prints ``lines`` under ``title`` in the run's summary."""

    def add(title: str, lines: list[str]) -> None:
        REPORT_TABLES[title] = lines

    return add


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, lines in sorted(REPORT_TABLES.items()):
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
