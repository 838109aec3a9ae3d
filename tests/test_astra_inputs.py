"""ASTRA-sim beyond roofline: kernel times in the trace (``stg generate --system`` writes every
COMP node's ``duration_micros``) and ASTRA-sim's own input files (``--astra_sim_configs``),
checked against the parsers of astra-sim 518bd51, astra-network-analytical 599a047 and
astra-memory-analytical 641cce8 (see stg/perf/astra_sim.py and docs/generation.md)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.astra_sim import astra_sim_inputs, network_config
from stg.perf.calibration import Calibration, load_calibration
from stg.perf.costs import compute_time
from stg.perf.durations import duration_micros, has_work, with_durations
from stg.perf.kernels import kernel_table
from stg.perf.system import load_system
from stg.trace.chakra_v004 import encode_nodes
from stg.trace.reader import iter_nodes, read_metadata
from stg.trace.validate import validate_trace, validate_workload

TINY = dict(
    dvocal=128, dmodel=64, dff=128, head=4, kvhead=2, seq=32, batch=8, micro_batch=4,
    num_stacks=2, tp=2, dp=2,
)  # fmt: skip
TINY_ARGS = [a for k, v in TINY.items() for a in (f"--{k}", str(v))]

# What ASTRA-sim's parsers accept (key -> check of the JSON value), read from its sources:
# Sys::initialize_sys (strings compared to these names; ints read into int members; numbers
# into doubles) and CollectiveImplLookup::generate_collective_impl_from_input.
IMPLEMENTATIONS = re.compile(
    r"ring|oneRing|doubleBinaryTree|direct\d*|oneDirect\d*|halvingDoubling|oneHalvingDoubling"
)
SYSTEM_KEYS = {
    "scheduling-policy": lambda v: v in ("LIFO", "FIFO", "EXPLICIT"),
    "collective-optimization": lambda v: v in ("baseline", "localBWAware"),
    "endpoint-delay": lambda v: type(v) is int and v >= 0,
    "active-chunks-per-dimension": lambda v: type(v) is int and v >= 1,
    "preferred-dataset-splits": lambda v: type(v) is int and v >= 1,
    "roofline-enabled": lambda v: v == 0 and type(v) is int,
    "peak-perf": lambda v: type(v) in (int, float) and v > 0,
    "local-mem-bw": lambda v: type(v) in (int, float) and v > 0,
    **{
        f"{kind}-implementation": lambda v: (
            isinstance(v, list)
            and all(isinstance(x, str) and IMPLEMENTATIONS.fullmatch(x) for x in v)
        )
        for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
    },
}
MEMORY_TYPES = ("NO_MEMORY_EXPANSION", "PER_NODE_MEMORY_EXPANSION", "PER_NPU_MEMORY_EXPANSION",
                "MEMORY_POOL")  # fmt: skip


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def parse_network_yaml(text: str) -> dict[str, list[Any]]:
    """The YAML subset the analytical network's parser is fed: ``key: [ a, b ]`` per line;
    numbers as YAML reads them (int, else float), words as strings. Checked against PyYAML
    where it is installed."""
    config: dict[str, list[Any]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z_]+): \[ (.*) \]", line)
        assert m, f"not a flow-list line: {line!r}"
        values: list[Any] = []
        for item in m.group(2).split(", "):
            if re.fullmatch(r"-?\d+", item):
                values.append(int(item))
            elif re.fullmatch(r"-?\d+\.\d+(e[-+]?\d+)?", item):
                values.append(float(item))
            else:
                assert re.fullmatch(r"[A-Za-z]+", item), item
                values.append(item)
        config[m.group(1)] = values
    try:
        import yaml
    except ImportError:
        return config
    assert yaml.safe_load(text) == config
    return config


def check_network(config: dict[str, list[Any]], world_size: int) -> None:
    """NetworkParser::parse_network_config_yml and check_validity."""
    assert list(config) == ["topology", "npus_count", "bandwidth", "latency"]
    dims = len(config["topology"])
    assert all(t in ("Ring", "FullyConnected", "Switch") for t in config["topology"])
    assert all(len(config[key]) == dims for key in config)
    assert all(type(n) is int and n > 1 for n in config["npus_count"])
    assert math.prod(config["npus_count"]) == world_size  # one NPU per rank file
    assert all(type(b) in (int, float) and b > 0 for b in config["bandwidth"])
    assert all(type(latency) in (int, float) and latency >= 0 for latency in config["latency"])


def check_system(config: dict[str, Any], dims: int) -> None:
    assert set(config) <= set(SYSTEM_KEYS)
    for key, value in config.items():
        assert SYSTEM_KEYS[key](value), (key, value)
    for key in config:
        if key.endswith("-implementation"):
            assert len(config[key]) == dims  # one per network dimension


# -- ASTRA-sim's input files -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "counts"),
    [(2, [2]), (8, [8]), (16, [8, 2]), (8 * 32 * 3, [8, 32, 3])],
)
def test_inputs_follow_astra_sims_parsers(world: int, counts: list[int]) -> None:
    h100 = load_system("h100-80g")
    texts = astra_sim_inputs(h100, world, "bf16")
    network = parse_network_yaml(texts["network"])
    check_network(network, world)
    assert network["npus_count"] == counts
    check_system(json.loads(texts["system"]), len(counts))
    assert json.loads(texts["memory"])["memory-type"] in MEMORY_TYPES
    assert set(json.loads(texts["memory"])) == {"memory-type"}


def test_network_mirrors_the_stg_system() -> None:
    """Each dimension: a Switch of the ranks it holds, stg's effective bandwidth in ASTRA-sim's
    GB/s (2^30 B), the per-step latency over the switch's two hops in ns."""
    h100 = load_system("h100-80g")
    config = network_config(h100, 16 * 8 * 32)
    nvlink, rail, spine = h100.network
    assert config["topology"] == ["Switch"] * 3
    assert config["npus_count"] == [8, 32, 16]
    for got, dim in zip(config["bandwidth"], (nvlink, rail, spine), strict=True):
        assert got == pytest.approx(dim.bandwidth * dim.efficiency / 2**30, abs=1e-6)
    assert config["latency"] == [1700, 4800, 4800]  # 3.4 us and 9.6 us per step
    system = json.loads(astra_sim_inputs(h100, 16, "fp8")["system"])
    assert system["peak-perf"] == 1978.9 and system["local-mem-bw"] == 3350
    assert system["roofline-enabled"] == 0  # ASTRA-sim replays duration_micros


def test_a_collective_is_one_chunk_at_the_links_bandwidth() -> None:
    """The congestion-unaware backend gives every message in flight the whole link: more than
    one chunk in flight per dimension would multiply the bandwidth stg describes, and more
    than one chunk would repeat the ring's per-step latencies (astra_sim.ONE_CHUNK)."""
    system = json.loads(astra_sim_inputs(load_system("h100-80g"), 16, "bf16")["system"])
    assert system["active-chunks-per-dimension"] == 1
    assert system["preferred-dataset-splits"] == 1


def test_generate_writes_the_inputs_and_their_arguments(capsys, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", *TINY_ARGS, "--system", "h100-80g", "--astra_sim_configs",
        "--output_dir", out,
    )  # fmt: skip
    assert code == 0, err
    arguments = err.strip().splitlines()[-1].split()
    assert arguments == [
        f"--workload-configuration={out / 'workload'}",
        f"--comm-group-configuration={out / 'workload.json'}",
        f"--system-configuration={out / 'workload.system.json'}",
        f"--network-configuration={out / 'workload.network.yml'}",
        f"--remote-memory-configuration={out / 'workload.memory.json'}",
    ]
    assert "kernel models on h100-80g" in err
    check_network(parse_network_yaml((out / "workload.network.yml").read_text()), 4)
    check_system(json.loads((out / "workload.system.json").read_text()), 1)
    assert json.loads((out / "workload.memory.json").read_text()) == {
        "memory-type": "NO_MEMORY_EXPANSION"
    }
    code, stdout, err = run(
        capsys, "generate", *TINY_ARGS, "--system", "h100-80g", "--astra-sim-configs",
        "--output_dir", out, "--output_name", "run.%d.et", "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["durations"] == "h100-80g"
    assert summary["astra_sim"]["network_configuration"] == str(out / "run.network.yml")
    assert summary["astra_sim"]["remote_memory_configuration"] == str(out / "run.memory.json")
    assert summary["rank_files"] == [str(out / f"run.{r}.et") for r in range(4)]
    assert str(out / "run.system.json") in summary["files"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--astra_sim_configs"], "error: --astra_sim_configs applies to the system the traces "
         "are timed for; give --system (a preset or a system JSON file)"),
        (["--calibration", "cal.json"], "error: --calibration applies to the system the traces "
         "are timed for; give --system (a preset or a system JSON file) or --predict"),
        (["--system", "h100-80g", "--astra_sim_configs", "--format", "json"],
         "error: --astra_sim_configs: ASTRA-sim reads chakra-v0.0.4 traces, not json; "
         "allowed: --format chakra-v0.0.4"),
        (["--system", "h100-80g", "--astra_sim_configs", "--dp", "12", "--tp", "1", "--batch", "24",
          "--micro_batch", "12"],
         "error: --astra_sim_configs: 12 ranks do not fill whole groups of 8 on h100-80g's "
         "nvlink dimension, and ASTRA-sim's network holds a product of dimension sizes; "
         "allowed: a world size that does"),
        (["--system", "h100-80g", "--astra_sim_configs", "--dp", "1", "--tp", "1"],
         "error: --astra_sim_configs: ASTRA-sim's analytical network needs at least 2 NPUs "
         "per dimension; this workload has 1 rank"),
        (["--system", "h100-80g", "--astra_sim_configs", "--output_name", "w.%d.v4.et"],
         "error: --astra_sim_configs: ASTRA-sim opens <prefix>.<rank>.et, and "
         "output_name='w.%d.v4.et' does not end in .%d.et; allowed: a name that does (or one "
         "without %d)"),
        (["--system", "h100-80g", "--astra_sim_configs", "--comm_group_file",
          "workload.system.json"],
         "error: --astra_sim_configs: workload.system.json is also the name of a trace file; "
         "allowed: another --comm_group_file"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(capsys, tmp_path: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "out"
    code, _, err = run(capsys, "generate", *TINY_ARGS, *extra, "--output_dir", out)
    assert code == 2
    assert err == message + "\n"
    assert not out.exists()


def test_hybrid_system_has_no_analytical_network(capsys, tmp_path: Path) -> None:
    system = tmp_path / "h.json"
    system.write_text(
        json.dumps(
            {
                "name": "v100+t4",
                "groups": [
                    {"name": "v100", "device": "v100-32g", "gpus_per_node": 2},
                    {"name": "t4", "device": "t4-16g", "gpus_per_node": 2},
                ],
            }
        )
    )
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", *TINY_ARGS, "--system", system, "--astra_sim_configs",
        "--output_dir", out,
    )  # fmt: skip
    assert code == 2 and not out.exists()
    assert err.startswith("error: --astra_sim_configs: system 'v100+t4' has device groups")
    assert err.count("\n") == 1


# -- kernel times in the trace -----------------------------------------------------------------


def test_duration_rounding() -> None:
    """Whole microseconds, half up, at least 1 for a node with work (0 would be 1 ns)."""
    assert duration_micros(0.4e-6, True) == 1
    assert duration_micros(0.4e-6, False) == 0
    assert duration_micros(1.49e-6, True) == 1
    assert duration_micros(2.5e-6, True) == 3
    assert duration_micros(1234.56e-6, True) == 1235


def _expected(workload, system, dtype="bf16", profile="megatron", calibration=None):
    """rank -> {node id: duration} from compute_time on the rank's class templates."""
    table = kernel_table([], system.name)
    out = {}
    for graph in workload.ranks:
        out[graph.rank] = {
            t.id: duration_micros(
                compute_time(t, system, dtype, table, profile, calibration), has_work(t)
            )
            for t in graph.rank_class.nodes
            if t.type is NodeType.COMP
        }
    return out


@pytest.mark.parametrize("profile", ["megatron", "eager"])
def test_durations_are_the_kernel_models_rounded(
    capsys, tmp_path: Path, registry, profile: str
) -> None:
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", *TINY_ARGS, "--profile", profile, "--system", "a100-80g",
        "--output_dir", out,
    )  # fmt: skip
    assert code == 0, err
    workload = build_workload(GenerateOptions(**TINY, profile=profile), registry)
    expected = _expected(workload, load_system("a100-80g"), profile=profile)
    for rank in range(4):
        path = out / f"workload.{rank}.et"
        assert read_metadata(path)["attrs"]["system"] == "a100-80g"
        got = {n.id: n.runtime for n in iter_nodes(path) if n.type is NodeType.COMP}
        assert got == expected[rank]
        assert all(d >= 1 for d in got.values())
    code, out_text, err = run(capsys, "validate", out)
    assert code == 0, err + out_text


def test_calibration_prices_the_durations(capsys, tmp_path: Path, registry) -> None:
    table = tmp_path / "cal.json"
    table.write_text(
        json.dumps(
            {
                "format": "stg-calibration",
                "version": 1,
                "entries": [],
                "models": [
                    {
                        "op_class": "gemm",
                        "dtype": "bf16",
                        "latency_us": 700,
                        "tflops": 1,
                        "flops_range": [0, 1e30],
                    }
                ],
            }
        )
    )
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", *TINY_ARGS, "--system", "h100-80g", "--calibration", table,
        "--output_dir", out,
    )  # fmt: skip
    assert code == 0, err
    workload = build_workload(GenerateOptions(**TINY), registry)
    calibration = load_calibration(table)
    expected = _expected(workload, load_system("h100-80g"), calibration=calibration)
    got = {n.id: n.runtime for n in iter_nodes(out / "workload.0.et") if n.type is NodeType.COMP}
    assert got == expected[0]
    assert max(got.values()) >= 700  # the fitted model, not the H100's kernel model


def test_hybrid_ranks_take_their_groups_device(registry) -> None:
    """Ranks of one class on different GPUs get their own GPU's kernel times."""
    from stg.perf.hybrid import hybrid_from_dict

    system = hybrid_from_dict(
        {
            "name": "v100+t4",
            "groups": [
                {"name": "v100", "device": "v100-32g", "gpus_per_node": 2},
                {"name": "t4", "device": "t4-16g", "gpus_per_node": 2},
            ],
        }
    )
    options = GenerateOptions(**{**TINY, "tp": 1, "dp": 4}, dtype="fp16")
    workload = build_workload(options, registry)
    assert len(workload.rank_classes) == 1
    timed = with_durations(workload, system)
    assert len(timed.rank_classes) == 2
    for graph in timed.ranks:
        device = load_system("v100-32g" if graph.rank < 2 else "t4-16g")
        expected = _expected(workload, device, dtype="fp16")[graph.rank]
        assert {t.id: t.runtime for t in graph.rank_class.nodes if t.id in expected} == expected
    assert not validate_workload(timed).errors
    with pytest.raises(UserError, match="on a hybrid system give it with one group's device"):
        with_durations(workload, system, calibration=Calibration(device="t4"))


def test_without_system_the_trace_is_unchanged(capsys, tmp_path: Path) -> None:
    """Without --system nothing carries a duration or names a system (--predict alone
    included); with it, only the COMP nodes' durations and the metadata's system differ."""
    plain, predicted, timed = tmp_path / "plain", tmp_path / "predicted", tmp_path / "timed"
    for out, extra in ((plain, []), (predicted, ["--predict"]), (timed, ["--system", "h100-80g"])):
        code, _, err = run(capsys, "generate", *TINY_ARGS, *extra, "--output_dir", out)
        assert code == 0, err
    for rank in range(4):
        name = f"workload.{rank}.et"
        assert (plain / name).read_bytes() == (predicted / name).read_bytes()
        before, after = list(iter_nodes(plain / name)), list(iter_nodes(timed / name))
        assert all(n.runtime == 0 for n in before)
        assert [replace(n, runtime=0) for n in after] == before
        assert all(n.runtime > 0 for n in after if n.type is NodeType.COMP and has_work(n))
        meta_before = dict(read_metadata(plain / name)["attrs"])
        meta_after = dict(read_metadata(timed / name)["attrs"])
        assert meta_after.pop("system") == "h100-80g"
        assert meta_after == meta_before
    assert sorted(p.name for p in plain.iterdir()) == sorted(p.name for p in timed.iterdir())


# -- validate: a trace generated for a system carries its durations ----------------------------


def _drop_duration(path: Path) -> int:
    """Rewrite a rank file with its first COMP node's duration removed; return its id."""
    nodes = list(iter_nodes(path))
    victim = next(n for n in nodes if n.type is NodeType.COMP and n.runtime > 0)
    changed = [replace(n, runtime=0) if n.id == victim.id else n for n in nodes]
    metadata = read_metadata(path)
    path.write_bytes(encode_nodes(changed, metadata["attrs"]))
    return victim.id


def test_validate_requires_durations_of_a_timed_trace(capsys, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, err = run(capsys, "generate", *TINY_ARGS, "--system", "h100-80g", "--output_dir", out)
    assert code == 0, err
    node = _drop_duration(out / "workload.1.et")
    report = validate_trace(out, jobs=1)
    assert [(v.check, v.rank, v.node) for v in report.errors] == [("duration", 1, node)]
    assert "generated for system h100-80g" in report.errors[0].message
    assert "ASTRA-sim rule" in report.errors[0].message
    code, stdout, _ = run(capsys, "validate", out)
    assert code == 1 and "duration" in stdout
    chakra = validate_trace(out, jobs=1, consumer="chakra")
    assert not chakra.errors and [v.check for v in chakra.warnings] == ["duration"]


def test_validate_workload_requires_durations(registry) -> None:
    workload = build_workload(GenerateOptions(**TINY), registry)
    assert not validate_workload(workload).errors  # no system: no durations needed
    untimed = replace(workload, metadata={**workload.metadata, "system": "h100-80g"})
    errors = validate_workload(untimed).errors
    assert errors and {v.check for v in errors} == {"duration"}
    assert not validate_workload(with_durations(workload, load_system("h100-80g"))).errors
