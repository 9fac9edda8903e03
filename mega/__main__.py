"""``python -m mega`` is the ``mega`` command."""

from mega.cli import main

main()
