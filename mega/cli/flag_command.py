"""Commands whose flags come from config dataclasses, parsed by mega (not click) the way
``mega train`` parses them: which flags exist can depend on a plugin named on the same line.

``@flag_command(name, help_sections)`` turns ``run(args, plugins)`` into a click command that
shows ``--help`` from the flag table and warns about plugins that failed to load, before ``run``
is called with the raw arguments (a clashing plugin name is refused where ``run`` looks it up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

HelpSections = Callable[[list[str], Any], tuple[str, dict[str, type]]]


def flag_help(intro: str, sections: dict[str, type]) -> str:
    """``intro``, then every flag of ``sections`` by section: aliases, choices, default, help."""
    from mega.core.config.flags import FlagTable

    table = FlagTable(sections)
    aliases: dict[str, list[str]] = {}
    for name, flag in table.by_flag.items():
        aliases.setdefault(flag.name, []).append(name)
    rows: list[tuple[str, str, str]] = []  # (section, names, help)
    for flag in table.by_key.values():
        names = ", ".join(aliases[flag.name])
        shown = ""
        if flag.base_type is not bool:  # switches take no value and show no default
            choices = flag.choices and "{" + ",".join(map(str, flag.choices)) + "}"
            names += " " + (choices or ("VALUE..." if flag.base_type is list else "VALUE"))
            if flag.default not in (None, []):
                shown = f" [default: {flag.default}]"
        rows.append((flag.section, names, flag.help + shown))
    width = min(max((len(names) for _, names, _ in rows), default=0), 44)
    lines, current = [intro], None
    for section, names, text in rows:
        if section != current:
            current = section
            lines += ["", f"{section}:"]
        lines.append(f"  {names:{width}s} {text}")
    return "\n".join(lines)


def warn_failed_plugins(plugins: Any) -> None:
    """One ``warning:`` line per plugin that failed to load (never fatal)."""
    for info in plugins.failures():
        click.echo(
            f"warning: plugin '{info.name}' ({info.dist}) failed to load: {info.error}", err=True
        )


def flag_command(
    name: str, help_sections: HelpSections, *, warn_failures: bool = True
) -> Callable[[Callable[[list[str], Any], None]], click.Command]:
    """Decorate ``run(args, plugins)``; its docstring's first line is the command's summary.
    ``help_sections(args, plugins)`` gives the help's intro and the flag sections to list.
    ``warn_failures=False``: ``run`` decides itself who warns (a job's ranks warn once)."""

    def decorate(run: Callable[[list[str], Any], None]) -> click.Command:
        @click.command(
            name,
            help=run.__doc__,
            context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
            add_help_option=False,
        )
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def command(args: tuple[str, ...]) -> None:
            from mega.cli import current_plugins

            args_list, plugins = list(args), current_plugins()
            if "--help" in args_list or "-h" in args_list:
                click.echo(flag_help(*help_sections(args_list, plugins)))
                return
            # no plugins.check(): a name two plugins registered is refused where it is looked up
            # (Registry.get), so a clash stops only the commands that use that name
            if warn_failures:
                warn_failed_plugins(plugins)
            run(args_list, plugins)

        return command

    return decorate
