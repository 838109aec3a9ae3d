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


@pytest.fixture(scope="session", autouse=True)
def _private_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Caches on disk (the analytical predictor's reduced workloads) go to a folder of the
    test session, for the processes the tests start too, not to the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STG_CACHE_DIR", str(tmp_path_factory.mktemp("stg-cache")))
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow first: pytest-xdist hands tests out in this order, so each slow
    one starts on a worker of its own while the others share out the rest."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


REPORT_TABLES: dict[str, list[str]] = {}
"""Accuracy tables that tests fill (title -> lines); printed at the end of the run, so CI's
log shows how each sub-model fares against its measurements."""
_REPORT_KEY = "stg_report_table"


@pytest.fixture
def report_table(request: pytest.FixtureRequest) -> Callable[[str, list[str]], None]:
    """``report_table(title, lines)`` prints ``lines`` under ``title`` in the run's summary.

    The table travels as a user property of the test's report, so it reaches the summary
    from pytest-xdist's workers too."""

    def add(title: str, lines: list[str]) -> None:
        request.node.user_properties.append((_REPORT_KEY, (title, list(lines))))

    return add


@pytest.fixture
def report_row(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``report_row(title, header, blanks, key, line, passed)`` puts one row into a table
    whose rows other tests fill, on this worker or another: ``blanks`` is every row's
    ``(key, placeholder line)`` in table order. The summary shows the table with each
    test's row in place and a count of rows run and failed."""

    def add(
        title: str, header: str, blanks: list[tuple[str, str]], key: str, line: str, passed: bool
    ) -> None:
        value = (title, header, [list(b) for b in blanks], key, line, passed)
        request.node.user_properties.append((_REPORT_ROW_KEY, value))

    return add


_REPORT_ROW_KEY = "stg_report_row"
_REPORT_ROWS: dict[str, tuple[str, list[list[str]], dict[str, tuple[str, bool]]]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == _REPORT_KEY:
            title, lines = value
            REPORT_TABLES[title] = lines
        elif key == _REPORT_ROW_KEY:
            title, header, blanks, row_key, line, passed = value
            _REPORT_ROWS.setdefault(title, (header, blanks, {}))[2][row_key] = (line, passed)


def _row_tables() -> dict[str, list[str]]:
    tables = {}
    for title, (header, blanks, rows) in _REPORT_ROWS.items():
        lines = [header] + [rows[k][0] if k in rows else blank for k, blank in blanks]
        failed = sum(not passed for _, passed in rows.values())
        lines.append(f"{len(rows)} of {len(blanks)} points run, {failed} outside their tolerance")
        tables[title] = lines
    return tables


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, lines in sorted({**REPORT_TABLES, **_row_tables()}.items()):
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
