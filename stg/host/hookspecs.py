"""The hooks a plugin may implement. Each is prefixed ``stg_`` and takes a ``register`` callable.

A plugin is a module (or any object) with functions marked ``@stg.hookimpl``; it is found
through the entry-point group ``stg``, or named on the command line with ``stg -p module``.
Registration hooks receive one argument, ``register``: call it once per record. The record
types live in :mod:`stg.host.records` and are checked when registered, so a mistake is reported at
load time with the plugin's name (``stg plugins list`` shows it) instead of failing later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import typer

    from stg.host.records import (
        BenchOp,
        Emitter,
        Kernel,
        Model,
        PipelineSchedule,
        Predictor,
        Preset,
    )

hookspec = pluggy.HookspecMarker("stg")
"""Marker for hook specifications of the ``stg`` project."""


@hookspec
def stg_register_models(register: Callable[[Model], None]) -> None:
    """Register model templates (:class:`stg.host.records.Model`).

    Example::

        @stg.hookimpl
        def stg_register_models(register):
            register(Model(name="tiny", embedding=embed, block=block, head=head,
                           aliases=("tiny-lm",)))
    """


@hookspec
def stg_register_presets(register: Callable[[Preset], None]) -> None:
    """Register named configurations of models (:class:`stg.host.records.Preset`): ``--model
    NAME`` then fills the preset's dimensions, and options given explicitly override them.

    Example::

        @stg.hookimpl
        def stg_register_presets(register):
            register(Preset(name="tiny-7m", model="tiny",
                            dims={"dmodel": 256, "num_stacks": 8, "head": 8, "kvhead": 8},
                            source="Doe et al. 2025, Table 2", published_parameters=7.1e6))

    Presets kept as data, a TOML file of ``[[preset]]`` tables that the plugin ships, are
    read by :func:`stg.api.load_presets` (docs/presets.md, "Presets as data")::

        @stg.hookimpl
        def stg_register_presets(register):
            for preset in load_presets(files("my_plugin") / "presets.toml"):
                register(preset)
    """


@hookspec
def stg_register_parallelisms(register: Callable[[PipelineSchedule], None]) -> None:
    """Register pipeline schedules (:class:`stg.host.records.PipelineSchedule`).

    Example::

        @stg.hookimpl
        def stg_register_parallelisms(register):
            register(PipelineSchedule(name="all-forward-first", order=gpipe_order))
    """


@hookspec
def stg_register_kernels(register: Callable[[Kernel], None]) -> None:
    """Register kernels: per-op precision and cost overrides (:class:`stg.host.records.Kernel`).

    Example::

        @stg.hookimpl
        def stg_register_kernels(register):
            register(Kernel(name="int8-gemm", op_class="einsum", dtype="int8", speedup=2.0))
    """


@hookspec
def stg_register_emitters(register: Callable[[Emitter], None]) -> None:
    """Register output formats (:class:`stg.host.records.Emitter`).

    Example::

        @stg.hookimpl
        def stg_register_emitters(register):
            register(Emitter(name="csv", write=write_csv, extension=".csv"))
    """


@hookspec
def stg_register_predictors(register: Callable[[Predictor], None]) -> None:
    """Register predictors of time and memory (:class:`stg.host.records.Predictor`).

    Example::

        @stg.hookimpl
        def stg_register_predictors(register):
            register(Predictor(name="flops-only", predict=predict_flops))
    """


@hookspec
def stg_register_bench_ops(register: Callable[[BenchOp], None]) -> None:
    """Register operators for ``stg bench compute`` (:class:`stg.host.records.BenchOp`), as
    PARAM's operator registry does: a config names them like the built-in ``torch.mm``.

    Example::

        @stg.hookimpl
        def stg_register_bench_ops(register):
            register(BenchOp(name="mylib.scaled_add", function="mylib.ops.scaled_add",
                             op_class="stream", nbytes=lambda config: 3 * 4 * 1024))
    """


@hookspec
def stg_register_commands(app: typer.Typer) -> None:
    """Add commands to the ``stg`` command line: ``app`` is a :class:`typer.Typer`.

    Commands go to stdout for data and stderr for messages; raise
    :class:`stg.errors.UserError` for bad input (the CLI prints one line and exits 2).

    Example::

        @stg.hookimpl
        def stg_register_commands(app):
            @app.command()
            def hello(name: str = "world") -> None:
                print(f"hello {name}")
    """
