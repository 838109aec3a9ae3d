"""``--profile torchtitan``: torchtitan's Llama in eager PyTorch (pytorch/torchtitan 1ea476e9f),
whose rotary embedding, ``repeat_kv``, SwiGLU, fp32 RMSNorm (``--norm_type rmsnorm``) and fp32
logits run as the aten kernels they are (:mod:`stg.core.torchtitan`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.plan import make_plan
from stg.core.torchtitan import EAGER_KERNEL_BYTES_ATTR, EAGER_KERNELS_ATTR
from stg.core.workload import NodeTemplate, NodeType
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.costs import EAGER_OP_HOST_S, compute_time, eager_kernels_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system
from stg.trace.reader import read_nodes

RUNS = Path(__file__).parent / "data" / "runs" / "cluster_runs.json"

# one layer: 8 query heads of 32 in 4 groups of 2 key/value heads, FFN 512, 2 x 128 tokens
B, S, D, HEADS, KV, DFF, VOCAB = 2, 128, 256, 8, 2, 512, 1000
HD = D // HEADS
SMALL = {
    "model": "llama", "dvocal": VOCAB, "dmodel": D, "dff": DFF, "head": HEADS, "kvhead": KV,
    "num_stacks": 1, "batch": B, "seq": S, "causal": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def registry():  # type: ignore[no-untyped-def]
    return load_registry(autoload=False)


def _comp_nodes(options: GenerateOptions, registry) -> dict[str, NodeTemplate]:  # type: ignore[no-untyped-def]
    workload = build_workload(options, registry)
    return {n.name: n for n in workload.ranks[0].rank_class.nodes if n.type is NodeType.COMP}


def test_eager_bytes_of_one_layer_in_closed_form(registry) -> None:  # type: ignore[no-untyped-def]
    """Each node's bytes are its kernels' operands (bf16 2 B, fp32 4 B, complex64 8 B per
    element), read once and written once:

    - RoPE of ``n`` elements: bf16 -> fp32 copy (2 + 4), complex multiply (4 + 4) reading
      ``freqs_cis`` (``F`` = s·dhead/2·8 B), fp32 -> bf16 copy (4 + 2): 20·n + F forward; the
      same backward plus the copy of ``freqs_cis.conj()`` (2F): 20·n + 3F;
    - ``repeat_kv`` of K and of V (``m`` elements each, group ``r``): a copy (2m + 2rm) each
      forward, a sum (2rm + 2m) each backward, with RoPE of K;
    - SwiGLU over ``f`` elements: silu (2 + 2), mul (2 + 2 + 2) forward: 10f; the gate's
      gradient mul and silu_backward (6 + 6): 12f; the up's mul: 6f;
    - fp32 RMSNorm over ``n`` elements in ``R`` rows of ``d``: 36n + 24R + 2d forward, 84n +
      40R + 2d for the input's gradient, 8n + 2d for the weight's;
    - fp32 cross-entropy over ``v`` logits in ``R`` rows: 14v + 12R + 8 forward (copy 6v,
      log-softmax 8v, the targets' log-probabilities and int64 targets, loss and weight),
      22v + 12R backward (zeroed gradient 4v with the targets, log-softmax backward 12v,
      copy back 6v)."""
    options = GenerateOptions(**SMALL, profile="torchtitan", norm_type="rmsnorm")
    nodes = {name.rsplit("/", 1)[-1]: n for name, n in _comp_nodes(options, registry).items()}
    q, m, group = B * S * HEADS * HD, B * S * KV * HD, HEADS // KV
    freqs = S * HD // 2 * 8
    f, n, rows, v = B * S * DFF, B * S * D, B * S, B * S * VOCAB
    repeat = 2 * (2 * m + 2 * group * m)
    expected = {
        "rope_q": 20 * q + freqs,
        "rope_q.grad_q": 20 * q + 3 * freqs,
        "rope_k": 20 * m + freqs + repeat,
        "rope_k.grad_k": 20 * m + 3 * freqs + repeat,
        "swiglu": 10 * f,
        "swiglu.grad_gate": 12 * f,
        "swiglu.grad_up": 6 * f,
        "attention_norm": 36 * n + 24 * rows + 2 * D,
        "attention_norm.grad_x": 84 * n + 40 * rows + 2 * D,
        "attention_norm.grad_attention_norm.weight": 8 * n + 2 * D,
        "ffn_norm": 36 * n + 24 * rows + 2 * D,
        "ffn_norm.grad_residual1": 84 * n + 40 * rows + 2 * D,
        "ffn_norm.grad_ffn_norm.weight": 8 * n + 2 * D,
        "ln_f": 36 * n + 24 * rows + 2 * D,
        "ln_f.grad_x": 84 * n + 40 * rows + 2 * D,
        "ln_f.grad_ln_f.weight": 8 * n + 2 * D,
        "cross_entropy": 14 * v + 12 * rows + 8,
        "cross_entropy.grad_logits": 22 * v + 12 * rows,
    }
    for op, nbytes in expected.items():
        node = nodes[op]
        assert node.tensor_size == nbytes, op
        assert sum(node.attrs[EAGER_KERNEL_BYTES_ATTR]) == nbytes, op
    counts = {op: len(nodes[op].attrs[EAGER_KERNELS_ATTR]) for op in expected}
    assert counts["rope_k"] == 5 and counts["rope_q.grad_q"] == 4
    assert counts["attention_norm"] == 8 and counts["attention_norm.grad_x"] == 14
    assert nodes["cross_entropy"].attrs[EAGER_KERNELS_ATTR][1] == "log_softmax:fp32"
    with_kernels = {op for op, node in nodes.items() if EAGER_KERNELS_ATTR in node.attrs}
    assert with_kernels == set(expected)


def test_fused_rmsnorm_and_multi_head_attention_keep_their_nodes(registry) -> None:  # type: ignore[no-untyped-def]
    """torchtitan's default ``fused_rmsnorm`` is one Triton kernel, as stg prices a norm; with
    as many key/value heads as query heads ``repeat_kv`` returns its input (no copy)."""
    fused = {
        name.rsplit("/", 1)[-1]: n
        for name, n in _comp_nodes(
            GenerateOptions(**{**SMALL, "kvhead": HEADS}, profile="torchtitan"), registry
        ).items()
    }
    megatron = {
        name.rsplit("/", 1)[-1]: n
        for name, n in _comp_nodes(GenerateOptions(**{**SMALL, "kvhead": HEADS}), registry).items()
    }
    assert EAGER_KERNELS_ATTR not in fused["attention_norm"].attrs
    assert fused["attention_norm"].tensor_size == megatron["attention_norm"].tensor_size
    k = B * S * HEADS * HD
    assert fused["rope_k"].tensor_size == 20 * k + S * HD // 2 * 8
    assert len(fused["rope_k"].attrs[EAGER_KERNELS_ATTR]) == 3


@pytest.mark.parametrize("profile", ["megatron", "eager", "compiled"])
def test_other_profiles_carry_no_eager_kernels(registry, profile: str) -> None:  # type: ignore[no-untyped-def]
    """The kernels are torchtitan's: other profiles' workloads keep their bytes, but for the
    eager profile's loss on fp32 logits (``tests/test_eager_cross_entropy.py``)."""
    nodes = _comp_nodes(GenerateOptions(**SMALL, profile=profile), registry)
    loss = {k for k in nodes if k.split("/")[-1].startswith("cross_entropy")}
    loss = loss if profile == "eager" else set()
    assert loss or profile != "eager"
    assert {k for k, n in nodes.items() if EAGER_KERNELS_ATTR in n.attrs} == loss
    megatron = _comp_nodes(GenerateOptions(**SMALL), registry)
    assert {k: n.tensor_size for k, n in nodes.items() if k not in loss} == {
        k: n.tensor_size for k, n in megatron.items() if k not in loss
    }


@pytest.mark.parametrize(
    ("recompute", "rerun"),
    [
        ("none", set()),
        # torchtitan's op-level checkpointing saves only matmul and SDPA outputs
        ("selective_op", {"attention_norm", "rope_q", "rope_k", "ffn_norm", "swiglu"}),
        ("full", {"attention_norm", "rope_q", "rope_k", "ffn_norm", "swiglu"}),
    ],
)
def test_checkpointing_reruns_the_eager_kernels(registry, recompute: str, rerun: set[str]) -> None:  # type: ignore[no-untyped-def]
    options = GenerateOptions(
        **SMALL, profile="torchtitan", norm_type="rmsnorm", activation_recompute=recompute
    )
    nodes = _comp_nodes(options, registry)
    recomputed = {
        name.rsplit("/", 1)[-1]
        for name, n in nodes.items()
        if "/recompute/" in name and EAGER_KERNELS_ATTR in n.attrs
    }
    assert recomputed == rerun


def _node(kinds: tuple[str, ...], sizes: tuple[int, ...]) -> NodeTemplate:
    return NodeTemplate(
        id=0, name="rope_q", type=NodeType.COMP, num_ops=1 << 20, tensor_size=sum(sizes),
        dtype="bf16",
        attrs={"op": "rope_q", EAGER_KERNELS_ATTR: kinds, EAGER_KERNEL_BYTES_ATTR: sizes},
    )  # fmt: skip


def test_each_eager_kernel_is_a_memory_bound_kernel_with_its_launch() -> None:
    system = load_system("a100-80g")
    kinds = ("stream:fp32", "softmax:fp32", "stream:bf16")
    sizes = (3 << 28, 4 << 28, 3 << 27)
    expected = sum(
        memory_bound_time(system.gpu, nbytes, kind.split(":")[0], kind.split(":")[1])
        + system.kernel_overhead
        for kind, nbytes in zip(kinds, sizes, strict=True)
    )
    node = _node(kinds, sizes)
    assert eager_kernels_time(node, system) == pytest.approx(expected)
    assert compute_time(node, system, profile="torchtitan") == pytest.approx(expected)
    # small kernels: the host's dispatch of each op is longer
    assert compute_time(_node(kinds, (64, 64, 64)), system) == 3 * EAGER_OP_HOST_S
    with pytest.raises(UserError, match="the same kernels"):
        eager_kernels_time(_node(kinds, (64, 64)), system)
    with pytest.raises(UserError, match="eager kernel class 'scan'"):
        eager_kernels_time(_node(("scan:bf16",), (64,)), system)


def test_eager_kernels_survive_the_trace(tmp_path: Path, registry) -> None:  # type: ignore[no-untyped-def]
    """A trace written and read back meets ASTRA-sim's rules (``stg validate``) and prices the
    kernels as the workload in memory does."""
    out = tmp_path / "tt"
    args = ["generate", "--output_dir", str(out), "--profile", "torchtitan",
            "--norm_type", "rmsnorm", *(f"--{k}={v}" for k, v in SMALL.items())]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    checked = CliRunner().invoke(app, ["validate", "--consumer", "astra-sim", str(out)])
    assert checked.exit_code == 0, checked.output
    read = {n.name: n for n in read_nodes(out / "workload.0.et")}
    memory = _comp_nodes(
        GenerateOptions(**SMALL, profile="torchtitan", norm_type="rmsnorm"), registry
    )
    system = load_system("a100-80g")
    name = "mb0/layer0/bwd/attention_norm.grad_x"
    assert (
        tuple(read[name].attrs[EAGER_KERNEL_BYTES_ATTR])
        == memory[name].attrs[EAGER_KERNEL_BYTES_ATTR]
    )
    assert compute_time(read[name], system, profile="torchtitan") == pytest.approx(
        compute_time(memory[name], system, profile="torchtitan")
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"norm_type": "rmsnorm"}, "norm_type=rmsnorm is torchtitan's model.norm_type: "
         "profile=megatron is not allowed; allowed: profile=torchtitan"),
        ({"profile": "torchtitan", "norm_type": "layernorm"},
         "norm_type='layernorm' must be one of fused_rmsnorm, rmsnorm"),
        ({"profile": "torchtitan", "model": "gpt"},
         "model=gpt is not allowed; allowed: model=llama"),
        ({"profile": "torchtitan", "dtype": "fp8"}, "dtype=fp8 is not allowed"),
        ({"profile": "torchtitan", "attention": "unfused"}, "attention=unfused is not allowed"),
        ({"profile": "torchtitan", "phase": "prefill"}, "phase=prefill is not allowed"),
    ],
)  # fmt: skip
def test_what_torchtitan_did_not_run_is_refused(options: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        make_plan(GenerateOptions(**{**SMALL, **options}))


def test_norm_type_without_the_profile_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = CliRunner().invoke(
        app, ["generate", "--model", "llama", "--norm_type", "rmsnorm", "--output_dir", str(out)]
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: norm_type=rmsnorm is torchtitan's model.norm_type: profile=megatron is not "
        "allowed; allowed: profile=torchtitan"
    ]
    assert not out.exists()


def test_tt2408_rows_spell_torchtitans_eager_llama() -> None:
    """torchtitan's rows of 1ea476e9f ran eagerly (``compile = false``): they run under
    ``torchtitan``, with the ``norm_type`` of their ``train_configs`` (``rmsnorm`` in
    ``llama2_70b.toml`` and ``llama3_70b.toml``, ``fused_rmsnorm`` in the 8B and 13B ones), and
    say so in their assumptions."""
    rows = [e for e in json.loads(RUNS.read_text())["entries"] if e["id"].startswith("tt2408-")]
    assert len(rows) == 6
    for row in rows:
        options = row["options"]
        assert options["profile"] == "torchtitan", row["id"]
        norm = "rmsnorm" if row["model"].endswith("-70b") else None
        assert options.get("norm_type") == norm, row["id"]
        assert any("--profile torchtitan" in a for a in row["assumptions"]), row["id"]


OPS = Path(__file__).parent / "data" / "kernels" / "h100-torchtitan-ops.jsonl"
SHAPES = {"llama3-8b": (1, 8192), "llama2-13b": (2, 4096), "llama3-70b": (1, 8192)}
"""Local batch and sequence of each measured case (8,192 tokens each)."""
NODES = {
    # measured op(s): the nodes that price them, forward and backward
    ("rotary", "repeat_kv"): (("rope_q", "rope_k"), ("rope_q.grad_q", "rope_k.grad_k")),
    ("swiglu",): (("swiglu",), ("swiglu.grad_gate", "swiglu.grad_up")),
    ("rmsnorm",): (
        ("attention_norm",),
        ("attention_norm.grad_x", "attention_norm.grad_attention_norm.weight"),
    ),
    ("logits_loss",): (("cross_entropy",), ("cross_entropy.grad_logits",)),
}


def test_eager_kernels_against_the_h100_measurement(registry) -> None:  # type: ignore[no-untyped-def]
    """The profile's nodes on an H100 against the same ops timed on one
    (h100-torchtitan-ops.jsonl: torchtitan 1ea476e9f's expressions, forward and backward,
    PyTorch 2.11; benchmarks/measure_torchtitan_ops.py), at 8,192 tokens of three of the rows'
    models: every op within 10 %, forward and backward. Its kernels' classes were measured one
    by one on the same GPU (h100-torchtitan-kernels.jsonl), the ops as a whole were not fitted."""
    h100 = load_system("h100-80g")
    measured = {}
    for line in OPS.read_text().splitlines():
        row = json.loads(line)
        if "op" in row:
            measured[row["model"], row["op"]] = row
    for model, (batch, seq) in SHAPES.items():
        case = measured[model, "swiglu"]
        options = GenerateOptions(
            model="llama", dmodel=case["dim"], dff=case["ffn"], head=case["heads"],
            kvhead=case["kv_heads"], dvocal=case["vocab"], num_stacks=1, batch=batch, seq=seq,
            causal=True, profile="torchtitan", norm_type="rmsnorm",
        )  # fmt: skip
        nodes = {
            name.rsplit("/", 1)[-1]: n
            for name, n in _comp_nodes(options, registry).items()
            if "/layer0/" in name or "/head/" in name
        }
        for ops, phases in NODES.items():
            rows = [measured[model, op] for op in ops if (model, op) in measured]
            for names, key in zip(phases, ("forward_ms", "backward_ms"), strict=True):
                predicted = sum(
                    compute_time(nodes[n], h100, "bf16", None, "torchtitan") for n in names
                )
                observed = sum(r[key] for r in rows) / 1e3
                assert predicted == pytest.approx(observed, rel=0.10), (model, ops, key)
