"""Models without a layer stack (``block=None``, convolutional networks) and convolutions as
einsums over window views (``GraphBuilder.windows``), on a tiny network written here."""

from __future__ import annotations

import pytest
import sympy

from stg.api import Dim, GenerateOptions, GraphBuilder, Model, NodeType, Tensor
from stg.core.modelinfo import describe_model, model_parameters
from stg.core.options import OptionError
from stg.core.pipeline import symbol_values
from stg.testing import check_model


def fixed(name: str, size: int) -> Dim:
    return Dim(name, sympy.Integer(size))


H, W, C, OUT, CLASSES = (
    fixed("h8", 8),
    fixed("w8", 8),
    fixed("c4", 4),
    fixed("c16", 16),
    fixed("n10", 10),
)
K, KW = fixed("kh3", 3), fixed("kw3", 3)


def body(b: GraphBuilder, x: None) -> Tensor:
    images = b.data("images", [b.dim("batch"), H, W, C])
    windows = b.windows(images, [b.dim("batch"), H, W, C, K, KW], name="conv_windows")
    y = b.einsum("bhwckl,cklo->bhwo", windows, b.weight("conv", [C, K, KW, OUT]), name="conv")
    return b.elementwise("relu", y, flops=1, backward_flops=1)


def head(b: GraphBuilder, x: Tensor) -> Tensor:
    pooled = b.custom("avgpool", [x], [b.dim("batch"), OUT], flops=1, backward_flops=1)
    logits = b.einsum("bc,cn->bn", pooled, b.weight("fc", [OUT, CLASSES]), name="fc")
    return b.custom("loss", [logits], [b.dim("batch")], flops=5, backward_flops=3)


TINY_CNN = Model("tiny-cnn", embedding=body, block=None, head=head)


def nodes(**kw) -> dict[str, object]:
    workload = check_model(TINY_CNN, batch=4, micro_batch=4, **kw)
    return {n.name: n for n in workload.ranks[0].nodes()}


def test_a_convolution_is_an_einsum_over_windows_that_moves_its_input_once() -> None:
    n = nodes(dp=2)  # 2 images per rank
    conv = n["mb0/embedding/conv"]
    assert conv.num_ops == 2 * 2 * 8 * 8 * 16 * 4 * 9  # 2·N·Hout·Wout·Cout·Cin·k²
    assert conv.attrs["gemm"] == (1, 2 * 8 * 8, 16, 4 * 9) and conv.attrs["implicit_gemm"] == 1
    image, filters, out = 2 * 8 * 8 * 4 * 2, 4 * 9 * 16 * 2, 2 * 8 * 8 * 16 * 2
    assert conv.tensor_size == image + filters + out  # not the 9x larger window matrix
    # the images need no gradient: the weight gradient only, which reads them once
    grads = [k for k in n if k.startswith("mb0/embedding/bwd/conv.")]
    assert grads == ["mb0/embedding/bwd/conv.grad_conv"]
    assert n["mb0/embedding/bwd/conv.grad_conv"].tensor_size == image + 4 * 9 * 16 * 2 + out
    assert any(v.type is NodeType.COMM_COLL for v in n.values())  # the gradient all-reduce


def test_the_head_receives_the_bodys_output_and_there_are_no_layers() -> None:
    n = nodes()
    assert not any("/layer" in name for name in n)
    assert "mb0/head/fwd/avgpool" in n and "mb0/head/fwd/fc" in n
    o = GenerateOptions(model="x", batch=1)
    counts = model_parameters(TINY_CNN, o, symbol_values(o))
    assert counts["parameters"] == 4 * 9 * 16 + 16 * 10
    report = describe_model(TINY_CNN, o, symbol_values(o))
    assert set(report["parts"]) == {"embedding", "head"}
    # saved for the backward: the images (not their windows), the conv output (the ReLU's
    # input), the ReLU's output (the pool's input), the pooled features and the logits
    saved = 8 * 8 * 4 * 2 + 2 * 8 * 8 * 16 * 2 + 16 * 2 + 10 * 2
    activation = sum(report["parts"][p]["activation_bytes"]["value"] for p in report["parts"])
    assert activation == saved


def test_no_layer_stack_means_no_pipeline_stages() -> None:
    with pytest.raises(OptionError, match=r"has no layer stack to split into pipeline stages"):
        check_model(TINY_CNN, batch=4, pp=2)


def test_no_layer_stack_means_nothing_to_recompute() -> None:
    with pytest.raises(OptionError, match=r"no layer stack to recompute: activation_recompute"):
        check_model(TINY_CNN, batch=4, activation_recompute="full")


def test_no_layer_stack_means_no_serving_phases() -> None:
    with pytest.raises(OptionError, match=r"no layer stack to serve token by token: phase="):
        check_model(TINY_CNN, batch=4, phase="prefill")
