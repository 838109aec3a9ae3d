"""The vision model plugin: published sizes, FLOPs summed from the written files (decoded by
mlc-chakra) against closed forms, convolutions priced as implicit GEMMs, data parallelism
only, and the predictors and the precision planner on these models."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import stg_vision_models as vision
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner

from stg.api import GenerateOptions, NodeType, build_workload
from stg.cli import app
from stg.testing import check_model, make_registry

runner = CliRunner()
PLUGIN = ["-p", "stg_vision_models"]


def resnet50_macs() -> tuple[int, list[tuple[str, int]]]:
    """Multiply-adds of one 224x224 image through ResNet-50 v1.5, layer by layer from He et
    al. 2016, Table 1 (stride in the 3x3 convolution), and the (name, Cin·k²) of each conv."""
    convs: list[tuple[str, int, int, int, int]] = [("conv1", 112, 3, 64, 7)]  # name, out, cin...
    cin, side = 64, 56
    for stage, (width, blocks, stride) in enumerate(vision.RESNET50_STAGES, start=1):
        for block in range(blocks):
            s = stride if block == 0 else 1
            out_side = side // s
            name = f"layer{stage}_{block}"
            convs += [(f"{name}_conv1", side, cin, width, 1)]
            convs += [(f"{name}_conv2", out_side, width, width, 3)]
            convs += [(f"{name}_conv3", out_side, width, 4 * width, 1)]
            if block == 0:
                convs += [(f"{name}_downsample", out_side, cin, 4 * width, 1)]
            cin, side = 4 * width, out_side
    macs = sum(o * o * ci * co * k * k for _, o, ci, co, k in convs) + 2048 * 1000
    return macs, [(n, ci * k * k) for n, _, ci, _, k in convs]


def vgg16_macs() -> int:
    """Multiply-adds of one 224x224 image through VGG-16 (configuration D)."""
    macs, cin, side = 0, 3, 224
    for channels, convs in vision.VGG16_STAGES:
        for _ in range(convs):
            macs += side * side * cin * channels * 9
            cin = channels
        side //= 2
    return macs + 7 * 7 * 512 * 4096 + 4096 * 4096 + 4096 * 1000


def build(registry, model: str, **kw):
    return build_workload(GenerateOptions(model=model, **kw), registry)


def forward_gemm_flops(workload) -> int:
    return sum(
        n.num_ops
        for n in workload.ranks[0].nodes()
        if n.type is NodeType.COMP and "gemm" in n.attrs and "/bwd/" not in n.name
    )


def test_published_sizes_and_flops(stg_registry) -> None:
    """torchvision's counts (resnet50: 25,557,032 parameters, 4.09 GFLOPS as multiply-adds;
    vgg16: 138,357,544, 15.47), within 1% of the papers' 25.6M and 138M."""
    registry = stg_registry(vision)
    assert {"resnet50", "vgg16"} <= set(registry.models.names())
    for model, parameters, published, macs in (
        ("resnet50", 25_557_032, 25.6e6, resnet50_macs()[0]),
        ("vgg16", 138_357_544, 138e6, vgg16_macs()),
    ):
        w = build(registry, model, batch=1)
        assert w.rank_classes[0].facts["parameters"] == parameters
        assert abs(parameters / published - 1) < 0.01
        assert forward_gemm_flops(w) == 2 * macs
    assert resnet50_macs()[0] == 4_089_184_256 and vgg16_macs() == 15_470_264_320


def official_nodes(directory: Path) -> list:
    nodes = []
    for path in sorted(directory.glob("workload.*.et")):
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            while True:
                node = et_def_pb2.Node()
                if not protolib.decodeMessage(f, node):
                    break
                nodes.append(node)
    return nodes


@pytest.mark.parametrize("model", ["resnet50", "vgg16"])
def test_written_flops_are_three_passes_of_the_convolutions(tmp_path: Path, model) -> None:
    """Every conv and fc runs forward, data gradient and weight gradient (2·MACs each), but
    the first conv has no data gradient (images need none); summed from mlc-chakra's reading
    of the files that `stg generate` writes for dp 2, and `stg validate` passes them."""
    out = tmp_path / "out"
    args = [*PLUGIN, "generate", "--model", model, "--dp", "2", "--batch", "4"]
    result = runner.invoke(app, [*args, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, [*PLUGIN, "validate", str(out)]).exit_code == 0
    gemm: Counter[str] = Counter()
    for node in official_nodes(out):
        attrs = {a.name for a in node.attr}
        if node.type == et_def_pb2.COMP_NODE and "gemm" in attrs:
            num_ops = next(a.int64_val for a in node.attr if a.name == "num_ops")
            gemm["bwd" if "/bwd/" in node.name else "fwd"] += num_ops
    macs = resnet50_macs()[0] if model == "resnet50" else vgg16_macs()
    first = 112 * 112 * 3 * 64 * 49 if model == "resnet50" else 224 * 224 * 3 * 64 * 9
    assert gemm["fwd"] == 2 * 4 * macs  # 4 images over the two ranks
    assert gemm["bwd"] == 2 * 2 * 4 * macs - 2 * 4 * first


def test_a_convolution_moves_its_input_once(stg_registry) -> None:
    """A 3x3 convolution reads its input, not the 9x larger window matrix its GEMM shape
    implies: tensor_size is input + filters + output; the predictor prices it so."""
    w = build(stg_registry(vision), "resnet50", batch=32)
    nodes = {n.name: n for n in w.ranks[0].nodes()}
    conv = nodes["mb0/embedding/layer1_0_conv2"]
    assert conv.attrs["gemm"] == (1, 32 * 56 * 56, 64, 64 * 9)
    assert conv.attrs["implicit_gemm"] == 1
    assert conv.tensor_size == 2 * (32 * 56 * 56 * 64 * 2 + 64 * 9 * 64)
    assert "implicit_gemm" not in nodes["mb0/embedding/layer1_0_conv1"].attrs  # 1x1: a GEMM
    dgrad = nodes["mb0/embedding/bwd/layer1_0_conv2.grad_layer1_0_conv2_windows"]
    assert dgrad.tensor_size == conv.tensor_size


def test_data_parallel_only_and_no_layer_stack(stg_registry, tmp_path: Path) -> None:
    registry = stg_registry(vision)
    check_model("resnet50", registry=registry, dp=2)
    for option, message in (
        ("--tp", "model 'resnet50' trains with data parallelism only: tp=2 is not allowed"),
        ("--pp", "model 'resnet50' has no layer stack to split into pipeline stages: pp=2"),
    ):
        out = tmp_path / option.strip("-")
        args = [*PLUGIN, "generate", "--model", "resnet50", option, "2", "--batch", "4"]
        result = runner.invoke(app, [*args, "--output_dir", str(out)])
        assert result.exit_code == 2 and result.output.startswith(f"error: {message}")
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    # the language-model sizes do not apply: the same nodes whatever they say
    a = build(registry, "vgg16", batch=2, dp=2)
    b = build(registry, "vgg16", batch=2, dp=2, num_stacks=3, seq=77, dmodel=96, head=4, kvhead=2)
    assert a.ranks[0].rank_class.nodes == b.ranks[0].rank_class.nodes


def test_predicted_time_and_memory_with_data_parallelism(stg_registry) -> None:
    """Samples per second instead of tokens; activations from the generated graph (what the
    model saves per micro-batch), held for one micro-batch under 1F1B and for all under
    GPipe."""
    result = runner.invoke(
        app, [*PLUGIN, "predict", "--model", "resnet50", "--dp", "2", "--batch", "64", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert "tokens_per_s" not in report["time"]
    assert report["time"]["samples_per_s"] == pytest.approx(64 / report["time"]["iteration_time_s"])
    registry = stg_registry(vision)
    w = build(registry, "resnet50", batch=64, dp=2)
    saved = w.rank_classes[0].facts["activation_bytes"]
    (memory,) = report["memory"]["classes"]
    assert memory["activations"] == saved
    assert 1.5e9 < saved < 2.5e9  # 32 images of bf16 activations
    gpipe = build(registry, "resnet50", batch=64, micro_batch=32, dp=2, pipeline_schedule="gpipe")
    assert gpipe.rank_classes[0].facts["activation_bytes"] == saved // 2


def test_precision_planner_names_the_convolutions(tmp_path: Path) -> None:
    """The planner's candidates are the convolutions and the classifier, by their names; a
    planned convolution casts its input once, not its windows."""
    args = [*PLUGIN, "plan", "precision", "--model", "resnet50", "--dp", "2", "--batch", "64"]
    args += ["--system", "h100-80g", "--dtypes", "bf16,int8", "--out", str(tmp_path / "p.json")]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    planned, _ = json.JSONDecoder().raw_decode(result.stdout)
    candidates = {op for op, _ in planned["candidates"]}
    # every matmul that reaches a GEMM's arithmetic intensity (32 FLOP/B, stg.perf.system):
    # all but the first bottleneck's 1x1 convolution of 64 to 64 channels (2·64·64 FLOPs
    # per 4·64 bytes of pixel in and out: 32, less the filters) and the classifier (32
    # images against 2048x1000 weights)
    convs = {name for name, _ in resnet50_macs()[1]}
    assert candidates == convs - {"layer1_0_conv1"}
    o = GenerateOptions(model="resnet50", batch=8, precision=(("layer1_0_conv2", "int8"),))
    w = build_workload(o, make_registry(vision))
    casts = {n.name: n.num_ops for n in w.ranks[0].nodes() if ".cast_" in n.name}
    assert casts["mb0/embedding/layer1_0_conv2.cast_layer1_0_conv2_windows"] == 8 * 56 * 56 * 64


def test_gradients_are_reduced_in_ddp_buckets(stg_registry) -> None:
    """The body's gradients are all-reduced in PyTorch DDP's buckets (1 MiB first, then
    25 MiB, in the reverse order of the weights), each waiting only for its own gradients, so
    that all but the last overlap the backward; the classifier's in one."""
    w = build(stg_registry(vision), "resnet50", batch=8, dp=2)
    nodes = list(w.ranks[0].nodes())
    reduce = [n for n in nodes if n.type is NodeType.COMM_COLL]
    # first bucket: layer4_2's bn3 bias and scale and its conv3 filters, in bf16
    assert [n.comm_size for n in reduce] == [
        2 * 2049000, 2 * (2048 * 2 + 512 * 2048), 26_773_504, 18_137_216
    ]  # fmt: skip
    assert sum(n.comm_size for n in reduce) == 2 * 25_557_032
    last_backward = max(n.id for n in nodes if "/bwd/" in n.name)
    first_body_bucket = reduce[1]
    assert max(first_body_bucket.data_deps) < last_backward - 300  # overlaps the backward


def test_loading_the_plugin_leaves_the_symbolic_core_for_its_builders() -> None:
    """`stg --help` imports every installed plugin: this one registers its models without
    sympy, which its builders import when a model is built."""
    check = (
        "import sys, stg_vision_models as vision; models = []; "
        "vision.stg_register_models(models.append); "
        "assert {m.name for m in models} == {'resnet50', 'vgg16'}; print('sympy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
