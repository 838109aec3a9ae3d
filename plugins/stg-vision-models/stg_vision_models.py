"""An stg plugin: ResNet-50 and VGG-16 on ImageNet (224x224 images, 1000 classes).

Convolutions are plain einsums: the input ``[batch, h, w, c]`` seen as its overlapping
windows ``[batch, h_out, w_out, c, k_h, k_w]`` (``b.windows``, a view: no copy) contracted
with the filters ``[c, k_h, k_w, c_out]``, which costs 2·N·H_out·W_out·C_out·C_in·k² FLOPs
and moves the input, filters and output once, as cuDNN's implicit-GEMM convolutions do.
Batch norm (per-GPU statistics, as data-parallel PyTorch without SyncBatchNorm), ReLU,
pooling and dropout are memory-bound elementwise ops; the classifier is fully connected.

These networks have no repeated layer of one shape, so the whole convolutional body is the
model's embedding part and the classifier its head (``block=None``); they train with data
parallelism and micro-batches only: ``--tp``, ``--sp``/``--cp`` and ``--ep`` other than 1 are
refused, ``--pp`` has no layer stack to split. The image size and the number of classes are
the architecture's (224, 1000); the language-model sizes (``--seq``, ``--dmodel``, ``--dff``,
``--head``, ``--dvocal``, ``--num_stacks``, ...) do not apply and are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import stg
from stg.api import Model
from stg.errors import UserError

if TYPE_CHECKING:  # the builders import the symbolic core when a model is built, not here
    from stg.api import Dim, GraphBuilder, Tensor

__version__ = "0.1.0"

IMAGE = 224
CLASSES = 1000
BATCHNORM_FLOPS = 7  # as LayerNorm: mean, variance (3), normalise (2), scale and shift (2)
RELU_FLOPS = 1
DROPOUT_FLOPS = 2  # compare with the random draw, scale
CROSS_ENTROPY_FLOPS = 5
CROSS_ENTROPY_BACKWARD_FLOPS = 3

RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
"""(width, bottleneck blocks, stride of the first) of each stage: He et al. 2016, Table 1;
the stride sits in the 3x3 convolution (ResNet v1.5, torchvision's)."""
BOTTLENECK_EXPANSION = 4
VGG16_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))
"""(channels, 3x3 convolutions) of each stage of VGG-16 (Simonyan & Zisserman 2015,
Table 1, configuration D), each stage ending in a 2x2 max-pool."""
VGG16_FC = (4096, 4096)


def size_dim(prefix: str, size: int) -> Dim:
    """A dimension of fixed size, named after it (``h56``, ``c256``): same name, same size."""
    import sympy

    from stg.api import Dim

    return Dim(f"{prefix}{size}", sympy.Integer(size))


def data_parallel_only(b: GraphBuilder, model: str) -> None:
    """Refuse the parallelism a convolutional network here does not split by."""
    for axis in ("tp", "sp", "ep"):
        degree = b.options.get(axis, 1)
        if degree != 1:
            raise UserError(
                f"model {model!r} trains with data parallelism only: {axis}={degree} is not "
                f"allowed; allowed: {axis}=1 (with --dp and --micro_batch)"
            )


def conv(
    b: GraphBuilder, x: Tensor, name: str, out: int, k: int, stride: int = 1, bias: bool = False
) -> Tensor:
    """A k x k convolution of ``x`` [batch, h, w, c] to ``out`` channels, padding k // 2."""
    batch, h, _, c = x.dims  # square: h = w
    size = (int(h.size) + 2 * (k // 2) - k) // stride + 1
    ho, wo, co = size_dim("h", size), size_dim("w", size), size_dim("c", out)
    if k == 1 and stride == 1:
        y = b.einsum("bhwc,co->bhwo", x, b.weight(name, [c, co]), name=name)
    elif k == 1:
        windows = b.windows(x, [batch, ho, wo, c], name=f"{name}_windows")
        y = b.einsum("bhwc,co->bhwo", windows, b.weight(name, [c, co]), name=name)
    else:
        kh, kw = size_dim("kh", k), size_dim("kw", k)
        windows = b.windows(x, [batch, ho, wo, c, kh, kw], name=f"{name}_windows")
        filters = b.weight(name, [c, kh, kw, co])
        y = b.einsum("bhwckl,cklo->bhwo", windows, filters, name=name)
    if bias:
        y = b.elementwise(f"{name}_bias", y, b.weight(f"{name}.bias", [co]))
    return y


def batchnorm(b: GraphBuilder, x: Tensor, name: str) -> Tensor:
    c = x.dims[-1]
    gamma, beta = b.weight(f"{name}.weight", [c]), b.weight(f"{name}.bias", [c])
    return b.elementwise(name, x, gamma, beta, flops=BATCHNORM_FLOPS)


def relu(b: GraphBuilder, x: Tensor, name: str) -> Tensor:
    return b.elementwise(name, x, flops=RELU_FLOPS, backward_flops=RELU_FLOPS)


def maxpool(b: GraphBuilder, x: Tensor, name: str, k: int, stride: int) -> Tensor:
    """Max over k x k windows: k² comparisons per output element; the backward routes each
    gradient to its window's maximum (one op per input element)."""
    import sympy

    batch, h, w, c = x.dims
    size = (int(h.size) + 2 * ((k - 1) // 2) - k) // stride + 1
    out = [batch, size_dim("h", size), size_dim("w", size), c]
    per_input = sympy.Rational(k * k * size * size, int(h.size) * int(w.size))
    return b.custom(name, [x], out, flops=per_input, backward_flops=1)


def images(b: GraphBuilder) -> Tensor:
    side = (size_dim("h", IMAGE), size_dim("w", IMAGE))
    return b.data("images", [b.dim("batch"), *side, size_dim("c", 3)])


def classify(b: GraphBuilder, x: Tensor, name: str) -> Tensor:
    """Fully connected layer to the classes, with its bias, and the cross-entropy loss."""
    classes = size_dim("classes", CLASSES)
    logits = linear(b, x, name, classes)
    return b.custom(
        "cross_entropy",
        [logits],
        [b.dim("batch")],
        flops=CROSS_ENTROPY_FLOPS,
        backward_flops=CROSS_ENTROPY_BACKWARD_FLOPS,
        out_dtype="fp32",
    )


def linear(b: GraphBuilder, x: Tensor, name: str, out: Dim) -> Tensor:
    y = b.einsum("bc,cn->bn", x, b.weight(name, [x.dims[-1], out]), name=name)
    return b.elementwise(f"{name}_bias", y, b.weight(f"{name}.bias", [out]))


# -- ResNet-50 ---------------------------------------------------------------------------------


def bottleneck(b: GraphBuilder, x: Tensor, name: str, width: int, stride: int) -> Tensor:
    """1x1 reduce, 3x3 (with the stride), 1x1 expand, each with batch norm; a projection
    shortcut (1x1 convolution and batch norm) where the shape changes."""
    out = width * BOTTLENECK_EXPANSION
    y = relu(b, batchnorm(b, conv(b, x, f"{name}_conv1", width, 1), f"{name}_bn1"), f"{name}_relu1")
    y = conv(b, y, f"{name}_conv2", width, 3, stride)
    y = relu(b, batchnorm(b, y, f"{name}_bn2"), f"{name}_relu2")
    y = batchnorm(b, conv(b, y, f"{name}_conv3", out, 1), f"{name}_bn3")
    shortcut = x
    if stride != 1 or int(x.dims[-1].size) != out:
        shortcut = conv(b, x, f"{name}_downsample", out, 1, stride)
        shortcut = batchnorm(b, shortcut, f"{name}_downsample_bn")
    return relu(b, b.add(y, shortcut, name=f"{name}_add"), f"{name}_relu3")


def resnet50_body(b: GraphBuilder, x: None) -> Tensor:
    """The stem (7x7/2 convolution, 3x3/2 max-pool) and the four stages of bottlenecks."""
    data_parallel_only(b, "resnet50")
    y = conv(b, images(b), "conv1", 64, 7, 2)
    y = maxpool(b, relu(b, batchnorm(b, y, "bn1"), "relu"), "maxpool", 3, 2)
    for stage, (width, blocks, stride) in enumerate(RESNET50_STAGES, start=1):
        for block in range(blocks):
            y = bottleneck(b, y, f"layer{stage}_{block}", width, stride if block == 0 else 1)
    return y


def global_average_pool(b: GraphBuilder, x: Tensor) -> Tensor:
    batch, _, _, c = x.dims
    return b.custom("avgpool", [x], [batch, c], flops=1, backward_flops=1)


def resnet50_head(b: GraphBuilder, x: Tensor) -> Tensor:
    return classify(b, global_average_pool(b, x), "fc")


# -- VGG-16 ------------------------------------------------------------------------------------


def vgg16_body(b: GraphBuilder, x: None) -> Tensor:
    """Thirteen 3x3 convolutions with biases and ReLU in five stages, each max-pooled 2x2."""
    data_parallel_only(b, "vgg16")
    y = images(b)
    for stage, (channels, convs) in enumerate(VGG16_STAGES, start=1):
        for i in range(1, convs + 1):
            y = conv(b, y, f"conv{stage}_{i}", channels, 3, bias=True)
            y = relu(b, y, f"relu{stage}_{i}")
        y = maxpool(b, y, f"pool{stage}", 2, 2)
    return y


def vgg16_head(b: GraphBuilder, x: Tensor) -> Tensor:
    """fc6 and fc7 (4096, ReLU, dropout), fc8 to the classes, the loss."""
    batch, h, w, c = x.dims
    features = size_dim("features", int(h.size) * int(w.size) * int(c.size))
    y = b.view(x, [batch, features], name="flatten")
    for i, width in enumerate(VGG16_FC, start=6):
        y = relu(b, linear(b, y, f"fc{i}", size_dim("c", width)), f"relu{i}")
        y = b.elementwise(f"dropout{i}", y, flops=DROPOUT_FLOPS, backward_flops=1)
    return classify(b, y, "fc8")


MODELS: Sequence[Model] = (
    Model(
        "resnet50",
        embedding=resnet50_body,
        block=None,
        head=resnet50_head,
        description="ResNet-50 (v1.5) on 224x224 ImageNet images: data parallelism only",
    ),
    Model(
        "vgg16",
        embedding=vgg16_body,
        block=None,
        head=vgg16_head,
        description="VGG-16 (configuration D) on 224x224 ImageNet images: data parallelism only",
    ),
)


@stg.hookimpl
def stg_register_models(register):  # type: ignore[no-untyped-def]
    for model in MODELS:
        register(model)
