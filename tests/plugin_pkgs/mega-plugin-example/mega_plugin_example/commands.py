"""``mega example-hello``: a plugin command. It reads mega's registries through the running CLI."""

from __future__ import annotations

import click


@click.command("example-hello")
@click.option("--name", default="world", show_default=True, help="Who to greet.")
def example_hello(name: str) -> None:
    """Greet NAME and say which models this mega installation knows."""
    from mega.cli import current_plugins  # the Plugins object the `mega` command already built

    models = current_plugins().models.names()
    click.echo(f"Hello, {name}! mega knows {len(models)} models: {', '.join(models)}")
