"""CPU activation offload: Megatron-LM's ``--cpu-offloading-num-layers`` run on Transformer
Engine's default offload schedule (stg.core.offload). The copies are read from the written
files and checked against the closed form of a layer's saved tensors; the memory peak against
(L - N) layers' activations; the replay's host-copy stream hidden behind compute on a fast
link and exposed on a slow one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner
from workload_checks import check_runs_to_completion

from stg.cli import app
from stg.core.offload import held_activation_peak
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.sizes import estimate_size
from stg.core.workload import NodeType, Phase, node_micro_batch, node_part, node_phase
from stg.host.registry import load_registry
from stg.perf import system as system_module
from stg.predictors.analytical import predict_options
from stg.predictors.memory import activation_bytes_per_layer, predict_memory, predict_memory_options
from stg.predictors.time import predict_time
from stg.trace.feeder import ETFeeder, replay
from stg.trace.reader import read_nodes
from stg.trace.validate import validate_trace

# GPT, unfused attention, no dropout: what Megatron-LM's layer saves and Transformer Engine's
# offload copies (every tensor saved for the backward, TE v2.10 cpu_offload.py): its input,
# both LayerNorms' outputs, the MLP's input (the residual), Q, K, V after their biases (the
# bias add saves nothing), the softmax output (not its input), the context, the GELU's input
# and output: e·(8·s·b·h + a·s²·b + 2·s·b·F) bytes per layer and micro-batch
SMALL = dict(
    model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=128, batch=8,
    micro_batch=4, attention="unfused", num_stacks=4,
)  # fmt: skip
STORE, LOAD = NodeType.MEM_STORE, NodeType.MEM_LOAD


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def saved_layer_bytes(o: GenerateOptions) -> int:
    b, s, h, f, a = o.micro_batch or o.batch, o.seq, o.dmodel, o.dff, o.head
    return 2 * (8 * s * b * h + a * s * s * b + 2 * s * b * f)


def written(tmp_path: Path, args: list[str]) -> Path:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", *args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    return out


def cli_args(o: GenerateOptions) -> list[str]:
    args = []
    for key, value in o.recorded().items():
        if value is None or key in ("precision", "placement"):
            continue
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


@pytest.mark.parametrize("offloaded", [1, 3])
def test_the_copies_in_the_written_files(tmp_path: Path, offloaded: int) -> None:
    """Each offloaded layer is copied out after its forward and back before its backward,
    once per micro-batch, with its saved bytes; the trace validates under ASTRA-sim's rules,
    decodes with mlc-chakra's reader and drains through the feeder."""
    o = options(cpu_offloading_num_layers=offloaded)
    out = written(tmp_path, cli_args(o))
    assert validate_trace(out).ok
    path = out / "workload.0.et"
    nodes = read_nodes(path)
    copies = {
        (n.type, node_part(n), node_micro_batch(n), node_phase(n)): n.tensor_size
        for n in nodes
        if n.type in (STORE, LOAD)
    }
    expected = {}
    for mb in range(o.micro_batches):
        for layer in range(offloaded):
            expected[(STORE, f"layer{layer}", mb, Phase.FORWARD)] = saved_layer_bytes(o)
            expected[(LOAD, f"layer{layer}", mb, Phase.BACKWARD)] = saved_layer_bytes(o)
    assert copies == expected
    assert all(not n.is_cpu_op for n in nodes if n.type in (STORE, LOAD))
    ids = []
    with path.open("rb") as f:
        assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
        node = et_def_pb2.Node()
        while protolib.decodeMessage(f, node):
            ids.append(node.id)
            if node.type in (et_def_pb2.MEM_STORE_NODE, et_def_pb2.MEM_LOAD_NODE):
                sizes = [a.uint64_val for a in node.attr if a.name == "tensor_size"]
                assert sizes == [saved_layer_bytes(o)]
            node = et_def_pb2.Node()
    issued = [nid for kind, nid in replay(ETFeeder(path)) if kind == "issue"]
    assert sorted(ids) == sorted(issued) == sorted(n.id for n in nodes)


def test_the_schedule_of_transformer_engine() -> None:
    """L = 4, N = 2: layer i's copy starts after its forward, the forward of layer L - N + i
    waits for it (its memory is freed then); its reload starts after the compute issued
    before the backward of layer L - 1 - N + i, and layer i's backward reads the reloaded
    tensors."""
    o = options(cpu_offloading_num_layers=2, batch=4)
    workload = build_workload(o, load_registry())
    assert check_runs_to_completion(workload) == len(workload.ranks[0].rank_class.nodes)
    nodes = workload.rank_classes[0].nodes
    by_id = {n.id: n for n in nodes}

    def place(n: object) -> tuple[str, str]:
        return (node_phase(n).name, str(node_part(n)))  # type: ignore[union-attr]

    for i, (freed, reload_after) in enumerate([(2, 2), (3, 3)]):
        store = next(n for n in nodes if n.type is STORE and node_part(n) == f"layer{i}")
        load = next(n for n in nodes if n.type is LOAD and node_part(n) == f"layer{i}")
        assert {place(by_id[d]) for d in store.data_deps} == {("FORWARD", f"layer{i}")}
        forward = [n for n in nodes if place(n) == ("FORWARD", f"layer{freed}")]
        assert store.id in forward[0].ctrl_deps
        assert store.id in load.data_deps
        (before,) = load.ctrl_deps  # the last compute before layer 1's (0's: 2's) backward
        assert place(by_id[before]) == ("BACKWARD", f"layer{reload_after}")
        later = [n for n in nodes if n.id > before and place(n)[1] == f"layer{reload_after}"]
        assert not [n for n in later if n.type is NodeType.COMP]
        backward = [n for n in nodes if place(n) == ("BACKWARD", f"layer{i}") and n is not load]
        readers = [n for n in backward if load.id in n.data_deps]
        assert readers and readers[0] is backward[0]  # its first kernel waits for the reload


def test_the_memory_peak_drops_by_the_offloaded_layers() -> None:
    """One stage, one micro-batch in flight: L layers keep L·A, N offloaded L - N (A: the
    layer's activations, Korthikanti's closed form); from options and from the built
    workload alike."""
    registry = load_registry()
    base = predict_memory_options(options(), "h100-80g")["classes"][0]
    per_layer = activation_bytes_per_layer(options())
    for offloaded in (1, 2, 3):
        o = options(cpu_offloading_num_layers=offloaded)
        fast = predict_memory_options(o, "h100-80g")["classes"][0]
        built = predict_memory(build_workload(o, registry), "h100-80g")["classes"][0]
        assert (fast["activations"], fast["buffers"]) == (built["activations"], built["buffers"])
        assert base["activations"] - fast["activations"] == pytest.approx(offloaded * per_layer)
        assert base["peak"] - fast["peak"] == pytest.approx(offloaded * per_layer, abs=1)


def test_held_activation_peak() -> None:
    """(L - N)·A for equal layers; the forward's end or a backward step for unequal ones."""
    assert held_activation_peak([5.0] * 10, 0) == 50
    assert held_activation_peak([5.0] * 10, 3) == 35
    assert held_activation_peak([5.0] * 10, 9) == 5
    # layers 2 and 3 at the forward's end; in the backward of layer 1, 0 and 1 back
    assert held_activation_peak([1.0, 2.0, 3.0, 4.0], 2) == 7
    assert held_activation_peak([4.0, 3.0, 1.0, 1.0], 2) == 7  # 0 and 1 reloaded


def _replayed(o: GenerateOptions) -> dict:
    registry = load_registry()
    return predict_time(build_workload(o, registry), "h100-80g", kernels=list(registry.kernels))


def test_copies_hide_behind_compute_on_a_fast_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy a tenth of a layer's forward and backward: each runs beside the two layers'
    compute before it is needed, and the iteration takes what it takes without offload."""
    o = options(cpu_offloading_num_layers=2)
    plain = _replayed(options())
    layer_s = plain["iteration_time_s"] / (o.micro_batches * o.num_stacks)
    bandwidth = saved_layer_bytes(o) / (layer_s / 10)
    monkeypatch.setitem(system_module.HOST_LINK_BYTES_PER_S, "hopper", bandwidth)
    got = _replayed(o)
    assert got["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-12)
    rank = got["ranks"][0]
    copies = o.micro_batches * 2 * 2
    assert rank["host_copy_s"] == pytest.approx(copies * saved_layer_bytes(o) / bandwidth)
    assert rank["exposed_host_copy_s"] == pytest.approx(0, abs=1e-12)
    assert rank["bubble_s"] == pytest.approx(0, abs=1e-12)


def test_copies_are_exposed_on_a_slow_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy a hundred times a layer's compute: the one copy stream sets the pace; every
    copy runs in turn, so the iteration takes at least all of them and at most all of them
    plus the compute."""
    o = options(cpu_offloading_num_layers=2)
    plain = _replayed(options())
    layer_s = plain["iteration_time_s"] / (o.micro_batches * o.num_stacks)
    bandwidth = saved_layer_bytes(o) / (100 * layer_s)
    monkeypatch.setitem(system_module.HOST_LINK_BYTES_PER_S, "hopper", bandwidth)
    got = _replayed(o)
    copies_s = o.micro_batches * 2 * 2 * saved_layer_bytes(o) / bandwidth
    assert copies_s <= got["iteration_time_s"] <= copies_s + plain["iteration_time_s"]
    rank = got["ranks"][0]
    assert rank["exposed_host_copy_s"] == pytest.approx(
        got["iteration_time_s"] - plain["iteration_time_s"], rel=1e-9
    )


def test_astra_sim_gets_a_host_memory(tmp_path: Path) -> None:
    """ASTRA-sim sends MEM_STORE and MEM_LOAD nodes to its remote memory, which
    NO_MEMORY_EXPANSION refuses: with offload each NPU has its own, behind the host link."""
    base = ["--model", "debug", "--system", "h100-80g", "--astra_sim_configs", "--dp", "2"]
    on = written(tmp_path / "on", [*base, "--cpu_offloading_num_layers", "1"])
    off = written(tmp_path / "off", base)
    assert json.loads((on / "workload.memory.json").read_text()) == {
        "memory-type": "PER_NPU_MEMORY_EXPANSION",
        "remote-mem-bw": 64,  # H100 PCIe Gen5 x16, GB/s per direction (= bytes per ns)
    }
    assert json.loads((off / "workload.memory.json").read_text()) == {
        "memory-type": "NO_MEMORY_EXPANSION"
    }


def test_the_size_estimate_counts_the_copies() -> None:
    registry = load_registry()
    o = options(cpu_offloading_num_layers=3)
    built = sum(len(c.nodes) for c in build_workload(o, registry).rank_classes)
    plain = sum(len(c.nodes) for c in build_workload(options(), registry).rank_classes)
    estimate = estimate_size(o, registry).templates
    assert estimate >= built
    assert estimate - estimate_size(options(), registry).templates == built - plain


def test_off_is_not_recorded_and_the_analytical_predictor_refuses() -> None:
    assert "cpu_offloading_num_layers" not in options().recorded()
    assert options(cpu_offloading_num_layers=2).recorded()["cpu_offloading_num_layers"] == 2
    registry = load_registry()
    with pytest.raises(Exception, match="predictor time"):
        predict_options(options(cpu_offloading_num_layers=1), "h100-80g", registry=registry)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu_offloading_num_layers", "4"],
         "cpu_offloading_num_layers=4: the stack has 4 layer(s) and at least one keeps its "
         "activations on the GPU (Megatron-LM); allowed: 1 to 3"),
        (["--cpu_offloading_num_layers", "1", "--pp", "2"],
         "Megatron-LM has no CPU offloading under pipeline parallelism (pp=2, "
         "virtual_stages=1); allowed: pp=1, virtual_stages=1"),
        (["--cpu_offloading_num_layers", "1", "--activation_recompute", "full"],
         "does not work with activation recompute (activation_recompute=full); allowed: "
         "activation_recompute=none"),
        (["--cpu_offloading_num_layers", "1", "--pipeline_schedule", "gpipe", "--batch", "8",
          "--micro_batch", "4"],
         "pipeline_schedule=gpipe runs several forwards before a backward"),
        (["--cpu_offloading_num_layers", "-1"],
         "cpu_offloading_num_layers=-1 must be a non-negative integer"),
        (["--cpu_offloading_num_layers", "1", "--phase", "decode"],
         "cpu_offloading_num_layers=1 is a training option; phase=decode"),
    ],
)  # fmt: skip
def test_impossible_offload_options_are_refused_with_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["generate", "--model", "debug", "--num_stacks", "4", *args, "--output_dir", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_stg_predict_shows_the_exposed_copies() -> None:
    args = ["predict", "--model", "debug", "--num_stacks", "4", "--system", "h100-80g"]
    shown = CliRunner().invoke(app, [*args, "--cpu_offloading_num_layers", "2"])
    assert shown.exit_code == 0, shown.output
    assert "host copy" in shown.output
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0 and "host copy" not in plain.output


def test_the_memory_predictor_refuses_what_generation_refuses() -> None:
    o = options(cpu_offloading_num_layers=1, pp=2, num_stacks=4)
    with pytest.raises(OptionError, match="no CPU offloading under pipeline parallelism"):
        predict_memory_options(o, "h100-80g")


def test_explain_names_the_exposed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slow link the critical path runs through the copies: --explain's parts still add
    up to the iteration time, and the copies are a part of their own."""
    monkeypatch.setitem(system_module.HOST_LINK_BYTES_PER_S, "hopper", 1e9)
    registry = load_registry()
    o = options(cpu_offloading_num_layers=2)
    report = predict_time(
        build_workload(o, registry), "h100-80g", kernels=list(registry.kernels), explain=True
    )
    parts = report["explain"]["breakdown_s"]
    assert parts["host copy"] > 0.5 * report["iteration_time_s"]
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=1e-9)


def megatron_layer_bytes(o: GenerateOptions) -> float:
    """What one Megatron-LM layer saves for its backward with Transformer Engine (no
    dropout), per rank and micro-batch: the two norms' inputs and outputs (split over tp
    under sequence parallelism: the column-parallel GEMMs save their local input and gather
    it again), Q, K, V after bias and RoPE (TE v2.10's FusedRoPEFunc saves only the
    frequencies) and the projection input, the MLP's GELU input and output (GPT) or gate,
    up and SwiGLU product (Llama); unfused: the softmax output (Megatron's fused softmax
    saves only its result), fused: the fp32 log-sum-exp per query row and head."""
    b, s, h, f, a, t = o.micro_batch or o.batch, o.seq, o.dmodel, o.dff, o.head, o.tp
    kv, d, e = o.kvhead, o.dmodel // o.head, 2
    norms = 4 * s * b * h / (t if o.tpsp else 1)
    if o.model == "gpt":
        sharded = 4 * s * b * h + 2 * s * b * f
    else:
        sharded = s * b * d * (2 * a + 2 * kv) + 3 * s * b * f
    core = e * a * s * s * b if o.attention == "unfused" else 4 * a * s * b
    return e * (norms + sharded / t) + core / t


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("attention", ["fused", "unfused"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_copies_carry_what_the_memory_predictor_frees(
    tmp_path: Path, model: str, attention: str, tp: int
) -> None:
    """An offloaded layer's copy carries the bytes Megatron-LM's layer saves (a closed form
    from the sources), and the memory predictor frees exactly that, from options and from
    the built workload alike (the copies once carried the graph's pre-bias and pre-RoPE
    tensors, the scores beside the softmax and gathered norm outputs)."""
    kw = {**SMALL, "model": model, "attention": attention, "tp": tp, "kvhead": 2}
    if model == "gpt":
        kw["kvhead"] = kw["head"]
    plain = GenerateOptions(**kw)  # type: ignore[arg-type]
    o = GenerateOptions(**kw, cpu_offloading_num_layers=1)  # type: ignore[arg-type]
    expected = megatron_layer_bytes(o)
    nodes = read_nodes(written(tmp_path, cli_args(o)) / "workload.0.et")
    assert {n.tensor_size for n in nodes if n.type in (STORE, LOAD)} == {expected}
    registry = load_registry()
    for predict in (
        lambda x: predict_memory_options(x, "h100-80g"),
        lambda x: predict_memory(build_workload(x, registry), "h100-80g"),
    ):
        before, after = (predict(x)["classes"][0]["activations"] for x in (plain, o))
        assert before - after == pytest.approx(expected, rel=1e-12)


def test_offload_of_a_hybrid_stack_follows_its_layer_order() -> None:
    """A stack of Mamba, MLP and attention layers (``layer_pattern``) keeps unequal layers:
    the peak under offload is :func:`held_activation_peak` of them in the pattern's order.
    Generation and validation accepted such a plan and the memory predictor refused it
    (it knew the order of the built-in stacks only)."""
    registry = load_registry()
    hybrid = dict(
        model="hybrid", layer_pattern="M-*-", dmodel=256, dff=512, head=4, kvhead=4, seq=256,
        dvocal=1024, num_stacks=4, batch=1, micro_batch=1, ssm_state=16,
    )  # fmt: skip
    base = build_workload(GenerateOptions(**hybrid), registry)
    per_kind = base.rank_classes[0].facts["layer_activation_bytes"]
    layers = [per_kind[k] for k in ("mamba", "mlp", "attention", "mlp")]
    before = predict_memory(base, "h100-80g")["classes"][0]["activations"]
    for offloaded in (1, 2, 3):
        o = GenerateOptions(**hybrid, cpu_offloading_num_layers=offloaded)
        after = predict_memory(build_workload(o, registry), "h100-80g")["classes"][0]
        assert before - after["activations"] == pytest.approx(
            sum(layers) - held_activation_peak(layers, offloaded)
        )
