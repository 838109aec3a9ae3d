"""What the real consumers of a written trace check, for the tests of each new option."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner

from stg.cli import app
from stg.trace.feeder import ETFeeder, replay


def assert_ranks_decode_and_feed(out: Path) -> None:
    """Every rank file of ``out`` decodes with the official Chakra reader (mlc-chakra), and
    stg's feeder issues each of its nodes exactly once, in dependency order."""
    ranks = sorted(out.glob("workload.*.et"))
    assert ranks, f"no rank files in {out}"
    for path in ranks:
        ids = []
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            node = et_def_pb2.Node()
            while protolib.decodeMessage(f, node):
                ids.append(node.id)
                node = et_def_pb2.Node()
        issued = [nid for kind, nid in replay(ETFeeder(path)) if kind == "issue"]
        assert sorted(issued) == sorted(ids), path.name


def assert_trace_checks_out_and_predicts_as_options(
    out: Path, options: Mapping[str, object], system: str = "h100-80g"
) -> None:
    """The trace ``out`` (written from ``options``) passes ``stg validate`` under ASTRA-sim's
    rules, decodes and feeds (:func:`assert_ranks_decode_and_feed`), and ``stg predict`` gives
    the same iteration time and peak memory from it as from the options."""
    runner = CliRunner()
    result = runner.invoke(app, ["validate", "--consumer", "astra-sim", str(out)])
    assert result.exit_code == 0, result.output
    assert_ranks_decode_and_feed(out)
    flags = [a for k, v in options.items() for a in (f"--{k}", str(v).lower())]
    reports = []
    for source in ([str(out)], flags):
        result = runner.invoke(app, ["predict", *source, "--system", system, "--json"])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.output))
    from_trace, from_options = reports
    assert from_trace["time"]["iteration_time_s"] == from_options["time"]["iteration_time_s"]
    assert from_trace["memory"]["peak_bytes"] == from_options["memory"]["peak_bytes"]
