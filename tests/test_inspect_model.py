"""`stg inspect model`: closed forms of a model template."""

from __future__ import annotations

import json

import sympy
from typer.testing import CliRunner

from stg.cli import app
from stg.core.modelinfo import describe_model
from stg.core.options import GenerateOptions
from stg.core.pipeline import symbol_values
from stg.core.symbolic import Dff, Dmodel, Dvocal, Seq
from stg.host.registry import load_registry

runner = CliRunner()


def test_gpt_parameters_are_narayanans_plus_the_untied_head():
    o = GenerateOptions(dvocal=51200, dmodel=2048, dff=8192, seq=2048, head=16, num_stacks=24)
    report = describe_model(load_registry().models.get("gpt"), o, symbol_values(o))
    L, h, V, s = 24, 2048, 51200, 2048
    narayanan = (
        12 * L * h * h * (1 + sympy.Rational(13, 12 * h) + sympy.Rational(V + s, 12 * L * h))
    )
    # the LM head has its own V·h weights and the final LayerNorm 2h (docs/generation.md)
    assert report["totals"]["parameters"] == narayanan + V * h + 2 * h
    block = sympy.sympify(
        report["parts"]["block"]["parameters"]["expression"], locals={"dff": Dff, "dmodel": Dmodel}
    )
    assert sympy.expand(block.subs(Dff, 4 * Dmodel) - (12 * Dmodel**2 + 13 * Dmodel)) == 0


def test_block_forward_matmuls_match_the_closed_form():
    o = GenerateOptions(
        dvocal=1000, dmodel=256, dff=1024, seq=128, head=8, num_stacks=2, batch=2, micro_batch=2
    )
    report = describe_model(load_registry().models.get("gpt"), o, symbol_values(o))
    b, s, h, F = 2, 128, 256, 1024
    forward = report["parts"]["block"]["forward_flops"]["value"]
    matmuls = 2 * b * s * (4 * h * h + 2 * h * F) + 4 * b * s * s * h
    elementwise = forward - matmuls
    assert 0 < elementwise < 0.05 * matmuls
    head = report["parts"]["head"]["forward_flops"]["value"]
    assert 0 < head - 2 * b * s * h * 1000 < 0.02 * head  # + LayerNorm and cross-entropy


def test_cli_json_and_dot(tmp_path):
    dot = tmp_path / "block.dot"
    result = runner.invoke(
        app,
        [
            "inspect",
            "model",
            "llama",
            "--dmodel",
            "512",
            "--head",
            "8",
            "--kvhead",
            "2",
            "--dff",
            "1024",
            "--json",
            "--dot",
            str(dot),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["parts"]) == {"embedding", "block", "head"}
    assert report["parts"]["embedding"]["parameters"]["expression"] == str(Dmodel * Dvocal)
    text = dot.read_text()
    assert text.startswith('digraph "block"') and "->" in text and "einsum" in text
    assert str(Seq) in report["parts"]["block"]["forward_flops"]["expression"]


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    for args in (["inspect", "model", "nope"], ["inspect", "model", "gpt", "--head", "7"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2
        assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error:")
