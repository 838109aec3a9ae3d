"""Valid plans that a fuzz of ``stg predict`` (from options, and on the trace ``stg generate``
writes for the same options) found refused, crashing or disagreeing: each must predict, the
same from its options as from its trace, or be refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.cli import main
from stg.perf.system import host_link_bandwidth, load_system, preset_names

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code, out, err = _run(capsys, "predict", *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STG_CACHE_DIR", "")


OFFLOAD = ("--model", "bert", "--dmodel", "256", "--head", "2", "--kvhead", "1", "--dhead", "16",
           "--dff", "256", "--dvocal", "128", "--seq", "512", "--num_stacks", "4",
           "--micro_batch", "2", "--batch", "6", "--cpu_offloading_num_layers", "1")  # fmt: skip


def test_every_system_preset_has_a_host_link() -> None:
    """CPU activation offload writes a trace that validates on any system; its copies are
    priced at the GPU's host link, which every preset's architecture now has (HGX B200/B300,
    AMD's, Ada's, Volta's and Turing's PCIe were missing: predict refused the plan)."""
    for name in preset_names():
        assert host_link_bandwidth(load_system(name)) > 0, name


@pytest.mark.parametrize("system", ["b200-180g", "mi300x-192g", "v100-32g"])
def test_cpu_offload_predicts_off_hopper_and_ampere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], system: str
) -> None:
    """``--cpu_offloading_num_layers 1 --system b200-180g`` was refused by predict ("no host
    link bandwidth is known") though generate wrote a trace that validates; it predicts now,
    from its options as from its trace, its copies at the PCIe rate."""
    report = _predict(capsys, *OFFLOAD, "--system", system)["time"]
    assert report["iteration_time_s"] > 0
    copy = report["ranks"][0]["host_copy_s"]
    assert copy > 0
    rate = host_link_bandwidth(load_system(system))
    out = tmp_path / "trace"
    code, _, err = _run(capsys, "generate", *OFFLOAD, "--output_dir", str(out))
    assert code == 0, err
    code, _, err = _run(capsys, "validate", str(out), "-j", "1")
    assert code == 0, err
    traced = _predict(capsys, str(out), "--system", system, "-j", "1")["time"]
    assert traced["iteration_time_s"] == pytest.approx(report["iteration_time_s"], rel=1e-2)
    # the same bytes at each system's rate: the copy time scales with 1/rate
    hopper = _predict(capsys, *OFFLOAD, "--system", "h100-80g")["time"]["ranks"][0]
    assert copy * rate == pytest.approx(hopper["host_copy_s"] * 64e9, rel=1e-9)


def test_a_periodic_replay_prints_no_negative_duration(capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline of 32 micro-batches replayed for its fill, one period and its drain: the
    last stage's exposed communication, 0 in every replayed micro-batch, was extrapolated to
    -6.3e-18 s (the rounding of the two replays' sums, times the periods); every duration of
    the breakdown is >= 0, and equal to the full replay's."""
    plan = ("--model", "llama", "--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff",
            "1024", "--dvocal", "1024", "--seq", "128", "--pp", "2", "--num_stacks", "4",
            "--batch", "64", "--micro_batch", "2", "--predictor", "time")  # fmt: skip
    fast = _predict(capsys, *plan)["time"]
    assert fast["replay"]["kind"] == "periodic"
    exact = _predict(capsys, *plan, "--exact")["time"]
    scale = exact["iteration_time_s"]
    for got, want in zip(fast["ranks"], exact["ranks"], strict=True):
        for key, value in want.items():
            if key.endswith("_s"):
                assert got[key] >= 0 and value >= 0, key
                assert got[key] == pytest.approx(value, abs=1e-9 * scale), key
    assert fast["ranks"][1]["exposed_communication_s"] == 0.0


def test_precision_plan_warnings_of_predict_are_warning_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A precision plan naming ops the model lacks (SwiGLU's gate, up, down on gpt): predict
    from options built its workloads inside the predictors, outside generate's warning
    capture, so Python printed ``.../pipeline.py:515: PrecisionPlanWarning: ...`` and the
    source line ``return _build_workload(...)`` (twice each), also before the one error line
    of a plan refused later. Now one ``warning:`` line per entry, as generate prints them."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ops": {"gate": "int8", "up": "int8", "down": "fp8"}}))
    args = ("--model", "gpt", "--dmodel", "128", "--head", "8", "--kvhead", "8", "--dff",
            "512", "--dvocal", "1024", "--seq", "128", "--num_stacks", "2",
            "--precision_plan", str(plan))  # fmt: skip
    expected = [
        f"warning: precision plan: op {op!r} matches no op of model 'gpt' and is ignored; "
        "known ops: attn_out, context, fc1, fc2, k, logits, q, scores, v"
        for op in ("gate", "up", "down")
    ]
    # memory alone builds no workload (closed forms): the plan is checked against the model
    for predictor in ("all", "time", "analytical", "memory"):
        code, out, err = _run(capsys, "predict", *args, "--predictor", predictor, "--json")
        assert code == 0, err
        assert json.loads(out)
        assert err.splitlines() == expected, predictor
    # refused after the predictors built the workloads: a system whose link gives no finite
    # time (tests/test_fuzzed_plans_predict.py); the warnings, then the one error line
    text = (DOCS / "systems.md").read_text(encoding="utf-8")
    system = json.loads(text.split("```json my-cluster.json", 1)[1].split("```", 1)[0])
    system["network"][0]["bandwidth_gbps"] = 5e-324
    slow = tmp_path / "tiny-bw.json"
    slow.write_text(json.dumps(system))
    code, out, err = _run(capsys, "predict", *args, "--dp", "2", "--system", str(slow))
    assert code == 2 and not out
    lines = err.splitlines()
    assert lines[:-1] == expected and lines[-1].startswith("error: "), err


SMALL = ("--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff", "512", "--dvocal", "1024",
         "--seq", "128", "--num_stacks", "2", "--batch", "4", "--tp", "2")  # fmt: skip


@pytest.mark.parametrize(
    "model",
    [("gpt",), ("moe",), ("deepseek", "--mtp_depth", "1"), ("llama", "--attention", "unfused")],
)
def test_op_level_checkpointing_predicts_for_every_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: tuple[str, ...]
) -> None:
    """``--activation_recompute selective_op`` on a model other than a Llama dense one (GPT,
    MoE, DeepSeek's latent attention, unfused attention, a precision plan) wrote a trace that
    validates, but predict refused it ("the memory of gpt's layers under torchtitan's op-level
    checkpointing is not modelled"). The memory of such layers now comes from their graph
    (stg.core.pipeline.op_checkpoint_saved_bytes): between full recompute's and none's, the
    same from the options as from the trace."""
    plan = ("--model", *model, *SMALL)
    kept = {}
    for mode in ("none", "selective_op", "full"):
        report = _predict(capsys, *plan, "--activation_recompute", mode)
        kept[mode] = report["memory"]["classes"][0]["activations"]
        assert report["time"]["iteration_time_s"] > 0
    assert kept["full"] < kept["selective_op"] < kept["none"]
    out = tmp_path / "trace"
    code, _, err = _run(capsys, "generate", *plan, "--activation_recompute", "selective_op",
                        "--output_dir", str(out))  # fmt: skip
    assert code == 0, err
    traced = _predict(capsys, str(out), "-j", "1")
    options = _predict(capsys, *plan, "--activation_recompute", "selective_op")
    assert traced["memory"]["peak_bytes"] == options["memory"]["peak_bytes"]
    assert traced["time"]["iteration_time_s"] == pytest.approx(
        options["time"]["iteration_time_s"], rel=1e-2
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tp": 2},
        {"tp": 2, "tpsp": False},
        {"profile": "eager"},
        {"dtype": "fp32"},
        {"attention_output_gate": True},
        {"sp": 2, "dhead": 48},
    ],
)
def test_the_graph_count_of_op_level_checkpointing_is_the_llama_closed_form(
    extra: dict[str, object],
) -> None:
    """The graph's count of what op-level checkpointing keeps (the layer input, the odd
    matmuls' outputs, a reduce-scatter's shard after a row-parallel one, the attention's
    output and log-sum-exp) equals the memory predictor's closed form of a Llama dense layer,
    which it replaces for the other layers."""
    from stg.core.options import GenerateOptions
    from stg.core.pipeline import build_workload
    from stg.host.registry import load_registry
    from stg.predictors.memory import op_checkpoint_layer_bytes

    o = GenerateOptions(
        model="llama", dvocal=1024, dmodel=256, dff=688, head=8, kvhead=4, seq=128, batch=8,
        micro_batch=4, num_stacks=2, activation_recompute="selective_op", **extra,
    )  # fmt: skip
    workload = build_workload(o, load_registry(autoload=False))
    facts = workload.rank_classes[0].facts["op_checkpoint_layer_bytes"]
    assert facts == {"block": op_checkpoint_layer_bytes(o)}


def test_precision_plan_with_module_recompute_is_refused_by_generate_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--activation_recompute selective --recompute_modules core_attn,mlp`` with a precision
    plan: generate wrote a trace that validates, predict refused it (the memory predictor
    models a plan's saved inputs under core_attn recompute only). Generation refuses it now,
    in one line naming the allowed values, where a layer's memory comes from the closed forms;
    a hybrid stack, whose layers' memory comes from their graph, still predicts."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ops": {"q": "fp16", "up": "fp16"}}))
    args = ("--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff", "512", "--dvocal",
            "1024", "--seq", "256", "--num_stacks", "2", "--batch", "4",
            "--activation_recompute", "selective", "--recompute_modules", "core_attn,mlp",
            "--precision_plan", str(plan))  # fmt: skip
    for command in (("generate", "--output_dir", str(tmp_path / "out")), ("predict",)):
        code, out, err = _run(capsys, *command, "--model", "llama", *args)
        assert not out
        lines = [line for line in err.splitlines() if not line.startswith("warning:")]
        assert code == 2, err
        assert len(lines) == 1 and "allowed: recompute_modules=core_attn" in lines[0], err
    assert not (tmp_path / "out").exists()
    report = _predict(capsys, "--model", "hybrid", "--layer_pattern", "*-", *args)
    assert report["memory"]["peak_bytes"] > 0


def test_precision_plan_warnings_of_predict_on_a_trace_are_warning_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stg predict DIR`` on a BERT trace generated with a plan naming ops BERT lacks: the
    memory predictor builds the workload of the options the trace records (BERT's head has
    no closed form), and Python printed its plan warnings with their source line. They are
    ``warning:`` lines now, once each, as from the options."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ops": {"gate": "int8"}}))
    out = tmp_path / "trace"
    args = ("--model", "bert", "--dmodel", "256", "--head", "4", "--kvhead", "4", "--dff",
            "512", "--dvocal", "128", "--seq", "128", "--num_stacks", "1", "--batch", "4",
            "--precision_plan", str(plan))  # fmt: skip
    code, _, err = _run(capsys, "generate", *args, "--output_dir", str(out))
    assert code == 0, err
    code, out_text, err = _run(capsys, "predict", str(out), "-j", "1", "--json")
    assert code == 0, err
    assert json.loads(out_text)["memory"]["peak_bytes"] > 0
    assert err.splitlines() == [
        "warning: precision plan: op 'gate' matches no op of model 'bert' and is ignored; "
        "known ops: attn_out, context, fc1, fc2, k, logits, mlm_dense, q, scores, v"
    ]


def test_a_presets_own_model_options_do_not_refuse_a_layer_pattern(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Nemotron-H's preset sets the Mamba layers' ssm_state; a ``layer_pattern`` without Mamba
    layers leaves it unread, which is no reason to refuse the plan. The same value given on
    the command line still is, and nothing of the preset's leaks into the trace's options."""
    plan = ("--model", "nemotron-h-8b", "--layer_pattern", "*-*-", "--num_stacks", "4",
            "--seq", "512", "--batch", "1")  # fmt: skip
    assert _predict(capsys, *plan, "--predictor", "time")["time"]["iteration_time_s"] > 0
    code, _, err = _run(capsys, "predict", *plan, "--ssm_state", "128")
    assert code == 2
    assert err.strip() == (
        "error: ssm_state=128 does not apply to model 'hybrid': none of its layers reads it "
        "(leave it unset)"
    )
    code, _, err = _run(capsys, "generate", *plan, "--output_dir", str(tmp_path))
    assert code == 0, err
    text = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.json"))
    assert "preset_fills" not in text


@pytest.mark.parametrize(
    "pattern",
    [("nemotron-h-8b", "*-"), ("qwen3-next-80b-a3b", "*E"), ("qwen3-next-80b-a3b", "GE"),
     ("llama4-scout", "M-")],
)  # fmt: skip
def test_a_trace_of_a_preset_with_its_own_pattern_predicts_as_its_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, pattern: tuple[str, str]
) -> None:
    """The trace records the preset's values that the chosen layers do not read
    (``linear_key_heads`` under ``*E``); ``stg predict DIR`` rebuilt the workload for its
    memory from them and refused them as if given. Same figures as from the options now."""
    model, layers = pattern
    plan = ("--model", model, "--layer_pattern", layers, "--num_stacks", "2", "--seq", "256",
            "--batch", "1")  # fmt: skip
    code, _, err = _run(capsys, "generate", *plan, "--output_dir", str(tmp_path))
    assert code == 0, err
    from_trace = _predict(capsys, str(tmp_path))
    from_options = _predict(capsys, *plan)
    time = from_trace["time"]["iteration_time_s"]
    assert time == pytest.approx(from_options["time"]["iteration_time_s"], rel=1e-9)
    assert from_trace["memory"]["classes"] == from_options["memory"]["classes"]
