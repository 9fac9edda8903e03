"""The built-in commands, registered like any plugin's (each command module is imported lazily)."""

from __future__ import annotations

from mega import hookimpl


@hookimpl
def register_commands(register):
    from mega.cli.plugins_command import plugins_command
    from mega.cli.train_command import train_command

    register(train_command)
    register(plugins_command)
