"""``mega plugins``: every plugin, its distribution, version, what it registers and which other
hooks it implements (the lifecycle hooks, ``validate_config``...): without them a plugin such as
mega's own metrics sinks, which registers nothing, would show as doing nothing."""

from __future__ import annotations

import json

import click


def implemented_hooks(plugins) -> dict[str, list[str]]:
    """Plugin name -> the hooks it implements besides the ``register_*`` ones, by name."""
    hooks: dict[str, list[str]] = {}
    for name, caller in vars(plugins.pm.hook).items():
        if caller.has_spec() and not name.startswith("register_"):
            for impl in caller.get_hookimpls():
                hooks.setdefault(impl.plugin_name, []).append(name)
    return hooks


def plugin_rows(plugins) -> list[dict]:
    hooks = implemented_hooks(plugins)
    return [
        {
            "name": info.name,
            "distribution": info.dist,
            "version": info.version,
            "builtin": info.builtin,
            "module": info.module,
            "registers": info.registers,
            "hooks": hooks.get(info.name, []) if info.error is None else [],
            "error": info.error,
        }
        for info in plugins.infos
    ]


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print the same information as JSON.")
def plugins_command(as_json: bool) -> None:
    """List installed plugins and what each one registers."""
    from mega.cli import current_plugins

    plugins = current_plugins()
    rows = plugin_rows(plugins)
    if as_json:
        click.echo(json.dumps({"plugins": rows, "problems": plugins.problems}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mega plugins")
    for column in ("plugin", "distribution", "version", "registers"):
        table.add_column(column)
    for row in rows:
        registers = "\n".join(f"{k}: {', '.join(v)}" for k, v in row["registers"].items())
        if row["hooks"]:
            registers += ("\n" if registers else "") + f"hooks: {', '.join(row['hooks'])}"
        if row["error"]:
            registers = f"[red]failed to load: {row['error']}[/red]"
        table.add_row(row["name"], row["distribution"], row["version"], registers or "-")
    console = Console()
    if not console.is_terminal:  # a pipe or a file has no width to fit: keep every cell whole
        natural = Console(width=100_000).measure(table).maximum
        console = Console(width=max(console.width, natural))
    console.print(table)
    for problem in plugins.problems:
        console.print(f"[red]problem:[/red] {problem}")
