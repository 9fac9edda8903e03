"""The ``mega`` command. Its subcommands arrive through the ``register_commands`` hook.

Bad input ends with one ``error: ...`` line per problem on stderr and exit code 2, no traceback;
a run that cannot go on ends with one ``error: ...`` line and exit code 1. In a job of several
processes the ranks other than 0 say ``[rank N] error: ...``, so a shared log shows whose it is.
"""

from __future__ import annotations

import os
import sys

import click

from mega.errors import MegaRunError, MegaUsageError, first_line, unknown_name_message


class MegaGroup(click.Group):
    """A click group that builds the plugin manager on first use and asks it for commands."""

    def __init__(self, *args, plugins=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._plugins = plugins

    def plugins(self):
        if self._plugins is None:
            from mega.core.plugins.manager import make_plugins

            self._plugins = make_plugins()
        return self._plugins

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self.plugins().commands.names()

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        commands = self.plugins().commands
        return commands.peek(name) if name in commands else None  # help lists even a clash

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0]
        if self.get_command(ctx, name) is None and not name.startswith("-"):
            raise MegaUsageError(unknown_name_message("command", name, self.list_commands(ctx)))
        self.plugins().commands.check_name(name)  # two plugins' `mega NAME`: run neither
        return super().resolve_command(ctx, args)


def make_cli(plugins=None) -> MegaGroup:
    """The root command; tests pass their own ``Plugins`` to avoid global state."""
    from mega import __version__

    @click.group(
        cls=MegaGroup, plugins=plugins, context_settings={"help_option_names": ["-h", "--help"]}
    )
    @click.version_option(__version__, prog_name="mega")
    def cli() -> None:
        """mega: train transformer language models the Megatron-LM way, with plugins.

        \b
        Quickstart (CPU, about 2.5 minutes on 2 cores):
          mega train --model gpt --save runs/quickstart
        """

    return cli


def current_plugins():
    """The Plugins object of the running ``mega`` command (from inside a subcommand)."""
    return click.get_current_context().find_root().command.plugins()


def _rank_prefix() -> str:
    """``"[rank N] "`` in a worker of a multi-process job whose rank is not 0 (RANK or
    SLURM_PROCID says so); rank 0 and a one-process run print unprefixed."""
    from mega.core.console.display import rank_prefix
    from mega.parallel.distributed import process_place

    try:
        place = process_place()
    except ValueError:  # a malformed launcher variable must not hide the error being reported
        return ""
    return rank_prefix(place.rank) if place.world_size > 1 else ""


def _launched_worker() -> bool:
    """Whether this process is a worker of ``mega train --nproc-per-node`` (never imported here
    just to ask: mega --help stays fast)."""
    launch = sys.modules.get("mega.cli.launch")
    return launch is not None and launch.is_launched_worker()


def main(argv: list[str] | None = None, plugins=None) -> None:
    """The ``mega`` command: every error becomes one ``error:`` line and an exit code
    (``plugins``: a given plugin manager instead of the installed plugins, as tests do)."""
    # torch.cuda.is_available() asks the CUDA driver unless this is set, and that spoils fork
    # for the launcher's workers ("Cannot re-initialize CUDA in forked subprocess") without
    # torch.cuda.is_initialized() saying so: set before any plugin loads, the check asks NVML,
    # so a plugin that asks at import (or mega itself) leaves the workers able to use CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    cli = make_cli(plugins)
    try:
        code = cli.main(args=argv, prog_name="mega", standalone_mode=False)
    except MegaUsageError as exc:
        prefix = _rank_prefix()
        if prefix and _launched_worker():
            # Bad input fails every rank alike (a --load that does not fit, say): rank 0's lines
            # say it. Hold this rank's copy back while the launcher stops the job on rank 0's exit
            # (this rank dies from its SIGTERM); a failure of this rank alone is still shown.
            from mega.cli.peers import wait_for_launcher

            wait_for_launcher()
        for message in exc.messages:
            click.echo(f"{prefix}error: {message}", err=True)
        sys.exit(2)
    except MegaRunError as exc:
        click.echo(f"{_rank_prefix()}error: {exc}", err=True)
        sys.exit(1)
    except click.UsageError as exc:
        click.echo(f"{_rank_prefix()}error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.Abort:
        sys.exit(130)
    except Exception as exc:
        from mega.cli.peers import lost_peer, wait_for_launcher

        if not lost_peer(exc):
            raise  # a bug: its traceback is what helps
        # Another rank failed or died, so this rank's collective broke: a consequence, not the
        # cause. Let the launcher name the rank that failed first, then say what happened here.
        wait_for_launcher()
        first = first_line(exc)
        click.echo(
            f"{_rank_prefix()}error: communication with the other ranks failed (another rank"
            f" has probably failed; its message says why): {first}",
            err=True,
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
