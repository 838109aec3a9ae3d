"""FSDP2's copy kernels on the compute stream: the copy-out that splits each weight all-gather's
buffer into the unsharded parameters (``foreach_all_gather_copy_out``) and the copy-in that
concatenates the unsharded gradients, cast to the reduce dtype, into the reduce-scatter's
buffer (``foreach_reduce``'s ``chunk_cat``). Their bytes follow from the parameter counts."""

from __future__ import annotations

from collections import Counter

import pytest

from stg.core.lowering import FSDP_COPY_IN, FSDP_COPY_OUT
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import NodeType, node_part
from stg.errors import UserError
from stg.host.registry import load_registry

DMODEL, DFF, DP = 256, 512, 4
SMALL = dict(
    model="llama", dvocal=1000, dmodel=DMODEL, dff=DFF, head=4, kvhead=4, seq=128, batch=4,
    micro_batch=4, num_stacks=2, dp=DP, weight_sharded=True, mixed_precision=True,
    grad_reduce_dtype="fp32",
)  # fmt: skip
# one Llama layer: q, k, v, o (4 h^2, kvhead = head), gate, up, down (3 h f), two RMSNorms
LAYER_PARAMETERS = 4 * DMODEL * DMODEL + 3 * DMODEL * DFF + 2 * DMODEL
PADDED = -(-LAYER_PARAMETERS // DP) * DP  # FSDP's flat buffer, padded to the degree


def rank0_nodes(**kw: object) -> list:
    options = GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]
    return list(build_workload(options, load_registry(autoload=False)).ranks[0].nodes())


def layer_copies(nodes: list, name: str, layer: int = 0) -> list:
    return [n for n in nodes if n.name.endswith(name) and node_part(n) == f"layer{layer}"]


def test_copy_out_moves_the_gathered_parameters_twice() -> None:
    nodes = rank0_nodes()
    copies = layer_copies(nodes, FSDP_COPY_OUT)
    assert len(copies) == 2  # gathered before the forward and again before the backward
    for copy in copies:
        assert copy.type is NodeType.COMP
        # read the bf16 all-gather output, write the bf16 parameters
        assert copy.tensor_size == 2 * 2 * PADDED


def test_copy_in_reads_bf16_gradients_and_writes_the_fp32_buffer() -> None:
    (copy,) = layer_copies(rank0_nodes(), FSDP_COPY_IN)
    assert copy.tensor_size == (2 + 4) * PADDED
    (copy,) = layer_copies(rank0_nodes(grad_reduce_dtype="bf16"), FSDP_COPY_IN)
    assert copy.tensor_size == (2 + 2) * PADDED


def test_the_reduce_scatter_and_the_layers_gemms_wait_for_the_copies() -> None:
    nodes = rank0_nodes()
    by_id = {n.id: n for n in nodes}
    (copy_in,) = layer_copies(nodes, FSDP_COPY_IN)
    reduce = next(n for n in nodes if copy_in.id in n.data_deps)
    assert reduce.type is NodeType.COMM_COLL
    forward_copy = layer_copies(nodes, FSDP_COPY_OUT)[0]
    gather = by_id[next(iter(forward_copy.data_deps))]
    assert gather.type is NodeType.COMM_COLL
    readers = [n for n in nodes if forward_copy.id in n.data_deps]
    # the layer's projections (q, k, v, ...) read its gathered weights
    assert sum(1 for r in readers if r.type is NodeType.COMP and "gemm" in r.attrs) >= 3


def test_the_prefetched_gathers_copy_out_runs_in_its_own_backward() -> None:
    """The gather of layer 0's backward is prefetched from layer 1's pre-backward; its copy
    waits for layer 0's backward (FSDPParamGroup.wait_for_unshard), after layer 1's
    gradients."""
    nodes = rank0_nodes()
    order = [n.id for n in nodes]
    backward_copy = layer_copies(nodes, FSDP_COPY_OUT)[1]
    (layer1_copy_in,) = layer_copies(nodes, FSDP_COPY_IN, layer=1)
    assert order.index(backward_copy.id) > order.index(layer1_copy_in.id)


def test_weights_kept_after_forward_are_copied_once() -> None:
    nodes = rank0_nodes(reshard_after_forward="never")
    assert len(layer_copies(nodes, FSDP_COPY_OUT)) == 1
    assert len(layer_copies(nodes, FSDP_COPY_IN)) == 1


def test_a_float8_all_gather_copies_one_byte_per_weight() -> None:
    nodes = rank0_nodes(dtype="fp8", low_precision_recipe="tensorwise", fp8_param_gather=True)
    (copy, _) = layer_copies(nodes, FSDP_COPY_OUT)
    linear = 4 * DMODEL * DMODEL + 3 * DMODEL * DFF
    # the linears' fp8 weights (1 B) and the norms' bf16 ones (2 B), each buffer padded
    assert 2 * linear <= copy.tensor_size < 2 * (linear + 2 * 2 * DMODEL + 2 * DP * 2)
    (copy_in,) = layer_copies(nodes, FSDP_COPY_IN)
    assert copy_in.tensor_size == (2 + 4) * PADDED  # the gradients stay bf16


def test_no_copies_without_fsdp() -> None:
    nodes = rank0_nodes(weight_sharded=False)
    counts = Counter(n.name.rsplit("/", 1)[-1] for n in nodes)
    assert counts[FSDP_COPY_OUT] == 0 and counts[FSDP_COPY_IN] == 0


def test_megatron_fsdp_has_no_copies() -> None:
    """Megatron-FSDP's parameters are views into its gathered buckets and its gradients live
    in its reduce-scatter buffers: the same collectives, no copy kernels."""
    fsdp2, megatron = rank0_nodes(), rank0_nodes(megatron_fsdp=True)
    names = Counter(n.name.rsplit("/", 1)[-1] for n in megatron)
    assert names[FSDP_COPY_OUT] == 0 and names[FSDP_COPY_IN] == 0
    collectives = [n.comm_size for n in fsdp2 if n.type is NodeType.COMM_COLL]
    assert collectives == [n.comm_size for n in megatron if n.type is NodeType.COMM_COLL]


def test_megatron_fsdp_needs_weight_sharding() -> None:
    with pytest.raises(UserError, match=r"megatron_fsdp .* needs weight_sharded=true"):
        rank0_nodes(weight_sharded=False, megatron_fsdp=True)


def test_a_written_fsdp_trace_with_its_copies_validates_decodes_and_predicts(tmp_path) -> None:
    """The copy kernels meet the consumers' rules (``stg validate``, ASTRA-sim's included),
    decode with mlc-chakra, feed every node once, and the written trace predicts."""
    from consumers import assert_ranks_decode_and_feed
    from typer.testing import CliRunner

    from stg.cli import app

    out = tmp_path / "out"
    args = ["generate", "--output_dir", str(out)]
    for key, value in SMALL.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert any(FSDP_COPY_OUT in line for line in _node_names(out))
    validated = runner.invoke(app, ["validate", str(out)])
    assert validated.exit_code == 0, validated.output
    assert_ranks_decode_and_feed(out)
    predicted = runner.invoke(app, ["predict", str(out), "--predictor", "time", "--json"])
    assert predicted.exit_code == 0, predicted.output


def _node_names(out) -> list[str]:
    from stg.trace.reader import read_nodes

    return [n.name for n in read_nodes(sorted(out.glob("workload.*.et"))[0])]
