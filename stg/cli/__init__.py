"""The stg command line.

Each built-in command (or command group) is one module ``stg/cli/<name>.py`` that defines
``app = typer.Typer(...)``; the module is imported only when its command runs or help is
shown. A module whose app has one command named like the module is that command
(``stg generate``); otherwise it is a group (``stg plugins list``). Plugins add commands
through the ``stg_register_commands`` hook. Data goes to stdout, messages to stderr; a
:class:`stg.errors.UserError` becomes one ``error: ...`` line on stderr and exit code 2, and
so does, as a last resort, an :class:`OSError` of :data:`stg.errors.WRITE_FAULTS` (a full disk,
a read-only file system, ...) that a writer let through.
"""

from __future__ import annotations

import gc
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import typer
import typer.main
from typer import _click
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer._click.globals import get_current_context
from typer.core import TyperCommand, TyperGroup

from stg.errors import UserError, is_write_fault

if TYPE_CHECKING:
    from rich.console import Console

    from stg.host.registry import Registry

PLUGINS_KEY = "stg.plugins"
REGISTRY_KEY = "stg.registry"
COMMAND_REGISTRY_KEY = "stg.command_registry"
LISTING_KEY = "stg.listing_commands"

COMMAND_SUMMARIES: dict[str, str] = {
    "bench": "PARAM-compatible benchmarks of this machine, and calibration of the predictors.",
    "convert": "Convert a trace (every rank file, plus the comm-group file) to another format.\n"
    "v0.0.4 <-> json is lossless; v0.0.1 drops what that schema cannot hold. Never overwrites\n"
    "a different trace without --force (re-running the same conversion is fine).",
    "feed": "Feed traces in dependency order and report issue statistics per rank.",
    "generate": "Generate the workload of one training iteration (or, with --phase, of serving:\n"
    "prefill, decode or a mixed batch) and write it as trace files.",
    "inspect": "Inspect traces, models and systems.",
    "plan": "Search plans: stg plan precision finds a per-op precision plan.",
    "plugins": "Inspect the loaded plugins.",
    "predict": "Predict iteration time (and MFU, exposed communication, bubble) and peak memory.",
    "search": "Find the fastest parallel plans that fit in memory (serving: the plans of most\n"
    "tokens per second within a latency limit).",
    "serve": "Simulate an inference cluster request by request.",
    "simulate": "Run ASTRA-sim on a trace and print each rank's finish time and exposed "
    "communication\nbeside stg predict's for the same trace and system.",
    "sweep": "Predict every configuration of a design space; write a results table.",
    "validate": "Check every rank file of a trace: ids, deps, cycles, attribute types, send/recv "
    "pairs,\ncollective sequences, the comm-group file and, by default, ASTRA-sim's consumption "
    "rules\n(--consumer). Exit 1 on any violation, 2 on unusable input (a file that is not a\n"
    "readable trace, a partial rank set, a --comm_group_file that is missing or not a\n"
    "comm-group file).",
}
"""The first paragraph of each built-in command's help, all that ``stg --help`` shows of it:
the list is made without importing the commands' modules (tests/test_light_start.py checks
this table against them)."""


@cache
def builtin_command_names() -> tuple[str, ...]:
    """Names of the built-in commands: one per module of ``stg.cli`` (``_x`` modules skipped)."""
    names = [
        info.name.replace("_", "-")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    return tuple(sorted(names))


def _builtin_command(name: str) -> _click.Command:
    module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
    sub_app: typer.Typer = module.app
    commands = sub_app.registered_commands
    if (
        sub_app.registered_callback is None
        and not sub_app.registered_groups
        and len(commands) == 1
        and _command_name(commands[0]) == name
    ):
        command = typer.main.get_command(sub_app)
    else:
        command = typer.main.get_group(sub_app)
    command.name = name
    return command


def _command_name(info: Any) -> str:
    if info.name:
        return str(info.name)
    return typer.main.get_command_name(info.callback.__name__)


def _prescan_plugins(args: Sequence[str]) -> list[str]:
    """The ``-p/--plugin`` values given before the command name."""
    found: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token in ("-p", "--plugin"):
            if i + 1 < len(args):
                found.append(args[i + 1])
            i += 2
            continue
        if token.startswith("--plugin="):
            found.append(token.split("=", 1)[1])
        elif token.startswith("-p") and not token.startswith("--"):
            found.append(token[2:])
        elif token == "--" or not token.startswith("-"):
            break
        i += 1
    return found


def _plugins_of(ctx: _click.Context) -> tuple[str, ...]:
    root = ctx.find_root()
    if PLUGINS_KEY in root.meta:
        return tuple(root.meta[PLUGINS_KEY])
    return tuple(root.params.get("plugin") or ())


def get_registry(ctx: _click.Context | None = None) -> Registry:
    """The plugin registry of this invocation (built-ins, entry points and ``-p`` modules).

    Loaded once per invocation; a ``-p`` module that fails to load is reported on stderr.
    """
    from stg.host.registry import SOURCE_COMMAND_LINE, load_registry

    root = (ctx or get_current_context()).find_root()
    registry = root.meta.get(REGISTRY_KEY)
    if registry is None:
        registry = load_registry(_plugins_of(root), reserved_commands=builtin_command_names())
        root.meta[REGISTRY_KEY] = registry
        for failure in registry.failures:
            if failure.source == SOURCE_COMMAND_LINE:
                typer.echo(
                    f"warning: plugin {failure.name!r} failed to load: {failure.error}",
                    err=True,
                )
    return registry


def _command_registry(ctx: _click.Context) -> Registry:
    """Plugins that may add commands (built-ins never do): skips importing the built-ins."""
    from stg.host.registry import load_registry

    root = ctx.find_root()
    registry: Registry | None = root.meta.get(REGISTRY_KEY) or root.meta.get(COMMAND_REGISTRY_KEY)
    if registry is None:
        registry = load_registry(
            _plugins_of(root), builtins=False, reserved_commands=builtin_command_names()
        )
        root.meta[COMMAND_REGISTRY_KEY] = registry
    return registry


def err_console() -> Console:
    """A rich console on stderr for messages, progress and summaries."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


def _fault_message(exc: OSError) -> str:
    """``PATH: No space left on device`` for a file system fault (the destination of a move)."""
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    reason = exc.strerror or str(exc)
    return reason if path is None else f"{path}: {reason}"


class StgGroup(TyperGroup):
    """The root group: lazy built-in commands, plugin commands, one-line errors."""

    def parse_args(self, ctx: _click.Context, args: list[str]) -> list[str]:
        ctx.meta[PLUGINS_KEY] = _prescan_plugins(args)
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: _click.Context) -> list[str]:
        names = list(super().list_commands(ctx))
        names += [n for n in builtin_command_names() if n not in names]
        names += [n for n in _command_registry(ctx).command_names() if n not in names]
        return names

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        if cmd_name in builtin_command_names():
            summary = COMMAND_SUMMARIES.get(cmd_name)
            if summary is not None and ctx.meta.get(LISTING_KEY):
                return TyperCommand(cmd_name, help=summary)  # listed, never run
            return _builtin_command(cmd_name)
        for entry in _command_registry(ctx).commands:
            if cmd_name in entry.item.names:
                return typer.main.get_group(entry.item.app).commands[cmd_name]
        return None

    def format_help(self, ctx: _click.Context, formatter: Any) -> None:
        ctx.meta[LISTING_KEY] = True  # the commands are listed from COMMAND_SUMMARIES
        try:
            super().format_help(ctx, formatter)
        finally:
            del ctx.meta[LISTING_KEY]

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        code = 0
        try:
            result = super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
            if isinstance(result, int) and not isinstance(result, bool):
                code = result
        except NoArgsIsHelpError as exc:
            if exc.message.strip():  # rich help is printed while the error is built
                typer.echo(exc.message)
        except UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            _fail(f"{exc.format_message().rstrip('.')}{where}")
            code = exc.exit_code
        except ClickException as exc:
            _fail(exc.format_message())
            code = exc.exit_code
        except UserError as exc:
            _fail(str(exc))
            code = 2
        except MemoryError:
            _fail(
                "out of memory: this run needs more memory than this machine gives it; lower "
                "--num_stacks, the number of micro-batches or the ranks"
            )
            code = 2
        except OSError as exc:
            if not is_write_fault(exc):
                raise
            _fail(_fault_message(exc))  # a writer missed it; it still is the place's fault
            code = 2
        except typer.Abort:
            _fail("aborted")
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=StgGroup,
    name="stg",
    help="Generate Chakra execution traces of distributed transformer training, "
    "read them back, and predict their time and memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from stg import __version__

        typer.echo(f"stg {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    plugin: list[str] = typer.Option(  # noqa: B008 (typer's declaration style)
        [],
        "-p",
        "--plugin",
        metavar="MODULE",
        help="Load an extra plugin module (repeatable), after the installed plugins.",
    ),
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print the version and exit.",
    ),
) -> None:
    """Generate Chakra execution traces of distributed transformer training."""


from stg.cli._shared import (  # noqa: E402
    allowed_values_in_help,
    light_coercion,
    plain_flags_in_help,
)

plain_flags_in_help()
allowed_values_in_help()
light_coercion()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the ``stg`` command line with ``argv`` (default: the process's arguments); ends
    with ``SystemExit``, as a click command does."""
    command = typer.main.get_command(app)
    command.main(args=argv, prog_name="stg")


def run() -> None:
    """Entry point of the ``stg`` script and of ``python -m stg``: :func:`main` in a process of
    its own. At its end the objects left are frozen out of the cyclic garbage collector
    (``gc.freeze``): the interpreter's last collection would walk every object that sympy,
    the registry and the models made, about 0.04 CPU s, to find nothing a process about to
    exit needs freed. Exit handlers and the flushing of output run as before."""
    try:
        main()
    finally:
        gc.freeze()


__all__ = ["app", "builtin_command_names", "err_console", "get_registry", "main", "run"]
